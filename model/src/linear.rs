//! A linear layer whose weight is either dense or kept in its GGUF
//! quantization.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::checkpoint::Weights;
use crate::error::Result;
use crate::quant::{ActivationScratch, QuantMatrix};

#[derive(Debug, Clone)]
pub(crate) enum Linear {
    /// The weight as stored (`[out, in]`), multiplied through a transposed
    /// view. With the weights streaming from memory (a span is far larger
    /// than the caches) this layout is the fast one for a batch of rows:
    /// measured on 2 cores, 16 rows through a 512x1376 projection cost
    /// 0.58 ms against 1.36 ms with a contiguous `[in, out]` copy, at the
    /// price of 0.37 ms against 0.32 ms for a single row.
    Dense {
        weight: Tensor,
        bias: Option<Tensor>,
    },
    Quantized {
        weight: QuantizedWeight,
        bias: Option<Tensor>,
    },
}

/// Who multiplies a quantized weight: Corolla's kernels ([`crate::quant`])
/// for the formats they cover, candle's for the rest.
#[derive(Debug, Clone)]
pub(crate) enum QuantizedWeight {
    Blocks(QuantMatrix),
    Candle(QMatMul),
}

/// Set to `candle` to multiply every quantized weight with candle's kernels
/// (for side-by-side benchmarks).
pub const KERNELS_ENV: &str = "COROLLA_KERNELS";

fn corolla_kernels() -> bool {
    std::env::var(KERNELS_ENV).map_or(true, |v| v != "candle")
}

impl Linear {
    /// A projection by `weight` as stored; tied heads pass the embeddings'
    /// tensor, which is then shared, not copied.
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear::Dense { weight, bias }
    }

    pub fn quantized(weight: QTensor, bias: Option<Tensor>) -> Result<Self> {
        let weight = Arc::new(weight);
        let blocks = if corolla_kernels() {
            QuantMatrix::new(weight.clone())?
        } else {
            None
        };
        let weight = match blocks {
            Some(matrix) => QuantizedWeight::Blocks(matrix),
            None => QuantizedWeight::Candle(QMatMul::from_arc(weight)?),
        };
        Ok(Linear::Quantized { weight, bias })
    }

    /// The layer with a quantized weight repacked for batches where its
    /// format has such kernels (see [`QuantMatrix::interleaved`]).
    pub fn interleaved(self) -> Result<Self> {
        Ok(match self {
            Linear::Quantized {
                weight: QuantizedWeight::Blocks(matrix),
                bias,
            } => Linear::Quantized {
                weight: QuantizedWeight::Blocks(matrix.interleaved()?),
                bias,
            },
            other => other,
        })
    }

    /// Whether candle multiplies this weight (dense, or a quantized format
    /// Corolla's kernels do not cover): its products want rayon's threads.
    pub fn multiplied_by_candle(&self) -> bool {
        !matches!(
            self,
            Linear::Quantized {
                weight: QuantizedWeight::Blocks(_),
                ..
            }
        )
    }

    /// Loads `weight` (`[out_dim, in_dim]`) and, if asked, `bias` under `w`.
    pub fn load(w: &Weights, out_dim: usize, in_dim: usize, bias: bool) -> Result<Self> {
        let bias = if bias {
            Some(w.get("bias", &[out_dim])?)
        } else {
            None
        };
        match w.get_quantized("weight", &[out_dim, in_dim])? {
            Some(q) => Self::quantized(q, bias),
            None => Ok(Self::dense(w.get("weight", &[out_dim, in_dim])?, bias)),
        }
    }

    /// [`Self::forward`] of `rows` rows of plain f32 (`x`: `[rows, in]`)
    /// into `y`, with the same bits: Corolla's kernels take the rows as
    /// they are (their activations rounded into `scratch`, so that a step
    /// allocates nothing), anything else goes through a tensor.
    pub fn forward_rows_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut Vec<f32>,
        scratch: &mut ActivationScratch,
    ) -> Result<()> {
        let Linear::Quantized {
            weight: QuantizedWeight::Blocks(matrix),
            bias,
        } = self
        else {
            let input = Tensor::from_slice(x, (rows, x.len() / rows.max(1)), &Device::Cpu)?;
            *y = self.forward(&input)?.flatten_all()?.to_vec1()?;
            return Ok(());
        };
        y.resize(rows * matrix.rows(), 0.0);
        matrix.matmul_reusing(x, rows, y, scratch)?;
        if let Some(bias) = bias {
            with_f32_values(bias, |bias| {
                for row in y.chunks_exact_mut(bias.len()) {
                    for (y, b) in row.iter_mut().zip(bias) {
                        *y += b;
                    }
                }
            })?;
        }
        Ok(())
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = match self {
            Linear::Dense { weight, bias } => {
                // All leading dimensions as rows of one matrix product.
                let dims = x.dims();
                let in_dim = dims.last().copied().unwrap_or(0);
                let rows = x.elem_count() / in_dim.max(1);
                let y = x.reshape((rows, in_dim))?.matmul(&weight.t()?)?;
                let mut out_dims = dims.to_vec();
                if let Some(last) = out_dims.last_mut() {
                    *last = weight.dim(0)?;
                }
                (y.reshape(out_dims)?, bias)
            }
            Linear::Quantized {
                weight: QuantizedWeight::Blocks(matrix),
                bias,
            } => (matrix.forward(x)?, bias),
            Linear::Quantized {
                weight: QuantizedWeight::Candle(weight),
                bias,
            } => {
                // Candle's quantized kernels take f32 activations.
                let dtype = x.dtype();
                let y = weight.forward(&x.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
                (y, bias)
            }
        };
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Calls `f` with `t`'s values as f32, read in place where they are f32
/// already (a bias, at every step).
pub(crate) fn with_f32_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.to_dtype(DType::F32)?;
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => {
            Ok(f(&cpu.as_slice::<f32>()?[start..end]))
        }
        _ => {
            drop(storage);
            Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
        }
    }
}

/// `N` projections of one input (Q, K and V; gate and up). Quantized ones
/// that share a format are stacked into one matrix: one pass over the input
/// and one dispatch to the thread pool instead of `N`. Their weights are
/// repacked for batches ([`Linear::interleaved`]).
#[derive(Debug, Clone)]
pub(crate) enum Projections<const N: usize> {
    Stacked { linear: Linear, widths: [usize; N] },
    Separate([Linear; N]),
}

impl<const N: usize> Projections<N> {
    pub fn new(parts: [Linear; N]) -> Result<Self> {
        let matrices: Option<Vec<&QuantMatrix>> = parts
            .iter()
            .map(|p| match p {
                Linear::Quantized {
                    weight: QuantizedWeight::Blocks(m),
                    ..
                } => Some(m),
                _ => None,
            })
            .collect();
        let biases: Vec<Option<&Tensor>> = parts
            .iter()
            .map(|p| match p {
                Linear::Quantized { bias, .. } | Linear::Dense { bias, .. } => bias.as_ref(),
            })
            .collect();
        let bias = if biases.iter().all(Option::is_none) {
            Some(None)
        } else if biases.iter().all(Option::is_some) {
            Some(Some(Tensor::cat(
                &biases.into_iter().flatten().collect::<Vec<_>>(),
                0,
            )?))
        } else {
            None
        };
        if let (Some(matrices), Some(bias)) = (matrices, bias) {
            if let Some(stacked) = QuantMatrix::concat(&matrices)? {
                let widths = std::array::from_fn(|i| matrices[i].rows());
                return Ok(Projections::Stacked {
                    linear: Linear::Quantized {
                        weight: QuantizedWeight::Blocks(stacked.interleaved()?),
                        bias,
                    },
                    widths,
                });
            }
        }
        let parts: Vec<Linear> = parts
            .into_iter()
            .map(Linear::interleaved)
            .collect::<Result<_>>()?;
        Ok(Projections::Separate(parts.try_into().unwrap_or_else(
            |_| unreachable!("one layer per projection"),
        )))
    }

    pub fn multiplied_by_candle(&self) -> bool {
        match self {
            Projections::Stacked { linear, .. } => linear.multiplied_by_candle(),
            Projections::Separate(parts) => parts.iter().any(Linear::multiplied_by_candle),
        }
    }

    /// [`Self::forward`] of `rows` rows of plain f32 into `outputs`: each
    /// projection's `[rows, width]` values (`stacked`: room for a stacked
    /// product's outputs before they are split).
    pub fn forward_rows_into(
        &self,
        x: &[f32],
        rows: usize,
        outputs: [&mut Vec<f32>; N],
        stacked: &mut Vec<f32>,
        scratch: &mut ActivationScratch,
    ) -> Result<()> {
        match self {
            Projections::Separate(parts) => {
                for (part, out) in parts.iter().zip(outputs) {
                    part.forward_rows_into(x, rows, out, scratch)?;
                }
            }
            Projections::Stacked { linear, widths } => {
                linear.forward_rows_into(x, rows, stacked, scratch)?;
                let total: usize = widths.iter().sum();
                let mut at = 0;
                for (&w, out) in widths.iter().zip(outputs) {
                    out.clear();
                    for row in stacked.chunks_exact(total) {
                        out.extend_from_slice(&row[at..at + w]);
                    }
                    at += w;
                }
            }
        }
        Ok(())
    }

    /// Each projection of `x`, in the order they were given.
    pub fn forward(&self, x: &Tensor) -> Result<[Tensor; N]> {
        let outputs: Vec<Tensor> = match self {
            Projections::Separate(parts) => {
                parts.iter().map(|p| p.forward(x)).collect::<Result<_>>()?
            }
            Projections::Stacked { linear, widths } => {
                let y = linear.forward(x)?;
                let last = y.rank() - 1;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(last, at, w);
                        at += w;
                        part
                    })
                    .collect::<candle_core::Result<_>>()?
            }
        };
        Ok(outputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per projection")))
    }
}
