//! The client side of one inference session over one stream, at the level of
//! bytes and payloads (no tensors), so that native and browser clients share it.

use std::time::Duration;

use futures::AsyncWriteExt;
use libp2p::PeerId;

use crate::flow::{write_frame_in_pieces, FlowReceiver};
use crate::framing::{read_frame, write_frame, FrameReader};
use crate::limits::Limits;
use crate::protocol::{
    encode_step_with, ErrorCode, OpenRequest, ProtocolError, Request, Response, SessionToken,
    StepHeader, INFERENCE_PROTOCOL, INFO_PROTOCOL,
};
use crate::push_proof::{view_digest, PayloadDigest, PushProof, PushSender};
use crate::record::{ServerRecord, MAX_RECORD_BYTES};
use crate::tensor::{Compression, TensorPayload};
use crate::time::with_timeout;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("cannot open a stream to {peer}: {message}")]
    Connect { peer: PeerId, message: String },
    #[error("connection to {peer} failed: {source}")]
    Io {
        peer: PeerId,
        #[source]
        source: std::io::Error,
    },
    #[error("{peer} closed the session")]
    Closed { peer: PeerId },
    #[error("{peer} sent a bad message: {source}")]
    Protocol {
        peer: PeerId,
        #[source]
        source: ProtocolError,
    },
    #[error("{peer} refused: {message} ({code:?})")]
    Remote {
        peer: PeerId,
        code: ErrorCode,
        message: String,
    },
    #[error("{peer} sent an unexpected message")]
    Unexpected { peer: PeerId },
    #[error("{peer} did not answer within {timeout:?}")]
    Timeout { peer: PeerId, timeout: Duration },
    /// A well-formed answer that cannot be the blocks' output.
    #[error("{peer} returned an impossible output: {message}")]
    BadOutput { peer: PeerId, message: String },
    /// A spot check found the server's output wrong (see the client's chain).
    #[error("{peer} returned wrong activations (found by a spot check)")]
    Caught { peer: PeerId },
    /// The server pushed other activations than it returned, and signed
    /// them (see [`crate::push_proof`]).
    #[error("{peer} pushed other activations to the next server than it returned (its signed push proof shows it)")]
    PushLie { peer: PeerId },
    /// The server refused what was pushed to it for the step (a proof that
    /// does not hold, a step already passed): the pusher's fault, which the
    /// client charges to the pusher after carrying the step itself.
    #[error("{peer} refused the push it got for the step: {message}")]
    PushRefused { peer: PeerId, message: String },
    /// The server said it pushed its output on, but no valid push reached
    /// the next server in time (the next server then answered the step
    /// the client carried to it).
    #[error("{peer} did not deliver its push to the next server: {message}")]
    PushUndelivered { peer: PeerId, message: String },
}

impl SessionError {
    /// The stream ended or failed (yamux's reset stream writes zero bytes,
    /// WebRTC's resets) before any answer came. When the whole connection
    /// is gone the next try's stream cannot open, which ends the tries.
    fn is_dropped_stream(&self) -> bool {
        matches!(self, SessionError::Closed { .. } | SessionError::Io { .. })
    }

    pub fn peer(&self) -> PeerId {
        match self {
            SessionError::Connect { peer, .. }
            | SessionError::Io { peer, .. }
            | SessionError::Closed { peer }
            | SessionError::Protocol { peer, .. }
            | SessionError::Remote { peer, .. }
            | SessionError::Unexpected { peer }
            | SessionError::Timeout { peer, .. }
            | SessionError::BadOutput { peer, .. }
            | SessionError::Caught { peer }
            | SessionError::PushLie { peer }
            | SessionError::PushRefused { peer, .. }
            | SessionError::PushUndelivered { peer, .. } => *peer,
        }
    }
}

pub struct RemoteSession {
    /// The server: its peer id, and its key as the sender of the pushes its
    /// proofs speak for (decoded once).
    server: PushSender,
    stream: libp2p::Stream,
    /// Frames without flow control, read cancel-safely: a step whose wait
    /// ran out (a push that never came) leaves the stream in step.
    reader: FrameReader,
    /// Frames under flow control.
    buf: Vec<u8>,
    /// A flow-controlled read was cut off by its deadline part way: the
    /// stream is out of step and the session cannot be used again.
    flow_read_cut: bool,
    limits: Limits,
    timeout: Duration,
    step_timeout: Option<StepTimeout>,
    /// Set when the session asked for flow control.
    flow: Option<FlowReceiver>,
    /// The server's handle on this session, for pushes from other servers.
    token: SessionToken,
    /// The id of the last step sent or expected; answers of earlier steps
    /// that arrive late are skipped.
    step_id: u32,
    /// How this end compresses what it sends.
    compression: Compression,
    /// The one server this session may push to, named at Open.
    next: Option<PeerId>,
    /// The last pushed step whose answer came after the client had given
    /// up waiting for it (skipped as late): the push did arrive.
    late_pushed_answer: Option<u32>,
}

/// A step's output as the server answered it.
#[derive(Debug)]
pub struct StepReply {
    /// Checked to be possible, and decompressed.
    pub hidden: TensorPayload,
    /// The server pushed it on to the next session of the route.
    pub pushed: bool,
    /// For a step pushed to this session: the pushing server's proof of
    /// what it pushed.
    pub input_proof: Option<PushProof>,
    /// When `pushed`: the digest of the output as it came (what the next
    /// server's proof must name).
    pub digest: Option<PayloadDigest>,
}

/// Late answers skipped while waiting for one step's output: more can only
/// be a server answering steps nobody sent.
const MAX_STALE_ANSWERS: usize = 8;

/// A step deadline that grows with the step's positions: a server that died
/// without closing its connection (WebRTC notices only after ~30 s) is given
/// up on after `base` for a one-token step, not after the session timeout.
#[derive(Debug, Clone, Copy)]
pub struct StepTimeout {
    pub base: Duration,
    pub per_position: Duration,
}

impl RemoteSession {
    /// Opens a stream to `peer` and a session on it. A stream that ends
    /// before any answer is opened again (see [`DROPPED_STREAM_TRIES`]).
    pub async fn open(
        control: &mut libp2p_stream::Control,
        peer: PeerId,
        request: OpenRequest,
        timeout: Duration,
    ) -> Result<Self, SessionError> {
        retry_dropped_stream(timeout, || {
            Self::open_once(control.clone(), peer, request.clone(), timeout)
        })
        .await
    }

    async fn open_once(
        mut control: libp2p_stream::Control,
        peer: PeerId,
        request: OpenRequest,
        timeout: Duration,
    ) -> Result<Self, SessionError> {
        let stream =
            match with_timeout(timeout, control.open_stream(peer, INFERENCE_PROTOCOL)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return Err(SessionError::Connect {
                        peer,
                        message: e.to_string(),
                    })
                }
                Err(_) => return Err(SessionError::Timeout { peer, timeout }),
            };
        let flow = (request.flow_window > 0).then(|| FlowReceiver::new(request.flow_window));
        let compression = request.compression;
        let next = request.next;
        let mut session = RemoteSession {
            server: PushSender::new(peer),
            stream,
            reader: FrameReader::new(0),
            buf: Vec::new(),
            flow_read_cut: false,
            // Until the first step: an answer to Open is a few bytes.
            limits: Limits {
                max_tensor_bytes: 0,
                ..Limits::DEFAULT
            },
            timeout,
            step_timeout: None,
            flow,
            token: SessionToken([0; 16]),
            step_id: 0,
            compression,
            next,
            late_pushed_answer: None,
        };
        let frame = Request::Open(request).encode();
        let token = match session.exchange(&frame, timeout).await? {
            Response::Opened { token, .. } => token,
            _ => return Err(SessionError::Unexpected { peer }),
        };
        session.token = token;
        Ok(session)
    }

    /// The server's handle on this session, for a push route.
    pub fn token(&self) -> SessionToken {
        self.token
    }

    /// An id for the next step, above every id this session has seen.
    pub fn next_step_id(&self) -> u32 {
        self.step_id.wrapping_add(1)
    }

    /// Takes note that step `step_id` may reach this session by push, so
    /// that the next step sent to it directly gets a later id.
    pub fn expect_step(&mut self, step_id: u32) {
        self.step_id = self.step_id.max(step_id);
    }

    pub fn peer(&self) -> PeerId {
        self.server.peer()
    }

    /// This session's server as the sender of pushes (its key decoded once).
    pub fn as_push_sender(&self) -> &PushSender {
        &self.server
    }

    /// The server this session may push to, as its Open named it.
    pub fn next(&self) -> Option<PeerId> {
        self.next
    }

    /// Steps wait `base + per_position × T`, at most the session timeout.
    pub fn with_step_timeout(mut self, step_timeout: Option<StepTimeout>) -> Self {
        self.step_timeout = step_timeout;
        self
    }

    /// Sends hidden states for positions `start..start + T`; returns the
    /// span's output, checked to be possible: the input's dtype and shape
    /// (a longer answer is refused before it is read) and finite values.
    pub async fn step(
        &mut self,
        start: u32,
        hidden: &TensorPayload,
    ) -> Result<TensorPayload, SessionError> {
        let header = StepHeader {
            start_position: start,
            step_id: self.next_step_id(),
            push: Vec::new(),
        };
        self.send_step(&header, hidden).await?;
        Ok(self.receive_output(header.step_id, hidden).await?.hidden)
    }

    /// The deadline of a step like `hidden`.
    fn step_deadline(&self, hidden: &TensorPayload) -> Duration {
        let positions = hidden.shape.get(1).copied().unwrap_or(1) as u32;
        match self.step_timeout {
            Some(t) => (t.base + t.per_position * positions).min(self.timeout),
            None => self.timeout,
        }
    }

    /// Sends a step without waiting for its answer (see [`Self::receive_output`]).
    pub async fn send_step(
        &mut self,
        header: &StepHeader,
        hidden: &TensorPayload,
    ) -> Result<(), SessionError> {
        let frame = encode_step_with(header, &hidden.compressed(self.compression));
        let peer = self.peer();
        let timeout = self.step_deadline(hidden);
        self.step_id = header.step_id;
        let io = |source| SessionError::Io { peer, source };
        with_timeout(timeout, async {
            match self.flow {
                Some(_) => write_frame_in_pieces(&mut self.stream, &frame).await,
                None => write_frame(&mut self.stream, &frame).await,
            }
        })
        .await
        .map_err(|_| SessionError::Timeout { peer, timeout })?
        .map_err(io)
    }

    /// Waits for the output of step `step_id`, whose input was like `input`
    /// (its own, or the one pushed to this session), skipping late answers
    /// of earlier steps. Returns the output, checked to be possible, with
    /// what the server said of pushes.
    pub async fn receive_output(
        &mut self,
        step_id: u32,
        input: &TensorPayload,
    ) -> Result<StepReply, SessionError> {
        let deadline = self.step_deadline(input);
        self.receive_output_within(step_id, input, deadline, None)
            .await
    }

    /// [`Self::receive_output`] waiting at most `wait` (and never past the
    /// step's deadline) for a step `pusher` was to push to this session: the
    /// server's word that it refused that push is
    /// [`SessionError::PushRefused`]. A wait that runs out leaves the
    /// session usable when [`Self::in_step`] says so.
    pub async fn receive_output_within(
        &mut self,
        step_id: u32,
        input: &TensorPayload,
        wait: Duration,
        pusher: Option<PeerId>,
    ) -> Result<StepReply, SessionError> {
        self.step_id = step_id;
        let timeout = wait.min(self.step_deadline(input));
        self.limits = Limits {
            max_tensor_bytes: input.data.len() as u64,
            ..Limits::DEFAULT
        };
        let peer = self.peer();
        let bad = |message: String| SessionError::BadOutput { peer, message };
        for _ in 0..=MAX_STALE_ANSWERS {
            let reply = match self.read_response(timeout).await? {
                Response::StepOut {
                    step_id: id,
                    pushed,
                    input_proof,
                    hidden: out,
                } => {
                    if id != step_id {
                        if id < step_id {
                            if input_proof.is_some() {
                                self.late_pushed_answer = Some(id);
                            }
                            continue;
                        }
                        return Err(bad(format!(
                            "the answer of step {id}, while step {step_id} was the last sent"
                        )));
                    }
                    if out.dtype != input.dtype || out.shape != input.shape {
                        return Err(bad(format!(
                            "{:?} {:?} for an input of {:?} {:?}",
                            out.dtype, out.shape, input.dtype, input.shape
                        )));
                    }
                    StepReply {
                        hidden: out.to_owned().decompressed(),
                        pushed,
                        input_proof,
                        digest: pushed.then(|| view_digest(&out)),
                    }
                }
                Response::PushRefused {
                    step_id: id,
                    from,
                    reason,
                } => {
                    // Late news of an earlier step, or of a push from a
                    // server this session's route does not put before it.
                    if id < step_id || Some(from) != pusher {
                        continue;
                    }
                    if id > step_id {
                        return Err(bad(format!(
                            "a refused push of step {id}, while step {step_id} was the last sent"
                        )));
                    }
                    return Err(SessionError::PushRefused {
                        peer,
                        message: reason,
                    });
                }
                _ => return Err(SessionError::Unexpected { peer }),
            };
            return match reply.hidden.first_non_finite() {
                Some(i) => Err(bad(format!("value {i} is NaN or infinite"))),
                None => Ok(reply),
            };
        }
        Err(bad(format!(
            "more than {MAX_STALE_ANSWERS} answers of steps before step {step_id}"
        )))
    }

    /// Ends the session politely; the server frees its cache.
    pub async fn close(mut self) {
        let close = Request::Close.encode();
        let _ = match self.flow {
            Some(_) => write_frame_in_pieces(&mut self.stream, &close).await,
            None => write_frame(&mut self.stream, &close).await,
        };
        let _ = self.stream.close().await;
    }

    async fn exchange(
        &mut self,
        frame: &[u8],
        timeout: Duration,
    ) -> Result<Response<'_>, SessionError> {
        let peer = self.peer();
        let io = |source| SessionError::Io { peer, source };
        with_timeout(timeout, async {
            match self.flow {
                Some(_) => write_frame_in_pieces(&mut self.stream, frame).await,
                None => write_frame(&mut self.stream, frame).await,
            }
        })
        .await
        .map_err(|_| SessionError::Timeout { peer, timeout })?
        .map_err(io)?;
        self.read_response(timeout).await
    }

    /// Whether this session's server answered the pushed step `step_id`
    /// after all, once the client no longer waited for it: the push came,
    /// late (or the server computed slowly).
    pub fn answered_late(&self, step_id: u32) -> bool {
        self.late_pushed_answer == Some(step_id)
    }

    /// Whether the stream is between frames (or in a frame the next read
    /// resumes), so that the session can go on after a wait ran out.
    pub fn in_step(&self) -> bool {
        !self.flow_read_cut
    }

    async fn read_response(&mut self, timeout: Duration) -> Result<Response<'_>, SessionError> {
        let peer = self.peer();
        let io = |source| SessionError::Io { peer, source };
        let max = self.limits.max_frame_bytes();
        let timed_out = |_| SessionError::Timeout { peer, timeout };
        let got = match &mut self.flow {
            Some(flow) => {
                self.flow_read_cut = true;
                let read = flow.read_frame(&mut self.stream, max, &mut self.buf);
                let got = with_timeout(timeout, read)
                    .await
                    .map_err(timed_out)?
                    .map_err(io)?;
                self.flow_read_cut = false;
                got
            }
            None => {
                self.reader.set_max_len(max);
                with_timeout(timeout, self.reader.next_frame(&mut self.stream))
                    .await
                    .map_err(timed_out)?
                    .map_err(io)?
                    .is_some()
            }
        };
        if !got {
            return Err(SessionError::Closed { peer });
        }
        let frame = match self.flow {
            Some(_) => &self.buf[..],
            None => self.reader.frame(),
        };
        match Response::decode(frame, &self.limits) {
            Ok(Response::Error { code, message }) => Err(SessionError::Remote {
                peer,
                code,
                message,
            }),
            Ok(r) => Ok(r),
            Err(source) => Err(SessionError::Protocol { peer, source }),
        }
    }
}

/// Asks `peer` for its live record over the info protocol (again when the
/// stream ends before the record, see [`DROPPED_STREAM_TRIES`]).
pub async fn fetch_info(
    control: &mut libp2p_stream::Control,
    peer: PeerId,
    timeout: Duration,
) -> Result<ServerRecord, SessionError> {
    retry_dropped_stream(timeout, || fetch_info_once(control.clone(), peer, timeout)).await
}

async fn fetch_info_once(
    mut control: libp2p_stream::Control,
    peer: PeerId,
    timeout: Duration,
) -> Result<ServerRecord, SessionError> {
    let result = with_timeout(timeout, async {
        let mut stream = control
            .open_stream(peer, INFO_PROTOCOL)
            .await
            .map_err(|e| SessionError::Connect {
                peer,
                message: e.to_string(),
            })?;
        let mut buf = Vec::new();
        let got = read_frame(&mut stream, MAX_RECORD_BYTES, &mut buf)
            .await
            .map_err(|source| SessionError::Io { peer, source })?;
        if !got {
            return Err(SessionError::Closed { peer });
        }
        ServerRecord::from_bytes(&buf).map_err(|_| SessionError::Unexpected { peer })
    })
    .await;
    match result {
        Ok(r) => r,
        Err(_) => Err(SessionError::Timeout { peer, timeout }),
    }
}

/// How many times a request is sent on a fresh stream when its stream ends
/// (or is reset) before any answer. libp2p's stream layer keeps one
/// unaccepted inbound stream per protocol and drops the others, so when
/// many clients arrive together while a server's cores are busy computing,
/// streams are lost before the server sees them; nothing was done on them,
/// so asking again is safe. A crowd of eight at a server that accepts one
/// stream per 300 ms needs ~2.4 s of tries for its last member: five tries
/// (1.2 s of waits) lost opens when the machine was loaded.
pub const DROPPED_STREAM_TRIES: u32 = 10;

/// The wait before the second try; it doubles for each later one, up to
/// [`DROPPED_STREAM_BACKOFF_MAX`] (~3 s of waits over all tries).
const DROPPED_STREAM_BACKOFF: Duration = Duration::from_millis(40);
const DROPPED_STREAM_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Runs `attempt` until it succeeds, fails otherwise than by a dropped
/// stream, [`DROPPED_STREAM_TRIES`] are spent, or `timeout` has passed.
async fn retry_dropped_stream<T, F, Fut>(
    timeout: Duration,
    mut attempt: F,
) -> Result<T, SessionError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, SessionError>>,
{
    let started = web_time::Instant::now();
    let mut backoff = DROPPED_STREAM_BACKOFF;
    let mut tries = 1;
    loop {
        match attempt().await {
            Err(e)
                if e.is_dropped_stream()
                    && tries < DROPPED_STREAM_TRIES
                    && started.elapsed() + backoff < timeout =>
            {
                tracing::debug!(peer = %e.peer(), tries, "stream dropped before any answer; opening another");
                crate::time::sleep(backoff).await;
                backoff = (backoff * 2).min(DROPPED_STREAM_BACKOFF_MAX);
                tries += 1;
            }
            other => return other,
        }
    }
}
