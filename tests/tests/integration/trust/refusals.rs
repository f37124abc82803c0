//! Refusals and departures are named quickly, and the answer goes on.

use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_client::{generate, RemoteChain};
use corolla_model::Device;
use corolla_shared::protocol::encode_step;
use corolla_tests::hostile::{exchange, hidden_payload, open_stream};
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;

use crate::tiny_reference::{client_of, open_frame, request, settings, Reference, MODEL};

use super::until_servers;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_named_quickly() {
    let server = start_server(
        "0:4",
        None,
        &["--inference-max-length", "32", "--max-sessions", "1"],
    )
    .await;
    let node = client_of(&server).await;
    // Longer than the server allows.
    let started = Instant::now();
    let err = RemoteChain::connect(&node, settings(64), &Device::Cpu)
        .await
        .err()
        .expect("refused");
    let message = err.to_string();
    assert!(message.contains("max_length 64 exceeds 32"), "{message}");
    let too_long_after = started.elapsed();
    assert!(
        too_long_after < Duration::from_secs(8),
        "{too_long_after:?}"
    );

    // Busy: the one session is taken, and kept working (an idle one would
    // give its place to a client that waits).
    let other = client_of(&server).await;
    let mut s = open_stream(&other, server.peer_id()).await;
    assert!(matches!(
        exchange(&mut s, &open_frame(16, 0)).await,
        Some((None, _))
    ));
    let working = tokio::spawn(async move {
        for position in 0..15 {
            let step = encode_step(position, &hidden_payload(1, 64));
            if !matches!(exchange(&mut s, &step).await, Some((None, _))) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let err = RemoteChain::connect(&node, settings(16), &Device::Cpu)
        .await
        .err()
        .expect("busy");
    assert!(err.to_string().contains("busy: 1/1 sessions"), "{err}");
    let busy_after = started.elapsed();
    assert!(busy_after < Duration::from_secs(8));
    working.abort();
    Figures::of("trust::refusals::refusals_are_named_quickly")
        .set("too_long_ms", too_long_after.as_millis())
        .set("busy_ms", busy_after.as_millis())
        .save();

    // An unreachable bootstrap peer.
    let dead: libp2p::Multiaddr = format!("/ip4/127.0.0.1/tcp/9/p2p/{}", libp2p::PeerId::random())
        .parse()
        .unwrap();
    let err = connect(&[dead]).await.err().expect("unreachable");
    assert!(
        err.to_string().contains("cannot reach the bootstrap peer"),
        "{err}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_server_says_so_and_the_answer_goes_on() {
    let reference = Reference::load();
    let flags = ["--update-period", "1s"];
    let a = start_server("0:4", None, &flags).await;
    let boot = a.tcp_addr().unwrap().to_string();
    let b = start_server("0:4", Some(&boot), &flags).await;
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    until_servers(&node, 2).await;
    // Pin the answer on b, then let b leave under it.
    let mut s = settings(64);
    s.allowed_servers = None;
    let mut chain = RemoteChain::connect(&node, s, &Device::Cpu).await.unwrap();
    let used = chain.route()[0].peer_id.clone();
    let (leaver, stayer) = if used == b.peer_id().to_string() {
        (b, a)
    } else {
        (a, b)
    };
    let leave = tokio::spawn(leaver.leave());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = generate(&reference.head, &mut chain, &request(3), |_| {
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap();
    assert_eq!(out.generated_ids, reference.tokens(3).await);
    let recovery = &chain.recoveries()[0];
    assert!(recovery.error.contains("shutting down"), "{recovery:?}");
    chain.close().await;
    leave.await.unwrap();
    // The DHT was told: a fresh lookup lists only the server that stayed.
    let fresh = connect(&[stayer.tcp_addr().unwrap().clone()])
        .await
        .unwrap();
    let found = fresh.discover(MODEL, Duration::from_secs(3)).await.unwrap();
    assert_eq!(
        found.iter().map(|r| r.peer_id.clone()).collect::<Vec<_>>(),
        [stayer.peer_id().to_string()]
    );
    stayer.shutdown();
}
