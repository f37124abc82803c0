//! Rebalancing: every update period (give or take a quarter, so servers do
//! not all look at once) a server that chose its own blocks reads the swarm
//! and, when it is the server whose move would raise the swarm's weakest
//! block the most (see [`crate::placement::best_move`]), drains its
//! sessions, puts its span down, loads the new one and announces it.

use std::sync::Arc;
use std::time::Duration;

use corolla_shared::node::NodeHandle;

use crate::error::ServerError;
use crate::host::{SpanHost, SpanLoader};
use crate::host_settings::HostSettings;
use crate::placement::{best_move, Move};
use crate::quota::Quota;

/// How long one look at the swarm may take.
const DISCOVER_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) struct Rebalancer {
    pub node: NodeHandle,
    pub host: Arc<SpanHost>,
    pub settings: Arc<HostSettings>,
    pub loader: SpanLoader,
    pub sessions: Arc<Quota>,
    pub num_layers: usize,
    pub period: Duration,
    /// `--balance-quality`: the least gain of the weakest block worth a move.
    pub quality: f64,
    pub drain_timeout: Duration,
}

impl Rebalancer {
    pub async fn run(self) {
        loop {
            let jitter = 0.75 + rand::random::<f64>() / 2.0;
            tokio::time::sleep(self.period.mul_f64(jitter)).await;
            let Some(m) = self.my_move().await else {
                continue;
            };
            if let Err(e) = self.move_to(&m).await {
                tracing::error!(error = %e, "could not move; this server stops serving");
                return;
            }
        }
    }

    /// The swarm's best move, if it is this server's.
    async fn my_move(&self) -> Option<Move> {
        let me = self.node.peer_id().to_string();
        let mine = self.host.ctx()?.record();
        let mut records = match self.node.discover(&mine.model, DISCOVER_TIMEOUT).await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the swarm to rebalance");
                return None;
            }
        };
        // What this server holds now, whatever copy the DHT returned.
        records.retain(|r| r.peer_id != me);
        records.push(mine);
        let m = best_move(self.num_layers, &records, self.quality)?;
        (m.peer_id == me).then_some(m)
    }

    /// Drains, swaps the span and announces the new one. Should the new
    /// blocks not load, the old ones are loaded again; an error means the
    /// server holds nothing.
    async fn move_to(&self, m: &Move) -> Result<(), ServerError> {
        tracing::info!(
            from = ?m.from,
            to = ?m.to,
            weakest_before = m.weakest_before,
            weakest_after = m.weakest_after,
            "moving to where the swarm is weakest"
        );
        if let Err(e) = self.node.leave().await {
            tracing::debug!(error = %e, "could not withdraw the record");
        }
        if let Some(old) = self.host.put_down() {
            old.tell_sessions_to_leave();
            self.sessions
                .drained_by(tokio::time::Instant::now() + self.drain_timeout)
                .await;
            // The old span's memory is given back before the new one is loaded.
            drop(old);
        }
        let loaded = match self.loader.load(m.to.0, m.to.1).await {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::warn!(error = %e, to = ?m.to, "the new blocks did not load; taking the old ones back");
                self.loader.load(m.from.0, m.from.1).await?
            }
        };
        let hosted = self.settings.host(loaded)?;
        let announcement = self.settings.announcement(&hosted);
        self.host.pick_up(hosted);
        self.node
            .announce(Some(announcement))
            .await
            .map_err(|e| ServerError::Network(e.to_string()))?;
        tracing::info!(blocks = ?m.to, "serving the new blocks");
        Ok(())
    }
}
