//! The inference and info protocols: protocol ids, messages and their
//! binary encoding.
//!
//! One libp2p stream carries one inference session:
//!
//! ```text
//! client: Open{model, fingerprint, span, max_length, dtype, next}  server: Opened{max_length, token}
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
//! pushed other numbers than it returned from a receiver that lies.
//!
//! Every message is one length-prefixed frame (see [`crate::framing`]):
//! a tag byte, then its fields, little-endian. Decoding checks every field
//! against [`Limits`] and borrows tensor data from the frame.

use libp2p::StreamProtocol;

use crate::limits::Limits;
use crate::push_proof::{PushProof, MAX_SIGNATURE_LEN};
pub use crate::session_token::SessionToken;
use crate::tensor::{
    encode_into, Compression, TensorCodecError, TensorPayload, TensorView, WireDType,
};

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

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if n > self.buf.len() {
            return Err(ProtocolError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, ProtocolError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, ProtocolError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, ProtocolError> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    fn string(&mut self, max: usize) -> Result<String, ProtocolError> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(ProtocolError::StringTooLong { len, max });
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ProtocolError::BadUtf8)
    }

    fn token(&mut self) -> Result<SessionToken, ProtocolError> {
        let mut token = [0u8; 16];
        token.copy_from_slice(self.take(16)?);
        Ok(SessionToken(token))
    }

    fn peer_id(&mut self) -> Result<libp2p::PeerId, ProtocolError> {
        let len = self.u8()? as usize;
        if len > MAX_PEER_ID_LEN {
            return Err(ProtocolError::BadPeerId);
        }
        libp2p::PeerId::from_bytes(self.take(len)?).map_err(|_| ProtocolError::BadPeerId)
    }

    fn optional_peer_id(&mut self) -> Result<Option<libp2p::PeerId>, ProtocolError> {
        match self.u8()? {
            0 => Ok(None),
            _ => self.peer_id().map(Some),
        }
    }

    fn proof(&mut self) -> Result<PushProof, ProtocolError> {
        let mut digest = [0u8; 32];
        digest.copy_from_slice(self.take(32)?);
        let len = self.u8()? as usize;
        if len > MAX_SIGNATURE_LEN {
            return Err(ProtocolError::SignatureTooLong(len));
        }
        Ok(PushProof {
            digest,
            signature: self.take(len)?.to_vec(),
        })
    }

    fn optional_proof(&mut self) -> Result<Option<PushProof>, ProtocolError> {
        match self.u8()? {
            0 => Ok(None),
            _ => self.proof().map(Some),
        }
    }

    fn header(&mut self) -> Result<StepHeader, ProtocolError> {
        let start_position = self.u32()?;
        let step_id = self.u32()?;
        let count = self.u8()? as usize;
        if count > MAX_PUSH_TARGETS {
            return Err(ProtocolError::PushRouteTooLong(count));
        }
        let mut push = Vec::with_capacity(count);
        for _ in 0..count {
            push.push(PushTarget {
                peer: self.peer_id()?,
                token: self.token()?,
            });
        }
        Ok(StepHeader {
            start_position,
            step_id,
            push,
        })
    }

    fn tensor(&mut self, limits: &Limits) -> Result<TensorView<'a>, ProtocolError> {
        let (view, used) = TensorView::decode_prefix(self.buf, limits)?;
        self.buf = &self.buf[used..];
        Ok(view)
    }

    fn finish(self) -> Result<(), ProtocolError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(ProtocolError::TrailingBytes(n)),
        }
    }
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
            other => return Err(ProtocolError::UnknownTag(other)),
        };
        r.finish()?;
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn open() -> OpenRequest {
        OpenRequest {
            model: "tiny-llama-a".into(),
            fingerprint: "abc".into(),
            start: 1,
            end: 3,
            max_length: 48,
            dtype: WireDType::F32,
            compression: Compression::Int8Block64,
            flow_window: 16_000,
            next: Some(libp2p::PeerId::from_public_key(
                &libp2p::identity::Keypair::ed25519_from_bytes([5; 32])
                    .unwrap()
                    .public(),
            )),
        }
    }

    fn proof() -> PushProof {
        PushProof {
            digest: [4; 32],
            signature: vec![6; 64],
        }
    }

    fn samples() -> Vec<Vec<u8>> {
        let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
        vec![
            Request::Open(open()).encode(),
            encode_step(5, &hidden),
            Request::Close.encode(),
            Request::Ack { received: 1 << 40 }.encode(),
            Response::Opened {
                max_length: 9,
                token: SessionToken([3; 16]),
            }
            .encode(),
            Response::StepOut {
                step_id: 7,
                pushed: true,
                input_proof: Some(proof()),
                hidden: hidden.view(),
            }
            .encode(),
            Response::error(ErrorCode::BadShape, "wrong shape").encode(),
        ]
    }

    #[test]
    fn messages_round_trip() {
        let limits = Limits::DEFAULT;
        let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
        let s = samples();
        assert_eq!(
            Request::decode(&s[0], &limits).unwrap(),
            Request::Open(open())
        );
        assert_eq!(
            Request::decode(&s[1], &limits).unwrap(),
            Request::Step {
                header: StepHeader {
                    start_position: 5,
                    ..StepHeader::default()
                },
                hidden: hidden.view()
            }
        );
        assert_eq!(Request::decode(&s[2], &limits).unwrap(), Request::Close);
        assert_eq!(
            Request::decode(&s[3], &limits).unwrap(),
            Request::Ack { received: 1 << 40 }
        );
        assert_eq!(
            Response::decode(&s[4], &limits).unwrap(),
            Response::Opened {
                max_length: 9,
                token: SessionToken([3; 16])
            }
        );
        assert_eq!(
            Response::decode(&s[5], &limits).unwrap(),
            Response::StepOut {
                step_id: 7,
                pushed: true,
                input_proof: Some(proof()),
                hidden: hidden.view()
            }
        );
        let without = Response::StepOut {
            step_id: 7,
            pushed: false,
            input_proof: None,
            hidden: hidden.view(),
        };
        assert_eq!(
            Response::decode(&without.encode(), &limits).unwrap(),
            without
        );
        let alone = Request::Open(OpenRequest {
            next: None,
            ..open()
        });
        assert_eq!(Request::decode(&alone.encode(), &limits).unwrap(), alone);
        assert_eq!(
            Response::decode(&s[6], &limits).unwrap(),
            Response::error(ErrorCode::BadShape, "wrong shape")
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        for (i, bytes) in samples().iter().enumerate() {
            for len in 0..bytes.len() {
                let cut = &bytes[..len];
                if i < 3 {
                    assert!(
                        Request::decode(cut, &Limits::DEFAULT).is_err(),
                        "message {i} cut at {len}"
                    );
                } else {
                    assert!(
                        Response::decode(cut, &Limits::DEFAULT).is_err(),
                        "message {i} cut at {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn overlong_strings_are_truncated_by_the_sender() {
        let mut o = open();
        o.model = "é".repeat(MAX_NAME_LEN);
        let bytes = Request::Open(o).encode();
        match Request::decode(&bytes, &Limits::DEFAULT).unwrap() {
            Request::Open(o) => assert!(o.model.len() <= MAX_NAME_LEN),
            other => panic!("{other:?}"),
        }
    }

    fn route(n: usize) -> Vec<PushTarget> {
        (0..n)
            .map(|i| PushTarget {
                peer: libp2p::PeerId::random(),
                token: SessionToken([i as u8; 16]),
            })
            .collect()
    }

    #[test]
    fn steps_and_pushes_carry_their_routes() {
        let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
        let header = StepHeader {
            start_position: 12,
            step_id: 99,
            push: route(3),
        };
        let bytes = encode_step_with(&header, &hidden);
        assert_eq!(
            Request::decode(&bytes, &Limits::DEFAULT).unwrap(),
            Request::Step {
                header: header.clone(),
                hidden: hidden.view()
            }
        );
        let token = SessionToken([9; 16]);
        let bytes = PushStep::encode(token, &header, &proof(), &hidden);
        let push = PushStep::decode(&bytes, &Limits::DEFAULT).unwrap();
        assert_eq!(push.token, token);
        assert_eq!(push.header, header);
        assert_eq!(push.proof, proof());
        assert_eq!(push.hidden, hidden.view());
        for len in 0..bytes.len() {
            assert!(PushStep::decode(&bytes[..len], &Limits::DEFAULT).is_err());
        }
        // A push is not a request on a session stream, nor the reverse.
        assert!(Request::decode(&bytes, &Limits::DEFAULT).is_err());
        assert!(PushStep::decode(&encode_step(0, &hidden), &Limits::DEFAULT).is_err());
    }

    #[test]
    fn a_push_route_over_the_limit_is_refused_before_it_is_read() {
        let hidden = TensorPayload::new(WireDType::F16, vec![1, 1, 1], vec![0; 2]).unwrap();
        let mut bytes = encode_step(0, &hidden);
        // The route count sits after the tag, start and step id.
        bytes[9] = (MAX_PUSH_TARGETS + 1) as u8;
        assert_eq!(
            Request::decode(&bytes, &Limits::DEFAULT),
            Err(ProtocolError::PushRouteTooLong(MAX_PUSH_TARGETS + 1))
        );
        // Senders cut an overlong route to the limit.
        let header = StepHeader {
            push: route(MAX_PUSH_TARGETS + 5),
            ..StepHeader::default()
        };
        match Request::decode(&encode_step_with(&header, &hidden), &Limits::DEFAULT).unwrap() {
            Request::Step { header, .. } => assert_eq!(header.push.len(), MAX_PUSH_TARGETS),
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Request::decode(&bytes, &Limits::DEFAULT);
            let _ = Response::decode(&bytes, &Limits::DEFAULT);
            let _ = PushStep::decode(&bytes, &Limits::DEFAULT);
        }
    }
}
