//! The client's part of the model: token embeddings, final RMSNorm, LM head.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::Embedding;

use crate::checkpoint::Checkpoint;
use crate::config::LlamaConfig;
use crate::embeddings::{RowFetch, RowFormat, TokenEmbeddings};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::norm::Norm;
use crate::pool::ComputePool;
use crate::span::rms_norm;
use crate::tensor_names::{EMBED_TOKENS, LM_HEAD};
use crate::weight_file::RawDType;

fn is_quantized(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

#[derive(Debug, Clone)]
pub struct ClientHead {
    embed_tokens: Arc<TokenEmbeddings>,
    norm: Norm,
    lm_head: Linear,
    config: LlamaConfig,
    dtype: DType,
    device: Device,
    /// The LM head's product is a decode step's largest (49152 x 576 for the
    /// default model): it runs on threads that stay warm, as a span's do.
    pool: ComputePool,
}

impl ClientHead {
    /// The head of `checkpoint`. A GGUF embedding table stays in the mapped
    /// file in its stored type (rows are dequantized as tokens need them),
    /// unless it is tied and dequantized: then it is loaded dense, since the
    /// LM head multiplies by all of it.
    pub fn load(checkpoint: &Checkpoint, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = checkpoint.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let tied = cfg.tie_word_embeddings && !checkpoint.contains(LM_HEAD);
        let w = checkpoint.weights(dtype, device);
        // A tied table kept quantized is multiplied from its stored blocks,
        // as llama.cpp does (a quarter of the bytes a dense one reads per
        // token); rows are dequantized as tokens need them.
        let tied_quantized = if tied {
            w.get_quantized(EMBED_TOKENS, &[v, h])?
        } else {
            None
        };
        if tied && tied_quantized.is_none() {
            // Tied and dense: the embeddings are at hand, and multiplying by
            // them costs no memory and no activation quantization.
            let embeddings = w.get(EMBED_TOKENS, &[v, h])?;
            let lm_head = Linear::dense(embeddings.clone(), None);
            let embed_tokens = TokenEmbeddings::Dense(Embedding::new(embeddings, h));
            return Self::with_embeddings(checkpoint, embed_tokens, lm_head, dtype, device);
        }
        let raw = checkpoint.raw_tensor(EMBED_TOKENS)?;
        let embed_tokens = match raw.dtype {
            RawDType::Ggml(stored) if raw.shape == [v, h] => {
                let format = RowFormat {
                    dtype: stored,
                    rows: v,
                    hidden: h,
                };
                TokenEmbeddings::mapped(raw, format)?
            }
            _ => {
                let w = checkpoint.weights(dtype, device);
                TokenEmbeddings::Dense(Embedding::new(w.get(EMBED_TOKENS, &[v, h])?, h))
            }
        };
        let lm_head = match tied_quantized {
            Some(table) => Linear::quantized(table, None)?,
            None => Self::lm_head(checkpoint, dtype, device)?,
        };
        // The table the head multiplies is its own copy (rows for the
        // embeddings come from the file), so it may be repacked; not in a
        // page, whose memory never shrinks back from the repacking's peak.
        #[cfg(not(target_arch = "wasm32"))]
        let lm_head = lm_head.interleaved()?;
        Self::with_embeddings(checkpoint, embed_tokens, lm_head, dtype, device)
    }

    /// The head of an untied model held in pieces, as a page holds it: the
    /// checkpoint has the config and final norm; the LM head arrived on its
    /// own (streamed into its storage, [`crate::quantized_buffer`]); rows of
    /// `format` come from `source` as tokens need them, the recent ones kept.
    pub fn load_split(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
        lm_head: QTensor,
        format: RowFormat,
        source: Box<dyn RowFetch>,
    ) -> Result<Self> {
        let cfg = checkpoint.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        if format.rows != v || format.hidden != h || lm_head.shape().dims() != [v, h] {
            return Err(ModelError::InvalidConfig(format!(
                "embedding rows {}x{} and an LM head of {:?} for a model of vocabulary {v} \
                 and hidden size {h}",
                format.rows,
                format.hidden,
                lm_head.shape().dims()
            )));
        }
        // As `load` does: the same choice of dense or quantized math.
        let lm_head = if checkpoint.dequantizes() || !is_quantized(lm_head.dtype()) {
            Linear::dense(lm_head.dequantize(device)?.to_dtype(dtype)?, None)
        } else {
            Linear::quantized(lm_head, None)?
        };
        let embed_tokens = TokenEmbeddings::fetched(format, source)?;
        Self::with_embeddings(checkpoint, embed_tokens, lm_head, dtype, device)
    }

    /// An untied LM head, kept quantized when the checkpoint keeps quantized weights.
    fn lm_head(checkpoint: &Checkpoint, dtype: DType, device: &Device) -> Result<Linear> {
        let cfg = checkpoint.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let w = checkpoint.weights(dtype, device);
        Ok(match w.get_quantized(LM_HEAD, &[v, h])? {
            Some(q) => Linear::quantized(q, None)?,
            None => Linear::dense(w.get(LM_HEAD, &[v, h])?, None),
        })
    }

    // A page's row source holds JavaScript values (not `Send`); wasm32 has
    // one thread, and natively `RowFetch` is `Send + Sync`.
    #[cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]
    fn with_embeddings(
        checkpoint: &Checkpoint,
        embed_tokens: TokenEmbeddings,
        lm_head: Linear,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let cfg = checkpoint.config();
        let w = checkpoint.weights(dtype, device);
        let pool = match device.is_cpu() {
            true => ComputePool::new(lm_head.multiplied_by_candle()),
            false => ComputePool::default(),
        };
        Ok(ClientHead {
            embed_tokens: Arc::new(embed_tokens),
            norm: rms_norm(&w, "model.norm", cfg)?,
            lm_head,
            config: cfg.clone(),
            dtype,
            device: device.clone(),
            pool,
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

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(&id) => Err(ModelError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// Embeds `ids` as hidden states of shape `[1, T, hidden]`. A head that
    /// fetches rows must hold them already ([`Self::embed_fetching`]).
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.check_ids(ids)?;
        self.embed_tokens.embed(ids, self.dtype, &self.device)
    }

    /// [`Self::embed`], first fetching the rows a fetching head lacks.
    pub async fn embed_fetching(&self, ids: &[u32]) -> Result<Tensor> {
        self.check_ids(ids)?;
        self.embed_tokens.fetch_missing(ids).await?;
        self.embed_tokens.embed(ids, self.dtype, &self.device)
    }

    /// How the embeddings are held: `"dense"`, `"mapped"` or `"fetched"`.
    pub fn embeddings_kind(&self) -> &'static str {
        match *self.embed_tokens {
            TokenEmbeddings::Dense(_) => "dense",
            TokenEmbeddings::Mapped { .. } => "mapped",
            TokenEmbeddings::Fetched { .. } => "fetched",
        }
    }

    /// The final RMSNorm of the last layer's output.
    pub fn final_norm(&self, hidden: &Tensor) -> Result<Tensor> {
        self.norm.forward(&hidden.to_dtype(self.dtype)?)
    }

    /// Logits for every position: `[1, T, hidden]` -> `[1, T, vocab]` in f32.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.pool.run(|| self.logits_here(hidden))
    }

    fn logits_here(&self, hidden: &Tensor) -> Result<Tensor> {
        let normed = self.final_norm(hidden)?;
        Ok(self.lm_head.forward(&normed)?.to_dtype(DType::F32)?)
    }

    /// Logits of the last position only, as a `[vocab]` f32 vector.
    pub fn last_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let t = hidden.dim(1)?;
        let last = hidden.narrow(1, t - 1, 1)?;
        Ok(self.logits(&last)?.flatten_all()?)
    }

    /// Logits of the last `rows` positions as `[rows, vocab]` f32, through
    /// one LM-head product (a draft check needs every row of its step).
    pub fn last_logits_rows(&self, hidden: &Tensor, rows: usize) -> Result<Tensor> {
        let t = hidden.dim(1)?;
        if rows == 0 || rows > t {
            return Err(ModelError::InvalidConfig(format!(
                "logits of the last {rows} rows of a {t}-row hidden state"
            )));
        }
        let last = hidden.narrow(1, t - rows, rows)?;
        Ok(self.logits(&last)?.squeeze(0)?)
    }
}
