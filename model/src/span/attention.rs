//! A decoder layer's attention: the Q, K and V projections (Qwen3's head
//! norms), the rotation, the KV cache written in place, and attention over
//! it (row by row on the CPU, `decode_attention.rs`; matrix products
//! elsewhere).

use candle_core::{DType, Tensor};

use crate::adapter::Target;
use crate::checkpoint::Weights;
use crate::config::LlamaConfig;
use crate::decode_attention::{self, HeadShape};
use crate::error::Result;
use crate::kv_cache::LayerCache;
use crate::linear::{Linear, Projections};
use crate::lora::RowLoras;
use crate::norm::Norm;
use crate::rope::Rope;

fn linear(w: &Weights, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> Result<Linear> {
    Linear::load(&w.pp(name), out_dim, in_dim, bias)
}

/// Qwen3's RMSNorm of each query and key head (over `head_dim`), before the rotation.
#[derive(Debug, Clone)]
pub(super) struct HeadNorms {
    pub(super) query: Norm,
    pub(super) key: Norm,
}

impl HeadNorms {
    pub(super) fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
        let norm = |name: &str| Norm::load(w, name, cfg.head_dim, cfg.rms_norm_eps);
        Ok(HeadNorms {
            query: norm("q_norm")?,
            key: norm("k_norm")?,
        })
    }
}

#[derive(Debug, Clone)]
pub(super) struct Attention {
    /// Q, K and V.
    pub(super) qkv: Projections<3>,
    pub(super) head_norms: Option<HeadNorms>,
    pub(super) o_proj: Linear,
    pub(super) num_heads: usize,
    pub(super) num_kv_heads: usize,
    pub(super) head_dim: usize,
    /// Sliding-window attention: keys older than this many positions are not seen.
    pub(super) window: Option<usize>,
}

impl Attention {
    pub(super) fn load(w: &Weights, cfg: &LlamaConfig) -> Result<Self> {
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

    pub(super) fn forward(
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
    pub(super) fn forward_decode_batch(
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

    pub(super) fn multiplied_by_candle(&self) -> bool {
        self.qkv.multiplied_by_candle() || self.o_proj.multiplied_by_candle()
    }

    /// The heads as the row-by-row attention kernel takes them.
    pub(super) fn head_shape(&self) -> HeadShape {
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
