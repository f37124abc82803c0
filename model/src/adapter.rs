//! LoRA adapter files: a PEFT folder (`adapter_config.json` and
//! `adapter_model.safetensors`) or a GGUF adapter as llama.cpp's
//! `convert_lora_to_gguf.py` writes it.
//!
//! An [`AdapterFile`] holds every pair of low-rank matrices of the file in
//! f32, in the Hugging Face row layout, with the scale each is applied at;
//! [`crate::BlockSpan::adapter`] takes the layers a span runs and puts them
//! into the span's dtype, device and rotary layout ([`crate::lora`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::file_bytes::FileBytes;
use crate::rope::RopeLayout;

/// PEFT's file names inside an adapter folder.
pub const PEFT_CONFIG: &str = "adapter_config.json";
pub const PEFT_WEIGHTS: &str = "adapter_model.safetensors";

/// The largest rank accepted: adapters in use are 4 to 256; a larger one is
/// more likely a misread file than an adapter.
pub const MAX_RANK: usize = 4096;

/// A projection of a decoder layer that an adapter may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Query,
    Key,
    Value,
    Output,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Query,
        Target::Key,
        Target::Value,
        Target::Output,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module's Hugging Face name inside a layer.
    pub fn hf_module(self) -> &'static str {
        match self {
            Target::Query => "self_attn.q_proj",
            Target::Key => "self_attn.k_proj",
            Target::Value => "self_attn.v_proj",
            Target::Output => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// The tensor's GGUF name inside a block (without `.weight`).
    pub fn gguf_module(self) -> &'static str {
        match self {
            Target::Query => "attn_q",
            Target::Key => "attn_k",
            Target::Value => "attn_v",
            Target::Output => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether the target is part of the feed-forward (absent from a mixture of experts' layers).
    pub fn is_feed_forward(self) -> bool {
        matches!(self, Target::Gate | Target::Up | Target::Down)
    }
}

/// One adapted projection: `y += scale · B (A x)`.
#[derive(Debug, Clone)]
pub struct LowRankPair {
    /// `[rank, in]`.
    pub a: Tensor,
    /// `[out, rank]`.
    pub b: Tensor,
    pub scale: f64,
}

impl LowRankPair {
    pub fn rank(&self) -> usize {
        self.a.dims().first().copied().unwrap_or(0)
    }
}

/// Every adapted projection of an adapter file, by layer and target.
#[derive(Debug, Clone)]
pub struct AdapterFile {
    path: PathBuf,
    pairs: BTreeMap<(usize, Target), LowRankPair>,
    /// How the rows of query and key `B` are laid out in the file.
    layout: RopeLayout,
    /// llama.cpp's architecture name, for a GGUF adapter.
    architecture: Option<String>,
}

/// The part of PEFT's `adapter_config.json` that changes the math.
#[derive(Debug, Deserialize)]
struct PeftConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    alpha_pattern: BTreeMap<String, f64>,
    #[serde(default)]
    rank_pattern: BTreeMap<String, usize>,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    target_parameters: Option<Vec<String>>,
    /// `true`/`false`, or a method name: PiSSA, OLoRA, CorDA and LoftQ
    /// adapters saved unconverted apply to a changed base.
    #[serde(default)]
    init_lora_weights: Option<serde_json::Value>,
    /// Activated LoRA: the adapter applies only after these tokens.
    #[serde(default)]
    alora_invocation_tokens: Option<serde_json::Value>,
    #[serde(default)]
    layer_replication: Option<serde_json::Value>,
}

impl PeftConfig {
    /// Refuses what would change the math in ways Corolla does not compute.
    fn check(&self, path: &Path) -> Result<()> {
        let refuse = |what: &str| Err(ModelError::invalid_file(path, what));
        if self.peft_type.as_deref().is_some_and(|t| t != "LORA") {
            return refuse("not a LoRA adapter (peft_type is not LORA)");
        }
        if self.use_dora {
            return refuse("DoRA adapters (use_dora) are not supported");
        }
        if self.fan_in_fan_out {
            return refuse("fan_in_fan_out (transposed Conv1D weights) is not supported");
        }
        if self.bias.as_deref().is_some_and(|b| b != "none") || self.lora_bias {
            return refuse("adapters with biases are not supported (bias must be \"none\")");
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("modules_to_save (whole replaced modules) is not supported");
        }
        if self
            .target_parameters
            .as_ref()
            .is_some_and(|m| !m.is_empty())
        {
            return refuse("target_parameters (adapted expert weights) is not supported");
        }
        if self.r == 0 || self.r > MAX_RANK {
            return refuse(&format!("rank {} is outside 1..={MAX_RANK}", self.r));
        }
        if let Some(serde_json::Value::String(method)) = &self.init_lora_weights {
            let changed_base = ["pissa", "olora", "corda", "loftq"];
            if changed_base
                .iter()
                .any(|m| method.to_ascii_lowercase().starts_with(m))
            {
                return refuse(&format!(
                    "init_lora_weights {method:?}: such an adapter applies to a changed base model \
                     (convert it to a plain LoRA with PEFT first)"
                ));
            }
        }
        if self
            .alora_invocation_tokens
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return refuse("activated LoRA (alora_invocation_tokens) is not supported");
        }
        if self
            .layer_replication
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return refuse("layer_replication is not supported");
        }
        let keys = self.alpha_pattern.keys().chain(self.rank_pattern.keys());
        if let Some(key) = keys.into_iter().find(|k| !is_module_name(k)) {
            return refuse(&format!(
                "pattern {key:?} is a regular expression; Corolla matches alpha_pattern and \
                 rank_pattern keys as module names only"
            ));
        }
        Ok(())
    }

    /// The value of the pattern matching `module` (PEFT: the key equals the
    /// module's name or ends it after a dot), else `default`. Keys that
    /// match the same module with different values are refused: PEFT takes
    /// the first in the file's order, which a parsed map does not keep.
    fn pattern<T: Copy + PartialEq>(
        patterns: &BTreeMap<String, T>,
        module: &str,
        default: T,
    ) -> std::result::Result<T, String> {
        let mut matching = patterns
            .iter()
            .filter(|(key, _)| module == key.as_str() || module.ends_with(&format!(".{key}")));
        let Some((first, value)) = matching.next() else {
            return Ok(default);
        };
        match matching.find(|(_, other)| *other != value) {
            Some((second, _)) => Err(format!(
                "patterns {first:?} and {second:?} both match {module} with different values"
            )),
            None => Ok(*value),
        }
    }

    /// The scale of `module`'s pair, whose tensors have rank `rank` (what
    /// `rank_pattern` sized them to).
    fn scale(&self, module: &str, rank: usize) -> std::result::Result<f64, String> {
        let alpha = Self::pattern(&self.alpha_pattern, module, self.lora_alpha)?;
        let rank = rank as f64;
        Ok(if self.use_rslora {
            alpha / rank.sqrt()
        } else {
            alpha / rank
        })
    }
}

/// Whether a pattern key is a plain module name (`down_proj`,
/// `mlp.down_proj`, `model.layers.3.mlp.down_proj`), not a regular expression.
fn is_module_name(key: &str) -> bool {
    !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        && !key.contains("..")
}

impl AdapterFile {
    /// Reads a PEFT folder or a GGUF adapter file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::open_peft(path)
        } else {
            Self::open_gguf(path)
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every pair, by layer and target.
    pub fn pairs(&self) -> &BTreeMap<(usize, Target), LowRankPair> {
        &self.pairs
    }

    /// How the rows of query and key `B` are laid out in the file.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// llama.cpp's architecture name of a GGUF adapter; `None` for PEFT's.
    pub fn architecture(&self) -> Option<&str> {
        self.architecture.as_deref()
    }

    /// The largest layer index adapted, if any.
    pub fn last_layer(&self) -> Option<usize> {
        self.pairs.keys().map(|(layer, _)| *layer).max()
    }

    fn open_peft(dir: &Path) -> Result<Self> {
        let config_path = dir.join(PEFT_CONFIG);
        let text = std::fs::read(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
        let config: PeftConfig =
            serde_json::from_slice(&text).map_err(|e| ModelError::invalid_file(&config_path, e))?;
        config.check(&config_path)?;
        let weights_path = dir.join(PEFT_WEIGHTS);
        let bytes = FileBytes::map(&weights_path)?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| ModelError::invalid_file(&weights_path, e))?;
        let mut halves: BTreeMap<(usize, Target), [Option<Tensor>; 2]> = BTreeMap::new();
        for (name, tensor) in tensors {
            let Some((layer, target, side)) = peft_tensor(&name) else {
                return Err(ModelError::invalid_file(
                    &weights_path,
                    format!("{name}: not a LoRA matrix of a decoder layer's projection"),
                ));
            };
            halves.entry((layer, target)).or_default()[side] = Some(tensor);
        }
        let mut pairs = BTreeMap::new();
        for ((layer, target), [a, b]) in halves {
            let module = format!("model.layers.{layer}.{}", target.hf_module());
            let (Some(a), Some(b)) = (a, b) else {
                return Err(ModelError::invalid_file(
                    &weights_path,
                    format!("{module}: lora_A or lora_B is missing"),
                ));
            };
            let rank = checked_rank(&weights_path, &module, &a, &b)?;
            let scale = config
                .scale(&module, rank)
                .map_err(|e| ModelError::invalid_file(&config_path, e))?;
            pairs.insert((layer, target), pair(a, b, scale)?);
        }
        Ok(AdapterFile {
            path: dir.to_path_buf(),
            pairs,
            layout: RopeLayout::Halves,
            architecture: None,
        })
    }

    fn open_gguf(path: &Path) -> Result<Self> {
        let bytes = FileBytes::map(path)?;
        if crate::gguf::has_zero_alignment(&bytes) {
            return Err(ModelError::invalid_file(path, "general.alignment is 0"));
        }
        let mut reader = std::io::Cursor::new(&bytes[..]);
        let content = Content::read(&mut reader).map_err(|e| ModelError::invalid_file(path, e))?;
        let string = |key: &str| match content.metadata.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        if string("general.type").as_deref() != Some("adapter")
            || string("adapter.type").as_deref() != Some("lora")
        {
            return Err(ModelError::invalid_file(
                path,
                "not a LoRA adapter: general.type must be \"adapter\" and adapter.type \"lora\" \
                 (a PEFT adapter is a folder with adapter_config.json)",
            ));
        }
        let alpha = match content.metadata.get("adapter.lora.alpha") {
            Some(Value::F32(v)) => *v as f64,
            Some(Value::F64(v)) => *v,
            _ => 0.0,
        };
        let architecture = string("general.architecture");
        let mut halves: BTreeMap<(usize, Target), [Option<Tensor>; 2]> = BTreeMap::new();
        for name in content.tensor_infos.keys() {
            let Some((layer, target, side)) = gguf_tensor(name) else {
                return Err(ModelError::invalid_file(
                    path,
                    format!("{name}: not a LoRA matrix of a block's projection"),
                ));
            };
            let tensor = content
                .tensor(&mut reader, name, &Device::Cpu)
                .and_then(|t| t.dequantize(&Device::Cpu))
                .map_err(|e| ModelError::invalid_file(path, format!("{name}: {e}")))?;
            halves.entry((layer, target)).or_default()[side] = Some(tensor);
        }
        let mut pairs = BTreeMap::new();
        for ((layer, target), [a, b]) in halves {
            let module = format!("blk.{layer}.{}", target.gguf_module());
            let (Some(a), Some(b)) = (a, b) else {
                return Err(ModelError::invalid_file(
                    path,
                    format!("{module}: lora_a or lora_b is missing"),
                ));
            };
            let rank = checked_rank(path, &module, &a, &b)?;
            // llama.cpp: alpha / rank, or 1 where the file names no alpha.
            let scale = if alpha == 0.0 {
                1.0
            } else {
                alpha / rank as f64
            };
            pairs.insert((layer, target), pair(a, b, scale)?);
        }
        // llama.cpp permutes query and key rows for its `llama` architecture
        // (B's rows are the projection's output rows).
        let layout = match architecture.as_deref() {
            Some("llama") => RopeLayout::Interleaved,
            _ => RopeLayout::Halves,
        };
        Ok(AdapterFile {
            path: path.to_path_buf(),
            pairs,
            layout,
            architecture,
        })
    }
}

fn pair(a: Tensor, b: Tensor, scale: f64) -> Result<LowRankPair> {
    Ok(LowRankPair {
        a: a.to_dtype(DType::F32)?,
        b: b.to_dtype(DType::F32)?,
        scale,
    })
}

/// The rank of `a` (`[rank, in]`) and `b` (`[out, rank]`) if they agree.
fn checked_rank(path: &Path, module: &str, a: &Tensor, b: &Tensor) -> Result<usize> {
    match (a.dims(), b.dims()) {
        ([rank, _], [_, rank_b]) if rank == rank_b && (1..=MAX_RANK).contains(rank) => Ok(*rank),
        (a, b) => Err(ModelError::invalid_file(
            path,
            format!("{module}: A {a:?} and B {b:?} are not [rank, in] and [out, rank]"),
        )),
    }
}

/// `base_model.model.model.layers.N.<module>.lora_{A,B}.weight`: layer,
/// target and side (0 for A).
fn peft_tensor(name: &str) -> Option<(usize, Target, usize)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, side) = rest.rsplit_once(".lora_")?;
    let side = match side {
        "A.weight" => 0,
        "B.weight" => 1,
        _ => return None,
    };
    let target = Target::ALL.into_iter().find(|t| t.hf_module() == module)?;
    Some((layer.parse().ok()?, target, side))
}

/// `blk.N.<tensor>.weight.lora_{a,b}`: layer, target and side (0 for A).
fn gguf_tensor(name: &str) -> Option<(usize, Target, usize)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, side) = rest.rsplit_once(".weight.lora_")?;
    let side = match side {
        "a" => 0,
        "b" => 1,
        _ => return None,
    };
    let target = Target::ALL
        .into_iter()
        .find(|t| t.gguf_module() == module)?;
    Some((layer.parse().ok()?, target, side))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_of_both_formats_parse() {
        assert_eq!(
            peft_tensor("base_model.model.model.layers.12.self_attn.k_proj.lora_B.weight"),
            Some((12, Target::Key, 1))
        );
        assert_eq!(
            peft_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"),
            Some((0, Target::Down, 0))
        );
        assert_eq!(peft_tensor("base_model.model.lm_head.lora_A.weight"), None);
        assert_eq!(
            peft_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector"),
            None
        );
        assert_eq!(
            gguf_tensor("blk.3.attn_output.weight.lora_a"),
            Some((3, Target::Output, 0))
        );
        assert_eq!(
            gguf_tensor("blk.3.ffn_up.weight.lora_b"),
            Some((3, Target::Up, 1))
        );
        assert_eq!(gguf_tensor("token_embd.weight.lora_a"), None);
    }

    #[test]
    fn peft_scales_follow_rslora_and_the_alpha_pattern() {
        let config: PeftConfig = serde_json::from_str(
            r#"{"r": 8, "lora_alpha": 4, "use_rslora": true, "alpha_pattern": {"down_proj": 16}}"#,
        )
        .unwrap();
        let scale = config.scale("model.layers.0.self_attn.q_proj", 8).unwrap();
        assert!((scale - 4.0 / 8f64.sqrt()).abs() < 1e-12);
        let scale = config.scale("model.layers.0.mlp.down_proj", 8).unwrap();
        assert!((scale - 16.0 / 8f64.sqrt()).abs() < 1e-12);
        let plain: PeftConfig = serde_json::from_str(r#"{"r": 4, "lora_alpha": 8}"#).unwrap();
        assert_eq!(plain.scale("model.layers.1.mlp.up_proj", 4), Ok(2.0));
        // Two keys matching one module with different values: PEFT's
        // choice depends on the file's order, so neither is guessed.
        let overlapping: PeftConfig = serde_json::from_str(
            r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"down_proj": 16, "layers.1.mlp.down_proj": 2}}"#,
        )
        .unwrap();
        assert!(overlapping
            .scale("model.layers.1.mlp.down_proj", 4)
            .is_err());
        assert_eq!(
            overlapping.scale("model.layers.2.mlp.down_proj", 4),
            Ok(4.0)
        );
    }

    #[test]
    fn configs_that_change_the_math_otherwise_are_refused() {
        for bad in [
            r#"{"r": 4, "lora_alpha": 8, "use_dora": true}"#,
            r#"{"r": 4, "lora_alpha": 8, "bias": "all"}"#,
            r#"{"r": 4, "lora_alpha": 8, "modules_to_save": ["lm_head"]}"#,
            r#"{"r": 0, "lora_alpha": 8}"#,
            r#"{"r": 4, "lora_alpha": 8, "peft_type": "IA3"}"#,
            r#"{"r": 4, "lora_alpha": 8, "init_lora_weights": "pissa_niter_4"}"#,
            r#"{"r": 4, "lora_alpha": 8, "alora_invocation_tokens": [5, 6]}"#,
            r#"{"r": 4, "lora_alpha": 8, "layer_replication": [[0, 2]]}"#,
            r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj|v_proj": 16}}"#,
            r#"{"r": 4, "lora_alpha": 8, "rank_pattern": {"layers\\.[0-3]\\.q_proj": 8}}"#,
        ] {
            let config: PeftConfig = serde_json::from_str(bad).unwrap();
            assert!(config.check(Path::new("x")).is_err(), "{bad}");
        }
    }
}
