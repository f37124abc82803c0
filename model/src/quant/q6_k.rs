//! Q6_K weights against Q8_K activations, four activation rows at a time.
//!
//! A batch's rows met each Q6_K weight row through candle's one-row dot
//! product, which rebuilds the row's 6-bit values from their low nibbles
//! and high bit pairs, and widens its scales, again for every activation
//! row. Here a super-block is rebuilt once and serves four rows. Per row
//! the arithmetic is candle's AVX2 kernel's, instruction for instruction
//! (the same 16-bit products and offsets, the same 32-bit lanes, the same
//! fused multiply-add per super-block and the same final sum), so a row's
//! output is bit for bit what candle's kernel gives it alone.

use candle_core::quantized::k_quants::BlockQ6K;

use super::parallel::Kernels;

/// Candle's kernels, with the four-row one where the CPU runs candle's
/// AVX2 kernel.
pub(crate) fn kernels() -> Kernels<BlockQ6K> {
    #[cfg(target_arch = "x86_64")]
    return super::k_quants::with_four_rows(x86::four_activations);
    #[cfg(not(target_arch = "x86_64"))]
    Kernels::candle()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use candle_core::quantized::k_quants::{BlockQ6K, BlockQ8K};

    use super::super::k_quants::{four_rows_of, Q8K_BYTES, Q8K_VALUES_AT};
    use super::super::lanes::sum_lanes;

    // Q6_K's byte layout (ggml's): 128 bytes of low nibbles, 64 of high bit
    // pairs, 16 scales (i8), `d` (f16).
    const Q6K_BYTES: usize = 210;
    const Q6K_HIGH_AT: usize = 128;
    const Q6K_SCALES_AT: usize = 192;
    const Q6K_D_AT: usize = 208;
    const _: () = assert!(std::mem::size_of::<BlockQ6K>() == Q6K_BYTES);

    /// [`super::super::parallel::Batched4`] for Q6_K.
    pub fn four_activations(n: usize, xs: &[BlockQ6K], ys: [&[BlockQ8K]; 4]) -> [f32; 4] {
        four_rows_of(n, xs, ys, four_rows)
    }

    /// Scales `2i` (eight bytes) and `2i + 1` (eight bytes) of `scales`,
    /// widened to 16 bits: candle's `get_scale_shuffle(i)`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scale_pair(scales: __m128i, i: usize) -> __m256i {
        const REPEAT: i64 = 0x0101_0101_0101_0101;
        let pick = _mm_set_epi64x((2 * i + 1) as i64 * REPEAT, (2 * i) as i64 * REPEAT);
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick))
    }

    /// One weight row of `blocks` super-blocks against four activation rows.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn four_rows(blocks: usize, w: *const u8, x: [*const u8; 4]) -> [f32; 4] {
        let low_bits = _mm256_set1_epi8(0x0f);
        let pair_bits = _mm256_set1_epi8(3);
        let offset = _mm256_set1_epi8(32);
        let mut acc = [_mm256_setzero_ps(); 4];
        for b in 0..blocks {
            let wb = w.add(b * Q6K_BYTES);
            let d = half::f16::from_bits(std::ptr::read_unaligned(wb.add(Q6K_D_AT).cast::<u16>()))
                .to_f32();
            let scales = _mm_loadu_si128(wb.add(Q6K_SCALES_AT).cast());
            let xb = [
                x[0].add(b * Q8K_BYTES),
                x[1].add(b * Q8K_BYTES),
                x[2].add(b * Q8K_BYTES),
                x[3].add(b * Q8K_BYTES),
            ];
            let mut sumi = [_mm256_setzero_si256(); 4];
            for half in 0..2 {
                let mut scale = [_mm256_setzero_si256(); 4];
                for (k, scale) in scale.iter_mut().enumerate() {
                    *scale = scale_pair(scales, 4 * half + k);
                }
                let low1 = _mm256_loadu_si256(wb.add(64 * half).cast());
                let low2 = _mm256_loadu_si256(wb.add(64 * half + 32).cast());
                let high = _mm256_loadu_si256(wb.add(Q6K_HIGH_AT + 32 * half).cast());
                let high0 = _mm256_slli_epi16(_mm256_and_si256(high, pair_bits), 4);
                let high1 =
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), pair_bits), 4);
                let high2 =
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), pair_bits), 4);
                let high3 =
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), pair_bits), 4);
                let values = [
                    _mm256_or_si256(_mm256_and_si256(low1, low_bits), high0),
                    _mm256_or_si256(_mm256_and_si256(low2, low_bits), high1),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(low1, 4), low_bits),
                        high2,
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(low2, 4), low_bits),
                        high3,
                    ),
                ];
                for r in 0..4 {
                    let q8 = xb[r].add(Q8K_VALUES_AT + 128 * half);
                    let mut p = [_mm256_setzero_si256(); 4];
                    for k in 0..4 {
                        let activations = _mm256_loadu_si256(q8.add(32 * k).cast());
                        let offsets = _mm256_maddubs_epi16(offset, activations);
                        let products = _mm256_maddubs_epi16(values[k], activations);
                        p[k] = _mm256_madd_epi16(scale[k], _mm256_sub_epi16(products, offsets));
                    }
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p[0], p[1]));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p[2], p[3]));
                }
            }
            for r in 0..4 {
                let x_d = std::ptr::read_unaligned(xb[r].cast::<f32>());
                let scale = _mm256_set1_ps(x_d * d);
                acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        [
            sum_lanes(acc[0]),
            sum_lanes(acc[1]),
            sum_lanes(acc[2]),
            sum_lanes(acc[3]),
        ]
    }
}
