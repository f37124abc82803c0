//! The inference and info protocols: protocol ids, messages and their
//! binary encoding.
//!
//! One libp2p stream carries one inference session:
//!
//! ```text
//! client: Open{model, fingerprint, span, max_length, dtype}   server: Opened{max_length}
//! client: Step{start_position, hidden[1, T, H]}               server: StepOut{hidden} | Error
//! ...
//! client: Close
//! ```
//!
//! Every message is one length-prefixed frame (see [`crate::framing`]):
//! a tag byte, then its fields, little-endian. Decoding checks every field
//! against [`Limits`] and borrows tensor data from the frame.

use libp2p::StreamProtocol;

use crate::limits::Limits;
use crate::tensor::{encode_into, TensorCodecError, TensorPayload, TensorView, WireDType};

pub const INFERENCE_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/inference/2");
pub const INFO_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/info/1");
pub const KADEMLIA_PROTOCOL: StreamProtocol = StreamProtocol::new("/corolla/kad/1");
pub const IDENTIFY_PROTOCOL_VERSION: &str = "/corolla/1";

/// Longest model name or fingerprint accepted.
pub const MAX_NAME_LEN: usize = 256;
/// Longest error message accepted.
pub const MAX_MESSAGE_LEN: usize = 4096;

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
    /// Nonzero: the most unacknowledged bytes the server may have in flight
    /// toward the client, which acknowledges with [`Request::Ack`]; and every
    /// write of both ends is a flushed piece of at most 8000 bytes (see
    /// [`crate::flow`]). Browsers over WebRTC need it; zero means neither.
    pub flow_window: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Request<'a> {
    Open(OpenRequest),
    Step {
        start_position: u32,
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
    Opened { max_length: u32 },
    StepOut { hidden: TensorView<'a> },
    Error { code: ErrorCode, message: String },
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
    #[error("tensor: {0}")]
    Tensor(#[from] TensorCodecError),
}

mod tag {
    pub const OPEN: u8 = 1;
    pub const STEP: u8 = 2;
    pub const CLOSE: u8 = 3;
    pub const ACK: u8 = 4;
    pub const OPENED: u8 = 101;
    pub const STEP_OUT: u8 = 102;
    pub const ERROR: u8 = 103;
}

fn dtype_code(d: WireDType) -> u8 {
    match d {
        WireDType::F32 => 0,
        WireDType::F16 => 1,
        WireDType::BF16 => 2,
    }
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
                out.extend_from_slice(&o.flow_window.to_le_bytes());
            }
            Request::Step {
                start_position,
                hidden,
            } => {
                out.push(tag::STEP);
                out.extend_from_slice(&start_position.to_le_bytes());
                encode_into(hidden.dtype, &hidden.shape, hidden.data, &mut out);
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

/// Encodes a step without building a [`TensorView`] first.
pub fn encode_step(start_position: u32, hidden: &TensorPayload) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + hidden.encoded_len());
    out.push(tag::STEP);
    out.extend_from_slice(&start_position.to_le_bytes());
    encode_into(hidden.dtype, &hidden.shape, &hidden.data, &mut out);
    out
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
                flow_window: r.u32()?,
            }),
            tag::STEP => Request::Step {
                start_position: r.u32()?,
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
            Response::Opened { max_length } => {
                out.push(tag::OPENED);
                out.extend_from_slice(&max_length.to_le_bytes());
            }
            Response::StepOut { hidden } => {
                out.reserve(1 + hidden.data.len() + 64);
                out.push(tag::STEP_OUT);
                encode_into(hidden.dtype, &hidden.shape, hidden.data, &mut out);
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
            },
            tag::STEP_OUT => Response::StepOut {
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
            flow_window: 16_000,
        }
    }

    fn samples() -> Vec<Vec<u8>> {
        let hidden = TensorPayload::new(WireDType::F16, vec![1, 2, 2], vec![7; 8]).unwrap();
        vec![
            Request::Open(open()).encode(),
            encode_step(5, &hidden),
            Request::Close.encode(),
            Request::Ack { received: 1 << 40 }.encode(),
            Response::Opened { max_length: 9 }.encode(),
            Response::StepOut {
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
                start_position: 5,
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
            Response::Opened { max_length: 9 }
        );
        assert_eq!(
            Response::decode(&s[5], &limits).unwrap(),
            Response::StepOut {
                hidden: hidden.view()
            }
        );
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

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = Request::decode(&bytes, &Limits::DEFAULT);
            let _ = Response::decode(&bytes, &Limits::DEFAULT);
        }
    }
}
