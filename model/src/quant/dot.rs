//! Block dot products candle leaves scalar, vectorised (chosen at run time,
//! so one binary runs on every x86-64 machine).

use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8_1};

use super::parallel::Kernels;

// The byte layouts the vector kernels read (ggml's): `d`, `m` (or `s`) as
// f16, then the packed values.
const Q4_1_BYTES: usize = 20;
const Q8_1_BYTES: usize = 36;
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == Q4_1_BYTES);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == Q8_1_BYTES);

/// Q4_1 weights against Q8_1 activations: AVX2 where the CPU has it.
pub(crate) fn q4_1_q8_1() -> Kernels<BlockQ4_1> {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        return Kernels {
            one: x86::q4_1_q8_1,
            four: x86::q4_1_q8_1_x4,
            batched: Some(x86::q4_1_q8_1_batched),
        };
    }
    Kernels::candle()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::lanes::sum_lanes;

    use super::{BlockQ4_1, BlockQ8_1, Q4_1_BYTES, Q8_1_BYTES};

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    pub fn q4_1_q8_1(n: usize, xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
        let blocks = (n / 32).min(xs.len()).min(ys.len());
        // SAFETY: `available()` was true when this kernel was chosen, and
        // `blocks` blocks lie inside both slices.
        unsafe { one_row(blocks, xs.as_ptr().cast(), ys.as_ptr().cast()) }
    }

    pub fn q4_1_q8_1_x4(
        n: usize,
        xs0: &[BlockQ4_1],
        xs1: &[BlockQ4_1],
        xs2: &[BlockQ4_1],
        xs3: &[BlockQ4_1],
        ys: &[BlockQ8_1],
    ) -> (f32, f32, f32, f32) {
        let blocks = [xs0.len(), xs1.len(), xs2.len(), xs3.len(), ys.len()]
            .into_iter()
            .fold(n / 32, usize::min);
        let rows = [xs0, xs1, xs2, xs3].map(|r| r.as_ptr().cast::<u8>());
        // SAFETY: as for `q4_1_q8_1`, for each of the four rows.
        let [a, b, c, d] = unsafe { four_rows(blocks, rows, ys.as_ptr().cast()) };
        (a, b, c, d)
    }

    pub fn q4_1_q8_1_batched(n: usize, xs: &[BlockQ4_1], ys: [&[BlockQ8_1]; 4]) -> [f32; 4] {
        let blocks = ys
            .iter()
            .map(|y| y.len())
            .fold(xs.len().min(n / 32), usize::min);
        // SAFETY: as for `q4_1_q8_1`, for each of the four activation rows.
        unsafe { four_activations(blocks, xs.as_ptr().cast(), ys.map(|y| y.as_ptr().cast())) }
    }

    /// The two f16s at `p` as f32 lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn two_halves(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p.cast::<i32>())))
    }

    /// The 32 values of a Q4_1 block (0..16 are the low nibbles, 16..32 the
    /// high ones) times the 32 activations, summed by 8 lanes of 4.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_sums(block: *const u8, activations: __m256i) -> __m256 {
        let packed = _mm_loadu_si128(block.add(4).cast());
        let values = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
            _mm256_set1_epi8(0x0f),
        );
        let pairs = _mm256_maddubs_epi16(values, activations);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// One weight row. Its sums are taken in the order of [`four_rows`] and
    /// [`four_activations`], so that a row's output does not depend on the
    /// kernel its batch chose (a session's tokens on who shares its step).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one_row(blocks: usize, w: *const u8, x: *const u8) -> f32 {
        let mut acc = _mm256_setzero_ps();
        // Lane 1 accumulates the blocks' minimum terms (m_w * s_x).
        let mut mins = _mm_setzero_ps();
        for i in 0..blocks {
            let (wb, xb) = (w.add(i * Q4_1_BYTES), x.add(i * Q8_1_BYTES));
            // Lane 0: d_w * d_x; lane 1: m_w * s_x.
            let scales = _mm_mul_ps(two_halves(wb), two_halves(xb));
            let sums = block_sums(wb, _mm256_loadu_si256(xb.add(4).cast()));
            mins = _mm_add_ps(mins, scales);
            acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), sums, acc);
        }
        _mm_cvtss_f32(_mm_movehdup_ps(mins)) + sum_lanes(acc)
    }

    /// Four weight rows against one activation row, read once.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn four_rows(blocks: usize, w: [*const u8; 4], x: *const u8) -> [f32; 4] {
        let [mut w0, mut w1, mut w2, mut w3] = w;
        let mut xb = x;
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        // Lane k: row k's minimum terms.
        let mut mins = _mm_setzero_ps();
        for _ in 0..blocks {
            let activation_scales = two_halves(xb);
            let activations = _mm256_loadu_si256(xb.add(4).cast());
            let s0 = _mm_mul_ps(two_halves(w0), activation_scales);
            let s1 = _mm_mul_ps(two_halves(w1), activation_scales);
            let s2 = _mm_mul_ps(two_halves(w2), activation_scales);
            let s3 = _mm_mul_ps(two_halves(w3), activation_scales);
            acc0 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s0), block_sums(w0, activations), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s1), block_sums(w1, activations), acc1);
            acc2 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s2), block_sums(w2, activations), acc2);
            acc3 = _mm256_fmadd_ps(_mm256_broadcastss_ps(s3), block_sums(w3, activations), acc3);
            // [s0.1, s1.1, s2.1, s3.1]: each row's m_w * s_x.
            let low = _mm_unpacklo_ps(s0, s1);
            let high = _mm_unpacklo_ps(s2, s3);
            mins = _mm_add_ps(mins, _mm_movehl_ps(high, low));
            w0 = w0.add(Q4_1_BYTES);
            w1 = w1.add(Q4_1_BYTES);
            w2 = w2.add(Q4_1_BYTES);
            w3 = w3.add(Q4_1_BYTES);
            xb = xb.add(Q8_1_BYTES);
        }
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), mins);
        out[0] += sum_lanes(acc0);
        out[1] += sum_lanes(acc1);
        out[2] += sum_lanes(acc2);
        out[3] += sum_lanes(acc3);
        out
    }

    /// An unpacked Q4_1 block's values times the activations of the Q8_1
    /// block at `xb`, summed by 8 lanes of 4.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpacked_sums(values: __m256i, xb: *const u8, ones: __m256i) -> __m256 {
        let pairs = _mm256_maddubs_epi16(values, _mm256_loadu_si256(xb.add(4).cast()));
        _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones))
    }

    /// One weight row against four activation rows, each block unpacked once.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn four_activations(blocks: usize, w: *const u8, x: [*const u8; 4]) -> [f32; 4] {
        let [mut x0, mut x1, mut x2, mut x3] = x;
        let mut wb = w;
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        // Lane k: activation row k's minimum terms.
        let mut mins = _mm_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        for _ in 0..blocks {
            let weight_scales = two_halves(wb);
            let packed = _mm_loadu_si128(wb.add(4).cast());
            let values = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                _mm256_set1_epi8(0x0f),
            );
            let s0 = _mm_mul_ps(weight_scales, two_halves(x0));
            let s1 = _mm_mul_ps(weight_scales, two_halves(x1));
            let s2 = _mm_mul_ps(weight_scales, two_halves(x2));
            let s3 = _mm_mul_ps(weight_scales, two_halves(x3));
            acc0 = _mm256_fmadd_ps(
                _mm256_broadcastss_ps(s0),
                unpacked_sums(values, x0, ones),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_broadcastss_ps(s1),
                unpacked_sums(values, x1, ones),
                acc1,
            );
            acc2 = _mm256_fmadd_ps(
                _mm256_broadcastss_ps(s2),
                unpacked_sums(values, x2, ones),
                acc2,
            );
            acc3 = _mm256_fmadd_ps(
                _mm256_broadcastss_ps(s3),
                unpacked_sums(values, x3, ones),
                acc3,
            );
            let low = _mm_unpacklo_ps(s0, s1);
            let high = _mm_unpacklo_ps(s2, s3);
            mins = _mm_add_ps(mins, _mm_movehl_ps(high, low));
            wb = wb.add(Q4_1_BYTES);
            x0 = x0.add(Q8_1_BYTES);
            x1 = x1.add(Q8_1_BYTES);
            x2 = x2.add(Q8_1_BYTES);
            x3 = x3.add(Q8_1_BYTES);
        }
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), mins);
        out[0] += sum_lanes(acc0);
        out[1] += sum_lanes(acc1);
        out[2] += sum_lanes(acc2);
        out[3] += sum_lanes(acc3);
        out
    }
}
