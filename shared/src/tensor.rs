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

    /// This tensor in `compression` (a copy; decompressed first if it was
    /// in another one).
    pub fn compressed(&self, compression: Compression) -> TensorPayload {
        if compression == self.compression {
            return self.clone();
        }
        let plain = self.decompressed();
        match compression {
            Compression::None => plain,
            Compression::Int8Block64 => {
                let values = plain.to_f32();
                let mut data = Vec::with_capacity(
                    compression.data_len(self.dtype, values.len() as u64) as usize,
                );
                for block in values.chunks(Compression::BLOCK) {
                    let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = half::f16::from_f32(absmax / 127.0);
                    data.extend_from_slice(&scale.to_le_bytes());
                    let scale = scale.to_f32();
                    data.extend(block.iter().map(|v| {
                        if scale > 0.0 {
                            (v / scale).round().clamp(-127.0, 127.0) as i8 as u8
                        } else {
                            0
                        }
                    }));
                }
                TensorPayload {
                    dtype: self.dtype,
                    compression,
                    shape: self.shape.clone(),
                    data,
                }
            }
        }
    }

    /// This tensor uncompressed, in its dtype.
    pub fn decompressed(&self) -> TensorPayload {
        match self.compression {
            Compression::None => self.clone(),
            Compression::Int8Block64 => {
                let values = self.to_f32();
                let data = match self.dtype {
                    WireDType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    WireDType::F16 => values
                        .iter()
                        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                        .collect(),
                    WireDType::BF16 => values
                        .iter()
                        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                        .collect(),
                };
                TensorPayload {
                    dtype: self.dtype,
                    compression: Compression::None,
                    shape: self.shape.clone(),
                    data,
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn non_finite_values_are_found_in_every_dtype() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let p = TensorPayload::new(WireDType::F32, vec![3], f32s(&[1.0, -2.0, 0.5])).unwrap();
        assert_eq!(p.first_non_finite(), None);
        let p = TensorPayload::new(WireDType::F32, vec![3], f32s(&[1.0, f32::NAN, 0.5])).unwrap();
        assert_eq!(p.first_non_finite(), Some(1));
        let halves = |v: &[half::f16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let p = TensorPayload::new(
            WireDType::F16,
            vec![2],
            halves(&[half::f16::ONE, half::f16::INFINITY]),
        )
        .unwrap();
        assert_eq!(p.first_non_finite(), Some(1));
        let p = TensorPayload::new(
            WireDType::BF16,
            vec![2],
            half::bf16::NAN
                .to_le_bytes()
                .into_iter()
                .chain(half::bf16::ONE.to_le_bytes())
                .collect(),
        )
        .unwrap();
        assert_eq!(p.first_non_finite(), Some(0));
        let a = TensorPayload::new(WireDType::F32, vec![2], f32s(&[4.0, 1.0])).unwrap();
        let b = TensorPayload::new(WireDType::F32, vec![2], f32s(&[4.0, 1.2])).unwrap();
        // RMS of a: sqrt(17 / 2).
        let d = a.max_difference_relative_to_rms(&b).unwrap();
        assert!((d - 0.2 / 8.5f64.sqrt()).abs() < 1e-6, "{d}");
        assert_eq!(a.max_difference_relative_to_rms(&p), None);
    }

    fn payload_strategy() -> impl Strategy<Value = TensorPayload> {
        (
            prop::sample::select(WireDType::ALL.to_vec()),
            prop::collection::vec(0usize..6, 0..4),
        )
            .prop_flat_map(|(dtype, shape)| {
                let len = shape.iter().product::<usize>() * dtype.size_in_bytes();
                (
                    Just(dtype),
                    Just(shape),
                    prop::collection::vec(any::<u8>(), len),
                )
            })
            .prop_map(|(dtype, shape, data)| {
                TensorPayload::new(dtype, shape, data).expect("strategy builds consistent payloads")
            })
    }

    fn f32_payload(shape: Vec<usize>, values: &[f32]) -> TensorPayload {
        let data = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        TensorPayload::new(WireDType::F32, shape, data).unwrap()
    }

    #[test]
    fn int8_blocks_round_trip_within_half_a_step_of_each_block() {
        // Two blocks and a short third, with very different magnitudes.
        let values: Vec<f32> = (0..150)
            .map(|i| {
                let magnitude = if i < 64 { 100.0 } else { 0.01 };
                magnitude * ((i as f32) * 0.37).sin()
            })
            .collect();
        let p = f32_payload(vec![1, 3, 50], &values);
        let c = p.compressed(Compression::Int8Block64);
        assert_eq!(c.data.len(), 3 * 2 + 150);
        let bytes = c.encode();
        let view = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap();
        assert_eq!(view.compression, Compression::Int8Block64);
        let back = view.to_owned().decompressed();
        assert_eq!(
            (back.dtype, back.shape.clone()),
            (WireDType::F32, p.shape.clone())
        );
        for (block, (a, b)) in values.chunks(64).zip(back.to_f32().chunks(64)).enumerate() {
            let absmax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= absmax / 127.0 * 0.51 + 1e-6,
                    "block {block}: {x} vs {y}"
                );
            }
        }
        // Truncating sees through the compression.
        let mut cut = c.clone();
        cut.truncate_axis1(1);
        assert_eq!(cut.shape, vec![1, 1, 50]);
        assert_eq!(cut.decompressed().to_f32().len(), 50);
        assert_eq!(c.first_non_finite(), None);
        // A zero block stays zero.
        let zeros = f32_payload(vec![70], &[0.0; 70]).compressed(Compression::Int8Block64);
        assert!(zeros.decompressed().to_f32().iter().all(|v| *v == 0.0));
    }

    #[test]
    fn a_compressed_length_is_checked_before_reading() {
        let p = f32_payload(vec![100], &[1.0; 100]).compressed(Compression::Int8Block64);
        let mut bytes = p.encode();
        // The data length field sits after the header and one dimension.
        let at = FIXED_HEADER + 8;
        bytes[at..at + 8].copy_from_slice(&400u64.to_le_bytes());
        let err = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap_err();
        assert!(
            matches!(err, TensorCodecError::LengthMismatch { expected: 104, .. }),
            "{err}"
        );
    }

    #[test]
    fn truncating_positions_keeps_each_batch_rows_prefix() {
        // [2, 3, 2] of f16 (2 bytes each): rows of 4 bytes.
        let data: Vec<u8> = (0..24).collect();
        let mut p = TensorPayload::new(WireDType::F16, vec![2, 3, 2], data).unwrap();
        p.truncate_axis1(2);
        assert_eq!(p.shape, vec![2, 2, 2]);
        let expected: Vec<u8> = (0..8).chain(12..20).collect();
        assert_eq!(p.data, expected);
        let mut single = TensorPayload::new(WireDType::F32, vec![1, 3, 1], vec![7; 12]).unwrap();
        single.truncate_axis1(5);
        assert_eq!(single.shape, vec![1, 3, 1]);
        single.truncate_axis1(1);
        assert_eq!(
            (single.shape.clone(), single.data.len()),
            (vec![1, 1, 1], 4)
        );
    }

    proptest! {
        #[test]
        fn round_trips(p in payload_strategy()) {
            let bytes = p.encode();
            prop_assert_eq!(bytes.len(), p.encoded_len());
            let view = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap();
            prop_assert_eq!(view.to_owned(), p);
        }

        #[test]
        fn every_truncation_is_an_error(p in payload_strategy(), cut in any::<prop::sample::Index>()) {
            let bytes = p.encode();
            let len = cut.index(bytes.len());
            prop_assert!(TensorView::decode(&bytes[..len], &Limits::DEFAULT).is_err());
        }

        #[test]
        fn every_corrupted_byte_is_an_error(
            p in payload_strategy(),
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let mut bytes = p.encode();
            let i = at.index(bytes.len());
            bytes[i] ^= flip;
            prop_assert!(TensorView::decode(&bytes, &Limits::DEFAULT).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = TensorView::decode(&bytes, &Limits::DEFAULT);
        }
    }

    #[test]
    fn rejects_oversized_claims_before_allocating() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&[VERSION, 0, 0, 2]);
        bytes.extend_from_slice(&(1u64 << 20).to_le_bytes());
        bytes.extend_from_slice(&(1u64 << 20).to_le_bytes());
        let err = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap_err();
        assert!(matches!(err, TensorCodecError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn rejects_trailing_bytes() {
        let p = TensorPayload::new(WireDType::F16, vec![2], vec![1, 2, 3, 4]).unwrap();
        let mut bytes = p.encode();
        bytes.push(0);
        assert_eq!(
            TensorView::decode(&bytes, &Limits::DEFAULT),
            Err(TensorCodecError::TrailingBytes(1))
        );
    }

    #[test]
    fn new_checks_length() {
        assert!(TensorPayload::new(WireDType::F32, vec![3], vec![0; 8]).is_err());
    }
}
