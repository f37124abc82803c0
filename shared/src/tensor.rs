//! The tensor payload codec: dtype, shape and raw little-endian bytes.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! magic "CTNS" | version u8 | dtype u8 | compression u8 | rank u8
//! | dims: rank × u64 | data_len u64 | data | crc32 u32
//! ```
//!
//! The CRC covers every byte before it, so a corrupted or truncated buffer
//! is always an error. Every field is checked against [`Limits`] before the
//! decoder trusts it; [`TensorView::decode`] borrows the data from the
//! received buffer instead of copying it.

use crate::limits::Limits;

mod compression;
#[cfg(test)]
mod tests;

const MAGIC: &[u8; 4] = b"CTNS";
const VERSION: u8 = 1;
const FIXED_HEADER: usize = MAGIC.len() + 4;
const CRC_LEN: usize = 4;

/// Element type of a tensor on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WireDType {
    F32,
    F16,
    BF16,
}

impl WireDType {
    pub const ALL: [WireDType; 3] = [WireDType::F32, WireDType::F16, WireDType::BF16];

    pub fn size_in_bytes(self) -> usize {
        match self {
            WireDType::F32 => 4,
            WireDType::F16 | WireDType::BF16 => 2,
        }
    }

    pub fn code(self) -> u8 {
        match self {
            WireDType::F32 => 0,
            WireDType::F16 => 1,
            WireDType::BF16 => 2,
        }
    }

    fn from_code(code: u8) -> Result<Self, TensorCodecError> {
        match code {
            0 => Ok(WireDType::F32),
            1 => Ok(WireDType::F16),
            2 => Ok(WireDType::BF16),
            other => Err(TensorCodecError::UnknownDType(other)),
        }
    }
}

/// How the data bytes are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    /// The values in their dtype.
    #[default]
    None,
    /// Blocks of [`Compression::BLOCK`] values (the last one may be
    /// shorter), each an f16 scale (the block's largest magnitude / 127)
    /// then one signed byte per value: about 1.03 bytes a value, whatever
    /// the dtype the values decompress into.
    Int8Block64,
}

impl Compression {
    pub const ALL: [Compression; 2] = [Compression::None, Compression::Int8Block64];
    /// Values per scale in [`Compression::Int8Block64`].
    pub const BLOCK: usize = 64;

    pub fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Int8Block64 => 1,
        }
    }

    pub fn from_code(code: u8) -> Result<Self, TensorCodecError> {
        match code {
            0 => Ok(Compression::None),
            1 => Ok(Compression::Int8Block64),
            other => Err(TensorCodecError::UnknownCompression(other)),
        }
    }

    /// Data bytes of `values` values of `dtype` in this compression.
    pub fn data_len(self, dtype: WireDType, values: u64) -> u64 {
        match self {
            Compression::None => values.saturating_mul(dtype.size_in_bytes() as u64),
            Compression::Int8Block64 => values
                .div_ceil(Self::BLOCK as u64)
                .saturating_mul(2)
                .saturating_add(values),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TensorCodecError {
    #[error("tensor payload truncated: need {needed} bytes, have {available}")]
    Truncated { needed: usize, available: usize },
    #[error("not a tensor payload (bad magic)")]
    BadMagic,
    #[error("unsupported tensor payload version {0}")]
    UnsupportedVersion(u8),
    #[error("unknown dtype code {0}")]
    UnknownDType(u8),
    #[error("unknown compression code {0}")]
    UnknownCompression(u8),
    #[error("tensor rank {rank} exceeds the limit of {max}")]
    RankTooLarge { rank: usize, max: usize },
    #[error("tensor dimension {dim} exceeds the limit of {max}")]
    DimTooLarge { dim: u64, max: u64 },
    #[error("tensor of {bytes} bytes exceeds the limit of {max}")]
    TooLarge { bytes: u64, max: u64 },
    #[error("data length {actual} does not match shape and dtype ({expected} bytes)")]
    LengthMismatch { expected: u64, actual: u64 },
    #[error("{0} trailing bytes after the tensor payload")]
    TrailingBytes(usize),
    #[error("checksum mismatch: payload corrupted")]
    Checksum,
}

/// A decoded tensor whose data borrows the received buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView<'a> {
    pub dtype: WireDType,
    pub compression: Compression,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

/// An owned tensor ready to encode. Its `data` is compressed as
/// `compression` says; [`TensorPayload::new`] makes uncompressed ones, and
/// everything that reads values ([`TensorPayload::to_f32`], the checks,
/// `truncate_axis1`) sees through a compression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPayload {
    pub dtype: WireDType,
    pub compression: Compression,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl TensorPayload {
    /// Checks that `data` holds exactly `shape` elements of `dtype`.
    pub fn new(
        dtype: WireDType,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<Self, TensorCodecError> {
        let expected = shape
            .iter()
            .try_fold(dtype.size_in_bytes() as u64, |acc, &d| {
                acc.checked_mul(d as u64)
            })
            .ok_or(TensorCodecError::TooLarge {
                bytes: u64::MAX,
                max: u64::MAX,
            })?;
        if expected != data.len() as u64 {
            return Err(TensorCodecError::LengthMismatch {
                expected,
                actual: data.len() as u64,
            });
        }
        Ok(Self {
            dtype,
            compression: Compression::None,
            shape,
            data,
        })
    }

    pub fn encoded_len(&self) -> usize {
        encoded_len(self.shape.len(), self.data.len())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        encode_into(
            self.dtype,
            self.compression,
            &self.shape,
            &self.data,
            &mut out,
        );
        out
    }

    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            dtype: self.dtype,
            compression: self.compression,
            shape: self.shape.clone(),
            data: &self.data,
        }
    }

    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The index of the first NaN or infinite value, if any.
    pub fn first_non_finite(&self) -> Option<usize> {
        if self.compression != Compression::None {
            // Scales are f16; quantized values are always finite.
            return self
                .data
                .chunks(2 + Compression::BLOCK)
                .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00)
                .map(|block| block * Compression::BLOCK);
        }
        match self.dtype {
            WireDType::F32 => self
                .data
                .chunks_exact(4)
                .position(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()),
            // Half formats: all exponent bits set means infinity or NaN.
            WireDType::F16 => self
                .data
                .chunks_exact(2)
                .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
            WireDType::BF16 => self
                .data
                .chunks_exact(2)
                .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
        }
    }

    /// The largest difference between two payloads of one dtype and shape,
    /// relative to the root mean square of `self`; `None` when they cannot
    /// be compared.
    pub fn max_difference_relative_to_rms(&self, other: &TensorPayload) -> Option<f64> {
        if self.dtype != other.dtype || self.shape != other.shape {
            return None;
        }
        let (a, b) = (self.to_f32(), other.to_f32());
        let mean_square =
            a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / a.len().max(1) as f64;
        let diff = a
            .iter()
            .zip(&b)
            .fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs())));
        Some(diff / mean_square.sqrt().max(1e-6))
    }

    /// The values as f32 (halves widened exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        if self.compression == Compression::Int8Block64 {
            let mut values = Vec::with_capacity(self.elem_count());
            for block in self.data.chunks(2 + Compression::BLOCK) {
                if block.len() < 2 {
                    break;
                }
                let scale = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
                values.extend(block[2..].iter().map(|q| f32::from(*q as i8) * scale));
            }
            return values;
        }
        match self.dtype {
            WireDType::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            WireDType::F16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            WireDType::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }

    /// Keeps the first `len` entries along axis 1 (positions, for hidden
    /// states `[1, T, H]`); a no-op when there are no more than that.
    pub fn truncate_axis1(&mut self, len: usize) {
        let Some(&t) = self.shape.get(1) else {
            return;
        };
        if len >= t {
            return;
        }
        if self.compression != Compression::None {
            // Blocks may straddle rows: cut the values, then compress again.
            let compression = self.compression;
            let mut plain = self.decompressed();
            plain.truncate_axis1(len);
            *self = plain.compressed(compression);
            return;
        }
        let row: usize = self.shape[2..].iter().product::<usize>() * self.dtype.size_in_bytes();
        let outer = self.shape[0];
        if outer == 1 {
            self.data.truncate(len * row);
        } else {
            let data = self
                .data
                .chunks(t * row)
                .flat_map(|chunk| &chunk[..len * row])
                .copied()
                .collect();
            self.data = data;
        }
        self.shape[1] = len;
    }
}

fn encoded_len(rank: usize, data_len: usize) -> usize {
    FIXED_HEADER + 8 * rank + 8 + data_len + CRC_LEN
}

/// Appends the encoding of a tensor to `out`.
///
/// Callers guarantee `data.len() == compression.data_len(dtype, product(shape))`;
/// the decoder rejects anything else.
pub fn encode_into(
    dtype: WireDType,
    compression: Compression,
    shape: &[usize],
    data: &[u8],
    out: &mut Vec<u8>,
) {
    let start = out.len();
    out.reserve(encoded_len(shape.len(), data.len()));
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(dtype.code());
    out.push(compression.code());
    out.push(shape.len() as u8);
    for &d in shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TensorCodecError> {
        let available = self.buf.len() - self.pos;
        if n > available {
            return Err(TensorCodecError::Truncated {
                needed: self.pos.saturating_add(n),
                available: self.buf.len(),
            });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, TensorCodecError> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, TensorCodecError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
}

impl<'a> TensorView<'a> {
    /// Decodes one tensor that fills `buf` exactly.
    pub fn decode(buf: &'a [u8], limits: &Limits) -> Result<Self, TensorCodecError> {
        let (view, used) = Self::decode_prefix(buf, limits)?;
        if used != buf.len() {
            return Err(TensorCodecError::TrailingBytes(buf.len() - used));
        }
        Ok(view)
    }

    /// Decodes one tensor at the start of `buf`; returns it and the number
    /// of bytes it occupied.
    pub fn decode_prefix(
        buf: &'a [u8],
        limits: &Limits,
    ) -> Result<(Self, usize), TensorCodecError> {
        let mut r = Reader { buf, pos: 0 };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(TensorCodecError::BadMagic);
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(TensorCodecError::UnsupportedVersion(version));
        }
        let dtype = WireDType::from_code(r.u8()?)?;
        let compression = Compression::from_code(r.u8()?)?;
        let rank = r.u8()? as usize;
        if rank > limits.max_rank {
            return Err(TensorCodecError::RankTooLarge {
                rank,
                max: limits.max_rank,
            });
        }
        let mut shape = Vec::with_capacity(rank);
        let mut expected = dtype.size_in_bytes() as u64;
        for _ in 0..rank {
            let dim = r.u64()?;
            if dim > limits.max_dim {
                return Err(TensorCodecError::DimTooLarge {
                    dim,
                    max: limits.max_dim,
                });
            }
            expected = expected.saturating_mul(dim);
            if expected > limits.max_tensor_bytes {
                return Err(TensorCodecError::TooLarge {
                    bytes: expected,
                    max: limits.max_tensor_bytes,
                });
            }
            // Bounded by max_dim, which fits usize on every supported target.
            shape.push(dim as usize);
        }
        let data_len = r.u64()?;
        // Checked against the bytes of the uncompressed values above; a
        // compressed encoding is never longer.
        let values = expected / dtype.size_in_bytes() as u64;
        let expected = compression.data_len(dtype, values);
        if data_len != expected {
            return Err(TensorCodecError::LengthMismatch {
                expected,
                actual: data_len,
            });
        }
        // Bounded by max_tensor_bytes above.
        let data = r.take(data_len as usize)?;
        let covered = r.pos;
        let crc_bytes = r.take(CRC_LEN)?;
        let crc = u32::from_le_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
        if crc32fast::hash(&buf[..covered]) != crc {
            return Err(TensorCodecError::Checksum);
        }
        Ok((
            TensorView {
                dtype,
                compression,
                shape,
                data,
            },
            r.pos,
        ))
    }

    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn to_owned(&self) -> TensorPayload {
        TensorPayload {
            dtype: self.dtype,
            compression: self.compression,
            shape: self.shape.clone(),
            data: self.data.to_vec(),
        }
    }
}
