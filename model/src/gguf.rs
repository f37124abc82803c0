//! GGUF files (llama.cpp's format): config, tokenizer metadata and quantized
//! tensors of Llama-family models.
//!
//! Tensors keep their GGUF quantization (Q4_0…Q8_0, k-quants, F16, F32) and
//! are exposed under Hugging Face names, so spans, the client head and the
//! fingerprints treat a GGUF checkpoint like any other. One difference is
//! visible to the math: llama.cpp's converter permutes the rows of each
//! attention head's Q and K weights so that rotary pairs sit next to each
//! other, hence [`crate::rope::RopeLayout::Interleaved`] for GGUF weights.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::Device;

use crate::config::{Family, LlamaConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::file_bytes::FileBytes;

/// llama.cpp's per-frequency rope divisors.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The first bytes of every GGUF file.
pub const MAGIC: &[u8; 4] = b"GGUF";

/// Hugging Face name suffixes inside a layer and their GGUF counterparts.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    // A mixture of experts: the router, and each projection of every
    // expert stacked in one `[experts, rows, columns]` tensor.
    ("mlp.gate", "ffn_gate_inp"),
    ("mlp.experts.gate_proj", "ffn_gate_exps"),
    ("mlp.experts.up_proj", "ffn_up_exps"),
    ("mlp.experts.down_proj", "ffn_down_exps"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Tensors outside the layers.
const TOP_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens", "token_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
];

fn split_param(name: &str) -> Option<(&str, &str)> {
    name.rsplit_once('.')
        .filter(|(_, p)| *p == "weight" || *p == "bias")
}

/// The GGUF name of a Hugging Face tensor name, if it has one.
pub fn gguf_name(hf: &str) -> Option<String> {
    let (module, param) = split_param(hf)?;
    if let Some((_, g)) = TOP_NAMES.iter().find(|(h, _)| *h == module) {
        return Some(format!("{g}.{param}"));
    }
    let rest = module.strip_prefix("model.layers.")?;
    let (layer, inner) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, g) = LAYER_NAMES.iter().find(|(h, _)| *h == inner)?;
    Some(format!("blk.{layer}.{g}.{param}"))
}

/// The Hugging Face name of a GGUF tensor name, if it is one Corolla uses.
pub fn hf_name(gguf: &str) -> Option<String> {
    let (module, param) = split_param(gguf)?;
    if let Some((h, _)) = TOP_NAMES.iter().find(|(_, g)| *g == module) {
        return Some(format!("{h}.{param}"));
    }
    let rest = module.strip_prefix("blk.")?;
    let (layer, inner) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (h, _) = LAYER_NAMES.iter().find(|(_, g)| *g == inner)?;
    Some(format!("model.layers.{layer}.{h}.{param}"))
}

/// llama.cpp's `general.architecture` for a family: Mistral and Mixtral
/// files are `llama` ones (with a window key, with expert tensors).
pub fn architecture_of(family: Family) -> &'static str {
    match family {
        Family::Llama | Family::Mistral | Family::Mixtral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Qwen3Moe => "qwen3moe",
    }
}

/// Whether `path` starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == MAGIC
}

/// One tensor inside a mapped GGUF file.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub gguf_name: String,
    pub dtype: GgmlDType,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub range: (usize, usize),
}

/// A memory-mapped GGUF file with its parsed header.
pub struct GgufFile {
    path: PathBuf,
    mmap: FileBytes,
    metadata: HashMap<String, Value>,
    /// Keyed by Hugging Face name; tensors Corolla does not use are left out.
    tensors: HashMap<String, GgufTensorInfo>,
    /// llama.cpp's per-frequency rope divisors (llama3 scaling), if present.
    rope_freqs: Option<GgufTensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Whether the header sets `general.alignment` to 0, which candle's reader
/// divides by (a panic on a malformed file, found by `fuzz/gguf`): the key's
/// bytes, then an integer type tag and a zero.
/// Only the metadata at the file's start is looked at (a 70B file's tensor
/// data is tens of GB): the first 64 MiB, more than any tokenizer's metadata.
pub(crate) fn has_zero_alignment(bytes: &[u8]) -> bool {
    const KEY: &[u8] = b"general.alignment";
    const METADATA_SCANNED: usize = 64 << 20;
    bytes[..bytes.len().min(METADATA_SCANNED)]
        .windows(KEY.len())
        .enumerate()
        .filter(|(_, w)| *w == KEY)
        .any(|(at, _)| {
            let rest = &bytes[at + KEY.len()..];
            let Some((tag, value)) = rest.split_first_chunk::<4>() else {
                return false;
            };
            // GGUF's integer types: u8, i8, u16, i16, u32, i32 (0..=5).
            let width = match u32::from_le_bytes(*tag) {
                0 | 1 => 1,
                2 | 3 => 2,
                4 | 5 => 4,
                _ => return false,
            };
            value
                .get(..width)
                .is_some_and(|v| v.iter().all(|b| *b == 0))
        })
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_bytes(path, FileBytes::map(path)?)
    }

    /// Parses a GGUF file held in memory (or mapped); `path` names it in errors.
    pub fn from_bytes(path: &Path, mmap: FileBytes) -> Result<Self> {
        if has_zero_alignment(&mmap) {
            return Err(ModelError::invalid_file(path, "general.alignment is 0"));
        }
        let content = Content::read(&mut std::io::Cursor::new(&mmap[..]))
            .map_err(|e| ModelError::invalid_file(path, e))?;
        let mut tensors = HashMap::new();
        let mut rope_freqs = None;
        for (name, info) in &content.tensor_infos {
            let hf = hf_name(name);
            if hf.is_none() && name != ROPE_FREQS {
                tracing::debug!(tensor = %name, "ignoring a GGUF tensor Corolla does not use");
                continue;
            }
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            if elems % block != 0 {
                return Err(ModelError::invalid_file(
                    path,
                    format!("{name}: {elems} elements are not whole blocks of {block}"),
                ));
            }
            let len = elems / block * info.ggml_dtype.type_size();
            let start = usize::try_from(content.tensor_data_offset.saturating_add(info.offset))
                .unwrap_or(usize::MAX);
            let end = start.saturating_add(len);
            if end > mmap.len() {
                return Err(ModelError::invalid_file(
                    path,
                    format!("{name} ends at byte {end}, past the end of the file"),
                ));
            }
            let tensor = GgufTensorInfo {
                gguf_name: name.clone(),
                dtype: info.ggml_dtype,
                shape: info.shape.dims().to_vec(),
                range: (start, end),
            };
            match hf {
                Some(hf) => {
                    tensors.insert(hf, tensor);
                }
                None => rope_freqs = Some(tensor),
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            rope_freqs,
            metadata: content.metadata,
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    /// Tensors by Hugging Face name.
    pub fn tensors(&self) -> &HashMap<String, GgufTensorInfo> {
        &self.tensors
    }

    pub(crate) fn mapped_bytes(&self) -> &[u8] {
        &self.mmap
    }

    pub fn bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.mmap[info.range.0..info.range.1]
    }

    /// The tensor `hf` (a Hugging Face name) in its stored quantization.
    pub fn qtensor(&self, hf: &str, device: &Device) -> Result<QTensor> {
        let info = self
            .tensors
            .get(hf)
            .ok_or_else(|| ModelError::MissingTensor { name: hf.into() })?;
        qtensor_from_ggml(info.dtype, self.bytes(info), info.shape.clone(), device)
            .map_err(|e| ModelError::invalid_file(&self.path, format!("{}: {e}", info.gguf_name)))
    }

    /// Matrix `index` of the stacked tensor `hf` (`[count, rows, columns]`,
    /// such as one expert's projection), in its stored quantization: the
    /// bytes of one matrix, since quantized blocks never cross rows.
    pub fn qtensor_part(&self, hf: &str, index: usize, device: &Device) -> Result<QTensor> {
        let info = self
            .tensors
            .get(hf)
            .ok_or_else(|| ModelError::MissingTensor { name: hf.into() })?;
        let [count, rows, columns] = info.shape[..] else {
            return Err(self.invalid(format!("{}: not a stack of matrices", info.gguf_name)));
        };
        let bytes = self.bytes(info);
        if index >= count || !bytes.len().is_multiple_of(count) {
            return Err(self.invalid(format!(
                "{}: matrix {index} of {count} in {} bytes",
                info.gguf_name,
                bytes.len()
            )));
        }
        let part = bytes.len() / count;
        qtensor_from_ggml(
            info.dtype,
            &bytes[index * part..][..part],
            vec![rows, columns],
            device,
        )
        .map_err(|e| self.invalid(format!("{}: {e}", info.gguf_name)))
    }

    fn invalid(&self, msg: impl std::fmt::Display) -> ModelError {
        ModelError::invalid_file(&self.path, msg.to_string())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn string(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    /// An integer entry of any width, if it is a non-negative integer.
    pub fn uint(&self, key: &str) -> Option<u64> {
        self.metadata.get(key).and_then(value_as_u64)
    }

    pub fn float(&self, key: &str) -> Option<f64> {
        match self.metadata.get(key)? {
            Value::F32(v) => Some(*v as f64),
            Value::F64(v) => Some(*v),
            other => value_as_u64(other).map(|v| v as f64),
        }
    }

    pub fn bool(&self, key: &str) -> Option<bool> {
        match self.metadata.get(key)? {
            Value::Bool(b) => Some(*b),
            other => value_as_u64(other).map(|v| v != 0),
        }
    }

    fn required_uint(&self, key: &str) -> Result<usize> {
        self.uint(key)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| self.invalid(format!("metadata {key} is missing or not an integer")))
    }

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

    /// The tokenizer stored in the metadata, if any.
    pub fn tokenizer(&self) -> Result<Option<GgufTokenizer>> {
        let Some(model) = self.string("tokenizer.ggml.model") else {
            return Ok(None);
        };
        let strings = |key: &str| -> Result<Vec<String>> {
            match self.metadata.get(key) {
                None => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s.clone()),
                        _ => Err(self.invalid(format!("{key} holds a non-string"))),
                    })
                    .collect(),
                Some(_) => Err(self.invalid(format!("{key} is not an array"))),
            }
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(self.invalid("tokenizer.ggml.tokens is empty"));
        }
        let numbers = |key: &str| -> Result<Vec<f64>> {
            match self.metadata.get(key) {
                None => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::F32(x) => Ok(*x as f64),
                        Value::F64(x) => Ok(*x),
                        Value::I32(x) => Ok(*x as f64),
                        other => value_as_u64(other)
                            .map(|x| x as f64)
                            .ok_or_else(|| self.invalid(format!("{key} holds a non-number"))),
                    })
                    .collect(),
                Some(_) => Err(self.invalid(format!("{key} is not an array"))),
            }
        };
        let scores: Vec<f32> = numbers("tokenizer.ggml.scores")?
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let token_types: Vec<i32> = numbers("tokenizer.ggml.token_type")?
            .into_iter()
            .map(|x| x as i32)
            .collect();
        for (key, len) in [
            ("tokenizer.ggml.scores", scores.len()),
            ("tokenizer.ggml.token_type", token_types.len()),
        ] {
            if len != 0 && len != tokens.len() {
                return Err(self.invalid(format!(
                    "{key} has {len} entries for {} tokens",
                    tokens.len()
                )));
            }
        }
        let id = |key: &str| {
            self.uint(key)
                .and_then(|v| u32::try_from(v).ok())
                .filter(|&v| (v as usize) < tokens.len())
        };
        Ok(Some(GgufTokenizer {
            model: model.to_string(),
            pre: self.string("tokenizer.ggml.pre").map(str::to_string),
            merges: strings("tokenizer.ggml.merges")?,
            scores,
            token_types,
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_id: id("tokenizer.ggml.eos_token_id"),
            unknown_token_id: id("tokenizer.ggml.unknown_token_id"),
            add_bos_token: self.bool("tokenizer.ggml.add_bos_token"),
            add_space_prefix: self.bool("tokenizer.ggml.add_space_prefix"),
            tokens,
        }))
    }

    pub fn chat_template(&self) -> Option<String> {
        self.string("tokenizer.chat_template").map(str::to_string)
    }
}

fn value_as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(x as u64),
        Value::U16(x) => Some(x as u64),
        Value::U32(x) => Some(x as u64),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

/// A tokenizer as GGUF metadata describes it; the client turns it into a
/// `tokenizers::Tokenizer`.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTokenizer {
    /// `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE with byte fallback).
    pub model: String,
    /// The pre-tokenizer llama.cpp names for `gpt2` models (`smollm`, `llama-bpe`, …).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Vec<i32>,
    pub scores: Vec<f32>,
    /// `"left right"` pairs, highest priority first.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

impl GgufTokenizer {
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const BYTE: i32 = 6;
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_zero_alignment_is_refused_before_candle_divides_by_it() {
        let crash = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/gguf_zero_alignment.bin"
        ))
        .unwrap();
        assert!(super::has_zero_alignment(&crash));
        let err = super::GgufFile::from_bytes(
            std::path::Path::new("crash.gguf"),
            super::FileBytes::Owned(crash),
        )
        .unwrap_err();
        assert!(err.to_string().contains("general.alignment is 0"), "{err}");
    }

    use super::*;

    #[test]
    fn names_map_both_ways() {
        for hf in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.29.mlp.down_proj.weight",
            "model.layers.3.self_attn.o_proj.bias",
            "model.layers.7.post_attention_layernorm.weight",
        ] {
            let g = gguf_name(hf).unwrap();
            assert_eq!(hf_name(&g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(
            gguf_name("model.layers.12.self_attn.k_proj.weight").as_deref(),
            Some("blk.12.attn_k.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(gguf_name("model.layers.1.unknown.weight"), None);
    }
}
