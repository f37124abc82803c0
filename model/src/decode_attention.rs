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
    // Work units: a KV head with the query heads that share it, for a few
    // consecutive rows of one cache (a prompt's positions).
    let rows_at_once = (QUERIES_AT_ONCE / group).max(1);
    let mut tiles: SmallVec<[(usize, usize); INLINE_SESSIONS]> = SmallVec::new();
    let mut row = 0;
    while row < b {
        let mut end = row + 1;
        while end < b && end - row < rows_at_once && which[end] == which[row] {
            end += 1;
        }
        tiles.push((row, end));
        row = end;
    }
    let most_queries = rows_at_once * group;
    let attend_units = |units: std::ops::Range<usize>, scores: &mut Vec<f32>| {
        // Room for every position a cache may come to hold, once: a
        // thread's scores then never grow step after step (cleared first:
        // room beyond the last tile's scores would double it).
        scores.clear();
        scores.reserve(most_queries * capacity);
        for unit in units {
            let ((rows_start, rows_end), kv) = (tiles[unit / kv_heads], unit % kv_heads);
            let cache = &caches[rows_start];
            let base = kv * cache.capacity * head_dim;
            let span = base..base + cache.capacity * head_dim;
            let mut queries: SmallVec<[Query; QUERIES_AT_ONCE]> = SmallVec::new();
            for i in rows_start..rows_end {
                let c = &caches[i];
                for h in kv * group..(kv + 1) * group {
                    let at = (i * heads + h) * head_dim;
                    queries.push(Query {
                        q: &q[at..at + head_dim],
                        first: c.first,
                        seen: c.seen,
                        // SAFETY: query (i, h) alone writes
                        // `out[at..at + head_dim]`, inside `out` (b * heads
                        // queries), and each belongs to one unit.
                        out: unsafe { out_ptr.slice(at, head_dim) },
                    });
                }
            }
            let tile = Tile {
                keys: &cache.keys[span.clone()],
                values: &cache.values[span],
                head_dim,
                scale,
            };
            tile.attend(&mut queries, scores);
        }
    };
    let attend_tiles = |units: std::ops::Range<usize>| {
        SCORES.with_borrow_mut(|scores| attend_units(units, scores))
    };
    let work = caches.iter().map(|c| c.seen - c.first).sum::<usize>() * heads * head_dim * 2;
    parallel::split(tiles.len() * kv_heads, work, attend_tiles);
    drop(caches);
    drop(guards);
    Ok(())
}

/// Queries attended together (a KV head's query heads, for as many rows of
/// one cache as fit): each key and value read serves all of them while it
/// is in the nearest cache (one query at a time, a long prompt's attention
/// waited on reading them). A model with more query heads per KV head
/// takes them all, one row at a time.
const QUERIES_AT_ONCE: usize = 16;

/// Positions whose keys (or values) are read once for all of a tile's
/// queries: 8 KB at a head size of 64, well inside the first-level cache.
const POSITIONS_AT_ONCE: usize = 32;

thread_local! {
    /// A tile's scores, kept by each compute thread between tiles and steps.
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

/// One query head of one row: it sees positions `first..seen` of its KV
/// head, and its output goes to `out` (`head_dim` values, zeroed).
struct Query<'a> {
    q: &'a [f32],
    first: usize,
    seen: usize,
    out: &'a mut [f32],
}

/// One KV head's cached keys and values (`[capacity, head_dim]`).
struct Tile<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    head_dim: usize,
    scale: f32,
}

impl Tile<'_> {
    /// Attends every query to the positions it sees. Each query's scores
    /// and outputs are the bits of attending it alone (see the tests):
    /// a score does not depend on which keys it was computed with, and
    /// each output value is summed in position order.
    fn attend(&self, queries: &mut [Query], scores: &mut Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { self.attend_avx2(queries, scores) };
        }
        self.attend_plain(queries, scores, dots)
    }

    /// The same code compiled for AVX2: eight lanes where the plain build
    /// has four, and the same bits (the compiler may not reorder float sums).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_avx2(&self, queries: &mut [Query], scores: &mut Vec<f32>) {
        // SAFETY (of the closure's call): the CPU has AVX2.
        self.attend_plain(queries, scores, |a, b| unsafe { dots_avx2(a, b) })
    }

    /// Each score and each output value is summed in one fixed order
    /// (the bits do not depend on the CPU), but several are summed at once:
    /// a single sum is a chain of dependent additions that keeps the core
    /// waiting on each one's latency (this was a fifth of a decode step).
    #[inline(always)]
    fn attend_plain(
        &self,
        queries: &mut [Query],
        scores: &mut Vec<f32>,
        dots: impl Fn(&[f32], [&[f32]; KEYS_AT_ONCE]) -> [f32; KEYS_AT_ONCE],
    ) {
        let head_dim = self.head_dim;
        let (Some(lo), Some(hi)) = (
            queries.iter().map(|q| q.first).min(),
            queries.iter().map(|q| q.seen).max(),
        ) else {
            return;
        };
        let width = hi - lo;
        scores.clear();
        scores.resize(queries.len() * width, 0.0);
        // Loops, not iterator adapters: an adapter's `fold` is a function
        // of its own, compiled without the caller's AVX2.
        let mut block = lo;
        while block < hi {
            let block_end = (block + POSITIONS_AT_ONCE).min(hi);
            for (n, query) in queries.iter().enumerate() {
                let (from, to) = (block.max(query.first), block_end.min(query.seen));
                let mut at = from;
                while at + KEYS_AT_ONCE <= to {
                    let rows = std::array::from_fn(|k| {
                        &self.keys[(at + k) * head_dim..(at + k + 1) * head_dim]
                    });
                    let row_scores = &mut scores[n * width + at - lo..][..KEYS_AT_ONCE];
                    for (s, d) in row_scores.iter_mut().zip(dots(query.q, rows)) {
                        *s = d * self.scale;
                    }
                    at += KEYS_AT_ONCE;
                }
                while at < to {
                    let key = &self.keys[at * head_dim..(at + 1) * head_dim];
                    scores[n * width + at - lo] = dot(query.q, key) * self.scale;
                    at += 1;
                }
            }
            block = block_end;
        }
        for (n, query) in queries.iter().enumerate() {
            softmax(&mut scores[n * width + query.first - lo..n * width + query.seen - lo]);
        }
        let mut block = lo;
        while block < hi {
            let block_end = (block + POSITIONS_AT_ONCE).min(hi);
            for (n, query) in queries.iter_mut().enumerate() {
                let (from, to) = (block.max(query.first), block_end.min(query.seen));
                if from >= to {
                    continue;
                }
                let weights = &scores[n * width + from - lo..n * width + to - lo];
                let values = &self.values[from * head_dim..to * head_dim];
                weigh_values(weights, values, query.out);
            }
            block = block_end;
        }
    }
}

/// Adds the `values` rows (`[positions, head_dim]`) weighted by `weights`
/// to `out`, each output value summed in position order, a register's
/// width of them at a time (independent sums).
#[inline(always)]
fn weigh_values(weights: &[f32], values: &[f32], out: &mut [f32]) {
    let head_dim = out.len();
    let mut columns = out.chunks_exact_mut(OUT_LANES);
    let mut at = 0;
    for lanes in &mut columns {
        weigh_lanes::<OUT_LANES>(weights, values, head_dim, at, lanes);
        at += OUT_LANES;
    }
    let mut columns = columns.into_remainder().chunks_exact_mut(8);
    for lanes in &mut columns {
        weigh_lanes::<8>(weights, values, head_dim, at, lanes);
        at += 8;
    }
    for lane in columns.into_remainder().chunks_exact_mut(1) {
        weigh_lanes::<1>(weights, values, head_dim, at, lane);
        at += 1;
    }
}

/// Output values `at..at + N` (`lanes`, added to): the values of every
/// position weighted by its weight, in position order.
#[inline(always)]
fn weigh_lanes<const N: usize>(
    weights: &[f32],
    values: &[f32],
    head_dim: usize,
    at: usize,
    lanes: &mut [f32],
) {
    let mut acc: [f32; N] = std::array::from_fn(|j| lanes[j]);
    for (&p, v) in weights.iter().zip(values.chunks_exact(head_dim)) {
        let v = &v[at..at + N];
        for j in 0..N {
            acc[j] += p * v[j];
        }
    }
    lanes.copy_from_slice(&acc);
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
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
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
    // Each key's eight lanes summed in `dot`'s order, all keys at once:
    // the lanes are transposed so that register j holds lane j of every
    // key, and the registers are added in lane order (one key's lanes
    // summed one after another cost a third of a long prompt's attention).
    let lanes = transpose_8x8(acc);
    // `Iterator::sum`'s start, whatever the standard library takes for it.
    let empty_sum = std::iter::empty::<f32>().sum::<f32>();
    let mut sums = _mm256_set1_ps(empty_sum);
    for lane in lanes {
        sums = _mm256_add_ps(sums, lane);
    }
    // Each key's values past the last whole eight, summed as `dot` sums
    // them (from `Iterator::sum`'s start: no values leave just that). A
    // loop, not `map(..).sum()`: an adapter's fold is a function of its
    // own, called eight times a call here and compiled without AVX2.
    let mut tails = [empty_sum; KEYS_AT_ONCE];
    for (tail, b) in tails.iter_mut().zip(&b) {
        let mut i = chunks;
        while i < a.len() {
            *tail += a[i] * b[i];
            i += 1;
        }
    }
    // SAFETY: `tails` holds eight values.
    let sums = _mm256_add_ps(sums, unsafe { _mm256_loadu_ps(tails.as_ptr()) });
    let mut out = [0f32; KEYS_AT_ONCE];
    // SAFETY: `out` holds eight values.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sums) };
    out
}

/// Rows to columns: lane `j` of result `k` is lane `k` of `rows[j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn transpose_8x8(rows: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::{
        _mm256_permute2f128_ps, _mm256_shuffle_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };
    let [r0, r1, r2, r3, r4, r5, r6, r7] = rows;
    // Pairs of rows interleaved, then quads, within each 128-bit half.
    let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
    let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
    let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
    let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
    let (q0, q1) = (
        _mm256_shuffle_ps::<0x44>(t0, t2),
        _mm256_shuffle_ps::<0xee>(t0, t2),
    );
    let (q2, q3) = (
        _mm256_shuffle_ps::<0x44>(t1, t3),
        _mm256_shuffle_ps::<0xee>(t1, t3),
    );
    let (q4, q5) = (
        _mm256_shuffle_ps::<0x44>(t4, t6),
        _mm256_shuffle_ps::<0xee>(t4, t6),
    );
    let (q6, q7) = (
        _mm256_shuffle_ps::<0x44>(t5, t7),
        _mm256_shuffle_ps::<0xee>(t5, t7),
    );
    // Lanes 0-3 of rows 0-3 and 4-7 from the low halves, lanes 4-7 from the high.
    [
        _mm256_permute2f128_ps::<0x20>(q0, q4),
        _mm256_permute2f128_ps::<0x20>(q1, q5),
        _mm256_permute2f128_ps::<0x20>(q2, q6),
        _mm256_permute2f128_ps::<0x20>(q3, q7),
        _mm256_permute2f128_ps::<0x31>(q0, q4),
        _mm256_permute2f128_ps::<0x31>(q1, q5),
        _mm256_permute2f128_ps::<0x31>(q2, q6),
        _mm256_permute2f128_ps::<0x31>(q3, q7),
    ]
}

/// Scores to weights. Written in plain float operations that the compiler
/// turns into vector code (libm's `exp` one score at a time, and one
/// running sum, were most of a long context's attention), in a fixed order:
/// the same bits in every build and on every CPU.
#[inline(always)]
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in scores.iter_mut() {
        *s = exp_at_most_zero(*s - max);
    }
    // Eight partial sums, each in position order, then added in order.
    let mut partial = [0f32; 8];
    let mut chunks = scores.chunks_exact(8);
    for eight in &mut chunks {
        for j in 0..8 {
            partial[j] += eight[j];
        }
    }
    let mut sum = 0f32;
    for p in partial {
        sum += p;
    }
    for &s in chunks.remainder() {
        sum += s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

/// 2^23: the floats from here to 2^24 are the integers, each in its low bits.
const MANTISSA_ONE: f32 = 8_388_608.0;
/// An f32's exponent field holds its power of two plus this.
const EXPONENT_BIAS: f32 = 127.0;

/// e^x for x <= 0 (a score less the largest), within about two units in
/// the last place: x = n ln 2 + r with |r| <= ln 2 / 2, e^x = 2^n e^r, e^r
/// by Cephes' `expf` polynomial. Products and sums only, no fused
/// multiply-add, so no build or CPU changes a bit.
#[inline(always)]
fn exp_at_most_zero(x: f32) -> f32 {
    // Below this, 2^n is no longer a normal f32 (and e^x ~ 1e-38 weighs
    // nothing next to the largest score's 1).
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    // ln 2 in two parts: n * LN2_HIGH is exact for the n that occur.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    let r = x - n * LN2_HIGH - n * LN2_LOW;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * (r * r) + r + 1.0;
    // 2^n for -126 <= n <= 0, built from its exponent bits: n + 127 is
    // read off the low bits of 2^23 + n + 127 (exact for these integers),
    // which vectorises; `n as i32` saturates, and its checks were done one
    // lane at a time (a tenth of a long context's attention).
    let biased = (n + (EXPONENT_BIAS + MANTISSA_ONE)).to_bits() - MANTISSA_ONE.to_bits();
    let two_to_n = f32::from_bits(biased << 23);
    e_r * two_to_n
}

#[cfg(test)]
mod tests;
