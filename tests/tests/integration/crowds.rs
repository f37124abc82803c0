//! Attacks by crowds from many networks, as a botnet or a renter of address
//! blocks would make them: every `127.x.y.z` is this machine, so each
//! member of a crowd comes from its own /24 in its own /16 of 127/8
//! (forwarders connecting from there, or sockets bound there), and the
//! honest client from 127.0.0.1. A limit per address holds against one
//! address; these hold because places are shared between the groups
//! competing (the share shrinks as more compete) and kept by progress, not
//! by holding on.

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use corolla_shared::protocol::{encode_step, ErrorCode};
use corolla_tests::forwarder::{connect_from, Forwarder};
use corolla_tests::hostile::{ask_relay_slot, exchange, hidden_payload};
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;
use libp2p::{Multiaddr, PeerId};

use super::sources::{crowd_member, socket_of, try_open};
use super::tiny_reference::{client_of, sessions_in_use, settings, swarm_tokens, Reference};

/// Member `i`'s source: its own /24 in its own /16.
fn member(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 100 + i as u8, 7, 1))
}

/// How often each session of the crowd steps to keep its place: under the
/// server's 10 s staleness, over the 3 s after which an idle holder gives
/// way to a waiting newcomer.
const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The most an honest answer may take under attack: three times its calm
/// time plus one step deadline (the 5 s this test gives a step; an Open
/// waits at most 3 s for an idle holder's place).
fn bound(calm: Duration) -> Duration {
    calm * 3 + Duration::from_secs(5)
}

/// One member of the crowd: it opens a session through `via` and steps
/// once per [`KEEP_ALIVE`] (from `phase` on), opening another whenever it
/// is evicted, until aborted. Counts its evictions and its sessions held.
fn keep_a_session(
    via: Arc<Forwarder>,
    server: PeerId,
    phase: Duration,
    evicted: Arc<AtomicUsize>,
    held: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Some(node) = crowd_member(&via, &server).await else {
            return;
        };
        tokio::time::sleep(phase).await;
        loop {
            let Some((mut stream, None)) = try_open(&node, server).await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            held.fetch_add(1, Ordering::SeqCst);
            for position in 0u32.. {
                tokio::time::sleep(KEEP_ALIVE).await;
                let step = encode_step(position, &hidden_payload(1, 64));
                match exchange(&mut stream, &step).await {
                    Some((None, _)) => {}
                    Some((Some(ErrorCode::Busy), _)) | None => break,
                    Some((Some(_), _)) => break,
                }
            }
            held.fetch_sub(1, Ordering::SeqCst);
            evicted.fetch_add(1, Ordering::SeqCst);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_keeping_sessions_from_many_networks_leaves_room_for_an_honest_client() {
    const MEMBERS: usize = 20;
    let reference = Reference::load();
    let server = start_server(
        "0:4",
        None,
        &["--max-sessions", "16", "--max-sessions-per-peer", "1"],
    )
    .await;
    let peer = server.peer_id();
    let target = socket_of(server.tcp_addr().unwrap());
    let honest = client_of(&server).await;
    let mut session = settings(64);
    session.timeout = Duration::from_secs(5);
    let started = Instant::now();
    let (tokens, chain) = swarm_tokens(&reference, &honest, session.clone(), 1).await;
    let calm = started.elapsed();
    assert_eq!(tokens, reference.tokens(1).await);
    chain.close().await;

    // Twenty networks, one session each wanted, sixteen places.
    let (evicted, held) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let crowd: Vec<_> = (0..MEMBERS)
        .map(|i| {
            let via = Arc::new(Forwarder::from_source(member(i), target).unwrap());
            let phase = KEEP_ALIVE * i as u32 / MEMBERS as u32;
            keep_a_session(via, peer, phase, evicted.clone(), held.clone())
        })
        .collect();
    // The crowd settles into its keep-alive rhythm: every session has
    // stepped at least once.
    tokio::time::sleep(KEEP_ALIVE * 2).await;
    // Three answers, each asked while the crowd holds every place, each
    // correct and within the bound.
    let mut slowest = Duration::ZERO;
    for seed in 2..5 {
        let filled = Instant::now();
        while sessions_in_use(&honest, &server).await < 16 {
            assert!(
                filled.elapsed() < Duration::from_secs(30),
                "the crowd never filled the server"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let started = Instant::now();
        let (tokens, chain) = swarm_tokens(&reference, &honest, session.clone(), seed).await;
        let took = started.elapsed();
        assert_eq!(tokens, reference.tokens(seed).await, "seed {seed}");
        assert!(
            took <= bound(calm),
            "seed {seed}: {took:?} > {:?}",
            bound(calm)
        );
        slowest = slowest.max(took);
        chain.close().await;
    }
    // Evicted sessions learn so at their next keep-alive.
    tokio::time::sleep(KEEP_ALIVE + Duration::from_secs(1)).await;
    let crowd_held = held.load(Ordering::SeqCst);
    let crowd_evicted = evicted.load(Ordering::SeqCst);
    println!(
        "a crowd of {MEMBERS} networks keeping sessions alive every {KEEP_ALIVE:?} on a server \
         with 16: calm {calm:?}, slowest answer under attack {slowest:?}; the crowd held \
         {crowd_held} sessions at the end, lost {crowd_evicted}"
    );
    for task in crowd {
        task.abort();
    }
    server.shutdown();
    Figures::of(
        "crowds::a_crowd_keeping_sessions_from_many_networks_leaves_room_for_an_honest_client",
    )
    .set("networks", MEMBERS)
    .set("calm_ms", calm.as_millis())
    .set("slowest_ms", slowest.as_millis())
    .set("crowd_evicted", crowd_evicted)
    .save();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_networks_cannot_hold_every_handshake_or_connection() {
    const NETWORKS: usize = 16;
    let reference = Reference::load();
    // 32 connections: a host may hold 4, a network 8; 64 handshakes: a
    // host 16, a network 32.
    let server = start_server("0:4", None, &["--max-connections", "32"]).await;
    let peer = server.peer_id();
    let target = socket_of(server.tcp_addr().unwrap());
    let mut session = settings(64);
    session.timeout = Duration::from_secs(5);
    // The calm run's client stays connected: one of the 32.
    let calm_client = client_of(&server).await;
    let started = Instant::now();
    let (tokens, chain) = swarm_tokens(&reference, &calm_client, session.clone(), 1).await;
    let calm = started.elapsed();
    assert_eq!(tokens, reference.tokens(1).await);
    chain.close().await;

    // 1. Handshakes: eight silent sockets from each of sixteen networks,
    // twice what the server has places for.
    let silent: Vec<TcpStream> = (0..NETWORKS)
        .flat_map(|i| (0..8).filter_map(move |_| connect_from(member(i), target).ok()))
        .collect();
    // The server takes them in before the crowd below arrives.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // 2. Connections: four identities from each of eight more networks
    // take the 31 left (the last network's fourth is refused: its region
    // holds its share).
    let forwarders: Vec<Forwarder> = (NETWORKS..NETWORKS + 8)
        .map(|i| Forwarder::from_source(member(i), target).unwrap())
        .collect();
    // (A member's handshake may lose its place to the silent sockets still
    // being accepted: the crowd tries again, as it would.)
    let mut crowd = Vec::new();
    for via in &forwarders {
        let mut members = 0;
        for _ in 0..12 {
            if members == 4 || crowd.len() == 31 {
                break;
            }
            if let Some(node) = crowd_member(via, &peer).await {
                crowd.push(node);
                members += 1;
            }
        }
    }
    // (31 is every place left; one may still be lost to a silent socket's
    // handshake evicting a member's on a loaded machine.)
    assert!(
        crowd.len() >= 30,
        "the crowd holds {} connections",
        crowd.len()
    );
    // A new honest client connects and answers within the bound.
    let started = Instant::now();
    let honest = client_of(&server).await;
    let (tokens, chain) = swarm_tokens(&reference, &honest, session, 2).await;
    let took = started.elapsed();
    assert_eq!(tokens, reference.tokens(2).await);
    assert!(took <= bound(calm), "{took:?} > {:?}", bound(calm));
    chain.close().await;
    println!(
        "{} silent sockets from {NETWORKS} networks and {} connections from 8 more: the \
         honest client answered in {took:?} (calm {calm:?})",
        silent.len(),
        crowd.len()
    );
    drop(silent);
    drop(calm_client);
    server.shutdown();
    Figures::of("crowds::a_crowd_of_networks_cannot_hold_every_handshake_or_connection")
        .set("silent_sockets", NETWORKS * 8)
        .set("crowd_connections", crowd.len())
        .set("calm_ms", calm.as_millis())
        .set("answer_ms", took.as_millis())
        .save();
}

/// Twenty-four identities from twelve networks take a relay's 16 slots
/// (each host within its share); a peer from another network is refused
/// once, the relay ends a reservation of the crowd, and the peer's next
/// request is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_networks_gives_a_relay_slot_back_to_a_newcomer() {
    let relay = start_server("0:4", None, &["--relay-max-reservations", "16"]).await;
    let peer = relay.peer_id();
    let target = socket_of(relay.tcp_addr().unwrap());
    let through = |port: u16| -> Multiaddr {
        format!("/ip4/127.0.0.1/tcp/{port}/p2p/{peer}/p2p-circuit")
            .parse()
            .unwrap()
    };
    let forwarders: Vec<Forwarder> = (0..12)
        .map(|i| Forwarder::from_source(member(40 + i), target).unwrap())
        .collect();
    let mut crowd = Vec::new();
    let mut granted = 0;
    for via in forwarders.iter().chain(&forwarders) {
        let (slot, _, task) =
            ask_relay_slot(through(via.addr().port()), Duration::from_secs(3)).await;
        granted += usize::from(slot);
        crowd.push(task);
    }
    assert_eq!(granted, 16, "the crowd holds every slot");
    let mut attempts = 0;
    let mut honest_tasks = Vec::new();
    let honest = loop {
        attempts += 1;
        let (slot, _, task) = ask_relay_slot(through(target.port()), Duration::from_secs(5)).await;
        honest_tasks.push(task);
        if slot || attempts == 2 {
            break slot;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    println!("relay with 16 slots held by 12 networks: a newcomer got one on attempt {attempts}: {honest}");
    assert!(honest, "the newcomer got no slot in two attempts");
    for task in crowd.into_iter().chain(honest_tasks) {
        task.abort();
    }
    relay.shutdown();
    Figures::of("crowds::a_crowd_of_networks_gives_a_relay_slot_back_to_a_newcomer")
        .set("attempts", attempts)
        .save();
}
