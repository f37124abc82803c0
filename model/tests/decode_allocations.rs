//! A decode step through a kept-quantized span allocates nothing of its own
//! per layer: the rows path's buffers (`span/scratch.rs`) are sized by the
//! first steps and reused (a step of the default model allocated ~20
//! buffers in each of its 30 layers before). What is left per layer is
//! candle's: writing the step's key and value rows into the cache in place
//! (`Tensor::inplace_op1`) first checks that the cache's layout does not
//! overlap itself, which collects its axes into a vector, once per write.
//! What a step allocates besides (its output tensor) does not grow with the
//! span's layers.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use corolla_model::config::LlamaConfig;
use corolla_model::random_gguf::{write_random_gguf, ModelShape, RandomGguf, WeightQuant};
use corolla_model::span::BlockSpan;
use corolla_model::{Checkpoint, DType, Device, QuantizedWeights, Tensor};

/// Counts the allocations of the thread that asks (the step's caller; the
/// compute gang's workers only multiply).
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A kept-quantized span of `layers` small Llama layers in `quant`.
fn span(dir: &std::path::Path, layers: usize, quant: WeightQuant) -> BlockSpan {
    let config = LlamaConfig {
        hidden_size: 128,
        intermediate_size: 256,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        vocab_size: 512,
        ..ModelShape::Llama2_70b.config(layers)
    };
    let path = dir.join(format!("{layers}-{quant:?}.gguf"));
    let spec = RandomGguf {
        config,
        vocabulary: ModelShape::Llama2_70b,
        quant,
        seed: 11,
        name: "allocations".into(),
    };
    write_random_gguf(&path, &spec, |_, _| {}).unwrap();
    let checkpoint = Checkpoint::open(&path)
        .unwrap()
        .with_quantized_weights(QuantizedWeights::Keep);
    BlockSpan::load(&checkpoint, 0, layers, DType::F32, &Device::Cpu).unwrap()
}

fn hidden(t: usize, seed: usize) -> Tensor {
    let values: Vec<f32> = (0..t * 128)
        .map(|i| (((i + seed * 7919) * 104_729) % 2003) as f32 / 1001.5 - 1.0)
        .collect();
    Tensor::from_vec(values, (1, t, 128), &Device::Cpu).unwrap()
}

/// The allocations of one decode step, after a prefill and a few steps.
fn allocations_of_a_step(span: &BlockSpan) -> usize {
    let mut cache = span.new_cache(64).unwrap();
    span.forward(&hidden(5, 0), 0, &mut cache).unwrap();
    for position in 5..8 {
        span.forward(&hidden(1, position), position, &mut cache)
            .unwrap();
    }
    let input = hidden(1, 8);
    let before = ALLOCATIONS.with(Cell::get);
    let out = span.forward(&input, 8, &mut cache).unwrap();
    let after = ALLOCATIONS.with(Cell::get);
    drop(out);
    after - before
}

/// Allocations per layer of a decode step: candle's, one for each of the
/// two in-place cache writes (keys and values).
const CANDLES_PER_LAYER: usize = 2;

#[test]
fn a_decode_step_allocates_nothing_of_its_own_per_layer() {
    let dir = tempfile::tempdir().unwrap();
    let mut formats = vec![WeightQuant::Q4_1];
    // Q8_0 is repacked (and multiplied without allocating) where the CPU
    // has AVX-512 VNNI; elsewhere its row kernels round each product's
    // activations into a vector of their own.
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw") {
        formats.push(WeightQuant::Q8_0);
    }
    for quant in formats {
        let two = allocations_of_a_step(&span(dir.path(), 2, quant));
        let eight = allocations_of_a_step(&span(dir.path(), 8, quant));
        assert_eq!(
            eight.saturating_sub(two),
            6 * CANDLES_PER_LAYER,
            "{quant:?}: a decode step through 2 layers allocated {two} times, through 8 layers {eight}"
        );
    }
}
