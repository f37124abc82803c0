//! One decoder layer: attention and the feed-forward block, each after
//! its RMSNorm and added to the residual.

use candle_core::Tensor;

use super::attention::Attention;
use super::rms_norm;
use crate::checkpoint::Weights;
use crate::config::LlamaConfig;
use crate::error::Result;
use crate::feed_forward::FeedForward;
use crate::kv_cache::LayerCache;
use crate::lora::RowLoras;
use crate::norm::Norm;
use crate::rope::Rope;

#[derive(Debug, Clone)]
pub(super) struct DecoderLayer {
    pub(super) input_layernorm: Norm,
    pub(super) self_attn: Attention,
    pub(super) post_attention_layernorm: Norm,
    pub(super) mlp: FeedForward,
}

impl DecoderLayer {
    pub(super) fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        Ok(DecoderLayer {
            input_layernorm: rms_norm(w, "input_layernorm", cfg)?,
            self_attn: Attention::load(&w.pp("self_attn"), cfg)?,
            post_attention_layernorm: rms_norm(w, "post_attention_layernorm", cfg)?,
            mlp: FeedForward::load(w, cfg)?,
        })
    }

    pub(super) fn forward(
        &self,
        x: &Tensor,
        start: usize,
        rope: &Rope,
        cache: &mut LayerCache,
        mask: Option<&Tensor>,
        loras: &RowLoras,
    ) -> Result<Tensor> {
        let normed = self.input_layernorm.forward(x)?;
        let attn = self
            .self_attn
            .forward(&normed, start, rope, cache, mask, loras)?;
        self.add_mlp(x, attn, loras)
    }

    pub(super) fn multiplied_by_candle(&self) -> bool {
        self.self_attn.multiplied_by_candle() || self.mlp.multiplied_by_candle()
    }

    /// The residual of attention, then the MLP's.
    fn add_mlp(&self, x: &Tensor, attn: Tensor, loras: &RowLoras) -> Result<Tensor> {
        let x = (x + attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?, loras)?;
        Ok((x + mlp)?)
    }

    /// [`Self::forward`] for one decode position of each of several sessions (`x`: `[B, hidden]`).
    pub(super) fn forward_decode_batch(
        &self,
        x: &Tensor,
        starts: &[usize],
        rotation: &(Tensor, Tensor),
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        loras: &RowLoras,
    ) -> Result<Tensor> {
        let attn = self.self_attn.forward_decode_batch(
            &self.input_layernorm.forward(x)?,
            starts,
            rotation,
            rope,
            caches,
            loras,
        )?;
        self.add_mlp(x, attn, loras)
    }
}
