//! The model crate's error type.

use std::path::PathBuf;

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid {path}: {message}")]
    InvalidFile { path: PathBuf, message: String },
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    #[error("unsupported architecture {0:?}: Corolla runs Llama-family models (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; GGUF: llama, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    #[error("no weights in {0}: expected model.safetensors, model.safetensors.index.json or corolla-index.json")]
    NoWeights(PathBuf),
    #[error("tensor {name} is missing from the checkpoint")]
    MissingTensor { name: String },
    #[error("tensor {name} has shape {actual:?}, expected {expected:?}")]
    WrongShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor {name} has unsupported dtype {dtype}")]
    UnsupportedTensorDType { name: String, dtype: String },
    #[error("layer range {start}..{end} is outside the model's {num_layers} layers")]
    LayerRange {
        start: usize,
        end: usize,
        num_layers: usize,
    },
    #[error("a decode batch takes one position per session, all through the same layers")]
    BatchMismatch,
    #[error("a KV cache tensor is not in the contiguous CPU f32 layout the decode kernel reads")]
    CacheLayout,
    #[error(
        "cached keys and values must be [1, kv heads, positions, head dim], alike in every layer"
    )]
    CachedPositionsShape,
    #[error("position {end} exceeds the session's KV cache of {capacity} tokens")]
    CacheFull { end: usize, capacity: usize },
    #[error("start position {start} is past the {cached} tokens already in the cache")]
    PositionGap { start: usize, cached: usize },
    #[error("max length {requested} exceeds the model's {max} positions")]
    MaxLengthTooLarge { requested: usize, max: usize },
    #[error("hidden states of shape {actual:?} do not match hidden size {hidden}")]
    HiddenShape { actual: Vec<usize>, hidden: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("the embedding row of token {0} has not been fetched")]
    EmbeddingRowMissing(u32),
    #[error("cannot fetch embedding rows: {0}")]
    RowFetch(String),
    #[error("invalid sampling settings: {0}")]
    InvalidSampling(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid_file(path: impl Into<PathBuf>, message: impl ToString) -> Self {
        ModelError::InvalidFile {
            path: path.into(),
            message: message.to_string(),
        }
    }
}
