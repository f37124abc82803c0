//! Random GGUF models with the real shapes of 70B-class models
//! (`corolla random-model`): a real model's hidden size, heads, FFN,
//! vocabulary, tensor names and quantization on a short stack of layers,
//! with a working tokenizer of the right size, so that one machine can
//! serve a 70B-shaped model whole and the page meets a 70B-sized head.
//!
//! Weights are random quantized blocks whose scales give each matrix the
//! spread of a trained one (about `1/sqrt(inputs)`), so activations stay
//! finite through any number of layers.

use std::collections::{BinaryHeap, HashSet};
use std::path::Path;

use candle_core::quantized::GgmlDType;
use half::f16;

use crate::config::{Family, LlamaConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf::{gguf_name, ROPE_FREQS};
use crate::gguf_writer::{write_gguf, MetaValue, TensorEntry};
use crate::random::SplitMix64;

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
}

impl ModelShape {
    pub const ALL: [ModelShape; 3] = [Self::Llama2_70b, Self::Llama3_70b, Self::Qwen25_72b];

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama2_70b => "llama-2-70b",
            Self::Llama3_70b => "llama-3-70b",
            Self::Qwen25_72b => "qwen2.5-72b",
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

/// The quantization of the weight matrices (norms, biases and rope
/// factors stay float32, as in llama.cpp's files).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightQuant {
    Q4K,
    Q8_0,
    F16,
}

impl WeightQuant {
    pub fn dtype(self) -> GgmlDType {
        match self {
            Self::Q4K => GgmlDType::Q4K,
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
            "q8_0" => Ok(Self::Q8_0),
            "f16" => Ok(Self::F16),
            other => Err(format!(
                "unknown quantization {other:?} (known: q4_k, q8_0, f16)"
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
    let arch = match cfg.family {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
    };
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
        plan.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Fill::Norm,
        ));
        for (name, shape) in [
            ("mlp.gate_proj", [i, h]),
            ("mlp.up_proj", [i, h]),
            ("mlp.down_proj", [h, i]),
        ] {
            let spread = Fill::Spread(1.0 / (shape[1] as f64).sqrt());
            plan.push((format!("{p}.{name}.weight"), shape.to_vec(), spread));
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
        let dtype = if shape.len() == 1 {
            GgmlDType::F32
        } else {
            spec.quant.for_row(shape[1])
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

/// Llama 3's special tokens start here (`<|begin_of_text|>`).
const LLAMA3_FIRST_SPECIAL: u32 = 128_000;
/// Qwen2's special tokens start here (`<|endoftext|>`).
const QWEN_FIRST_SPECIAL: u32 = 151_643;

/// A tokenizer in GGUF's terms: tokens, their types, and the BPE merges
/// (byte-level models) or scores (SentencePiece).
struct Vocabulary {
    model: &'static str,
    pre: Option<&'static str>,
    tokens: Vec<String>,
    types: Vec<i32>,
    scores: Vec<f32>,
    merges: Vec<String>,
}

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

impl Vocabulary {
    fn build(shape: ModelShape, size: usize) -> Result<Self> {
        let too_small = |needed: usize| {
            Err(ModelError::InvalidConfig(format!(
                "a vocabulary of {size} is too small for {} (at least {needed})",
                shape.name()
            )))
        };
        match shape {
            ModelShape::Llama2_70b => {
                let base = 3 + 256;
                if size < base + 96 {
                    return too_small(base + 96);
                }
                let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
                let mut types = vec![2, CONTROL, CONTROL];
                tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
                types.extend([BYTE; 256]);
                let alphabet = spm_alphabet();
                let (grown, _) = grow_pieces(&alphabet, size - base - alphabet.len());
                tokens.extend(alphabet.into_iter().chain(grown));
                types.resize(tokens.len(), NORMAL);
                let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
                Ok(Vocabulary {
                    model: "llama",
                    pre: None,
                    tokens,
                    types,
                    scores,
                    merges: Vec::new(),
                })
            }
            ModelShape::Llama3_70b | ModelShape::Qwen25_72b => {
                let (first_special, specials, pre) = if shape == ModelShape::Llama3_70b {
                    (
                        LLAMA3_FIRST_SPECIAL as usize,
                        llama3_specials(),
                        "llama-bpe",
                    )
                } else {
                    (QWEN_FIRST_SPECIAL as usize, qwen_specials(), "qwen2")
                };
                if size < first_special + specials.len() {
                    return too_small(first_special + specials.len());
                }
                let alphabet = byte_level_alphabet();
                let (grown, merges) = grow_pieces(&alphabet, first_special - alphabet.len());
                let mut tokens: Vec<String> = alphabet.clone();
                tokens.extend(grown);
                let mut types = vec![NORMAL; tokens.len()];
                for (i, special) in specials.iter().enumerate() {
                    tokens.push(special.clone());
                    // Llama 3's reserved tokens are control tokens too;
                    // Qwen's tool-call tags are plain added tokens.
                    types.push(if special.starts_with("<|") {
                        CONTROL
                    } else {
                        USER_DEFINED
                    });
                    debug_assert_eq!(tokens.len(), first_special + i + 1);
                }
                while tokens.len() < size {
                    tokens.push(format!("[PAD{}]", tokens.len()));
                    types.push(UNUSED);
                }
                Ok(Vocabulary {
                    model: "gpt2",
                    pre: Some(pre),
                    tokens,
                    types,
                    scores: Vec::new(),
                    merges,
                })
            }
        }
    }
}

/// GPT-2's printable stand-ins for the 256 byte values, in byte order.
fn byte_level_alphabet() -> Vec<String> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut shifted = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(c).map(String::from).unwrap_or_default()
        })
        .collect()
}

/// SentencePiece's single-character pieces: the word boundary, letters,
/// digits and punctuation.
fn spm_alphabet() -> Vec<String> {
    std::iter::once('\u{2581}')
        .chain('a'..='z')
        .chain('A'..='Z')
        .chain('0'..='9')
        .chain("'.,;:!?-()\"/&%$#@*+=<>[]{}_|~^`\\".chars())
        .map(String::from)
        .collect()
}

/// English letter frequencies (per mille), which order the grown pieces:
/// likely strings first, as a trained vocabulary would have them.
const LETTER_WEIGHTS: [(char, u32); 26] = [
    ('e', 127),
    ('t', 91),
    ('a', 82),
    ('o', 75),
    ('i', 70),
    ('n', 67),
    ('s', 63),
    ('h', 61),
    ('r', 60),
    ('d', 43),
    ('l', 40),
    ('c', 28),
    ('u', 28),
    ('m', 24),
    ('w', 24),
    ('f', 22),
    ('g', 20),
    ('y', 20),
    ('p', 19),
    ('b', 15),
    ('v', 10),
    ('k', 8),
    ('j', 2),
    ('x', 2),
    ('q', 1),
    ('z', 1),
];

/// Grows `count` multi-character pieces over `alphabet`: words of lower-case
/// letters, with and without a leading word boundary (`▁` or GPT-2's `Ġ`),
/// most likely first. Every piece is an earlier piece plus one letter, so
/// the merges (returned as `"left right"`, in order) build each of them.
fn grow_pieces(alphabet: &[String], count: usize) -> (Vec<String>, Vec<String>) {
    /// Highest weight first; among equal weights the alphabetically first piece.
    struct Candidate(f64, std::cmp::Reverse<String>, String);
    impl PartialEq for Candidate {
        fn eq(&self, other: &Self) -> bool {
            self.cmp(other).is_eq()
        }
    }
    impl Eq for Candidate {}
    impl PartialOrd for Candidate {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Candidate {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            self.0
                .total_cmp(&other.0)
                .then_with(|| self.1.cmp(&other.1))
        }
    }
    let boundary = if alphabet.iter().any(|s| s == "\u{2581}") {
        "\u{2581}"
    } else {
        "\u{120}"
    };
    let have: HashSet<&str> = alphabet.iter().map(String::as_str).collect();
    let letters: Vec<(String, f64)> = LETTER_WEIGHTS
        .iter()
        .map(|&(c, w)| (c.to_string(), w as f64 / 1000.0))
        .filter(|(c, _)| have.contains(c.as_str()))
        .collect();
    let mut heap = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<Candidate>, left: &str, weight: f64| {
        for (c, w) in &letters {
            let piece = format!("{left}{c}");
            heap.push(Candidate(
                weight * w,
                std::cmp::Reverse(piece),
                left.to_string(),
            ));
        }
    };
    push(&mut heap, boundary, 0.9);
    for (c, w) in &letters {
        push(&mut heap, c, *w);
    }
    let mut pieces = Vec::with_capacity(count);
    let mut merges = Vec::with_capacity(count);
    let mut seen: HashSet<String> = alphabet.iter().cloned().collect();
    while pieces.len() < count {
        let Some(Candidate(weight, std::cmp::Reverse(piece), left)) = heap.pop() else {
            break;
        };
        if !seen.insert(piece.clone()) {
            continue;
        }
        let right = &piece[left.len()..];
        merges.push(format!("{left} {right}"));
        push(&mut heap, &piece, weight);
        pieces.push(piece);
    }
    (pieces, merges)
}

fn llama3_specials() -> Vec<String> {
    let named = [
        (0, "<|begin_of_text|>"),
        (1, "<|end_of_text|>"),
        (4, "<|finetune_right_pad_id|>"),
        (6, "<|start_header_id|>"),
        (7, "<|end_header_id|>"),
        (8, "<|eom_id|>"),
        (9, "<|eot_id|>"),
        (10, "<|python_tag|>"),
    ];
    let mut reserved = 0;
    (0..256)
        .map(|i| match named.iter().find(|(at, _)| *at == i) {
            Some((_, name)) => name.to_string(),
            None => {
                reserved += 1;
                format!("<|reserved_special_token_{}|>", reserved - 1)
            }
        })
        .collect()
}

fn qwen_specials() -> Vec<String> {
    [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ]
    .map(String::from)
    .to_vec()
}

const LLAMA3_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}";

const QWEN_TEMPLATE: &str = "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}";

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
    let template = match spec.vocabulary {
        ModelShape::Llama2_70b => None,
        ModelShape::Llama3_70b => Some(LLAMA3_TEMPLATE),
        ModelShape::Qwen25_72b => Some(QWEN_TEMPLATE),
    };
    if let Some(t) = template {
        m.push(("tokenizer.chat_template".into(), MetaValue::Str(t.into())));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabularies_have_the_real_sizes_and_build_every_piece() {
        for shape in ModelShape::ALL {
            let size = shape.config(1).vocab_size;
            let v = Vocabulary::build(shape, size).unwrap();
            assert_eq!(v.tokens.len(), size, "{}", shape.name());
            assert_eq!(v.types.len(), size);
            let distinct: HashSet<&String> = v.tokens.iter().collect();
            assert_eq!(distinct.len(), size, "{}: duplicate tokens", shape.name());
            let index: HashSet<&str> = v.tokens.iter().map(String::as_str).collect();
            for merge in &v.merges {
                let (l, r) = merge.split_once(' ').unwrap();
                assert!(index.contains(l) && index.contains(r), "{merge}");
                assert!(index.contains(format!("{l}{r}").as_str()), "{merge}");
            }
        }
    }

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
