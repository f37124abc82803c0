//! The client side of one inference session over one stream, at the level of
//! bytes and payloads (no tensors), so that native and browser clients share it.

use std::time::Duration;

use futures::AsyncWriteExt;
use libp2p::PeerId;

use crate::flow::{write_frame_in_pieces, FlowReceiver};
use crate::framing::{read_frame, write_frame};
use crate::limits::Limits;
use crate::node::{with_timeout, NodeError};
use crate::protocol::{
    encode_step, ErrorCode, OpenRequest, ProtocolError, Request, Response, INFERENCE_PROTOCOL,
    INFO_PROTOCOL,
};
use crate::record::{ServerRecord, MAX_RECORD_BYTES};
use crate::tensor::TensorPayload;

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
}

impl SessionError {
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
            | SessionError::Caught { peer } => *peer,
        }
    }
}

pub struct RemoteSession {
    peer: PeerId,
    stream: libp2p::Stream,
    buf: Vec<u8>,
    limits: Limits,
    timeout: Duration,
    step_timeout: Option<StepTimeout>,
    /// Set when the session asked for flow control.
    flow: Option<FlowReceiver>,
}

/// A step deadline that grows with the step's positions: a server that died
/// without closing its connection (WebRTC notices only after ~30 s) is given
/// up on after `base` for a one-token step, not after the session timeout.
#[derive(Debug, Clone, Copy)]
pub struct StepTimeout {
    pub base: Duration,
    pub per_position: Duration,
}

impl RemoteSession {
    /// Opens a stream to `peer` and a session on it.
    pub async fn open(
        control: &mut libp2p_stream::Control,
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
        let mut session = RemoteSession {
            peer,
            stream,
            buf: Vec::new(),
            // Until the first step: an answer to Open is a few bytes.
            limits: Limits {
                max_tensor_bytes: 0,
                ..Limits::DEFAULT
            },
            timeout,
            step_timeout: None,
            flow,
        };
        let frame = Request::Open(request).encode();
        match session.exchange(&frame, timeout).await? {
            Response::Opened { .. } => Ok(session),
            _ => Err(SessionError::Unexpected { peer }),
        }
    }

    pub fn peer(&self) -> PeerId {
        self.peer
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
        let frame = encode_step(start, hidden);
        let positions = hidden.shape.get(1).copied().unwrap_or(1) as u32;
        let timeout = match self.step_timeout {
            Some(t) => (t.base + t.per_position * positions).min(self.timeout),
            None => self.timeout,
        };
        self.limits = Limits {
            max_tensor_bytes: hidden.data.len() as u64,
            ..Limits::DEFAULT
        };
        let peer = self.peer;
        let bad = |message: String| SessionError::BadOutput { peer, message };
        let out = match self.exchange(&frame, timeout).await? {
            Response::StepOut { hidden: out } => {
                if out.dtype != hidden.dtype || out.shape != hidden.shape {
                    return Err(bad(format!(
                        "{:?} {:?} for an input of {:?} {:?}",
                        out.dtype, out.shape, hidden.dtype, hidden.shape
                    )));
                }
                out.to_owned()
            }
            _ => return Err(SessionError::Unexpected { peer }),
        };
        match out.first_non_finite() {
            Some(i) => Err(bad(format!("value {i} is NaN or infinite"))),
            None => Ok(out),
        }
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
        let peer = self.peer;
        let io = |source| SessionError::Io { peer, source };
        let max = self.limits.max_frame_bytes();
        let got = with_timeout(timeout, async {
            match &mut self.flow {
                Some(flow) => {
                    write_frame_in_pieces(&mut self.stream, frame)
                        .await
                        .map_err(io)?;
                    flow.read_frame(&mut self.stream, max, &mut self.buf)
                        .await
                        .map_err(io)
                }
                None => {
                    write_frame(&mut self.stream, frame).await.map_err(io)?;
                    read_frame(&mut self.stream, max, &mut self.buf)
                        .await
                        .map_err(io)
                }
            }
        })
        .await
        .map_err(|_| SessionError::Timeout { peer, timeout })??;
        if !got {
            return Err(SessionError::Closed { peer });
        }
        match Response::decode(&self.buf, &self.limits) {
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

/// Asks `peer` for its live record over the info protocol.
pub async fn fetch_info(
    control: &mut libp2p_stream::Control,
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
        Err(NodeError::Timeout(_)) | Err(_) => Err(SessionError::Timeout { peer, timeout }),
    }
}
