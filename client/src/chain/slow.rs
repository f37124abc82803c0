//! Leaving a server slower than it claims: a step deadline derived from
//! what the client measured. A server that answers correctly but far later
//! than another server of the same blocks is expected to (by that one's
//! measured or announced speed) is left after [`SLOW_STRIKES`] such steps
//! in a row, like a failed one: banned, its blocks replayed elsewhere.

use std::collections::HashSet;
use std::time::Duration;

use corolla_shared::session::SessionError;

use super::RemoteChain;

/// A hop this many times slower than the best alternative for its blocks
/// is late...
const SLOW_FACTOR: f64 = 4.0;
/// ...and this many seconds per step: no deadline is shorter (loopback
/// steps of a few milliseconds differ by factors that cost nothing).
const SLOW_MARGIN: f64 = 0.5;
/// Late steps in a row after which the server is left.
const SLOW_STRIKES: u32 = 2;

impl RemoteChain {
    /// After a step: counts each hop late or not, and replaces the servers
    /// of a hop late [`SLOW_STRIKES`] times in a row. The step's output is
    /// already taken; a replacement that fails keeps the slow server.
    pub(super) async fn leave_slow_servers(&mut self, position: usize) {
        for index in 0..self.hops.len() {
            let Some(late) = self.late_server(index) else {
                self.hops[index].slow_strikes = 0;
                continue;
            };
            self.hops[index].slow_strikes += 1;
            if self.hops[index].slow_strikes < SLOW_STRIKES {
                continue;
            }
            self.hops[index].slow_strikes = 0;
            if let Err(e) = self.recover(index, &late, position).await {
                tracing::warn!(error = %e, "could not leave a slow server; keeping it");
            }
        }
    }

    /// The first server of hop `index` whose measured step time breaks the
    /// deadline the best alternative sets, as the timeout it broke.
    fn late_server(&self, index: usize) -> Option<SessionError> {
        let max_length = self.settings.max_length;
        self.hops[index].sessions.iter().find_map(|(hop, session)| {
            // Under the floor no deadline can be broken: skip planning an
            // alternative on every fast step.
            let measured = self
                .view
                .measured_seconds(hop)
                .filter(|m| *m > SLOW_MARGIN)?;
            let exclude = HashSet::from([hop.peer_id.clone()]);
            let others = self
                .view
                .plan_excluding(hop.start, hop.end, &self.settings, &exclude)?;
            let deadline =
                (self.view.expected_seconds(&others, max_length) * SLOW_FACTOR).max(SLOW_MARGIN);
            (measured > deadline).then(|| SessionError::Timeout {
                peer: session.peer(),
                timeout: Duration::from_secs_f64(deadline),
            })
        })
    }
}
