//! A server dying mid-answer is replaced (a middle server killed, a server
//! joining during the answer, the CLI's failure kinds) and routes avoid
//! slow and blocked servers.

use super::*;

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
