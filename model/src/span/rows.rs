//! A step on the CPU in f32, each position a row of plain floats: the
//! layer's norms, rotations, residuals and the products of Corolla's
//! kernels run on slices, with candle's arithmetic for each operation, so a
//! step gives the bits the tensor path (`span.rs`, which GPUs and other
//! dtypes take) gives. Done with tensors, a decode step of the default
//! model cost about sixty small tensors per layer (~1 µs of fixed costs
//! each, on one thread while the other waited); here they are loops.
//!
//! What stays on tensors: adapters' changes, dense and candle-quantized
//! products (converted at their edges), a mixture's experts, and the
//! attention of a step too long for the row kernel.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use super::{causal_mask, Attention, BlockSpan, DecoderLayer, ROW_KERNEL_MAX_ROWS};
use crate::adapter::Target;
use crate::decode_attention;
use crate::error::{ModelError, Result};
use crate::feed_forward::FeedForward;
use crate::kv_cache::{LayerCache, SessionCache};
use crate::lora::{RowLoras, SpanAdapter};
use crate::rope::Rope;

/// One session's rows of a step: positions `start..start + rows.len()`.
struct Segment {
    start: usize,
    rows: Range<usize>,
}

/// Where a step's rows are and the positions they hold.
struct StepRows {
    segments: Vec<Segment>,
    positions: Vec<usize>,
}

impl BlockSpan {
    /// Runs each session's `[1, t, hidden]` at its position through the
    /// span as rows: one session's step of any length, or a batch of
    /// decode steps (one row each). Returns each session's output.
    pub(super) fn forward_rows(
        &self,
        steps: &mut [(Tensor, usize, &mut SessionCache)],
    ) -> Result<Vec<Tensor>> {
        let hidden = self.config.hidden_size;
        let mut x = Vec::new();
        let mut segments = Vec::with_capacity(steps.len());
        for (h, start, _) in steps.iter() {
            let first = x.len() / hidden;
            x.extend(h.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            let end = x.len() / hidden;
            segments.push(Segment {
                start: *start,
                rows: first..end,
            });
        }
        let positions = segments
            .iter()
            .flat_map(|s| s.start..s.start + s.rows.len())
            .collect();
        let step = StepRows {
            segments,
            positions,
        };
        let Some((_, _, first_cache)) = steps.first() else {
            return Ok(Vec::new());
        };
        let first_layer = first_cache.first_layer;
        let layers = self.layers_of(first_cache);
        let adapters: Vec<Option<SpanAdapter>> =
            steps.iter().map(|(_, _, c)| c.adapter.clone()).collect();
        for (l, layer) in layers.iter().enumerate() {
            let chosen: Vec<_> = adapters
                .iter()
                .map(|a| a.as_ref().and_then(|a| a.layer(first_layer + l)))
                .collect();
            // As the tensor path: one session's rows through its adapter as
            // one product, a batch's row by row.
            let loras = match chosen.as_slice() {
                [one] => RowLoras::all(*one),
                _ => RowLoras::per_row(chosen),
            };
            let mut caches: Vec<&mut LayerCache> = steps
                .iter_mut()
                .map(|(_, _, cache)| &mut cache.layers[l])
                .collect();
            layer.forward_rows(&mut x, &step, &self.rope, &mut caches, &loras)?;
        }
        for (segment, (_, start, cache)) in step.segments.iter().zip(steps.iter_mut()) {
            cache.len = *start + segment.rows.len();
        }
        step.segments
            .iter()
            .map(|s| {
                let rows = &x[s.rows.start * hidden..s.rows.end * hidden];
                Ok(Tensor::from_slice(
                    rows,
                    (1, s.rows.len(), hidden),
                    &Device::Cpu,
                )?)
            })
            .collect()
    }
}

impl DecoderLayer {
    fn forward_rows(
        &self,
        x: &mut [f32],
        step: &StepRows,
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        loras: &RowLoras,
    ) -> Result<()> {
        let normed = self.input_layernorm.rows(x);
        let attended = self
            .self_attn
            .forward_rows(&normed, step, rope, caches, loras)?;
        add_into(x, &attended);
        let normed = self.post_attention_layernorm.rows(x);
        let rows = step.positions.len();
        let mlp = match &self.mlp {
            FeedForward::Dense(mlp) => mlp.forward_rows(&normed, rows, loras)?,
            experts @ FeedForward::Experts(_) => {
                let input = Tensor::from_slice(&normed, (rows, x.len() / rows), &Device::Cpu)?;
                experts.forward(&input, loras)?.flatten_all()?.to_vec1()?
            }
        };
        add_into(x, &mlp);
        Ok(())
    }
}

/// `x += y`, element by element (candle's `x + y`: the same bits).
fn add_into(x: &mut [f32], y: &[f32]) {
    for (x, y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

impl Attention {
    fn forward_rows(
        &self,
        x: &[f32],
        step: &StepRows,
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        loras: &RowLoras,
    ) -> Result<Vec<f32>> {
        let rows = step.positions.len();
        let (nh, nkv) = (self.num_heads, self.num_kv_heads);
        let [q, k, v] = self.qkv.forward_rows(x, rows)?;
        let q = loras.add_rows(Target::Query, x, rows, q)?;
        let k = loras.add_rows(Target::Key, x, rows, k)?;
        let v = loras.add_rows(Target::Value, x, rows, v)?;
        let (mut q, mut k) = match &self.head_norms {
            Some(norms) => (norms.query.rows(&q), norms.key.rows(&k)),
            None => (q, k),
        };
        rope.rotate_rows(&mut q, &step.positions, nh)?;
        rope.rotate_rows(&mut k, &step.positions, nkv)?;
        for (segment, cache) in step.segments.iter().zip(caches.iter_mut()) {
            cache
                .keys
                .slice_set(&self.heads_first(&k, segment)?, 2, segment.start)?;
            cache
                .values
                .slice_set(&self.heads_first(&v, segment)?, 2, segment.start)?;
        }
        let attended = self.attend_rows(&q, step, caches)?;
        let y = self.o_proj.forward_rows(&attended, rows)?;
        loras.add_rows(Target::Output, &attended, rows, y)
    }

    /// A segment's keys or values (rows of `[kv heads, head_dim]`) as the
    /// cache holds them: `[1, kv heads, t, head_dim]`.
    fn heads_first(&self, rows: &[f32], segment: &Segment) -> Result<Tensor> {
        let (nkv, hd) = (self.num_kv_heads, self.head_dim);
        let t = segment.rows.len();
        let mut out = vec![0f32; t * nkv * hd];
        for (r, row) in segment.rows.clone().enumerate() {
            for h in 0..nkv {
                out[(h * t + r) * hd..][..hd].copy_from_slice(&rows[(row * nkv + h) * hd..][..hd]);
            }
        }
        Ok(Tensor::from_vec(out, (1, nkv, t, hd), &Device::Cpu)?)
    }

    /// Each row's attention over its session's cache (written up to the
    /// step's end): rows of `[heads, head_dim]`. Rows of steps the row
    /// kernel takes attend together (as [`Attention::attend`] attends
    /// them); a longer step attends through matrix products.
    fn attend_rows(
        &self,
        q: &[f32],
        step: &StepRows,
        caches: &[&mut LayerCache],
    ) -> Result<Vec<f32>> {
        let width = self.num_heads * self.head_dim;
        let short = |s: &Segment| s.rows.len() <= ROW_KERNEL_MAX_ROWS;
        if step.segments.iter().all(short) {
            let mut keys = Vec::with_capacity(step.positions.len());
            let mut values = Vec::with_capacity(step.positions.len());
            for (segment, cache) in step.segments.iter().zip(caches) {
                keys.extend(segment.rows.clone().map(|_| &cache.keys));
                values.extend(segment.rows.clone().map(|_| &cache.values));
            }
            let shape = self.head_shape();
            return decode_attention::attend_rows(q, &keys, &values, &step.positions, shape);
        }
        let [segment] = step.segments.as_slice() else {
            // Batches are of decode steps, one row each.
            return Err(ModelError::BatchMismatch);
        };
        let cache = &caches[0];
        let t = segment.rows.len();
        let (nh, hd) = (self.num_heads, self.head_dim);
        let q = Tensor::from_slice(q, (1, t, nh, hd), &Device::Cpu)?
            .transpose(1, 2)?
            .contiguous()?;
        let mask = causal_mask(t, segment.start, self.window, &Device::Cpu)?;
        let out = self.attend_cached(&q, segment.start, cache, Some(&mask))?;
        let out: Vec<f32> = out.flatten_all()?.to_vec1()?;
        debug_assert_eq!(out.len(), t * width);
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
