//! Q8_0 weights repacked sixteen rows to a unit (two groups of eight,
//! zipped block by block as [`super::super::interleaved`] zips Q4's), for
//! CPUs with AVX-512 VNNI: one 64-byte load holds four values of sixteen
//! rows, and one `vpdpbusd` adds their products with four broadcast
//! activations into the rows' lanes. Its unsigned operand is the weight plus 128, so a
//! block's sum is less 128 × the activations' sum, which is exact. A
//! block's sums are then scaled and added as the row kernel does
//! ([`super`]): the repacked matrix gives the row layout's bits (a page,
//! which keeps the row layout, gives the native head's logits).

use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};

use super::super::interleaved::{run_units, GROUP, GROUPS_PER_UNIT, UNIT};
use super::super::parallel::Shape;
use super::{bytes_of, scale_of, BLOCK, BLOCK_BYTES};
use crate::error::{ModelError, Result};

/// One block of a unit: sixteen `d`s (f16), then eight chunks of 64 bytes;
/// chunk `c` holds values `4c..4c + 4` of each row, plus 128, row after row.
const UNIT_BLOCK_BYTES: usize = 2 * UNIT + 8 * CHUNK_BYTES;
/// A chunk: four values of each of a unit's rows.
const CHUNK_BYTES: usize = 4 * UNIT;

/// Where, in a unit's block, chunk `c` starts.
const fn chunk_at(c: usize) -> usize {
    2 * UNIT + CHUNK_BYTES * c
}

/// Activation rows rounded to Q8_0 blocks, and each block's sum of values:
/// kept by the caller between products.
#[derive(Debug, Default)]
pub(crate) struct ActivationBlocks {
    blocks: Vec<BlockQ8_0>,
    sums: Vec<i32>,
}

/// A Q8_0 matrix `[rows, cols]` in units of sixteen rows (the last unit
/// padded with zero rows).
#[derive(Debug, Clone)]
pub(crate) struct InterleavedQ8 {
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

/// One activation row's blocks and each block's sum of values.
#[derive(Clone, Copy)]
struct ActivationRow<'a> {
    blocks: &'a [u8],
    sums: &'a [i32],
}

/// Multiplies one unit by up to `MAX_ACTIVATIONS` activation rows:
/// `out[r * GROUPS_PER_UNIT + i][j]` is weight row `j` of the unit's group `i`
/// times row `r`.
type UnitKernel = fn(per_row: usize, unit: &[u8], xs: &[ActivationRow], out: &mut [[f32; GROUP]]);

impl InterleavedQ8 {
    /// Whether this CPU has the kernel the repacked layout needs.
    pub fn supported() -> bool {
        #[cfg(target_arch = "x86_64")]
        return avx512::available();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Repacks `rows` rows of `cols` values in Q8_0 blocks.
    pub fn new(blocks: &[BlockQ8_0], rows: usize, cols: usize) -> Result<Self> {
        let per_row = cols / BLOCK;
        if !cols.is_multiple_of(BLOCK) || blocks.len() != rows * per_row {
            return Err(ModelError::InvalidConfig(format!(
                "{} blocks are not a {rows}x{cols} Q8_0 matrix",
                blocks.len()
            )));
        }
        let bytes = bytes_of(blocks);
        let units = rows.div_ceil(UNIT);
        let mut packed = vec![0u8; units * per_row * UNIT_BLOCK_BYTES];
        for (u, unit) in packed
            .chunks_exact_mut(per_row * UNIT_BLOCK_BYTES)
            .enumerate()
        {
            for (b, dst) in unit.chunks_exact_mut(UNIT_BLOCK_BYTES).enumerate() {
                for j in 0..UNIT {
                    let row = u * UNIT + j;
                    if row >= rows {
                        // Padding rows: zero weights (128 stored), zero scales.
                        for c in 0..8 {
                            dst[chunk_at(c) + 4 * j..][..4].fill(128);
                        }
                        continue;
                    }
                    let src = &bytes[(row * per_row + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                    dst[2 * j..2 * j + 2].copy_from_slice(&src[..2]);
                    for c in 0..8 {
                        let to = chunk_at(c) + 4 * j;
                        for t in 0..4 {
                            dst[to + t] = (src[2 + 4 * c + t] as i8 as i16 + 128) as u8;
                        }
                    }
                }
            }
        }
        Ok(InterleavedQ8 {
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
        activations: &mut ActivationBlocks,
    ) {
        self.matmul_with(kernel(), shape, input, out, activations)
    }

    fn matmul_with(
        &self,
        kernel: UnitKernel,
        shape: Shape,
        input: &[f32],
        out: &mut [f32],
        activations: &mut ActivationBlocks,
    ) {
        let Shape { rows, cols, batch } = shape;
        debug_assert_eq!((rows, cols), (self.rows, self.cols));
        let per_row = cols / BLOCK;
        let ActivationBlocks { blocks, sums } = activations;
        // Rounded as the row kernel rounds them (candle's Q8_0).
        blocks.resize(batch * per_row, BlockQ8_0::zeros());
        for (row, blocks) in input
            .chunks_exact(cols)
            .zip(blocks.chunks_exact_mut(per_row))
        {
            BlockQ8_0::from_float(row, blocks);
        }
        let block_bytes = bytes_of(blocks);
        sums.clear();
        sums.extend(
            block_bytes
                .chunks_exact(BLOCK_BYTES)
                .map(|b| b[2..].iter().map(|&v| v as i8 as i32).sum::<i32>()),
        );
        let sums = &*sums;
        run_units(
            &self.bytes,
            per_row * UNIT_BLOCK_BYTES,
            shape,
            |r| ActivationRow {
                blocks: &block_bytes[r * per_row * BLOCK_BYTES..(r + 1) * per_row * BLOCK_BYTES],
                sums: &sums[r * per_row..(r + 1) * per_row],
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

/// The kernels' arithmetic in plain Rust (the tests' reference).
fn portable(per_row: usize, unit: &[u8], xs: &[ActivationRow], out: &mut [[f32; GROUP]]) {
    for group in 0..GROUPS_PER_UNIT {
        for (r, x) in xs.iter().enumerate() {
            let out = &mut out[r * GROUPS_PER_UNIT + group];
            *out = [0.0; GROUP];
            for b in 0..per_row {
                let block = &unit[b * UNIT_BLOCK_BYTES..][..UNIT_BLOCK_BYTES];
                let activations = &x.blocks[b * BLOCK_BYTES..][..BLOCK_BYTES];
                let dx = scale_of(activations);
                for (j, total) in out.iter_mut().enumerate() {
                    let row = group * GROUP + j;
                    let mut sum = 0i32;
                    for c in 0..8 {
                        for t in 0..4 {
                            let w = block[chunk_at(c) + 4 * row + t] as i32;
                            sum += w * (activations[2 + 4 * c + t] as i8) as i32;
                        }
                    }
                    let sum = sum - 128 * x.sums[b];
                    *total += (scale_of(&block[2 * row..]) * dx) * sum as f32;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::super::interleaved::{prefetch, MAX_ACTIVATIONS};
    use super::{chunk_at, ActivationRow, BLOCK_BYTES, GROUP, UNIT, UNIT_BLOCK_BYTES};

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
            assert!(x.blocks.len() >= per_row * BLOCK_BYTES && x.sums.len() >= per_row);
        }
        let mut lanes = [[0f32; UNIT]; MAX_ACTIVATIONS];
        let w = unit.as_ptr();
        let rows: [(*const u8, *const i32); MAX_ACTIVATIONS] = std::array::from_fn(|r| {
            xs.get(r).map_or((std::ptr::null(), std::ptr::null()), |x| {
                (x.blocks.as_ptr(), x.sums.as_ptr())
            })
        });
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
                4 => store(&mut lanes, tile::<4>(per_row, w, rows)),
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

    /// The unit at `w` against `R` activation rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    unsafe fn tile<const R: usize>(
        per_row: usize,
        w: *const u8,
        x: [(*const u8, *const i32); R],
    ) -> [__m512; R] {
        let mut total = [_mm512_setzero_ps(); R];
        for b in 0..per_row {
            let block = w.add(b * UNIT_BLOCK_BYTES);
            prefetch(block, UNIT_BLOCK_BYTES);
            let mut sums = [_mm512_setzero_si512(); R];
            for c in 0..8 {
                let weights = _mm512_loadu_si512(block.add(chunk_at(c)).cast());
                for r in 0..R {
                    let values = x[r].0.add(b * BLOCK_BYTES + 2 + 4 * c);
                    let xs = _mm512_set1_epi32(std::ptr::read_unaligned(values.cast()));
                    sums[r] = _mm512_dpbusd_epi32(sums[r], weights, xs);
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            for r in 0..R {
                let offset = _mm512_set1_epi32(128 * *x[r].1.add(b));
                let sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r], offset));
                let dx = scale_at(x[r].0.add(b * BLOCK_BYTES));
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
                total[r] = _mm512_add_ps(total[r], _mm512_mul_ps(scale, sum));
            }
        }
        total
    }

    #[inline]
    unsafe fn scale_at(p: *const u8) -> f32 {
        half::f16::from_bits(std::ptr::read_unaligned(p.cast::<u16>())).to_f32()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repacked matrix gives the row kernel's bits with every kernel
    /// this CPU runs, for one row and batches, a short last group and
    /// ranges of odd groups.
    #[test]
    fn the_repacked_matrix_gives_the_row_kernels_bits() {
        let (rows, cols) = (45, 256);
        let (blocks, _) = super::super::test_matrix(rows, cols, 0);
        let packed = InterleavedQ8::new(&blocks, rows, cols).unwrap();
        let mut kernels: Vec<(&str, UnitKernel)> = vec![("portable", portable)];
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            kernels.push(("avx512", avx512::unit));
        }
        let mut scratch = ActivationBlocks::default();
        for batch in [1, 3, 4, 6] {
            let (_, input) = super::super::test_matrix(rows, cols, batch);
            let shape = Shape { rows, cols, batch };
            let mut by_rows = vec![0f32; batch * rows];
            super::super::matmul_rows(&blocks, shape, &input, &mut by_rows);
            for (name, kernel) in &kernels {
                let mut repacked = vec![0f32; batch * rows];
                packed.matmul_with(*kernel, shape, &input, &mut repacked, &mut scratch);
                let differ = repacked
                    .iter()
                    .zip(&by_rows)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{name}, batch {batch}: {differ} outputs differ");
            }
        }
    }
}
