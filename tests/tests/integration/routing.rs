//! Routing around servers that fail a client: a crowd of fakes costs one
//! try (their host, and the record they copied, become suspect, not just
//! the identity), and a
//! server that answers correctly but far slower than it claims is left
//! within a few steps.

use std::net::Ipv4Addr;
use std::time::Instant;

use corolla_client::network::connect;
use corolla_tests::hostile::{lying_server_at, Lie};
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;
use libp2p::PeerId;

use super::tiny_reference::{
    client_of, server_to_copy, settings, swarm_tokens, until_most_announced, Reference, NEW_TOKENS,
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
