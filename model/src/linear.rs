//! A linear layer whose weight is either dense or kept in its GGUF
//! quantization (multiplied by candle's quantized kernels).

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::checkpoint::Weights;
use crate::error::Result;

#[derive(Debug, Clone)]
pub(crate) enum Linear {
    Dense(candle_nn::Linear),
    Quantized {
        weight: QMatMul,
        bias: Option<Tensor>,
    },
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear::Dense(candle_nn::Linear::new(weight, bias))
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
            Linear::Dense(l) => Ok(l.forward(x)?),
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
