//! A session's KV cache for one span (with the adapter the session runs
//! with), and copies of some of its positions.
//!
//! The cache is preallocated for the session's maximum length and written in
//! place at each step; attention reads it as one contiguous tensor per layer.
//! [`CachedPositions`] are the keys and values of a run of positions, copied
//! out of one session's cache and into another's: a server that saw the same
//! inputs at the same positions before hands a new session their keys and
//! values instead of computing them again.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::lora::SpanAdapter;

#[derive(Debug)]
pub(crate) struct LayerCache {
    /// `[1, kv heads, capacity, head dim]`.
    pub(crate) keys: Tensor,
    pub(crate) values: Tensor,
}

/// The KV cache of one session for one span, preallocated to `capacity`
/// positions, and the LoRA adapter the session's steps run with: the keys
/// and values it holds were computed with that adapter.
#[derive(Debug)]
pub struct SessionCache {
    pub(crate) layers: Vec<LayerCache>,
    pub(crate) adapter: Option<SpanAdapter>,
    /// Absolute index of the first layer this cache serves.
    pub(crate) first_layer: usize,
    pub(crate) len: usize,
    pub(crate) capacity: usize,
}

/// Keys and values of `positions` positions of some layers, owned (not a
/// view of any session's cache): `[1, kv heads, positions, head dim]` each.
#[derive(Debug, Clone)]
pub struct CachedPositions {
    layers: Vec<(Tensor, Tensor)>,
    first_layer: usize,
    positions: usize,
}

impl CachedPositions {
    /// Keys and values (`[1, kv heads, positions, head dim]` each, all
    /// alike) of consecutive layers from `first_layer`.
    pub fn new(first_layer: usize, layers: Vec<(Tensor, Tensor)>) -> Result<Self> {
        let shape = match layers.first() {
            Some((keys, _)) => keys.dims().to_vec(),
            None => return Err(ModelError::CachedPositionsShape),
        };
        let alike = |t: &Tensor| t.dims() == shape.as_slice() && t.dtype() == layers[0].0.dtype();
        if shape.len() != 4 || shape[0] != 1 || !layers.iter().all(|(k, v)| alike(k) && alike(v)) {
            return Err(ModelError::CachedPositionsShape);
        }
        Ok(CachedPositions {
            positions: shape[2],
            layers,
            first_layer,
        })
    }

    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The absolute layers these positions were computed by.
    pub fn layers(&self) -> Range<usize> {
        self.first_layer..self.first_layer + self.layers.len()
    }

    /// Bytes the copies hold.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}

impl SessionCache {
    /// A cache of zeros for `layers`, `(kv heads, head dim)` per position.
    pub(crate) fn zeros(
        layers: Range<usize>,
        (kv_heads, head_dim): (usize, usize),
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let shape = (1, kv_heads, capacity, head_dim);
        let caches = layers
            .clone()
            .map(|_| {
                Ok(LayerCache {
                    keys: Tensor::zeros(shape, dtype, device)?,
                    values: Tensor::zeros(shape, dtype, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SessionCache {
            layers: caches,
            adapter: None,
            first_layer: layers.start,
            len: 0,
            capacity,
        })
    }

    /// Positions whose keys and values are cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets positions `len..` (kept as they are until overwritten): the
    /// next step may start at `len` at the latest.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The absolute layers this cache serves.
    pub fn layers(&self) -> Range<usize> {
        self.first_layer..self.first_layer + self.layers.len()
    }

    /// Runs the session's next steps with `adapter` (made for a span that
    /// holds this cache's layers), or without one. Positions cached so far
    /// are forgotten: they were computed with the previous choice.
    pub fn set_adapter(&mut self, adapter: Option<SpanAdapter>) {
        self.adapter = adapter;
        self.len = 0;
    }

    pub fn adapter(&self) -> Option<&SpanAdapter> {
        self.adapter.as_ref()
    }

    /// A copy of the keys and values of `positions`, which must be cached.
    pub fn copy_out(&self, positions: Range<usize>) -> Result<CachedPositions> {
        if positions.is_empty() || positions.end > self.len {
            return Err(ModelError::PositionGap {
                start: positions.end,
                cached: self.len,
            });
        }
        let (at, n) = (positions.start, positions.len());
        let layers = self
            .layers
            .iter()
            .map(|l| {
                // Fresh compact storage: a page outlives the session it came from.
                let copy = |t: &Tensor| t.narrow(2, at, n)?.force_contiguous();
                Ok((copy(&l.keys)?, copy(&l.values)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CachedPositions {
            layers,
            first_layer: self.first_layer,
            positions: n,
        })
    }

    /// Writes `cached` at positions `at..` (at most one past what is cached
    /// now, as a step may) and forgets what followed them: the cache then
    /// holds `at + cached.positions()` positions.
    pub fn copy_in(&mut self, at: usize, cached: &CachedPositions) -> Result<()> {
        if cached.layers() != self.layers() {
            let served = cached.layers();
            return Err(ModelError::LayerRange {
                start: served.start,
                end: served.end,
                num_layers: self.layers().end,
            });
        }
        if at > self.len {
            return Err(ModelError::PositionGap {
                start: at,
                cached: self.len,
            });
        }
        let end = at + cached.positions;
        if end > self.capacity {
            return Err(ModelError::CacheFull {
                end,
                capacity: self.capacity,
            });
        }
        for (layer, (keys, values)) in self.layers.iter_mut().zip(&cached.layers) {
            layer.keys.slice_set(keys, 2, at)?;
            layer.values.slice_set(values, 2, at)?;
        }
        self.len = end;
        Ok(())
    }
}
