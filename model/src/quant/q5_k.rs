//! Q5_K weights against Q8_K activations, four activation rows at a time:
//! each super-block's 5-bit values and 6-bit scales rebuilt once for four
//! rows, and per row candle's AVX2 kernel's arithmetic instruction for
//! instruction (the same integer lanes, the same fused multiply-add per
//! super-block, the mins' term summed on the side in f32 as candle sums
//! it), so a row's output is bit for bit what candle's kernel gives it
//! alone.

use candle_core::quantized::k_quants::BlockQ5K;

use super::parallel::Kernels;

/// Candle's kernels, with the four-row one where the CPU runs candle's
/// AVX2 kernel.
pub(crate) fn kernels() -> Kernels<BlockQ5K> {
    #[cfg(target_arch = "x86_64")]
    return super::k_quants::with_four_rows(x86::four_activations);
    #[cfg(not(target_arch = "x86_64"))]
    Kernels::candle()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use candle_core::quantized::k_quants::{BlockQ5K, BlockQ8K};

    use super::super::k_quants::{four_rows_of, Q8K_BYTES, Q8K_SUMS_AT, Q8K_VALUES_AT};
    use super::super::lanes::{mins_by_sums, scale_shuffle, scales_and_mins_at, sum_lanes};

    // Q5_K's byte layout (ggml's): `d`, `dmin` (f16), 12 bytes of packed
    // 6-bit scales and mins, 32 bytes of fifth bits, 128 bytes of low nibbles.
    const Q5K_BYTES: usize = 176;
    const Q5K_SCALES_AT: usize = 4;
    const Q5K_HIGH_AT: usize = 16;
    const Q5K_LOW_AT: usize = 48;
    const _: () = assert!(std::mem::size_of::<BlockQ5K>() == Q5K_BYTES);

    /// [`super::super::parallel::Batched4`] for Q5_K.
    pub fn four_activations(n: usize, xs: &[BlockQ5K], ys: [&[BlockQ8K]; 4]) -> [f32; 4] {
        four_rows_of(n, xs, ys, four_rows)
    }

    /// The fifth bits of values `32k..32k + 32` of each of the 32 bytes of
    /// `high` (bit `k`), moved to bit 4 of each byte: candle shifts by the
    /// constant `k` chosen per branch.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fifth_bits(high: __m256i, k: usize) -> __m256i {
        let bit = _mm256_and_si256(high, _mm256_set1_epi8(1 << k));
        let at_zero = match k {
            0 => bit,
            1 => _mm256_srli_epi16(bit, 1),
            2 => _mm256_srli_epi16(bit, 2),
            3 => _mm256_srli_epi16(bit, 3),
            4 => _mm256_srli_epi16(bit, 4),
            5 => _mm256_srli_epi16(bit, 5),
            6 => _mm256_srli_epi16(bit, 6),
            _ => _mm256_srli_epi16(bit, 7),
        };
        _mm256_slli_epi16(at_zero, 4)
    }

    /// One weight row of `blocks` super-blocks against four activation rows.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn four_rows(blocks: usize, w: *const u8, x: [*const u8; 4]) -> [f32; 4] {
        let nibble = _mm256_set1_epi8(0x0f);
        let zero = _mm_setzero_si128();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut mins_total = [0f32; 4];
        for b in 0..blocks {
            let wb = w.add(b * Q5K_BYTES);
            let d = half::f16::from_bits(std::ptr::read_unaligned(wb.cast::<u16>())).to_f32();
            let dmin =
                half::f16::from_bits(std::ptr::read_unaligned(wb.add(2).cast::<u16>())).to_f32();
            let (scales, mins) = scales_and_mins_at(wb.add(Q5K_SCALES_AT));
            let high = _mm256_loadu_si256(wb.add(Q5K_HIGH_AT).cast());
            let xb = [
                x[0].add(b * Q8K_BYTES),
                x[1].add(b * Q8K_BYTES),
                x[2].add(b * Q8K_BYTES),
                x[3].add(b * Q8K_BYTES),
            ];
            for r in 0..4 {
                let x_d = std::ptr::read_unaligned(xb[r].cast::<f32>());
                let product = mins_by_sums(mins, xb[r].add(Q8K_SUMS_AT));
                let total = _mm_hadd_epi32(_mm_hadd_epi32(product, zero), zero);
                mins_total[r] += -x_d * dmin * _mm_extract_epi32(total, 0) as f32;
            }
            let mut sumi = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let scale_low = _mm256_shuffle_epi8(scales, scale_shuffle(2 * j));
                let scale_high = _mm256_shuffle_epi8(scales, scale_shuffle(2 * j + 1));
                let bits = _mm256_loadu_si256(wb.add(Q5K_LOW_AT + 32 * j).cast());
                let low = _mm256_add_epi8(_mm256_and_si256(bits, nibble), fifth_bits(high, 2 * j));
                let high_values = _mm256_add_epi8(
                    _mm256_and_si256(_mm256_srli_epi16(bits, 4), nibble),
                    fifth_bits(high, 2 * j + 1),
                );
                for r in 0..4 {
                    let values = xb[r].add(Q8K_VALUES_AT + 64 * j);
                    let xl = _mm256_loadu_si256(values.cast());
                    let xh = _mm256_loadu_si256(values.add(32).cast());
                    let pl = _mm256_madd_epi16(scale_low, _mm256_maddubs_epi16(low, xl));
                    let ph = _mm256_madd_epi16(scale_high, _mm256_maddubs_epi16(high_values, xh));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                }
            }
            for r in 0..4 {
                let x_d = std::ptr::read_unaligned(xb[r].cast::<f32>());
                let scale = _mm256_set1_ps(x_d * d);
                acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        let mut out = [0f32; 4];
        for (r, out) in out.iter_mut().enumerate() {
            *out = sum_lanes(acc[r]) + mins_total[r];
        }
        out
    }
}
