//! A checkpoint on disk and lazy, memory-mapped access to its tensors.
//!
//! Four layouts are understood, detected in this order:
//! 0. a single GGUF file (llama.cpp's format, quantized or not);
//! 1. `corolla-index.json`, written by [`crate::convert::convert`]: per-span
//!    block files (safetensors or GGUF) plus a client part;
//! 2. `model.safetensors.index.json` with sharded `*.safetensors` files;
//! 3. a single `model.safetensors`.
//!
//! Files are opened and mapped only when one of their tensors is first
//! requested, so a server hosting a few layers never touches (or needs to
//! have downloaded) the files of the others. A browser's downloaded client
//! part is a checkpoint too ([`Checkpoint::from_memory`]). One file's bytes
//! and index are [`crate::weight_file`]'s business; loading one tensor is
//! `checkpoint/tensors.rs`'s, the tokenizer and chat template
//! `checkpoint/client_files.rs`'s.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::file_bytes::FileBytes;
use crate::gguf::GgufFile;
use crate::rope::RopeLayout;
use crate::weight_file::WeightFile;
pub use crate::weight_file::{RawDType, RawTensor};

mod client_files;
mod quantized_weights;
mod tensors;
mod weights;

pub use client_files::TokenizerSource;

pub use quantized_weights::QuantizedWeights;
pub use weights::Weights;

pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const SHARDED_INDEX: &str = "model.safetensors.index.json";
pub const COROLLA_INDEX: &str = "corolla-index.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// `corolla-index.json`: which file holds which blocks, and every tensor's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorollaIndex {
    pub format: String,
    pub version: u32,
    pub num_layers: usize,
    /// The file with embeddings, final norm and LM head.
    pub client: String,
    pub spans: Vec<SpanFile>,
    pub weight_map: BTreeMap<String, String>,
    /// The source checkpoint's fingerprint (see [`crate::fingerprint`]).
    #[serde(default)]
    pub fingerprint: Option<String>,
    /// The source model's default name in the DHT.
    #[serde(default)]
    pub model_name: Option<String>,
    /// Per-block hashes of the source (see [`crate::fingerprint`]).
    #[serde(default)]
    pub block_hashes: Option<Vec<String>>,
}

impl CorollaIndex {
    pub const FORMAT: &'static str = "corolla-blocks";
    pub const VERSION: u32 = 1;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpanFile {
    pub start: usize,
    pub end: usize,
    pub file: String,
}

#[derive(Debug, Deserialize)]
struct ShardedIndex {
    weight_map: HashMap<String, String>,
}

/// A model folder or GGUF file: its config, where each tensor lives, and
/// lazily opened files.
pub struct Checkpoint {
    dir: PathBuf,
    /// The GGUF file itself, when the checkpoint is one file.
    single_file: Option<PathBuf>,
    config: LlamaConfig,
    weight_map: HashMap<String, String>,
    corolla_index: Option<CorollaIndex>,
    files: Mutex<HashMap<String, Arc<WeightFile>>>,
    /// Turn quantized weights into dense ones at load (the compute dtype).
    dequantize: bool,
    /// Side files (tokenizer, tokenizer config) of a checkpoint held in memory.
    side_files: Option<HashMap<String, Vec<u8>>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("tensors", &self.weight_map.len())
            .finish()
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::invalid_file(path, e))
}

impl Checkpoint {
    /// Opens a model folder (any of the layouts above) or a single GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_file() {
            return Self::open_gguf(path);
        }
        let dir = path.to_path_buf();
        let config = LlamaConfig::from_file(&dir.join(CONFIG_FILE))?;
        let mut files = HashMap::new();
        let (weight_map, corolla_index) = if dir.join(COROLLA_INDEX).is_file() {
            let path = dir.join(COROLLA_INDEX);
            let index: CorollaIndex = read_json(&path)?;
            if index.format != CorollaIndex::FORMAT || index.version != CorollaIndex::VERSION {
                return Err(ModelError::invalid_file(
                    path,
                    format!(
                        "format {:?} version {} is not {:?} version {}",
                        index.format,
                        index.version,
                        CorollaIndex::FORMAT,
                        CorollaIndex::VERSION
                    ),
                ));
            }
            let map = index.weight_map.clone().into_iter().collect();
            (map, Some(index))
        } else if dir.join(SHARDED_INDEX).is_file() {
            let index: ShardedIndex = read_json(&dir.join(SHARDED_INDEX))?;
            (index.weight_map, None)
        } else if dir.join(SINGLE_FILE).is_file() {
            let file = WeightFile::open(&dir.join(SINGLE_FILE))?;
            let map = file
                .tensor_names()
                .into_iter()
                .map(|name| (name, SINGLE_FILE.to_string()))
                .collect();
            files.insert(SINGLE_FILE.to_string(), Arc::new(file));
            (map, None)
        } else {
            return Err(ModelError::NoWeights(dir));
        };
        for file in weight_map.values() {
            if Path::new(file).components().count() != 1 || file.starts_with('.') {
                return Err(ModelError::invalid_file(
                    &dir,
                    format!(
                        "weight file name {file:?} must be a plain file name in the model folder"
                    ),
                ));
            }
        }
        Ok(Checkpoint {
            dir,
            single_file: None,
            config,
            weight_map,
            corolla_index,
            files: Mutex::new(files),
            dequantize: false,
            side_files: None,
        })
    }

    fn open_gguf(path: &Path) -> Result<Self> {
        if !crate::gguf::is_gguf(path) {
            return Err(ModelError::invalid_file(
                path,
                "not a GGUF file; pass a GGUF file or a model folder",
            ));
        }
        let file = GgufFile::open(path)?;
        let config = file.config()?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let weight_map = file
            .tensors()
            .keys()
            .map(|t| (t.clone(), name.clone()))
            .collect();
        let dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let files = HashMap::from([(name, Arc::new(WeightFile::Gguf(file)))]);
        Ok(Checkpoint {
            dir,
            single_file: Some(path.to_path_buf()),
            config,
            weight_map,
            corolla_index: None,
            files: Mutex::new(files),
            dequantize: false,
            side_files: None,
        })
    }

    /// A model folder held in memory, as a browser downloads a server's
    /// client part: `config.json`, weight files (`*.safetensors`, `*.gguf`)
    /// and side files such as `tokenizer.json`, by file name.
    pub fn from_memory(files: impl IntoIterator<Item = (String, Vec<u8>)>) -> Result<Self> {
        let dir = PathBuf::from("(downloaded model)");
        let mut weight_files = HashMap::new();
        let mut weight_map = HashMap::new();
        let mut side_files = HashMap::new();
        for (name, bytes) in files {
            if name.ends_with(".safetensors") || name.ends_with(".gguf") {
                let file = WeightFile::from_bytes(&dir.join(&name), FileBytes::Owned(bytes))?;
                for tensor in file.tensor_names() {
                    weight_map.insert(tensor, name.clone());
                }
                weight_files.insert(name, Arc::new(file));
            } else {
                side_files.insert(name, bytes);
            }
        }
        if weight_files.is_empty() {
            return Err(ModelError::NoWeights(dir));
        }
        let config = side_files
            .get(CONFIG_FILE)
            .ok_or_else(|| ModelError::invalid_file(&dir, "no config.json"))?;
        let config =
            LlamaConfig::from_json(&String::from_utf8_lossy(config)).map_err(|e| match e {
                ModelError::InvalidConfig(msg) => {
                    ModelError::invalid_file(dir.join(CONFIG_FILE), msg)
                }
                other => other,
            })?;
        Ok(Checkpoint {
            dir,
            single_file: None,
            config,
            weight_map,
            corolla_index: None,
            files: Mutex::new(weight_files),
            dequantize: false,
            side_files: Some(side_files),
        })
    }

    /// Loads quantized weights as dense tensors of the compute dtype: more
    /// memory, float-exact math.
    pub fn with_dequantize(mut self, dequantize: bool) -> Self {
        self.dequantize = dequantize;
        self
    }

    /// Applies a [`QuantizedWeights`] choice.
    pub fn with_quantized_weights(self, choice: QuantizedWeights) -> Self {
        self.with_dequantize(choice.dequantizes())
    }

    /// Whether quantized weights are loaded dense.
    pub fn dequantizes(&self) -> bool {
        self.dequantize
    }

    /// The folder holding the checkpoint (a GGUF file's parent folder).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The GGUF file, when the checkpoint is a single file.
    pub fn single_file(&self) -> Option<&Path> {
        self.single_file.as_deref()
    }

    /// Whether the weights come from GGUF files.
    pub fn is_gguf(&self) -> bool {
        self.weight_map.values().any(|f| f.ends_with(".gguf"))
    }

    /// How Q and K rows are laid out for rotary embeddings.
    pub fn rope_layout(&self) -> RopeLayout {
        // llama.cpp permutes Q and K only for its `llama` architecture
        // (which Mistral and Mixtral files use too).
        if self.is_gguf() && crate::gguf::architecture_of(self.config.family) == "llama" {
            RopeLayout::Interleaved
        } else {
            RopeLayout::Halves
        }
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The block layout, when this is a `corolla convert` output.
    pub fn corolla_index(&self) -> Option<&CorollaIndex> {
        self.corolla_index.as_ref()
    }

    /// The memory a block takes once loaded, averaged over the model's
    /// blocks: quantized tensors kept at their stored size, the others in
    /// `dtype`. `None` when some block's weights are not here (a server of
    /// a repo downloads only its own blocks).
    pub fn loaded_block_bytes(&self, dtype: DType) -> Option<u64> {
        let layers = self.config.num_hidden_layers as u64;
        let mut total = 0u64;
        for name in self
            .weight_map
            .keys()
            .filter(|n| n.starts_with("model.layers."))
        {
            let raw = self.raw_tensor(name).ok()?;
            total += if raw.dtype.is_quantized() && !self.dequantize {
                raw.data().len() as u64
            } else {
                raw.shape.iter().product::<usize>() as u64 * dtype.size_in_bytes() as u64
            };
        }
        Some(total / layers.max(1))
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.weight_map.keys().map(String::as_str)
    }

    /// The weight files holding the tensors of layers `[start, end)`.
    pub fn files_for_layers(&self, start: usize, end: usize) -> std::collections::BTreeSet<String> {
        self.weight_map
            .iter()
            .filter(|(name, _)| {
                name.strip_prefix("model.layers.")
                    .and_then(|rest| rest.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_some_and(|i| (start..end).contains(&i))
            })
            .map(|(_, file)| file.clone())
            .collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.weight_map.contains_key(name)
    }

    /// The weight files holding `names` (those the checkpoint has).
    pub fn files_for_tensors<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> std::collections::BTreeSet<String> {
        names
            .into_iter()
            .filter_map(|n| self.weight_map.get(n).cloned())
            .collect()
    }

    pub fn weights(&self, dtype: DType, device: &Device) -> Weights<'_> {
        Weights::new(self, dtype, device)
    }

    /// Whether every layer of `start..end` has weights here (named in the
    /// index, in files present on disk or in memory).
    pub fn has_layers(&self, start: usize, end: usize) -> bool {
        let files = self.files_for_layers(start, end);
        let present = |file: &String| {
            self.single_file.is_some()
                || self.side_files.is_some()
                    && self.files.lock().is_ok_and(|f| f.contains_key(file))
                || self.dir.join(file).is_file()
        };
        (start..end).all(|i| {
            let prefix = format!("model.layers.{i}.");
            self.weight_map.keys().any(|name| name.starts_with(&prefix))
        }) && files.iter().all(present)
    }

    pub fn check_layer_range(&self, start: usize, end: usize) -> Result<()> {
        let num_layers = self.config.num_hidden_layers;
        if start >= end || end > num_layers {
            return Err(ModelError::LayerRange {
                start,
                end,
                num_layers,
            });
        }
        Ok(())
    }
}
