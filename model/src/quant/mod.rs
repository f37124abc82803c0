//! Matrix products straight from GGUF block formats, as llama.cpp computes
//! them: each activation row is quantized to 8 bits per block, and every
//! output is an integer dot product of a weight row's blocks with it.
//!
//! One call multiplies all the rows of a batch, weight row by weight row, so
//! a weight row is read from memory once per step however many sessions
//! share it; the weight rows are split over the thread pool.
//! [`QuantMatrix::concat`] stacks projections that read the same input (Q, K
//! and V; gate and up) so they cost one pass and one dispatch, and
//! [`QuantMatrix::interleaved`] repacks 4-bit weights ([`interleaved`]) and,
//! where the CPU has AVX-512 VNNI, Q8_0 ones (`q8_0/interleaved.rs`).

mod blocks;
mod dot;
mod interleaved;
mod k_quants;
#[cfg(target_arch = "x86_64")]
mod lanes;
pub(crate) mod parallel;
mod q4_k;
mod q5_k;
mod q6_k;
mod q8_0;

pub(crate) use blocks::QuantBlocks;
use interleaved::{Activations, InterleavedQ4};
use q4_k::{ActivationsQ8K, InterleavedQ4K};
use q8_0::{ActivationBlocks, InterleavedQ8};

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// Whether this CPU's kept-quantized spans repack `format` sixteen rows to
/// a unit for batches ([`QuantMatrix::interleaved`]), rather than keep its
/// blocks as stored: where the CPU runs the repacked layout's vector
/// kernel (elsewhere it would fall to the portable one).
pub fn repacked_for_batches(format: candle_core::quantized::GgmlDType) -> bool {
    use candle_core::quantized::GgmlDType;
    match format {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 => true,
        GgmlDType::Q8_0 => InterleavedQ8::supported(),
        GgmlDType::Q4K => InterleavedQ4K::supported(),
        _ => false,
    }
}

/// The room a product's quantized activations take, kept between products.
#[derive(Debug, Default)]
pub(crate) struct ActivationScratch {
    q4: Activations,
    q8: ActivationBlocks,
    q4k: ActivationsQ8K,
}

/// A weight matrix `[rows, cols]` kept in its GGUF quantization.
#[derive(Debug, Clone)]
pub(crate) struct QuantMatrix {
    rows: usize,
    cols: usize,
    weights: Layout,
}

#[derive(Debug, Clone)]
enum Layout {
    /// As GGUF stores them (in place in candle's storage).
    Blocks(QuantBlocks),
    /// Repacked for batches.
    Interleaved(Arc<InterleavedQ4>),
    /// Q8_0 repacked for AVX-512 VNNI.
    InterleavedQ8(Arc<InterleavedQ8>),
    /// Q4_K repacked for AVX-512 VNNI.
    InterleavedQ4K(Arc<InterleavedQ4K>),
}

impl QuantMatrix {
    /// The matrix of a quantized tensor (`[rows, cols]`), or `None` for a
    /// format these kernels do not cover (the caller keeps candle's).
    pub fn new(tensor: Arc<QTensor>) -> Result<Option<Self>> {
        let (rows, cols) = tensor.shape().dims2()?;
        let block = tensor.dtype().block_size();
        if !cols.is_multiple_of(block) {
            return Ok(None);
        }
        let Some(blocks) = QuantBlocks::new(tensor)? else {
            return Ok(None);
        };
        if blocks.len() != rows * cols / block {
            return Err(ModelError::InvalidConfig(format!(
                "a {rows}x{cols} {:?} tensor holds {} blocks",
                blocks.format(),
                blocks.len()
            )));
        }
        Ok(Some(QuantMatrix {
            rows,
            cols,
            weights: Layout::Blocks(blocks),
        }))
    }

    /// The matrix with its weights repacked sixteen rows to a unit where
    /// the format has such kernels (Q4_0 and Q4_1 everywhere, which multiply a
    /// batch's rows 2-3x faster; Q8_0 and Q4_K on CPUs with AVX-512 VNNI). The
    /// repacked copy replaces the blocks, which are dropped: not for a
    /// matrix whose blocks are read elsewhere too.
    pub fn interleaved(self) -> Result<Self> {
        let Layout::Blocks(blocks) = &self.weights else {
            return Ok(self);
        };
        if !repacked_for_batches(blocks.format()) {
            return Ok(self);
        }
        let (rows, cols) = (self.rows, self.cols);
        let weights = if let Some(q4) = blocks.interleaved(rows, cols)? {
            Layout::Interleaved(Arc::new(q4))
        } else if let Some(q4k) = blocks.interleaved_q4k(rows, cols)? {
            Layout::InterleavedQ4K(Arc::new(q4k))
        } else if let Some(q8) = blocks.interleaved_q8(rows, cols)? {
            Layout::InterleavedQ8(Arc::new(q8))
        } else {
            return Ok(self);
        };
        Ok(QuantMatrix { weights, ..self })
    }

    /// The matrices stacked by rows (one product computes all their
    /// outputs, in order), when they share a format and a width and are
    /// not yet repacked.
    pub fn concat(parts: &[&QuantMatrix]) -> Result<Option<QuantMatrix>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts.iter().any(|p| p.cols != first.cols) {
            return Ok(None);
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let blocks: Option<Vec<&QuantBlocks>> = parts
            .iter()
            .map(|p| match &p.weights {
                Layout::Blocks(blocks) => Some(blocks),
                Layout::Interleaved(_) | Layout::InterleavedQ8(_) | Layout::InterleavedQ4K(_) => {
                    None
                }
            })
            .collect();
        let Some(blocks) = blocks else {
            return Ok(None);
        };
        Ok(
            QuantBlocks::concat(&blocks, rows, first.cols)?.map(|blocks| QuantMatrix {
                rows,
                cols: first.cols,
                weights: Layout::Blocks(blocks),
            }),
        )
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `x` (`[.., cols]`, any float dtype) times the transposed matrix:
    /// `[.., rows]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let cols = dims.last().copied().unwrap_or(0);
        if cols != self.cols {
            return Err(ModelError::HiddenShape {
                actual: dims.to_vec(),
                hidden: self.cols,
            });
        }
        let dtype = x.dtype();
        let input = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let batch = input.len() / cols.max(1);
        let mut out = vec![0f32; batch * self.rows];
        self.matmul(&input, batch, &mut out)?;
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = self.rows;
        }
        Ok(Tensor::from_vec(out, out_dims, &Device::Cpu)?.to_dtype(dtype)?)
    }

    fn shape(&self, batch: usize) -> parallel::Shape {
        parallel::Shape {
            rows: self.rows,
            cols: self.cols,
            batch,
        }
    }

    /// `out[r * rows + o] = dot(weight row o, input row r)` for `batch` rows.
    pub fn matmul(&self, input: &[f32], batch: usize, out: &mut [f32]) -> Result<()> {
        self.matmul_reusing(input, batch, out, &mut ActivationScratch::default())
    }

    /// [`Self::matmul`], the input rows quantized into `scratch`: a
    /// repacked matrix's product allocates nothing once `scratch` has
    /// held a batch as large.
    pub fn matmul_reusing(
        &self,
        input: &[f32],
        batch: usize,
        out: &mut [f32],
        scratch: &mut ActivationScratch,
    ) -> Result<()> {
        // The kernels write `out` through a raw pointer: real checks.
        assert_eq!(input.len(), batch * self.cols, "input of the wrong size");
        assert_eq!(out.len(), batch * self.rows, "output of the wrong size");
        match &self.weights {
            Layout::Interleaved(interleaved) => {
                interleaved.matmul(self.shape(batch), input, out, &mut scratch.q4);
                Ok(())
            }
            Layout::InterleavedQ8(interleaved) => {
                interleaved.matmul(self.shape(batch), input, out, &mut scratch.q8);
                Ok(())
            }
            Layout::InterleavedQ4K(interleaved) => {
                interleaved.matmul(self.shape(batch), input, out, &mut scratch.q4k);
                Ok(())
            }
            Layout::Blocks(blocks) => blocks.matmul(self.shape(batch), input, out),
        }
    }
}

#[cfg(test)]
mod tests;
