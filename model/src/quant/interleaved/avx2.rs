//! The interleaved Q4_1 kernel in AVX2, a group (half a unit) at a time:
//! per block, four 32-byte loads give the nibbles of eight rows; each
//! activation's four bytes are broadcast and multiplied against them
//! (`maddubs`), the eight products summed in 16 bits (at most
//! 8 × 2 × 15 × 128 = 30720: no overflow), then widened once per block.

use std::arch::x86_64::*;

use super::{
    chunk_at, ActivationRow, Nibbles, BLOCK, GROUP, MAX_ACTIVATIONS, MINS_AT, UNIT_BLOCK_BYTES,
};

pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// [`super::GroupKernel`] for CPUs where [`available`] holds.
pub fn group(
    format: Nibbles,
    per_row: usize,
    unit: &[u8],
    group: usize,
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
) {
    assert!(unit.len() >= per_row * UNIT_BLOCK_BYTES, "a short unit");
    assert!(group < super::GROUPS_PER_UNIT && out.len() >= xs.len());
    let w = unit.as_ptr();
    let rows = rows_of(per_row, xs);
    let rows = &rows[..xs.len()];
    // SAFETY: `available()` held when this kernel was chosen, and the
    // asserts above keep every read inside the slices.
    unsafe {
        match format {
            Nibbles::Q4_0 => tiles::<true>(per_row, w, group, rows, out),
            Nibbles::Q4_1 => tiles::<false>(per_row, w, group, rows, out),
        }
    }
}

/// [`tile`] for as many rows as `x` holds (at most four).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiles<const OFFSET: bool>(
    per_row: usize,
    w: *const u8,
    group: usize,
    x: &[Row],
    out: &mut [[f32; GROUP]],
) {
    match *x {
        [a] => store(out, tile::<1, OFFSET>(per_row, w, group, [a])),
        [a, b] => store(out, tile::<2, OFFSET>(per_row, w, group, [a, b])),
        [a, b, c] => store(out, tile::<3, OFFSET>(per_row, w, group, [a, b, c])),
        [a, b, c, d] => store(out, tile::<4, OFFSET>(per_row, w, group, [a, b, c, d])),
        _ => {}
    }
}

/// An activation row's pointers.
#[derive(Clone, Copy)]
pub(super) struct Row {
    pub values: *const i8,
    pub scales: *const f32,
    pub sums: *const i32,
}

/// The pointers of `xs` (at most [`MAX_ACTIVATIONS`] rows of `per_row`
/// blocks: asserted, so that kernels may read every block through them).
pub(super) fn rows_of(per_row: usize, xs: &[ActivationRow]) -> [Row; MAX_ACTIVATIONS] {
    assert!(xs.len() <= MAX_ACTIVATIONS, "too many activation rows");
    let mut rows = [Row {
        values: std::ptr::null(),
        scales: std::ptr::null(),
        sums: std::ptr::null(),
    }; MAX_ACTIVATIONS];
    for (row, x) in rows.iter_mut().zip(xs) {
        assert!(x.values.len() >= per_row * BLOCK && x.scales.len() >= 2 * per_row);
        assert!(x.sums.len() >= per_row);
        *row = Row {
            values: x.values.as_ptr(),
            scales: x.scales.as_ptr(),
            sums: x.sums.as_ptr(),
        };
    }
    rows
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store<const R: usize>(out: &mut [[f32; GROUP]], sums: [__m256; R]) {
    for (lanes, sum) in out.iter_mut().zip(sums) {
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    }
}

/// Group `group` of the unit at `w` against `R` activation rows; `OFFSET`
/// for Q4_0 (values are the nibbles less 8; no `m`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const OFFSET: bool>(
    per_row: usize,
    w: *const u8,
    group: usize,
    x: [Row; R],
) -> [__m256; R] {
    let (scales_at, rows_at) = (2 * GROUP * group, 4 * GROUP * group);
    let nibble = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..per_row {
        let block = w.add(b * UNIT_BLOCK_BYTES);
        if group == 0 {
            super::prefetch(block, UNIT_BLOCK_BYTES);
        }
        let mut sums = [_mm256_setzero_si256(); R];
        for c in 0..4 {
            let packed = _mm256_loadu_si256(block.add(chunk_at(c) + rows_at).cast());
            let low = _mm256_and_si256(packed, nibble);
            let high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            for r in 0..R {
                let values = x[r].values.add(b * BLOCK);
                let xl = _mm256_set1_epi32(std::ptr::read_unaligned(values.add(4 * c).cast()));
                let xh = _mm256_set1_epi32(std::ptr::read_unaligned(values.add(16 + 4 * c).cast()));
                sums[r] = _mm256_add_epi16(
                    sums[r],
                    _mm256_add_epi16(
                        _mm256_maddubs_epi16(low, xl),
                        _mm256_maddubs_epi16(high, xh),
                    ),
                );
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(block.add(scales_at).cast()));
        let mw = _mm256_cvtph_ps(_mm_loadu_si128(block.add(MINS_AT + scales_at).cast()));
        for r in 0..R {
            let mut sum = _mm256_madd_epi16(sums[r], ones);
            if OFFSET {
                sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * *x[r].sums.add(b)));
            }
            let dx = _mm256_set1_ps(*x[r].scales.add(2 * b));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sum), acc[r]);
            if !OFFSET {
                let sx = _mm256_set1_ps(*x[r].scales.add(2 * b + 1));
                acc[r] = _mm256_fmadd_ps(mw, sx, acc[r]);
            }
        }
    }
    acc
}

/// [`super::quantize_block`] in AVX2, with the same bits.
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    assert!(x.len() >= BLOCK && q.len() >= BLOCK, "a short block");
    // SAFETY: `available()` held when this was chosen; the assert keeps
    // the reads and writes inside the slices.
    unsafe { quantize(x.as_ptr(), q.as_mut_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize(x: *const f32, q: *mut i8) -> (f32, i32) {
    let v = [0, 8, 16, 24].map(|at| _mm256_loadu_ps(x.add(at)));
    let sign = _mm256_set1_ps(-0.0);
    let abs = v.map(|v| _mm256_andnot_ps(sign, v));
    let max = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let half = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
    let half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    let amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let ints = v.map(|v| {
        _mm256_cvtps_epi32(_mm256_round_ps(
            _mm256_mul_ps(v, id),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        ))
    });
    let sums = _mm256_add_epi32(
        _mm256_add_epi32(ints[0], ints[1]),
        _mm256_add_epi32(ints[2], ints[3]),
    );
    let sums = _mm_add_epi32(
        _mm256_castsi256_si128(sums),
        _mm256_extracti128_si256(sums, 1),
    );
    let sums = _mm_hadd_epi32(sums, sums);
    let sum = _mm_cvtsi128_si32(_mm_hadd_epi32(sums, sums));
    // Narrowed in lane order: packs interleave the 128-bit halves, the
    // permute puts them back.
    let words = _mm256_packs_epi32(ints[0], ints[1]);
    let words_high = _mm256_packs_epi32(ints[2], ints[3]);
    let bytes = _mm256_packs_epi16(words, words_high);
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.cast(), bytes);
    (d, sum)
}
