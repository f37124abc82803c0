//! Block dot products candle leaves scalar, vectorised (chosen at run time,
//! so one binary runs on every x86-64 machine).

use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8_1, GgmlType};

use super::parallel::Dot;

// The byte layouts the vector kernels read (ggml's): `d`, `m` (or `s`) as
// f16, then the packed values.
const Q4_1_BYTES: usize = 20;
const Q8_1_BYTES: usize = 36;
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == Q4_1_BYTES);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == Q8_1_BYTES);

/// Q4_1 weights against Q8_1 activations: AVX2 where the CPU has it.
pub(crate) fn q4_1_q8_1() -> Dot<BlockQ4_1> {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        return x86::q4_1_q8_1;
    }
    BlockQ4_1::vec_dot
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

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
        unsafe { q4_1_q8_1_avx2(blocks, xs.as_ptr().cast(), ys.as_ptr().cast()) }
    }

    /// The two f16s at `p` as f32 lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn two_halves(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p.cast::<i32>())))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_q8_1_avx2(blocks: usize, w: *const u8, x: *const u8) -> f32 {
        let low_nibbles = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        // Lane 1 accumulates the blocks' minimum terms (m * s).
        let mut mins = _mm_setzero_ps();
        for i in 0..blocks {
            let wb = w.add(i * Q4_1_BYTES);
            let xb = x.add(i * Q8_1_BYTES);
            // Lane 0: d_w * d_x; lane 1: m_w * s_x.
            let scales = _mm_mul_ps(two_halves(wb), two_halves(xb));
            mins = _mm_add_ps(mins, scales);
            let packed = _mm_loadu_si128(wb.add(4).cast());
            // Values 0..16 are the low nibbles, 16..32 the high ones.
            let values = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                low_nibbles,
            );
            let activations = _mm256_loadu_si256(xb.add(4).cast());
            let pairs = _mm256_maddubs_epi16(values, activations);
            let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), sums, acc);
        }
        let half = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
        let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
        let total = _mm_add_ss(half, _mm_movehdup_ps(half));
        _mm_cvtss_f32(total) + _mm_cvtss_f32(_mm_movehdup_ps(mins))
    }
}
