//! The product of a batch of activation rows with a quantized matrix, split
//! over the thread pool by weight rows.

use candle_core::quantized::k_quants::GgmlType;

/// A block dot product: `n` values of weight blocks against activation blocks.
pub(crate) type Dot<T> = fn(usize, &[T], &[<T as GgmlType>::VecDotType]) -> f32;

/// Four weight rows against one activation row: the activation's blocks
/// are loaded once, and four independent sums keep the core busy.
pub(crate) type Dot4<T> =
    fn(usize, &[T], &[T], &[T], &[T], &[<T as GgmlType>::VecDotType]) -> (f32, f32, f32, f32);

/// One weight row against four activation rows: the weight blocks are
/// unpacked once for all four (a batch's rows).
pub(crate) type Batched4<T> = fn(usize, &[T], [&[<T as GgmlType>::VecDotType]; 4]) -> [f32; 4];

/// The dot products of a format.
pub(crate) struct Kernels<T: GgmlType> {
    pub one: Dot<T>,
    pub four: Dot4<T>,
    pub batched: Option<Batched4<T>>,
}

impl<T: GgmlType> Kernels<T> {
    /// Candle's own (vectorised for most formats).
    pub fn candle() -> Self {
        Kernels {
            one: T::vec_dot,
            four: T::vec_dot_4,
            batched: None,
        }
    }
}

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
    kernels: Kernels<T>,
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
    let row = |o: usize| &weights[o * per_row..(o + 1) * per_row];
    let activations = |r: usize| &quantized[r * per_row..(r + 1) * per_row];
    let run_batched = |range: std::ops::Range<usize>, batched: Batched4<T>| {
        for o in range {
            let w = row(o);
            let mut r = 0;
            while r + 4 <= batch {
                let x = [
                    activations(r),
                    activations(r + 1),
                    activations(r + 2),
                    activations(r + 3),
                ];
                for (k, value) in batched(cols, w, x).into_iter().enumerate() {
                    // SAFETY: each (r, o) is written by exactly one work item,
                    // and (r + k) * rows + o < batch * rows = out.len().
                    unsafe { out_ptr.write((r + k) * rows + o, value) };
                }
                r += 4;
            }
            for r in r..batch {
                // SAFETY: as above.
                unsafe { out_ptr.write(r * rows + o, (kernels.one)(cols, w, activations(r))) };
            }
        }
    };
    let run = |range: std::ops::Range<usize>| {
        if let (Some(batched), true) = (kernels.batched, batch >= 4) {
            return run_batched(range, batched);
        }
        let mut o = range.start;
        while o + 4 <= range.end {
            let (w0, w1, w2, w3) = (row(o), row(o + 1), row(o + 2), row(o + 3));
            for (r, x) in quantized.chunks_exact(per_row).enumerate() {
                let (a, b, c, d) = (kernels.four)(cols, w0, w1, w2, w3, x);
                // SAFETY: each (r, o) is written by exactly one work item,
                // and r * rows + o + 3 < batch * rows = out.len().
                unsafe {
                    out_ptr.write(r * rows + o, a);
                    out_ptr.write(r * rows + o + 1, b);
                    out_ptr.write(r * rows + o + 2, c);
                    out_ptr.write(r * rows + o + 3, d);
                }
            }
            o += 4;
        }
        for o in o..range.end {
            for (r, x) in quantized.chunks_exact(per_row).enumerate() {
                let value = (kernels.one)(cols, row(o), x);
                // SAFETY: as above.
                unsafe { out_ptr.write(r * rows + o, value) };
            }
        }
    };
    split(rows.div_ceil(ROW_GRAIN), rows * cols * batch, |grains| {
        run(grains.start * ROW_GRAIN..(grains.end * ROW_GRAIN).min(rows))
    });
}

/// Runs `run` over `0..units` split in ranges over the thread pool, or on
/// the calling thread when `work` (weight values times rows) is too little
/// to pay for waking the pool.
pub(crate) fn split(units: usize, work: usize, run: impl Fn(std::ops::Range<usize>) + Sync + Send) {
    let threads = crate::pool::threads();
    if threads <= 1 || work < PARALLEL_MIN_WORK {
        run(0..units);
        return;
    }
    // A few items per thread: the caller's thread takes them too, so a
    // worker that the OS delays (other processes share these cores) costs
    // one item, not its whole half.
    let items = (threads * 4).min(units).max(1);
    let per_item = units.div_ceil(items);
    crate::pool::for_each(units.div_ceil(per_item), &|item| {
        run(item * per_item..((item + 1) * per_item).min(units))
    });
}

/// Calls `run(start, part)` for parts of `out` (`start`: the part's first
/// index) over the threads of the forward, parts of at least `min_part`
/// values: element-wise work between two products, which would otherwise
/// leave the other threads spinning.
pub(crate) fn for_parts(out: &mut [f32], min_part: usize, run: impl Fn(usize, &mut [f32]) + Sync) {
    let len = out.len();
    let parts = crate::pool::threads().min(len / min_part.max(1)).max(1);
    if parts == 1 {
        run(0, out);
        return;
    }
    let per_part = len.div_ceil(parts);
    let out = OutPtr(out.as_mut_ptr());
    crate::pool::for_each(parts, &|part| {
        let start = part * per_part;
        let end = ((part + 1) * per_part).min(len);
        // SAFETY: parts are disjoint ranges of `out`, each written by one item.
        run(start, unsafe { out.slice(start, end - start) });
    });
}

/// Where the work items write their outputs.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub *mut f32);
// SAFETY: work items write disjoint elements (see `matmul`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    /// # Safety
    /// `index` lies inside the output, and no other item writes it.
    pub unsafe fn write(self, index: usize, value: f32) {
        *self.0.add(index) = value;
    }

    /// # Safety
    /// `at..at + len` lies inside the output, and no other item writes it
    /// while the slice lives.
    pub unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}
