//! 8-bit blocks of 64 values with an f16 scale, the wire's lossy compression.

use super::{Compression, TensorPayload, WireDType};

impl TensorPayload {
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
}
