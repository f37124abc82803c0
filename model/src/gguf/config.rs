//! A GGUF file's model configuration: the `<architecture>.*` metadata and
//! llama.cpp's rope divisors, as a [`LlamaConfig`].

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

use crate::config::{Family, LlamaConfig, RopeScaling};
use crate::error::{ModelError, Result};

use super::GgufFile;

impl GgufFile {
    /// The model's configuration, from the `<architecture>.*` metadata
    /// (`llama`, `qwen2` and `qwen3`; llama.cpp stores Mistral models as `llama`).
    pub fn config(&self) -> Result<LlamaConfig> {
        let arch = self.string("general.architecture").unwrap_or("");
        let key = |name: &str| format!("{arch}.{name}");
        let experts = self.uint(&key("expert_count")).unwrap_or(0);
        let family = match arch {
            "llama" if experts > 0 => Family::Mixtral,
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "qwen3moe" => Family::Qwen3Moe,
            other => {
                return Err(ModelError::UnsupportedArchitecture(format!(
                    "GGUF architecture {other:?} (supported: llama, qwen2, qwen3, qwen3moe)"
                )))
            }
        };
        let hidden = self.required_uint(&key("embedding_length"))?;
        let heads = self.required_uint(&key("attention.head_count"))?;
        let kv_heads = self
            .uint(&key("attention.head_count_kv"))
            .map_or(Ok(heads), |v| {
                usize::try_from(v).map_err(|_| self.invalid("head_count_kv is too large"))
            })?;
        let vocab = match self.uint(&key("vocab_size")) {
            Some(v) => usize::try_from(v).map_err(|_| self.invalid("vocab_size is too large"))?,
            None => match self.metadata.get("tokenizer.ggml.tokens") {
                Some(Value::Array(tokens)) => tokens.len(),
                _ => return Err(self.invalid("neither a vocab_size nor a token list")),
            },
        };
        let mut rope_scaling = match self.string(&key("rope.scaling.type")) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: self
                    .float(&key("rope.scaling.factor"))
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| self.invalid("linear rope scaling without a factor"))?,
            },
            Some(other) => {
                return Err(ModelError::InvalidConfig(format!(
                    "GGUF rope scaling {other:?} is not supported (supported: none, linear)"
                )))
            }
        };
        if let Some(divisors) = self.rope_divisors()? {
            if rope_scaling != RopeScaling::None {
                return Err(self.invalid("both rope_freqs and a rope scaling type"));
            }
            rope_scaling = RopeScaling::Divisors(divisors);
        }
        let eos: Vec<u32> = self
            .uint("tokenizer.ggml.eos_token_id")
            .and_then(|v| u32::try_from(v).ok())
            .into_iter()
            .chain(self.eot_token_id())
            .collect();
        let mut json = serde_json::json!({
            "architectures": [family.architecture()],
            "hidden_size": hidden,
            "intermediate_size": self.required_uint(&key("feed_forward_length"))?,
            "num_hidden_layers": self.required_uint(&key("block_count"))?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": self.uint(&key("attention.key_length")).unwrap_or((hidden / heads.max(1)) as u64),
            "vocab_size": vocab,
            "max_position_embeddings": self.uint(&key("context_length")).unwrap_or(4096),
            "rms_norm_eps": self.float(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            "rope_theta": self.float(&key("rope.freq_base")).unwrap_or(10_000.0),
            "tie_word_embeddings": !self.tensors.contains_key(crate::tensor_names::LM_HEAD),
            "bos_token_id": self.uint("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos,
            "sliding_window": self.uint(&key("attention.sliding_window")),
        });
        if let (true, Some(map)) = (experts > 0, json.as_object_mut()) {
            map.insert("num_local_experts".into(), experts.into());
            map.insert(
                "num_experts_per_tok".into(),
                self.uint(&key("expert_used_count")).into(),
            );
            if let Some(width) = self.uint(&key("expert_feed_forward_length")) {
                map.insert("moe_intermediate_size".into(), width.into());
            }
            // llama.cpp always renormalises the chosen experts' weights for
            // these two (Qwen3-MoE's released models set norm_topk_prob).
            map.insert("norm_topk_prob".into(), true.into());
        }
        let mut cfg = LlamaConfig::from_json(&json.to_string())
            .map_err(|e| self.invalid(format!("metadata: {e}")))?;
        if let RopeScaling::Divisors(d) = &rope_scaling {
            if d.len() != cfg.head_dim / 2 {
                return Err(self.invalid(format!(
                    "rope_freqs has {} values for head_dim {}",
                    d.len(),
                    cfg.head_dim
                )));
            }
        }
        cfg.rope_scaling = rope_scaling;
        Ok(cfg)
    }

    /// llama.cpp's end-of-turn token (`<|eot_id|>`, `<|im_end|>`), also a
    /// place to stop, when it differs from the end-of-sequence one.
    fn eot_token_id(&self) -> Option<u32> {
        let eot = self
            .uint("tokenizer.ggml.eot_token_id")
            .and_then(|v| u32::try_from(v).ok())?;
        (Some(eot as u64) != self.uint("tokenizer.ggml.eos_token_id")).then_some(eot)
    }

    /// The `rope_freqs` tensor (one divisor per rotary frequency), if present.
    fn rope_divisors(&self) -> Result<Option<Vec<f64>>> {
        let Some(info) = &self.rope_freqs else {
            return Ok(None);
        };
        if info.dtype != GgmlDType::F32 || info.shape.len() != 1 {
            return Err(self.invalid("rope_freqs must be a float32 vector"));
        }
        let bytes = &self.mmap[info.range.0..info.range.1];
        let divisors: Vec<f64> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect();
        if divisors.iter().any(|d| !(d.is_finite() && *d > 0.0)) {
            return Err(self.invalid("rope_freqs holds a divisor that is not positive"));
        }
        Ok(Some(divisors))
    }
}
