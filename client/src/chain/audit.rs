//! Spot checks: a sampled step's output is compared with a witness's
//! (other servers of the blocks, else the client's own copy); when they
//! differ a third opinion decides who lied, and only a server outvoted is
//! banned. A server caught lying may have lied on steps nobody checked:
//! its replacement's replay of the hop's history is compared with what the
//! liar returned, and the answer is computed again from the first
//! position where they differ (`recheck`).

use std::collections::HashSet;
use std::time::Duration;

use corolla_shared::session::SessionError;
use corolla_shared::time::with_timeout;
use corolla_shared::{ErrorKind, TensorPayload};
use libp2p::PeerId;

use super::RemoteChain;
use crate::spot_check::{agree_within, tolerance_on_the_wire, Witness, WitnessError};

/// Witnesses (and third opinions) asked for one check before giving up:
/// servers that fail are replaced by others, then by the client's own
/// blocks where it has them.
const WITNESS_TRIES: usize = 3;

/// A witness is given this many times what the primary's step is expected
/// to take (measured, else announced) for what it is asked, and at least
/// [`WITNESS_WAIT_FLOOR`]: a crowd of fakes that accept a session and stay
/// silent then costs about a second each, not a step timeout each.
const WITNESS_WAIT_FACTOR: f64 = 4.0;
const WITNESS_WAIT_FLOOR: Duration = Duration::from_secs(1);

/// Why a server caught by a spot check is banned.
const WRONG_ACTIVATIONS: &str = "returned wrong activations (spot check)";

/// What a new witness is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Witness,
    ThirdOpinion,
}

/// The positions a step's activations carry.
fn positions(payload: &TensorPayload) -> usize {
    payload.shape.get(1).copied().unwrap_or(1).max(1)
}

/// The first of `peers` as a peer id (they came from parsed records).
fn first_peer(peers: &[String]) -> PeerId {
    peers
        .first()
        .and_then(|p| p.parse().ok())
        .unwrap_or(PeerId::random())
}

impl RemoteChain {
    /// Checks `primary`, hop `index`'s output for `input`, against a
    /// witness. Returns the output to go on with; `Err` names a primary
    /// server found lying (the caller replaces it and repeats the step).
    pub(super) async fn spot_check(
        &mut self,
        index: usize,
        start: u32,
        input: &TensorPayload,
        primary: TensorPayload,
    ) -> Result<TensorPayload, SessionError> {
        let primary_peers = self.hops[index].peers();
        let Some(witnessed) = self
            .witness_output(index, start, input, &primary_peers)
            .await
        else {
            return Ok(primary);
        };
        let tolerance = tolerance_on_the_wire(primary.dtype, self.settings.compression);
        let agree = move |a: &TensorPayload, b: &TensorPayload| agree_within(a, b, tolerance);
        if agree(&primary, &witnessed) {
            self.passed(&primary_peers);
            return Ok(primary);
        }
        let witness_peers = self.hops[index]
            .witness
            .as_ref()
            .map(|(w, _)| w.peers())
            .unwrap_or_default();
        tracing::warn!(
            primary = ?primary_peers,
            witness = ?witness_peers,
            "spot check: outputs differ; asking a third opinion"
        );
        if witness_peers.is_empty() {
            // The client's own computation needs no second opinion.
            self.suspect(&primary_peers, WRONG_ACTIVATIONS);
            return Err(SessionError::Caught {
                peer: first_peer(&primary_peers),
            });
        }
        let exclude: HashSet<String> = primary_peers
            .iter()
            .chain(&witness_peers)
            .cloned()
            .collect();
        let third = self.third_opinion(index, start, input, &exclude).await;
        let Some(third) = third else {
            // Nobody can tell which of the two lied: both are reported,
            // neither is banned.
            tracing::warn!("spot check undecided: no third opinion to be had");
            self.report(&primary_peers);
            self.report(&witness_peers);
            return Ok(primary);
        };
        match (agree(&third, &primary), agree(&third, &witnessed)) {
            (true, false) => {
                // The witness lied; the next check finds another.
                self.passed(&primary_peers);
                self.suspect(&witness_peers, WRONG_ACTIVATIONS);
                if let Some((w, _)) = self.hops[index].witness.take() {
                    w.close().await;
                }
                Ok(primary)
            }
            (false, true) => {
                self.suspect(&primary_peers, WRONG_ACTIVATIONS);
                Err(SessionError::Caught {
                    peer: first_peer(&primary_peers),
                })
            }
            _ => {
                tracing::warn!("spot check undecided: three different outputs");
                self.report(&primary_peers);
                self.report(&witness_peers);
                Ok(primary)
            }
        }
    }

    /// After a server of hop `index` was caught lying and replaced: compares
    /// `replayed`, the replacement's outputs for the hop's history, with
    /// what the liar returned for it (the next hop's inputs, or the route's
    /// outputs for the last hop). From the first entry that differs on,
    /// the answer was computed from lies (`BlockChain::take_tainted`).
    pub(super) fn recheck(&mut self, index: usize, replayed: &[TensorPayload]) {
        let returned = match self.hops.get(index + 1) {
            Some(next) => &next.history,
            None => &self.returned,
        };
        let history = &self.hops[index].history;
        let first_lie =
            history
                .iter()
                .zip(replayed)
                .enumerate()
                .find_map(|(i, ((start, _), honest))| {
                    let tolerance = tolerance_on_the_wire(honest.dtype, self.settings.compression);
                    match returned.get(i) {
                        Some((at, liar))
                            if at == start && agree_within(liar, honest, tolerance) =>
                        {
                            None
                        }
                        _ => Some(*start as usize),
                    }
                });
        if let Some(position) = first_lie {
            tracing::warn!(
                position,
                hop = index,
                "the caught server had lied unchecked before: the answer from there is computed again"
            );
            self.tainted = Some(self.tainted.map_or(position, |t| t.min(position)));
        }
    }

    /// Bans `peers`, caught lying (`how`), and reports them.
    pub(super) fn suspect(&mut self, peers: &[String], how: &str) {
        for peer in peers {
            self.view.ban_for(peer, ErrorKind::BadServer, how);
        }
        self.report(peers);
    }

    /// Counts a check `peers` passed: they are checked less often from now on.
    fn passed(&self, peers: &[String]) {
        for peer in peers {
            self.view.record_clean_check(peer);
        }
    }

    /// Reports `peers` in the answer's suspects.
    pub(super) fn report(&mut self, peers: &[String]) {
        for peer in peers {
            if !self.suspects.contains(peer) {
                self.suspects.push(peer.clone());
            }
        }
    }

    /// The witness's output for `input`, after feeding it what it has not
    /// seen of the history; a witness is found first when there is none:
    /// other servers of the hop's blocks, else the client's own copy.
    async fn witness_output(
        &mut self,
        index: usize,
        start: u32,
        input: &TensorPayload,
        primary_peers: &[String],
    ) -> Option<TensorPayload> {
        // A recovery may have moved the hop onto the witness's servers.
        if let Some((w, _)) = &self.hops[index].witness {
            if w.peers().iter().any(|p| primary_peers.contains(p)) {
                if let Some((w, _)) = self.hops[index].witness.take() {
                    w.close().await;
                }
            }
        }
        // A witness that fails (a server dying, leaving) is replaced: were
        // the step let through unchecked, a liar could wait for that moment.
        let mut exclude: HashSet<String> = primary_peers
            .iter()
            .chain(&self.failed_witnesses)
            .cloned()
            .collect();
        for _ in 0..WITNESS_TRIES {
            if self.hops[index].witness.is_none() {
                let witness = self.new_witness(index, &exclude, Role::Witness).await?;
                self.hops[index].witness = Some((witness, 0));
            }
            let deadline = {
                let hop = &self.hops[index];
                let fed = hop.witness.as_ref().map_or(0, |(_, fed)| *fed);
                let unseen = hop.history[fed.min(hop.history.len())..]
                    .iter()
                    .map(|(_, p)| positions(p))
                    .sum::<usize>();
                self.witness_wait(index, unseen + positions(input))
            };
            let hop = &mut self.hops[index];
            let (witness, fed) = hop.witness.as_mut()?;
            // A caught step was fed but never entered the history.
            let fed_before = (*fed).min(hop.history.len());
            // The client's own blocks take what they take; servers are timed.
            let local = witness.peers().is_empty();
            let work = async {
                witness.replay(&hop.history[fed_before..]).await?;
                witness.step(start, input).await
            };
            let answered = if local {
                Ok(work.await)
            } else {
                with_timeout(deadline, work).await
            };
            match answered {
                Ok(Ok(out)) => {
                    *fed = hop.history.len() + 1;
                    return Some(out);
                }
                failure => {
                    let failed = witness.peers();
                    // A witness server that fails or is late is passed over
                    // like any failed server (its host and record suspect),
                    // so copies of its record are not asked next.
                    let why = match failure {
                        Err(_) => Some((
                            ErrorKind::Unreachable,
                            format!("did not answer within {deadline:?} as a witness"),
                        )),
                        Ok(Err(WitnessError::Server(e))) => {
                            tracing::debug!(error = %e, "a witness failed");
                            Some((e.kind(), format!("failed as a witness: {e}")))
                        }
                        Ok(Err(WitnessError::Local(e))) => {
                            tracing::warn!(error = %e, "the client's own check failed");
                            None
                        }
                        Ok(Ok(_)) => None,
                    };
                    if let Some((kind, why)) = why {
                        for peer in &failed {
                            self.view.ban_for(peer, kind, &why);
                        }
                        self.failed_witnesses.extend(failed.iter().cloned());
                    }
                    let hop = &mut self.hops[index];
                    if let Some((w, _)) = hop.witness.take() {
                        w.close().await;
                    }
                    if failed.is_empty() {
                        // The client's own blocks failed: nobody else to ask.
                        return None;
                    }
                    exclude.extend(failed);
                }
            }
        }
        None
    }

    /// How long a witness of hop `index` may take for `positions`; see
    /// [`WITNESS_WAIT_FACTOR`].
    fn witness_wait(&self, index: usize, positions: usize) -> Duration {
        let expected = self.hops[index]
            .sessions
            .iter()
            .map(|(hop, _)| self.view.expected_step_seconds(hop))
            .sum::<f64>()
            * positions.max(1) as f64;
        Duration::from_secs_f64(
            (WITNESS_WAIT_FACTOR * expected)
                .max(WITNESS_WAIT_FLOOR.as_secs_f64())
                .min(self.settings.timeout.as_secs_f64()),
        )
    }

    /// A witness for hop `index` that uses none of `exclude`: other servers
    /// (when the view has them), else the client's own copy of the blocks:
    /// always as a third opinion, as the witness only when every step is
    /// checked (a local witness computes everything the hop computes).
    async fn new_witness(
        &mut self,
        index: usize,
        exclude: &HashSet<String>,
        role: Role,
    ) -> Option<Witness> {
        let (from, to) = (self.hops[index].start, self.hops[index].end);
        if let Some(route) = self.view.plan_excluding(from, to, &self.settings, exclude) {
            match self.open_all(&route, None).await {
                Ok(sessions) => {
                    return Some(Witness::Servers(route.into_iter().zip(sessions).collect()))
                }
                Err(e) => tracing::debug!(error = %e, "cannot open a witness"),
            }
        }
        if role == Role::Witness && self.settings.spot_check < 1.0 {
            return None;
        }
        let referee = self.settings.referee.as_ref()?;
        match Witness::local(referee, (from, to), self.settings.max_length) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot check servers with the client's own blocks");
                None
            }
        }
    }

    /// A third computation of `input` on hop `index`, from scratch.
    async fn third_opinion(
        &mut self,
        index: usize,
        start: u32,
        input: &TensorPayload,
        exclude: &HashSet<String>,
    ) -> Option<TensorPayload> {
        let mut exclude = exclude.clone();
        for _ in 0..WITNESS_TRIES {
            let mut third = self
                .new_witness(index, &exclude, Role::ThirdOpinion)
                .await?;
            let history = std::mem::take(&mut self.hops[index].history);
            let out = match third.replay(&history).await {
                Ok(_) => third.step(start, input).await.ok(),
                Err(_) => None,
            };
            self.hops[index].history = history;
            let asked = third.peers();
            third.close().await;
            if out.is_some() || asked.is_empty() {
                return out;
            }
            // That server failed (not lied): ask another, at last the
            // client's own blocks.
            exclude.extend(asked);
        }
        None
    }
}
