//! Limits a stranger cannot multiply: sessions and streams held, memory
//! promised by announced frame lengths, and an honest client's speed while
//! both run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use corolla_client::{generate, RemoteChain};
use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::Device;
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::{encode_step, ErrorCode};
use corolla_shared::session::fetch_info;
use corolla_tests::hostile::{
    exchange, hidden_payload, knock_until_heard, open_stream, read_reply, resident_memory_bytes,
    Door,
};
use corolla_tests::reliability::Figures;
use corolla_tests::{start_model_server, start_server};

use crate::tiny_reference::{
    client_of, open_frame, request, sessions_in_use, settings, swarm_tokens, Reference,
};
use futures::AsyncWriteExt;
use libp2p::Stream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_lock_a_server() {
    let reference = Reference::load();
    let server = start_server(
        "0:4",
        None,
        &["--max-sessions", "8", "--session-timeout", "2s"],
    )
    .await;
    let peer = server.peer_id();
    let attacker = client_of(&server).await;
    let watcher = client_of(&server).await;

    // 1. Sessions per peer: a quarter of 8.
    let mut held = Vec::new();
    let mut refusals = Vec::new();
    for _ in 0..8 {
        let mut s = open_stream(&attacker, peer).await;
        match exchange(&mut s, &open_frame(64, 0)).await {
            Some((None, _)) => held.push(s),
            Some((Some(code), message)) => refusals.push((code, message)),
            None => refusals.push((ErrorCode::Busy, "stream refused".into())),
        }
    }
    assert_eq!(held.len(), 2, "{refusals:?}");
    let held_count = held.len();
    assert!(
        refusals
            .iter()
            .all(|(code, m)| *code == ErrorCode::Busy && m.contains("busy")),
        "{refusals:?}"
    );
    // Meanwhile an honest client gets the reference tokens.
    let honest = client_of(&server).await;
    let (tokens, chain) = swarm_tokens(&reference, &honest, settings(64), 1).await;
    assert_eq!(tokens, reference.tokens(1).await);
    chain.close().await;

    // 2. Bad frames do not keep a session alive: an empty frame every
    // 500 ms gets an error, and the third in a row closes the stream.
    let mut pest = held.pop().unwrap();
    let mut closed_after = None;
    for i in 1..=5 {
        match exchange(&mut pest, b"").await {
            Some((Some(ErrorCode::BadFrame), m)) if m.contains("in a row") => {
                closed_after = Some(i);
                break;
            }
            Some((Some(ErrorCode::BadFrame), _)) => {}
            other => panic!("bad frame {i}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(closed_after, Some(3));
    assert!(read_reply(&mut pest, Duration::from_secs(2))
        .await
        .is_none());

    // 3. Silence: the other held session expires after 2 s without progress.
    let mut idle = held.pop().unwrap();
    let reply = read_reply(&mut idle, Duration::from_secs(5)).await;
    assert!(
        matches!(&reply, Some((Some(ErrorCode::Timeout), _))),
        "{reply:?}"
    );

    // 4. A window below the minimum is refused; a session that never
    // acknowledges its 8000-byte window loses its slot within the write
    // deadline (the session timeout here).
    let mut tiny = open_stream(&attacker, peer).await;
    let reply = exchange(&mut tiny, &open_frame(64, 1)).await;
    assert!(
        matches!(&reply, Some((Some(ErrorCode::BadFrame), m)) if m.contains("minimum")),
        "{reply:?}"
    );
    let mut stingy = open_stream(&attacker, peer).await;
    let reply = exchange(&mut stingy, &open_frame(64, 8000)).await;
    assert!(matches!(&reply, Some((None, _))), "{reply:?}");
    // 40 positions of 64 f32 = 10 KB of output: more than the window.
    let step = encode_step(0, &hidden_payload(40, 64));
    corolla_shared::framing::write_frame(&mut stingy, &step)
        .await
        .unwrap();
    let started = Instant::now();
    while sessions_in_use(&watcher, &server).await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "the unacknowledging session still holds its slot"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let freed_after = started.elapsed();
    let _ = stingy.close().await;
    server.shutdown();
    Figures::of("trust::limits::one_peer_cannot_lock_a_server")
        .set("opened", held_count)
        .set("refused", refusals.len())
        .set("refusal", &refusals[0].1)
        .set("freed_s", format!("{:.1}", freed_after.as_secs_f64()))
        .save();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_frame_lengths_cost_nothing_until_sent() {
    // Sessions as long as the flag allows, but the frame limit follows the
    // model's 256 positions: 256 x 64 x 4 bytes of hidden states.
    let server = start_server("0:4", None, &["--inference-max-length", "100000"]).await;
    let peer = server.peer_id();
    let watcher = client_of(&server).await;
    let record = fetch_info(&mut watcher.control(), peer, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(record.max_length, 256);
    let attacker = client_of(&server).await;
    let mut s = open_stream(&attacker, peer).await;
    s.write_all(&(200_000u32).to_le_bytes()).await.unwrap();
    s.flush().await.unwrap();
    let reply = read_reply(&mut s, Duration::from_secs(5)).await;
    assert!(
        matches!(&reply, Some((Some(ErrorCode::TooLong), m)) if m.contains("exceeds the limit")),
        "{reply:?}"
    );

    server.shutdown();

    // A wider model, whose largest frame is 4 MiB: many peers, each
    // announcing it on every stream it may open (6 a peer, 40 in all), then
    // sending 10 bytes of it.
    let tmp = tempfile::tempdir().unwrap();
    let wide = tmp.path().join("wide");
    let spec = RandomSpec {
        hidden_size: 1024,
        num_layers: 1,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 256,
        vocab_size: 64,
        max_positions: 1024,
        seed: 3,
    };
    write_random_checkpoint(&wide, &spec).unwrap();
    let server = start_model_server(&wide, "0:1", None, &[]).await;
    let peer = server.peer_id();
    let max_frame: u32 = 1024 * 1024 * 4 + 64 * 1024;
    let mut frame_start = max_frame.to_le_bytes().to_vec();
    frame_start.extend_from_slice(&[0; 10]);
    // Every client connects first: a stream that has not sent a whole frame
    // is closed 5 s after it opened, so the streams are opened together and
    // counted at once (opened one client after another on loaded cores, the
    // first ones were closed before the last were counted).
    let mut attackers = Vec::new();
    for _ in 0..6 {
        attackers.push(client_of(&server).await);
    }
    let newcomer = client_of(&server).await;
    let before = resident_memory_bytes();
    let opened = Instant::now();
    let frame = &frame_start;
    // A stream is counted held when the server says nothing for a while;
    // one it dropped in a burst (see `Door::Dropped`) is opened again.
    let hold = |node: &NodeHandle| {
        let node = node.clone();
        async move {
            match knock_until_heard(&node, peer, frame, Duration::from_millis(300)).await {
                Door::Held(stream) => stream,
                other => panic!("an attacker's stream was not held: {other:?}"),
            }
        }
    };
    let streams: Vec<Stream> =
        futures::future::join_all(attackers.iter().flat_map(|node| (0..6).map(|_| hold(node))))
            .await;
    // A seventh stream of one peer, and streams beyond 40 in all, are
    // refused (the rest get no answer: they wait for their frames).
    let refusal_of = |node: NodeHandle| async move {
        match knock_until_heard(&node, peer, frame, Duration::from_secs(1)).await {
            Door::Held(stream) => Ok(stream),
            Door::Answered(_, message) => Err(message),
            Door::Dropped => panic!("the server dropped every try of a stream"),
        }
    };
    let seventh = refusal_of(attackers[0].clone())
        .await
        .expect_err("a seventh stream of one peer is refused");
    assert!(seventh.contains("this peer has 6 streams"), "{seventh}");
    let mut newcomer_streams = Vec::new();
    let mut beyond_total = Vec::new();
    for door in futures::future::join_all((0..6).map(|_| refusal_of(newcomer.clone()))).await {
        match door {
            Err(message) => beyond_total.push(message),
            Ok(s) => newcomer_streams.push(s),
        }
    }
    let counted_after = opened.elapsed();
    assert!(
        counted_after < Duration::from_millis(4500),
        "opening and counting the streams took {counted_after:?}: the first ones were \
         closed for want of a frame (5 s) before the count"
    );
    assert_eq!(
        (newcomer_streams.len(), beyond_total.len()),
        (4, 2),
        "40 streams in all: {beyond_total:?}"
    );
    assert!(
        beyond_total.iter().all(|m| m.contains("40/40 streams")),
        "{beyond_total:?}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let grown = resident_memory_bytes().saturating_sub(before);
    let naive = streams.len() as u64 * u64::from(max_frame);
    println!(
        "announced frames: {} streams x {max_frame} bytes announced ({} MiB if allocated up front); resident memory grew {} KiB",
        streams.len(),
        naive >> 20,
        grown >> 10
    );
    assert!(
        grown < naive / 2,
        "grew {grown} bytes for {naive} announced"
    );
    server.shutdown();
    Figures::of("trust::limits::announced_frame_lengths_cost_nothing_until_sent")
        .set("streams", streams.len() + newcomer_streams.len())
        .set("max_frame", max_frame)
        .set(
            "naive_mib",
            (naive + newcomer_streams.len() as u64 * u64::from(max_frame)) >> 20,
        )
        .set(
            "grown_mib",
            format!("{:.1}", grown as f64 / f64::from(1 << 20)),
        )
        .set("seventh", seventh)
        .set("beyond_total", &beyond_total[0])
        .save();
}

/// Tokens per second of one honest answer (median of `rounds`).
async fn honest_speed(reference: &Reference, node: &NodeHandle, rounds: u64) -> f64 {
    let mut speeds = Vec::new();
    for seed in 0..rounds {
        let mut chain = RemoteChain::connect(node, settings(64), &Device::Cpu)
            .await
            .unwrap();
        let out = generate(&reference.head, &mut chain, &request(seed), |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap();
        assert_eq!(out.generated_ids, reference.tokens(seed).await);
        speeds.push(out.tokens_per_second());
        chain.close().await;
    }
    speeds.sort_by(f64::total_cmp);
    speeds[speeds.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_client_keeps_its_speed_under_attack() {
    let reference = Reference::load();
    let server = start_server("0:4", None, &["--step-delay-ms", "2"]).await;
    let peer = server.peer_id();
    let honest = client_of(&server).await;
    let calm = honest_speed(&reference, &honest, 5).await;

    // Attackers at once: frames announced and never sent on every stream
    // they may open, sessions held at the per-peer cap and fed bad frames.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut attacks = Vec::new();
    // The largest frame this server takes: 256 positions of the tiny
    // model's 64 f32 hidden states, and the message around them (a larger
    // announcement is refused at once and holds nothing).
    let largest_frame = u32::try_from(
        corolla_shared::limits::Limits {
            max_tensor_bytes: 256 * 64 * 4,
            ..corolla_shared::limits::Limits::DEFAULT
        }
        .max_frame_bytes(),
    )
    .expect("a small frame");
    for _ in 0..4 {
        let node = client_of(&server).await;
        let stop = stop.clone();
        attacks.push(tokio::spawn(async move {
            let mut announced = Vec::new();
            for _ in 0..2 {
                let mut s = open_stream(&node, peer).await;
                let _ = s.write_all(&largest_frame.to_le_bytes()).await;
                let _ = s.flush().await;
                announced.push(s);
            }
            let mut pests = Vec::new();
            for _ in 0..4 {
                let mut s = open_stream(&node, peer).await;
                if let Some((None, _)) = exchange(&mut s, &open_frame(64, 0)).await {
                    pests.push(s);
                }
            }
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for s in pests.iter_mut() {
                    let _ = exchange(s, b"").await;
                }
                // Streams closed after bad frames in a row are replaced.
                let mut s = open_stream(&node, peer).await;
                if let Some((None, _)) = exchange(&mut s, &open_frame(64, 0)).await {
                    pests.push(s);
                }
                pests.truncate(4);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            drop(announced);
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let attacked = honest_speed(&reference, &honest, 5).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for a in attacks {
        a.await.unwrap();
    }
    let ratio = attacked / calm;
    println!(
        "honest tokens/s: {calm:.1} calm, {attacked:.1} under attack (4 peers: announced frames, held sessions, bad frames): ratio {ratio:.2}"
    );
    assert!(
        ratio >= 0.5,
        "the attack slowed the honest client to {ratio:.2}×"
    );
    Figures::of("trust::limits::an_honest_client_keeps_its_speed_under_attack")
        .set("largest_frame", largest_frame)
        .set("calm", format!("{calm:.1}"))
        .set("attacked", format!("{attacked:.1}"))
        .set("ratio", format!("{ratio:.2}"))
        .save();
}
