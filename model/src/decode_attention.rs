//! Attention of one new position per session against that session's own KV
//! cache, for every session of a batched decode step at once, on the CPU in
//! f32. Done with candle's ops it is about a dozen small tensors per session
//! and layer, and at 16 sessions their fixed costs outweighed the batched
//! projections; here it is one pass over the cached keys and values.

use candle_core::{DType, Device, Storage, Tensor};

use crate::error::{ModelError, Result};
use crate::quant::parallel::{self, OutPtr};

/// Heads of one attention layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: only the last `window` positions are seen.
    pub window: Option<usize>,
}

/// Whether [`attend`] serves tensors of this dtype on this device.
pub(crate) fn supported(dtype: DType, device: &Device) -> bool {
    dtype == DType::F32 && device.is_cpu()
}

/// `q`: `[B, heads, 1, head_dim]`, row `i` at position `starts[i]`, whose
/// keys and values are already written into `keys[i]`/`values[i]`
/// (`[1, kv_heads, capacity, head_dim]`). Returns `[B, heads * head_dim]`.
pub(crate) fn attend(
    q: &Tensor,
    keys: &[&Tensor],
    values: &[&Tensor],
    starts: &[usize],
    shape: HeadShape,
) -> Result<Tensor> {
    let q = q.flatten_all()?.to_vec1::<f32>()?;
    let out = attend_rows(&q, keys, values, starts, shape)?;
    Ok(Tensor::from_vec(
        out,
        (starts.len(), shape.heads * shape.head_dim),
        &Device::Cpu,
    )?)
}

/// [`attend`] of query rows of plain f32 (`q`: `[B, heads, head_dim]`):
/// `[B, heads * head_dim]` values.
pub(crate) fn attend_rows(
    q: &[f32],
    keys: &[&Tensor],
    values: &[&Tensor],
    starts: &[usize],
    shape: HeadShape,
) -> Result<Vec<f32>> {
    let HeadShape {
        heads,
        kv_heads,
        head_dim,
        window,
    } = shape;
    let b = starts.len();
    if q.len() != b * heads * head_dim || keys.len() != b || values.len() != b {
        return Err(ModelError::BatchMismatch);
    }
    let group = heads / kv_heads.max(1);
    let scale = 1.0 / (head_dim as f32).sqrt();
    // Each session's cache, read in place (the guards outlive the work);
    // a step of several positions passes one session's cache for each, and
    // its lock is read once.
    let mut distinct: Vec<(&Tensor, &Tensor)> = Vec::new();
    let which: Vec<usize> = keys
        .iter()
        .zip(values)
        .map(
            |(&k, &v)| match distinct.iter().position(|(d, _)| d.id() == k.id()) {
                Some(at) => at,
                None => {
                    distinct.push((k, v));
                    distinct.len() - 1
                }
            },
        )
        .collect();
    let guards: Vec<_> = distinct
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let mut caches = Vec::with_capacity(b);
    for (&at, &start) in which.iter().zip(starts) {
        let (k_guard, v_guard) = &guards[at];
        let seen = start + 1;
        caches.push(Cached {
            keys: cached_rows(&k_guard.0, k_guard.1, kv_heads, seen, head_dim)?,
            values: cached_rows(&v_guard.0, v_guard.1, kv_heads, seen, head_dim)?,
            capacity: k_guard.1.dims()[2],
            first: window.map_or(0, |w| seen.saturating_sub(w)),
            seen,
        });
    }
    let mut out = vec![0f32; b * heads * head_dim];
    let out_ptr = OutPtr(out.as_mut_ptr());
    let attend_heads = |units: std::ops::Range<usize>| {
        let mut scores = Vec::new();
        for unit in units {
            let (i, h) = (unit / heads, unit % heads);
            let cache = &caches[i];
            let base = (h / group) * cache.capacity * head_dim;
            let seen = base + cache.first * head_dim..base + cache.seen * head_dim;
            let q_row = &q[unit * head_dim..][..head_dim];
            // SAFETY: unit `unit` alone writes `out[unit * head_dim..][..head_dim]`,
            // inside `out` (b * heads units).
            let o = unsafe { out_ptr.slice(unit * head_dim, head_dim) };
            let head = Head {
                q: q_row,
                keys: &cache.keys[seen.clone()],
                values: &cache.values[seen],
                scale,
            };
            head.attend(&mut scores, o);
        }
    };
    let work = caches.iter().map(|c| c.seen - c.first).sum::<usize>() * heads * head_dim * 2;
    parallel::split(b * heads, work, attend_heads);
    drop(guards);
    Ok(out)
}

/// A session's cached keys and values (`[kv_heads, capacity, head_dim]`)
/// and the positions its new one sees.
struct Cached<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    capacity: usize,
    first: usize,
    seen: usize,
}

/// One query head against the positions it sees of its KV head.
struct Head<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    scale: f32,
}

impl Head<'_> {
    /// Writes the head's output into `out` (`head_dim` values, zeroed).
    fn attend(&self, scores: &mut Vec<f32>, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { self.attend_avx2(scores, out) };
        }
        self.attend_plain(scores, out)
    }

    /// The same code compiled for AVX2: eight lanes where the plain build
    /// has four, and the same bits (the compiler may not reorder float sums).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_avx2(&self, scores: &mut Vec<f32>, out: &mut [f32]) {
        self.attend_plain(scores, out)
    }

    #[inline(always)]
    fn attend_plain(&self, scores: &mut Vec<f32>, out: &mut [f32]) {
        let head_dim = self.q.len();
        scores.clear();
        // Loops, not iterator adapters: an adapter's `fold` is a function
        // of its own, compiled without the caller's AVX2.
        for k in self.keys.chunks_exact(head_dim) {
            scores.push(dot(self.q, k) * self.scale);
        }
        softmax(scores);
        for (&p, v) in scores.iter().zip(self.values.chunks_exact(head_dim)) {
            for (o, &x) in out.iter_mut().zip(v) {
                *o += p * x;
            }
        }
    }
}

/// The f32 contents of a contiguous `[1, kv_heads, capacity, head_dim]`
/// cache tensor with at least `seen` positions.
fn cached_rows<'a>(
    storage: &'a Storage,
    layout: &candle_core::Layout,
    kv_heads: usize,
    seen: usize,
    head_dim: usize,
) -> Result<&'a [f32]> {
    let dims = layout.dims();
    let fits = dims.len() == 4
        && dims[0] == 1
        && dims[1] == kv_heads
        && dims[2] >= seen
        && dims[3] == head_dim
        && layout.is_contiguous();
    let Storage::Cpu(cpu) = storage else {
        return Err(ModelError::CacheLayout);
    };
    if !fits {
        return Err(ModelError::CacheLayout);
    }
    let all = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    all.get(start..start + layout.shape().elem_count())
        .ok_or(ModelError::CacheLayout)
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums let the compiler keep them in one vector register.
    let mut acc = [0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}
