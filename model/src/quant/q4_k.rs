//! Q4_K weights against Q8_K activations, four activation rows at a time.
//!
//! A batch's rows (a prefill's positions, the sessions of a decode batch)
//! met each Q4_K weight row through candle's one-row dot product, which
//! unpacks the row's nibbles and its 6-bit scales again for every
//! activation row. Here a super-block is unpacked once and serves four
//! rows. Per row the arithmetic is candle's AVX2 kernel's, instruction for
//! instruction: the same integer lanes, the same fused multiply-adds in
//! the same order, the same final sums. So a row's output is bit for bit
//! what candle's kernel gives it alone, and a session's numbers do not
//! depend on who shares its step.

use candle_core::quantized::k_quants::BlockQ4K;

use super::parallel::Kernels;

// Q4_K's byte layout (ggml's): `d`, `dmin` (f16), 12 bytes of packed 6-bit
// scales and mins, 128 bytes of nibbles.
const Q4K_BYTES: usize = 144;
const Q4K_SCALES_AT: usize = 4;
const Q4K_VALUES_AT: usize = 16;
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == Q4K_BYTES);

mod interleaved;

pub(crate) use interleaved::{ActivationsQ8K, InterleavedQ4K};

/// Candle's kernels, with the four-row one where the CPU runs candle's
/// AVX2 kernel.
pub(crate) fn kernels() -> Kernels<BlockQ4K> {
    #[cfg(target_arch = "x86_64")]
    return super::k_quants::with_four_rows(x86::four_activations);
    #[cfg(not(target_arch = "x86_64"))]
    Kernels::candle()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use candle_core::quantized::k_quants::{BlockQ4K, BlockQ8K};

    use super::super::k_quants::{four_rows_of, Q8K_BYTES, Q8K_SUMS_AT, Q8K_VALUES_AT};
    use super::super::lanes::{mins_by_sums, scale_shuffle, scales_and_mins_at, sum_lanes};
    use super::{Q4K_BYTES, Q4K_SCALES_AT, Q4K_VALUES_AT};

    /// [`super::super::parallel::Batched4`] for Q4_K.
    pub fn four_activations(n: usize, xs: &[BlockQ4K], ys: [&[BlockQ8K]; 4]) -> [f32; 4] {
        four_rows_of(n, xs, ys, four_rows)
    }

    /// One weight row of `blocks` super-blocks against four activation rows.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn four_rows(blocks: usize, w: *const u8, x: [*const u8; 4]) -> [f32; 4] {
        let nibble = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut acc_m = [_mm_setzero_ps(); 4];
        for b in 0..blocks {
            let wb = w.add(b * Q4K_BYTES);
            let d = half::f16::from_bits(std::ptr::read_unaligned(wb.cast::<u16>())).to_f32();
            let dmin =
                half::f16::from_bits(std::ptr::read_unaligned(wb.add(2).cast::<u16>())).to_f32();
            let (scales, mins) = scales_and_mins_at(wb.add(Q4K_SCALES_AT));
            let xb = [
                x[0].add(b * Q8K_BYTES),
                x[1].add(b * Q8K_BYTES),
                x[2].add(b * Q8K_BYTES),
                x[3].add(b * Q8K_BYTES),
            ];
            for r in 0..4 {
                let x_d = std::ptr::read_unaligned(xb[r].cast::<f32>());
                let product = mins_by_sums(mins, xb[r].add(Q8K_SUMS_AT));
                let dmin_r = -x_d * dmin;
                acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin_r), _mm_cvtepi32_ps(product), acc_m[r]);
            }
            let mut sumi = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let scale_low = _mm256_shuffle_epi8(scales, scale_shuffle(2 * j));
                let scale_high = _mm256_shuffle_epi8(scales, scale_shuffle(2 * j + 1));
                let bits = _mm256_loadu_si256(wb.add(Q4K_VALUES_AT + 32 * j).cast());
                let low = _mm256_and_si256(bits, nibble);
                let high = _mm256_and_si256(_mm256_srli_epi16(bits, 4), nibble);
                for r in 0..4 {
                    let values = xb[r].add(Q8K_VALUES_AT + 64 * j);
                    let xl = _mm256_loadu_si256(values.cast());
                    let xh = _mm256_loadu_si256(values.add(32).cast());
                    let pl = _mm256_madd_epi16(scale_low, _mm256_maddubs_epi16(low, xl));
                    sumi[r] = _mm256_add_epi32(sumi[r], pl);
                    let ph = _mm256_madd_epi16(scale_high, _mm256_maddubs_epi16(high, xh));
                    sumi[r] = _mm256_add_epi32(sumi[r], ph);
                }
            }
            for r in 0..4 {
                let x_d = std::ptr::read_unaligned(xb[r].cast::<f32>());
                let d_r = _mm256_set1_ps(x_d * d);
                acc[r] = _mm256_fmadd_ps(d_r, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        let mut out = [0f32; 4];
        for (r, out) in out.iter_mut().enumerate() {
            let m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            *out = sum_lanes(acc[r]) + _mm_cvtss_f32(m);
        }
        out
    }
}
