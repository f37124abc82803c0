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

use candle_core::{Device, Tensor};
use smallvec::SmallVec;

use super::scratch::{write_rows, AttentionScratch, LayerScratch, RowScratch};
use super::{Attention, BlockSpan, DecoderLayer};
use crate::adapter::Target;
use crate::decode_attention;
use crate::error::Result;
use crate::feed_forward::FeedForward;
use crate::kv_cache::{LayerCache, SessionCache};
use crate::linear::with_f32_values;
use crate::lora::{RowLoras, SpanAdapter};
use crate::quant::ActivationScratch;
use crate::rope::Rope;

/// One session's rows of a step: positions `start..start + rows.len()`.
#[derive(Debug)]
pub(super) struct Segment {
    start: usize,
    rows: Range<usize>,
}

/// Where a step's rows are and the positions they hold.
struct StepRows<'a> {
    segments: &'a [Segment],
    positions: &'a [usize],
}

/// The sessions' caches of one layer (written in place, through the
/// tensors' own locks).
struct LayerCaches<'s, 'c> {
    steps: &'s [(Tensor, usize, &'c mut SessionCache)],
    layer: usize,
}

impl LayerCaches<'_, '_> {
    fn of(&self, session: usize) -> &LayerCache {
        &self.steps[session].2.layers[self.layer]
    }
}

impl BlockSpan {
    /// Runs each session's `[1, t, hidden]` at its position through the
    /// span as rows: one session's step of any length, or a batch of
    /// decode steps (one row each). Returns each session's output.
    pub(super) fn forward_rows(
        &self,
        steps: &mut [(Tensor, usize, &mut SessionCache)],
    ) -> Result<Vec<Tensor>> {
        let mut scratch = self.scratch.take();
        let out = self.forward_rows_in(steps, &mut scratch);
        self.scratch.put(scratch);
        out
    }

    fn forward_rows_in(
        &self,
        steps: &mut [(Tensor, usize, &mut SessionCache)],
        scratch: &mut RowScratch,
    ) -> Result<Vec<Tensor>> {
        let hidden = self.config.hidden_size;
        let RowScratch {
            x,
            segments,
            positions,
            layer: room,
        } = scratch;
        x.clear();
        segments.clear();
        for (h, start, _) in steps.iter() {
            let first = x.len() / hidden;
            with_f32_values(h, |values| x.extend_from_slice(values))?;
            let end = x.len() / hidden;
            segments.push(Segment {
                start: *start,
                rows: first..end,
            });
        }
        positions.clear();
        positions.extend(
            segments
                .iter()
                .flat_map(|s| s.start..s.start + s.rows.len()),
        );
        let step = StepRows {
            segments,
            positions,
        };
        let Some((_, _, first_cache)) = steps.first() else {
            return Ok(Vec::new());
        };
        let first_layer = first_cache.first_layer;
        let layers = self.layers_of(first_cache);
        let adapters: Option<Vec<Option<SpanAdapter>>> = steps
            .iter()
            .any(|(_, _, c)| c.adapter.is_some())
            .then(|| steps.iter().map(|(_, _, c)| c.adapter.clone()).collect());
        for (l, layer) in layers.iter().enumerate() {
            let chosen: Vec<_> = adapters
                .iter()
                .flatten()
                .map(|a| a.as_ref().and_then(|a| a.layer(first_layer + l)))
                .collect();
            // As the tensor path: one session's rows through its adapter as
            // one product, a batch's row by row.
            let loras = match chosen.as_slice() {
                [] => RowLoras::None,
                [one] => RowLoras::all(*one),
                _ => RowLoras::per_row(chosen),
            };
            let caches = LayerCaches { steps, layer: l };
            layer.forward_rows(x, &step, &self.rope, &caches, &loras, room)?;
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
        caches: &LayerCaches,
        loras: &RowLoras,
        room: &mut LayerScratch,
    ) -> Result<()> {
        let LayerScratch {
            normed,
            out,
            attention,
            mlp,
            activations,
        } = room;
        self.input_layernorm.rows_into(x, normed);
        self.self_attn.forward_rows(
            normed,
            step,
            rope,
            caches,
            loras,
            attention,
            out,
            activations,
        )?;
        add_into(x, out);
        self.post_attention_layernorm.rows_into(x, normed);
        let rows = step.positions.len();
        match &self.mlp {
            FeedForward::Dense(dense) => {
                dense.forward_rows_into(normed, rows, loras, out, mlp, activations)?
            }
            experts @ FeedForward::Experts(_) => {
                let input = Tensor::from_slice(normed, (rows, x.len() / rows), &Device::Cpu)?;
                *out = experts.forward(&input, loras)?.flatten_all()?.to_vec1()?;
            }
        }
        add_into(x, out);
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
    /// The layer's attention of `x` (the normed rows) into `out`.
    #[allow(clippy::too_many_arguments)]
    fn forward_rows(
        &self,
        x: &[f32],
        step: &StepRows,
        rope: &Rope,
        caches: &LayerCaches,
        loras: &RowLoras,
        room: &mut AttentionScratch,
        out: &mut Vec<f32>,
        activations: &mut ActivationScratch,
    ) -> Result<()> {
        let rows = step.positions.len();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let AttentionScratch {
            q,
            k,
            v,
            stacked,
            normed,
            attended,
        } = room;
        self.qkv
            .forward_rows_into(x, rows, [&mut *q, &mut *k, &mut *v], stacked, activations)?;
        *q = loras.add_rows(Target::Query, x, rows, std::mem::take(q))?;
        *k = loras.add_rows(Target::Key, x, rows, std::mem::take(k))?;
        *v = loras.add_rows(Target::Value, x, rows, std::mem::take(v))?;
        if let Some(norms) = &self.head_norms {
            norms.query.rows_into(q, normed);
            std::mem::swap(q, normed);
            norms.key.rows_into(k, normed);
            std::mem::swap(k, normed);
        }
        rope.rotate_rows(q, step.positions, nh)?;
        rope.rotate_rows(k, step.positions, nkv)?;
        for (i, segment) in step.segments.iter().enumerate() {
            let cache = caches.of(i);
            let at = segment.rows.start * nkv * hd..segment.rows.end * nkv * hd;
            write_rows(&cache.keys, &k[at.clone()], nkv, hd, segment.start)?;
            write_rows(&cache.values, &v[at], nkv, hd, segment.start)?;
        }
        self.attend_rows(q, step, caches, attended)?;
        self.o_proj
            .forward_rows_into(attended, rows, out, activations)?;
        *out = loras.add_rows(Target::Output, attended, rows, std::mem::take(out))?;
        Ok(())
    }

    /// Each row's attention over its session's cache (written up to the
    /// step's end) into `out`: rows of `[heads, head_dim]`, every row by
    /// the row kernel (as [`Attention::attend`] attends them).
    fn attend_rows(
        &self,
        q: &[f32],
        step: &StepRows,
        caches: &LayerCaches,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let mut keys: SmallVec<[&Tensor; 8]> = SmallVec::new();
        let mut values: SmallVec<[&Tensor; 8]> = SmallVec::new();
        for (i, segment) in step.segments.iter().enumerate() {
            let cache = caches.of(i);
            keys.extend(segment.rows.clone().map(|_| &cache.keys));
            values.extend(segment.rows.clone().map(|_| &cache.values));
        }
        let shape = self.head_shape();
        decode_attention::attend_rows(q, &keys, &values, step.positions, shape, out)
    }
}

#[cfg(test)]
mod tests;
