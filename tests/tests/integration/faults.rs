//! Servers dying mid-answer: the client replays to replacements and the
//! answer comes out token-identical; routing prefers fast servers and obeys
//! the user's block list.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_client::{generate, GenerateRequest, LocalChain, RemoteChain, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::node::NodeHandle;
use corolla_shared::WireDType;
use corolla_tests::{corolla_bin, greedy, start_server, tiny_llama, Golden};

const SPANS: [&str; 3] = ["0:1", "1:3", "3:4"];

async fn start(blocks: &str, join: Option<&str>, extra: &[&str]) -> RunningServer {
    let flags = ["--update-period", "1s", "--inference-max-length", "128"];
    start_server(blocks, join, &[&flags[..], extra].concat()).await
}

fn addr(server: &RunningServer) -> String {
    server.tcp_addr().unwrap().to_string()
}

/// Two replicas of every span; `slow` adds a step delay to the middle span's servers.
async fn six_servers(slow_ms: u64) -> Vec<RunningServer> {
    let delay = slow_ms.to_string();
    let first = start(SPANS[0], None, &[]).await;
    let boot = addr(&first);
    let mut servers = vec![first];
    for (i, span) in SPANS.iter().enumerate() {
        for replica in 0..2 {
            if i == 0 && replica == 0 {
                continue;
            }
            let extra: Vec<&str> = if i == 1 {
                vec!["--step-delay-ms", &delay]
            } else {
                vec![]
            };
            servers.push(start(span, Some(&boot), &extra).await);
        }
    }
    servers
}

fn settings(max_length: usize) -> SessionSettings {
    let mut s = SessionSettings::new("tiny-llama-a", 4, max_length, WireDType::F32);
    s.expected_blocks = Some(block_hashes(&Checkpoint::open(tiny_llama()).unwrap(), 0, 4).unwrap());
    s.timeout = Duration::from_secs(10);
    s.discovery_timeout = Duration::from_secs(20);
    s
}

async fn chain_covering(
    node: &NodeHandle,
    settings: SessionSettings,
    servers: usize,
) -> RemoteChain {
    // Wait until every server is announced, so that routes are chosen among all.
    for _ in 0..100 {
        if node
            .discover("tiny-llama-a", Duration::from_secs(5))
            .await
            .unwrap()
            .len()
            >= servers
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    RemoteChain::connect(node, settings, &Device::Cpu)
        .await
        .unwrap()
}

/// Six servers (see [`six_servers`]), a greedy 32-token request for
/// `prompt` and a chain over all of them; the last item is the peer id of
/// the server the chain uses for the middle span.
async fn answer_through_six(
    slow_ms: u64,
    prompt: &corolla_tests::GoldenPrompt,
) -> (
    Arc<Mutex<Vec<RunningServer>>>,
    GenerateRequest,
    RemoteChain,
    String,
) {
    let servers = Arc::new(Mutex::new(six_servers(slow_ms).await));
    let boot = addr(&servers.lock().unwrap()[0]);
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    // One chain step per token (no drafts), so "killed after token k" is step k.
    let request = GenerateRequest {
        drafts: 0,
        ..greedy(prompt.input_ids.clone(), 32)
    };
    let chain = chain_covering(&node, settings(request.max_length()), 6).await;
    let victim = chain
        .route()
        .into_iter()
        .find(|h| h.start == 1)
        .unwrap()
        .peer_id;
    (servers, request, chain, victim)
}

fn head() -> ClientHead {
    ClientHead::load(
        &Checkpoint::open(tiny_llama()).unwrap(),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_middle_server_after_token_k_changes_nothing() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = &golden.prompts[0];
    let head = head();
    // k = None: killed while the prompt's prefill is in flight.
    for k in [None, Some(1), Some(13), Some(31)] {
        let slow = if k.is_none() { 400 } else { 0 };
        let (servers, request, mut chain, victim) = answer_through_six(slow, prompt).await;
        let kill = {
            let servers = servers.clone();
            let victim = victim.clone();
            move || {
                let mut all = servers.lock().unwrap();
                let i = all
                    .iter()
                    .position(|s| s.peer_id().to_string() == victim)
                    .unwrap();
                all.remove(i).shutdown();
            }
        };
        let killer = if k.is_none() {
            let kill = kill.clone();
            Some(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                kill();
            }))
        } else {
            None
        };
        let mut generated = 0;
        let out = generate(&head, &mut chain, &request, |_| {
            generated += 1;
            if Some(generated) == k {
                kill();
            }
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap();
        if let Some(killer) = killer {
            killer.await.unwrap();
        }
        assert_eq!(
            out.generated_ids, prompt.generated_new_ids,
            "killed after token {k:?}"
        );
        let recoveries = chain.recoveries();
        assert_eq!(recoveries.len(), 1, "{recoveries:?}");
        let r = &recoveries[0];
        assert_eq!(r.failed_peer, victim);
        assert_eq!((r.start, r.end, r.step), (1, 3, k.unwrap_or(0)));
        assert_eq!(r.replacement.len(), 1);
        assert_ne!(r.replacement[0].peer_id, victim);
        println!("killed after token {k:?}: recovered in {:.3} s", r.seconds);
        chain.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_recovers_onto_a_server_that_joined_during_the_answer() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = golden.prompts[1].clone();
    let first = start("0:1", None, &[]).await;
    let boot = addr(&first);
    let middle = start("1:3", Some(&boot), &["--step-delay-ms", "100"]).await;
    let last = start("3:4", Some(&boot), &[]).await;
    let model = tiny_llama();
    let cli = tokio::process::Command::new(corolla_bin())
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--initial-peers",
            &boot,
            "--json",
        ])
        .args([
            "--max-new-tokens",
            "32",
            "--prompt",
            &prompt.prompt,
            "--step-timeout",
            "10",
        ])
        .env("RUST_LOG", "error")
        .output();
    let watcher = connect(&[boot.parse().unwrap()]).await.unwrap();
    let chaos = async {
        // Strike once the answer is under way: the middle server has a session
        // and has served a few steps (100 ms each).
        let mut control = watcher.control();
        for _ in 0..600 {
            let info = corolla_shared::session::fetch_info(
                &mut control,
                middle.peer_id(),
                Duration::from_secs(5),
            )
            .await;
            if info.is_ok_and(|r| r.sessions > 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let replacement = start("1:3", Some(&boot), &[]).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let victim = middle.peer_id().to_string();
        middle.shutdown();
        (victim, replacement)
    };
    let (out, (victim, replacement)) = tokio::join!(cli, chaos);
    let out = out.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = serde_json::from_value(json["generated_ids"].clone()).unwrap();
    assert_eq!(ids, prompt.generated_new_ids);
    let recoveries = json["recoveries"].as_array().unwrap();
    assert_eq!(recoveries.len(), 1, "{json}");
    assert_eq!(recoveries[0]["failed_peer"], victim.as_str());
    assert_eq!(
        recoveries[0]["replacement"][0]["peer_id"],
        replacement.peer_id().to_string().as_str()
    );
    assert!(recoveries[0]["step"].as_u64().unwrap() > 0);
    drop((first, last, replacement));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_avoid_slow_and_blocked_servers() {
    let first = start("0:1", None, &[]).await;
    let boot = addr(&first);
    let slow = start("1:3", Some(&boot), &["--step-delay-ms", "200"]).await;
    let fast = start("1:3", Some(&boot), &[]).await;
    let last = start("3:4", Some(&boot), &[]).await;
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    let middle = |chain: &RemoteChain| {
        chain
            .route()
            .into_iter()
            .find(|h| h.start == 1)
            .unwrap()
            .peer_id
    };

    let chain = chain_covering(&node, settings(64), 4).await;
    assert_eq!(
        middle(&chain),
        fast.peer_id().to_string(),
        "the fast replica"
    );
    chain.close().await;

    let mut blocked = settings(64);
    blocked.blocked_servers = HashSet::from([fast.peer_id().to_string()]);
    let chain = chain_covering(&node, blocked, 4).await;
    assert_eq!(
        middle(&chain),
        slow.peer_id().to_string(),
        "the fast one is blocked"
    );
    chain.close().await;

    let mut allowed = settings(64);
    allowed.allowed_servers = Some(
        [&first, &slow, &last]
            .iter()
            .map(|s| s.peer_id().to_string())
            .collect(),
    );
    let chain = chain_covering(&node, allowed, 4).await;
    assert_eq!(
        middle(&chain),
        slow.peer_id().to_string(),
        "only allowed servers"
    );
    chain.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_every_session_completes_token_identical() {
    const SESSIONS: u64 = 50;
    const NEW_TOKENS: usize = 12;
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = golden.prompts[1].input_ids.clone();
    let head = head();
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let whole = [BlockSpan::load(&ck, 0, 4, DType::F32, &Device::Cpu).unwrap()];
    let request = |seed: u64| GenerateRequest {
        prompt_ids: prompt.clone(),
        max_new_tokens: NEW_TOKENS,
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: Some(0.95),
            seed,
            ..Default::default()
        },
        stop_at_eos: false,
        drafts: corolla_client::DEFAULT_DRAFTS,
    };
    let mut expected = Vec::new();
    for seed in 0..SESSIONS {
        let mut local = LocalChain::new(&whole, request(seed).max_length()).unwrap();
        let out = generate(&head, &mut local, &request(seed), |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap();
        expected.push(out.generated_ids);
    }

    let servers = Arc::new(Mutex::new(six_servers(0).await));
    let boot = addr(&servers.lock().unwrap()[0]);
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Kill a random server whose span has another live replica, then start a
    // new one for that span; bounded in count and time.
    let chaos = {
        let servers = servers.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let mut kills = 0u32;
            let mut rng = 0x2545_f491_4f6c_dd1du64;
            let started = Instant::now();
            while !done.load(std::sync::atomic::Ordering::Relaxed)
                && kills < 25
                && started.elapsed() < Duration::from_secs(120)
            {
                tokio::time::sleep(Duration::from_millis(250)).await;
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let (span, join) = {
                    let mut all = servers.lock().unwrap();
                    let i = (rng % all.len() as u64) as usize;
                    let span = all[i].blocks();
                    if all.iter().filter(|s| s.blocks() == span).count() < 2 {
                        continue;
                    }
                    all.remove(i).shutdown();
                    let join = addr(&all[0]);
                    (span, join)
                };
                kills += 1;
                let fresh = start(&format!("{}:{}", span.0, span.1), Some(&join), &[]).await;
                servers.lock().unwrap().push(fresh);
            }
            kills
        })
    };

    let (mut recoveries, mut mismatches) = (0, 0);
    for seed in 0..SESSIONS {
        let mut s = settings(request(seed).max_length());
        s.max_retries = 20;
        let mut chain = match RemoteChain::connect(&node, s, &Device::Cpu).await {
            Ok(c) => c,
            Err(e) => {
                let found = node.discover("tiny-llama-a", Duration::from_secs(5)).await;
                let live: Vec<_> = servers
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|s| (s.peer_id().to_string(), s.blocks()))
                    .collect();
                panic!("session {seed}: no route ({e}); the DHT lists {found:?}; alive: {live:?}");
            }
        };
        let out = generate(&head, &mut chain, &request(seed), |_| {
            std::thread::sleep(Duration::from_millis(10));
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap_or_else(|e| panic!("session {seed} failed: {e}"));
        recoveries += chain.recoveries().len();
        if out.generated_ids != expected[seed as usize] {
            mismatches += 1;
        }
        chain.close().await;
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let kills = chaos.await.unwrap();
    println!("chaos: {SESSIONS} sessions, {kills} kills, {recoveries} recoveries, {mismatches} mismatches");
    assert_eq!(mismatches, 0);
    assert!(kills >= 5, "too few kills ({kills}) to mean anything");
    assert!(recoveries >= 1, "no session met a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_leaving_mid_answer_hands_its_sessions_over_at_once() {
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = &golden.prompts[0];
    let head = head();
    let (servers, request, mut chain, victim) = answer_through_six(0, prompt).await;
    let leaving: Arc<Mutex<Option<tokio::task::JoinHandle<Duration>>>> = Arc::default();
    let mut generated = 0;
    let out = generate(&head, &mut chain, &request, |_| {
        generated += 1;
        if generated == 13 {
            let mut all = servers.lock().unwrap();
            let i = all
                .iter()
                .position(|s| s.peer_id().to_string() == victim)
                .unwrap();
            let server = all.remove(i);
            *leaving.lock().unwrap() = Some(tokio::spawn(async move {
                let started = Instant::now();
                server.leave().await;
                started.elapsed()
            }));
        }
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap();
    assert_eq!(out.generated_ids, prompt.generated_new_ids);
    let recoveries = chain.recoveries().to_vec();
    assert_eq!(recoveries.len(), 1, "{recoveries:?}");
    let r = &recoveries[0];
    assert_eq!(r.failed_peer, victim);
    assert!(
        r.error.contains("shutting down"),
        "the client was not told the server leaves: {}",
        r.error
    );
    // No step timeout was waited out (the settings' timeout is 10 s).
    assert!(r.seconds < 2.0, "recovery took {:.3} s", r.seconds);
    chain.close().await;
    let task = leaving.lock().unwrap().take().expect("the server left");
    let drained = task.await.unwrap();
    // Its only session moved away at once: no drain timeout (30 s) was waited out.
    assert!(drained < Duration::from_secs(5), "leaving took {drained:?}");
    println!(
        "left after token 13: recovered in {:.3} s, server gone after {drained:?}",
        r.seconds
    );
}

/// A `corolla-server` process, killed when dropped.
struct ServerProcess {
    child: std::process::Child,
    peer_id: String,
    _dir: tempfile::TempDir,
}

impl ServerProcess {
    fn start(blocks: &str, join: &str) -> ServerProcess {
        let dir = tempfile::tempdir().unwrap();
        let addr_file = dir.path().join("addr.json");
        let child = std::process::Command::new(corolla_tests::corolla_server_bin())
            .args([
                "--model",
                tiny_llama().to_str().unwrap(),
                "--block-indices",
                blocks,
            ])
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--initial-peers",
                join,
            ])
            .args(["--update-period", "1s", "--inference-max-length", "128"])
            .arg("--addr-file")
            .arg(&addr_file)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start corolla-server");
        let mut process = ServerProcess {
            child,
            peer_id: String::new(),
            _dir: dir,
        };
        let started = Instant::now();
        while !addr_file.is_file() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no address file"
            );
            assert!(
                process.child.try_wait().unwrap().is_none(),
                "the server exited"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let info: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&addr_file).unwrap()).unwrap();
        process.peer_id = info["peer_id"].as_str().unwrap().to_string();
        process
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The longest wait between two tokens when the middle server of the route
/// gets `signal` after token 13, with a replica up; the answer must stay
/// the reference's.
async fn stall_after_signal(signal: &'static str) -> Duration {
    let golden = Golden::load(&tiny_llama(), "float32");
    let prompt = &golden.prompts[0];
    let head = head();
    let first = start(SPANS[0], None, &[]).await;
    let boot = addr(&first);
    let last = start(SPANS[2], Some(&boot), &[]).await;
    let middle = {
        let boot = boot.clone();
        tokio::task::spawn_blocking(move || {
            [
                ServerProcess::start(SPANS[1], &boot),
                ServerProcess::start(SPANS[1], &boot),
            ]
        })
        .await
        .unwrap()
    };
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    let request = greedy(prompt.input_ids.clone(), 32);
    let mut settings = settings(request.max_length());
    // What a client waits for a step before it gives a silent server up.
    settings.timeout = Duration::from_secs(3);
    let mut chain = chain_covering(&node, settings, 4).await;
    let victim = chain
        .route()
        .into_iter()
        .find(|h| h.start == 1)
        .unwrap()
        .peer_id;
    let victim = middle.iter().find(|p| p.peer_id == victim).unwrap();
    let mut token_times = vec![Instant::now()];
    let out = generate(&head, &mut chain, &request, |_| {
        token_times.push(Instant::now());
        if token_times.len() == 14 {
            victim.signal(signal);
        }
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap();
    assert_eq!(
        out.generated_ids, prompt.generated_new_ids,
        "after {signal}"
    );
    let recoveries = chain.recoveries();
    assert_eq!(recoveries.len(), 1, "{recoveries:?}");
    assert_eq!(recoveries[0].failed_peer, victim.peer_id);
    chain.close().await;
    drop((first, last, middle));
    token_times
        .windows(2)
        .skip(13)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_server_costs_its_sessions_less_than_a_vanished_one() {
    // SIGTERM: the server leaves (sessions told at once). SIGKILL: its
    // operating system resets the connections, which on loopback is
    // noticed at once too. SIGSTOP: what a dead host or a cut cable looks
    // like, connections open and silent, until the client's step timeout.
    let left = stall_after_signal("TERM").await;
    let killed = stall_after_signal("KILL").await;
    let vanished = stall_after_signal("STOP").await;
    println!(
        "longest wait between two tokens after the signal: SIGTERM {left:?}, SIGKILL {killed:?}, SIGSTOP {vanished:?}"
    );
    assert!(left < Duration::from_secs(1), "leaving stalled {left:?}");
    assert!(
        vanished >= Duration::from_secs(3),
        "a silent server is only given up after the step timeout: {vanished:?}"
    );
    assert!(left * 2 < vanished, "{left:?} vs {vanished:?}");
}

/// What `corolla generate --json` prints when it cannot answer: one JSON
/// object on stdout whose `error.kind` names the cause (blocks 1..3 served
/// by nobody; once they are, a request longer than the model), and a
/// failed exit status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reports_why_it_failed_as_a_kind_in_json() {
    let first = start("0:1", None, &[]).await;
    let boot = addr(&first);
    let _last = start("3:4", Some(&boot), &[]).await;
    let model = tiny_llama();
    let generate = |extra: &'static [&'static str]| {
        let mut cmd = tokio::process::Command::new(corolla_bin());
        cmd.args(["generate", "--model", model.to_str().unwrap()])
            .args(["--initial-peers", &boot, "--json", "--prompt", "Hello"])
            .args(["--discovery-timeout", "2"])
            .args(extra)
            .env("RUST_LOG", "error");
        cmd.output()
    };
    let failure = |out: std::process::Output| {
        assert!(!out.status.success(), "it succeeded");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json: serde_json::Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stdout}"));
        let message = json["error"]["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{json}");
        // The person reading stderr sees the same message.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{message} not in {stderr}");
        json["error"].clone()
    };

    let error = failure(generate(&[]).await.unwrap());
    assert_eq!(error["kind"], "no_coverage", "{error}");
    assert_eq!(error["retryable"], true, "{error}");
    assert_eq!(error["uncovered"], serde_json::json!([[1, 3]]), "{error}");

    let _middle = start("1:3", Some(&boot), &[]).await;
    let error = failure(generate(&["--max-new-tokens", "100000"]).await.unwrap());
    assert_eq!(error["kind"], "context_length_exceeded", "{error}");
    assert_eq!(error["retryable"], false, "{error}");
}
