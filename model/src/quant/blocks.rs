//! A matrix's blocks, seen in place in candle's storage (a copy would hold
//! a 70B LM head twice while it loads, and a page's wasm memory never
//! shrinks back from its peak), typed by their GGUF format.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::k_quants::{
    BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ6K, BlockQ8_0, GgmlType,
};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;

use super::dot;
use super::interleaved::{InterleavedQ4, Nibbles};
use super::parallel::{self, Kernels};
use super::q4_k::{self, InterleavedQ4K};
use super::q8_0::{self, InterleavedQ8};
use super::{q5_k, q6_k};
use crate::error::{ModelError, Result};

/// The blocks of a quantized tensor in a format these kernels cover.
#[derive(Debug, Clone)]
pub(crate) struct QuantBlocks {
    tensor: Arc<QTensor>,
}

/// `bytes` as blocks of `T`, when they are whole blocks aligned for `T`.
fn view<T: GgmlType>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    let aligned = (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>());
    if !aligned || !bytes.len().is_multiple_of(size) {
        return None;
    }
    // SAFETY: the block types are `repr(C)` structs of integers and f16s, for
    // which every bit pattern is a value; the pointer is aligned for `T` and
    // the length is a whole number of blocks inside `bytes`.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

fn covered(format: GgmlDType) -> bool {
    matches!(
        format,
        GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q8_0
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
    )
}

impl QuantBlocks {
    /// The blocks of `tensor`, or `None` for a format these kernels do not
    /// cover or storage they cannot see in place (not on the CPU).
    pub fn new(tensor: Arc<QTensor>) -> Result<Option<Self>> {
        if !covered(tensor.dtype()) || !tensor.device().is_cpu() {
            return Ok(None);
        }
        let blocks = QuantBlocks { tensor };
        let in_place = matches!(blocks.tensor.data()?, Cow::Borrowed(_));
        Ok((in_place && blocks.with_typed(|_| ()).is_some()).then_some(blocks))
    }

    pub fn format(&self) -> GgmlDType {
        self.tensor.dtype()
    }

    /// Calls `f` with the blocks typed by their format.
    fn with_typed<R>(&self, f: impl FnOnce(Typed<'_>) -> R) -> Option<R> {
        let data = self.tensor.data().ok()?;
        let bytes: &[u8] = &data;
        let typed = match self.format() {
            GgmlDType::Q4_0 => Typed::Q4_0(view(bytes)?),
            GgmlDType::Q4_1 => Typed::Q4_1(view(bytes)?),
            GgmlDType::Q8_0 => Typed::Q8_0(view(bytes)?),
            GgmlDType::Q4K => Typed::Q4K(view(bytes)?),
            GgmlDType::Q5K => Typed::Q5K(view(bytes)?),
            GgmlDType::Q6K => Typed::Q6K(view(bytes)?),
            _ => return None,
        };
        Some(f(typed))
    }

    pub fn len(&self) -> usize {
        self.with_typed(|t| t.len()).unwrap_or(0)
    }

    /// All parts' blocks in order (`rows` rows of `cols` values in all),
    /// when they share one format.
    pub fn concat(parts: &[&QuantBlocks], rows: usize, cols: usize) -> Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let format = first.format();
        if parts.iter().any(|p| p.format() != format) {
            return Ok(None);
        }
        let mut bytes = Vec::new();
        for part in parts {
            bytes.extend_from_slice(&part.tensor.data()?);
        }
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, format)?;
        Self::new(Arc::new(QTensor::new(storage, (rows, cols))?))
    }

    /// The blocks repacked for batches, when their format has such kernels.
    pub fn interleaved(&self, rows: usize, cols: usize) -> Result<Option<InterleavedQ4>> {
        let format = match self.format() {
            GgmlDType::Q4_0 => Nibbles::Q4_0,
            GgmlDType::Q4_1 => Nibbles::Q4_1,
            _ => return Ok(None),
        };
        let bytes = self.tensor.data()?;
        Ok(Some(InterleavedQ4::new(format, &bytes, rows, cols)?))
    }

    /// Q4_K blocks repacked sixteen rows to a unit.
    pub fn interleaved_q4k(&self, rows: usize, cols: usize) -> Result<Option<InterleavedQ4K>> {
        if self.format() != GgmlDType::Q4K {
            return Ok(None);
        }
        let bytes = self.tensor.data()?;
        Ok(Some(InterleavedQ4K::new(&bytes, rows, cols)?))
    }

    /// Q8_0 blocks repacked sixteen rows to a unit.
    pub fn interleaved_q8(&self, rows: usize, cols: usize) -> Result<Option<InterleavedQ8>> {
        self.with_typed(|typed| match typed {
            Typed::Q8_0(blocks) => Some(InterleavedQ8::new(blocks, rows, cols)),
            _ => None,
        })
        .flatten()
        .transpose()
    }

    pub fn matmul(&self, shape: parallel::Shape, input: &[f32], out: &mut [f32]) -> Result<()> {
        self.with_typed(|typed| match typed {
            Typed::Q4_0(w) => parallel::matmul(w, shape, input, out, Kernels::candle()),
            Typed::Q4_1(w) => parallel::matmul(w, shape, input, out, dot::q4_1_q8_1()),
            Typed::Q8_0(w) => q8_0::matmul_rows(w, shape, input, out),
            Typed::Q4K(w) => parallel::matmul(w, shape, input, out, q4_k::kernels()),
            Typed::Q5K(w) => parallel::matmul(w, shape, input, out, q5_k::kernels()),
            Typed::Q6K(w) => parallel::matmul(w, shape, input, out, q6_k::kernels()),
        })
        .ok_or_else(|| {
            ModelError::InvalidConfig(format!(
                "{:?} blocks are not readable in place",
                self.format()
            ))
        })
    }

    /// The scalar reference's product, for the tests.
    #[cfg(test)]
    pub fn reference(&self, shape: parallel::Shape, input: &[f32]) -> Vec<f32> {
        fn rows<T: GgmlType>(w: &[T], shape: parallel::Shape, x: &[f32]) -> Vec<f32> {
            let per_row = shape.cols / T::BLCK_SIZE;
            let mut out = vec![0f32; shape.batch * shape.rows];
            for r in 0..shape.batch {
                let mut q = vec![T::VecDotType::zeros(); per_row];
                T::VecDotType::from_float(&x[r * shape.cols..(r + 1) * shape.cols], &mut q);
                for o in 0..shape.rows {
                    let w = &w[o * per_row..(o + 1) * per_row];
                    out[r * shape.rows + o] = T::vec_dot_unopt(shape.cols, w, &q);
                }
            }
            out
        }
        self.with_typed(|typed| match typed {
            Typed::Q4_0(w) => rows(w, shape, input),
            Typed::Q4_1(w) => rows(w, shape, input),
            Typed::Q8_0(w) => rows(w, shape, input),
            Typed::Q4K(w) => rows(w, shape, input),
            Typed::Q5K(w) => rows(w, shape, input),
            Typed::Q6K(w) => rows(w, shape, input),
        })
        .unwrap_or_default()
    }
}

enum Typed<'a> {
    Q4_0(&'a [BlockQ4_0]),
    Q4_1(&'a [BlockQ4_1]),
    Q8_0(&'a [BlockQ8_0]),
    Q4K(&'a [BlockQ4K]),
    Q5K(&'a [BlockQ5K]),
    Q6K(&'a [BlockQ6K]),
}

impl Typed<'_> {
    fn len(&self) -> usize {
        match self {
            Typed::Q4_0(b) => b.len(),
            Typed::Q4_1(b) => b.len(),
            Typed::Q8_0(b) => b.len(),
            Typed::Q4K(b) => b.len(),
            Typed::Q5K(b) => b.len(),
            Typed::Q6K(b) => b.len(),
        }
    }
}
