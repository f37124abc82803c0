//! Random GGUF models with the real shapes of 70B-class models
//! (`corolla random-model`): a real model's hidden size, heads, FFN,
//! vocabulary, tensor names and quantization on a short stack of layers,
//! with a working tokenizer of the right size, so that one machine can
//! serve a 70B-shaped model whole and the page meets a 70B-sized head.
//!
//! Weights are random quantized blocks whose scales give each matrix the
//! spread of a trained one (about `1/sqrt(inputs)`), so activations stay
//! finite through any number of layers.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use half::f16;

use crate::config::{LlamaConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf::{gguf_name, ROPE_FREQS};
use crate::gguf_writer::{write_gguf, MetaValue, TensorEntry};
pub use crate::model_shape::ModelShape;
use crate::random::SplitMix64;
use crate::random_vocab::{chat_template, Vocabulary};

/// The quantization of the weight matrices (norms, biases and rope
/// factors stay float32, as in llama.cpp's files).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightQuant {
    Q4K,
    /// What the default model (SmolLM2-135M's GGUF) holds.
    Q4_1,
    Q8_0,
    F16,
}

impl WeightQuant {
    pub fn dtype(self) -> GgmlDType {
        match self {
            Self::Q4K => GgmlDType::Q4K,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::F16 => GgmlDType::F16,
        }
    }

    /// The type of a matrix whose rows hold `row` values: k-quants need
    /// whole blocks of 256, and llama.cpp falls back to Q5_0 for Q4_K
    /// (Qwen2.5-72B's FFN of 29568 is such a case).
    fn for_row(self, row: usize) -> GgmlDType {
        let dtype = self.dtype();
        if row.is_multiple_of(dtype.block_size()) {
            dtype
        } else {
            GgmlDType::Q5_0
        }
    }
}

impl std::str::FromStr for WeightQuant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4_k" | "q4k" => Ok(Self::Q4K),
            "q4_1" => Ok(Self::Q4_1),
            "q8_0" => Ok(Self::Q8_0),
            "f16" => Ok(Self::F16),
            other => Err(format!(
                "unknown quantization {other:?} (known: q4_k, q4_1, q8_0, f16)"
            )),
        }
    }
}

/// What to write.
#[derive(Debug, Clone)]
pub struct RandomGguf {
    /// The configuration (any Llama-family one; [`ModelShape::config`] gives the real ones).
    pub config: LlamaConfig,
    /// How the tokenizer is built: for which shape's conventions.
    pub vocabulary: ModelShape,
    pub quant: WeightQuant,
    pub seed: u64,
    /// `general.name`.
    pub name: String,
}

impl RandomGguf {
    pub fn new(shape: ModelShape, layers: usize, quant: WeightQuant, seed: u64) -> Self {
        RandomGguf {
            config: shape.config(layers),
            vocabulary: shape,
            quant,
            seed,
            name: format!("corolla-random-{}-{layers}l", shape.name()),
        }
    }

    /// A "wire-shaped" Llama 2 70B for network tests: what crosses each hop
    /// is a 70B's (`[T, 8192]` activations), while one layer computes in a
    /// few milliseconds on a CPU, about what a GPU server holding several
    /// 70B layers takes (~0.5 ms per layer).
    ///
    /// Kept from 70B: hidden size 8192, head_dim 128, the SentencePiece
    /// vocabulary's conventions. Shrunk, since none of it changes what
    /// crosses the wire: one query and one KV head (64/8 heads would make
    /// attention alone ~150M multiply-adds per token and layer), an FFN of
    /// 64 (28672 would add ~700M), and a vocabulary of 1024 (it stays on
    /// the client; 32000 rows would cost the client ~30 ms per token here).
    /// What is left, ~5.8M weights per layer (6 MB in Q8_0: one decode step
    /// is mostly reading them once), is Q8_0 in the file, which writes and
    /// loads fastest.
    pub fn wire_shaped(layers: usize, seed: u64) -> Self {
        let shape = ModelShape::Llama2_70b;
        RandomGguf {
            config: LlamaConfig {
                num_attention_heads: 1,
                num_key_value_heads: 1,
                intermediate_size: 64,
                vocab_size: 1024,
                ..shape.config(layers)
            },
            vocabulary: shape,
            quant: WeightQuant::Q8_0,
            seed,
            name: format!("corolla-wire-shaped-{}-{layers}l", shape.name()),
        }
    }
}

/// What a tensor's values look like.
#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Zero-mean values of this standard deviation.
    Spread(f64),
    /// Norm weights: `1 + 0.1·N(0, 1)`.
    Norm,
    /// GGUF's rope divisors.
    RopeDivisors,
}

/// Writes the model described by `spec` to `path`. `progress(written, total)`
/// follows the tensor data (bytes).
pub fn write_random_gguf(
    path: &Path,
    spec: &RandomGguf,
    progress: impl FnMut(u64, u64),
) -> Result<()> {
    let cfg = &spec.config;
    let arch = crate::gguf::architecture_of(cfg.family);
    let (tensors, fills) = tensor_plan(spec)?;
    let vocab = Vocabulary::build(spec.vocabulary, cfg.vocab_size)?;
    let metadata = metadata(spec, arch, vocab);
    let mut rng = SplitMix64(spec.seed);
    let divisors = crate::rope::frequency_divisors(cfg);
    write_gguf(
        path,
        &metadata,
        &tensors,
        |i, buf| {
            let tensor = &tensors[i];
            match fills[i] {
                Fill::Spread(std) => random_blocks(tensor, std, &mut rng, buf),
                Fill::Norm => {
                    let n: usize = tensor.shape.iter().product();
                    buf.extend(
                        (0..n).flat_map(|_| (1.0 + 0.1 * rng.normal() as f32).to_le_bytes()),
                    );
                }
                Fill::RopeDivisors => {
                    buf.extend(divisors.iter().flat_map(|d| (*d as f32).to_le_bytes()))
                }
            }
            Ok(())
        },
        progress,
    )
}

fn tensor_plan(spec: &RandomGguf) -> Result<(Vec<TensorEntry>, Vec<Fill>)> {
    let cfg = &spec.config;
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let mut plan: Vec<(String, Vec<usize>, Fill)> = Vec::new();
    // Embeddings of trained models are small; the first norm rescales them.
    plan.push((
        "model.embed_tokens.weight".into(),
        vec![v, h],
        Fill::Spread(0.02),
    ));
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        plan.push((format!("{p}.input_layernorm.weight"), vec![h], Fill::Norm));
        for (name, shape) in [
            ("self_attn.q_proj", [q, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, q]),
        ] {
            let spread = Fill::Spread(1.0 / (shape[1] as f64).sqrt());
            plan.push((format!("{p}.{name}.weight"), shape.to_vec(), spread));
            if cfg.has_qkv_bias() && name != "self_attn.o_proj" {
                plan.push((
                    format!("{p}.{name}.bias"),
                    vec![shape[0]],
                    Fill::Spread(0.02),
                ));
            }
            if cfg.attention_bias && name == "self_attn.o_proj" {
                plan.push((format!("{p}.{name}.bias"), vec![h], Fill::Spread(0.02)));
            }
        }
        if cfg.qk_norm {
            for name in ["self_attn.q_norm", "self_attn.k_norm"] {
                plan.push((format!("{p}.{name}.weight"), vec![cfg.head_dim], Fill::Norm));
            }
        }
        plan.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Fill::Norm,
        ));
        match &cfg.experts {
            None => {
                for (name, shape) in [
                    ("mlp.gate_proj", [i, h]),
                    ("mlp.up_proj", [i, h]),
                    ("mlp.down_proj", [h, i]),
                ] {
                    let spread = Fill::Spread(1.0 / (shape[1] as f64).sqrt());
                    plan.push((format!("{p}.{name}.weight"), shape.to_vec(), spread));
                }
            }
            Some(experts) => {
                // The router (f32 in llama.cpp's files), then each
                // projection of every expert stacked, as llama.cpp stores them.
                let (e, i) = (experts.count, experts.intermediate_size);
                let spread = Fill::Spread(1.0 / (h as f64).sqrt());
                plan.push((format!("{p}.mlp.gate.weight"), vec![e, h], spread));
                for (name, shape) in [
                    ("mlp.experts.gate_proj", [e, i, h]),
                    ("mlp.experts.up_proj", [e, i, h]),
                    ("mlp.experts.down_proj", [e, h, i]),
                ] {
                    let spread = Fill::Spread(1.0 / (shape[2] as f64).sqrt());
                    plan.push((format!("{p}.{name}.weight"), shape.to_vec(), spread));
                }
            }
        }
    }
    plan.push(("model.norm.weight".into(), vec![h], Fill::Norm));
    if !cfg.tie_word_embeddings {
        plan.push((
            "lm_head.weight".into(),
            vec![v, h],
            Fill::Spread(1.0 / (h as f64).sqrt()),
        ));
    }
    let mut tensors = Vec::with_capacity(plan.len() + 1);
    let mut fills = Vec::with_capacity(plan.len() + 1);
    if matches!(
        cfg.rope_scaling,
        RopeScaling::Llama3 { .. } | RopeScaling::Divisors(_)
    ) {
        tensors.push(TensorEntry {
            name: ROPE_FREQS.into(),
            shape: vec![cfg.head_dim / 2],
            dtype: GgmlDType::F32,
        });
        fills.push(Fill::RopeDivisors);
    }
    for (hf, shape, fill) in plan {
        let name = gguf_name(&hf).ok_or_else(|| ModelError::MissingTensor { name: hf.clone() })?;
        let dtype = if shape.len() == 1 || hf.ends_with("mlp.gate.weight") {
            GgmlDType::F32
        } else {
            spec.quant.for_row(shape[shape.len() - 1])
        };
        tensors.push(TensorEntry { name, shape, dtype });
        fills.push(fill);
    }
    Ok((tensors, fills))
}

/// Appends random blocks of `tensor`'s type whose values spread by `std`.
fn random_blocks(tensor: &TensorEntry, std: f64, rng: &mut SplitMix64, buf: &mut Vec<u8>) {
    let n: usize = tensor.shape.iter().product();
    let bytes = |rng: &mut SplitMix64, buf: &mut Vec<u8>, count: usize| {
        buf.extend((0..count.div_ceil(8)).flat_map(|_| rng.next_u64().to_le_bytes()));
        buf.truncate(buf.len() - (count.div_ceil(8) * 8 - count));
    };
    match tensor.dtype {
        GgmlDType::F32 | GgmlDType::F16 => {
            let f32s = tensor.dtype == GgmlDType::F32;
            for _ in 0..n {
                let x = (rng.normal() * std) as f32;
                if f32s {
                    buf.extend(x.to_le_bytes());
                } else {
                    buf.extend(f16::from_f32(x).to_le_bytes());
                }
            }
        }
        GgmlDType::Q8_0 => {
            // 32 signed bytes uniform in -127..=127 (std 73.6) times d.
            let d = f16::from_f64(std / 73.6).to_le_bytes();
            for _ in 0..n / 32 {
                buf.extend(d);
                let start = buf.len();
                bytes(rng, buf, 32);
                for b in &mut buf[start..] {
                    *b = ((*b as i32 % 255) - 127) as i8 as u8;
                }
            }
        }
        GgmlDType::Q5_0 => {
            // 5-bit values uniform in 0..32, minus 16 (std 9.23), times d.
            let d = f16::from_f64(std / 9.23).to_le_bytes();
            for _ in 0..n / 32 {
                buf.extend(d);
                bytes(rng, buf, 4 + 16);
            }
        }
        GgmlDType::Q4_1 => {
            // d·q + m with 4-bit q uniform in 0..16 and m = -7.5·d: zero
            // mean, std d·4.61.
            let d = std / 4.61;
            let (d16, m16) = (f16::from_f64(d), f16::from_f64(-7.5 * d));
            for _ in 0..n / 32 {
                buf.extend(d16.to_le_bytes());
                buf.extend(m16.to_le_bytes());
                bytes(rng, buf, 16);
            }
        }
        GgmlDType::Q4K => {
            // Per sub-block of 32: d·sc·q − dmin·m with 4-bit q. With m = sc
            // and dmin = 7.5·d that is d·sc·(q − 7.5): zero mean, std
            // d·sc·4.61; sub-block scales vary in 16..32.
            let mean_scale = 23.5;
            let d = std / (mean_scale * 4.61);
            let (d16, dmin16) = (f16::from_f64(d), f16::from_f64(7.5 * d));
            for _ in 0..n / 256 {
                buf.extend(d16.to_le_bytes());
                buf.extend(dmin16.to_le_bytes());
                let mut scales = [0u8; 8];
                for s in &mut scales {
                    *s = 16 + (rng.next_u64() % 16) as u8;
                }
                buf.extend(pack_k4_scales(&scales, &scales));
                bytes(rng, buf, 128);
            }
        }
        other => unreachable!("random blocks of {other:?} are never planned"),
    }
}

/// Q4_K's twelve bytes of 6-bit sub-block scales and mins (llama.cpp's
/// `get_scale_min_k4`, inverted).
fn pack_k4_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

fn metadata(spec: &RandomGguf, arch: &str, vocab: Vocabulary) -> Vec<(String, MetaValue)> {
    let cfg = &spec.config;
    let key = |k: &str| format!("{arch}.{k}");
    let mut m = vec![
        (
            "general.architecture".to_string(),
            MetaValue::Str(arch.into()),
        ),
        ("general.name".into(), MetaValue::Str(spec.name.clone())),
        (
            "tokenizer.ggml.model".into(),
            MetaValue::Str(vocab.model.into()),
        ),
    ];
    let sizes = [
        ("context_length", cfg.max_position_embeddings),
        ("embedding_length", cfg.hidden_size),
        ("block_count", cfg.num_hidden_layers),
        ("feed_forward_length", cfg.intermediate_size),
        ("attention.head_count", cfg.num_attention_heads),
        ("attention.head_count_kv", cfg.num_key_value_heads),
        ("attention.key_length", cfg.head_dim),
        ("attention.value_length", cfg.head_dim),
        ("rope.dimension_count", cfg.head_dim),
        ("vocab_size", cfg.vocab_size),
    ];
    m.extend(sizes.map(|(k, v)| (key(k), MetaValue::U32(v as u32))));
    m.push((
        key("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(cfg.rms_norm_eps as f32),
    ));
    m.push((key("rope.freq_base"), MetaValue::F32(cfg.rope_theta as f32)));
    if let RopeScaling::Linear { factor } = cfg.rope_scaling {
        m.push((key("rope.scaling.type"), MetaValue::Str("linear".into())));
        m.push((key("rope.scaling.factor"), MetaValue::F32(factor as f32)));
    }
    if let Some(window) = cfg.sliding_window {
        m.push((
            key("attention.sliding_window"),
            MetaValue::U32(window as u32),
        ));
    }
    if let Some(experts) = &cfg.experts {
        m.push((key("expert_count"), MetaValue::U32(experts.count as u32)));
        m.push((
            key("expert_used_count"),
            MetaValue::U32(experts.per_token as u32),
        ));
        m.push((
            key("expert_feed_forward_length"),
            MetaValue::U32(experts.intermediate_size as u32),
        ));
    }
    if let Some(pre) = vocab.pre {
        m.push(("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())));
    }
    m.push((
        "tokenizer.ggml.tokens".into(),
        MetaValue::Strings(vocab.tokens),
    ));
    m.push((
        "tokenizer.ggml.token_type".into(),
        MetaValue::I32s(vocab.types),
    ));
    if !vocab.scores.is_empty() {
        m.push((
            "tokenizer.ggml.scores".into(),
            MetaValue::F32s(vocab.scores),
        ));
    }
    if !vocab.merges.is_empty() {
        m.push((
            "tokenizer.ggml.merges".into(),
            MetaValue::Strings(vocab.merges),
        ));
    }
    if let Some(bos) = cfg.bos_token_id {
        m.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(bos)));
    }
    m.push((
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(cfg.bos_token_id.is_some()),
    ));
    if let Some(&eos) = cfg.eos_token_ids.first() {
        m.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(eos)));
    }
    if let Some(&eot) = cfg.eos_token_ids.get(1) {
        m.push(("tokenizer.ggml.eot_token_id".into(), MetaValue::U32(eot)));
    }
    if vocab.model == "llama" {
        m.push(("tokenizer.ggml.unknown_token_id".into(), MetaValue::U32(0)));
    }
    if let Some(t) = chat_template(spec.vocabulary) {
        m.push(("tokenizer.chat_template".into(), MetaValue::Str(t.into())));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4k_scales_round_trip() {
        let sc = [16, 17, 30, 31, 20, 63, 1, 45];
        let m = [5, 9, 63, 0, 33, 12, 47, 2];
        let q = pack_k4_scales(&sc, &m);
        for j in 0..8 {
            let (d, min) = if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                (
                    (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                    (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
                )
            };
            assert_eq!((d, min), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn shape_names_parse() {
        for shape in ModelShape::ALL {
            assert_eq!(shape.name().parse::<ModelShape>(), Ok(shape));
        }
        assert!("llama-9"
            .parse::<ModelShape>()
            .unwrap_err()
            .contains("llama-2-70b"));
        assert_eq!("Q4_K".parse::<WeightQuant>(), Ok(WeightQuant::Q4K));
    }
}
