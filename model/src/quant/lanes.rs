//! What the AVX2 kernels share (candle's order, so its bits).

use std::arch::x86_64::*;

/// The eight lanes of `v` summed as candle's `hsum_float_8` sums them (the
/// high half plus the low half, then pairs, then the last two), so that
/// kernels repeating candle's give its bits.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn sum_lanes(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)))
}

/// Candle's `get_scale_shuffle_k4(i)`: picks 16-bit scale `i` of a
/// register holding eight (twice) into every lane pair.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn scale_shuffle(i: usize) -> __m256i {
    let low = (2 * i) as u8;
    _mm256_set1_epi16(i16::from_le_bytes([low, low + 1]))
}

/// A Q4_K or Q5_K super-block's 6-bit scales and mins from their 12 bytes
/// at `packed`, widened to 16 bits as candle widens them: the scales twice
/// (both halves, for [`scale_shuffle`]), and the mins.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn scales_and_mins_at(packed: *const u8) -> (__m256i, __m128i) {
    let packed: [u8; 12] = std::ptr::read_unaligned(packed.cast());
    let [s0, s1, s2, s3] = super::k_quants::scales_and_mins(&packed);
    let both = _mm256_cvtepu8_epi16(_mm_set_epi32(s3 as i32, s2 as i32, s1 as i32, s0 as i32));
    let scales = _mm256_extracti128_si256(both, 0);
    (
        _mm256_set_m128i(scales, scales),
        _mm256_extracti128_si256(both, 1),
    )
}

/// Each sub-block's min times the sum of its 32 activations (the Q8_K sums
/// of sixteen at `sums_at`, added in pairs), summed two sub-blocks to a
/// lane, as candle's kernels compute it.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn mins_by_sums(mins: __m128i, sums_at: *const u8) -> __m128i {
    let sums = _mm256_loadu_si256(sums_at.cast());
    let pair_sums = _mm_hadd_epi16(
        _mm256_extracti128_si256(sums, 0),
        _mm256_extracti128_si256(sums, 1),
    );
    _mm_madd_epi16(mins, pair_sums)
}
