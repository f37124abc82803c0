//! The room a step through the rows path (`rows.rs`) works in, kept by the
//! span between steps: the residual stream, each layer's norms, products
//! and attention write into buffers sized by the first step, so a decode
//! step allocates nothing per layer (a step of the default model allocated
//! ~20 buffers in each of its 30 layers).

use std::sync::Mutex;

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};

use crate::mlp::MlpScratch;
use crate::quant::ActivationScratch;

/// One step's buffers.
#[derive(Debug, Default)]
pub(super) struct RowScratch {
    /// The step's rows: the residual stream.
    pub x: Vec<f32>,
    /// Each session's rows and positions.
    pub segments: Vec<super::rows::Segment>,
    pub positions: Vec<usize>,
    pub layer: LayerScratch,
}

/// What a layer writes before the residual stream takes it.
#[derive(Debug, Default)]
pub(super) struct LayerScratch {
    pub normed: Vec<f32>,
    /// Attention's output, then the MLP's.
    pub out: Vec<f32>,
    pub attention: AttentionScratch,
    pub mlp: MlpScratch,
    pub activations: ActivationScratch,
}

#[derive(Debug, Default)]
pub(super) struct AttentionScratch {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// A stacked Q, K and V product before it is split.
    pub stacked: Vec<f32>,
    /// A head norm's output, before it takes the place of `q` or `k`.
    pub normed: Vec<f32>,
    /// Every head's output, before the output projection.
    pub attended: Vec<f32>,
}

/// A span's scratch. A forward takes it for its run; a second forward of
/// the same span at the same time (which the server's one compute thread
/// never runs) works in a fresh one.
#[derive(Debug, Default)]
pub(super) struct ScratchSlot(Mutex<Option<RowScratch>>);

impl ScratchSlot {
    pub fn take(&self) -> RowScratch {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .unwrap_or_default()
    }

    pub fn put(&self, scratch: RowScratch) {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(scratch);
    }
}

impl Clone for ScratchSlot {
    /// A copy of a span works in room of its own.
    fn clone(&self) -> Self {
        ScratchSlot::default()
    }
}

/// Writes rows of `[kv heads, head_dim]` (`rows`, one per position from
/// `start` on) into a cache tensor `[1, kv heads, capacity, head_dim]` in
/// place: what `slice_set` of a temporary tensor did, without the tensor.
pub(super) struct WriteRows<'a> {
    pub rows: &'a [f32],
    pub kv_heads: usize,
    pub head_dim: usize,
    pub start: usize,
}

impl InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "write-cache-rows"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (nkv, hd) = (self.kv_heads, self.head_dim);
        let CpuStorage::F32(data) = storage else {
            return Err(candle_core::Error::Msg(
                "the rows path's caches are f32".into(),
            ));
        };
        let (Some((offset, end)), [1, heads, capacity, dim]) =
            (layout.contiguous_offsets(), layout.dims())
        else {
            return Err(candle_core::Error::Msg("a cache of another shape".into()));
        };
        let t = self.rows.len() / (nkv * hd).max(1);
        if *heads != nkv || *dim != hd || self.start + t > *capacity || end > data.len() {
            return Err(candle_core::Error::Msg("rows past the cache's room".into()));
        }
        let cache = &mut data[offset..end];
        for (r, row) in self.rows.chunks_exact(nkv * hd).enumerate() {
            for (h, values) in row.chunks_exact(hd).enumerate() {
                let at = (h * capacity + self.start + r) * hd;
                cache[at..at + hd].copy_from_slice(values);
            }
        }
        Ok(())
    }
}

/// Writes `rows` into `cache` (see [`WriteRows`]).
pub(super) fn write_rows(
    cache: &Tensor,
    rows: &[f32],
    kv_heads: usize,
    head_dim: usize,
    start: usize,
) -> crate::error::Result<()> {
    Ok(cache.inplace_op1(&WriteRows {
        rows,
        kv_heads,
        head_dim,
        start,
    })?)
}
