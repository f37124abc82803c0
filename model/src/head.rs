//! The client's part of the model: token embeddings, final RMSNorm, LM head.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, RmsNorm};

use crate::checkpoint::Checkpoint;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::span::rms_norm;

pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

#[derive(Debug, Clone)]
pub struct ClientHead {
    embed_tokens: Embedding,
    norm: RmsNorm,
    lm_head: Linear,
    config: LlamaConfig,
    dtype: DType,
    device: Device,
}

impl ClientHead {
    pub fn load(checkpoint: &Checkpoint, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = checkpoint.config();
        let w = checkpoint.weights(dtype, device);
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embeddings = w.get(EMBED_TOKENS, &[v, h])?;
        // Some checkpoints with tied embeddings still ship lm_head; prefer it when present.
        let head_name = if cfg.tie_word_embeddings && !w.contains(LM_HEAD) {
            EMBED_TOKENS
        } else {
            LM_HEAD
        };
        // Tied: the dense embeddings are at hand, and multiplying by them
        // costs no memory and no activation quantization.
        let lm_head = if head_name == EMBED_TOKENS {
            Linear::dense(embeddings.clone(), None)
        } else {
            match w.get_quantized(head_name, &[v, h])? {
                Some(q) => Linear::quantized(q, None)?,
                None => Linear::dense(w.get(head_name, &[v, h])?, None),
            }
        };
        Ok(ClientHead {
            embed_tokens: Embedding::new(embeddings, h),
            norm: rms_norm(&w, "model.norm", cfg)?,
            lm_head,
            config: cfg.clone(),
            dtype,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Embeds `ids` as hidden states of shape `[1, T, hidden]`.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.config.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id, vocab });
        }
        let ids = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        Ok(self.embed_tokens.forward(&ids)?)
    }

    /// The final RMSNorm of the last layer's output.
    pub fn final_norm(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.norm.forward(&hidden.to_dtype(self.dtype)?)?)
    }

    /// Logits for every position: `[1, T, hidden]` -> `[1, T, vocab]` in f32.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let normed = self.final_norm(hidden)?;
        Ok(self.lm_head.forward(&normed)?.to_dtype(DType::F32)?)
    }

    /// Logits of the last position only, as a `[vocab]` f32 vector.
    pub fn last_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let t = hidden.dim(1)?;
        let last = hidden.narrow(1, t - 1, 1)?;
        Ok(self.logits(&last)?.flatten_all()?)
    }
}
