//! Servers behind home routers (`corolla_tests::nat`): a server in a home
//! behind a masquerading router joins through a public bootstrap, learns it
//! is private (AutoNAT), takes a slot on the bootstrap's relay and announces
//! it; a client in another home generates through it with the tokens of a
//! local run, relayed and then direct after a hole punch; behind symmetric
//! NATs the relay still carries it; with the relay off the error says which
//! blocks cannot be reached and why. Skipped where namespaces or iptables
//! are missing.

use std::time::Duration;

use corolla_tests::nat::{nat_model, NatKind, NatWorld};
use corolla_tests::wan::{generate_local, Generation};
use serde_json::Value;

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";
const NEW_TOKENS: usize = 12;
/// The tiny model's 4 blocks: the bootstrap holds the first two, the home
/// server (and nobody else) the last two.
const BOOTSTRAP_BLOCKS: (usize, usize) = (0, 2);
const HOME_BLOCKS: (usize, usize) = (2, 4);
/// AutoNAT's first test waits a probe interval (5 s) and a dial-back that
/// the router drops times out (10 s); the relay slot follows at once.
const REACHABILITY_TIMEOUT: Duration = Duration::from_secs(90);

fn world(why: &str, nat: NatKind, bootstrap_extra: &[&str]) -> Option<NatWorld> {
    let world = NatWorld::create(nat, &nat_model(), BOOTSTRAP_BLOCKS, bootstrap_extra);
    if world.is_none() {
        assert!(
            !corolla_tests::netns::netns_required(),
            "{why}: cannot create network namespaces with iptables (needs root, iproute2 and iptables)"
        );
        eprintln!("SKIPPED {why}: cannot create network namespaces with iptables (needs root, iproute2 and iptables)");
    }
    world
}

/// Starts the home server and waits until it has told its owner it is
/// private and (with a relay) holds a slot there.
fn start_private_home_server(world: &mut NatWorld, expect_relay: bool) {
    world.start_home_server(&nat_model(), HOME_BLOCKS, &[]);
    assert!(
        world.wait_home_log("not reachable from the internet", REACHABILITY_TIMEOUT),
        "the home server never found out it is behind a NAT\n{}",
        world.logs()
    );
    let log = world.home_log();
    assert!(
        log.contains("forward TCP 42000"),
        "the owner is not told which port to forward:\n{log}"
    );
    if expect_relay {
        assert!(
            world.wait_home_log("holding a slot on a relay", REACHABILITY_TIMEOUT),
            "the home server took no relay slot\n{}",
            world.logs()
        );
    }
}

/// The home server's record as the client sees it, once it announces what
/// `ready` accepts.
fn home_record(world: &NatWorld, ready: impl Fn(&Value) -> bool) -> Value {
    let home = world
        .home_server
        .as_ref()
        .expect("home server started")
        .peer_id()
        .to_string();
    let started = std::time::Instant::now();
    let mut last = String::new();
    while started.elapsed() < REACHABILITY_TIMEOUT {
        match world.swarm_json(&nat_model()) {
            Ok(json) => {
                let found = json["servers"]
                    .as_array()
                    .and_then(|s| s.iter().find(|r| r["peer_id"] == home.as_str()).cloned());
                match found {
                    Some(record) if ready(&record) => return record,
                    Some(record) => last = record.to_string(),
                    None => last = format!("not in {json}"),
                }
            }
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    panic!(
        "the home server's record never got ready; last seen: {last}\n{}",
        world.logs()
    );
}

fn addresses(record: &Value) -> Vec<String> {
    record["addresses"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// How the client reached the server of `blocks` in an answer's route.
fn via(generation: &Generation, blocks: (usize, usize)) -> String {
    let hops = generation.json["route"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    hops.iter()
        .find(|h| {
            h["start"].as_u64() == Some(blocks.0 as u64)
                && h["end"].as_u64() == Some(blocks.1 as u64)
        })
        .map(|h| h["via"].as_str().unwrap_or("missing").to_string())
        .unwrap_or_else(|| format!("no hop for {blocks:?} in {hops:?}"))
}

#[test]
fn a_home_server_is_reached_through_the_relay_then_directly() {
    let Some(mut world) = world(
        "a_home_server_is_reached_through_the_relay_then_directly",
        NatKind::PortPreserving,
        &[],
    ) else {
        return;
    };
    start_private_home_server(&mut world, true);
    let record = home_record(&world, |r| {
        addresses(r).iter().any(|a| a.contains("/p2p-circuit"))
    });
    assert_eq!(record["reachability"], "private", "{record}");
    let addrs = addresses(&record);
    assert!(
        addrs.iter().all(|a| a.contains("/p2p-circuit")),
        "a private server announces only relayed addresses: {addrs:?}"
    );
    assert!(
        !world.client_can_connect("192.168.1.2:42000"),
        "the client's home reaches the home server's LAN address"
    );

    let local = generate_local(&nat_model(), PROMPT, NEW_TOKENS).expect("local run");

    let relayed = world
        .generate(&nat_model(), PROMPT, NEW_TOKENS, &["--no-hole-punch"])
        .unwrap_or_else(|e| panic!("{e}\n{}", world.logs()));
    assert_eq!(
        relayed.generated_ids, local.generated_ids,
        "relayed tokens differ from the local run"
    );
    assert_eq!(via(&relayed, HOME_BLOCKS), "relayed");
    assert_eq!(via(&relayed, BOOTSTRAP_BLOCKS), "direct");

    let direct = world
        .generate(&nat_model(), PROMPT, NEW_TOKENS, &[])
        .unwrap_or_else(|e| panic!("{e}\n{}", world.logs()));
    assert_eq!(
        direct.generated_ids, local.generated_ids,
        "tokens after the hole punch differ from the local run"
    );
    assert_eq!(
        via(&direct, HOME_BLOCKS),
        "direct",
        "no hole was punched through the two NATs\n{}\n--- client ---\n{}",
        world.logs(),
        direct.log
    );
    assert!(
        world.home_log().contains("hole punched: direct connection"),
        "{}",
        world.logs()
    );
}

#[test]
fn behind_symmetric_nats_the_relay_still_carries_the_answer() {
    let Some(mut world) = world(
        "behind_symmetric_nats_the_relay_still_carries_the_answer",
        NatKind::Symmetric,
        &[],
    ) else {
        return;
    };
    start_private_home_server(&mut world, true);
    home_record(&world, |r| {
        addresses(r).iter().any(|a| a.contains("/p2p-circuit"))
    });
    let local = generate_local(&nat_model(), PROMPT, NEW_TOKENS).expect("local run");
    // Hole punching is on: it fails (each NAT picks a new port per
    // destination) and the relayed connection carries the answer.
    let answer = world
        .generate(&nat_model(), PROMPT, NEW_TOKENS, &[])
        .unwrap_or_else(|e| panic!("{e}\n{}", world.logs()));
    assert_eq!(
        answer.generated_ids, local.generated_ids,
        "relayed tokens differ from the local run"
    );
    assert_eq!(via(&answer, HOME_BLOCKS), "relayed");
}

#[test]
fn without_a_relay_the_error_names_the_unreachable_blocks() {
    let Some(mut world) = world(
        "without_a_relay_the_error_names_the_unreachable_blocks",
        NatKind::PortPreserving,
        &["--no-relay"],
    ) else {
        return;
    };
    start_private_home_server(&mut world, false);
    let record = home_record(&world, |r| r["reachability"] == "private");
    assert!(
        addresses(&record).is_empty(),
        "a private server without a relay has no address to announce: {record}"
    );
    let error = world
        .generate(
            &nat_model(),
            PROMPT,
            NEW_TOKENS,
            &["--discovery-timeout", "5"],
        )
        .expect_err("generation through an unreachable server failed");
    assert!(
        error.contains("blocks 2..4") && error.contains("behind a NAT"),
        "the error does not say which blocks cannot be reached and why: {error}"
    );
}
