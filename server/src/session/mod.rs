//! One inference session per stream: open, steps, close. Every field a peer
//! sends is checked before anything is allocated; a bad request gets an
//! error frame and the session (and every other session) goes on. Every
//! read, write and acknowledgement wait has a deadline, only progress (an
//! opened session, a computed step) keeps a stream alive, and a stream that
//! sends bad requests over and over is closed.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corolla_shared::flow::{FlowSender, MIN_WINDOW};
use corolla_shared::framing::{write_frame, FrameReader};
use corolla_shared::protocol::{ErrorCode, Request, Response};
use corolla_shared::{Compression, ServerRecord, WireDType};
use futures::AsyncWriteExt;
use libp2p::{PeerId, Stream};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::adapters::ServedAdapters;
use crate::admission::Reservation;
use crate::compute::{CacheLease, ComputeCore};
use crate::host_settings::HostSettings;
use crate::metrics::ServerMetrics;
use crate::push::{Inbox, InboxItem, PushLink, Pushed};
use crate::push_fault::LastPush;
use crate::quota::{Eviction, Slot};
use crate::refuse::{FIRST_FRAME_WITHIN, MAX_BAD_REQUESTS_IN_A_ROW};
use crate::successor::Successor;

mod open;
mod step;
use open::open_session;
use step::run_step;

/// What a refusal for want of cache suggests waiting before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// The longest any one reply may take to leave, acknowledgement waits included.
const MAX_WRITE_TIME: Duration = Duration::from_secs(30);

/// What every session of this server shares.
pub(crate) struct SessionContext {
    /// Owns the span and every session's cache; steps go through it.
    pub core: ComputeCore,
    /// Hashes of the span's blocks, in order.
    pub block_hashes: Vec<String>,
    /// The adapters a session may choose.
    pub adapters: ServedAdapters,
    /// What every span's sessions share (limits, deadlines, quotas, pushes).
    pub settings: Arc<HostSettings>,
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
        r.sessions = self.settings.sessions.in_use() as u32;
        // Shared prefix pages make way for sessions: their room is free.
        let pages = self.core.prefixes().map_or(0, |p| p.tokens_held());
        r.cache_tokens_left = (self.settings.cache.free() + pages) as u64;
        r.prefix_tokens = pages as u64;
    }

    fn write_deadline(&self) -> Duration {
        self.settings.idle_timeout.min(MAX_WRITE_TIME)
    }
}

struct Session {
    cache: CacheLease,
    /// The blocks this session runs.
    layers: Range<usize>,
    /// Positions the cache holds.
    len: usize,
    dtype: WireDType,
    /// How the client asked outputs to be compressed.
    compression: Compression,
    max_length: usize,
    /// Where other servers' pushes for this session arrive.
    inbox: Inbox,
    /// The one server this session may push to, named at Open (pushed to
    /// once it said it serves the next blocks).
    next: Option<Successor>,
    /// Toward that server, once pushed to.
    push_link: PushLink,
    /// The id of the last step computed: a push of this step or an earlier
    /// one is a replay (or came after the client carried the step itself),
    /// and computing it would rewind the cache under later steps.
    last_step_id: u32,
    /// What a `--push-fault replayed` server pushes next (a testing aid).
    last_push: LastPush,
    slot: Slot,
    _reservation: Reservation,
}

type Reply = Result<Vec<u8>, (ErrorCode, String)>;

fn refuse(code: ErrorCode, message: impl Into<String>) -> Reply {
    Err((code, message.into()))
}

/// The server's end of one session stream: it owns the framing (plain, or
/// flow-controlled once an Open asked for it; read through one cancel-safe
/// reader, which waits for pushes too) and every deadline on it.
struct SessionStream {
    stream: Stream,
    reader: FrameReader,
    flow: Option<FlowSender>,
    /// Counts the error frames sent.
    metrics: ServerMetrics,
}

impl SessionStream {
    /// Writes one reply within `deadline`; `false` when the stream is unusable.
    async fn send(&mut self, reply: Reply, deadline: Duration) -> bool {
        let frame = match reply {
            Ok(frame) => frame,
            Err((code, message)) => {
                tracing::debug!(?code, %message, "refusing a request");
                self.metrics.error_sent(code);
                Response::error(code, message).encode()
            }
        };
        let write = async {
            match &mut self.flow {
                Some(flow) => {
                    flow.write_frame(&mut self.stream, &mut self.reader, &frame)
                        .await
                }
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
    Pushed(InboxItem),
    End,
    Idle,
    /// The stream's or the session's slot went to another source.
    Evicted,
    ShuttingDown,
    /// Unreadable: the stream is out of sync (`Some`: tell the peer why).
    Broken(Option<String>),
}

/// The next step another server pushed to `session`, or word of one refused.
async fn next_push(session: &mut Option<Session>) -> InboxItem {
    if let Some(s) = session {
        if let Some(pushed) = s.inbox.receiver.recv().await {
            return pushed;
        }
    }
    std::future::pending().await
}

/// A pushed step to compute, or the notice to the client of a push refused:
/// on the push stream (its proof did not hold), or here, for a step the
/// session has already passed.
fn refused_push(session: Option<&Session>, item: InboxItem) -> Result<Pushed, Response<'static>> {
    let (from, step_id, reason) = match item {
        InboxItem::Step(pushed) => match session {
            Some(s) if pushed.header.step_id <= s.last_step_id => {
                let reason = format!(
                    "a push of step {}, which this session already passed (step {})",
                    pushed.header.step_id, s.last_step_id
                );
                (pushed.from, pushed.header.step_id, reason)
            }
            _ => return Ok(pushed),
        },
        InboxItem::Refused {
            from,
            step_id,
            reason,
        } => (from, step_id, reason),
    };
    tracing::debug!(%from, step_id, %reason, "refused a push; telling the client");
    Err(Response::PushRefused {
        step_id,
        from,
        reason,
    })
}

/// Completes when the stream's slot or its session's was given away.
async fn evicted(stream_slot: &Slot, session: Option<Eviction>) {
    match session {
        Some(session) => tokio::select! {
            _ = stream_slot.evicted() => {}
            _ = session.happened() => {}
        },
        None => stream_slot.evicted().await,
    }
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
    let mut io = SessionStream {
        stream,
        reader: FrameReader::new(ctx.settings.limits.max_frame_bytes()),
        flow: None,
        metrics: ctx.settings.metrics.clone(),
    };
    let mut session: Option<Session> = None;
    // Ended without the client's Close or end of stream: a client that
    // still wants it reopens and replays (see `ServerMetrics::session_opened`).
    let mut cut_short = false;
    let mut shutdown = ctx.shutdown.clone();
    let mut control = ctx.settings.control.clone();
    // An idle stream holds a slot: until its session opens, it has seconds.
    let mut idle_until = Instant::now() + FIRST_FRAME_WITHIN.min(ctx.settings.idle_timeout);
    let mut bad_in_a_row = 0;
    loop {
        let session_eviction = session.as_ref().map(|s| s.slot.eviction());
        let incoming = tokio::select! {
            read = tokio::time::timeout_at(idle_until, io.reader.next_frame(&mut io.stream)) => match read {
                Err(_) => Incoming::Idle,
                Ok(Ok(Some(_))) => Incoming::Frame,
                Ok(Ok(None)) => Incoming::End,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => Incoming::Broken(Some(e.to_string())),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "session stream failed");
                    Incoming::Broken(None)
                }
            },
            pushed = next_push(&mut session) => Incoming::Pushed(pushed),
            _ = evicted(&stream_slot, session_eviction) => Incoming::Evicted,
            _ = shutting_down(&mut shutdown) => Incoming::ShuttingDown,
        };
        let deadline = ctx.write_deadline();
        let mut pushed_step = None;
        match incoming {
            Incoming::Frame => {}
            Incoming::Pushed(item) => match refused_push(session.as_ref(), item) {
                Ok(pushed) => pushed_step = Some(pushed),
                // Neither progress nor the client's fault: it hears at once,
                // carries the step itself and blames the pusher.
                Err(notice) => {
                    if !io.send(Ok(notice.encode()), deadline).await {
                        cut_short = true;
                        break;
                    }
                    continue;
                }
            },
            Incoming::End => break,
            Incoming::Idle => {
                let msg = match session {
                    Some(_) => format!(
                        "idle (no progress) for {:?}; session closed",
                        ctx.settings.idle_timeout
                    ),
                    None => {
                        format!("no session opened within {FIRST_FRAME_WITHIN:?}; stream closed")
                    }
                };
                io.send(Err((ErrorCode::Timeout, msg)), deadline).await;
                cut_short = true;
                break;
            }
            Incoming::Evicted => {
                let msg = "busy: this server is full and this session's place went to a \
                           waiting client (it was idle, or its addresses held more than their \
                           share); continue elsewhere";
                io.send(Err((ErrorCode::Busy, msg.into())), deadline).await;
                cut_short = true;
                break;
            }
            Incoming::ShuttingDown => {
                let msg = "this server is shutting down; continue elsewhere";
                io.send(Err((ErrorCode::ShuttingDown, msg.into())), deadline)
                    .await;
                break;
            }
            Incoming::Broken(why) => {
                match why {
                    Some(why) => {
                        io.send(Err((ErrorCode::TooLong, why)), deadline).await;
                    }
                    None => cut_short = true,
                }
                break;
            }
        }
        let reply = if let Some(pushed) = pushed_step {
            tracing::trace!(%peer, from = %pushed.from, step = pushed.header.step_id, "a pushed step");
            let (s, reply) = run_step(
                &ctx,
                session.take(),
                &mut control,
                &pushed.header,
                &pushed.hidden.view(),
                Some(pushed.proof),
            )
            .await;
            session = s;
            reply
        } else {
            match Request::decode(io.reader.frame(), &ctx.settings.limits) {
                Err(e) => refuse(ErrorCode::BadFrame, format!("malformed request: {e}")),
                Ok(Request::Close) => break,
                Ok(Request::Ack { received }) => match io.flow.as_mut().map(|f| f.on_ack(received))
                {
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
                        let token = s.inbox.token();
                        tracing::debug!(%peer, start = open.start, end = open.end, max_length, "session opened");
                        session = Some(s);
                        Response::Opened { max_length, token }.encode()
                    })
                    }
                },
                Ok(Request::Step { header, hidden }) => {
                    let (s, reply) =
                        run_step(&ctx, session.take(), &mut control, &header, &hidden, None).await;
                    session = s;
                    reply
                }
            }
        };
        let reply = match reply {
            Ok(frame) => {
                bad_in_a_row = 0;
                idle_until = Instant::now() + ctx.settings.idle_timeout;
                stream_slot.progressed();
                if let Some(s) = &session {
                    s.slot.progressed();
                }
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
            cut_short = true;
            break;
        }
    }
    if let Some(s) = session.as_ref().filter(|_| cut_short) {
        ctx.settings
            .metrics
            .session_cut_short(peer, s.layers.clone());
    }
    // Free the cache, the slots and the span (a moving server waits for
    // them) before waiting for the stream to close.
    drop(session);
    drop(stream_slot);
    drop(ctx);
    io.close().await;
    tracing::debug!(%peer, "session closed");
}
