//! Real servers on ephemeral loopback ports, chained by the real `corolla`
//! binary through the DHT.

use std::time::{Duration, Instant};

use corolla_server::RunningServer;
use corolla_tests::{corolla_bin, start_server, tiny_llama, Golden};
use serde_json::Value;

const UPDATE_PERIOD_SECS: u64 = 2;

async fn start(blocks: &str, join: Option<&RunningServer>) -> RunningServer {
    let period = format!("{UPDATE_PERIOD_SECS}s");
    let join = join.map(|first| first.tcp_addr().expect("tcp address").to_string());
    start_server(
        blocks,
        join.as_deref(),
        &["--update-period", &period, "--inference-max-length", "256"],
    )
    .await
}

/// The first server's TCP multiaddr, as the CLI takes it.
fn bootstrap(servers: &[RunningServer]) -> String {
    servers[0].tcp_addr().expect("tcp address").to_string()
}

async fn corolla(args: &[&str]) -> Value {
    let out = tokio::process::Command::new(corolla_bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run corolla");
    assert!(
        out.status.success(),
        "corolla {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

async fn generate(extra: &[&str]) -> Value {
    let model = tiny_llama();
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--json",
        "--max-new-tokens",
        "32",
    ];
    args.extend_from_slice(extra);
    corolla(&args).await
}

async fn three_servers() -> Vec<RunningServer> {
    let first = start("0:1", None).await;
    let second = start("1:3", Some(&first)).await;
    let third = start("3:4", Some(&first)).await;
    // The CLI's one lookup must find all three: on two cores shared with
    // other tests an announcement can lag the server's start.
    let watcher =
        corolla_client::network::connect(&[first.tcp_addr().expect("tcp address").clone()])
            .await
            .expect("a client of the swarm");
    crate::trust::until_servers(&watcher, 3).await;
    vec![first, second, third]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_server_chain_generates_the_reference_tokens() {
    let servers = three_servers().await;
    let peers = bootstrap(&servers);
    let golden = Golden::load(&tiny_llama(), "float32");
    for prompt in &golden.prompts {
        let out = generate(&["--initial-peers", &peers, "--prompt", &prompt.prompt]).await;
        let ids: Vec<u32> = serde_json::from_value(out["generated_ids"].clone()).unwrap();
        assert_eq!(ids, prompt.generated_new_ids, "prompt {:?}", prompt.prompt);
        let route = out["route"].as_array().expect("route");
        let hops: Vec<(String, u64, u64)> = route
            .iter()
            .map(|h| {
                (
                    h["peer_id"].as_str().unwrap().to_string(),
                    h["start"].as_u64().unwrap(),
                    h["end"].as_u64().unwrap(),
                )
            })
            .collect();
        let expected: Vec<(String, u64, u64)> = servers
            .iter()
            .map(|s| {
                (
                    s.peer_id().to_string(),
                    s.blocks().0 as u64,
                    s.blocks().1 as u64,
                )
            })
            .collect();
        assert_eq!(hops, expected);
    }

    let prompt = &golden.prompts[1].prompt;
    let sampling = [
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--seed",
        "1234",
        "--prompt",
        prompt,
    ];
    let local = generate(&[&["--local"], &sampling[..]].concat()).await;
    // Sampled draws equal the local run's only where the wire carries what
    // the local run computes: f32 (f16 moves probabilities by ~1e-3, enough
    // to flip a draw near a boundary).
    let swarm = generate(
        &[
            &["--initial-peers", &peers, "--wire-dtype", "f32"],
            &sampling[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(swarm["generated_ids"], local["generated_ids"]);
    assert_ne!(
        serde_json::from_value::<Vec<u32>>(local["generated_ids"].clone()).unwrap(),
        golden.prompts[1].generated_new_ids,
        "sampling should differ from greedy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_swarm_view_shows_coverage_and_forgets_a_dead_server() {
    let mut servers = three_servers().await;
    let peers = bootstrap(&servers);
    let model = tiny_llama();
    let swarm = || async {
        corolla(&[
            "swarm",
            "--initial-peers",
            &peers,
            "--model",
            model.to_str().unwrap(),
            "--json",
            "--discovery-timeout",
            "5",
        ])
        .await
    };
    // Announcements propagate within moments; wait for all three.
    let deadline = Instant::now() + Duration::from_secs(20);
    let view = loop {
        let view = swarm().await;
        if view["servers"].as_array().unwrap().len() == 3 || Instant::now() > deadline {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(view["complete"], true, "{view}");
    assert_eq!(view["servers"].as_array().unwrap().len(), 3, "{view}");
    assert_eq!(view["gaps"], serde_json::json!([]));

    // Entries live two update periods after the last announcement; the slack
    // covers the time one `corolla swarm` run takes on a loaded machine.
    let dead = servers.pop().unwrap();
    let dead_id = dead.peer_id().to_string();
    let killed = Instant::now();
    dead.shutdown();
    let view = loop {
        let view = swarm().await;
        let listed = view["servers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["peer_id"] == dead_id.as_str());
        if !listed {
            break view;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(2 * UPDATE_PERIOD_SECS + 5),
            "the dead server is still listed after {:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let gone_after = killed.elapsed();
    println!("dead server gone from the DHT after {gone_after:?}");
    assert!(gone_after <= Duration::from_secs(2 * UPDATE_PERIOD_SECS + 5));
    assert_eq!(view["complete"], false);
    assert_eq!(view["gaps"], serde_json::json!([[3, 4]]));
}

/// Llama 3, Qwen2, Mistral, Qwen3, Mixtral and Qwen3-MoE (tests/fixtures/families) through three
/// servers of one block each: the text prompt's ids and the 24 greedy tokens
/// are transformers' (tests/reference/families_reference.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_family_through_three_servers_generates_what_transformers_generates() {
    let golden: Value = serde_json::from_slice(
        &std::fs::read(corolla_tests::fixtures_dir().join("families/golden.json")).unwrap(),
    )
    .unwrap();
    for family in [
        "llama3",
        "qwen2",
        "mistral",
        "qwen3",
        "mixtral",
        "qwen3_moe",
    ] {
        let model = corolla_tests::fixtures_dir().join("families").join(family);
        let flags = ["--update-period", "2s", "--inference-max-length", "256"];
        let first = corolla_tests::start_model_server(&model, "0:1", None, &flags).await;
        let peers = bootstrap(std::slice::from_ref(&first));
        let second = corolla_tests::start_model_server(&model, "1:2", Some(&peers), &flags).await;
        let third = corolla_tests::start_model_server(&model, "2:3", Some(&peers), &flags).await;
        let run = &golden["families"][family][0];
        let out = corolla(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--json",
            "--max-new-tokens",
            "24",
            "--initial-peers",
            &peers,
            "--prompt",
            run["prompt"].as_str().unwrap(),
        ])
        .await;
        assert_eq!(out["prompt_ids"], run["prompt_ids"], "{family}");
        assert_eq!(out["generated_ids"], run["generated_ids"], "{family}");
        assert_eq!(
            out["route"].as_array().map(Vec::len),
            Some(3),
            "{family}: {out}"
        );
        for server in [first, second, third] {
            server.shutdown();
        }
    }
}

/// The step count the CLI's JSON reports as pushed down the whole route.
fn pushed_steps(out: &Value) -> u64 {
    out["pushed_steps"]
        .as_u64()
        .expect("pushed_steps in the JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_push_to_each_other_and_the_tokens_stay_the_reference() {
    let servers = three_servers().await;
    let peers = bootstrap(&servers);
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = &golden.prompts[0];
    for wire in ["f32", "f16"] {
        let common = [
            "--initial-peers",
            &peers,
            "--prompt",
            &prompt.prompt,
            "--wire-dtype",
            wire,
        ];
        let pushed = generate(&common).await;
        let carried = generate(&[&common[..], &["--no-push"]].concat()).await;
        for (label, out) in [("push", &pushed), ("no push", &carried)] {
            let ids: Vec<u32> = serde_json::from_value(out["generated_ids"].clone()).unwrap();
            assert_eq!(ids, prompt.generated_new_ids, "{label}, {wire} on the wire");
        }
        // Every forward call (the prefill and each step) went by push.
        let calls = pushed["steps"].as_u64().map_or(32, |steps| steps + 1);
        assert_eq!(pushed_steps(&pushed), calls, "{wire}: {pushed}");
        assert_eq!(pushed_steps(&carried), 0, "{wire}: {carried}");
    }
}
