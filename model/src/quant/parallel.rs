//! The product of a batch of activation rows with a quantized matrix, split
//! over the thread pool by weight rows.

use candle_core::quantized::k_quants::GgmlType;

/// A block dot product: `n` values of weight blocks against activation blocks.
pub(crate) type Dot<T> = fn(usize, &[T], &[<T as GgmlType>::VecDotType]) -> f32;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Weight rows (outputs).
    pub rows: usize,
    /// Values per row (inputs).
    pub cols: usize,
    /// Activation rows.
    pub batch: usize,
}

/// Below this many weight values times rows a product runs on the calling
/// thread: waking the pool costs more than it saves.
const PARALLEL_MIN_WORK: usize = 96 * 1024;

/// Weight rows per work item are a multiple of this.
const ROW_GRAIN: usize = 8;

/// `out[r * rows + o] = dot(weights row o, input row r)`.
pub(crate) fn matmul<T: GgmlType>(
    weights: &[T],
    shape: Shape,
    input: &[f32],
    out: &mut [f32],
    dot: Dot<T>,
) {
    let Shape { rows, cols, batch } = shape;
    let per_row = cols / T::BLCK_SIZE;
    let mut quantized = vec![T::VecDotType::zeros(); batch * per_row];
    for (row, blocks) in input
        .chunks_exact(cols)
        .zip(quantized.chunks_exact_mut(per_row))
    {
        T::VecDotType::from_float(row, blocks);
    }
    let quantized = &quantized;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        for o in range {
            let w = &weights[o * per_row..(o + 1) * per_row];
            for (r, x) in quantized.chunks_exact(per_row).enumerate() {
                let value = dot(cols, w, x);
                // SAFETY: each (r, o) is written by exactly one work item,
                // and r * rows + o < batch * rows = out.len().
                unsafe { out_ptr.write(r * rows + o, value) };
            }
        }
    };
    let threads = pool_threads();
    if threads <= 1 || rows * cols * batch < PARALLEL_MIN_WORK {
        run(0..rows);
        return;
    }
    // A few items per thread: the caller's thread takes them too, so a
    // worker that the OS delays (other processes share these cores) costs
    // one item, not its whole half.
    let items = (threads * 4).min(rows.div_ceil(ROW_GRAIN)).max(1);
    let per_item = rows.div_ceil(items).next_multiple_of(ROW_GRAIN);
    run_items(rows.div_ceil(per_item), |item| {
        run(item * per_item..((item + 1) * per_item).min(rows))
    });
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: work items write disjoint elements (see `matmul`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    unsafe fn write(self, index: usize, value: f32) {
        *self.0.add(index) = value;
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn pool_threads() -> usize {
    rayon::current_num_threads()
}

#[cfg(not(target_arch = "wasm32"))]
fn run_items(items: usize, f: impl Fn(usize) + Sync + Send) {
    use rayon::prelude::*;
    (0..items).into_par_iter().for_each(f);
}

#[cfg(target_arch = "wasm32")]
fn pool_threads() -> usize {
    1
}

#[cfg(target_arch = "wasm32")]
fn run_items(items: usize, f: impl Fn(usize)) {
    (0..items).for_each(f);
}
