//! Attention of one new position per session against that session's own KV
//! cache, for every session of a batched decode step at once, on the CPU in
//! f32. Done with candle's ops it is about a dozen small tensors per session
//! and layer, and at 16 sessions their fixed costs outweighed the batched
//! projections; here it is one pass over the cached keys and values.

use candle_core::{DType, Device, Storage, Tensor};
use smallvec::SmallVec;

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
    let mut out = Vec::new();
    attend_rows(&q, keys, values, starts, shape, &mut out)?;
    Ok(Tensor::from_vec(
        out,
        (starts.len(), shape.heads * shape.head_dim),
        &Device::Cpu,
    )?)
}

/// Sessions a step's bookkeeping holds without allocating.
const INLINE_SESSIONS: usize = 8;

/// [`attend`] of query rows of plain f32 (`q`: `[B, heads, head_dim]`):
/// `[B, heads * head_dim]` values, into `out`. A step of up to
/// [`INLINE_SESSIONS`] sessions allocates nothing once `out` has held one
/// as large.
pub(crate) fn attend_rows(
    q: &[f32],
    keys: &[&Tensor],
    values: &[&Tensor],
    starts: &[usize],
    shape: HeadShape,
    out: &mut Vec<f32>,
) -> Result<()> {
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
    let mut distinct: SmallVec<[(&Tensor, &Tensor); INLINE_SESSIONS]> = SmallVec::new();
    let which: SmallVec<[usize; INLINE_SESSIONS]> = keys
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
    let guards: SmallVec<[_; INLINE_SESSIONS]> = distinct
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let mut caches: SmallVec<[Cached; INLINE_SESSIONS]> = SmallVec::new();
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
    out.clear();
    out.resize(b * heads * head_dim, 0.0);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let capacity = caches.iter().map(|c| c.capacity).max().unwrap_or(0);
    let attend_units = |units: std::ops::Range<usize>, scores: &mut Vec<f32>| {
        // Room for every position a cache may come to hold, once: a
        // thread's scores then never grow step after step.
        scores.reserve(capacity);
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
            head.attend(scores, o);
        }
    };
    let attend_heads = |units: std::ops::Range<usize>| {
        SCORES.with_borrow_mut(|scores| attend_units(units, scores))
    };
    let work = caches.iter().map(|c| c.seen - c.first).sum::<usize>() * heads * head_dim * 2;
    parallel::split(b * heads, work, attend_heads);
    drop(caches);
    drop(guards);
    Ok(())
}

thread_local! {
    /// A head's scores, kept by each compute thread between heads and steps.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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
        self.attend_plain(scores, out, dots)
    }

    /// The same code compiled for AVX2: eight lanes where the plain build
    /// has four, and the same bits (the compiler may not reorder float sums).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_avx2(&self, scores: &mut Vec<f32>, out: &mut [f32]) {
        // SAFETY (of the closure's call): the CPU has AVX2.
        self.attend_plain(scores, out, |a, b| unsafe { dots_avx2(a, b) })
    }

    /// Each score and each output value is summed in one fixed order
    /// (the bits do not depend on the CPU), but several are summed at once:
    /// a single sum is a chain of dependent additions that keeps the core
    /// waiting on each one's latency (this was a fifth of a decode step).
    #[inline(always)]
    fn attend_plain(
        &self,
        scores: &mut Vec<f32>,
        out: &mut [f32],
        dots: impl Fn(&[f32], [&[f32]; KEYS_AT_ONCE]) -> [f32; KEYS_AT_ONCE],
    ) {
        let head_dim = self.q.len();
        scores.clear();
        // Loops, not iterator adapters: an adapter's `fold` is a function
        // of its own, compiled without the caller's AVX2.
        let mut keys = self.keys.chunks_exact(head_dim * KEYS_AT_ONCE);
        for several in &mut keys {
            let rows = std::array::from_fn(|k| &several[k * head_dim..(k + 1) * head_dim]);
            for d in dots(self.q, rows) {
                scores.push(d * self.scale);
            }
        }
        for k in keys.remainder().chunks_exact(head_dim) {
            scores.push(dot(self.q, k) * self.scale);
        }
        softmax(scores);
        // Output values a register's width at a time, over every position:
        // independent sums, each in position order.
        let mut columns = out.chunks_exact_mut(OUT_LANES);
        let mut at = 0;
        for lanes in &mut columns {
            self.weigh_values::<OUT_LANES>(scores, at, lanes);
            at += OUT_LANES;
        }
        let mut columns = columns.into_remainder().chunks_exact_mut(8);
        for lanes in &mut columns {
            self.weigh_values::<8>(scores, at, lanes);
            at += 8;
        }
        for lane in columns.into_remainder().chunks_exact_mut(1) {
            self.weigh_values::<1>(scores, at, lane);
            at += 1;
        }
    }

    /// Output values `at..at + N` (into `lanes`): the values of every
    /// position weighted by its score, each sum in position order.
    #[inline(always)]
    fn weigh_values<const N: usize>(&self, scores: &[f32], at: usize, lanes: &mut [f32]) {
        let mut acc = [0f32; N];
        for (&p, v) in scores.iter().zip(self.values.chunks_exact(self.q.len())) {
            let v = &v[at..at + N];
            for j in 0..N {
                acc[j] += p * v[j];
            }
        }
        lanes.copy_from_slice(&acc);
    }
}

/// Output values summed at once: eight AVX2 registers.
const OUT_LANES: usize = 64;

/// Positions scored at once: eight sums (of eight lanes) in registers.
const KEYS_AT_ONCE: usize = 8;

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

/// [`dot`] of one row against several, the sums interleaved: each is
/// [`dot`]'s, in its order.
#[inline(always)]
fn dots(a: &[f32], b: [&[f32]; KEYS_AT_ONCE]) -> [f32; KEYS_AT_ONCE] {
    std::array::from_fn(|k| dot(a, b[k]))
}

/// [`dots`] in AVX2 registers, spelled out: left to the compiler, the
/// sums were vectorised across the rows (shuffles on every step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dots_avx2(a: &[f32], b: [&[f32]; KEYS_AT_ONCE]) -> [f32; KEYS_AT_ONCE] {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let chunks = a.len() / 8 * 8;
    assert!(b.iter().all(|b| b.len() == a.len()));
    let mut acc = [_mm256_setzero_ps(); KEYS_AT_ONCE];
    let mut i = 0;
    while i < chunks {
        // SAFETY: i + 8 <= chunks <= the length of `a` and of each row of `b`.
        let x = unsafe { _mm256_loadu_ps(a.as_ptr().add(i)) };
        for (acc, b) in acc.iter_mut().zip(&b) {
            // SAFETY: as above.
            let y = unsafe { _mm256_loadu_ps(b.as_ptr().add(i)) };
            // A product, then a sum: two roundings, as `dot` (no fused multiply-add).
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
        }
        i += 8;
    }
    let mut sums = [0f32; KEYS_AT_ONCE];
    for ((sum, acc), b) in sums.iter_mut().zip(acc).zip(&b) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight values.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let tail: f32 = a[chunks..]
            .iter()
            .zip(&b[chunks..])
            .map(|(x, y)| x * y)
            .sum();
        *sum = lanes.iter().sum::<f32>() + tail;
    }
    sums
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

#[cfg(test)]
mod tests {
    use super::*;

    /// One position at a time and one output value at a time: the order
    /// every score and output is summed in.
    fn attend_one_by_one(head: &Head, out: &mut [f32]) {
        let head_dim = head.q.len();
        let mut scores: Vec<f32> = head
            .keys
            .chunks_exact(head_dim)
            .map(|k| dot(head.q, k) * head.scale)
            .collect();
        softmax(&mut scores);
        for (&p, v) in scores.iter().zip(head.values.chunks_exact(head_dim)) {
            for (o, &x) in out.iter_mut().zip(v) {
                *o += p * x;
            }
        }
    }

    #[test]
    fn several_sums_at_once_give_the_bits_of_one_at_a_time() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        for head_dim in [64, 80, 128, 12, 200] {
            for positions in [1, 3, 7, 8, 9, 17, 40] {
                let q: Vec<f32> = (0..head_dim).map(|_| next()).collect();
                let keys: Vec<f32> = (0..positions * head_dim).map(|_| next()).collect();
                let values: Vec<f32> = (0..positions * head_dim).map(|_| next()).collect();
                let head = Head {
                    q: &q,
                    keys: &keys,
                    values: &values,
                    scale: 0.125,
                };
                let mut expected = vec![0f32; head_dim];
                attend_one_by_one(&head, &mut expected);
                let mut got = vec![0f32; head_dim];
                head.attend(&mut Vec::new(), &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&expected),
                    "head_dim {head_dim}, {positions} positions"
                );
                let mut plain = vec![0f32; head_dim];
                head.attend_plain(&mut Vec::new(), &mut plain, dots);
                assert_eq!(bits(&plain), bits(&expected), "plain, head_dim {head_dim}");
            }
        }
    }
}
