//! Token embeddings: a dense table, or rows looked up one at a time in their
//! stored (often quantized) form. A 70B model's table is 32000–152064 rows
//! of 8192 values (1–5 GB in f32); a prompt needs a few dozen rows, so a
//! client keeps the table quantized in a mapped file, or (the page) fetches
//! just the rows it needs and keeps the recent ones.

use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Mutex;

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Embedding;
use hashlink::LruCache;

use crate::error::{ModelError, Result};
use crate::weight_file::RawTensor;

/// How one row of the table is stored: `hidden` values of `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowFormat {
    pub dtype: GgmlDType,
    pub rows: usize,
    pub hidden: usize,
}

impl RowFormat {
    /// Bytes of one row; `None` when a row is not whole blocks of `dtype`.
    pub fn row_bytes(&self) -> Option<usize> {
        let block = self.dtype.block_size();
        self.hidden
            .is_multiple_of(block)
            .then(|| self.hidden / block * self.dtype.type_size())
    }

    fn checked_row_bytes(&self) -> Result<usize> {
        self.row_bytes().ok_or_else(|| {
            ModelError::InvalidConfig(format!(
                "embedding rows of {} values are not whole {:?} blocks",
                self.hidden, self.dtype
            ))
        })
    }

    /// One stored row as `[hidden]` f32 values.
    fn dequantize(&self, bytes: &[u8], device: &Device) -> Result<Tensor> {
        let q = qtensor_from_ggml(self.dtype, bytes, vec![1, self.hidden], device)?;
        Ok(q.dequantize(device)?.reshape(self.hidden)?)
    }
}

/// The future a [`RowFetch`] returns; `Send` where threads exist.
#[cfg(not(target_arch = "wasm32"))]
pub type RowsFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Vec<u8>>>> + Send + 'a>>;
/// The future a [`RowFetch`] returns; `Send` where threads exist.
#[cfg(target_arch = "wasm32")]
pub type RowsFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Vec<u8>>>> + 'a>>;

/// Where rows that a head does not hold come from (the page: HTTP range
/// requests into the server's embedding file, each row checked).
#[cfg(not(target_arch = "wasm32"))]
pub trait RowFetch: Send + Sync {
    /// The stored bytes of each of `ids`, in order.
    fn fetch<'a>(&'a self, ids: &'a [u32]) -> RowsFuture<'a>;
}

/// Where rows that a head does not hold come from (the page: HTTP range
/// requests into the server's embedding file, each row checked).
#[cfg(target_arch = "wasm32")]
pub trait RowFetch {
    /// The stored bytes of each of `ids`, in order.
    fn fetch<'a>(&'a self, ids: &'a [u32]) -> RowsFuture<'a>;
}

/// Rows kept by a head that fetches them: enough for long conversations
/// (distinct tokens, not positions) at a few KiB each when quantized.
pub const FETCHED_ROWS_KEPT: usize = 8192;

pub(crate) enum TokenEmbeddings {
    Dense(Embedding),
    /// The table as stored in a mapped file.
    Mapped {
        raw: RawTensor,
        format: RowFormat,
    },
    /// Rows fetched on demand, the most recently used kept.
    Fetched {
        format: RowFormat,
        kept: Mutex<LruCache<u32, Vec<u8>>>,
        source: Box<dyn RowFetch>,
    },
}

impl std::fmt::Debug for TokenEmbeddings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dense(_) => f.write_str("Dense"),
            Self::Mapped { format, .. } => write!(f, "Mapped({format:?})"),
            Self::Fetched { format, .. } => write!(f, "Fetched({format:?})"),
        }
    }
}

impl TokenEmbeddings {
    pub(crate) fn mapped(raw: RawTensor, format: RowFormat) -> Result<Self> {
        let expected = format.checked_row_bytes()? * format.rows;
        if raw.data().len() != expected {
            return Err(ModelError::InvalidConfig(format!(
                "the embedding table holds {} bytes, {expected} expected for {format:?}",
                raw.data().len()
            )));
        }
        Ok(Self::Mapped { raw, format })
    }

    pub(crate) fn fetched(format: RowFormat, source: Box<dyn RowFetch>) -> Result<Self> {
        format.checked_row_bytes()?;
        let kept = NonZeroUsize::new(FETCHED_ROWS_KEPT).map_or(1, NonZeroUsize::get);
        Ok(Self::Fetched {
            format,
            kept: Mutex::new(LruCache::new(kept)),
            source,
        })
    }

    /// Fetches the rows of `ids` this table lacks (nothing for the others).
    pub(crate) async fn fetch_missing(&self, ids: &[u32]) -> Result<()> {
        let Self::Fetched {
            format,
            kept,
            source,
        } = self
        else {
            return Ok(());
        };
        let mut missing: Vec<u32> = {
            let kept = kept.lock().unwrap_or_else(|p| p.into_inner());
            ids.iter()
                .copied()
                .filter(|id| !kept.contains_key(id))
                .collect()
        };
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        let rows = source.fetch(&missing).await?;
        let row_bytes = format.checked_row_bytes()?;
        if rows.len() != missing.len() || rows.iter().any(|r| r.len() != row_bytes) {
            return Err(ModelError::InvalidConfig(format!(
                "the row source answered {} rows for {} asked, or rows not of {row_bytes} bytes",
                rows.len(),
                missing.len()
            )));
        }
        let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
        for (id, row) in missing.into_iter().zip(rows) {
            kept.insert(id, row);
        }
        Ok(())
    }

    /// `ids` (already checked against the vocabulary) as `[1, T, hidden]`.
    pub(crate) fn embed(&self, ids: &[u32], dtype: DType, device: &Device) -> Result<Tensor> {
        let rows = |format: &RowFormat, row: &mut dyn FnMut(u32) -> Result<Tensor>| {
            let rows = ids.iter().map(|&id| row(id)).collect::<Result<Vec<_>>>()?;
            Ok::<_, ModelError>(
                Tensor::stack(&rows, 0)?
                    .reshape((1, ids.len(), format.hidden))?
                    .to_dtype(dtype)?,
            )
        };
        match self {
            Self::Dense(table) => {
                let ids = Tensor::new(ids, device)?.unsqueeze(0)?;
                Ok(table.forward(&ids)?)
            }
            Self::Mapped { raw, format } => {
                let n = format.checked_row_bytes()?;
                let data = raw.data();
                rows(format, &mut |id| {
                    format.dequantize(&data[id as usize * n..][..n], device)
                })
            }
            Self::Fetched { format, kept, .. } => {
                let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
                rows(format, &mut |id| match kept.get(&id) {
                    Some(bytes) => format.dequantize(bytes, device),
                    None => Err(ModelError::EmbeddingRowMissing(id)),
                })
            }
        }
    }
}
