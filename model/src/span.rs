//! A contiguous span of decoder layers `[start, end)`.
//!
//! Weights are shared by every session; each session owns a [`SessionCache`]
//! (`kv_cache.rs`) preallocated for its maximum length, written in place at each step.
//!
//! A layer is `layer.rs`, its attention `attention.rs` (the row-by-row
//! attention kernel is `decode_attention.rs`); the rows path of decode
//! steps, without candle's tensors, is `rows.rs`.

mod attention;
mod layer;
mod rows;
mod scratch;

use attention::Attention;
use layer::DecoderLayer;

use candle_core::{DType, Device, Tensor};

use crate::adapter::AdapterFile;
use crate::checkpoint::{Checkpoint, Weights};
use crate::config::LlamaConfig;
use crate::decode_attention;
use crate::error::{ModelError, Result};
use crate::kv_cache::{LayerCache, SessionCache};
use crate::lora::{RowLoras, SpanAdapter};
use crate::norm::Norm;
use crate::pool::ComputePool;
use crate::rope::Rope;

pub(crate) fn rms_norm(w: &Weights, name: &str, cfg: &LlamaConfig) -> Result<Norm> {
    Norm::load(w, name, cfg.hidden_size, cfg.rms_norm_eps)
}

/// Decoder layers `[start, end)` of a Llama-family model.
#[derive(Debug, Clone)]
pub struct BlockSpan {
    start: usize,
    end: usize,
    layers: Vec<DecoderLayer>,
    rope: Rope,
    config: LlamaConfig,
    dtype: DType,
    device: Device,
    pool: ComputePool,
    /// Steps run as rows of plain f32 (`span/rows.rs`): f32 on the CPU.
    rows: bool,
    /// The rows path's buffers, kept between steps.
    scratch: scratch::ScratchSlot,
}

impl BlockSpan {
    /// Loads layers `[start, end)`, reading only their tensors.
    pub fn load(
        checkpoint: &Checkpoint,
        start: usize,
        end: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        checkpoint.check_layer_range(start, end)?;
        let cfg = checkpoint.config();
        let w = checkpoint.weights(dtype, device).pp("model.layers");
        let layers = (start..end)
            .map(|i| DecoderLayer::load(&w.pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        // A GPU's kernels run on the device; its host threads wait.
        let pool = match device.is_cpu() {
            true => ComputePool::new(layers.iter().any(DecoderLayer::multiplied_by_candle)),
            false => ComputePool::default(),
        };
        Ok(BlockSpan {
            start,
            end,
            layers,
            rope: Rope::new(cfg, checkpoint.rope_layout(), dtype, device)?,
            config: cfg.clone(),
            dtype,
            device: device.clone(),
            pool,
            rows: device.is_cpu() && dtype == DType::F32,
            scratch: Default::default(),
        })
    }

    pub fn range(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `file`'s layers of this span, ready for sessions to run with
    /// ([`SessionCache::set_adapter`]).
    pub fn adapter(&self, file: &AdapterFile) -> Result<SpanAdapter> {
        SpanAdapter::new(
            file,
            &self.config,
            self.range(),
            self.rope.layout(),
            self.dtype,
            &self.device,
        )
    }

    /// Bytes of KV cache one position costs in this span.
    pub fn cache_bytes_per_token(&self) -> usize {
        2 * self.layers.len()
            * self.config.num_key_value_heads
            * self.config.head_dim
            * self.dtype.size_in_bytes()
    }

    /// Allocates a session's KV cache for up to `max_length` positions.
    pub fn new_cache(&self, max_length: usize) -> Result<SessionCache> {
        self.new_cache_for(self.range(), max_length)
    }

    /// Allocates a KV cache for a session that runs only `layers` (absolute
    /// indices, inside this span) of this span.
    pub fn new_cache_for(
        &self,
        layers: std::ops::Range<usize>,
        max_length: usize,
    ) -> Result<SessionCache> {
        if layers.start < self.start || layers.end > self.end || layers.is_empty() {
            return Err(ModelError::LayerRange {
                start: layers.start,
                end: layers.end,
                num_layers: self.config.num_hidden_layers,
            });
        }
        let max = self.config.max_position_embeddings;
        if max_length == 0 || max_length > max {
            return Err(ModelError::MaxLengthTooLarge {
                requested: max_length,
                max,
            });
        }
        SessionCache::zeros(
            layers,
            (self.config.num_key_value_heads, self.config.head_dim),
            max_length,
            self.dtype,
            &self.device,
        )
    }

    /// Checks that `hidden` (`[1, T, hidden]`) at position `start` fits `cache`,
    /// whose layers this span holds: what [`Self::forward`] would refuse.
    pub fn check_step(&self, hidden: &[usize], start: usize, cache: &SessionCache) -> Result<()> {
        let dims = hidden;
        if dims.len() != 3 || dims[0] != 1 || dims[1] == 0 || dims[2] != self.config.hidden_size {
            return Err(ModelError::HiddenShape {
                actual: dims.to_vec(),
                hidden: self.config.hidden_size,
            });
        }
        let t = dims[1];
        if start > cache.len {
            return Err(ModelError::PositionGap {
                start,
                cached: cache.len,
            });
        }
        if start + t > cache.capacity {
            return Err(ModelError::CacheFull {
                end: start + t,
                capacity: cache.capacity,
            });
        }
        let served = cache.layers();
        let adapted = cache
            .adapter
            .as_ref()
            .map_or(served.clone(), |a| a.layers());
        if served.start < self.start
            || served.end > self.end
            || adapted.start > served.start
            || adapted.end < served.end
        {
            return Err(ModelError::LayerRange {
                start: served.start,
                end: served.end,
                num_layers: self.config.num_hidden_layers,
            });
        }
        Ok(())
    }

    /// The layers a cache runs through, out of this span's.
    fn layers_of(&self, cache: &SessionCache) -> &[DecoderLayer] {
        let first = cache.first_layer - self.start;
        &self.layers[first..first + cache.layers.len()]
    }

    /// Says that a forward is about to start on another thread (a server's
    /// compute thread, woken for a step): the span's compute threads wake
    /// now, alongside it, rather than at its first product.
    pub fn expect_work(&self) {
        self.pool.expect_work();
    }

    /// Runs `hidden` (`[1, T, hidden]`, positions `start..start+T`) through
    /// the span. `start` may rewind into the cache (the positions from
    /// `start` on are recomputed and overwritten) but may not skip ahead.
    pub fn forward(
        &self,
        hidden: &Tensor,
        start: usize,
        cache: &mut SessionCache,
    ) -> Result<Tensor> {
        self.pool.run(|| self.forward_here(hidden, start, cache))
    }

    fn forward_here(
        &self,
        hidden: &Tensor,
        start: usize,
        cache: &mut SessionCache,
    ) -> Result<Tensor> {
        self.check_step(hidden.dims(), start, cache)?;
        if self.rows {
            let mut step = [(hidden.clone(), start, cache)];
            let mut out = self.forward_rows(&mut step)?;
            return out.pop().ok_or(ModelError::BatchMismatch);
        }
        let t = hidden.dim(1)?;
        if t == 1 && decode_attention::supported(self.dtype, &self.device) {
            // The path of a batched decode step, so that a position's output
            // is the same bits alone, in a batch, locally or on a server
            // (kept-quantized products round activations to 8 bits, which
            // turns another path's last-bit differences into visible ones).
            let mut step = [(hidden.clone(), start, cache)];
            let mut out = self.forward_decode_batch(&mut step)?;
            return out.pop().ok_or(ModelError::BatchMismatch);
        }
        let mask = if t > 1 {
            Some(causal_mask(
                t,
                start,
                self.config.sliding_window,
                &self.device,
            )?)
        } else {
            None
        };
        let mut x = hidden.to_dtype(self.dtype)?;
        let first = cache.first_layer;
        let adapter = cache.adapter.clone();
        let layers = self.layers_of(cache).iter().zip(cache.layers.iter_mut());
        for (i, (layer, layer_cache)) in layers.enumerate() {
            let loras = RowLoras::all(adapter.as_ref().and_then(|a| a.layer(first + i)));
            x = layer.forward(&x, start, &self.rope, layer_cache, mask.as_ref(), &loras)?;
        }
        cache.len = start + t;
        Ok(x)
    }

    /// One decode step (`[1, 1, hidden]` each) for each of several sessions
    /// as one forward: the projections and the MLP run on `[B, hidden]`, so
    /// the weights are read once for all of them; attention runs per session
    /// against its own cache at its own position. Every cache must serve the
    /// same layers. Returns each session's `[1, 1, hidden]` output, in order.
    pub fn forward_decode_batch(
        &self,
        steps: &mut [(Tensor, usize, &mut SessionCache)],
    ) -> Result<Vec<Tensor>> {
        self.pool.run(|| self.forward_decode_batch_here(steps))
    }

    fn forward_decode_batch_here(
        &self,
        steps: &mut [(Tensor, usize, &mut SessionCache)],
    ) -> Result<Vec<Tensor>> {
        let Some((_, _, first)) = steps.first() else {
            return Ok(Vec::new());
        };
        let served = first.layers();
        for (hidden, start, cache) in steps.iter() {
            self.check_step(hidden.dims(), *start, cache)?;
            if hidden.dim(1)? != 1 || cache.layers() != served {
                return Err(ModelError::BatchMismatch);
            }
        }
        if self.rows {
            return self.forward_rows(steps);
        }
        let b = steps.len();
        let hidden = self.config.hidden_size;
        let rows = steps
            .iter()
            .map(|(h, _, _)| h.reshape((1, hidden)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut x = Tensor::cat(&rows, 0)?.to_dtype(self.dtype)?;
        let starts: Vec<usize> = steps.iter().map(|(_, start, _)| *start).collect();
        let rotation = self.rope.rows_at(&starts)?;
        let layers = self.layers_of(steps[0].2);
        let first = served.start;
        let adapters: Vec<Option<SpanAdapter>> =
            steps.iter().map(|(_, _, c)| c.adapter.clone()).collect();
        for (l, layer) in layers.iter().enumerate() {
            let rows: Vec<_> = adapters
                .iter()
                .map(|a| a.as_ref().and_then(|a| a.layer(first + l)))
                .collect();
            let loras = RowLoras::per_row(rows);
            let mut caches: Vec<&mut LayerCache> = steps
                .iter_mut()
                .map(|(_, _, cache)| &mut cache.layers[l])
                .collect();
            x = layer.forward_decode_batch(
                &x,
                &starts,
                &rotation,
                &self.rope,
                &mut caches,
                &loras,
            )?;
        }
        for (_, start, cache) in steps.iter_mut() {
            cache.len = *start + 1;
        }
        (0..b)
            .map(|i| Ok(x.narrow(0, i, 1)?.reshape((1, 1, hidden))?))
            .collect()
    }
}

/// `[t, start + t]` additive mask: query `i` (position `p = start + i`) sees
/// keys `0..=p`, or with a sliding window only the last `window` of them.
fn causal_mask(t: usize, start: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    let total = start + t;
    let window = window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..total).map(move |j| {
                let p = start + i;
                if j > p || p - j >= window {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, total), device)?)
}
