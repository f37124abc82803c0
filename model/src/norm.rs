//! RMSNorm, on tensors (through candle) and on rows of plain f32 (a CPU
//! step's rows, `span/rows.rs`) with candle's arithmetic, so both give the
//! same bits.

use candle_core::{DType, Module, Tensor};
use candle_nn::RmsNorm;

use crate::checkpoint::Weights;
use crate::error::Result;

#[derive(Debug, Clone)]
pub(crate) struct Norm {
    candle: RmsNorm,
    weight: Vec<f32>,
    eps: f32,
}

impl Norm {
    /// The norm `name` over `size` values, from its `weight`.
    pub fn load(w: &Weights, name: &str, size: usize, eps: f64) -> Result<Self> {
        let weight = w.pp(name).get("weight", &[size])?;
        Ok(Norm {
            weight: weight.to_dtype(DType::F32)?.to_vec1()?,
            candle: RmsNorm::new(weight, eps),
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.candle.forward(x)?)
    }

    /// Each row of `x` (rows as wide as the weight) normed into `out`, as
    /// candle's CPU kernel computes it.
    pub fn rows_into(&self, x: &[f32], out: &mut Vec<f32>) {
        out.resize(x.len(), 0.0);
        let n = self.weight.len();
        for (src, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let sum2 = src.iter().map(|&v| v * v).sum::<f32>();
            let m = (sum2 / n as f32 + self.eps).sqrt();
            for ((d, &s), &alpha) in dst.iter_mut().zip(src).zip(&self.weight) {
                *d = s / m * alpha;
            }
        }
    }
}
