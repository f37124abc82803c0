//! Surviving a server's failure: the hop's sessions are reopened (after a
//! pause the server may only have expired them) or replaced by another
//! route for exactly its blocks, and the hop's history is replayed so the
//! new caches hold the same numbers.

use corolla_shared::session::{RemoteSession, SessionError};
use corolla_shared::TensorPayload;
use serde::Serialize;
use web_time::Instant;

use super::hop::run_sessions;
use super::RemoteChain;
use crate::error::ClientError;
use crate::route::Hop;

/// One failure the chain survived.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// The forward call that failed: 0 is the prompt's prefill.
    pub step: usize,
    /// The first position of that call.
    pub position: usize,
    pub failed_peer: String,
    pub error: String,
    /// The blocks whose servers were replaced.
    pub start: usize,
    pub end: usize,
    pub replacement: Vec<Hop>,
    /// From the failure until the replacement had caught up.
    pub seconds: f64,
}

/// What a failed session says, without the peer's name (the caller adds it).
pub(super) fn failure_reason(e: &SessionError) -> String {
    match e {
        SessionError::Remote { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

impl RemoteChain {
    /// After a pause, reopens hop `index` on the servers it had and replays
    /// its history: servers expire idle sessions, which is no fault of theirs.
    pub(super) async fn reopen_expired(
        &mut self,
        index: usize,
        error: &SessionError,
        position: usize,
    ) -> bool {
        let started = Instant::now();
        let route: Vec<Hop> = self.hops[index]
            .sessions
            .iter()
            .map(|(hop, _)| hop.clone())
            .collect();
        match self.rebuild(index, &route).await {
            Ok((sessions, _)) => {
                tracing::debug!(%error, "reopened sessions after a pause");
                self.hops[index].sessions = sessions;
                self.recoveries.push(Recovery {
                    step: self.steps,
                    position,
                    failed_peer: error.peer().to_string(),
                    error: error.to_string(),
                    start: self.hops[index].start,
                    end: self.hops[index].end,
                    replacement: route,
                    seconds: started.elapsed().as_secs_f64(),
                });
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "reopening after a pause failed");
                false
            }
        }
    }

    /// Replaces the servers of hop `index` after `error`, replaying its
    /// history. When the server was caught lying, what the replacement
    /// computes from that history is compared with what the liar returned
    /// for it (`RemoteChain::recheck`).
    pub(super) async fn recover(
        &mut self,
        index: usize,
        error: &SessionError,
        position: usize,
    ) -> Result<(), ClientError> {
        let started = Instant::now();
        let failed = error.peer().to_string();
        tracing::warn!(peer = %failed, %error, "server failed; finding a replacement");
        self.view
            .ban_for(&failed, error.kind(), &failure_reason(error));
        let (from, to) = (self.hops[index].start, self.hops[index].end);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let route = self.find_route(from, to).await?;
            match self.rebuild(index, &route).await {
                Ok((sessions, replayed)) => {
                    if matches!(error, SessionError::Caught { .. }) {
                        self.recheck(index, &replayed);
                    }
                    let old = std::mem::replace(&mut self.hops[index].sessions, sessions);
                    for (_, s) in old {
                        drop(s);
                    }
                    self.recoveries.push(Recovery {
                        step: self.steps,
                        position,
                        failed_peer: failed,
                        error: error.to_string(),
                        start: from,
                        end: to,
                        replacement: route,
                        seconds: started.elapsed().as_secs_f64(),
                    });
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "replacement failed too");
                    if let ClientError::Session(se) = &e {
                        self.view
                            .ban_for(&se.peer().to_string(), se.kind(), &failure_reason(se));
                    }
                    if attempts > self.settings.max_retries {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Opens sessions along `route` and replays hop `index`'s history
    /// through them; returns them with their output for each entry.
    async fn rebuild(
        &mut self,
        index: usize,
        route: &[Hop],
    ) -> Result<(Vec<(Hop, RemoteSession)>, Vec<TensorPayload>), ClientError> {
        // The new sessions may push on to the next hop's server.
        let after = self
            .hops
            .get(index + 1)
            .and_then(|next| next.sessions.first())
            .map(|(_, s)| s.peer());
        let mut sessions: Vec<(Hop, RemoteSession)> = route
            .iter()
            .cloned()
            .zip(self.open_all(route, after).await?)
            .collect();
        let history = std::mem::take(&mut self.hops[index].history);
        let mut outputs = Vec::with_capacity(history.len());
        let mut replayed = Ok(());
        for (start, input) in &history {
            match run_sessions(&self.view, &mut sessions, *start, input).await {
                Ok(out) => outputs.push(out),
                Err(e) => {
                    replayed = Err(e);
                    break;
                }
            }
        }
        self.hops[index].history = history;
        replayed?;
        Ok((sessions, outputs))
    }
}
