//! One weight file, safetensors or GGUF: its bytes (memory-mapped from disk,
//! or owned: a browser downloads the client part into memory, there is no
//! file to map), its tensor index, and where each tensor's bytes are.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use safetensors::tensor::Metadata;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::error::{ModelError, Result};
use crate::file_bytes::FileBytes;
use crate::gguf::GgufFile;

/// How a tensor is stored on disk.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum RawDType {
    Safetensors(StDtype),
    Ggml(GgmlDType),
}

impl RawDType {
    /// Whether the bytes are blocks of a GGML quantization rather than floats.
    pub fn is_quantized(&self) -> bool {
        matches!(self, RawDType::Ggml(t) if !matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16))
    }
}

impl std::fmt::Debug for RawDType {
    // Only the inner name: fingerprints hash this text.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RawDType::Safetensors(t) => write!(f, "{t:?}"),
            RawDType::Ggml(t) => write!(f, "{t:?}"),
        }
    }
}

/// One tensor's location inside a mapped file, before conversion.
pub struct RawTensor {
    pub(crate) file: Arc<WeightFile>,
    pub dtype: RawDType,
    pub shape: Vec<usize>,
    range: (usize, usize),
}

impl RawTensor {
    pub fn data(&self) -> &[u8] {
        let mmap = match self.file.as_ref() {
            WeightFile::Safetensors(f) => &f.mmap[..],
            WeightFile::Gguf(f) => f.mapped_bytes(),
        };
        &mmap[self.range.0..self.range.1]
    }
}

pub(crate) enum WeightFile {
    Safetensors(MappedFile),
    Gguf(GgufFile),
}

impl WeightFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        Self::from_bytes(path, FileBytes::map(path)?)
    }

    /// `path` names the file (its extension tells the format) and is used in errors.
    pub(crate) fn from_bytes(path: &Path, bytes: FileBytes) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "gguf") {
            Ok(WeightFile::Gguf(GgufFile::from_bytes(path, bytes)?))
        } else {
            Ok(WeightFile::Safetensors(MappedFile::parse(path, bytes)?))
        }
    }

    /// Where `name`'s bytes are in `file`, if it holds that tensor.
    pub(crate) fn raw_tensor(file: &Arc<WeightFile>, name: &str) -> Option<RawTensor> {
        let (dtype, shape, range) = match file.as_ref() {
            WeightFile::Safetensors(f) => {
                let info = f.metadata.info(name)?;
                let range = (
                    f.data_start + info.data_offsets.0,
                    f.data_start + info.data_offsets.1,
                );
                (RawDType::Safetensors(info.dtype), info.shape.clone(), range)
            }
            WeightFile::Gguf(f) => {
                let info = f.tensors().get(name)?;
                (RawDType::Ggml(info.dtype), info.shape.clone(), info.range)
            }
        };
        Some(RawTensor {
            file: file.clone(),
            dtype,
            shape,
            range,
        })
    }

    pub(crate) fn tensor_names(&self) -> Vec<String> {
        match self {
            WeightFile::Safetensors(f) => f.metadata.tensors().into_keys().collect(),
            WeightFile::Gguf(g) => g.tensors().keys().cloned().collect(),
        }
    }
}

/// A safetensors file: its bytes and parsed header.
pub(crate) struct MappedFile {
    mmap: FileBytes,
    data_start: usize,
    metadata: Metadata,
}

impl MappedFile {
    fn parse(path: &Path, mmap: FileBytes) -> Result<Self> {
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::invalid_file(path, e))?;
        Ok(MappedFile {
            data_start: 8 + header_len,
            metadata,
            mmap,
        })
    }
}
