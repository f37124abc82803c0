//! The interleaved kernels in AVX-512 with VNNI: a unit's sixteen weight
//! rows in the lanes of one register (one 64-byte load a chunk), and each
//! chunk's byte products summed into the rows' 32-bit lanes by one
//! `vpdpbusd` (the nibbles are its unsigned operand, the activations its
//! signed one). Per lane the arithmetic is the AVX2 kernel's: the block's
//! exact integer sum, then the same fused multiply-adds, so both give the
//! same bits.

use std::arch::x86_64::*;

use super::avx2::{self, rows_of, Row};
use super::{
    chunk_at, ActivationRow, Nibbles, BLOCK, GROUP, MAX_ACTIVATIONS, MINS_AT, UNIT,
    UNIT_BLOCK_BYTES,
};

pub fn available() -> bool {
    avx2::available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// [`super::UnitKernel`] for CPUs where [`available`] holds.
pub fn unit(
    format: Nibbles,
    per_row: usize,
    weights: &[u8],
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
) {
    assert!(weights.len() >= per_row * UNIT_BLOCK_BYTES, "a short unit");
    assert!(out.len() >= 2 * xs.len(), "a short output");
    let rows = rows_of(per_row, xs);
    let w = weights.as_ptr();
    let mut sums = [[0f32; UNIT]; MAX_ACTIVATIONS];
    // SAFETY: `available()` held when this kernel was chosen; `weights`
    // holds a whole unit and `rows_of` checked the activation rows.
    unsafe {
        let rows = &rows[..xs.len()];
        match format {
            Nibbles::Q4_0 => tiles::<true>(per_row, w, rows, &mut sums),
            Nibbles::Q4_1 => tiles::<false>(per_row, w, rows, &mut sums),
        }
    }
    for (k, lanes) in sums[..xs.len()].iter().enumerate() {
        out[2 * k].copy_from_slice(&lanes[..GROUP]);
        out[2 * k + 1].copy_from_slice(&lanes[GROUP..]);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles<const OFFSET: bool>(
    per_row: usize,
    w: *const u8,
    x: &[Row],
    out: &mut [[f32; UNIT]],
) {
    let store = |out: &mut [[f32; UNIT]], sums: &[__m512]| {
        for (lanes, sum) in out.iter_mut().zip(sums) {
            _mm512_storeu_ps(lanes.as_mut_ptr(), *sum);
        }
    };
    match *x {
        [a] => store(out, &tile::<1, OFFSET>(per_row, w, [a])),
        [a, b] => store(out, &tile::<2, OFFSET>(per_row, w, [a, b])),
        [a, b, c] => store(out, &tile::<3, OFFSET>(per_row, w, [a, b, c])),
        [a, b, c, d] => store(out, &tile::<4, OFFSET>(per_row, w, [a, b, c, d])),
        _ => {}
    }
}

/// The unit at `w` against `R` activation rows; `OFFSET` for Q4_0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const R: usize, const OFFSET: bool>(
    per_row: usize,
    w: *const u8,
    x: [Row; R],
) -> [__m512; R] {
    let nibble = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..per_row {
        let block = w.add(b * UNIT_BLOCK_BYTES);
        super::prefetch(block, UNIT_BLOCK_BYTES);
        let mut sums = [_mm512_setzero_si512(); R];
        for c in 0..4 {
            let packed = _mm512_loadu_si512(block.add(chunk_at(c)).cast());
            let low = _mm512_and_si512(packed, nibble);
            let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            for r in 0..R {
                let values = x[r].values.add(b * BLOCK);
                let xl = _mm512_set1_epi32(std::ptr::read_unaligned(values.add(4 * c).cast()));
                let xh = _mm512_set1_epi32(std::ptr::read_unaligned(values.add(16 + 4 * c).cast()));
                sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r], low, xl), high, xh);
            }
        }
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
        let mw = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(MINS_AT).cast()));
        for r in 0..R {
            let mut sum = sums[r];
            if OFFSET {
                sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * *x[r].sums.add(b)));
            }
            let dx = _mm512_set1_ps(*x[r].scales.add(2 * b));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(sum), acc[r]);
            if !OFFSET {
                let sx = _mm512_set1_ps(*x[r].scales.add(2 * b + 1));
                acc[r] = _mm512_fmadd_ps(mw, sx, acc[r]);
            }
        }
    }
    acc
}
