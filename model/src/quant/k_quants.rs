//! What the K-quant kernels share: the super-block, the Q8_K activations'
//! byte layout, the 6-bit scales and mins of Q4_K and Q5_K, and where
//! candle runs its AVX2 kernels (whose bits the four-row kernels repeat).

use candle_core::quantized::k_quants::BlockQ8K;
#[cfg(target_arch = "x86_64")]
use candle_core::quantized::k_quants::GgmlType;

#[cfg(target_arch = "x86_64")]
use super::parallel::{Batched4, Kernels};

/// Values per super-block.
pub(crate) const SUPER_BLOCK: usize = 256;
/// Q8_K (ggml's layout): `d` (f32), 256 values, 16 sums of 16 values (i16).
pub(crate) const Q8K_BYTES: usize = 292;
pub(crate) const Q8K_VALUES_AT: usize = 4;
pub(crate) const Q8K_SUMS_AT: usize = 260;
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == Q8K_BYTES);

/// Candle's kernels, with `batched` for four activation rows where the
/// CPU runs candle's AVX2 kernel (`k_quants.rs`: AVX2 and FMA), whose
/// bits `batched` repeats.
#[cfg(target_arch = "x86_64")]
pub(crate) fn with_four_rows<T: GgmlType>(batched: Batched4<T>) -> Kernels<T> {
    match is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        true => Kernels {
            batched: Some(batched),
            ..Kernels::candle()
        },
        false => Kernels::candle(),
    }
}

/// A four-row AVX2 kernel: `blocks` super-blocks of the weight row at the
/// first pointer against the four activation rows.
#[cfg(target_arch = "x86_64")]
pub(crate) type FourRows = unsafe fn(usize, *const u8, [*const u8; 4]) -> [f32; 4];

/// `kernel` over the super-blocks the weight row `xs` and each activation
/// row hold (the [`Batched4`] of a format).
#[cfg(target_arch = "x86_64")]
pub(crate) fn four_rows_of<T>(
    n: usize,
    xs: &[T],
    ys: [&[BlockQ8K]; 4],
    kernel: FourRows,
) -> [f32; 4] {
    let blocks = ys
        .iter()
        .map(|y| y.len())
        .fold(xs.len().min(n / SUPER_BLOCK), usize::min);
    // SAFETY: `with_four_rows` hands the kernels out only where the CPU has
    // AVX2 and FMA, and `blocks` blocks lie inside every row.
    unsafe { kernel(blocks, xs.as_ptr().cast(), ys.map(|y| y.as_ptr().cast())) }
}

/// The scales (low 8 bytes) and mins (high 8 bytes) of a super-block,
/// 6 bits each, unpacked from their 12 bytes as candle does.
#[inline]
pub(crate) fn scales_and_mins(packed: &[u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let word = |i: usize| {
        u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ])
    };
    let (a, b, c) = (word(0), word(1), word(2));
    [
        a & KMASK1,
        (c & KMASK2) | (((a >> 6) & KMASK3) << 4),
        b & KMASK1,
        ((c >> 4) & KMASK2) | (((b >> 6) & KMASK3) << 4),
    ]
}
