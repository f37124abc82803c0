//! What the AVX2 kernels share.

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
