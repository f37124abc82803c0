//! The 70B-class shapes random models are written in (`corolla random-model`):
//! each real model's configuration on a stack of any height.

use crate::config::{ExpertConfig, Family, LlamaConfig, RopeScaling};

/// Llama 3's special tokens start here (`<|begin_of_text|>`).
pub(crate) const LLAMA3_FIRST_SPECIAL: u32 = 128_000;
/// Qwen2's special tokens start here (`<|endoftext|>`).
pub(crate) const QWEN_FIRST_SPECIAL: u32 = 151_643;

/// The model shapes `corolla random-model` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelShape {
    /// Llama 2 70B: hidden 8192, 64/8 heads, FFN 28672, SentencePiece vocabulary of 32000.
    Llama2_70b,
    /// Llama 3.1 70B: as Llama 2 70B with a byte-level vocabulary of 128256,
    /// rope theta 5e5 and llama3 rope scaling.
    Llama3_70b,
    /// Qwen2.5 72B: hidden 8192, 64/8 heads, FFN 29568, vocabulary 152064, QKV biases.
    Qwen25_72b,
    /// Qwen3 32B: hidden 5120, 64/8 heads of 128 (queries 8192 wide, more
    /// than the hidden size), FFN 25600, vocabulary 151936, per-head Q/K norms.
    Qwen3_32b,
    /// Mixtral 8x7B: hidden 4096, 32/8 heads, eight experts of FFN 14336, two per token.
    Mixtral8x7b,
    /// Qwen3-30B-A3B: hidden 2048, 32/4 heads of 128, 128 experts of FFN
    /// 768, eight per token (renormalised), per-head Q/K norms.
    Qwen3_30bA3b,
}

impl ModelShape {
    pub const ALL: [ModelShape; 6] = [
        Self::Llama2_70b,
        Self::Llama3_70b,
        Self::Qwen25_72b,
        Self::Qwen3_32b,
        Self::Mixtral8x7b,
        Self::Qwen3_30bA3b,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama2_70b => "llama-2-70b",
            Self::Llama3_70b => "llama-3-70b",
            Self::Qwen25_72b => "qwen2.5-72b",
            Self::Qwen3_32b => "qwen3-32b",
            Self::Mixtral8x7b => "mixtral-8x7b",
            Self::Qwen3_30bA3b => "qwen3-30b-a3b",
        }
    }

    /// The real model's configuration with `layers` decoder blocks.
    pub fn config(self, layers: usize) -> LlamaConfig {
        let llama = LlamaConfig {
            family: Family::Llama,
            hidden_size: 8192,
            intermediate_size: 28672,
            num_hidden_layers: layers,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            head_dim: 128,
            vocab_size: 32000,
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: false,
            attention_bias: false,
            qkv_bias: false,
            mlp_bias: false,
            qk_norm: false,
            experts: None,
            sliding_window: None,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            torch_dtype: None,
        };
        match self {
            Self::Llama2_70b => llama,
            Self::Llama3_70b => LlamaConfig {
                vocab_size: 128_256,
                max_position_embeddings: 131_072,
                rope_theta: 500_000.0,
                rope_scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                },
                bos_token_id: Some(LLAMA3_FIRST_SPECIAL),
                eos_token_ids: vec![LLAMA3_FIRST_SPECIAL + 1, LLAMA3_FIRST_SPECIAL + 9],
                ..llama
            },
            Self::Qwen25_72b => LlamaConfig {
                family: Family::Qwen2,
                intermediate_size: 29568,
                vocab_size: 152_064,
                max_position_embeddings: 32_768,
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                qkv_bias: true,
                bos_token_id: None,
                eos_token_ids: vec![QWEN_FIRST_SPECIAL, QWEN_FIRST_SPECIAL + 2],
                ..llama
            },
            Self::Qwen3_32b => LlamaConfig {
                family: Family::Qwen3,
                hidden_size: 5120,
                intermediate_size: 25600,
                vocab_size: 151_936,
                max_position_embeddings: 40_960,
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                qk_norm: true,
                bos_token_id: None,
                eos_token_ids: vec![QWEN_FIRST_SPECIAL + 2, QWEN_FIRST_SPECIAL],
                ..llama
            },
            Self::Mixtral8x7b => LlamaConfig {
                family: Family::Mixtral,
                hidden_size: 4096,
                num_attention_heads: 32,
                intermediate_size: 14336,
                max_position_embeddings: 32_768,
                rope_theta: 1_000_000.0,
                experts: Some(ExpertConfig {
                    count: 8,
                    per_token: 2,
                    intermediate_size: 14336,
                    normalize: true,
                }),
                ..llama
            },
            Self::Qwen3_30bA3b => LlamaConfig {
                family: Family::Qwen3Moe,
                hidden_size: 2048,
                num_attention_heads: 32,
                num_key_value_heads: 4,
                intermediate_size: 6144,
                vocab_size: 151_936,
                max_position_embeddings: 40_960,
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                qk_norm: true,
                experts: Some(ExpertConfig {
                    count: 128,
                    per_token: 8,
                    intermediate_size: 768,
                    normalize: true,
                }),
                bos_token_id: None,
                eos_token_ids: vec![QWEN_FIRST_SPECIAL + 2, QWEN_FIRST_SPECIAL],
                ..llama
            },
        }
    }
}

impl std::str::FromStr for ModelShape {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|shape| shape.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
                format!("unknown shape {s:?} (known: {})", names.join(", "))
            })
    }
}
