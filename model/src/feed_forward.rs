//! A decoder block's feed-forward: one SwiGLU MLP, or a mixture of experts.

use candle_core::Tensor;

use crate::checkpoint::Weights;
use crate::config::LlamaConfig;
use crate::error::Result;
use crate::experts::Experts;
use crate::lora::RowLoras;
use crate::mlp::Mlp;

#[derive(Debug, Clone)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Experts(Experts),
}

impl FeedForward {
    /// The feed-forward of the layer whose weights `layer` holds.
    pub(crate) fn load(layer: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        Ok(match &cfg.experts {
            Some(experts) => Self::Experts(Experts::load(layer, cfg, experts)?),
            None => Self::Dense(Mlp::load(&layer.pp("mlp"), cfg)?),
        })
    }

    pub(crate) fn multiplied_by_candle(&self) -> bool {
        match self {
            Self::Dense(mlp) => mlp.multiplied_by_candle(),
            Self::Experts(experts) => experts.multiplied_by_candle(),
        }
    }

    /// `x`: rows of the hidden size, under any leading dimensions. Adapters
    /// change a dense MLP only ([`crate::lora::SpanAdapter`] refuses
    /// others for a mixture).
    pub(crate) fn forward(&self, x: &Tensor, loras: &RowLoras) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x, loras),
            Self::Experts(experts) => experts.forward(x),
        }
    }
}
