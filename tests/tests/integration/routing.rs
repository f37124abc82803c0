//! Routing around servers that fail a client: a crowd of fakes costs one
//! try (their host, and the record they copied, become suspect, not just
//! the identity), and a
//! server that answers correctly but far slower than it claims is left
//! within a few steps.

use std::net::Ipv4Addr;
use std::time::Instant;

use corolla_client::network::connect;
use corolla_client::swarm_view::SwarmView;
use corolla_tests::hostile::{dht_peer, lying_server_at, lying_server_claiming, Lie};
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;
use libp2p::PeerId;

use super::tiny_reference::{
    client_of, server_to_copy, settings, swarm_tokens, swarm_tokens_via, until_most_announced,
    Reference, NEW_TOKENS,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_fakes_on_one_host_costs_one_try() {
    // The fakes' host becomes suspect after the first failure.
    a_crowd_of_fakes_costs_one_try(
        "routing::a_crowd_of_fakes_on_one_host_costs_one_try",
        |_| Ipv4Addr::new(127, 66, 0, 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_fakes_on_many_hosts_costs_one_try() {
    // Each fake in a network of its own (a botnet): the record they all
    // copied becomes suspect after the first failure.
    a_crowd_of_fakes_costs_one_try(
        "routing::a_crowd_of_fakes_on_many_hosts_costs_one_try",
        |i| Ipv4Addr::new(127, 70 + i as u8, 0, 1),
    )
    .await;
}

/// Ten copies of the honest record at a billion tokens per second, the
/// i-th at `host(i)`: ten refusing every Open, ten answering NaN, then ten
/// never answering a step. The client has 8 retries and a 10 s step
/// timeout; before, it spent all retries on the crowd.
async fn a_crowd_of_fakes_costs_one_try(test: &str, host: impl Fn(usize) -> Ipv4Addr) {
    let reference = Reference::load();
    let mut figures = Figures::of(test);
    let (server, boot, honest) = server_to_copy().await;
    for (seed, lie) in [Lie::Busy, Lie::NotANumber, Lie::Silent]
        .into_iter()
        .enumerate()
    {
        let mut crowd = Vec::new();
        for i in 0..10 {
            crowd.push(lying_server_at(host(i), &boot, &honest, lie).await);
        }
        let fakes: Vec<PeerId> = crowd.iter().map(|(peer, _)| *peer).collect();
        let node = connect(std::slice::from_ref(&boot)).await.unwrap();
        until_most_announced(&node, &fakes, 8).await;
        // The answer's cost, not the crowd's gathering (a minute, loaded).
        let started_answer = Instant::now();
        let (tokens, chain) = swarm_tokens(&reference, &node, settings(64), seed as u64).await;
        assert_eq!(tokens, reference.tokens(seed as u64).await, "{lie:?}");
        assert!(
            chain
                .route()
                .iter()
                .all(|h| h.peer_id == server.peer_id().to_string()),
            "{lie:?}"
        );
        // A NaN or silent fake is a recovery; a busy one never opened a session.
        let failed = chain.recoveries().len();
        assert!(failed <= 1, "{lie:?}: {failed} recoveries");
        // One step timeout at most, not one per fake.
        let seconds = started_answer.elapsed().as_secs_f64();
        assert!(seconds < 25.0, "{lie:?}: {seconds:.1} s");
        let lie = format!("{lie:?}").to_lowercase();
        figures
            .set(&format!("{lie}_seconds"), format!("{seconds:.1}"))
            .set(&format!("{lie}_recoveries"), failed);
        chain.close().await;
        for (_, task) in crowd {
            task.abort();
        }
    }
    server.shutdown();
    figures.save();
}

/// Ten fakes per lie, each in a network of its own and claiming a speed of
/// its own (ten record shapes: nothing they announce is shared, so no
/// failure makes the next fake suspect), more fakes than the client has
/// retries. What they cannot fake is what a client knows: the peer it
/// joined through (a new client that joined through the honest server), or
/// the servers it measured answering (a chat's client that joined through
/// a DHT node vouching for nobody, after one answer). For both, each lie
/// costs one try; before, each fake cost one and the retries ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_botnet_of_distinct_records_costs_one_try() {
    let test = "routing::a_botnet_of_distinct_records_costs_one_try";
    let reference = Reference::load();
    let mut figures = Figures::of(test);
    let (server, boot, honest) = server_to_copy().await;
    let (door, door_task) = dht_peer(&boot).await;
    let chat_node = connect(std::slice::from_ref(&door)).await.unwrap();
    let chat = SwarmView::new(chat_node.clone(), &settings(64));
    let (tokens, chain) = swarm_tokens_via(&reference, &chat, settings(64), 9).await;
    assert_eq!(tokens, reference.tokens(9).await);
    chain.close().await;
    for (n, lie) in [Lie::Busy, Lie::NotANumber, Lie::Silent]
        .into_iter()
        .enumerate()
    {
        let mut crowd = Vec::new();
        for i in 0..10 {
            let host = Ipv4Addr::new(127, 90 + (10 * n + i) as u8, 0, 1);
            // Every fake of every crowd claims a speed no other claims.
            let claim = 1e9 / (1 + 10 * n + i) as f64;
            crowd.push(lying_server_claiming(host, &boot, &honest, claim, lie).await);
        }
        let fakes: Vec<PeerId> = crowd.iter().map(|(peer, _)| *peer).collect();
        let newcomer = connect(std::slice::from_ref(&boot)).await.unwrap();
        until_most_announced(&newcomer, &fakes, 8).await;
        until_most_announced(&chat_node, &fakes, 8).await;
        chat.refresh().await;
        let newcomer_view = SwarmView::new(newcomer.clone(), &settings(64));
        let lie = format!("{lie:?}").to_lowercase();
        for (client, view) in [("newcomer", &newcomer_view), ("chat", &chat)] {
            let seed = n as u64;
            let started = Instant::now();
            let (tokens, chain) = swarm_tokens_via(&reference, view, settings(64), seed).await;
            let seconds = started.elapsed().as_secs_f64();
            let case = format!("{client}, {lie}");
            assert_eq!(tokens, reference.tokens(seed).await, "{case}");
            assert!(
                chain
                    .route()
                    .iter()
                    .all(|h| h.peer_id == server.peer_id().to_string()),
                "{case}"
            );
            let failed = chain.recoveries().len();
            assert!(failed <= 1, "{case}: {failed} recoveries");
            assert!(seconds < 25.0, "{case}: {seconds:.1} s");
            figures
                .set(&format!("{client}_{lie}_seconds"), format!("{seconds:.1}"))
                .set(&format!("{client}_{lie}_recoveries"), failed);
            chain.close().await;
        }
        for (_, task) in crowd {
            task.abort();
        }
    }
    door_task.abort();
    server.shutdown();
    figures.save();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_slower_than_it_claims_is_left_within_a_few_steps() {
    let reference = Reference::load();
    // The honest server announces its 5 ms step delay; the late one
    // announces its real speed but answers every step 1.5 s late.
    let honest = start_server("0:4", None, &["--step-delay-ms", "5"]).await;
    let boot = honest.tcp_addr().unwrap().to_string();
    let late = start_server("0:4", Some(&boot), &["--late-steps-ms", "1500"]).await;
    let node = client_of(&honest).await;
    let started = Instant::now();
    let (tokens, chain) = swarm_tokens(&reference, &node, settings(64), 3).await;
    let seconds = started.elapsed().as_secs_f64();
    assert_eq!(tokens, reference.tokens(3).await);
    let recoveries = chain.recoveries();
    // Chosen first for its announced speed, then left after two late steps.
    assert_eq!(recoveries.len(), 1, "{recoveries:?}");
    assert_eq!(recoveries[0].failed_peer, late.peer_id().to_string());
    let recoveries_step = recoveries[0].step;
    assert!(
        recoveries[0].step <= 3,
        "left at step {}",
        recoveries[0].step
    );
    assert!(chain
        .route()
        .iter()
        .all(|h| h.peer_id == honest.peer_id().to_string()));
    // Waiting out every late step would take at least 1.5 s × the steps.
    assert!(
        seconds < 1.5 * NEW_TOKENS as f64 / 2.0,
        "{seconds:.1} s for {NEW_TOKENS} tokens"
    );
    chain.close().await;
    late.shutdown();
    honest.shutdown();
    Figures::of("routing::a_server_slower_than_it_claims_is_left_within_a_few_steps")
        .set("left_at_step", recoveries_step)
        .set("tokens", NEW_TOKENS)
        .set("seconds", format!("{seconds:.1}"))
        .save();
}

/// Ten silent copies of the honest record, each on a network of its own,
/// as spot-check witnesses: every step is checked (`--spot-check 1`) and a
/// step may take 5 s. A witness is given a few times the primary's
/// expected step time (at least 1 s), and one that stays silent is banned
/// with its host and record: the fakes cost about a second each, not a
/// step timeout each (before: 55 s for the answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_witnesses_cost_a_second_each() {
    const FAKES: usize = 10;
    let reference = Reference::load();
    let (server, boot, honest) = server_to_copy().await;
    let mut crowd = Vec::new();
    for i in 0..FAKES {
        let host = Ipv4Addr::new(127, 150 + i as u8, 0, 1);
        crowd.push(lying_server_at(host, &boot, &honest, Lie::Silent).await);
    }
    let fakes: Vec<PeerId> = crowd.iter().map(|(peer, _)| *peer).collect();
    let node = connect(std::slice::from_ref(&boot)).await.unwrap();
    until_most_announced(&node, &fakes, 8).await;
    let mut session = settings(64);
    session.timeout = std::time::Duration::from_secs(5);
    session.spot_check = 1.0;
    let started = Instant::now();
    let (tokens, chain) = swarm_tokens(&reference, &node, session, 5).await;
    let seconds = started.elapsed().as_secs_f64();
    assert_eq!(tokens, reference.tokens(5).await);
    // At most one step timeout (a fake chosen first as the primary) and
    // about a second per fake asked as a witness.
    let bound = 5.0 + FAKES as f64 * 1.5 + 3.0;
    println!("{FAKES} silent fakes as witnesses of every step: the answer took {seconds:.1} s (bound {bound:.0} s); recoveries {:?}", chain.recoveries());
    assert!(seconds < bound, "{seconds:.1} s");
    chain.close().await;
    for (_, task) in crowd {
        task.abort();
    }
    server.shutdown();
    Figures::of("routing::silent_witnesses_cost_a_second_each")
        .set("fakes", FAKES)
        .set("seconds", format!("{seconds:.1}"))
        .save();
}
