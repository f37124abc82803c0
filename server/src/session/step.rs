//! One step of a session: checked, computed by the core, pushed on to the
//! next server when the Open named one, and answered.

use corolla_model::wire::{candle_dtype, from_view, to_payload};
use corolla_shared::hop_trace;
use corolla_shared::protocol::{ErrorCode, Response, StepHeader};
use corolla_shared::push_proof::PushProof;
use corolla_shared::{TensorPayload, TensorView};
use tokio::time::Instant;

use crate::corruption;
use crate::error::ComputeError;
use crate::metrics::StepKind;
use crate::push::check_route;

use super::{refuse, Reply, Session, SessionContext};

/// Runs one step of the client's or one pushed to this session (with its
/// sender's proof, `pushed_in`, returned to the client with the output);
/// pushes the output on when the step names a next session (critical path
/// first), then answers the client.
pub(super) async fn run_step(
    ctx: &SessionContext,
    session: Option<Session>,
    control: &mut libp2p_stream::Control,
    header: &StepHeader,
    hidden: &TensorView<'_>,
    pushed_in: Option<PushProof>,
) -> (Option<Session>, Reply) {
    let Some(s) = session else {
        return (
            None,
            refuse(
                ErrorCode::UnknownSession,
                "no session is open on this stream; send Open first",
            ),
        );
    };
    if let Err(why) = check_route(ctx.settings.peer_id, &header.push) {
        return (Some(s), Err((ErrorCode::BadFrame, why)));
    }
    let arrived = Instant::now();
    let block = ctx.core.span().range().start;
    tracing::trace!(name: hop_trace::STEP_ARRIVED, target: hop_trace::TARGET, block);
    let (mut s, out) = step(ctx, s, header.start_position as usize, hidden).await;
    let out = match out {
        Ok(out) => out,
        Err(e) => return (s, Err(e)),
    };
    if let Some(s) = &mut s {
        s.last_step_id = s.last_step_id.max(header.step_id);
    }
    tracing::trace!(name: hop_trace::OUTPUT_READY, target: hop_trace::TARGET, block);
    // A computed step passed `check_step`: its shape is [1, T, hidden].
    let positions = hidden.shape.get(1).copied().unwrap_or(0);
    ctx.settings.metrics.step_served(
        StepKind::of(pushed_in.is_some(), positions),
        positions,
        arrived.elapsed(),
    );
    let pushed = match (&mut s, header.push.first()) {
        (Some(s), Some(target)) if s.next.as_ref().is_some_and(|n| n.peer() == target.peer) => {
            let confirmed = match &mut s.next {
                Some(next) => next.confirmed().await,
                None => false,
            };
            confirmed && push_output(ctx, s, control, header, &out).await
        }
        (Some(_), Some(target)) => {
            tracing::debug!(target = %target.peer, "not pushing to a server the session's Open did not name");
            false
        }
        _ => false,
    };
    let frame = Response::StepOut {
        step_id: header.step_id,
        pushed,
        input_proof: pushed_in,
        hidden: out.view(),
    }
    .encode();
    (s, Ok(frame))
}

/// Pushes `out` on along `header`'s route (or fails to, the way a
/// `--push-fault` server is told to); whether the session says it pushed.
async fn push_output(
    ctx: &SessionContext,
    s: &mut Session,
    control: &mut libp2p_stream::Control,
    header: &StepHeader,
    out: &TensorPayload,
) -> bool {
    let identity = &ctx.settings.identity;
    if let Some(fault) = ctx.settings.push_fault {
        let link = &mut s.push_link;
        return fault
            .push(link, &mut s.last_push, control, identity, header, out)
            .await;
    }
    let corrupt =
        ctx.settings.corrupt_pushes > 0.0 && rand::random::<f64>() < ctx.settings.corrupt_pushes;
    let noisy = corrupt.then(|| corruption::with_noise(out, ctx.core.span().device()));
    let to_push = match &noisy {
        Some(Ok(noisy)) => noisy,
        _ => out,
    };
    let pushed = s.push_link.push(control, identity, header, to_push).await;
    ctx.settings.metrics.push_sent(pushed);
    pushed
}

/// The output of a step, or why there is none.
type StepResult = Result<TensorPayload, (ErrorCode, String)>;

/// Runs one step; the session comes back unless the computation panicked.
async fn step(
    ctx: &SessionContext,
    s: Session,
    start: usize,
    hidden: &TensorView<'_>,
) -> (Option<Session>, StepResult) {
    match check_step(ctx, &s, start, hidden) {
        Err(e) => (Some(s), Err(e)),
        Ok(()) => compute_step(ctx, s, start, hidden).await,
    }
}

fn check_step(
    ctx: &SessionContext,
    s: &Session,
    start: usize,
    hidden: &TensorView<'_>,
) -> Result<(), (ErrorCode, String)> {
    let hidden_size = ctx.core.span().config().hidden_size;
    let shape = &hidden.shape;
    if shape.len() != 3 || shape[0] != 1 || shape[1] == 0 || shape[2] != hidden_size {
        let msg = format!(
            "hidden states must have shape [1, T, {hidden_size}] with T >= 1; got {shape:?}"
        );
        return Err((ErrorCode::BadShape, msg));
    }
    let t = shape[1];
    if start > s.len {
        let msg = format!(
            "start position {start} is past the {} positions already processed",
            s.len
        );
        return Err((ErrorCode::BadShape, msg));
    }
    if start.saturating_add(t) > s.max_length {
        let msg = format!(
            "positions {start}..{} exceed the session's max_length {}",
            start.saturating_add(t),
            s.max_length
        );
        return Err((ErrorCode::TooLong, msg));
    }
    Ok(())
}

async fn compute_step(
    ctx: &SessionContext,
    mut s: Session,
    start: usize,
    hidden: &TensorView<'_>,
) -> (Option<Session>, StepResult) {
    let span = ctx.core.span();
    let input = match from_view(hidden, span.device()) {
        Ok(x) => x,
        Err(e) => return (Some(s), Err((ErrorCode::BadShape, e.to_string()))),
    };
    let positions = hidden.shape[1];
    let delay = ctx.settings.step_delay + ctx.settings.late_steps;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let corrupt =
        ctx.settings.corrupt_outputs > 0.0 && rand::random::<f64>() < ctx.settings.corrupt_outputs;
    let wire = s.dtype;
    let out = match s.cache.step(input, start).await {
        Ok(out) => out,
        Err(ComputeError::Lost(why)) => {
            tracing::error!(why, "a session's cache was lost");
            return (
                None,
                Err((ErrorCode::Internal, format!("{why}; session ended"))),
            );
        }
        Err(e) => return (Some(s), Err((ErrorCode::Internal, e.to_string()))),
    };
    s.len = start + positions;
    let payload = (if corrupt {
        corruption::add_noise(&out)
    } else {
        Ok(out)
    })
    .and_then(|y| to_payload(&y.to_dtype(candle_dtype(wire))?, wire))
    .map(|out| out.compressed(s.compression));
    (
        Some(s),
        payload.map_err(|e| (ErrorCode::Internal, e.to_string())),
    )
}
