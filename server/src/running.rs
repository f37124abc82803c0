//! A server running in this process: what tests and the binary ask of it,
//! and how it stops (at once, or leaving gracefully).

use std::sync::Arc;
use std::time::Duration;

use corolla_shared::node::NodeHandle;
use corolla_shared::ServerRecord;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use tokio::task::JoinHandle;

use crate::compute::ComputeFigures;
use crate::host::SpanHost;
use crate::metrics::ServerMetrics;
use crate::quota::Quota;

/// How long a leaving server stays reachable after its sessions ended, so
/// that clients between two steps still read why (and not a closed connection).
const GOODBYE_TIME: Duration = Duration::from_secs(2);

/// A server running in this process. Dropping it stops it.
pub struct RunningServer {
    pub(crate) peer_id: PeerId,
    pub(crate) addrs: Vec<Multiaddr>,
    pub(crate) model: String,
    pub(crate) node: NodeHandle,
    pub(crate) tasks: Vec<JoinHandle<()>>,
    /// Moves the blocks; stopped first when the server leaves.
    pub(crate) rebalancer: Option<JoinHandle<()>>,
    pub(crate) http: Option<String>,
    pub(crate) host: Arc<SpanHost>,
    pub(crate) sessions: Arc<Quota>,
    pub(crate) drain_timeout: Duration,
    pub(crate) metrics: ServerMetrics,
}

impl RunningServer {
    /// `http://HOST:PORT` when the server serves HTTP.
    pub fn http_url(&self) -> Option<&str> {
        self.http.as_deref()
    }

    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// Listen addresses, each ending in `/p2p/<peer id>`.
    pub fn addrs(&self) -> &[Multiaddr] {
        &self.addrs
    }

    /// The TCP address: what native peers dial.
    pub fn tcp_addr(&self) -> Option<&Multiaddr> {
        self.addrs.iter().find(|a| {
            a.iter().any(|p| matches!(p, Protocol::Tcp(_)))
                && !a.iter().any(|p| matches!(p, Protocol::Ws(_)))
        })
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// The blocks served now (a rebalancing server moves them).
    pub fn blocks(&self) -> (usize, usize) {
        self.host.blocks()
    }

    /// The announced record of the moment, live figures included.
    pub fn record(&self) -> ServerRecord {
        self.host.record()
    }

    pub fn node(&self) -> &NodeHandle {
        &self.node
    }

    /// The series `/metrics` serves.
    pub fn metrics(&self) -> &ServerMetrics {
        &self.metrics
    }

    /// What the compute core has done so far (decode batches, prefill chunks).
    pub fn compute_figures(&self) -> ComputeFigures {
        self.host
            .ctx()
            .map(|ctx| ctx.core.figures())
            .unwrap_or_default()
    }

    /// Stops listening, announcing and serving at once, as a crash would.
    pub fn shutdown(mut self) {
        self.abort();
    }

    /// Leaves gracefully: new sessions are refused, running steps finish
    /// and then every open session gets an error frame saying the server
    /// is leaving (its client replays elsewhere at once), the DHT gets a
    /// signed last record saying so and loses the provider entry; it stops
    /// once every session has ended, or after `--drain-timeout`.
    pub async fn leave(mut self) {
        if let Some(r) = self.rebalancer.take() {
            r.abort();
        }
        let hosted = self.host.put_down();
        if let Some(h) = &hosted {
            h.tell_sessions_to_leave();
        }
        let started = tokio::time::Instant::now();
        if let Err(e) = self.node.leave().await {
            tracing::debug!(error = %e, "could not tell the DHT");
        }
        let deadline = started + self.drain_timeout;
        let left = self.sessions.drained_by(deadline).await;
        if left > 0 {
            tracing::warn!(
                sessions = left,
                "drain timeout: stopping with sessions open"
            );
        }
        // The goodbye frames are written; clients between steps read them
        // when they next write.
        let room = deadline.saturating_duration_since(tokio::time::Instant::now());
        tokio::time::sleep(GOODBYE_TIME.min(room)).await;
        self.abort();
    }

    fn abort(&mut self) {
        for t in self.tasks.drain(..).chain(self.rebalancer.take()) {
            t.abort();
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.abort();
    }
}
