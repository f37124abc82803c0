//! A linear layer whose weight is either dense or kept in its GGUF
//! quantization (multiplied by candle's quantized kernels).

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::checkpoint::Weights;
use crate::error::Result;

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
        weight: QMatMul,
        bias: Option<Tensor>,
    },
}

impl Linear {
    /// A projection by `weight` as stored; tied heads pass the embeddings'
    /// tensor, which is then shared, not copied.
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear::Dense { weight, bias }
    }

    pub fn quantized(weight: QTensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Linear::Quantized {
            weight: QMatMul::from_qtensor(weight)?,
            bias,
        })
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

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
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
                let y = y.reshape(out_dims)?;
                Ok(match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
            Linear::Quantized { weight, bias } => {
                // The quantized kernels take f32 activations.
                let dtype = x.dtype();
                let y = weight.forward(&x.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
                Ok(match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
        }
    }
}
