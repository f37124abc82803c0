//! One inference session per stream: open, steps, close. Every field a peer
//! sends is checked before anything is allocated; a bad request gets an
//! error frame and the session (and every other session) goes on. Every
//! read, write and acknowledgement wait has a deadline, only progress (an
//! opened session, a computed step) keeps a stream alive, and a stream that
//! sends bad requests over and over is closed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use corolla_model::fingerprint::span_hash;
use corolla_model::wire::{candle_dtype, from_view, to_payload};
use corolla_model::{DType, Tensor};
use corolla_shared::flow::{FlowSender, MIN_WINDOW};
use corolla_shared::framing::{read_frame, write_frame};
use corolla_shared::protocol::{ErrorCode, OpenRequest, Request, Response};
use corolla_shared::{Limits, ServerRecord, TensorView, WireDType};
use futures::AsyncWriteExt;
use libp2p::{PeerId, Stream};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::admission::{BudgetFull, CacheBudget, Quota, Refusal, Reservation, Slot};
use crate::compute::{CacheLease, ComputeCore};
use crate::error::ComputeError;

/// Bad requests in a row after which a stream is closed.
pub(crate) const MAX_BAD_REQUESTS_IN_A_ROW: usize = 3;
/// What a refusal for want of cache suggests waiting before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// The longest any one reply may take to leave, acknowledgement waits included.
const MAX_WRITE_TIME: Duration = Duration::from_secs(30);

/// What every session of this server shares.
pub(crate) struct SessionContext {
    /// Owns the span and every session's cache; steps go through it.
    pub core: ComputeCore,
    pub model: String,
    /// Hashes of the span's blocks, in order.
    pub block_hashes: Vec<String>,
    pub limits: Limits,
    /// Longest session: `--inference-max-length`, at most the model's positions.
    pub max_length: usize,
    pub idle_timeout: Duration,
    pub step_delay: Duration,
    /// Sessions per peer and in total.
    pub sessions: Arc<Quota>,
    /// KV-cache tokens all sessions share (`--cache-tokens`).
    pub cache: Arc<CacheBudget>,
    /// A testing aid: the share of steps answered with noisy activations.
    pub corrupt_outputs: f64,
    /// Becomes `true` when the server leaves: open sessions are told so.
    pub shutdown: watch::Receiver<bool>,
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
        self.fill_live_figures(&mut r);
        r
    }

    /// Sessions open and cache tokens free right now.
    pub fn fill_live_figures(&self, r: &mut ServerRecord) {
        r.sessions = self.sessions.in_use() as u32;
        r.cache_tokens_left = self.cache.free() as u64;
    }

    fn write_deadline(&self) -> Duration {
        self.idle_timeout.min(MAX_WRITE_TIME)
    }
}

struct Session {
    cache: CacheLease,
    /// Positions the cache holds.
    len: usize,
    dtype: WireDType,
    max_length: usize,
    _slot: Slot,
    _reservation: Reservation,
}

type Reply = Result<Vec<u8>, (ErrorCode, String)>;

fn refuse(code: ErrorCode, message: impl Into<String>) -> Reply {
    Err((code, message.into()))
}

/// The server's end of one session stream: it owns the framing (plain, or
/// flow-controlled once an Open asked for it) and every deadline on it.
struct SessionStream {
    stream: Stream,
    flow: Option<FlowSender>,
}

impl SessionStream {
    /// Writes one reply within `deadline`; `false` when the stream is unusable.
    async fn send(&mut self, reply: Reply, deadline: Duration) -> bool {
        let frame = match reply {
            Ok(frame) => frame,
            Err((code, message)) => {
                tracing::debug!(?code, %message, "refusing a request");
                Response::error(code, message).encode()
            }
        };
        let write = async {
            match &mut self.flow {
                Some(flow) => flow.write_frame(&mut self.stream, &frame).await,
                None => write_frame(&mut self.stream, &frame).await,
            }
        };
        matches!(tokio::time::timeout(deadline, write).await, Ok(Ok(())))
    }

    async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.stream.close()).await;
    }
}

/// What the next frame turned out to be.
enum Incoming {
    Frame,
    End,
    Idle,
    ShuttingDown,
    /// Unreadable: the stream is out of sync (`Some`: tell the peer why).
    Broken(Option<String>),
}

async fn shutting_down(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|leaving| *leaving).await.is_err() {
        // The server is gone without a goodbye: the stream ends with it.
        std::future::pending::<()>().await;
    }
}

/// Serves one stream; `stream_slot` (its place in the per-peer stream
/// quota) is given back as soon as the session ends, before the stream's
/// close is waited out, so a client that opens its next sessions at once
/// is not refused for streams that are only closing.
pub(crate) async fn serve(
    stream: Stream,
    peer: PeerId,
    ctx: Arc<SessionContext>,
    stream_slot: Slot,
) {
    let mut io = SessionStream { stream, flow: None };
    let mut buf = Vec::new();
    let mut session: Option<Session> = None;
    let mut shutdown = ctx.shutdown.clone();
    let mut idle_until = Instant::now() + ctx.idle_timeout;
    let mut bad_in_a_row = 0;
    let max_frame = ctx.limits.max_frame_bytes();
    loop {
        let incoming = tokio::select! {
            read = tokio::time::timeout_at(idle_until, read_frame(&mut io.stream, max_frame, &mut buf)) => match read {
                Err(_) => Incoming::Idle,
                Ok(Ok(true)) => Incoming::Frame,
                Ok(Ok(false)) => Incoming::End,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => Incoming::Broken(Some(e.to_string())),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "session stream failed");
                    Incoming::Broken(None)
                }
            },
            _ = shutting_down(&mut shutdown) => Incoming::ShuttingDown,
        };
        let deadline = ctx.write_deadline();
        match incoming {
            Incoming::Frame => {}
            Incoming::End => break,
            Incoming::Idle => {
                let msg = format!(
                    "idle (no progress) for {:?}; session closed",
                    ctx.idle_timeout
                );
                io.send(Err((ErrorCode::Timeout, msg)), deadline).await;
                break;
            }
            Incoming::ShuttingDown => {
                let msg = "this server is shutting down; continue elsewhere";
                io.send(Err((ErrorCode::ShuttingDown, msg.into())), deadline)
                    .await;
                break;
            }
            Incoming::Broken(why) => {
                if let Some(why) = why {
                    io.send(Err((ErrorCode::TooLong, why)), deadline).await;
                }
                break;
            }
        }
        let reply = match Request::decode(&buf, &ctx.limits) {
            Err(e) => refuse(ErrorCode::BadFrame, format!("malformed request: {e}")),
            Ok(Request::Close) => break,
            Ok(Request::Ack { received }) => match io.flow.as_mut().map(|f| f.on_ack(received)) {
                // Acknowledgements are no progress: they do not keep a session alive.
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
                    if open.flow_window >= MIN_WINDOW && io.flow.is_none() {
                        io.flow = Some(FlowSender::new(open.flow_window));
                    }
                    open_session(&ctx, peer, &open).await.map(|s| {
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
        };
        let reply = match reply {
            Ok(frame) => {
                bad_in_a_row = 0;
                idle_until = Instant::now() + ctx.idle_timeout;
                Ok(frame)
            }
            Err((code, message)) => {
                bad_in_a_row += 1;
                if bad_in_a_row >= MAX_BAD_REQUESTS_IN_A_ROW {
                    let message = format!(
                        "{message}; closing the stream after {bad_in_a_row} bad requests in a row"
                    );
                    io.send(Err((code, message)), deadline).await;
                    tracing::debug!(%peer, "closed a stream sending bad requests");
                    break;
                }
                Err((code, message))
            }
        };
        if !io.send(reply, deadline).await {
            tracing::debug!(%peer, "a reply could not be sent in time; session closed");
            break;
        }
    }
    // Free the cache, the slots and the span (a moving server waits for
    // them) before waiting for the stream to close.
    drop(session);
    drop(stream_slot);
    drop(ctx);
    io.close().await;
    tracing::debug!(%peer, "session closed");
}

async fn open_session(
    ctx: &SessionContext,
    peer: PeerId,
    open: &OpenRequest,
) -> Result<Session, (ErrorCode, String)> {
    if open.model != ctx.model {
        return Err((
            ErrorCode::WrongModel,
            format!(
                "this server serves model {:?}, not {:?}",
                ctx.model, open.model
            ),
        ));
    }
    let served = ctx.core.span().range();
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
    if open.flow_window > 0 && open.flow_window < MIN_WINDOW {
        return Err((
            ErrorCode::BadFrame,
            format!(
                "flow_window {} is below the minimum of {MIN_WINDOW} bytes",
                open.flow_window
            ),
        ));
    }
    let max_length = open.max_length as usize;
    if max_length == 0 {
        return Err((ErrorCode::TooLong, "max_length must be at least 1".into()));
    }
    if max_length > ctx.max_length {
        return Err((
            ErrorCode::TooLong,
            format!("max_length {max_length} exceeds {}", ctx.max_length),
        ));
    }
    let slot = ctx.sessions.try_take(peer).map_err(|refusal| {
        let message = match refusal {
            Refusal::Full { limit } => format!("busy: {limit}/{limit} sessions in use"),
            Refusal::PeerFull { limit } => {
                format!("busy: this peer holds {limit} sessions, the most one peer may hold")
            }
        };
        (ErrorCode::Busy, message)
    })?;
    let reservation = ctx
        .cache
        .try_reserve(max_length)
        .map_err(|BudgetFull { free, total }| {
            (
                ErrorCode::Busy,
                format!(
                    "busy: the KV cache is full ({free} of {total} tokens free, {max_length} asked); \
                     retry after {} s",
                    RETRY_AFTER.as_secs()
                ),
            )
        })?;
    let cache = ctx
        .core
        .open(start..end, max_length)
        .await
        .map_err(|e| (ErrorCode::TooLong, e.to_string()))?;
    Ok(Session {
        cache,
        len: 0,
        dtype: open.dtype,
        max_length,
        _slot: slot,
        _reservation: reservation,
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
) -> (Option<Session>, Reply) {
    let span = ctx.core.span();
    let input = match from_view(hidden, span.device()) {
        Ok(x) => x,
        Err(e) => return (Some(s), refuse(ErrorCode::BadShape, e.to_string())),
    };
    let positions = hidden.shape[1];
    if !ctx.step_delay.is_zero() {
        tokio::time::sleep(ctx.step_delay).await;
    }
    let corrupt = ctx.corrupt_outputs > 0.0 && rand::random::<f64>() < ctx.corrupt_outputs;
    let wire = s.dtype;
    let out = match s.cache.step(input, start).await {
        Ok(out) => out,
        Err(ComputeError::Lost(why)) => {
            tracing::error!(why, "a session's cache was lost");
            return (
                None,
                refuse(ErrorCode::Internal, format!("{why}; session ended")),
            );
        }
        Err(e) => return (Some(s), refuse(ErrorCode::Internal, e.to_string())),
    };
    s.len = start + positions;
    let payload = (if corrupt { add_noise(&out) } else { Ok(out) })
        .and_then(|y| to_payload(&y.to_dtype(candle_dtype(wire))?, wire));
    match payload {
        Ok(out) => {
            let frame = Response::StepOut { hidden: out.view() }.encode();
            (Some(s), Ok(frame))
        }
        Err(e) => (Some(s), refuse(ErrorCode::Internal, e.to_string())),
    }
}

/// `--corrupt-outputs`: plausible but wrong activations, `y` plus Gaussian
/// noise of a tenth of its root mean square.
fn add_noise(y: &Tensor) -> corolla_model::Result<Tensor> {
    let rms = y
        .to_dtype(DType::F32)?
        .sqr()?
        .mean_all()?
        .sqrt()?
        .to_scalar::<f32>()?;
    let noise = Tensor::randn(0f32, 0.1 * rms.max(1e-3), y.shape(), y.device())?;
    Ok((y + noise.to_dtype(y.dtype())?)?)
}
