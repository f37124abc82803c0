//! One inference session per stream: open, steps, close. Every field a peer
//! sends is checked before anything is allocated; a bad request gets an
//! error frame and the session (and every other session) goes on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use corolla_model::fingerprint::span_hash;
use corolla_model::wire::{candle_dtype, from_view, to_payload};
use corolla_model::{BlockSpan, SessionCache};
use corolla_shared::flow::FlowSender;
use corolla_shared::framing::{read_frame, write_frame};
use corolla_shared::protocol::{ErrorCode, OpenRequest, Request, Response};
use corolla_shared::{Limits, ServerRecord, TensorView, WireDType};
use futures::AsyncWriteExt;
use libp2p::{PeerId, Stream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What every session of this server shares.
pub(crate) struct SessionContext {
    pub span: Arc<BlockSpan>,
    pub model: String,
    /// Hashes of the span's blocks, in order.
    pub block_hashes: Vec<String>,
    pub limits: Limits,
    pub max_length: usize,
    pub max_sessions: usize,
    pub idle_timeout: Duration,
    pub step_delay: Duration,
    pub permits: Arc<Semaphore>,
    /// The announced record; live fields are filled in by [`Self::record`].
    pub record: Mutex<ServerRecord>,
}

impl SessionContext {
    pub fn record(&self) -> ServerRecord {
        let mut r = self
            .record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let free = self.permits.available_permits();
        r.sessions = (self.max_sessions - free) as u32;
        r.cache_tokens_left = (free * self.max_length) as u64;
        r
    }
}

struct Session {
    cache: SessionCache,
    dtype: WireDType,
    max_length: usize,
    _permit: OwnedSemaphorePermit,
}

type Reply = Result<Vec<u8>, (ErrorCode, String)>;

fn refuse(code: ErrorCode, message: impl Into<String>) -> Reply {
    Err((code, message.into()))
}

pub(crate) async fn serve(mut stream: Stream, peer: PeerId, ctx: Arc<SessionContext>) {
    let mut buf = Vec::new();
    let mut session: Option<Session> = None;
    // Set by an Open that asks for flow control (browsers over WebRTC).
    let mut flow: Option<FlowSender> = None;
    loop {
        let read = tokio::time::timeout(
            ctx.idle_timeout,
            read_frame(&mut stream, ctx.limits.max_frame_bytes(), &mut buf),
        )
        .await;
        let reply = match read {
            Err(_) => {
                let msg = format!("session idle for {:?}; closed", ctx.idle_timeout);
                send(&mut stream, &mut flow, Err((ErrorCode::Timeout, msg))).await;
                break;
            }
            Ok(Ok(false)) => break,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                // The frame's body was not read, so the stream is out of sync: close it.
                send(
                    &mut stream,
                    &mut flow,
                    Err((ErrorCode::TooLong, e.to_string())),
                )
                .await;
                break;
            }
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "session stream failed");
                break;
            }
            Ok(Ok(true)) => match Request::decode(&buf, &ctx.limits) {
                Err(e) => refuse(ErrorCode::BadFrame, format!("malformed request: {e}")),
                Ok(Request::Close) => break,
                Ok(Request::Ack { received }) => match flow.as_mut().map(|f| f.on_ack(received)) {
                    Some(Ok(())) => continue,
                    Some(Err(e)) => refuse(ErrorCode::BadFrame, e.to_string()),
                    None => refuse(
                        ErrorCode::BadFrame,
                        "an acknowledgement without flow control",
                    ),
                },
                Ok(Request::Open(open)) => match &session {
                    Some(_) => refuse(
                        ErrorCode::BadFrame,
                        "a session is already open on this stream",
                    ),
                    None => {
                        // From here on the client reads under its window, even a refusal.
                        if open.flow_window > 0 && flow.is_none() {
                            flow = Some(FlowSender::new(open.flow_window));
                        }
                        open_session(&ctx, &open).map(|s| {
                            let max_length = s.max_length as u32;
                            tracing::debug!(%peer, start = open.start, end = open.end, max_length, "session opened");
                            session = Some(s);
                            Response::Opened { max_length }.encode()
                        })
                    }
                },
                Ok(Request::Step {
                    start_position,
                    hidden,
                }) => match session.take() {
                    None => refuse(
                        ErrorCode::UnknownSession,
                        "no session is open on this stream; send Open first",
                    ),
                    Some(s) => {
                        let (s, reply) = step(&ctx, s, start_position as usize, &hidden).await;
                        session = s;
                        reply
                    }
                },
            },
        };
        if !send(&mut stream, &mut flow, reply).await {
            break;
        }
    }
    let _ = stream.close().await;
    tracing::debug!(%peer, "session closed");
}

async fn send(stream: &mut Stream, flow: &mut Option<FlowSender>, reply: Reply) -> bool {
    let frame = match reply {
        Ok(frame) => frame,
        Err((code, message)) => {
            tracing::debug!(?code, %message, "refusing a request");
            Response::error(code, message).encode()
        }
    };
    match flow {
        Some(flow) => flow.write_frame(stream, &frame).await.is_ok(),
        None => write_frame(stream, &frame).await.is_ok(),
    }
}

fn open_session(ctx: &SessionContext, open: &OpenRequest) -> Result<Session, (ErrorCode, String)> {
    if open.model != ctx.model {
        return Err((
            ErrorCode::WrongModel,
            format!(
                "this server serves model {:?}, not {:?}",
                ctx.model, open.model
            ),
        ));
    }
    let served = ctx.span.range();
    let (start, end) = (open.start as usize, open.end as usize);
    if start >= end || start < served.start || end > served.end {
        return Err((
            ErrorCode::SpanNotServed,
            format!(
                "this server holds blocks {}..{}; blocks {start}..{end} requested",
                served.start, served.end
            ),
        ));
    }
    if !open.fingerprint.is_empty() {
        let ours = span_hash(&ctx.block_hashes[start - served.start..end - served.start]);
        if open.fingerprint != ours {
            return Err((
                ErrorCode::WrongModel,
                format!(
                    "this server holds other weights for blocks {start}..{end} (hash {ours}, not {})",
                    open.fingerprint
                ),
            ));
        }
    }
    let max_length = open.max_length as usize;
    if max_length == 0 || max_length > ctx.max_length {
        return Err((
            ErrorCode::TooLong,
            format!("max_length {max_length} is outside 1..={}", ctx.max_length),
        ));
    }
    let permit = ctx.permits.clone().try_acquire_owned().map_err(|_| {
        (
            ErrorCode::Busy,
            format!("server busy: all {} sessions in use", ctx.max_sessions),
        )
    })?;
    let cache = ctx
        .span
        .new_cache_for(start..end, max_length)
        .map_err(|e| (ErrorCode::TooLong, e.to_string()))?;
    Ok(Session {
        cache,
        dtype: open.dtype,
        max_length,
        _permit: permit,
    })
}

/// Runs one step; the session comes back unless the computation panicked.
async fn step(
    ctx: &SessionContext,
    s: Session,
    start: usize,
    hidden: &TensorView<'_>,
) -> (Option<Session>, Reply) {
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
    let hidden_size = ctx.span.config().hidden_size;
    let shape = &hidden.shape;
    if shape.len() != 3 || shape[0] != 1 || shape[1] == 0 || shape[2] != hidden_size {
        let msg = format!(
            "hidden states must have shape [1, T, {hidden_size}] with T >= 1; got {shape:?}"
        );
        return Err((ErrorCode::BadShape, msg));
    }
    let t = shape[1];
    if start > s.cache.len() {
        let msg = format!(
            "start position {start} is past the {} positions already processed",
            s.cache.len()
        );
        return Err((ErrorCode::BadShape, msg));
    }
    if start + t > s.max_length {
        let msg = format!(
            "positions {start}..{} exceed the session's max_length {}",
            start + t,
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
) -> (Option<Session>, Reply) {
    let input = match from_view(hidden, ctx.span.device()) {
        Ok(x) => x,
        Err(e) => return (Some(s), refuse(ErrorCode::BadShape, e.to_string())),
    };
    if !ctx.step_delay.is_zero() {
        tokio::time::sleep(ctx.step_delay).await;
    }
    let span = ctx.span.clone();
    let wire = s.dtype;
    let computed = tokio::task::spawn_blocking(move || {
        let out = span
            .forward(&input, start, &mut s.cache)
            .and_then(|y| to_payload(&y.to_dtype(candle_dtype(wire))?, wire));
        (s, out)
    })
    .await;
    match computed {
        Ok((s, Ok(out))) => {
            let frame = Response::StepOut { hidden: out.view() }.encode();
            (Some(s), Ok(frame))
        }
        Ok((s, Err(e))) => (Some(s), refuse(ErrorCode::Internal, e.to_string())),
        Err(join) => {
            // The computation took the session's cache with it: end the session.
            tracing::error!(error = %join, "step computation failed");
            (
                None,
                refuse(ErrorCode::Internal, "the step failed; session ended"),
            )
        }
    }
}
