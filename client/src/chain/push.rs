//! Steps by push: the client sends a step to the first server, each server
//! pushes its output to the next, and every hop's output still comes back
//! to the client (kept for replay, and spot-checked as usual). Each pushed
//! output comes back with its sender's signed digest of what it pushed
//! (`corolla_shared::push_proof`), checked against what the sender
//! returned: a server that pushes other numbers than it returns is the one
//! blamed, never the server after it.
//!
//! A push that does not come (nothing sent, a forged proof, a replay, too
//! late) is the pusher's to answer for: the client waits for the receiver's
//! output only a few times its expected step time (or until the receiver
//! says it refused the push), then carries the step to the receiver itself.
//! A receiver that answers that step has shown it works; the pusher is
//! charged (`settle_missed_push`) and replaced when another server holds
//! its blocks, else its outputs go through the client from then on.

use std::collections::HashSet;
use std::time::Duration;

use corolla_shared::hop_trace;
use corolla_shared::protocol::{PushTarget, StepHeader};
use corolla_shared::push_proof::{judge, PushVerdict, PushedStep};
use corolla_shared::session::{SessionError, StepReply};
use corolla_shared::TensorPayload;
use web_time::Instant;

use super::hop::HopState;
use super::RemoteChain;
use crate::swarm_view::PushBlame;

/// How many times its expected step time the client waits for a pushed
/// hop's output after the hop before it answered...
const PUSH_WAIT_FACTOR: f64 = 4.0;
/// ...and at least this long: loopback steps of a millisecond vary by
/// factors under load, a push that never comes costs this once.
const PUSH_WAIT_FLOOR: Duration = Duration::from_secs(1);

/// Where a pushed step stopped before the route's end.
enum PushStop {
    /// Hop `.0` failed (its server erred, closed, or timed out).
    Failed(usize, SessionError),
    /// The server before hop `.0` did not push to it: the client goes on
    /// from there itself.
    NotPushed(usize),
    /// No valid push reached a hop in time, or it refused the one it got.
    Missed(MissedPush),
}

/// A push that did not reach its receiver: the client carries the step to
/// the receiver itself, then settles who failed.
pub(super) struct MissedPush {
    /// The receiving hop.
    pub(super) receiver: usize,
    /// The hop charged with the push: the one before the receiver, or an
    /// earlier one that pushed into the receiver's session itself.
    pub(super) pusher: usize,
    /// The pushed step's id (an answer of it may still come, late).
    pub(super) step_id: u32,
    /// What went wrong, naming the pusher.
    pub(super) fault: SessionError,
}

/// What a step sent by push left for the client to do.
pub(super) struct PushOutcome {
    /// The first hop the client carries the step to itself.
    pub(super) carry_from: usize,
    /// The failure to handle there first.
    pub(super) pending: Option<SessionError>,
    /// A push that did not reach that hop, to settle once it answered.
    pub(super) missed: Option<MissedPush>,
}

impl RemoteChain {
    /// How many hops, from the first, a step can go through by push: asked
    /// for, each on one server (a hop split by a recovery goes through the
    /// client), and each session's Open named the next hop's server (after
    /// a recovery replaces a later hop, the link to it is the client's).
    /// A server whose pushes did not arrive lately pushes no more: the
    /// client carries its outputs.
    fn push_reach(&self) -> usize {
        let single = |h: &HopState| h.sessions.len() == 1;
        if !self.settings.push || !self.hops.first().is_some_and(single) {
            return 0;
        }
        let mut reach = 1;
        while let Some(hop) = self.hops.get(reach) {
            let (before_hop, before) = &self.hops[reach - 1].sessions[0];
            if !single(hop)
                || before.next() != Some(hop.sessions[0].1.peer())
                || self.view.pushes_fail(&before_hop.peer_id)
            {
                break;
            }
            reach += 1;
        }
        reach
    }

    /// Sends the step by push when it can go so, and takes the outputs of
    /// the hops that answered (push proofs and spot checks as usual) into
    /// their histories, leaving `payload` the last of them. Returns where
    /// the client carries the step on from, and what to handle there.
    pub(super) async fn forward_by_push(
        &mut self,
        start: usize,
        payload: &mut TensorPayload,
    ) -> PushOutcome {
        let reach = self.push_reach();
        if reach < 2 {
            return PushOutcome {
                carry_from: 0,
                pending: None,
                missed: None,
            };
        }
        let step_id = self.hops[..reach]
            .iter()
            .map(|h| h.sessions[0].1.next_step_id())
            .max()
            .unwrap_or(1);
        let mut first = 0;
        let mut pending: Option<SessionError> = None;
        let (replies, verdicts, stop) = self
            .forward_pushed(start as u32, step_id, payload, reach)
            .await;
        let answered = replies.len();
        if stop.is_none() {
            self.pushed_steps += 1;
        }
        // A receiver whose proof did not hold, found while judging its sender.
        let mut lying_receiver: Option<SessionError> = None;
        let mut verdicts = verdicts.into_iter();
        for reply in replies {
            if let Some(e) = lying_receiver.take() {
                pending = Some(e);
                break;
            }
            if let Some(verdict) = verdicts.next() {
                match verdict {
                    PushVerdict::Consistent => {}
                    PushVerdict::SenderLied => {
                        let peer = self.hops[first].sessions[0].1.peer();
                        tracing::warn!(%peer, "a server pushed other activations than it returned");
                        self.suspect(
                            &[peer.to_string()],
                            "pushed other activations than it returned (signed push proof)",
                        );
                        pending = Some(SessionError::PushLie { peer });
                        break;
                    }
                    PushVerdict::ReceiverLied(message) => {
                        let peer = self.hops[first + 1].sessions[0].1.peer();
                        tracing::warn!(%peer, %message, "a server's push proof does not hold");
                        self.suspect(&[peer.to_string()], &message);
                        lying_receiver = Some(SessionError::BadOutput { peer, message });
                    }
                }
            }
            let out = if self.check_now(first) {
                match self
                    .spot_check(first, start as u32, payload, reply.hidden)
                    .await
                {
                    Ok(out) => out,
                    Err(e) => {
                        pending = Some(e);
                        break;
                    }
                }
            } else {
                reply.hidden
            };
            let input = std::mem::replace(payload, out);
            self.hops[first].history.push((start as u32, input));
            first += 1;
        }
        if pending.is_none() {
            pending = lying_receiver;
        }
        match stop {
            Some(PushStop::Failed(index, e)) if pending.is_none() && index == answered => {
                tracing::debug!(error = %e, hop = index, "a pushed step failed; the client goes on");
                pending = Some(e);
            }
            Some(PushStop::NotPushed(index)) if index < self.hops.len() => {
                tracing::debug!(
                    hop = index,
                    "the step was not pushed to this hop; the client carries it on"
                );
            }
            Some(PushStop::Missed(missed)) if pending.is_none() && missed.receiver == answered => {
                tracing::debug!(error = %missed.fault, "a push did not come; the client carries the step");
                let receiver = missed.receiver;
                // A wait cut off part way through a frame (flow control)
                // leaves the stream out of step: the session is opened again.
                if !self.hops[receiver].sessions[0].1.in_step()
                    && !self.reopen_expired(receiver, &missed.fault, start).await
                {
                    let peer = self.hops[receiver].sessions[0].1.peer();
                    pending = Some(SessionError::Closed { peer });
                } else {
                    return PushOutcome {
                        carry_from: first,
                        pending: None,
                        missed: Some(missed),
                    };
                }
            }
            _ => {}
        }
        PushOutcome {
            carry_from: first,
            pending,
            missed: None,
        }
    }

    /// After hop `missed.receiver` answered the step the client carried to
    /// it: the receiver works, so the push that did not come is charged to
    /// its pusher (or, when the receiver missed other servers' pushes too,
    /// to the receiver, see [`crate::swarm_view::SwarmView::record_push_miss`]).
    /// A charged pusher is named and replaced when another server holds its
    /// blocks; without one it stays, and the client carries its outputs.
    /// A push answered after all, only late, charges nobody.
    pub(super) async fn settle_missed_push(&mut self, missed: MissedPush, position: usize) {
        let receiver = missed.receiver;
        if self.hops[receiver].sessions[0]
            .1
            .answered_late(missed.step_id)
        {
            tracing::debug!(error = %missed.fault, "the push came after all, late; nobody charged");
            return;
        }
        let pusher = missed.pusher;
        let pusher_id = self.hops[pusher].sessions[0].0.peer_id.clone();
        let receiver_id = self.hops[receiver].sessions[0].0.peer_id.clone();
        let (index, fault) = match self.view.record_push_miss(&pusher_id, &receiver_id) {
            PushBlame::Pusher => (pusher, missed.fault),
            PushBlame::Receiver => {
                let peer = self.hops[receiver].sessions[0].1.peer();
                let message = "it missed the pushes of other servers too".to_string();
                (receiver, SessionError::PushRefused { peer, message })
            }
        };
        let charged = self.hops[index].sessions[0].0.clone();
        tracing::warn!(peer = %charged.peer_id, error = %fault, "a push did not come");
        self.report(std::slice::from_ref(&charged.peer_id));
        let others = HashSet::from([charged.peer_id.clone()]);
        let replaceable = self
            .view
            .plan_excluding(charged.start, charged.end, &self.settings, &others)
            .is_some();
        if !replaceable {
            tracing::info!(peer = %charged.peer_id, "no other server holds its blocks; the client carries its outputs");
            return;
        }
        if let Err(e) = self.recover(index, &fault, position).await {
            tracing::warn!(error = %e, "could not replace a server whose push did not come; keeping it");
        }
    }

    /// When hop `receiver`'s proof is not its predecessor's, whether an
    /// earlier hop signed it: that hop knew the receiver's token (the client
    /// gives each server the rest of the route) and pushed into its session
    /// itself, before the predecessor's push; the receiver computed what it
    /// was given, honestly. The client carries the step to the receiver and
    /// charges that hop.
    fn intruded(
        &self,
        verdict: &PushVerdict,
        receiver: usize,
        start: u32,
        step_id: u32,
        reply: &StepReply,
    ) -> Option<MissedPush> {
        let PushVerdict::ReceiverLied(_) = verdict else {
            return None;
        };
        let proof = reply.input_proof.as_ref()?;
        let step = PushedStep {
            token: self.hops[receiver].sessions[0].1.token(),
            step_id,
            start_position: start,
        };
        let pusher = (0..receiver.saturating_sub(1)).find(|&earlier| {
            let sender = self.hops[earlier].sessions[0].1.as_push_sender();
            proof.verify(sender, &step).is_ok()
        })?;
        let peer = self.hops[pusher].sessions[0].1.peer();
        Some(MissedPush {
            receiver,
            pusher,
            step_id,
            fault: SessionError::PushUndelivered {
                peer,
                message: format!(
                    "it pushed into the session of {}, which follows another server",
                    self.hops[receiver].sessions[0].1.peer()
                ),
            },
        })
    }

    /// How long the client waits for hop `index`'s output once the hop
    /// before it answered (pushes leave before answers): a few times what
    /// the step is expected to take there, and at least [`PUSH_WAIT_FLOOR`].
    fn push_wait(&self, index: usize, input: &TensorPayload) -> Duration {
        let hop = &self.hops[index].sessions[0].0;
        let positions = input.shape.get(1).copied().unwrap_or(1).max(1) as f64;
        let expected = self.view.expected_step_seconds(hop) * positions;
        let seconds = (PUSH_WAIT_FACTOR * expected)
            .max(PUSH_WAIT_FLOOR.as_secs_f64())
            .min(self.settings.timeout.as_secs_f64());
        Duration::from_secs_f64(seconds)
    }

    /// Whether hop `index + 1`'s proof shows that hop `index` pushed it
    /// exactly what it returned to the client (`reply`).
    fn judge_push(
        &self,
        index: usize,
        start: u32,
        step_id: u32,
        reply: &StepReply,
        next: &StepReply,
    ) -> PushVerdict {
        let sender = &self.hops[index].sessions[0].1;
        let receiver = &self.hops[index + 1].sessions[0].1;
        let step = PushedStep {
            token: receiver.token(),
            step_id,
            start_position: start,
        };
        match &reply.digest {
            Some(returned) => judge(
                next.input_proof.as_ref(),
                sender.as_push_sender(),
                &step,
                returned,
            ),
            // Only a pushed output is followed by another reply.
            None => PushVerdict::ReceiverLied("an output came for a step nobody pushed".into()),
        }
    }

    /// Sends one step through the first `reach` hops by push and reads
    /// every hop's reply from its session as it comes. Returns the replies
    /// of the hops that answered, in order, the verdict on each push
    /// between two of them (judged as soon as the second came, while the
    /// next server computes), and where it stopped short of the route's
    /// end, if it did.
    async fn forward_pushed(
        &mut self,
        start: u32,
        step_id: u32,
        input: &TensorPayload,
        reach: usize,
    ) -> (Vec<StepReply>, Vec<PushVerdict>, Option<PushStop>) {
        let push = self.hops[1..reach]
            .iter()
            .map(|h| PushTarget {
                peer: h.sessions[0].1.peer(),
                token: h.sessions[0].1.token(),
            })
            .collect();
        for hop in &mut self.hops[..reach] {
            hop.sessions[0].1.expect_step(step_id);
        }
        let header = StepHeader {
            start_position: start,
            step_id,
            push,
        };
        let decode = input.shape.get(1) == Some(&1);
        let mut replies: Vec<StepReply> = Vec::with_capacity(reach);
        let mut verdicts = Vec::with_capacity(reach);
        let mut last = Instant::now();
        tracing::trace!(name: hop_trace::CLIENT_SENT, target: hop_trace::TARGET, "hop stage");
        if let Err(e) = self.hops[0].sessions[0].1.send_step(&header, input).await {
            return (replies, verdicts, Some(PushStop::Failed(0, e)));
        }
        for index in 0..reach {
            let wait = self.push_wait(index, input);
            let pusher = index
                .checked_sub(1)
                .map(|before| self.hops[before].sessions[0].1.peer());
            let (hop, session) = &mut self.hops[index].sessions[0];
            let received = match pusher {
                None => session.receive_output(step_id, input).await,
                Some(pusher) => {
                    let received = session
                        .receive_output_within(step_id, input, wait, Some(pusher))
                        .await;
                    let missed = match &received {
                        Err(SessionError::Timeout { peer, .. }) => {
                            Some(format!("no push reached {peer} within {wait:?}"))
                        }
                        Err(SessionError::PushRefused { peer, message }) => {
                            Some(format!("{peer} refused it: {message}"))
                        }
                        _ => None,
                    };
                    if let Some(message) = missed {
                        let missed = MissedPush {
                            receiver: index,
                            pusher: index - 1,
                            step_id,
                            fault: SessionError::PushUndelivered {
                                peer: pusher,
                                message,
                            },
                        };
                        return (replies, verdicts, Some(PushStop::Missed(missed)));
                    }
                    received
                }
            };
            match received {
                Ok(reply) => {
                    tracing::trace!(name: hop_trace::CLIENT_RECEIVED, target: hop_trace::TARGET, hop = index);
                    if decode {
                        // From the previous output to this one: one link and
                        // this hop's compute, what routing compares.
                        self.view.record_step(
                            &hop.peer_id,
                            last.elapsed().as_secs_f64(),
                            hop.end - hop.start,
                        );
                        last = Instant::now();
                    }
                    let pushed = reply.pushed;
                    if let Some(before) = replies.last() {
                        let verdict = self.judge_push(index - 1, start, step_id, before, &reply);
                        if let Some(missed) = self.intruded(&verdict, index, start, step_id, &reply)
                        {
                            return (replies, verdicts, Some(PushStop::Missed(missed)));
                        }
                        verdicts.push(verdict);
                    }
                    replies.push(reply);
                    if index + 1 < reach && !pushed {
                        let stop = PushStop::NotPushed(index + 1);
                        return (replies, verdicts, Some(stop));
                    }
                }
                Err(e) => return (replies, verdicts, Some(PushStop::Failed(index, e))),
            }
        }
        let stop = (reach < self.hops.len()).then_some(PushStop::NotPushed(reach));
        (replies, verdicts, stop)
    }
}
