//! Real servers and the real CLI over delayed links (`corolla_tests::wan`):
//! each in its own network namespace, every link 20 ms round trip, the
//! wire-shaped model (70B-sized activations on every hop). Skipped where
//! namespaces cannot be made (not root, no iproute2).

use std::time::{Duration, Instant};

use corolla_tests::wan::{generate_local, write_wire_model, LinkDelay, WanWorld};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog near the river bank";

/// The wire-shaped model's hidden size: each token crosses every hop as
/// this many values, at least 2 bytes each.
const HIDDEN: u64 = 8192;

fn world(why: &str, delay: LinkDelay) -> Option<WanWorld> {
    let world = WanWorld::create(delay);
    if world.is_none() {
        assert!(
            !corolla_tests::netns::netns_required(),
            "{why}: cannot create network namespaces (needs root and iproute2)"
        );
        eprintln!("SKIPPED {why}: cannot create network namespaces (needs root and iproute2)");
    }
    world
}

#[test]
fn answers_over_delayed_links_match_local() {
    let delay = LinkDelay::rtt_ms(20);
    let Some(mut world) = world("answers_over_delayed_links_match_local", delay) else {
        return;
    };
    let model = write_wire_model(world.dir(), 3);
    world.start_servers(&model, &[(0, 1), (1, 2), (2, 3)], &[]);

    // The host does not forward between namespaces: a server's real
    // address is out of the client's reach, its forwarder is not, so
    // whatever addresses identify or the DHT hand out, the delay holds.
    for (i, server) in world.servers.iter().enumerate() {
        assert!(
            !world.client_can_connect(server.inner_addr()),
            "the client reaches server {i}'s inner address {} past its forwarder",
            server.inner_addr()
        );
    }
    assert!(
        world.client_can_connect(world.servers[0].forwarder.addr()),
        "the client cannot reach server 0's forwarder"
    );

    let new_tokens = 24;
    let local = generate_local(&model, PROMPT, new_tokens).expect("local run");
    let before = world.traffic();
    let remote = world
        .generate(&model, PROMPT, new_tokens, &[])
        .unwrap_or_else(|e| panic!("{e}\n{}", world.logs()));
    assert_eq!(
        remote.generated_ids, local.generated_ids,
        "tokens over delayed links differ from the local run"
    );
    assert_eq!(remote.generated_ids.len(), new_tokens);
    let hops = remote.route();
    assert_eq!(hops.len(), 3, "one hop per server: {hops:?}");

    // Every connection passes one forwarder, so each server's input
    // (from the client or pushed by the server before it) crossed one.
    let carried: u64 = world
        .traffic()
        .iter()
        .zip(&before)
        .map(|(now, then)| now - then)
        .sum();
    let least = new_tokens as u64 * hops.len() as u64 * HIDDEN * 2;
    assert!(
        carried >= least,
        "the forwarders carried {carried} bytes, under the {least} of the activations"
    );

    // Each step down the route crosses at least hops + 1 links one way
    // (client, each server in turn, client), each at least `one_way` late:
    // a floor no noise can push a real run under, and a bypassed delay
    // (~10-30 ms per step of compute here) would fall below it. Per step,
    // not per token: a drafting client may take several tokens a step.
    let floor_ms = (hops.len() + 1) as f64 * delay.one_way.as_secs_f64() * 1e3;
    let ms = remote.decode_ms_per_step();
    eprintln!(
        "{ms:.1} ms per step, {:.1} ms per token, through {} servers at {} ms RTT \
         (floor {floor_ms:.0} ms per step); local {:.1} ms per token",
        remote.decode_ms_per_token(),
        hops.len(),
        delay.rtt().as_millis(),
        local.decode_ms_per_token()
    );
    assert!(
        ms >= floor_ms,
        "{ms:.1} ms per step is under the delay's floor of {floor_ms:.0} ms"
    );
}

#[test]
fn a_server_killed_mid_answer_over_delayed_links_is_replaced() {
    let Some(mut world) = world(
        "a_server_killed_mid_answer_over_delayed_links_is_replaced",
        LinkDelay::rtt_ms(20),
    ) else {
        return;
    };
    let model = write_wire_model(world.dir(), 3);
    // Servers 1 and 2 both hold block 1: one of them is the replacement.
    world.start_servers(&model, &[(0, 1), (1, 2), (1, 2), (2, 3)], &[]);
    let new_tokens = 64;
    let local = generate_local(&model, PROMPT, new_tokens).expect("local run");

    let before = world.decode_steps();
    let started = Instant::now();
    let child = world
        .generate_command(&model, PROMPT, new_tokens, &[])
        .spawn()
        .expect("start corolla generate");
    // The replica in use is the one computing: kill it a few tokens in.
    let in_use = world.wait_for_decode_steps(&before, &[1, 2], 4, Duration::from_secs(120));
    let Some(victim) = in_use else {
        let out = WanWorld::wait_generation(child, started);
        panic!(
            "no replica of block 1 computed the answer: {:?}\n{out:?}\n{}",
            world.decode_steps(),
            world.logs()
        );
    };
    let victim_id = world.servers[victim].peer_id.clone();
    world.servers[victim].kill();
    let killed_at = started.elapsed();

    let remote = WanWorld::wait_generation(child, started)
        .unwrap_or_else(|e| panic!("{e}\n{}", world.logs()));
    eprintln!(
        "killed server {victim} after {killed_at:?}; recoveries: {:?}",
        remote.recoveries()
    );
    assert_eq!(
        remote.generated_ids, local.generated_ids,
        "tokens differ from the local run after the recovery"
    );
    // The route that finished the answer went through the other replica.
    let replica_id = world.servers[3 - victim].peer_id.clone();
    let route = remote.route();
    assert!(
        route
            .iter()
            .any(|(peer, start, _)| *peer == replica_id && *start == 1),
        "the replica {replica_id} did not finish block 1: {route:?}"
    );
    let recoveries = remote.recoveries();
    assert!(
        recoveries
            .iter()
            .any(|r| r["failed_peer"].as_str() == Some(victim_id.as_str())),
        "no recovery from the killed server {victim_id}: {recoveries:?}"
    );
}

/// The delaying forwarder alone, on loopback (no root needed): each
/// direction waits its one-way delay, settings change while it runs, and
/// jitter never reorders the stream.
#[test]
fn the_forwarder_delays_each_direction_and_keeps_order() {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    use corolla_tests::forwarder::{Forwarder, LinkShape};

    let echo = TcpListener::bind("127.0.0.1:0").expect("bind");
    let target = echo.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in echo.incoming().flatten() {
            std::thread::spawn(move || {
                let mut out = conn.try_clone().expect("clone");
                let _ = std::io::copy(&mut &conn, &mut out);
            });
        }
    });
    let shape = LinkShape::new(Duration::from_millis(15), Duration::ZERO, 0.0);
    let forwarder = Forwarder::delaying("127.0.0.1:0".parse().expect("addr"), target, shape)
        .expect("forwarder");
    let mut conn = TcpStream::connect(forwarder.addr()).expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    let round_trip = |conn: &mut TcpStream| {
        let started = Instant::now();
        conn.write_all(b"ping").expect("write");
        let mut back = [0u8; 4];
        conn.read_exact(&mut back).expect("read");
        assert_eq!(&back, b"ping");
        started.elapsed()
    };
    let rtt = round_trip(&mut conn);
    assert!(
        rtt >= Duration::from_millis(30) && rtt < Duration::from_millis(300),
        "{rtt:?} for a 30 ms round trip"
    );
    let shape = forwarder.shape().expect("a delaying forwarder");
    shape.set(Duration::from_millis(50), Duration::ZERO, 0.0);
    let rtt = round_trip(&mut conn);
    assert!(
        rtt >= Duration::from_millis(100),
        "{rtt:?} after the change"
    );

    // Many small writes under heavy jitter come back whole and in order.
    shape.set(Duration::from_millis(1), Duration::from_millis(20), 0.0);
    let sent: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut writer = conn.try_clone().expect("clone");
    let to_send = sent.clone();
    let writing = std::thread::spawn(move || {
        for piece in to_send.chunks(100) {
            writer.write_all(piece).expect("write");
        }
    });
    let mut got = vec![0u8; sent.len()];
    conn.read_exact(&mut got).expect("read back");
    writing.join().expect("writer");
    assert!(got == sent, "the stream came back reordered or changed");
    assert!(forwarder.bytes_to_target() >= sent.len() as u64);
}
