//! Llama-family math on candle, split at any layer boundary.
//!
//! A model is two kinds of components: [`BlockSpan`]s (decoder layers
//! `[a, b)` with a preallocated KV cache per session) that servers host, and
//! the [`ClientHead`] (embeddings, final norm, LM head) that the client keeps.
//! Chaining spans `[0, a) + [a, b) + … + [c, L)` computes exactly what the
//! whole model computes. Weights load lazily from a [`Checkpoint`]: a
//! Hugging Face folder, a GGUF file (kept quantized) or the layout written
//! by [`convert::convert`].

pub mod adapter;
pub mod checkpoint;
pub mod config;
pub mod convert;
mod decode_attention;
pub mod dtype;
pub mod embeddings;
mod error;
mod experts;
mod feed_forward;
pub mod file_bytes;
pub mod fingerprint;
pub mod gguf;
#[cfg(feature = "generators")]
pub mod gguf_writer;
pub mod head;
pub mod kv_cache;
mod linear;
mod lora;
mod mlp;
#[cfg(feature = "generators")]
mod model_shape;
mod norm;
mod pool;
mod quant;
pub mod quantized_buffer;
#[cfg(feature = "generators")]
pub mod random;
#[cfg(feature = "generators")]
pub mod random_gguf;
#[cfg(feature = "generators")]
mod random_vocab;
pub mod rope;
pub mod sampler;
pub mod span;
pub mod tensor_names;
pub mod weight_file;
pub mod wire;

pub use adapter::AdapterFile;
pub use checkpoint::{Checkpoint, QuantizedWeights, TokenizerSource};
pub use config::LlamaConfig;
pub use dtype::ModelDType;
pub use error::{ModelError, Result};
pub use head::ClientHead;
pub use kv_cache::{CachedPositions, SessionCache};
pub use linear::KERNELS_ENV;
pub use lora::SpanAdapter;
pub use quant::repacked_for_batches;
pub use sampler::{Sampler, SamplingParams};
pub use span::BlockSpan;

pub use candle_core::quantized;
pub use candle_core::{DType, Device, Tensor};
