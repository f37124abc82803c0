//! Attacks by a crowd of identities behind one address: every `127.x.y.z`
//! is this machine, so the crowd comes from 127.66.0.1 (raw sockets bound
//! to it, or libp2p clients through a forwarder that connects from it) and
//! the honest client from 127.0.0.1, another network. Peer ids are free;
//! the server's handshake, connection, session and stream slots are shared
//! per source address, so the honest client is still served.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_server::RunningServer;
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::ErrorCode;
use corolla_tests::forwarder::{connect_from, Forwarder};
use corolla_tests::hostile::{
    ask_relay_slot, connect_through_relay, exchange, open_stream, read_reply,
};
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, Stream};

use super::tiny_reference::{client_of, open_frame, settings, swarm_tokens, Reference};

/// Where the crowd comes from: another /24 than 127.0.0.1's.
const CROWD: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 66, 0, 1));

pub(crate) fn socket_of(addr: &Multiaddr) -> SocketAddr {
    let mut ip = None;
    let mut port = None;
    for p in addr.iter() {
        match p {
            Protocol::Ip4(v4) => ip = Some(IpAddr::V4(v4)),
            Protocol::Tcp(p) => port = Some(p),
            _ => {}
        }
    }
    SocketAddr::new(ip.expect("an IPv4 address"), port.expect("a TCP port"))
}

/// A new identity of the crowd, connected (or refused) through `via`.
pub(crate) async fn crowd_member(via: &Forwarder, server: &libp2p::PeerId) -> Option<NodeHandle> {
    let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{}/p2p/{server}", via.addr().port())
        .parse()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), connect(&[addr]))
        .await
        .ok()?
        .ok()
}

/// Opens a session on `server` for `node`: the stream and the reply, when
/// the node's connection carried one.
pub(crate) async fn try_open(
    node: &NodeHandle,
    server: libp2p::PeerId,
) -> Option<(Stream, Option<ErrorCode>)> {
    let mut stream = tokio::time::timeout(
        Duration::from_secs(5),
        node.control()
            .open_stream(server, corolla_shared::protocol::INFERENCE_PROTOCOL),
    )
    .await
    .ok()?
    .ok()?;
    let (code, _) = exchange(&mut stream, &open_frame(64, 0)).await?;
    Some((stream, code))
}

/// How many of the crowd's sessions were told their place went to a
/// client from another address.
async fn evicted(held: &mut [Stream]) -> usize {
    let mut evicted = 0;
    for stream in held {
        if let Some((Some(ErrorCode::Busy), message)) =
            read_reply(stream, Duration::from_millis(200)).await
        {
            assert!(message.contains("waiting client"), "{message}");
            evicted += 1;
        }
    }
    evicted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_identities_from_one_address_leaves_the_server_to_others() {
    let reference = Reference::load();
    // 48 connections: one host may hold 6 and be in 16 handshakes at once.
    let server = start_server(
        "0:4",
        None,
        &[
            "--max-sessions",
            "4",
            "--max-sessions-per-peer",
            "1",
            "--max-connections",
            "48",
        ],
    )
    .await;
    let peer = server.peer_id();
    let target = socket_of(server.tcp_addr().unwrap());

    // 1. Handshakes: 70 silent sockets from one host would hold all 64
    // pending-handshake slots; it gets 16, and the honest client gets in.
    let silent: Vec<TcpStream> = (0..70)
        .map(|_| connect_from(CROWD, target).expect("a socket from the crowd's address"))
        .collect();
    let honest = client_of(&server).await;
    let (tokens, chain) = swarm_tokens(&reference, &honest, settings(64), 1).await;
    assert_eq!(tokens, reference.tokens(1).await);
    chain.close().await;
    drop(silent);

    // 2. Connections: ten identities from one host; six stay connected.
    let via = Forwarder::from_source(CROWD, target).unwrap();
    let mut connected = Vec::new();
    let mut held = Vec::new();
    let mut busy = 0;
    for _ in 0..10 {
        let Some(node) = crowd_member(&via, &peer).await else {
            continue;
        };
        if let Some((stream, code)) = try_open(&node, peer).await {
            match code {
                None => held.push(stream),
                Some(ErrorCode::Busy) => busy += 1,
                Some(other) => panic!("an Open refused with {other:?}"),
            }
            connected.push(node);
        }
    }
    assert_eq!(
        connected.len(),
        6,
        "identities from one host with a connection: the cap is 48/8"
    );
    // 3. Sessions: the crowd filled all four while nobody else asked (its
    // later Opens waited and took the places of its own idle sessions)...
    let own = evicted(&mut held).await;
    assert_eq!(held.len() - own, 4, "{own} of its own evicted");
    assert_eq!(own + busy, 2, "{own} of its own evicted, {busy} refused");
    // ...and the honest client still gets one: the crowd's network gives up
    // the session idle longest, and is told why.
    let started = Instant::now();
    let (tokens, chain) = swarm_tokens(&reference, &honest, settings(64), 2).await;
    assert_eq!(tokens, reference.tokens(2).await);
    let served_after = started.elapsed();
    assert!(served_after < Duration::from_secs(10));
    chain.close().await;
    assert_eq!(evicted(&mut held).await, 1, "one crowd session made room");

    // 4. Idle streams: a stream that never sends a byte is closed in
    // seconds, not at the 300 s session timeout.
    let member = &connected[0];
    let mut idle = vec![
        open_stream(member, peer).await,
        open_stream(member, peer).await,
    ];
    let started = Instant::now();
    for stream in &mut idle {
        let reply = read_reply(stream, Duration::from_secs(10)).await;
        assert!(
            matches!(&reply, Some((Some(ErrorCode::Timeout), m)) if m.contains("no session opened")),
            "{reply:?}"
        );
    }
    let idle_closed_after = started.elapsed();
    assert!(
        idle_closed_after < Duration::from_secs(8),
        "{idle_closed_after:?}"
    );
    drop(via);
    server.shutdown();
    Figures::of("sources::a_crowd_of_identities_from_one_address_leaves_the_server_to_others")
        .set("silent_sockets", 70)
        .set("identities", 10)
        .set("connected", connected.len())
        .set("sessions_held", 4)
        .set("served_ms", served_after.as_millis())
        .set(
            "idle_closed_s",
            format!("{:.1}", idle_closed_after.as_secs_f64()),
        )
        .save();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_cannot_hold_the_kv_cache_with_long_sessions() {
    let reference = Reference::load();
    // Cache for two sessions of 64 positions, slots for eight.
    let server = start_server(
        "0:4",
        None,
        &[
            "--max-sessions",
            "8",
            "--max-sessions-per-peer",
            "4",
            "--cache-tokens",
            "128",
        ],
    )
    .await;
    let peer = server.peer_id();
    let via = Forwarder::from_source(CROWD, socket_of(server.tcp_addr().unwrap())).unwrap();
    let crowd = crowd_member(&via, &peer).await.expect("the crowd connects");
    let mut held = Vec::new();
    for _ in 0..2 {
        let (stream, code) = try_open(&crowd, peer).await.expect("a reply");
        assert_eq!(code, None);
        held.push(stream);
    }
    // The crowd itself gets no more: it holds the cache.
    let (_, code) = try_open(&crowd, peer).await.expect("a reply");
    assert_eq!(code, Some(ErrorCode::Busy));
    // The honest client does, at the expense of one crowd session.
    let honest = client_of(&server).await;
    let (tokens, chain) = swarm_tokens(&reference, &honest, settings(64), 4).await;
    assert_eq!(tokens, reference.tokens(4).await);
    chain.close().await;
    assert_eq!(evicted(&mut held).await, 1, "one crowd session made room");
    drop(via);
    server.shutdown();
    Figures::of("sources::a_crowd_cannot_hold_the_kv_cache_with_long_sessions")
        .set("evicted", 1)
        .save();
}

/// A relay's slots are shared between addresses: twenty identities from one
/// host ask a relay with 16 slots for one each (without the shares they take
/// every slot, and a server behind a NAT loses its way in); the host gets
/// its eighth, and a peer from another address still gets a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_cannot_take_a_relays_slots() {
    let relay = start_server("0:4", None, &["--relay-max-reservations", "16"]).await;
    let peer = relay.peer_id();
    let target = socket_of(relay.tcp_addr().unwrap());
    let via = Forwarder::from_source(CROWD, target).unwrap();
    let through = |port: u16| -> Multiaddr {
        format!("/ip4/127.0.0.1/tcp/{port}/p2p/{peer}/p2p-circuit")
            .parse()
            .unwrap()
    };
    let mut crowd = Vec::new();
    let mut granted = 0;
    for _ in 0..20 {
        let (slot, _, task) =
            ask_relay_slot(through(via.addr().port()), Duration::from_secs(3)).await;
        granted += usize::from(slot);
        crowd.push(task);
    }
    let (honest, _, honest_task) =
        ask_relay_slot(through(target.port()), Duration::from_secs(5)).await;
    println!("relay with 16 slots: a crowd of 20 identities from one host got {granted}; a peer elsewhere got one: {honest}");
    assert!(honest, "the peer from another address got no slot");
    assert!(
        (1..=2).contains(&granted),
        "the crowd's host got {granted} slots (its share: 2)"
    );
    for task in crowd {
        task.abort();
    }
    honest_task.abort();
    relay.shutdown();
    Figures::of("sources::a_crowd_cannot_take_a_relays_slots")
        .set("granted", granted)
        .save();
}

/// A relay with 8 circuits, a peer behind it holding a slot, a forwarder
/// connecting to the relay from the crowd's host, and the relayed address
/// of the peer behind it through a given port (the relay's or the
/// forwarder's).
struct RelayedPeer {
    relay: RunningServer,
    target: SocketAddr,
    via: Forwarder,
    to_behind: Box<dyn Fn(u16) -> Multiaddr>,
    behind_task: tokio::task::JoinHandle<()>,
}

async fn relayed_peer() -> RelayedPeer {
    let relay = start_server("0:4", None, &["--relay-max-circuits", "8"]).await;
    let peer = relay.peer_id();
    let target = socket_of(relay.tcp_addr().unwrap());
    let (reserved, behind, behind_task) = ask_relay_slot(
        format!(
            "/ip4/127.0.0.1/tcp/{}/p2p/{peer}/p2p-circuit",
            target.port()
        )
        .parse()
        .unwrap(),
        Duration::from_secs(5),
    )
    .await;
    assert!(reserved, "the peer behind the relay got a slot");
    let via = Forwarder::from_source(CROWD, target).unwrap();
    let to_behind = Box::new(move |port: u16| -> Multiaddr {
        format!("/ip4/127.0.0.1/tcp/{port}/p2p/{peer}/p2p-circuit/p2p/{behind}")
            .parse()
            .unwrap()
    });
    RelayedPeer {
        relay,
        target,
        via,
        to_behind,
        behind_task,
    }
}

/// A relay's circuits are shared between addresses too: a crowd of
/// identities from one host dialing a server behind the relay holds at most
/// half of them at once (without the shares it takes all 8 and nobody else
/// gets through), and a client from another address still reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_cannot_take_a_relays_circuits() {
    let RelayedPeer {
        relay,
        target,
        via,
        to_behind,
        behind_task,
    } = relayed_peer().await;
    let mut crowd = Vec::new();
    let mut through = 0;
    for _ in 0..10 {
        let (up, task) =
            connect_through_relay(to_behind(via.addr().port()), Duration::from_secs(3)).await;
        through += usize::from(up);
        crowd.push(task);
    }
    let (honest, honest_task) =
        connect_through_relay(to_behind(target.port()), Duration::from_secs(5)).await;
    println!("relay with 8 circuits: a crowd of 10 identities from one host got {through} through; a client elsewhere got through: {honest}");
    assert!(
        honest,
        "the client from another address was not let through"
    );
    assert!(
        (1..=4).contains(&through),
        "the crowd's host holds {through} circuits (its share: 4)"
    );
    for task in crowd {
        task.abort();
    }
    honest_task.abort();
    behind_task.abort();
    relay.shutdown();
    Figures::of("sources::a_crowd_cannot_take_a_relays_circuits")
        .set("through", through)
        .save();
}

/// A relay's circuits are also rated per source address: a crowd of
/// identities from one host that opens circuits and closes each at once
/// (so its share of circuits at once never fills) gets a burst of as many
/// as the relay carries, then one every 2 s; a client from another address
/// is not slowed. Without the rate, churning ids could open circuits (and
/// their dials to the peer behind) as fast as they liked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_churning_a_relays_circuits_is_slowed_to_its_rate() {
    const CIRCUITS: usize = 8;
    const ATTEMPTS: usize = 20;
    let RelayedPeer {
        relay,
        target,
        via,
        to_behind,
        behind_task,
    } = relayed_peer().await;
    let started = Instant::now();
    let mut through = 0;
    for _ in 0..ATTEMPTS {
        let (up, task) =
            connect_through_relay(to_behind(via.addr().port()), Duration::from_secs(3)).await;
        through += usize::from(up);
        task.abort();
        // Long enough for the relay to see the circuit closed.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (honest, honest_task) =
        connect_through_relay(to_behind(target.port()), Duration::from_secs(5)).await;
    // The burst, one per 2 s since, and one refill at the edge.
    let allowed = CIRCUITS + (seconds / 2.0) as usize + 1;
    println!(
        "relay with 8 circuits: a crowd from one host churning {ATTEMPTS} circuits in {seconds:.1} s \
         got {through} through (its rate allows {allowed}); a client elsewhere got through: {honest}"
    );
    assert!(honest, "the client from another address was slowed too");
    assert!(
        through > CIRCUITS / 2,
        "{through} through: circuits did not close (the share at once, 4, stopped the crowd)"
    );
    assert!(
        through <= allowed && through < ATTEMPTS,
        "{through} of {ATTEMPTS} through in {seconds:.1} s (the rate allows {allowed})"
    );
    honest_task.abort();
    behind_task.abort();
    relay.shutdown();
    Figures::of("sources::a_crowd_churning_a_relays_circuits_is_slowed_to_its_rate")
        .set("attempts", ATTEMPTS)
        .set("through", through)
        .set("seconds", format!("{seconds:.1}"))
        .save();
}
