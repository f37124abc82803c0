//! Llama-family configuration read from a Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

mod experts;
mod rope_scaling;

use experts::experts_of;
pub use experts::{ExpertConfig, MAX_EXPERTS};
use rope_scaling::{parse_rope_scaling, RawRope};

/// How rotary frequencies are rescaled for longer contexts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Every inverse frequency divided by its own factor: GGUF's
    /// `rope_freqs` tensor, which is how llama.cpp stores llama3 scaling.
    Divisors(Vec<f64>),
}

/// The Llama-shaped families Corolla runs: the same decoder, with their
/// own names, biases and rotary layout in GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    Llama,
    /// As Llama, plus sliding-window attention when the config sets one.
    Mistral,
    /// Biases on the Q, K and V projections (not on the output one).
    Qwen2,
    /// No biases; each head's query and key RMS-normalised before the rotation.
    Qwen3,
    /// Mistral's attention with a mixture of experts in place of the MLP
    /// (llama.cpp stores it as `llama` with expert tensors).
    Mixtral,
    /// Qwen3's attention with a mixture of experts in place of the MLP.
    Qwen3Moe,
}

impl Family {
    const ALL: [Family; 6] = [
        Family::Llama,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mixtral,
        Family::Qwen3Moe,
    ];

    /// The transformers class name.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// transformers' `model_type`, which is also llama.cpp's GGUF architecture name.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    pub fn from_architecture(name: &str) -> Option<Family> {
        Self::ALL.into_iter().find(|f| f.architecture() == name)
    }

    pub fn from_model_type(name: &str) -> Option<Family> {
        Self::ALL.into_iter().find(|f| f.model_type() == name)
    }

    /// What an error about an unsupported architecture lists.
    pub fn supported() -> String {
        Self::ALL
            .iter()
            .map(|f| f.architecture())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The validated configuration of a Llama-family model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Biases on all four attention projections (Llama's `attention_bias`).
    pub attention_bias: bool,
    /// Biases on the Q, K and V projections only (Qwen2).
    pub qkv_bias: bool,
    pub mlp_bias: bool,
    /// RMSNorm over each head's query and key before the rotation (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// Every block's MLP is a mixture of experts.
    #[serde(default)]
    pub experts: Option<ExpertConfig>,
    /// Each position attends to at most this many positions (itself
    /// included); `None`: to every earlier one.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the checkpoint was saved in, as transformers names it.
    pub torch_dtype: Option<String>,
}

/// `config.json` as written by transformers 4 and 5.
#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    /// Corolla's own key (what `to_hf_json` writes); Qwen2 implies it.
    qkv_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    sliding_window: Option<usize>,
    /// Qwen2 keeps `sliding_window` in its config but uses it only when this is set.
    use_sliding_window: Option<bool>,
    hidden_act: Option<String>,
    /// Mixtral's name for the expert count (and transformers 5's for Qwen3-MoE).
    num_local_experts: Option<usize>,
    /// Qwen3-MoE's name for it in transformers 4.
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    /// Qwen3-MoE's expert width (Mixtral's experts use `intermediate_size`).
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

fn default_max_positions() -> usize {
    4096
}

fn default_eps() -> f64 {
    1e-6
}

/// The rope type under which `config.json` carries [`RopeScaling::Divisors`]
/// (Corolla's own: transformers has no such type).
const CUSTOM_DIVISORS: &str = "corolla_divisors";

/// The most positions a model may declare (4 Mi; Llama 3.1 has 128 Ki).
pub const MAX_POSITIONS: usize = 1 << 22;

impl LlamaConfig {
    /// Parameters of one decoder block: the four attention projections,
    /// the three MLP projections, their biases where the model has them,
    /// and the two norms.
    pub fn block_parameters(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let q = (self.num_attention_heads * self.head_dim) as u64;
        let kv = (self.num_key_value_heads * self.head_dim) as u64;
        let attention = h * q + 2 * h * kv + q * h;
        let attention_bias = self.attention_bias_parameters();
        let mlp = match &self.experts {
            Some(e) => e.count as u64 * (3 * h * e.intermediate_size as u64 + h),
            None => 3 * h * i,
        };
        let mlp_bias = if self.mlp_bias { 2 * i + h } else { 0 };
        let qk_norm = if self.qk_norm {
            2 * self.head_dim as u64
        } else {
            0
        };
        attention + attention_bias + qk_norm + mlp + mlp_bias + 2 * h
    }

    fn attention_bias_parameters(&self) -> u64 {
        let q = (self.num_attention_heads * self.head_dim) as u64;
        let kv = (self.num_key_value_heads * self.head_dim) as u64;
        match (self.attention_bias, self.qkv_bias) {
            (true, _) => q + 2 * kv + self.hidden_size as u64,
            (false, true) => q + 2 * kv,
            (false, false) => 0,
        }
    }

    /// Whether the Q, K and V projections have biases.
    pub fn has_qkv_bias(&self) -> bool {
        self.attention_bias || self.qkv_bias
    }

    /// Bytes of KV cache one position costs in one block, in `dtype_bytes` per value.
    pub fn cache_bytes_per_token_per_block(&self, dtype_bytes: usize) -> u64 {
        (2 * self.num_key_value_heads * self.head_dim * dtype_bytes) as u64
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::InvalidConfig(msg) => ModelError::invalid_file(path, msg),
            other => other,
        })
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ModelError::InvalidConfig(e.to_string()))?;
        Self::from_raw(raw)
    }

    /// This config as a Hugging Face `config.json` that [`Self::from_json`]
    /// reads back unchanged (what `corolla convert` writes for GGUF sources).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let rope_scaling = match self.rope_scaling {
            RopeScaling::None => serde_json::Value::Null,
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
            RopeScaling::Divisors(ref divisors) => {
                serde_json::json!({"rope_type": CUSTOM_DIVISORS, "divisors": divisors})
            }
        };
        let mut json = serde_json::json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "qkv_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window.is_some(),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "torch_dtype": self.torch_dtype,
        });
        if let (Some(e), Some(map)) = (&self.experts, json.as_object_mut()) {
            map.insert("num_local_experts".into(), e.count.into());
            map.insert("num_experts_per_tok".into(), e.per_token.into());
            map.insert("moe_intermediate_size".into(), e.intermediate_size.into());
            map.insert("norm_topk_prob".into(), e.normalize.into());
        }
        json
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        let family = match (&raw.architectures, &raw.model_type) {
            (Some(archs), _) if !archs.is_empty() => {
                let families: Vec<Option<Family>> =
                    archs.iter().map(|a| Family::from_architecture(a)).collect();
                match families.iter().position(Option::is_none) {
                    Some(bad) => {
                        return Err(ModelError::UnsupportedArchitecture(archs[bad].clone()))
                    }
                    None => families[0].unwrap_or(Family::Llama),
                }
            }
            (_, Some(mt)) => Family::from_model_type(mt)
                .ok_or_else(|| ModelError::UnsupportedArchitecture(mt.clone()))?,
            _ => Family::Llama,
        };
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(ModelError::InvalidConfig(format!(
                    "hidden_act {act:?} is not supported (Llama uses silu)"
                )));
            }
        }
        let invalid = |m: String| Err(ModelError::InvalidConfig(m));
        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return invalid(format!(
                "num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})"
            ));
        }
        if raw.hidden_size == 0
            || raw.intermediate_size == 0
            || raw.vocab_size == 0
            || raw.num_hidden_layers == 0
        {
            return invalid(
                "hidden_size, intermediate_size, vocab_size and num_hidden_layers must be positive"
                    .into(),
            );
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size.is_multiple_of(heads) => raw.hidden_size / heads,
            None => {
                return invalid(format!(
                    "hidden_size {} is not divisible by num_attention_heads {heads}",
                    raw.hidden_size
                ))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return invalid(format!("head_dim {head_dim} must be positive and even"));
        }
        if raw.max_position_embeddings == 0 {
            return invalid("max_position_embeddings must be positive".into());
        }
        // Rotary tables are precomputed for every position: bound them
        // before anything is allocated.
        if raw.max_position_embeddings > MAX_POSITIONS {
            return invalid(format!(
                "max_position_embeddings {} exceeds the supported {MAX_POSITIONS}",
                raw.max_position_embeddings
            ));
        }
        if !(raw.rms_norm_eps.is_finite() && raw.rms_norm_eps > 0.0) {
            return invalid(format!(
                "rms_norm_eps {} must be positive",
                raw.rms_norm_eps
            ));
        }

        // transformers 5 moves rope settings into `rope_parameters`; older
        // configs use top-level `rope_theta` and `rope_scaling`.
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return invalid(format!("rope_theta {rope_theta} must be positive"));
        }
        let rope_scaling = match rope {
            None => RopeScaling::None,
            Some(r) => parse_rope_scaling(r, raw.max_position_embeddings)?,
        };

        // Qwen configs carry a window they do not use unless told to.
        let sliding_window = match family {
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe
                if raw.use_sliding_window != Some(true) =>
            {
                None
            }
            _ if raw.use_sliding_window == Some(false) => None,
            _ => raw.sliding_window,
        };
        if sliding_window == Some(0) {
            return invalid("sliding_window must be positive".into());
        }
        if let RopeScaling::Divisors(d) = &rope_scaling {
            if d.len() != head_dim / 2 {
                return invalid(format!(
                    "{} rope divisors for head_dim {head_dim} (need {})",
                    d.len(),
                    head_dim / 2
                ));
            }
        }
        let experts = experts_of(&raw, family)?;
        let eos_token_ids = match raw.eos_token_id {
            None => Vec::new(),
            Some(OneOrMany::One(id)) => vec![id],
            Some(OneOrMany::Many(ids)) => ids,
        };
        Ok(LlamaConfig {
            family,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: raw.tie_word_embeddings,
            attention_bias: raw.attention_bias,
            qkv_bias: raw.qkv_bias.unwrap_or(family == Family::Qwen2),
            mlp_bias: raw.mlp_bias,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            experts,
            sliding_window,
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
            torch_dtype: raw.dtype.or(raw.torch_dtype),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,
        "intermediate_size":176,"num_hidden_layers":4,"num_attention_heads":4,
        "vocab_size":1024,"rms_norm_eps":1e-5"#;

    fn parse(extra: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json(&format!("{BASE}{extra}}}"))
    }

    #[test]
    fn huge_position_counts_are_refused_before_allocating() {
        let err = parse(r#","max_position_embeddings":1000000000000"#).unwrap_err();
        assert!(err.to_string().contains("exceeds the supported"), "{err}");
    }

    #[test]
    fn defaults_and_gqa() {
        let c = parse(r#","num_key_value_heads":2"#).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.num_key_value_heads, 2);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn rope_theta_from_rope_parameters_wins() {
        let c = parse(
            r#","rope_theta":1.0,"rope_parameters":{"rope_theta":500000.0,"rope_type":"default"}"#,
        )
        .unwrap();
        assert_eq!(c.rope_theta, 500_000.0);
    }

    #[test]
    fn llama3_and_linear_scaling() {
        let c = parse(r#","rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
        assert!(
            matches!(c.rope_scaling, RopeScaling::Llama3 { factor, original_max_position_embeddings: 8192, .. } if factor == 8.0)
        );
        let c = parse(r#","rope_scaling":{"type":"linear","factor":2.0}"#).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        assert!(parse(r#","rope_scaling":{"type":"yarn","factor":2.0}"#).is_err());
    }

    #[test]
    fn eos_list_and_unsupported_arch() {
        let c = parse(r#","eos_token_id":[2,7]"#).unwrap();
        assert_eq!(c.eos_token_ids, vec![2, 7]);
        let err = LlamaConfig::from_json(&format!(
            "{}}}",
            BASE.replace("LlamaForCausalLM", "GPT2LMHeadModel")
        ))
        .unwrap_err();
        assert!(matches!(err, ModelError::UnsupportedArchitecture(a) if a == "GPT2LMHeadModel"));
    }

    #[test]
    fn hf_json_round_trips() {
        for extra in [
            r#","num_key_value_heads":2,"eos_token_id":[2,7],"bos_token_id":1"#,
            r#","rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
            r#","rope_scaling":{"type":"linear","factor":2.0},"tie_word_embeddings":true"#,
        ] {
            let c = parse(extra).unwrap();
            let back = LlamaConfig::from_json(&c.to_hf_json().to_string()).unwrap();
            assert_eq!(back, c);
        }
    }

    #[test]
    fn bad_head_ratio() {
        assert!(parse(r#","num_key_value_heads":4"#).is_ok());
        assert!(parse(r#","num_key_value_heads":3"#).is_err());
    }
}
