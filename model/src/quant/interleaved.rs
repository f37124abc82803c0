//! Q4_1 and Q4_0 weights repacked sixteen rows to a unit, as llama.cpp
//! repacks Q4 weights: one vector holds the same four values of eight
//! weight rows (a group), so an activation's four bytes, broadcast, meet eight rows at
//! once and a block's eight sums come out in the lanes of one register with
//! no horizontal adds. A unit's two groups are zipped block by block, so
//! one AVX-512 load takes the four values of all sixteen rows, and a unit,
//! and the matrix, are read front to back as one stream (with the groups
//! one after the other, a kernel read two streams a group apart, and the
//! first chunk of each block waited on memory). The unpacked nibbles of a
//! unit's block serve up to four activation rows (a batch's sessions)
//! before the next block.
//!
//! Every output is computed in one order whatever the kernel or the batch:
//! a block's integer sum (exact; for Q4_0, whose values are the nibbles
//! less 8, less 8 × the activations' sum), then `acc = fma(d_w * d_x, sum,
//! acc)` and, for Q4_1, `acc = fma(m_w, s_x, acc)`, block after block. So a session's numbers do
//! not depend on who shares its step, nor on whether the machine has AVX2
//! (the portable kernel gives the same bits): a replacement server on
//! another CPU continues an answer exactly.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use half::f16;

use super::parallel::{self, OutPtr, Shape};
use crate::error::{ModelError, Result};

/// Weight rows per group: the f32 lanes of a 256-bit register.
pub(crate) const GROUP: usize = 8;
/// Groups per unit, the weight rows a kernel call takes (AVX-512 holds both
/// in a register).
pub(crate) const GROUPS_PER_UNIT: usize = 2;
/// Weight rows per unit.
pub(crate) const UNIT: usize = GROUPS_PER_UNIT * GROUP;
/// Values per block.
pub(crate) const BLOCK: usize = 32;
/// One block of a unit: sixteen `d`s, sixteen `m`s (f16; zero for Q4_0),
/// then four chunks of 64 bytes; chunk `c` holds bytes `4c..4c + 4` of
/// each row's nibbles, row after row (their low nibbles are values
/// `4c..4c + 4`, their high ones values `16 + 4c..16 + 4c + 4`).
pub(crate) const UNIT_BLOCK_BYTES: usize = 4 * UNIT + 4 * CHUNK_BYTES;
/// A chunk: four bytes of each of a unit's rows.
pub(crate) const CHUNK_BYTES: usize = 4 * UNIT;
/// Where, in a unit's block, the `m`s start.
pub(crate) const MINS_AT: usize = 2 * UNIT;
/// Where, in a unit's block, chunk `c` starts.
pub(crate) const fn chunk_at(c: usize) -> usize {
    4 * UNIT + CHUNK_BYTES * c
}
/// Activation rows a kernel call takes.
pub(crate) const MAX_ACTIVATIONS: usize = 4;

/// How far ahead of the block being multiplied the kernels ask for the
/// weights. The hardware's prefetcher alone left each chunk's load waiting
/// (the weights stream from the L3 or memory at every step), and it stops
/// at every 4 KiB page; asking 3-8 KiB ahead made a decode step of the
/// default model ~8 % faster on 2 cores (640 bytes ahead: ~3 %, 12 KiB:
/// ~5 %).
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_AHEAD: usize = 4096;

/// Asks for the cache lines of the `len` bytes [`PREFETCH_AHEAD`] after
/// `at`. A prefetch never faults: past the end of the weights it does
/// nothing.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch(at: *const u8, len: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = at.wrapping_add(PREFETCH_AHEAD);
    for line in (0..len).step_by(64) {
        // SAFETY: a prefetch reads nothing the program sees and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast()) };
    }
}

/// The 4-bit formats these kernels repack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nibbles {
    /// `d` (f16), 16 bytes of nibbles; a value is `d × (nibble - 8)`.
    Q4_0,
    /// `d`, `m` (f16), 16 bytes of nibbles; a value is `d × nibble + m`.
    Q4_1,
}

impl Nibbles {
    /// A block's bytes as GGUF stores it.
    fn block_bytes(self) -> usize {
        match self {
            Nibbles::Q4_0 => 18,
            Nibbles::Q4_1 => 20,
        }
    }

    /// Where a block's nibbles start.
    fn nibbles_at(self) -> usize {
        self.block_bytes() - 16
    }
}

/// A 4-bit matrix `[rows, cols]` in units of sixteen rows (the last unit
/// padded with zero rows).
#[derive(Debug, Clone)]
pub(crate) struct InterleavedQ4 {
    format: Nibbles,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

/// One activation row, quantized: 32 values a block, each block's `d` and
/// `s`, and the sum of its values.
#[derive(Clone, Copy)]
pub(crate) struct ActivationRow<'a> {
    pub values: &'a [i8],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
}

/// Multiplies one unit of weight rows (`per_row` blocks of
/// [`UNIT_BLOCK_BYTES`]) by up to [`MAX_ACTIVATIONS`] activation rows:
/// `out[r * GROUPS_PER_UNIT + i][j]` is weight row `j` of the unit's group `i`
/// times row `r`.
type UnitKernel = fn(
    format: Nibbles,
    per_row: usize,
    unit: &[u8],
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
);

impl InterleavedQ4 {
    /// Repacks `bytes`, `rows` rows of `cols` values in `format`'s blocks.
    pub fn new(format: Nibbles, bytes: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let per_row = cols / BLOCK;
        let block_bytes = format.block_bytes();
        if !cols.is_multiple_of(BLOCK) || bytes.len() != rows * per_row * block_bytes {
            return Err(ModelError::InvalidConfig(format!(
                "{} bytes are not a {rows}x{cols} {format:?} matrix",
                bytes.len()
            )));
        }
        let nibbles = format.nibbles_at();
        let units = rows.div_ceil(UNIT);
        let mut packed = vec![0u8; units * per_row * UNIT_BLOCK_BYTES];
        for (u, unit) in packed
            .chunks_exact_mut(per_row * UNIT_BLOCK_BYTES)
            .enumerate()
        {
            for (b, dst) in unit.chunks_exact_mut(UNIT_BLOCK_BYTES).enumerate() {
                for j in 0..UNIT.min(rows - u * UNIT) {
                    let at = ((u * UNIT + j) * per_row + b) * block_bytes;
                    let src = &bytes[at..at + block_bytes];
                    dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
                    if format == Nibbles::Q4_1 {
                        dst[MINS_AT + 2 * j..MINS_AT + 2 * j + 2].copy_from_slice(&src[2..4]);
                    }
                    for c in 0..4 {
                        let to = chunk_at(c) + 4 * j;
                        let from = nibbles + 4 * c;
                        dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
                    }
                }
            }
        }
        Ok(InterleavedQ4 {
            format,
            rows,
            cols,
            bytes: packed,
        })
    }

    /// `out[r * rows + o] = dot(weight row o, input row r)`, the input
    /// rows quantized into `activations`.
    pub fn matmul(
        &self,
        shape: Shape,
        input: &[f32],
        out: &mut [f32],
        activations: &mut Activations,
    ) {
        self.matmul_with(kernel(), quantizer(), shape, input, out, activations)
    }

    fn matmul_with(
        &self,
        kernel: UnitKernel,
        quantize: Quantizer,
        shape: Shape,
        input: &[f32],
        out: &mut [f32],
        activations: &mut Activations,
    ) {
        let Shape { rows, cols, batch } = shape;
        debug_assert_eq!((rows, cols), (self.rows, self.cols));
        let per_row = cols / BLOCK;
        activations.quantize(input, batch * per_row, quantize);
        let activations = &*activations;
        run_units(
            &self.bytes,
            per_row * UNIT_BLOCK_BYTES,
            shape,
            |r| activations.row(r, per_row),
            |weights, xs, sums| kernel(self.format, per_row, weights, xs, sums),
            out,
        );
    }
}

/// Multiplies a matrix repacked [`UNIT`] rows to a unit (`unit_bytes` a
/// unit in `bytes`, the last one padded) by the activation rows
/// (`activation(r)` for each input row `r`): `kernel` takes one unit and up
/// to [`MAX_ACTIVATIONS`] rows a call, as [`UnitKernel`] does, and the
/// units are split over the pool. Writes `out[r * rows + o]`; the last
/// unit's padding rows are dropped.
pub(crate) fn run_units<A: Copy + Sync>(
    bytes: &[u8],
    unit_bytes: usize,
    shape: Shape,
    activation: impl Fn(usize) -> A + Sync,
    kernel: impl Fn(&[u8], &[A], &mut [[f32; GROUP]]) + Sync,
    out: &mut [f32],
) {
    let Shape { rows, cols, batch } = shape;
    let units = rows.div_ceil(UNIT);
    assert_eq!(out.len(), batch * rows, "output of the wrong size");
    assert!(bytes.len() >= units * unit_bytes, "a short matrix");
    if batch == 0 {
        return;
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        let mut sums = [[0f32; GROUP]; MAX_ACTIVATIONS * GROUPS_PER_UNIT];
        for u in range {
            let weights = &bytes[u * unit_bytes..(u + 1) * unit_bytes];
            for tile in 0..batch.div_ceil(MAX_ACTIVATIONS) {
                let first = tile * MAX_ACTIVATIONS;
                let n = MAX_ACTIVATIONS.min(batch - first);
                let xs: [A; MAX_ACTIVATIONS] =
                    std::array::from_fn(|k| activation(first + k.min(n - 1)));
                let xs = &xs[..n];
                let sums = &mut sums[..n * GROUPS_PER_UNIT];
                kernel(weights, xs, sums);
                for (k, lanes) in sums.iter().enumerate() {
                    let r = tile * MAX_ACTIVATIONS + k / GROUPS_PER_UNIT;
                    let first = u * UNIT + (k % GROUPS_PER_UNIT) * GROUP;
                    let valid = GROUP.min(rows.saturating_sub(first));
                    // SAFETY: each (r, o) is written by exactly one work
                    // item, and r * rows + first + valid <= batch * rows.
                    // One slice copy, not a write per value with its own
                    // index arithmetic.
                    unsafe { out_ptr.slice(r * rows + first, valid) }
                        .copy_from_slice(&lanes[..valid]);
                }
            }
        }
    };
    parallel::split(units, rows * cols * batch, run);
}

/// Activation rows rounded to 8 bits per block of 32 as llama.cpp's Q8_1
/// does (`d` = the block's largest magnitude / 127, `s` = `d` × the sum of
/// its values, in f16 as candle computes them), rounding halves to even in
/// every kernel. Kept by the caller between products, so that a step
/// reuses their room instead of allocating it.
#[derive(Debug, Default)]
pub(crate) struct Activations {
    values: Vec<i8>,
    /// `d` and `s` of each block, as f32.
    scales: Vec<f32>,
    /// The sum of each block's values.
    sums: Vec<i32>,
}

impl Activations {
    /// Rounds `input`, `blocks` blocks of [`BLOCK`] values.
    fn quantize(&mut self, input: &[f32], blocks: usize, quantize: Quantizer) {
        let Activations {
            values,
            scales,
            sums,
        } = self;
        values.resize(blocks * BLOCK, 0);
        scales.resize(blocks * 2, 0.0);
        sums.resize(blocks, 0);
        for (((x, q), scale), block_sum) in input
            .chunks_exact(BLOCK)
            .zip(values.chunks_exact_mut(BLOCK))
            .zip(scales.chunks_exact_mut(2))
            .zip(sums.iter_mut())
        {
            let (d, sum) = quantize(x, q);
            *block_sum = sum;
            let d = f16::from_f32(d);
            scale[0] = d.to_f32();
            scale[1] = (f16::from_f32(sum as f32) * d).to_f32();
        }
    }

    fn row(&self, r: usize, per_row: usize) -> ActivationRow<'_> {
        ActivationRow {
            values: &self.values[r * per_row * BLOCK..(r + 1) * per_row * BLOCK],
            scales: &self.scales[r * per_row * 2..(r + 1) * per_row * 2],
            sums: &self.sums[r * per_row..(r + 1) * per_row],
        }
    }
}

/// Rounds a block of 32 values to `q` (as `round(x / d)`), returning `d`
/// and the sum of `q`.
type Quantizer = fn(x: &[f32], q: &mut [i8]) -> (f32, i32);

fn quantizer() -> Quantizer {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        return avx2::quantize_block;
    }
    quantize_block
}

fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
        sum += *q as i32;
    }
    (d, sum)
}

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_ne_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The fastest kernel this CPU runs (all give the same bits).
fn kernel() -> UnitKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available() {
            return avx512::unit;
        }
        if avx2::available() {
            return |format, per_row, unit, xs, out| {
                group_by_group(avx2::group, format, per_row, unit, xs, out)
            };
        }
    }
    portable
}

/// Multiplies group `group` of a unit (`per_row` blocks of
/// [`UNIT_BLOCK_BYTES`]) by up to [`MAX_ACTIVATIONS`] activation rows:
/// `out[r][j]` is the group's weight row `j` times row `r`.
type GroupKernel = fn(
    format: Nibbles,
    per_row: usize,
    unit: &[u8],
    group: usize,
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
);

/// A [`UnitKernel`] of a kernel of one group at a time.
fn group_by_group(
    one: GroupKernel,
    format: Nibbles,
    per_row: usize,
    unit: &[u8],
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
) {
    let mut sums = [[0f32; GROUP]; MAX_ACTIVATIONS];
    for group in 0..GROUPS_PER_UNIT {
        one(format, per_row, unit, group, xs, &mut sums[..xs.len()]);
        for (r, lanes) in sums[..xs.len()].iter().enumerate() {
            out[r * GROUPS_PER_UNIT + group] = *lanes;
        }
    }
}

/// The kernels' arithmetic in plain Rust, for CPUs without AVX2 and wasm.
fn portable(
    format: Nibbles,
    per_row: usize,
    unit: &[u8],
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
) {
    group_by_group(portable_group, format, per_row, unit, xs, out)
}

/// [`portable`] for one group.
fn portable_group(
    format: Nibbles,
    per_row: usize,
    unit: &[u8],
    group: usize,
    xs: &[ActivationRow],
    out: &mut [[f32; GROUP]],
) {
    for (x, out) in xs.iter().zip(out.iter_mut()) {
        *out = [0.0; GROUP];
        for b in 0..per_row {
            let block = &unit[b * UNIT_BLOCK_BYTES..(b + 1) * UNIT_BLOCK_BYTES];
            let activations = &x.values[b * BLOCK..(b + 1) * BLOCK];
            let (dx, sx) = (x.scales[2 * b], x.scales[2 * b + 1]);
            for (j, acc) in out.iter_mut().enumerate() {
                let row = group * GROUP + j;
                let mut sum = 0i32;
                for c in 0..4 {
                    for t in 0..4 {
                        let byte = block[chunk_at(c) + 4 * row + t];
                        let low = activations[4 * c + t] as i32;
                        let high = activations[16 + 4 * c + t] as i32;
                        sum += (byte & 0x0f) as i32 * low + (byte >> 4) as i32 * high;
                    }
                }
                let dw = half_at(block, 2 * row);
                match format {
                    Nibbles::Q4_0 => {
                        let sum = sum - 8 * x.sums[b];
                        *acc = (dw * dx).mul_add(sum as f32, *acc);
                    }
                    Nibbles::Q4_1 => {
                        let mw = half_at(block, MINS_AT + 2 * row);
                        *acc = (dw * dx).mul_add(sum as f32, *acc);
                        *acc = mw.mul_add(sx, *acc);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rows` rows of `cols` values quantized to `format`, repacked.
    fn matrix(format: Nibbles, rows: usize, cols: usize) -> InterleavedQ4 {
        use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ4_1, GgmlType};
        fn bytes_of<T: GgmlType>(weights: &[f32]) -> Vec<u8> {
            let mut blocks = vec![T::zeros(); weights.len() / T::BLCK_SIZE];
            T::from_float(weights, &mut blocks);
            // SAFETY: the block types are `repr(C)` structs of f16s and
            // bytes with no padding: their bytes are initialised.
            unsafe {
                std::slice::from_raw_parts(
                    blocks.as_ptr().cast::<u8>(),
                    blocks.len() * std::mem::size_of::<T>(),
                )
            }
            .to_vec()
        }
        let weights: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1013) as f32 / 506.5 - 1.0)
            .collect();
        let bytes = match format {
            Nibbles::Q4_0 => bytes_of::<BlockQ4_0>(&weights),
            Nibbles::Q4_1 => bytes_of::<BlockQ4_1>(&weights),
        };
        InterleavedQ4::new(format, &bytes, rows, cols).unwrap()
    }

    /// Every vector kernel this CPU runs.
    fn vector_kernels() -> Vec<(&'static str, UnitKernel)> {
        let mut kernels: Vec<(&'static str, UnitKernel)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if avx2::available() {
                kernels.push(("avx2", |format, per_row, unit, xs, out| {
                    group_by_group(avx2::group, format, per_row, unit, xs, out)
                }));
            }
            if avx512::available() {
                kernels.push(("avx512", avx512::unit));
            }
        }
        kernels
    }

    /// Every vector kernel and the portable one agree bit for bit (a
    /// server without AVX2 or AVX-512 continues another's answer exactly).
    #[test]
    fn the_kernels_give_the_same_bits() {
        let (rows, cols) = (43, 256);
        // Rows of halves too: with 127 in each block, `d` is 1 and every
        // other value a tie to round.
        let halves = |i: usize| match i % BLOCK {
            0 => 127.0,
            _ => ((i * 7) % 251) as f32 - 125.5,
        };
        for format in [Nibbles::Q4_0, Nibbles::Q4_1] {
            let matrix = matrix(format, rows, cols);
            for (batch, ties) in [(1, false), (3, false), (4, false), (9, false), (5, true)] {
                let input: Vec<f32> = (0..batch * cols)
                    .map(|i| match ties {
                        true => halves(i),
                        false => ((i * 104729) % 2017) as f32 / 1008.5 - 1.0,
                    })
                    .collect();
                let shape = Shape { rows, cols, batch };
                let mut plain = vec![0f32; batch * rows];
                let mut scratch = Activations::default();
                matrix.matmul_with(
                    portable,
                    quantize_block,
                    shape,
                    &input,
                    &mut plain,
                    &mut scratch,
                );
                for (name, kernel) in vector_kernels() {
                    let mut fast = vec![0f32; batch * rows];
                    matrix.matmul_with(kernel, quantizer(), shape, &input, &mut fast, &mut scratch);
                    let differ = fast
                        .iter()
                        .zip(&plain)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "{name}, {format:?} batch {batch}: {differ} outputs differ"
                    );
                }
            }
        }
    }
}
