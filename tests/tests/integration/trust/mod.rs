//! Attacks by one stranger on the swarm, each of which must fail: locking a
//! server's sessions, costing it memory with announced lengths, forging its
//! DHT record, lying about speed and outputs, and corrupting activations.
//! While they run, an honest client's tokens stay those of the whole model.

use std::sync::Arc;
use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_client::spot_check::Referee;
use corolla_model::{Checkpoint, DType, Device};
use corolla_server::RunningServer;
use corolla_shared::node::NodeHandle;
use corolla_tests::{start_server, tiny_llama};

use super::tiny_reference::MODEL;

mod liars;
mod limits;
mod push_faults;
mod rechecks;
mod records;
mod refusals;

/// Waits (at most 30 s: tests run side by side on two cores) until the DHT
/// lists `count` servers of the model.
pub(crate) async fn until_servers(node: &NodeHandle, count: usize) {
    let started = Instant::now();
    while node
        .discover(MODEL, Duration::from_secs(2))
        .await
        .unwrap()
        .len()
        < count
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "fewer than {count} servers announced"
        );
    }
}

/// The client's own blocks, for third opinions.
fn referee() -> Referee {
    let checkpoint = Arc::new(Checkpoint::open(tiny_llama()).unwrap());
    Referee::new(checkpoint, DType::F32, Device::Cpu).expect("the fixture holds every block")
}

/// Blocks 0..2 on one server; 2..4 on an honest replica and on a liar
/// answering a share of steps wrong (`--corrupt-outputs`). The honest
/// replica is the slower one, so routes choose the liar.
struct ReplicaLiar {
    first: RunningServer,
    honest: RunningServer,
    liar: RunningServer,
}

impl ReplicaLiar {
    async fn start(corrupt_outputs: &str) -> Self {
        let first = start_server("0:2", None, &["--update-period", "1s"]).await;
        let boot = first.tcp_addr().unwrap().to_string();
        let honest = start_server(
            "2:4",
            Some(&boot),
            &["--update-period", "1s", "--step-delay-ms", "30"],
        )
        .await;
        let liar = start_server(
            "2:4",
            Some(&boot),
            &[
                "--update-period",
                "1s",
                "--corrupt-outputs",
                corrupt_outputs,
            ],
        )
        .await;
        ReplicaLiar {
            first,
            honest,
            liar,
        }
    }

    fn honest_id(&self) -> String {
        self.honest.peer_id().to_string()
    }

    fn liar_id(&self) -> String {
        self.liar.peer_id().to_string()
    }

    /// A client that sees all three servers.
    async fn client(&self) -> NodeHandle {
        let node = connect(std::slice::from_ref(self.first.tcp_addr().unwrap()))
            .await
            .unwrap();
        until_servers(&node, 3).await;
        node
    }

    fn shutdown(self) {
        for s in [self.first, self.honest, self.liar] {
            s.shutdown();
        }
    }
}
