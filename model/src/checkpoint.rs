//! A checkpoint on disk and lazy, memory-mapped access to its tensors.
//!
//! Three layouts are understood, detected in this order:
//! 1. `corolla-index.json`, written by [`crate::convert::convert`]: per-span
//!    block files plus a client part;
//! 2. `model.safetensors.index.json` with sharded `*.safetensors` files;
//! 3. a single `model.safetensors`.
//!
//! Files are opened and mapped only when one of their tensors is first
//! requested, so a server hosting a few layers never touches (or needs to
//! have downloaded) the files of the others.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const SHARDED_INDEX: &str = "model.safetensors.index.json";
pub const COROLLA_INDEX: &str = "corolla-index.json";

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

/// One tensor's location inside a mapped file, before conversion.
pub struct RawTensor {
    file: Arc<MappedFile>,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    range: (usize, usize),
}

impl RawTensor {
    pub fn data(&self) -> &[u8] {
        &self.file.mmap[self.range.0..self.range.1]
    }
}

struct MappedFile {
    mmap: Mmap,
    data_start: usize,
    metadata: Metadata,
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: checkpoint files are read-only inputs; like every mmap-based
        // loader (candle's included) we rely on nobody truncating them while
        // the model runs.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::invalid_file(path, e))?;
        Ok(MappedFile {
            data_start: 8 + header_len,
            metadata,
            mmap,
        })
    }
}

/// A model folder: its config, where each tensor lives, and lazily opened files.
pub struct Checkpoint {
    dir: PathBuf,
    config: LlamaConfig,
    weight_map: HashMap<String, String>,
    corolla_index: Option<CorollaIndex>,
    files: Mutex<HashMap<String, Arc<MappedFile>>>,
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
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
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
            let file = MappedFile::open(&dir.join(SINGLE_FILE))?;
            let map = file
                .metadata
                .tensors()
                .into_keys()
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
            config,
            weight_map,
            corolla_index,
            files: Mutex::new(files),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The block layout, when this is a `corolla convert` output.
    pub fn corolla_index(&self) -> Option<&CorollaIndex> {
        self.corolla_index.as_ref()
    }

    pub fn tokenizer_path(&self) -> PathBuf {
        self.dir.join(TOKENIZER_FILE)
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

    /// The raw bytes and metadata of one tensor, mapping its file if needed.
    pub fn raw_tensor(&self, name: &str) -> Result<RawTensor> {
        let file_name = self
            .weight_map
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let file = self.mapped(file_name)?;
        let info = file
            .metadata
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let range = (
            file.data_start + info.data_offsets.0,
            file.data_start + info.data_offsets.1,
        );
        Ok(RawTensor {
            dtype: info.dtype,
            shape: info.shape.clone(),
            range,
            file,
        })
    }

    fn mapped(&self, file_name: &str) -> Result<Arc<MappedFile>> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = files.get(file_name) {
            return Ok(f.clone());
        }
        let path = self.dir.join(file_name);
        tracing::debug!(path = %path.display(), "mapping weight file");
        let f = Arc::new(MappedFile::open(&path)?);
        files.insert(file_name.to_string(), f.clone());
        Ok(f)
    }

    /// Loads one tensor, checks its shape and converts it to `dtype` on `device`.
    pub fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let raw = self.raw_tensor(name)?;
        if raw.shape != shape {
            return Err(ModelError::WrongShape {
                name: name.into(),
                expected: shape.to_vec(),
                actual: raw.shape.clone(),
            });
        }
        let src_dtype = match raw.dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedTensorDType {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let t = Tensor::from_raw_buffer(raw.data(), src_dtype, &raw.shape, device)?;
        Ok(t.to_dtype(dtype)?)
    }

    pub fn weights(&self, dtype: DType, device: &Device) -> Weights<'_> {
        Weights {
            checkpoint: self,
            prefix: String::new(),
            dtype,
            device: device.clone(),
        }
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

/// A view of a checkpoint under a name prefix, in a target dtype and device:
/// what model components take in their `load` functions.
#[derive(Clone)]
pub struct Weights<'a> {
    checkpoint: &'a Checkpoint,
    prefix: String,
    dtype: DType,
    device: Device,
}

impl<'a> Weights<'a> {
    pub fn pp(&self, name: impl std::fmt::Display) -> Weights<'a> {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        };
        Weights {
            prefix,
            ..self.clone()
        }
    }

    fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.checkpoint
            .tensor(&self.full_name(name), shape, self.dtype, &self.device)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.checkpoint.contains(&self.full_name(name))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
}
