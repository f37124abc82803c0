//! Reading a frame's fields, each checked against its bound before anything is allocated.

use super::{
    ProtocolError, PushTarget, SessionToken, StepHeader, MAX_PEER_ID_LEN, MAX_PUSH_TARGETS,
};
use crate::limits::Limits;
use crate::push_proof::{PushProof, MAX_SIGNATURE_LEN};
use crate::tensor::TensorView;

pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if n > self.buf.len() {
            return Err(ProtocolError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub(super) fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16, ProtocolError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub(super) fn u32(&mut self) -> Result<u32, ProtocolError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(super) fn u64(&mut self) -> Result<u64, ProtocolError> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    pub(super) fn string(&mut self, max: usize) -> Result<String, ProtocolError> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(ProtocolError::StringTooLong { len, max });
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ProtocolError::BadUtf8)
    }

    /// A string if any bytes are left, else `None`: a field added at the
    /// end of a message that older senders do not write.
    pub(super) fn trailing_string(&mut self, max: usize) -> Result<Option<String>, ProtocolError> {
        match self.buf.is_empty() {
            true => Ok(None),
            false => self.string(max).map(Some),
        }
    }

    pub(super) fn token(&mut self) -> Result<SessionToken, ProtocolError> {
        let mut token = [0u8; 16];
        token.copy_from_slice(self.take(16)?);
        Ok(SessionToken(token))
    }

    pub(super) fn peer_id(&mut self) -> Result<libp2p::PeerId, ProtocolError> {
        let len = self.u8()? as usize;
        if len > MAX_PEER_ID_LEN {
            return Err(ProtocolError::BadPeerId);
        }
        libp2p::PeerId::from_bytes(self.take(len)?).map_err(|_| ProtocolError::BadPeerId)
    }

    pub(super) fn optional_peer_id(&mut self) -> Result<Option<libp2p::PeerId>, ProtocolError> {
        match self.u8()? {
            0 => Ok(None),
            _ => self.peer_id().map(Some),
        }
    }

    pub(super) fn proof(&mut self) -> Result<PushProof, ProtocolError> {
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

    pub(super) fn optional_proof(&mut self) -> Result<Option<PushProof>, ProtocolError> {
        match self.u8()? {
            0 => Ok(None),
            _ => self.proof().map(Some),
        }
    }

    pub(super) fn header(&mut self) -> Result<StepHeader, ProtocolError> {
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

    pub(super) fn tensor(&mut self, limits: &Limits) -> Result<TensorView<'a>, ProtocolError> {
        let (view, used) = TensorView::decode_prefix(self.buf, limits)?;
        self.buf = &self.buf[used..];
        Ok(view)
    }

    pub(super) fn finish(self) -> Result<(), ProtocolError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(ProtocolError::TrailingBytes(n)),
        }
    }
}
