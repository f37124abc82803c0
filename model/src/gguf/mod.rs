//! GGUF files (llama.cpp's format): config, tokenizer metadata and quantized
//! tensors of Llama-family models.
//!
//! Tensors keep their GGUF quantization (Q4_0…Q8_0, k-quants, F16, F32) and
//! are exposed under Hugging Face names, so spans, the client head and the
//! fingerprints treat a GGUF checkpoint like any other. One difference is
//! visible to the math: llama.cpp's converter permutes the rows of each
//! attention head's Q and K weights so that rotary pairs sit next to each
//! other, hence [`crate::rope::RopeLayout::Interleaved`] for GGUF weights.
//!
//! This file reads a file's header and tensors; `names.rs` maps tensor
//! names, `config.rs` reads the model's configuration and `tokenizer.rs`
//! its tokenizer and chat template from the metadata.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::Device;

use crate::error::{ModelError, Result};
use crate::file_bytes::FileBytes;

mod config;
mod names;
mod tokenizer;

pub use names::{architecture_of, gguf_name, hf_name};
pub use tokenizer::GgufTokenizer;

/// llama.cpp's per-frequency rope divisors.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The first bytes of every GGUF file.
pub const MAGIC: &[u8; 4] = b"GGUF";

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
}
