//! A contiguous span of decoder layers `[start, end)`.
//!
//! Weights are shared by every session; each session owns a [`SessionCache`]
//! (`kv_cache.rs`) preallocated for its maximum length, written in place at each step.
//!
//! Over 600 lines because attention, the layer and the span are read top to
//! bottom as one forward pass (as candle's model files are); the batched
//! decode attention is apart (`decode_attention.rs`). Attention would be the
//! piece to move out next.

mod rows;
mod scratch;

use candle_core::{DType, Device, Tensor};

use crate::adapter::{AdapterFile, Target};
use crate::checkpoint::{Checkpoint, Weights};
use crate::config::LlamaConfig;
use crate::decode_attention::{self, HeadShape};
use crate::error::{ModelError, Result};
use crate::feed_forward::FeedForward;
use crate::kv_cache::{LayerCache, SessionCache};
use crate::linear::{Linear, Projections};
use crate::lora::{RowLoras, SpanAdapter};
use crate::norm::Norm;
use crate::pool::ComputePool;
use crate::rope::Rope;

fn linear(w: &Weights, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> Result<Linear> {
    Linear::load(&w.pp(name), out_dim, in_dim, bias)
}

pub(crate) fn rms_norm(w: &Weights, name: &str, cfg: &LlamaConfig) -> Result<Norm> {
    Norm::load(w, name, cfg.hidden_size, cfg.rms_norm_eps)
}

/// Qwen3's RMSNorm of each query and key head (over `head_dim`), before the rotation.
#[derive(Debug, Clone)]
struct HeadNorms {
    query: Norm,
    key: Norm,
}

impl HeadNorms {
    fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        let norm = |name: &str| Norm::load(w, name, cfg.head_dim, cfg.rms_norm_eps);
        Ok(HeadNorms {
            query: norm("q_norm")?,
            key: norm("k_norm")?,
        })
    }
}

#[derive(Debug, Clone)]
struct Attention {
    /// Q, K and V.
    qkv: Projections<3>,
    head_norms: Option<HeadNorms>,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// Sliding-window attention: keys older than this many positions are not seen.
    window: Option<usize>,
}

impl Attention {
    fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let (qkv_bias, o_bias) = (cfg.has_qkv_bias(), cfg.attention_bias);
        Ok(Attention {
            qkv: Projections::new([
                linear(w, "q_proj", nh * hd, h, qkv_bias)?,
                linear(w, "k_proj", nkv * hd, h, qkv_bias)?,
                linear(w, "v_proj", nkv * hd, h, qkv_bias)?,
            ])?,
            head_norms: cfg.qk_norm.then(|| HeadNorms::load(w, cfg)).transpose()?,
            o_proj: linear(w, "o_proj", h, nh * hd, o_bias)?.interleaved()?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            window: cfg.sliding_window,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        start: usize,
        rope: &Rope,
        cache: &mut LayerCache,
        mask: Option<&Tensor>,
        loras: &RowLoras,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let [q, k, v] = self.projections(x, loras)?;
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            Ok(y.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let (q, k) = self.normed(heads(q, nh)?, heads(k, nkv)?)?;
        let q = rope.apply(&q, start)?;
        let k = rope.apply(&k, start)?;
        let v = heads(v, nkv)?;
        let out = self.attend(&q, &k, &v, start, cache, mask)?;
        self.output(&out, loras)
    }

    /// Q, K and V of `x`, each with its adapter's change.
    fn projections(&self, x: &Tensor, loras: &RowLoras) -> Result<[Tensor; 3]> {
        let [q, k, v] = self.qkv.forward(x)?;
        Ok([
            loras.add(Target::Query, x, q)?,
            loras.add(Target::Key, x, k)?,
            loras.add(Target::Value, x, v)?,
        ])
    }

    fn output(&self, attended: &Tensor, loras: &RowLoras) -> Result<Tensor> {
        let y = self.o_proj.forward(attended)?;
        loras.add(Target::Output, attended, y)
    }

    /// One decode position for each of several sessions: `x` is `[B, hidden]`,
    /// row `i` at position `starts[i]` of `caches[i]`. The projections run once
    /// on all rows; attention runs per session against its own cache.
    fn forward_decode_batch(
        &self,
        x: &Tensor,
        starts: &[usize],
        rotation: &(Tensor, Tensor),
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        loras: &RowLoras,
    ) -> Result<Tensor> {
        let b = starts.len();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let [q, k, v] = self.projections(x, loras)?;
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            Ok(y.reshape((b, 1, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let (q, k) = self.normed(heads(q, nh)?, heads(k, nkv)?)?;
        let q = rope.apply_rows(&q, rotation)?;
        let k = rope.apply_rows(&k, rotation)?;
        let v = heads(v, nkv)?;
        if decode_attention::supported(q.dtype(), q.device()) {
            for (i, (&start, cache)) in starts.iter().zip(caches.iter_mut()).enumerate() {
                cache.keys.slice_set(&k.narrow(0, i, 1)?, 2, start)?;
                cache.values.slice_set(&v.narrow(0, i, 1)?, 2, start)?;
            }
            let keys: Vec<&Tensor> = caches.iter().map(|c| &c.keys).collect();
            let values: Vec<&Tensor> = caches.iter().map(|c| &c.values).collect();
            let shape = self.head_shape();
            let out = decode_attention::attend(&q, &keys, &values, starts, shape)?;
            return self.output(&out, loras);
        }
        let mut rows = Vec::with_capacity(b);
        for (i, (&start, cache)) in starts.iter().zip(caches.iter_mut()).enumerate() {
            let row = |t: &Tensor| t.narrow(0, i, 1);
            rows.push(self.attend(&row(&q)?, &row(&k)?, &row(&v)?, start, cache, None)?);
        }
        let out = Tensor::cat(&rows, 0)?.reshape((b, nh * hd))?;
        self.output(&out, loras)
    }

    fn multiplied_by_candle(&self) -> bool {
        self.qkv.multiplied_by_candle() || self.o_proj.multiplied_by_candle()
    }

    /// The heads as the row-by-row attention kernel takes them.
    fn head_shape(&self) -> HeadShape {
        HeadShape {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            window: self.window,
        }
    }

    /// Queries and keys (`[b, heads, t, hd]`) through the head norms, where the model has them.
    fn normed(&self, q: Tensor, k: Tensor) -> Result<(Tensor, Tensor)> {
        Ok(match &self.head_norms {
            Some(norms) => (norms.query.forward(&q)?, norms.key.forward(&k)?),
            None => (q, k),
        })
    }

    /// Writes `k`, `v` (`[b, kv heads, t, hd]`) at `start` into the cache and
    /// attends `q` to every cached position up to them: `[b, t, heads * hd]`.
    /// A multi-position step's `mask` carries the causal and window limits;
    /// a single position sees the last `window` keys.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        start: usize,
        cache: &mut LayerCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        cache.keys.slice_set(k, 2, start)?;
        cache.values.slice_set(v, 2, start)?;
        self.attend_cached(q, start, cache, mask)
    }

    /// [`Self::attend`] with the step's keys and values already in the cache.
    fn attend_cached(
        &self,
        q: &Tensor,
        start: usize,
        cache: &LayerCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, _, t, _) = q.dims4()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        if b == 1 && decode_attention::supported(q.dtype(), q.device()) {
            // Every step (a prompt, drafts being checked) attends each
            // position as a decode step does, so its outputs are the same
            // bits however the positions were grouped into steps: the
            // tokens of an answer do not depend on how many drafts each
            // step carried (kept-quantized products turn last-bit
            // differences into visible ones). On the CPU it is also the
            // faster way at any length: twice the matrix products' speed
            // for a 512-position prompt (10 blocks of the default model).
            let rows = q.transpose(1, 2)?.contiguous()?.reshape((t, nh, 1, hd))?;
            let keys = vec![&cache.keys; t];
            let values = vec![&cache.values; t];
            let starts: Vec<usize> = (start..start + t).collect();
            let shape = self.head_shape();
            let out = decode_attention::attend(&rows, &keys, &values, &starts, shape)?;
            return Ok(out.reshape((1, t, nh * hd))?);
        }
        let total = start + t;
        let first = match (mask, self.window) {
            (None, Some(window)) => total.saturating_sub(window),
            _ => 0,
        };
        let keys = cache.keys.narrow(2, first, total - first)?;
        let values = cache.values.narrow(2, first, total - first)?;
        let total = total - first;

        // Grouped-query attention without copying K/V per query head: the
        // query heads that share a KV head are stacked along the rows.
        let group = nh / nkv;
        let q = q.reshape((b, nkv, group * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&keys.t()?)? * scale)?.to_dtype(DType::F32)?;
        let scores = match mask {
            Some(mask) => scores
                .reshape((b, nkv, group, t, total))?
                .broadcast_add(mask)?
                .reshape((b, nkv, group * t, total))?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(values.dtype())?;
        Ok(probs
            .matmul(&values)?
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?)
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: Norm,
    self_attn: Attention,
    post_attention_layernorm: Norm,
    mlp: FeedForward,
}

impl DecoderLayer {
    fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        Ok(DecoderLayer {
            input_layernorm: rms_norm(w, "input_layernorm", cfg)?,
            self_attn: Attention::load(&w.pp("self_attn"), cfg)?,
            post_attention_layernorm: rms_norm(w, "post_attention_layernorm", cfg)?,
            mlp: FeedForward::load(w, cfg)?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        start: usize,
        rope: &Rope,
        cache: &mut LayerCache,
        mask: Option<&Tensor>,
        loras: &RowLoras,
    ) -> Result<Tensor> {
        let normed = self.input_layernorm.forward(x)?;
        let attn = self
            .self_attn
            .forward(&normed, start, rope, cache, mask, loras)?;
        self.add_mlp(x, attn, loras)
    }

    fn multiplied_by_candle(&self) -> bool {
        self.self_attn.multiplied_by_candle() || self.mlp.multiplied_by_candle()
    }

    /// The residual of attention, then the MLP's.
    fn add_mlp(&self, x: &Tensor, attn: Tensor, loras: &RowLoras) -> Result<Tensor> {
        let x = (x + attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?, loras)?;
        Ok((x + mlp)?)
    }

    /// [`Self::forward`] for one decode position of each of several sessions (`x`: `[B, hidden]`).
    fn forward_decode_batch(
        &self,
        x: &Tensor,
        starts: &[usize],
        rotation: &(Tensor, Tensor),
        rope: &Rope,
        caches: &mut [&mut LayerCache],
        loras: &RowLoras,
    ) -> Result<Tensor> {
        let attn = self.self_attn.forward_decode_batch(
            &self.input_layernorm.forward(x)?,
            starts,
            rotation,
            rope,
            caches,
            loras,
        )?;
        self.add_mlp(x, attn, loras)
    }
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
