//! Q4_K weights repacked sixteen rows to a unit, for CPUs with AVX-512
//! VNNI, as [`super::super::interleaved`] repacks Q4_0 and Q4_1: one 64-byte
//! load holds four bytes of nibbles of sixteen rows, and one `vpdpbusd`
//! adds their products with four broadcast activations into the rows'
//! lanes. Candle's kernel multiplies one weight row at a time with 8-bit
//! pair products (~27 G multiply-adds/s on a core here); this one meets
//! sixteen rows per instruction.
//!
//! A super-block's sum is computed exactly in integers: each sub-block's
//! products (at most 32 × 15 × 128) times its 6-bit scale, and the mins
//! times the activations' sums; then `acc = fma(d_w × d_x, sum, acc)` and
//! `acc = fma(-(dmin_w × d_x), mins, acc)`, super-block after super-block.
//! Every kernel and batch size gives those bits (the portable kernel is
//! the tests' reference). They differ from candle's one-row kernel's,
//! which sums eight lanes of partial products and adds them at the end; a
//! CPU without AVX-512 VNNI keeps candle's layout and its bits, within
//! the tolerance spot checks allow.

use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};
use half::f16;

use super::super::interleaved::{run_units, GROUP, GROUPS_PER_UNIT, UNIT};
use super::super::k_quants::{scales_and_mins, SUPER_BLOCK};
use super::super::k_quants::{Q8K_BYTES, Q8K_SUMS_AT, Q8K_VALUES_AT};
use super::super::parallel::Shape;
use super::{Q4K_BYTES, Q4K_SCALES_AT, Q4K_VALUES_AT};
use crate::error::{ModelError, Result};

/// Sub-blocks of 32 values per super-block, each with a scale and a min.
const SUB_BLOCKS: usize = 8;
/// Chunks per pair of sub-blocks: chunk `c` of pair `p` holds bytes
/// `4c..4c + 4` of each row's 32 bytes of nibbles of that pair (low
/// nibbles: values `4c..4c + 4` of sub-block `2p`; high: of `2p + 1`).
const CHUNKS_PER_PAIR: usize = 8;
/// A chunk: four bytes of each of a unit's rows.
const CHUNK_BYTES: usize = 4 * UNIT;
/// Where, in a unit's super-block, the `dmin`s start (after the `d`s).
const DMINS_AT: usize = 2 * UNIT;
/// Where the scales start: sub-block after sub-block, a byte per row.
const SCALES_AT: usize = 4 * UNIT;
/// Where the mins start, laid out as the scales.
const MINS_AT: usize = SCALES_AT + SUB_BLOCKS * UNIT;
/// Where the chunks start.
const CHUNKS_AT: usize = MINS_AT + SUB_BLOCKS * UNIT;
/// One super-block of a unit.
const UNIT_BLOCK_BYTES: usize = CHUNKS_AT + 4 * CHUNKS_PER_PAIR * CHUNK_BYTES;

const fn chunk_at(pair: usize, c: usize) -> usize {
    CHUNKS_AT + (pair * CHUNKS_PER_PAIR + c) * CHUNK_BYTES
}

/// Activation rows rounded to Q8_K blocks (candle's rounding, as its
/// kernel's), kept by the caller between products.
#[derive(Debug, Default)]
pub(crate) struct ActivationsQ8K {
    blocks: Vec<BlockQ8K>,
}

/// One activation row's Q8_K blocks, as bytes.
#[derive(Clone, Copy)]
struct ActivationRow<'a> {
    blocks: &'a [u8],
}

/// Multiplies one unit by up to `MAX_ACTIVATIONS` activation rows:
/// `out[r * GROUPS_PER_UNIT + i][j]` is weight row `j` of the unit's group
/// `i` times row `r`.
type UnitKernel = fn(per_row: usize, unit: &[u8], xs: &[ActivationRow], out: &mut [[f32; GROUP]]);

/// A Q4_K matrix `[rows, cols]` in units of sixteen rows (the last unit
/// padded with zero rows).
#[derive(Debug, Clone)]
pub(crate) struct InterleavedQ4K {
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

impl InterleavedQ4K {
    /// Whether this CPU has the kernel the repacked layout needs.
    pub fn supported() -> bool {
        #[cfg(target_arch = "x86_64")]
        return avx512::available();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Repacks `bytes`, `rows` rows of `cols` values in Q4_K blocks.
    pub fn new(bytes: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let per_row = cols / SUPER_BLOCK;
        if !cols.is_multiple_of(SUPER_BLOCK) || bytes.len() != rows * per_row * Q4K_BYTES {
            return Err(ModelError::InvalidConfig(format!(
                "{} bytes are not a {rows}x{cols} Q4_K matrix",
                bytes.len()
            )));
        }
        let units = rows.div_ceil(UNIT);
        // Padding rows stay zero: zero scales, zero outputs.
        let mut packed = vec![0u8; units * per_row * UNIT_BLOCK_BYTES];
        for (u, unit) in packed
            .chunks_exact_mut(per_row * UNIT_BLOCK_BYTES)
            .enumerate()
        {
            for (b, dst) in unit.chunks_exact_mut(UNIT_BLOCK_BYTES).enumerate() {
                for j in 0..UNIT.min(rows - u * UNIT) {
                    let at = ((u * UNIT + j) * per_row + b) * Q4K_BYTES;
                    let src = &bytes[at..at + Q4K_BYTES];
                    dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
                    dst[DMINS_AT + 2 * j..DMINS_AT + 2 * j + 2].copy_from_slice(&src[2..4]);
                    let mut packed_scales = [0u8; 12];
                    packed_scales.copy_from_slice(&src[Q4K_SCALES_AT..Q4K_SCALES_AT + 12]);
                    let mut unpacked = [0u8; 16];
                    for (bytes, word) in unpacked
                        .chunks_exact_mut(4)
                        .zip(scales_and_mins(&packed_scales))
                    {
                        bytes.copy_from_slice(&word.to_le_bytes());
                    }
                    for s in 0..SUB_BLOCKS {
                        dst[SCALES_AT + s * UNIT + j] = unpacked[s];
                        dst[MINS_AT + s * UNIT + j] = unpacked[SUB_BLOCKS + s];
                    }
                    for pair in 0..4 {
                        for c in 0..CHUNKS_PER_PAIR {
                            let from = Q4K_VALUES_AT + 32 * pair + 4 * c;
                            let to = chunk_at(pair, c) + 4 * j;
                            dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
                        }
                    }
                }
            }
        }
        Ok(InterleavedQ4K {
            rows,
            cols,
            bytes: packed,
        })
    }

    /// `out[r * rows + o] = dot(weight row o, input row r)`, the input
    /// rows rounded into `activations`.
    pub fn matmul(
        &self,
        shape: Shape,
        input: &[f32],
        out: &mut [f32],
        activations: &mut ActivationsQ8K,
    ) {
        self.matmul_with(kernel(), shape, input, out, activations)
    }

    fn matmul_with(
        &self,
        kernel: UnitKernel,
        shape: Shape,
        input: &[f32],
        out: &mut [f32],
        activations: &mut ActivationsQ8K,
    ) {
        let Shape { rows, cols, batch } = shape;
        debug_assert_eq!((rows, cols), (self.rows, self.cols));
        let per_row = cols / SUPER_BLOCK;
        let blocks = &mut activations.blocks;
        blocks.resize(batch * per_row, BlockQ8K::zeros());
        for (row, blocks) in input
            .chunks_exact(cols)
            .zip(blocks.chunks_exact_mut(per_row))
        {
            BlockQ8K::from_float(row, blocks);
        }
        // SAFETY: `BlockQ8K` is a `repr(C)` struct of an f32 and integers
        // with no padding (its size is asserted in `super`).
        let bytes = unsafe {
            std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), blocks.len() * Q8K_BYTES)
        };
        let row_bytes = per_row * Q8K_BYTES;
        run_units(
            &self.bytes,
            per_row * UNIT_BLOCK_BYTES,
            shape,
            |r| ActivationRow {
                blocks: &bytes[r * row_bytes..(r + 1) * row_bytes],
            },
            |weights, xs, sums| kernel(per_row, weights, xs, sums),
            out,
        );
    }
}

fn kernel() -> UnitKernel {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        return avx512::unit;
    }
    portable
}

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The kernels' arithmetic in plain Rust (the tests' reference).
fn portable(per_row: usize, unit: &[u8], xs: &[ActivationRow], out: &mut [[f32; GROUP]]) {
    for group in 0..GROUPS_PER_UNIT {
        for (r, x) in xs.iter().enumerate() {
            let out = &mut out[r * GROUPS_PER_UNIT + group];
            *out = [0.0; GROUP];
            for b in 0..per_row {
                let block = &unit[b * UNIT_BLOCK_BYTES..][..UNIT_BLOCK_BYTES];
                let activations = &x.blocks[b * Q8K_BYTES..][..Q8K_BYTES];
                let dx = f32::from_le_bytes([
                    activations[0],
                    activations[1],
                    activations[2],
                    activations[3],
                ]);
                let value = |i: usize| activations[Q8K_VALUES_AT + i] as i8 as i32;
                let block_sum = |k: usize| {
                    let at = Q8K_SUMS_AT + 2 * k;
                    i16::from_le_bytes([activations[at], activations[at + 1]]) as i32
                };
                for (j, total) in out.iter_mut().enumerate() {
                    let row = group * GROUP + j;
                    let (mut sum, mut mins) = (0i32, 0i32);
                    for s in 0..SUB_BLOCKS {
                        let (pair, high) = (s / 2, s % 2 == 1);
                        let mut dot = 0i32;
                        for c in 0..CHUNKS_PER_PAIR {
                            for t in 0..4 {
                                let byte = block[chunk_at(pair, c) + 4 * row + t];
                                let nibble = if high { byte >> 4 } else { byte & 0x0f };
                                dot += nibble as i32 * value(32 * s + 4 * c + t);
                            }
                        }
                        sum += dot * block[SCALES_AT + s * UNIT + row] as i32;
                        let min = block[MINS_AT + s * UNIT + row] as i32;
                        mins += min * (block_sum(2 * s) + block_sum(2 * s + 1));
                    }
                    let d = half_at(block, 2 * row);
                    let dmin = half_at(block, DMINS_AT + 2 * row);
                    *total = (d * dx).mul_add(sum as f32, *total);
                    *total = (-(dmin * dx)).mul_add(mins as f32, *total);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::super::interleaved::{prefetch, MAX_ACTIVATIONS};
    use super::{chunk_at, ActivationRow, CHUNKS_PER_PAIR, DMINS_AT, GROUP, MINS_AT, SCALES_AT};
    use super::{Q8K_BYTES, Q8K_SUMS_AT, Q8K_VALUES_AT};
    use super::{SUB_BLOCKS, UNIT, UNIT_BLOCK_BYTES};

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avx2")
    }

    /// [`super::UnitKernel`]: a unit's sixteen rows in the lanes of one register.
    pub fn unit(per_row: usize, unit: &[u8], xs: &[ActivationRow], out: &mut [[f32; GROUP]]) {
        assert!(
            unit.len() >= per_row * UNIT_BLOCK_BYTES && xs.len() <= MAX_ACTIVATIONS,
            "a kernel call too large"
        );
        assert!(out.len() >= 2 * xs.len(), "a short output");
        for x in xs {
            assert!(
                x.blocks.len() >= per_row * Q8K_BYTES,
                "a short activation row"
            );
        }
        let mut lanes = [[0f32; UNIT]; MAX_ACTIVATIONS];
        let w = unit.as_ptr();
        let rows: [*const u8; MAX_ACTIVATIONS] =
            std::array::from_fn(|r| xs.get(r).map_or(std::ptr::null(), |x| x.blocks.as_ptr()));
        // SAFETY: `available()` held when this kernel was chosen; the asserts
        // keep every read inside `unit` and the activation rows.
        unsafe {
            match xs.len() {
                1 => store(&mut lanes, tile::<1>(per_row, w, [rows[0]])),
                2 => store(&mut lanes, tile::<2>(per_row, w, [rows[0], rows[1]])),
                3 => store(
                    &mut lanes,
                    tile::<3>(per_row, w, [rows[0], rows[1], rows[2]]),
                ),
                4 => store(
                    &mut lanes,
                    tile::<4>(per_row, w, [rows[0], rows[1], rows[2], rows[3]]),
                ),
                _ => {}
            }
        }
        for (r, lanes) in lanes[..xs.len()].iter().enumerate() {
            out[2 * r].copy_from_slice(&lanes[..GROUP]);
            out[2 * r + 1].copy_from_slice(&lanes[GROUP..]);
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn store<const R: usize>(out: &mut [[f32; UNIT]], sums: [__m512; R]) {
        for (lanes, sum) in out.iter_mut().zip(sums) {
            _mm512_storeu_ps(lanes.as_mut_ptr(), sum);
        }
    }

    /// The sixteen bytes at `p`, each widened to a 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    unsafe fn widened(p: *const u8) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))
    }

    /// The unit at `w` against `R` activation rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    unsafe fn tile<const R: usize>(per_row: usize, w: *const u8, x: [*const u8; R]) -> [__m512; R] {
        let nibble = _mm512_set1_epi8(0x0f);
        let sign = _mm512_set1_epi32(i32::MIN);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..per_row {
            let block = w.add(b * UNIT_BLOCK_BYTES);
            let xb: [*const u8; R] = std::array::from_fn(|r| x[r].add(b * Q8K_BYTES));
            let mut sums = [_mm512_setzero_si512(); R];
            for pair in 0..4 {
                let mut low_sums = [_mm512_setzero_si512(); R];
                let mut high_sums = [_mm512_setzero_si512(); R];
                for c in 0..CHUNKS_PER_PAIR {
                    let at = block.add(chunk_at(pair, c));
                    prefetch(at, 64);
                    let packed = _mm512_loadu_si512(at.cast());
                    let low = _mm512_and_si512(packed, nibble);
                    let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
                    for r in 0..R {
                        let values = xb[r].add(Q8K_VALUES_AT + 64 * pair + 4 * c);
                        let xl = _mm512_set1_epi32(std::ptr::read_unaligned(values.cast()));
                        let xh = _mm512_set1_epi32(std::ptr::read_unaligned(values.add(32).cast()));
                        low_sums[r] = _mm512_dpbusd_epi32(low_sums[r], low, xl);
                        high_sums[r] = _mm512_dpbusd_epi32(high_sums[r], high, xh);
                    }
                }
                let low_scales = widened(block.add(SCALES_AT + 2 * pair * UNIT));
                let high_scales = widened(block.add(SCALES_AT + (2 * pair + 1) * UNIT));
                for r in 0..R {
                    sums[r] =
                        _mm512_add_epi32(sums[r], _mm512_mullo_epi32(low_sums[r], low_scales));
                    sums[r] =
                        _mm512_add_epi32(sums[r], _mm512_mullo_epi32(high_sums[r], high_scales));
                }
            }
            // Each lane's min twice as 16-bit pairs: one `vpdpwssd` adds
            // min × (the sub-block's two sums of sixteen activations).
            let mut mins = [_mm512_setzero_si512(); R];
            for s in 0..SUB_BLOCKS {
                let min = widened(block.add(MINS_AT + s * UNIT));
                let twice = _mm512_or_si512(min, _mm512_slli_epi32(min, 16));
                for r in 0..R {
                    let pair_sums = std::ptr::read_unaligned(xb[r].add(Q8K_SUMS_AT + 4 * s).cast());
                    mins[r] = _mm512_dpwssd_epi32(mins[r], twice, _mm512_set1_epi32(pair_sums));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let dminw = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(DMINS_AT).cast()));
            for r in 0..R {
                let dx = _mm512_set1_ps(std::ptr::read_unaligned(xb[r].cast::<f32>()));
                let scale = _mm512_mul_ps(dw, dx);
                acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[r]), acc[r]);
                let min_scale = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(_mm512_mul_ps(dminw, dx)),
                    sign,
                ));
                acc[r] = _mm512_fmadd_ps(min_scale, _mm512_cvtepi32_ps(mins[r]), acc[r]);
            }
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::k_quants::{BlockQ4K, GgmlType};

    use super::*;

    fn matrix(rows: usize, cols: usize) -> (Vec<BlockQ4K>, InterleavedQ4K) {
        let weights: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1013) as f32 / 506.5 - 1.0 + (i % 7) as f32 * 0.3)
            .collect();
        let mut blocks = vec![BlockQ4K::zeros(); rows * cols / SUPER_BLOCK];
        BlockQ4K::from_float(&weights, &mut blocks);
        // SAFETY: `BlockQ4K` is a `repr(C)` struct of f16s and bytes with no
        // padding (its size is asserted in `super`).
        let bytes = unsafe {
            std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), blocks.len() * Q4K_BYTES)
        };
        let packed = InterleavedQ4K::new(bytes, rows, cols).unwrap();
        (blocks, packed)
    }

    /// The vector kernel gives the portable kernel's bits, for one row,
    /// batches and a short last unit; both are the scalar reference's
    /// products up to the order of their float sums.
    #[test]
    fn the_kernels_give_the_same_bits_and_the_reference_values() {
        let (rows, cols) = (43, 512);
        let (blocks, packed) = matrix(rows, cols);
        let mut kernels: Vec<(&str, UnitKernel)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            kernels.push(("avx512", avx512::unit));
        }
        let mut scratch = ActivationsQ8K::default();
        for batch in [1, 3, 4, 6, 9] {
            let input: Vec<f32> = (0..batch * cols)
                .map(|i| ((i * 104729) % 2017) as f32 / 1008.5 - 1.0)
                .collect();
            let shape = Shape { rows, cols, batch };
            let mut plain = vec![0f32; batch * rows];
            packed.matmul_with(portable, shape, &input, &mut plain, &mut scratch);
            let per_row = cols / SUPER_BLOCK;
            for r in 0..batch {
                let mut q = vec![BlockQ8K::zeros(); per_row];
                BlockQ8K::from_float(&input[r * cols..(r + 1) * cols], &mut q);
                for o in 0..rows {
                    let w = &blocks[o * per_row..(o + 1) * per_row];
                    let want = BlockQ4K::vec_dot_unopt(cols, w, &q);
                    let got = plain[r * rows + o];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "batch {batch}, row {r}, output {o}: {got} against {want}"
                    );
                }
            }
            for (name, kernel) in &kernels {
                let mut fast = vec![0f32; batch * rows];
                packed.matmul_with(*kernel, shape, &input, &mut fast, &mut scratch);
                let differ = fast
                    .iter()
                    .zip(&plain)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{name}, batch {batch}: {differ} outputs differ");
            }
        }
    }
}
