//! Pushers that fail their push: nothing sent, a forged proof, the previous
//! step's push again, an honest push late. Each answers for it itself: the
//! client carries the step to the server after it, which answers, and the
//! pusher is named and replaced, or (with no other server of its blocks)
//! kept with its outputs carried by the client. The server after it is
//! never blamed, and the answer is the whole model's.

use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_client::swarm_view::SwarmView;
use corolla_client::{generate, GenerateRequest, RemoteChain};
use corolla_model::{Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_tests::reliability::Figures;
use corolla_tests::start_server;

use crate::tiny_reference::{request, settings, Reference};

use super::until_servers;

const FAULTS: [&str; 4] = ["silent", "forged", "replayed", "late:1500"];
/// What one answer may cost beyond three times its calm time: one wait for
/// a push that does not come (the client's floor is 1 s) and the pusher's
/// replacement, with room for a loaded machine.
const ALLOWANCE: Duration = Duration::from_secs(3);

fn greedy(seed: u64) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams::default(),
        ..request(seed)
    }
}

/// One greedy answer through `view`: its tokens, how long it took, and the chain.
async fn answer(
    reference: &Reference,
    view: &SwarmView,
    seed: u64,
) -> (Vec<u32>, Duration, RemoteChain) {
    let req = greedy(seed);
    let started = Instant::now();
    let mut chain = RemoteChain::connect_via(view, settings(req.max_length()), &Device::Cpu)
        .await
        .unwrap();
    let out = generate(&reference.head, &mut chain, &req, |_| {
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    (out.generated_ids, started.elapsed(), chain)
}

/// A greedy answer's time through two honest servers, the best of three.
async fn calm_time(reference: &Reference) -> Duration {
    let first = start_server("0:2", None, &["--update-period", "1s"]).await;
    let boot = first.tcp_addr().unwrap().to_string();
    let second = start_server("2:4", Some(&boot), &["--update-period", "1s"]).await;
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    until_servers(&node, 2).await;
    let view = SwarmView::new(node, &settings(greedy(0).max_length()));
    let mut best = Duration::MAX;
    for seed in 0..3 {
        let (_, took, chain) = answer(reference, &view, seed).await;
        best = best.min(took);
        chain.close().await;
    }
    first.shutdown();
    second.shutdown();
    best
}

/// The pusher of blocks 0..2 failing its pushes with `fault`, the honest
/// server of 2..4 after it, and (when `replica`) an honest, slower replica
/// of 0..2, so that routes choose the liar first.
struct Swarm {
    liar: RunningServer,
    receiver: RunningServer,
    replica: Option<RunningServer>,
}

impl Swarm {
    async fn start(fault: &str, replica: bool) -> Self {
        let liar = start_server(
            "0:2",
            None,
            &["--update-period", "1s", "--push-fault", fault],
        )
        .await;
        let boot = liar.tcp_addr().unwrap().to_string();
        let receiver = start_server("2:4", Some(&boot), &["--update-period", "1s"]).await;
        let replica = match replica {
            true => Some(
                start_server(
                    "0:2",
                    Some(&boot),
                    &["--update-period", "1s", "--step-delay-ms", "30"],
                )
                .await,
            ),
            false => None,
        };
        Swarm {
            liar,
            receiver,
            replica,
        }
    }

    fn honest(&self) -> Vec<String> {
        std::iter::once(&self.receiver)
            .chain(&self.replica)
            .map(|s| s.peer_id().to_string())
            .collect()
    }

    fn shutdown(self) {
        self.liar.shutdown();
        self.receiver.shutdown();
        if let Some(replica) = self.replica {
            replica.shutdown();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pusher_answers_for_its_push_and_the_server_after_it_is_never_blamed() {
    let reference = Reference::load();
    let calm = calm_time(&reference).await;
    let bound = calm * 3 + ALLOWANCE;
    let mut slowest = Duration::ZERO;
    for (case, fault) in FAULTS.into_iter().enumerate() {
        for replica in [true, false] {
            let swarm = Swarm::start(fault, replica).await;
            let liar = swarm.liar.peer_id().to_string();
            let boot = swarm.liar.tcp_addr().unwrap().clone();
            let node = connect(&[boot]).await.unwrap();
            until_servers(&node, 2 + usize::from(replica)).await;
            let view = SwarmView::new(node, &settings(greedy(0).max_length()));
            let what = format!("{fault}, replica of the pusher: {replica}");
            // Two answers through one view, as a client keeps one: the first
            // meets the fault, the second what the first learnt.
            for seed in [case as u64, case as u64 + 10] {
                let (tokens, took, mut chain) = answer(&reference, &view, seed).await;
                assert_eq!(tokens, reference.tokens_for(&greedy(seed)).await, "{what}");
                assert!(
                    took <= bound,
                    "{what}: the answer took {took:?}, over 3 x {calm:?} + {ALLOWANCE:?}"
                );
                slowest = slowest.max(took);
                let recoveries = chain.take_recoveries();
                assert!(
                    recoveries.iter().all(|r| r.failed_peer == liar),
                    "{what}: an honest server was blamed: {recoveries:?}"
                );
                let suspects = chain.take_suspects();
                assert!(
                    suspects.iter().all(|s| *s == liar),
                    "{what}: an honest server was named: {suspects:?}"
                );
                for honest in swarm.honest() {
                    assert!(!view.is_banned(&honest), "{what}: {honest} was banned");
                }
                if seed == case as u64 {
                    assert_eq!(
                        suspects,
                        std::slice::from_ref(&liar),
                        "{what}: the pusher was not named"
                    );
                    if replica {
                        assert!(
                            recoveries
                                .iter()
                                .any(|r| r.error.contains("did not deliver its push")),
                            "{what}: {recoveries:?}"
                        );
                    }
                }
                if replica {
                    assert!(
                        chain.route().iter().all(|h| h.peer_id != liar),
                        "{what}: the pusher is still in the route"
                    );
                    assert!(
                        chain.take_pushed_steps() > 0,
                        "{what}: steps go by push again after the pusher's replacement"
                    );
                } else {
                    assert!(
                        chain.route().iter().any(|h| h.peer_id == liar),
                        "{what}: the only server of blocks 0..2 is kept"
                    );
                }
                chain.close().await;
            }
            swarm.shutdown();
        }
    }
    println!(
        "push faults: {} answers token-identical, slowest {slowest:?} (calm {calm:?}), \
         the pusher named, no honest server blamed",
        FAULTS.len() * 4
    );
    Figures::of(
        "trust::push_faults::a_pusher_answers_for_its_push_and_the_server_after_it_is_never_blamed",
    )
    .set("answers", FAULTS.len() * 4)
    .set("calm_ms", calm.as_millis())
    .set("slowest_ms", slowest.as_millis())
    .save();
}

/// A server early in the route knows the later sessions' tokens (the client
/// gives each server the rest of its route): one that pushes its own output
/// into a later session, before that session's predecessor does, is named
/// by its own signature in the intruded session's proof; the intruded server
/// is carried the step and never blamed, nor is the one before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_pushing_into_a_later_session_is_named_by_its_signature() {
    let reference = Reference::load();
    let flags = ["--update-period", "1s"];
    let mut named = 0;
    for replica in [true, false] {
        let liar = start_server(
            "0:2",
            None,
            &["--update-period", "1s", "--push-fault", "intrude"],
        )
        .await;
        let boot = liar.tcp_addr().unwrap().to_string();
        let middle = start_server("2:3", Some(&boot), &flags).await;
        let last = start_server("3:4", Some(&boot), &flags).await;
        let slower = ["--update-period", "1s", "--step-delay-ms", "30"];
        let replica = match replica {
            true => Some(start_server("0:2", Some(&boot), &slower).await),
            false => None,
        };
        let liar_id = liar.peer_id().to_string();
        let honest: Vec<String> = [&middle, &last]
            .into_iter()
            .chain(&replica)
            .map(|s| s.peer_id().to_string())
            .collect();
        let node = connect(&[boot.parse().unwrap()]).await.unwrap();
        until_servers(&node, 3 + usize::from(replica.is_some())).await;
        let view = SwarmView::new(node, &settings(greedy(0).max_length()));
        for seed in [0, 10] {
            let (tokens, _, mut chain) = answer(&reference, &view, seed).await;
            let what = format!("seed {seed}, replica: {}", replica.is_some());
            assert_eq!(tokens, reference.tokens_for(&greedy(seed)).await, "{what}");
            let recoveries = chain.take_recoveries();
            assert!(
                recoveries.iter().all(|r| r.failed_peer == liar_id),
                "{what}: an honest server was blamed: {recoveries:?}"
            );
            let suspects = chain.take_suspects();
            assert!(
                suspects.iter().all(|s| *s == liar_id),
                "{what}: an honest server was named: {suspects:?}"
            );
            named += usize::from(!suspects.is_empty());
            for peer in &honest {
                assert!(!view.is_banned(peer), "{what}: {peer} was banned");
            }
            chain.close().await;
        }
        for server in [liar, middle, last].into_iter().chain(replica) {
            server.shutdown();
        }
    }
    assert_eq!(named, 2, "the intruder was named in each first answer");
    println!("an intruding pusher: 4 answers token-identical, named in both first answers");
    Figures::of(
        "trust::push_faults::a_server_pushing_into_a_later_session_is_named_by_its_signature",
    )
    .set("answers", 4)
    .save();
}
