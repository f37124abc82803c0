//! A server that leaves hands its sessions over at once; one that
//! vanishes costs them a step timeout.

use super::*;

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
    corolla_tests::reliability::Figures::of(
        "faults::leaving::a_leaving_server_costs_its_sessions_less_than_a_vanished_one",
    )
    .set("term_ms", format!("{:.1}", left.as_secs_f64() * 1000.0))
    .set("kill_ms", format!("{:.1}", killed.as_secs_f64() * 1000.0))
    .set("stop_s", format!("{:.2}", vanished.as_secs_f64()))
    .save();
}
