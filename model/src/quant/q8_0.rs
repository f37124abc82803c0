//! Q8_0 weight rows as GGUF stores them times activations rounded to Q8_0,
//! eight weight rows at a time: the eight rows are read where they lie, and
//! their eight block sums meet in the lanes of one register. The LM head
//! of most GGUFs is Q8_0; a page keeps it in this layout (a repacked copy
//! would hold the largest matrix twice while it is made), a native head
//! and Q8_0 spans repack it where the CPU has AVX-512 VNNI
//! ([`InterleavedQ8`], with this layout's bits).
//!
//! Every kernel sums in one order, so a native head and the page's give
//! the same bits: a block's integer sum (exact; converted to f32 exactly,
//! since |sum| <= 32 × 128 × 127 < 2^24), times `d_w * d_x`, added to the
//! row's total block after block. A multiply and an add, not a fused
//! multiply-add: wasm has none, and a software one per block would cost more
//! than the product.

use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};
use half::f16;

use super::parallel::{self, OutPtr, Shape};

mod interleaved;
pub(crate) use interleaved::{ActivationBlocks, InterleavedQ8};

/// Weight rows a kernel call computes.
const GROUP: usize = 8;
/// Values per block.
const BLOCK: usize = 32;
/// A block's bytes: `d` (f16), then 32 signed values.
const BLOCK_BYTES: usize = 34;
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == BLOCK_BYTES);

/// `GROUP` weight rows (`per_row` blocks each, row after row) times one
/// activation row's blocks.
type GroupKernel = fn(per_row: usize, weights: &[BlockQ8_0], x: &[BlockQ8_0]) -> [f32; GROUP];

/// `out[r * rows + o] = dot(weight row o, input row r)`.
pub(crate) fn matmul_rows(weights: &[BlockQ8_0], shape: Shape, input: &[f32], out: &mut [f32]) {
    matmul_with(kernel(), weights, shape, input, out)
}

fn matmul_with(
    kernel: GroupKernel,
    weights: &[BlockQ8_0],
    shape: Shape,
    input: &[f32],
    out: &mut [f32],
) {
    let Shape { rows, cols, batch } = shape;
    let per_row = cols / BLOCK;
    let mut activations = vec![BlockQ8_0::zeros(); batch * per_row];
    for (row, blocks) in input
        .chunks_exact(cols)
        .zip(activations.chunks_exact_mut(per_row))
    {
        BlockQ8_0::from_float(row, blocks);
    }
    let activations = &activations;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run = |groups: std::ops::Range<usize>| {
        for g in groups {
            let first = g * GROUP;
            let valid = GROUP.min(rows - first);
            let group = &weights[first * per_row..(first + valid) * per_row];
            for (r, x) in activations.chunks_exact(per_row).enumerate() {
                let sums = match valid {
                    GROUP => kernel(per_row, group, x),
                    _ => short_group(per_row, group, x),
                };
                for (j, &value) in sums[..valid].iter().enumerate() {
                    // SAFETY: each (r, o) is written by exactly one work
                    // item, and r * rows + o < batch * rows = out.len().
                    unsafe { out_ptr.write(r * rows + first + j, value) };
                }
            }
        }
    };
    parallel::split(rows.div_ceil(GROUP), rows * cols * batch, run);
}

fn bytes_of(blocks: &[BlockQ8_0]) -> &[u8] {
    // SAFETY: `BlockQ8_0` is a `repr(C)` struct of an f16 and 32 bytes with
    // no padding (34 bytes, asserted above): all its bytes are initialised.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

fn scale_of(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// One weight row's dot product with `x`, in the kernels' order.
fn row_dot(weights: &[u8], x: &[u8]) -> f32 {
    let mut total = 0f32;
    for (w, x) in weights
        .chunks_exact(BLOCK_BYTES)
        .zip(x.chunks_exact(BLOCK_BYTES))
    {
        let sum: i32 = w[2..]
            .iter()
            .zip(&x[2..])
            .map(|(&w, &x)| (w as i8) as i32 * (x as i8) as i32)
            .sum();
        total += (scale_of(w) * scale_of(x)) * sum as f32;
    }
    total
}

/// The last rows of a matrix whose rows are not a multiple of eight.
fn short_group(per_row: usize, weights: &[BlockQ8_0], x: &[BlockQ8_0]) -> [f32; GROUP] {
    let (weights, x) = (bytes_of(weights), bytes_of(x));
    let mut out = [0f32; GROUP];
    for (o, row) in out
        .iter_mut()
        .zip(weights.chunks_exact(per_row * BLOCK_BYTES))
    {
        *o = row_dot(row, x);
    }
    out
}

/// The kernels' arithmetic in plain Rust, for CPUs without AVX2.
#[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
fn portable(per_row: usize, weights: &[BlockQ8_0], x: &[BlockQ8_0]) -> [f32; GROUP] {
    short_group(per_row, weights, x)
}

/// The fastest kernel this machine runs (all give the same bits).
fn kernel() -> GroupKernel {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        return x86::eight_rows;
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return wasm::eight_rows;
    #[allow(unreachable_code)]
    portable
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{bytes_of, BlockQ8_0, BLOCK_BYTES, GROUP};

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
    }

    /// Whether the CPU has AVX-VNNI's byte products (Intel since Alder
    /// Lake and Sapphire Rapids, AMD since Zen 4). Cached by std.
    fn vnni() -> bool {
        is_x86_feature_detected!("avxvnni")
    }

    pub fn eight_rows(per_row: usize, weights: &[BlockQ8_0], x: &[BlockQ8_0]) -> [f32; GROUP] {
        assert!(
            weights.len() >= GROUP * per_row && x.len() >= per_row,
            "short rows"
        );
        let (w, x) = (bytes_of(weights).as_ptr(), bytes_of(x).as_ptr());
        // SAFETY: `available()` held when this kernel was chosen, and the
        // assert keeps every read inside the slices.
        unsafe {
            match vnni() {
                true => group_vnni(per_row, w, x),
                false => group_avx2(per_row, w, x),
            }
        }
    }

    /// Lane `j` of the result: the sum of `v[j]`'s eight lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sum_each(v: [__m256i; GROUP]) -> __m256i {
        let t0 = _mm256_hadd_epi32(v[0], v[1]);
        let t1 = _mm256_hadd_epi32(v[2], v[3]);
        let t2 = _mm256_hadd_epi32(v[4], v[5]);
        let t3 = _mm256_hadd_epi32(v[6], v[7]);
        // Low halves: rows 0-3's sums over their low 128 bits; high halves: over their high ones.
        let u0 = _mm256_hadd_epi32(t0, t1);
        let u1 = _mm256_hadd_epi32(t2, t3);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(u0, u1, 0x20),
            _mm256_permute2x128_si256(u0, u1, 0x31),
        )
    }

    /// The f16 at `p` as an f32 in every lane.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn broadcast_half(p: *const u8) -> __m256 {
        let h = std::ptr::read_unaligned(p.cast::<u16>());
        _mm256_cvtph_ps(_mm_set1_epi16(h as i16))
    }

    /// The group kernel with `$dot` summing a block's products by lanes
    /// of four (AVX-VNNI does it in one instruction, AVX2 in two).
    macro_rules! group_kernel {
        ($name:ident, $features:literal, $dot:ident) => {
            #[target_feature(enable = $features)]
            unsafe fn $name(per_row: usize, w: *const u8, x: *const u8) -> [f32; GROUP] {
                let row_bytes = per_row * BLOCK_BYTES;
                let mut total = _mm256_setzero_ps();
                for b in 0..per_row {
                    let xb = x.add(b * BLOCK_BYTES);
                    let activations = _mm256_loadu_si256(xb.add(2).cast());
                    let mut sums = [_mm256_setzero_si256(); GROUP];
                    let mut scales = [0u16; GROUP];
                    for (j, (sum, scale)) in sums.iter_mut().zip(scales.iter_mut()).enumerate() {
                        let wb = w.add(j * row_bytes + b * BLOCK_BYTES);
                        *scale = std::ptr::read_unaligned(wb.cast::<u16>());
                        let values = _mm256_loadu_si256(wb.add(2).cast());
                        // |w| (unsigned) times x with w's sign: the operands
                        // of an unsigned-by-signed byte product.
                        let magnitudes = _mm256_sign_epi8(values, values);
                        let signed = _mm256_sign_epi8(activations, values);
                        *sum = $dot(magnitudes, signed);
                    }
                    let block_sums = _mm256_cvtepi32_ps(sum_each(sums));
                    let weight_scales = _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().cast()));
                    let scale = _mm256_mul_ps(weight_scales, broadcast_half(xb));
                    total = _mm256_add_ps(total, _mm256_mul_ps(scale, block_sums));
                }
                let mut out = [0f32; GROUP];
                _mm256_storeu_ps(out.as_mut_ptr(), total);
                out
            }
        };
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_avx2(magnitudes: __m256i, signed: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(magnitudes, signed);
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn dot_vnni(magnitudes: __m256i, signed: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitudes, signed)
    }

    group_kernel!(group_avx2, "avx2,f16c", dot_avx2);
    group_kernel!(group_vnni, "avx2,f16c,avxvnni", dot_vnni);
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod wasm {
    use std::arch::wasm32::*;

    use super::{bytes_of, scale_of, BlockQ8_0, BLOCK_BYTES, GROUP};

    /// Row by row (the page has one thread), each block's products summed
    /// in 32-bit lanes: the exact integer sum the other kernels take.
    pub fn eight_rows(per_row: usize, weights: &[BlockQ8_0], x: &[BlockQ8_0]) -> [f32; GROUP] {
        let (weights, x) = (bytes_of(weights), bytes_of(x));
        let row_bytes = per_row * BLOCK_BYTES;
        assert!(
            weights.len() >= GROUP * row_bytes && x.len() >= row_bytes,
            "short rows"
        );
        let mut out = [0f32; GROUP];
        for (o, row) in out.iter_mut().zip(weights.chunks_exact(row_bytes)) {
            let mut total = 0f32;
            for (w, x) in row
                .chunks_exact(BLOCK_BYTES)
                .zip(x.chunks_exact(BLOCK_BYTES))
            {
                total += (scale_of(w) * scale_of(x)) * block_sum(&w[2..], &x[2..]) as f32;
            }
            *o = total;
        }
        out
    }

    /// The sum of the products of 32 signed bytes.
    #[inline]
    fn block_sum(w: &[u8], x: &[u8]) -> i32 {
        assert!(w.len() >= 32 && x.len() >= 32);
        // SAFETY: both slices hold at least 32 bytes (asserted), read unaligned.
        let (w0, w1, x0, x1) = unsafe {
            (
                v128_load(w.as_ptr().cast()),
                v128_load(w.as_ptr().add(16).cast()),
                v128_load(x.as_ptr().cast()),
                v128_load(x.as_ptr().add(16).cast()),
            )
        };
        let pairs = |w: v128, x: v128| {
            i32x4_add(
                i32x4_extadd_pairwise_i16x8(i16x8_extmul_low_i8x16(w, x)),
                i32x4_extadd_pairwise_i16x8(i16x8_extmul_high_i8x16(w, x)),
            )
        };
        let sums = i32x4_add(pairs(w0, x0), pairs(w1, x1));
        i32x4_extract_lane::<0>(sums)
            + i32x4_extract_lane::<1>(sums)
            + i32x4_extract_lane::<2>(sums)
            + i32x4_extract_lane::<3>(sums)
    }
}

/// A `rows` x `cols` Q8_0 matrix holding both ends of the 8-bit range, and
/// `batch` input rows, for the kernels' tests.
#[cfg(test)]
fn test_matrix(rows: usize, cols: usize, batch: usize) -> (Vec<BlockQ8_0>, Vec<f32>) {
    let weights: Vec<f32> = (0..rows * cols)
        .map(|i| match i % 97 {
            0 => -1.0,
            1 => 1.0,
            _ => ((i * 7919) % 1013) as f32 / 506.5 - 1.0,
        })
        .collect();
    let mut blocks = vec![BlockQ8_0::zeros(); rows * cols / BLOCK];
    BlockQ8_0::from_float(&weights, &mut blocks);
    let input = (0..batch * cols)
        .map(|i| ((i * 104729) % 2017) as f32 / 100.0 - 10.0)
        .collect();
    (blocks, input)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fastest kernel and the plain one agree bit for bit (the page's
    /// head gives the native head's logits), including the extremes of
    /// the 8-bit range and a row count that leaves a short group.
    #[test]
    fn the_kernels_give_the_same_bits() {
        let (rows, cols) = (45, 512);
        for batch in [1, 3] {
            let (weights, input) = test_matrix(rows, cols, batch);
            let shape = Shape { rows, cols, batch };
            let mut fast = vec![0f32; batch * rows];
            let mut plain = vec![0f32; batch * rows];
            matmul_with(kernel(), &weights, shape, &input, &mut fast);
            matmul_with(portable, &weights, shape, &input, &mut plain);
            let differ = fast
                .iter()
                .zip(&plain)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differ, 0, "batch {batch}: {differ} outputs differ");
        }
    }
}
