//! The inference and info protocols: protocol ids, messages and their
//! binary encoding.
//!
//! One libp2p stream carries one inference session:
//!
//! ```text
//! client: Open{model, fingerprint, span, max_length, dtype, next, adapter?}  server: Opened{max_length, token}
//! client: Step{start_position, step_id, push, hidden[1, T, H]}  server: StepOut{step_id, pushed, input_proof, hidden} | Error
//! ...
//! client: Close
//! ```
//!
//! Push (`/corolla/push/2`): a step may name the sessions after this
//! server (`push`: peer and session token of each, in route order); the
//! server then sends its output straight to the next one as a [`PushStep`]
//! on a push stream, before answering its own client. The next server runs
//! it as if its client had sent it, answers its client with an unsolicited
//! `StepOut` carrying the same `step_id`, and pushes on. The token, random
//! and known only to the session's client and the servers it names, is what
//! lets a push in: a push for an unknown token is refused. A server pushes
//! only to the `next` peer its session's Open named, and refuses a route
//! that names itself or any peer twice (a loop would make one client frame
//! cost many steps). Every push carries the sender's signed digest of what
//! it pushed ([`crate::push_proof`]), which the receiver checks and returns
//! in its `StepOut` (`input_proof`), so the client can tell a sender that
//! pushed other numbers than it returned from a receiver that lies. A push
//! the receiver refuses (a proof that does not hold, a step its session
//! already passed) is reported to the session's client too, unasked
//! (`PushRefused{step_id, reason}`): the client then carries that step
//! itself and blames the pusher, never the receiver that waited for it.
//!
//! Every message is one length-prefixed frame (see [`crate::framing`]):
//! a tag byte, then its fields, little-endian. Decoding checks every field
//! against [`Limits`] and borrows tensor data from the frame.

use libp2p::StreamProtocol;

use crate::adapter_name::MAX_ADAPTER_NAME_LEN;
use crate::limits::Limits;
use crate::push_proof::{PushProof, MAX_SIGNATURE_LEN};
pub use crate::session_token::SessionToken;
use crate::tensor::{
    encode_into, Compression, TensorCodecError, TensorPayload, TensorView, WireDType,
};

mod reader;
#[cfg(test)]
mod tests;

use reader::Reader;

pub const INFERENCE_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/inference/4");
pub const PUSH_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/push/2");
pub const INFO_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/info/1");
pub const KADEMLIA_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/kad/1");
pub const IDENTIFY_PROTOCOL_VERSION: &str = "/corolla/1";

/// Longest model name or fingerprint accepted.
pub const MAX_NAME_LEN: usize = 256;
/// Longest error message accepted.
pub const MAX_MESSAGE_LEN: usize = 4096;
/// Most sessions a step may ask to push through (a 70B model spans ~10).
pub const MAX_PUSH_TARGETS: usize = 64;
/// Longest peer id accepted, in bytes (an Ed25519 one is 38).
const MAX_PEER_ID_LEN: usize = 128;

/// One later session of a push route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    pub peer: libp2p::PeerId,
    pub token: SessionToken,
}

/// What a step says besides its hidden states.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepHeader {
    pub start_position: u32,
    /// Chosen by the client and echoed in every `StepOut` of the step (the
    /// pushed ones too), so a late answer of an abandoned step is told apart.
    pub step_id: u32,
    /// The sessions after this one, in route order; empty: answer only.
    pub push: Vec<PushTarget>,
}

/// A step one server pushes to the next (`/corolla/push/2`).
#[derive(Debug, Clone, PartialEq)]
pub struct PushStep<'a> {
    pub token: SessionToken,
    pub header: StepHeader,
    /// The sender's signed digest of `hidden`.
    pub proof: PushProof,
    pub hidden: TensorView<'a>,
}

/// The DHT key under which the servers of a model announce themselves.
pub fn model_dht_key(model: &str) -> libp2p::kad::RecordKey {
    libp2p::kad::RecordKey::new(&format!("/corolla/model/{model}"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenRequest {
    pub model: String,
    /// `span_hash` of the requested blocks' hashes, as the client expects
    /// them; empty when it does not know them.
    pub fingerprint: String,
    pub start: u32,
    pub end: u32,
    pub max_length: u32,
    /// dtype of the hidden states on the wire, both ways.
    pub dtype: WireDType,
    /// How both ends compress the hidden states they send (each end
    /// decompresses what it receives into `dtype`).
    pub compression: Compression,
    /// Nonzero: the most unacknowledged bytes the server may have in flight
    /// toward the client, which acknowledges with [`Request::Ack`]; and every
    /// write of both ends is a flushed piece of at most 8000 bytes (see
    /// [`crate::flow`]). Browsers over WebRTC need it; zero means neither.
    pub flow_window: u32,
    /// The one server this session may push its outputs to: the next of
    /// the client's route. `None`: the session never pushes.
    pub next: Option<libp2p::PeerId>,
    /// The LoRA adapter the session's steps run with (a name the server
    /// announces); `None`: the base weights. Written last and only when
    /// set, so an Open without one reads as before.
    pub adapter: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Request<'a> {
    Open(OpenRequest),
    Step {
        header: StepHeader,
        hidden: TensorView<'a>,
    },
    Close,
    /// Bytes the client has read from the stream so far (flow control).
    Ack {
        received: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BadFrame,
    UnknownSession,
    WrongModel,
    SpanNotServed,
    BadShape,
    TooLong,
    Busy,
    Timeout,
    Internal,
    /// The server is leaving the swarm; the client should go elsewhere.
    ShuttingDown,
}

impl ErrorCode {
    const ALL: [ErrorCode; 10] = [
        ErrorCode::BadFrame,
        ErrorCode::UnknownSession,
        ErrorCode::WrongModel,
        ErrorCode::SpanNotServed,
        ErrorCode::BadShape,
        ErrorCode::TooLong,
        ErrorCode::Busy,
        ErrorCode::Timeout,
        ErrorCode::Internal,
        ErrorCode::ShuttingDown,
    ];

    fn code(self) -> u16 {
        self as u16
    }

    fn from_code(code: u16) -> Result<Self, ProtocolError> {
        Self::ALL
            .get(code as usize)
            .copied()
            .ok_or(ProtocolError::UnknownErrorCode(code))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Response<'a> {
    Opened {
        max_length: u32,
        token: SessionToken,
    },
    StepOut {
        step_id: u32,
        /// The output also went on to the next session of the step's push route.
        pushed: bool,
        /// For a step pushed to this session: the proof the pushing server
        /// sent with it (what the client checks against that server's output).
        input_proof: Option<PushProof>,
        hidden: TensorView<'a>,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    /// A push for this session's step `step_id` did not get in (a proof
    /// that does not hold, a step already passed): sent unasked, so that
    /// the client carries that step itself at once and blames the pusher
    /// rather than waiting for an output that cannot come.
    PushRefused {
        step_id: u32,
        /// Who pushed it (the receiver's word: the client blames its own
        /// route's pusher only when this names it).
        from: libp2p::PeerId,
        reason: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("empty message")]
    Empty,
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    #[error("message truncated")]
    Truncated,
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("string of {len} bytes exceeds the limit of {max}")]
    StringTooLong { len: usize, max: usize },
    #[error("string is not valid UTF-8")]
    BadUtf8,
    #[error("unknown error code {0}")]
    UnknownErrorCode(u16),
    #[error("unknown dtype code {0}")]
    UnknownDType(u8),
    #[error("a push route of {0} sessions exceeds the limit of {MAX_PUSH_TARGETS}")]
    PushRouteTooLong(usize),
    #[error("bad peer id")]
    BadPeerId,
    #[error("a signature of {0} bytes exceeds the limit of {MAX_SIGNATURE_LEN}")]
    SignatureTooLong(usize),
    #[error("tensor: {0}")]
    Tensor(#[from] TensorCodecError),
}

mod tag {
    pub const OPEN: u8 = 1;
    pub const STEP: u8 = 2;
    pub const CLOSE: u8 = 3;
    pub const ACK: u8 = 4;
    pub const PUSH: u8 = 5;
    pub const OPENED: u8 = 101;
    pub const STEP_OUT: u8 = 102;
    pub const ERROR: u8 = 103;
    pub const PUSH_REFUSED: u8 = 104;
}

fn dtype_code(d: WireDType) -> u8 {
    d.code()
}

fn dtype_from_code(c: u8) -> Result<WireDType, ProtocolError> {
    WireDType::ALL
        .get(c as usize)
        .copied()
        .ok_or(ProtocolError::UnknownDType(c))
}

fn put_str(out: &mut Vec<u8>, s: &str, max: usize) {
    // Senders truncate rather than produce a frame the peer must reject.
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

impl Request<'_> {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Request::Open(o) => {
                out.push(tag::OPEN);
                put_str(&mut out, &o.model, MAX_NAME_LEN);
                put_str(&mut out, &o.fingerprint, MAX_NAME_LEN);
                out.extend_from_slice(&o.start.to_le_bytes());
                out.extend_from_slice(&o.end.to_le_bytes());
                out.extend_from_slice(&o.max_length.to_le_bytes());
                out.push(dtype_code(o.dtype));
                out.push(o.compression.code());
                out.extend_from_slice(&o.flow_window.to_le_bytes());
                put_optional_peer(&mut out, o.next.as_ref());
                if let Some(adapter) = &o.adapter {
                    put_str(&mut out, adapter, MAX_ADAPTER_NAME_LEN);
                }
            }
            Request::Step { header, hidden } => {
                out.push(tag::STEP);
                put_header(&mut out, header);
                encode_into(
                    hidden.dtype,
                    hidden.compression,
                    &hidden.shape,
                    hidden.data,
                    &mut out,
                );
            }
            Request::Close => out.push(tag::CLOSE),
            Request::Ack { received } => {
                out.push(tag::ACK);
                out.extend_from_slice(&received.to_le_bytes());
            }
        }
        out
    }
}

fn put_peer(out: &mut Vec<u8>, peer: &libp2p::PeerId) {
    let bytes = peer.to_bytes();
    out.push(bytes.len() as u8);
    out.extend_from_slice(&bytes);
}

fn put_optional_peer(out: &mut Vec<u8>, peer: Option<&libp2p::PeerId>) {
    match peer {
        None => out.push(0),
        Some(peer) => {
            out.push(1);
            put_peer(out, peer);
        }
    }
}

fn put_proof(out: &mut Vec<u8>, proof: &PushProof) {
    out.extend_from_slice(&proof.digest);
    // Senders keep within the limit rather than produce a frame the peer must reject.
    let signature = &proof.signature[..proof.signature.len().min(MAX_SIGNATURE_LEN)];
    out.push(signature.len() as u8);
    out.extend_from_slice(signature);
}

fn put_optional_proof(out: &mut Vec<u8>, proof: Option<&PushProof>) {
    match proof {
        None => out.push(0),
        Some(proof) => {
            out.push(1);
            put_proof(out, proof);
        }
    }
}

fn put_header(out: &mut Vec<u8>, header: &StepHeader) {
    out.extend_from_slice(&header.start_position.to_le_bytes());
    out.extend_from_slice(&header.step_id.to_le_bytes());
    // Senders keep within the limit rather than produce a frame the peer must reject.
    let push = &header.push[..header.push.len().min(MAX_PUSH_TARGETS)];
    out.push(push.len() as u8);
    for target in push {
        put_peer(out, &target.peer);
        out.extend_from_slice(&target.token.0);
    }
}

/// Encodes a plain step (no push, step id 0) without building a [`TensorView`] first.
pub fn encode_step(start_position: u32, hidden: &TensorPayload) -> Vec<u8> {
    encode_step_with(
        &StepHeader {
            start_position,
            ..StepHeader::default()
        },
        hidden,
    )
}

/// Encodes a step without building a [`TensorView`] first.
pub fn encode_step_with(header: &StepHeader, hidden: &TensorPayload) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 64 * header.push.len() + hidden.encoded_len());
    out.push(tag::STEP);
    put_header(&mut out, header);
    put_payload(&mut out, hidden);
    out
}

fn put_payload(out: &mut Vec<u8>, hidden: &TensorPayload) {
    encode_into(
        hidden.dtype,
        hidden.compression,
        &hidden.shape,
        &hidden.data,
        out,
    );
}

impl PushStep<'_> {
    /// Encodes a push of `hidden` without building a [`TensorView`] first.
    pub fn encode(
        token: SessionToken,
        header: &StepHeader,
        proof: &PushProof,
        hidden: &TensorPayload,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(200 + 64 * header.push.len() + hidden.encoded_len());
        out.push(tag::PUSH);
        out.extend_from_slice(&token.0);
        put_header(&mut out, header);
        put_proof(&mut out, proof);
        put_payload(&mut out, hidden);
        out
    }
}

impl<'a> PushStep<'a> {
    pub fn decode(buf: &'a [u8], limits: &Limits) -> Result<Self, ProtocolError> {
        let mut r = Reader { buf };
        match r.u8().map_err(|_| ProtocolError::Empty)? {
            tag::PUSH => {}
            other => return Err(ProtocolError::UnknownTag(other)),
        }
        let push = PushStep {
            token: r.token()?,
            header: r.header()?,
            proof: r.proof()?,
            hidden: r.tensor(limits)?,
        };
        r.finish()?;
        Ok(push)
    }
}

impl<'a> Request<'a> {
    pub fn decode(buf: &'a [u8], limits: &Limits) -> Result<Self, ProtocolError> {
        let mut r = Reader { buf };
        let msg = match r.u8().map_err(|_| ProtocolError::Empty)? {
            tag::OPEN => Request::Open(OpenRequest {
                model: r.string(MAX_NAME_LEN)?,
                fingerprint: r.string(MAX_NAME_LEN)?,
                start: r.u32()?,
                end: r.u32()?,
                max_length: r.u32()?,
                dtype: dtype_from_code(r.u8()?)?,
                compression: Compression::from_code(r.u8()?)?,
                flow_window: r.u32()?,
                next: r.optional_peer_id()?,
                adapter: r.trailing_string(MAX_ADAPTER_NAME_LEN)?,
            }),
            tag::STEP => Request::Step {
                header: r.header()?,
                hidden: r.tensor(limits)?,
            },
            tag::CLOSE => Request::Close,
            tag::ACK => Request::Ack { received: r.u64()? },
            other => return Err(ProtocolError::UnknownTag(other)),
        };
        r.finish()?;
        Ok(msg)
    }
}

impl Response<'_> {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Response::Opened { max_length, token } => {
                out.push(tag::OPENED);
                out.extend_from_slice(&max_length.to_le_bytes());
                out.extend_from_slice(&token.0);
            }
            Response::StepOut {
                step_id,
                pushed,
                input_proof,
                hidden,
            } => {
                out.reserve(1 + hidden.data.len() + 200);
                out.push(tag::STEP_OUT);
                out.extend_from_slice(&step_id.to_le_bytes());
                out.push(u8::from(*pushed));
                put_optional_proof(&mut out, input_proof.as_ref());
                encode_into(
                    hidden.dtype,
                    hidden.compression,
                    &hidden.shape,
                    hidden.data,
                    &mut out,
                );
            }
            Response::Error { code, message } => {
                out.push(tag::ERROR);
                out.extend_from_slice(&code.code().to_le_bytes());
                put_str(&mut out, message, MAX_MESSAGE_LEN);
            }
            Response::PushRefused {
                step_id,
                from,
                reason,
            } => {
                out.push(tag::PUSH_REFUSED);
                out.extend_from_slice(&step_id.to_le_bytes());
                put_peer(&mut out, from);
                put_str(&mut out, reason, MAX_MESSAGE_LEN);
            }
        }
        out
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Response::Error {
            code,
            message: message.into(),
        }
    }
}

impl<'a> Response<'a> {
    pub fn decode(buf: &'a [u8], limits: &Limits) -> Result<Self, ProtocolError> {
        let mut r = Reader { buf };
        let msg = match r.u8().map_err(|_| ProtocolError::Empty)? {
            tag::OPENED => Response::Opened {
                max_length: r.u32()?,
                token: r.token()?,
            },
            tag::STEP_OUT => Response::StepOut {
                step_id: r.u32()?,
                pushed: r.u8()? != 0,
                input_proof: r.optional_proof()?,
                hidden: r.tensor(limits)?,
            },
            tag::ERROR => Response::Error {
                code: ErrorCode::from_code(r.u16()?)?,
                message: r.string(MAX_MESSAGE_LEN)?,
            },
            tag::PUSH_REFUSED => Response::PushRefused {
                step_id: r.u32()?,
                from: r.peer_id()?,
                reason: r.string(MAX_MESSAGE_LEN)?,
            },
            other => return Err(ProtocolError::UnknownTag(other)),
        };
        r.finish()?;
        Ok(msg)
    }
}
