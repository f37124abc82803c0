//! A quantized tensor's storage allocated before its bytes arrive, so that
//! a download streams straight into the memory candle multiplies from. A
//! 70B model's LM head is 150–600 MB quantized; building it from a
//! downloaded file would hold it twice, and a page's wasm memory never
//! shrinks back from its peak.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8K, BlockQ8_0, BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use half::{bf16, f16};

use crate::error::{ModelError, Result};

/// The name a manifest gives a stored type (llama.cpp's, lower case).
pub fn ggml_dtype_name(dtype: GgmlDType) -> &'static str {
    match dtype {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2_k",
        GgmlDType::Q3K => "q3_k",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q5K => "q5_k",
        GgmlDType::Q6K => "q6_k",
        GgmlDType::Q8K => "q8_k",
    }
}

/// The stored type a manifest names.
pub fn parse_ggml_dtype(name: &str) -> Result<GgmlDType> {
    const ALL: [GgmlDType; 15] = [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q8_1,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::Q8K,
    ];
    ALL.into_iter()
        .find(|d| ggml_dtype_name(*d) == name)
        .ok_or_else(|| ModelError::InvalidConfig(format!("unknown tensor type {name:?}")))
}

macro_rules! blocks {
    ($($variant:ident($t:ty) = $dtype:path),* $(,)?) => {
        enum Blocks { $($variant(Vec<$t>)),* }

        impl Blocks {
            fn zeros(dtype: GgmlDType, blocks: usize) -> Blocks {
                match dtype { $($dtype => Blocks::$variant(vec![<$t as GgmlType>::zeros(); blocks])),* }
            }

            fn bytes_mut(&mut self) -> &mut [u8] {
                match self { $(Blocks::$variant(v) => as_bytes_mut(v)),* }
            }

            fn into_storage(self) -> QStorage {
                match self { $(Blocks::$variant(v) => QStorage::Cpu(Box::new(v))),* }
            }
        }
    };
}

blocks! {
    F32(f32) = GgmlDType::F32,
    F16(f16) = GgmlDType::F16,
    Bf16(bf16) = GgmlDType::BF16,
    Q4_0(BlockQ4_0) = GgmlDType::Q4_0,
    Q4_1(BlockQ4_1) = GgmlDType::Q4_1,
    Q5_0(BlockQ5_0) = GgmlDType::Q5_0,
    Q5_1(BlockQ5_1) = GgmlDType::Q5_1,
    Q8_0(BlockQ8_0) = GgmlDType::Q8_0,
    Q8_1(BlockQ8_1) = GgmlDType::Q8_1,
    Q2K(BlockQ2K) = GgmlDType::Q2K,
    Q3K(BlockQ3K) = GgmlDType::Q3K,
    Q4K(BlockQ4K) = GgmlDType::Q4K,
    Q5K(BlockQ5K) = GgmlDType::Q5K,
    Q6K(BlockQ6K) = GgmlDType::Q6K,
    Q8K(BlockQ8K) = GgmlDType::Q8K,
}

/// The bytes of a slice of blocks.
fn as_bytes_mut<T: GgmlType>(blocks: &mut [T]) -> &mut [u8] {
    let len = std::mem::size_of_val(blocks);
    // SAFETY: every GGML block type (and f32, f16, bf16) is `repr(C)` over
    // floats and byte arrays with no padding (candle asserts their sizes),
    // so any byte pattern is a valid value; the slice covers exactly the
    // blocks' memory and borrows it mutably for as long as the result lives.
    unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr().cast::<u8>(), len) }
}

/// Storage for a `[rows, columns]` tensor of a stored type, zeroed, to be
/// filled through [`Self::bytes_mut`] and turned into a [`QTensor`].
pub struct QuantizedBuffer {
    shape: Vec<usize>,
    blocks: Blocks,
}

impl QuantizedBuffer {
    /// Allocates the tensor; refuses shapes whose rows are not whole blocks
    /// and tensors over `max_bytes` (a size from outside is only a claim).
    pub fn new(dtype: GgmlDType, shape: &[usize], max_bytes: u64) -> Result<Self> {
        let row = shape.last().copied().unwrap_or(0);
        let block = dtype.block_size();
        let elems = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let bytes = elems.map(|e| (e / block) as u64 * dtype.type_size() as u64);
        match bytes {
            Some(b) if row > 0 && row.is_multiple_of(block) && b <= max_bytes => Ok(QuantizedBuffer {
                shape: shape.to_vec(),
                blocks: Blocks::zeros(dtype, (elems.unwrap_or(0)) / block),
            }),
            _ => Err(ModelError::InvalidConfig(format!(
                "a {dtype:?} tensor of shape {shape:?} is not whole blocks or exceeds {max_bytes} bytes"
            ))),
        }
    }

    /// The tensor's bytes, as GGUF stores them.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.blocks.bytes_mut()
    }

    pub fn into_qtensor(self) -> Result<QTensor> {
        Ok(QTensor::new(self.blocks.into_storage(), self.shape)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::ggml_file::qtensor_from_ggml;
    use candle_core::{Device, Tensor};

    #[test]
    fn filled_buffers_equal_tensors_read_from_bytes() {
        let device = Device::Cpu;
        let values: Vec<f32> = (0..4 * 256)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let dense = Tensor::from_vec(values, (4, 256), &device).unwrap();
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q8_0,
            GgmlDType::F16,
            GgmlDType::Q6K,
        ] {
            let q = QTensor::quantize(&dense, dtype).unwrap();
            let stored = q.data().unwrap().to_vec();
            let mut buffer = QuantizedBuffer::new(dtype, &[4, 256], 1 << 20).unwrap();
            buffer.bytes_mut().copy_from_slice(&stored);
            let filled = buffer.into_qtensor().unwrap().dequantize(&device).unwrap();
            let read = qtensor_from_ggml(dtype, &stored, vec![4, 256], &device)
                .unwrap()
                .dequantize(&device)
                .unwrap();
            let diff = (filled - read).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
            assert_eq!(parse_ggml_dtype(ggml_dtype_name(dtype)).unwrap(), dtype);
        }
        assert!(QuantizedBuffer::new(GgmlDType::Q4K, &[4, 100], 1 << 20).is_err());
        assert!(QuantizedBuffer::new(GgmlDType::Q4K, &[1 << 20, 256], 1 << 20).is_err());
        assert!(QuantizedBuffer::new(GgmlDType::F32, &[usize::MAX, 2], u64::MAX).is_err());
    }
}
