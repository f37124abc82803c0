//! Steps by push: the client sends a step to the first server, each server
//! pushes its output to the next, and every hop's output still comes back
//! to the client (kept for replay, and spot-checked as usual). Each pushed
//! output comes back with its sender's signed digest of what it pushed
//! (`corolla_shared::push_proof`), checked against what the sender
//! returned: a server that pushes other numbers than it returns is the one
//! blamed, never the server after it.

use corolla_shared::hop_trace;
use corolla_shared::protocol::{PushTarget, StepHeader};
use corolla_shared::push_proof::{judge, PushVerdict, PushedStep};
use corolla_shared::session::{SessionError, StepReply};
use corolla_shared::TensorPayload;
use web_time::Instant;

use super::hop::HopState;
use super::RemoteChain;

/// Where a pushed step stopped before the route's end.
enum PushStop {
    /// Hop `.0` failed (its server erred, closed, or timed out).
    Failed(usize, SessionError),
    /// The server before hop `.0` did not push to it: the client goes on
    /// from there itself.
    NotPushed(usize),
}

impl RemoteChain {
    /// How many hops, from the first, a step can go through by push: asked
    /// for, each on one server (a hop split by a recovery goes through the
    /// client), and each session's Open named the next hop's server (after
    /// a recovery replaces a later hop, the link to it is the client's).
    fn push_reach(&self) -> usize {
        let single = |h: &HopState| h.sessions.len() == 1;
        if !self.settings.push || !self.hops.first().is_some_and(single) {
            return 0;
        }
        let mut reach = 1;
        while let Some(hop) = self.hops.get(reach) {
            let before = &self.hops[reach - 1].sessions[0].1;
            if !single(hop) || before.next() != Some(hop.sessions[0].1.peer()) {
                break;
            }
            reach += 1;
        }
        reach
    }

    /// Sends the step by push when it can go so, and takes the outputs of
    /// the hops that answered (push proofs and spot checks as usual) into
    /// their histories, leaving `payload` the last of them. Returns the hop
    /// the client carries the step on from, and the failure to handle
    /// there first.
    pub(super) async fn forward_by_push(
        &mut self,
        start: usize,
        payload: &mut TensorPayload,
    ) -> (usize, Option<SessionError>) {
        let reach = self.push_reach();
        if reach < 2 {
            return (0, None);
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
            _ => {}
        }
        (first, pending)
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
            let (hop, session) = &mut self.hops[index].sessions[0];
            match session.receive_output(step_id, input).await {
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
                        verdicts.push(self.judge_push(index - 1, start, step_id, before, &reply));
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
