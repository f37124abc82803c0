//! Records: addresses a record lists are dialed sparingly, nobody forges a
//! server's record, and a private swarm ignores strangers' records.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corolla_client::network::{connect, connect_with};
use corolla_shared::node::server_dht_key;
use corolla_shared::session::fetch_info;
use corolla_tests::hostile::forge_record;
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;

use crate::tiny_reference::{expected_hashes, MODEL};

/// A record may list any host:ports; a client dials at most a few of them
/// (it is no reflection tool against third parties).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_listing_a_hundred_addresses_gets_a_few_dialed() {
    let server = start_server("0:4", None, &["--update-period", "60s"]).await;
    let boot = server.tcp_addr().unwrap().clone();
    let client = connect(std::slice::from_ref(&boot)).await.unwrap();
    let honest = client
        .discover(MODEL, Duration::from_secs(5))
        .await
        .unwrap()
        .remove(0);
    // Loopback addresses are dialed only once the client knows it listens
    // on loopback; its 0.0.0.0 listener reports each interface in turn, and
    // under load the record could come before 127.0.0.1 did.
    let started = Instant::now();
    while !client.listen_addrs().await.unwrap().iter().any(|a| {
        a.iter()
            .any(|p| matches!(p, libp2p::multiaddr::Protocol::Ip4(ip) if ip.is_loopback()))
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no loopback listener"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A hundred third-party ports, each noting whether it was dialed.
    let dialed_ports = Arc::new(std::sync::Mutex::new(HashSet::new()));
    let mut ports = Vec::new();
    for _ in 0..100 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        ports.push(port);
        let dialed_ports = dialed_ports.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                dialed_ports.lock().unwrap().insert(port);
                drop(socket);
            }
        });
    }
    let key = libp2p::identity::Keypair::generate_ed25519();
    let fake = key.public().to_peer_id();
    let mut record = honest.clone();
    record.peer_id = fake.to_string();
    record.addresses = ports
        .iter()
        .map(|port| format!("/ip4/127.0.0.1/tcp/{port}/p2p/{fake}"))
        .collect();
    forge_record(&boot, server_dht_key(&fake), record.sign(&key).unwrap()).await;

    let found = client.server_record(fake).await.unwrap();
    assert_eq!(found.addresses.len(), 100, "the record arrived whole");
    let opened = tokio::time::timeout(
        Duration::from_secs(20),
        client
            .control()
            .open_stream(fake, corolla_shared::protocol::INFERENCE_PROTOCOL),
    )
    .await;
    assert!(!matches!(opened, Ok(Ok(_))), "nobody speaks libp2p there");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dialed = dialed_ports.lock().unwrap().len();
    println!("a record listing 100 addresses: {dialed} of them dialed");
    assert!(
        (1..=corolla_shared::node::MAX_ADDRESSES_PER_PEER).contains(&dialed),
        "{dialed} of the record's 100 addresses were dialed"
    );
    server.shutdown();
    Figures::of("trust::records::a_record_listing_a_hundred_addresses_gets_a_few_dialed")
        .set("dialed", dialed)
        .set("most", corolla_shared::node::MAX_ADDRESSES_PER_PEER)
        .save();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_can_forge_a_servers_record() {
    // The server's key in a file, so the test can sign an old record with
    // it: what replaying a captured record amounts to.
    let keys = tempfile::tempdir().unwrap();
    let identity = keys.path().join("server.key");
    let server = start_server(
        "0:4",
        None,
        &[
            "--update-period",
            "60s",
            "--identity",
            identity.to_str().unwrap(),
        ],
    )
    .await;
    let boot = server.tcp_addr().unwrap().clone();
    let honest = server.peer_id();
    let key = server_dht_key(&honest);
    let client = connect(std::slice::from_ref(&boot)).await.unwrap();
    let before = client
        .discover(MODEL, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(before.len(), 1);

    // An unsigned record with other hashes, then the honest record signed
    // by another key, then an honest signature over altered content.
    let mut forged = before[0].clone();
    forged.block_hashes = vec!["bogus".into(); 4];
    forge_record(&boot, key.clone(), forged.to_bytes()).await;
    let other = libp2p::identity::Keypair::generate_ed25519();
    forge_record(&boot, key.clone(), forged.sign(&other).unwrap()).await;
    // A record the attacker may sign, under the honest server's key.
    let mut theirs = forged.clone();
    theirs.peer_id = other.public().to_peer_id().to_string();
    forge_record(&boot, key.clone(), theirs.sign(&other).unwrap()).await;
    // The server's own signature over an older record (other hashes): the
    // store keeps the newest, so a replayed record cannot roll it back.
    let honest_key =
        libp2p::identity::Keypair::from_protobuf_encoding(&std::fs::read(&identity).unwrap())
            .unwrap();
    let mut replayed = forged.clone();
    replayed.published_at_ms = before[0].published_at_ms - 1;
    assert!(replayed.published_at_ms > 0, "the honest record is dated");
    forge_record(&boot, key, replayed.sign(&honest_key).unwrap()).await;

    let fresh = connect(&[boot]).await.unwrap();
    let after = fresh.discover(MODEL, Duration::from_secs(5)).await.unwrap();
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0].block_hashes, expected_hashes());
    assert_eq!(after[0].peer_id, honest.to_string());
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_swarm_refuses_strangers_and_their_records() {
    let flags = ["--update-period", "1s"];
    let a = start_server("0:2", None, &flags).await;
    let boot = a.tcp_addr().unwrap().clone();
    let a_id = a.peer_id().to_string();
    let b = start_server(
        "2:4",
        Some(&boot.to_string()),
        &["--update-period", "1s", "--allowed-peers", &a_id],
    )
    .await;
    // b speaks to a only: a stranger's connection is closed at once (the
    // handshake may complete first), so nothing gets through.
    if let Ok(stranger) = connect(&[b.tcp_addr().unwrap().clone()]).await {
        let info = fetch_info(&mut stranger.control(), b.peer_id(), Duration::from_secs(3)).await;
        assert!(info.is_err(), "b answered a stranger: {info:?}");
    }
    // Through a, everyone sees both servers...
    let open = connect(std::slice::from_ref(&boot)).await.unwrap();
    let started = Instant::now();
    while open
        .discover(MODEL, Duration::from_secs(2))
        .await
        .unwrap()
        .len()
        < 2
    {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "b never announced"
        );
    }
    // ...but a client allowing only a ignores b's entries.
    let private = connect_with(
        std::slice::from_ref(&boot),
        Some(HashSet::from([a.peer_id()])),
        &corolla_shared::reach::ReachSettings::client(),
    )
    .await
    .unwrap();
    let found = private
        .discover(MODEL, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(
        found.iter().map(|r| r.peer_id.clone()).collect::<Vec<_>>(),
        [a_id]
    );
    a.shutdown();
    b.shutdown();
}
