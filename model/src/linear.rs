//! A linear layer whose weight is either dense or kept in its GGUF
//! quantization (multiplied by candle's quantized kernels).

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::checkpoint::Weights;
use crate::error::Result;

#[derive(Debug, Clone)]
pub(crate) enum Linear {
    /// The weight kept transposed (`[in, out]`, contiguous): candle's CPU
    /// matmul against a transposed view is several times slower once more
    /// than one row comes in, which is every batched decode step.
    Dense {
        weight_t: Tensor,
        bias: Option<Tensor>,
    },
    /// A weight also used elsewhere (tied embeddings), multiplied through a
    /// transposed view so that it is not copied.
    Shared(candle_nn::Linear),
    Quantized {
        weight: QMatMul,
        bias: Option<Tensor>,
    },
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Linear::Dense {
            weight_t: weight.t()?.contiguous()?,
            bias,
        })
    }

    /// A projection by `weight` without a transposed copy of it.
    pub fn shared(weight: Tensor) -> Self {
        Linear::Shared(candle_nn::Linear::new(weight, None))
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
            None => Self::dense(w.get("weight", &[out_dim, in_dim])?, bias),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Dense { weight_t, bias } => {
                // All leading dimensions as rows of one matrix product.
                let dims = x.dims();
                let in_dim = dims.last().copied().unwrap_or(0);
                let rows = x.elem_count() / in_dim.max(1);
                let y = x.reshape((rows, in_dim))?.matmul(weight_t)?;
                let mut out_dims = dims.to_vec();
                if let Some(last) = out_dims.last_mut() {
                    *last = weight_t.dim(1)?;
                }
                let y = y.reshape(out_dims)?;
                Ok(match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
            Linear::Shared(l) => Ok(l.forward(x)?),
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
