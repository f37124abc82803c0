//! A matrix's blocks, typed by their GGUF format.

use candle_core::quantized::k_quants::{
    BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ6K, BlockQ8_0, GgmlType,
};
use candle_core::quantized::GgmlDType;

use super::parallel::Kernels;
use super::{dot, parallel};
use crate::error::{ModelError, Result};

/// The formats these kernels multiply from; the rest stay with candle's.
#[derive(Debug, Clone)]
pub(crate) enum QuantBlocks {
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
}

/// The blocks stored in `bytes`, copied into their type's alignment.
fn typed<T: GgmlType>(bytes: &[u8]) -> Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(ModelError::InvalidConfig(format!(
            "{} bytes are not a whole number of {:?} blocks of {size}",
            bytes.len(),
            T::DTYPE
        )));
    }
    let mut blocks = vec![T::zeros(); bytes.len() / size];
    // SAFETY: the block types are `repr(C)` structs of integers and f16s, for
    // which every bit pattern is a value, and `blocks` holds exactly
    // `bytes.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            blocks.as_mut_ptr().cast::<u8>(),
            bytes.len(),
        );
    }
    Ok(blocks)
}

impl QuantBlocks {
    pub fn from_bytes(format: GgmlDType, bytes: &[u8]) -> Result<Option<Self>> {
        Ok(Some(match format {
            GgmlDType::Q4_0 => Self::Q4_0(typed(bytes)?),
            GgmlDType::Q4_1 => Self::Q4_1(typed(bytes)?),
            GgmlDType::Q8_0 => Self::Q8_0(typed(bytes)?),
            GgmlDType::Q4K => Self::Q4K(typed(bytes)?),
            GgmlDType::Q5K => Self::Q5K(typed(bytes)?),
            GgmlDType::Q6K => Self::Q6K(typed(bytes)?),
            _ => return Ok(None),
        }))
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Q4_0(b) => b.len(),
            Self::Q4_1(b) => b.len(),
            Self::Q8_0(b) => b.len(),
            Self::Q4K(b) => b.len(),
            Self::Q5K(b) => b.len(),
            Self::Q6K(b) => b.len(),
        }
    }

    /// All parts' blocks in order, when they share one format.
    pub fn concat<'a>(mut parts: impl Iterator<Item = &'a QuantBlocks>) -> Option<Self> {
        fn join<T: Clone>(first: &[T], rest: Vec<&[T]>) -> Vec<T> {
            let mut all = first.to_vec();
            for part in rest {
                all.extend_from_slice(part);
            }
            all
        }
        let first = parts.next()?;
        let rest: Vec<&QuantBlocks> = parts.collect();
        macro_rules! same {
            ($variant:ident, $blocks:expr) => {{
                let rest = rest
                    .iter()
                    .map(|p| match p {
                        Self::$variant(b) => Some(b.as_slice()),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?;
                Some(Self::$variant(join($blocks, rest)))
            }};
        }
        match first {
            Self::Q4_0(b) => same!(Q4_0, b),
            Self::Q4_1(b) => same!(Q4_1, b),
            Self::Q8_0(b) => same!(Q8_0, b),
            Self::Q4K(b) => same!(Q4K, b),
            Self::Q5K(b) => same!(Q5K, b),
            Self::Q6K(b) => same!(Q6K, b),
        }
    }

    pub fn matmul(&self, rows: usize, cols: usize, input: &[f32], batch: usize, out: &mut [f32]) {
        let shape = parallel::Shape { rows, cols, batch };
        match self {
            Self::Q4_0(w) => parallel::matmul(w, shape, input, out, Kernels::candle()),
            Self::Q4_1(w) => parallel::matmul(w, shape, input, out, dot::q4_1_q8_1()),
            Self::Q8_0(w) => parallel::matmul(w, shape, input, out, Kernels::candle()),
            Self::Q4K(w) => parallel::matmul(w, shape, input, out, Kernels::candle()),
            Self::Q5K(w) => parallel::matmul(w, shape, input, out, Kernels::candle()),
            Self::Q6K(w) => parallel::matmul(w, shape, input, out, Kernels::candle()),
        }
    }
}
