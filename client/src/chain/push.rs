//! Steps by push: the client sends a step to the first server, each server
//! pushes its output to the next, and every hop's output still comes back
//! to the client (kept for replay, and spot-checked as usual).

use corolla_shared::protocol::{PushTarget, StepHeader};
use corolla_shared::session::SessionError;
use corolla_shared::TensorPayload;
use web_time::Instant;

use super::RemoteChain;

/// Where a pushed step stopped before the route's end.
enum PushStop {
    /// Hop `.0` failed (its server erred, closed, or timed out).
    Failed(usize, SessionError),
    /// The server before hop `.0` could not push to it: the client goes on
    /// from there itself.
    NotPushed(usize),
}

impl RemoteChain {
    /// Whether the next step can go by push: asked for, more than one hop,
    /// and each hop on one server (a hop split by a recovery goes through
    /// the client).
    fn can_push(&self) -> bool {
        self.settings.push && self.hops.len() > 1 && self.hops.iter().all(|h| h.sessions.len() == 1)
    }

    /// Sends the step by push when it can go so, and takes the outputs of
    /// the hops that answered (spot-checked as usual) into their histories,
    /// leaving `payload` the last of them. Returns the hop the client
    /// carries the step on from, and the failure to handle there first.
    pub(super) async fn forward_by_push(
        &mut self,
        start: usize,
        payload: &mut TensorPayload,
    ) -> (usize, Option<SessionError>) {
        if !self.can_push() {
            return (0, None);
        }
        let mut first = 0;
        let mut pending: Option<SessionError> = None;
        let (outputs, stop) = self.forward_pushed(start as u32, payload).await;
        let answered = outputs.len();
        if stop.is_none() {
            self.pushed_steps += 1;
        }
        for out in outputs {
            let out = if self.schedule.check_now() {
                match self.spot_check(first, start as u32, payload, out).await {
                    Ok(out) => out,
                    Err(e) => {
                        pending = Some(e);
                        break;
                    }
                }
            } else {
                out
            };
            let input = std::mem::replace(payload, out);
            self.hops[first].history.push((start as u32, input));
            first += 1;
        }
        match stop {
            Some(PushStop::Failed(index, e)) if pending.is_none() && index == answered => {
                tracing::debug!(error = %e, hop = index, "a pushed step failed; the client goes on");
                pending = Some(e);
            }
            Some(PushStop::NotPushed(index)) => {
                tracing::debug!(
                    hop = index,
                    "a server could not push; the client carries the step on"
                );
            }
            _ => {}
        }
        (first, pending)
    }

    /// Sends one step down the whole route by push and reads every hop's
    /// output from its session as it comes. Returns the outputs of the
    /// hops that answered, in order, and where it stopped short, if it did.
    async fn forward_pushed(
        &mut self,
        start: u32,
        input: &TensorPayload,
    ) -> (Vec<TensorPayload>, Option<PushStop>) {
        let step_id = self
            .hops
            .iter()
            .map(|h| h.sessions[0].1.next_step_id())
            .max()
            .unwrap_or(1);
        let push = self.hops[1..]
            .iter()
            .map(|h| PushTarget {
                peer: h.sessions[0].1.peer(),
                token: h.sessions[0].1.token(),
            })
            .collect();
        for hop in &mut self.hops {
            hop.sessions[0].1.expect_step(step_id);
        }
        let header = StepHeader {
            start_position: start,
            step_id,
            push,
        };
        let decode = input.shape.get(1) == Some(&1);
        let mut outputs = Vec::with_capacity(self.hops.len());
        let mut last = Instant::now();
        if let Err(e) = self.hops[0].sessions[0].1.send_step(&header, input).await {
            return (outputs, Some(PushStop::Failed(0, e)));
        }
        let hops = self.hops.len();
        for index in 0..hops {
            let (hop, session) = &mut self.hops[index].sessions[0];
            match session.receive_output(step_id, input).await {
                Ok((out, pushed)) => {
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
                    outputs.push(out);
                    if index + 1 < hops && !pushed {
                        return (outputs, Some(PushStop::NotPushed(index + 1)));
                    }
                }
                Err(e) => return (outputs, Some(PushStop::Failed(index, e))),
            }
        }
        (outputs, None)
    }
}
