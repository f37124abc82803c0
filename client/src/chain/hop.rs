//! One hop of the route and running a step through its sessions.

use corolla_shared::session::{RemoteSession, SessionError};
use corolla_shared::TensorPayload;
use web_time::Instant;

use crate::route::Hop;
use crate::spot_check::Witness;
use crate::swarm_view::SwarmView;

/// One hop of the original route: blocks `start..end`, served now by one
/// or more sessions, with every input it was sent, for replay.
pub(super) struct HopState {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) sessions: Vec<(Hop, RemoteSession)>,
    pub(super) history: Vec<(u32, TensorPayload)>,
    /// Spot checks' independent computation of these blocks, and how many
    /// entries of `history` it has been fed.
    pub(super) witness: Option<(Witness, usize)>,
    /// Steps in a row on which a server of this hop was late (see `slow.rs`).
    pub(super) slow_strikes: u32,
}

impl HopState {
    pub(super) fn new(hop: Hop, session: RemoteSession) -> Self {
        HopState {
            start: hop.start,
            end: hop.end,
            sessions: vec![(hop, session)],
            history: Vec::new(),
            witness: None,
            slow_strikes: 0,
        }
    }

    pub(super) fn peers(&self) -> Vec<String> {
        self.sessions
            .iter()
            .map(|(h, _)| h.peer_id.clone())
            .collect()
    }
}

/// Runs `input` through `sessions` in turn; one-position steps are timed
/// into `view`, which routes by what the client measured.
pub(super) async fn run_sessions(
    view: &SwarmView,
    sessions: &mut [(Hop, RemoteSession)],
    start: u32,
    input: &TensorPayload,
) -> Result<TensorPayload, SessionError> {
    let decode = input.shape.get(1) == Some(&1);
    let mut x = input.clone();
    for (hop, s) in sessions.iter_mut() {
        let started = Instant::now();
        x = s.step(start, &x).await?;
        if decode {
            view.record_step(
                &hop.peer_id,
                started.elapsed().as_secs_f64(),
                hop.end - hop.start,
            );
        }
    }
    Ok(x)
}
