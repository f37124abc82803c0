//! Servers killed at random while many sessions run: every answer comes
//! out token-identical.

use super::*;

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
    corolla_tests::reliability::Figures::of(
        "faults::chaos::chaos_every_session_completes_token_identical",
    )
    .set("sessions", SESSIONS)
    .set("kills", kills)
    .set("recoveries", recoveries)
    .save();
}
