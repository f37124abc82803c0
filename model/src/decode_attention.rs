//! Attention of one new position per session against that session's own KV
//! cache, for every session of a batched decode step at once, on the CPU in
//! f32. Done with candle's ops it is about a dozen small tensors per session
//! and layer, and at 16 sessions their fixed costs outweighed the batched
//! projections; here it is one pass over the cached keys and values.

use candle_core::{DType, Device, Storage, Tensor};

use crate::error::{ModelError, Result};

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
    let HeadShape {
        heads,
        kv_heads,
        head_dim,
        window,
    } = shape;
    let b = starts.len();
    let q = q.flatten_all()?.to_vec1::<f32>()?;
    if q.len() != b * heads * head_dim || keys.len() != b || values.len() != b {
        return Err(ModelError::BatchMismatch);
    }
    let group = heads / kv_heads.max(1);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = vec![0f32; b * heads * head_dim];
    let mut scores = Vec::new();
    for (i, &start) in starts.iter().enumerate() {
        let seen = start + 1;
        let first = window.map_or(0, |w| seen.saturating_sub(w));
        let k_guard = keys[i].storage_and_layout();
        let v_guard = values[i].storage_and_layout();
        let k = cached_rows(&k_guard.0, k_guard.1, kv_heads, seen, head_dim)?;
        let v = cached_rows(&v_guard.0, v_guard.1, kv_heads, seen, head_dim)?;
        let capacity = k_guard.1.dims()[2];
        for h in 0..heads {
            let kv = h / group;
            let q_row = &q[(i * heads + h) * head_dim..][..head_dim];
            let base = kv * capacity * head_dim;
            scores.clear();
            scores.extend(
                (first..seen).map(|t| dot(q_row, &k[base + t * head_dim..][..head_dim]) * scale),
            );
            softmax(&mut scores);
            let o = &mut out[(i * heads + h) * head_dim..][..head_dim];
            for (t, &p) in (first..).zip(scores.iter()) {
                for (o, &x) in o.iter_mut().zip(&v[base + t * head_dim..][..head_dim]) {
                    *o += p * x;
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (b, heads * head_dim), &Device::Cpu)?)
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
