//! A batched decode step equals the same steps run alone (f32 within 1e-4
//! of the output's scale; kept quantized bit for bit), a short step of
//! several positions equals them decoded one by one (kept quantized, bit for
//! bit), and a prefill split into chunks equals the prefill run at once.

use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::{BlockSpan, Checkpoint, DType, Device, SessionCache, Tensor};

const HIDDEN: usize = 64;

fn span() -> BlockSpan {
    span_with_kv_heads(2)
}

fn span_with_kv_heads(num_kv_heads: usize) -> BlockSpan {
    let dir = tempfile::tempdir().unwrap();
    let spec = RandomSpec {
        hidden_size: HIDDEN,
        num_layers: 3,
        num_heads: 8,
        num_kv_heads,
        intermediate_size: 96,
        vocab_size: 32,
        max_positions: 256,
        seed: 7,
    };
    write_random_checkpoint(dir.path(), &spec).unwrap();
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    BlockSpan::load(&checkpoint, 0, 3, DType::F32, &Device::Cpu).unwrap()
}

fn hidden(t: usize, seed: u64) -> Tensor {
    hidden_of_width(t, HIDDEN, seed)
}

fn hidden_of_width(t: usize, width: usize, seed: u64) -> Tensor {
    let values: Vec<f32> = (0..t * width)
        .map(|i| (((i as u64 + 1) * (seed * 2 + 1) % 97) as f32 / 48.5) - 1.0)
        .collect();
    Tensor::from_vec(values, (1, t, width), &Device::Cpu).unwrap()
}

/// Largest absolute difference over the reference's root mean square.
fn relative_difference(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let rms = b
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .sqrt()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    diff / rms
}

fn prefilled(span: &BlockSpan, lengths: &[usize]) -> Vec<SessionCache> {
    let width = span.config().hidden_size;
    lengths
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let mut cache = span.new_cache(64).unwrap();
            span.forward(&hidden_of_width(t, width, i as u64), 0, &mut cache)
                .unwrap();
            cache
        })
        .collect()
}

/// Sessions with histories of `lengths` take `rounds` decode steps, each
/// alone and all together as one batch; per round, each session's
/// `(batched, alone)` outputs.
fn decode_alone_and_batched(
    span: &BlockSpan,
    lengths: &[usize],
    rounds: u64,
) -> Vec<Vec<(Tensor, Tensor)>> {
    let width = span.config().hidden_size;
    let mut alone = prefilled(span, lengths);
    let mut batched = prefilled(span, lengths);
    let mut out = Vec::new();
    for round in 0..rounds {
        let inputs: Vec<Tensor> = (0..lengths.len())
            .map(|i| hidden_of_width(1, width, 100 + round * 10 + i as u64))
            .collect();
        let expected: Vec<Tensor> = inputs
            .iter()
            .zip(alone.iter_mut())
            .map(|(x, cache)| {
                let start = cache.len();
                span.forward(x, start, cache).unwrap()
            })
            .collect();
        let mut steps: Vec<(Tensor, usize, &mut SessionCache)> = inputs
            .iter()
            .cloned()
            .zip(batched.iter_mut())
            .map(|(x, cache)| (x, cache.len(), cache))
            .collect();
        let outputs = span.forward_decode_batch(&mut steps).unwrap();
        assert_eq!(outputs.len(), expected.len());
        out.push(outputs.into_iter().zip(expected).collect());
    }
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a.len(), b.len());
    }
    out
}

#[test]
fn a_batched_decode_step_equals_each_step_alone() {
    // Grouped-query heads (8 over 2) and one KV head per query head.
    for kv_heads in [2, 8] {
        batched_equals_alone(&span_with_kv_heads(kv_heads));
    }
}

fn batched_equals_alone(span: &BlockSpan) {
    // Ragged histories: each session at its own position.
    let rounds = decode_alone_and_batched(span, &[1, 5, 12, 30, 2], 4);
    for (round, outputs) in rounds.iter().enumerate() {
        for (got, want) in outputs {
            assert_eq!(got.dims(), &[1, 1, HIDDEN]);
            let d = relative_difference(got, want);
            assert!(d < 1e-4, "round {round}: batched differs by {d} of the RMS");
        }
    }
}

/// Kept quantized, every product quantizes each row of activations on its
/// own and sums in one order whatever the batch: a session's output is the
/// same bits whoever shares its step (nine rows: two groups of four for the
/// batched kernel and one left over).
#[test]
fn a_kept_quantized_batched_decode_step_is_each_step_alone_bit_for_bit() {
    use corolla_model::random_gguf::WeightQuant;
    use corolla_tests::span_batching::small_kept_quantized;
    let dir = tempfile::tempdir().unwrap();
    let checkpoint =
        small_kept_quantized(dir.path(), "q4_1-batch", 256, 704, WeightQuant::Q4_1, 5).unwrap();
    let span = BlockSpan::load(&checkpoint, 0, 2, DType::F32, &Device::Cpu).unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        values.into_iter().map(f32::to_bits).collect()
    };
    let rounds = decode_alone_and_batched(&span, &[1, 5, 12, 30, 2, 7, 3, 9, 4], 3);
    for (round, outputs) in rounds.iter().enumerate() {
        for (i, (got, want)) in outputs.iter().enumerate() {
            assert!(
                bits(got) == bits(want),
                "round {round}, session {i}: the batched output differs from the step alone by {} of the RMS",
                relative_difference(got, want)
            );
        }
    }
}

/// Kept quantized, a step of several positions of one session (drafts
/// being checked, a short message) gives each position the bits it gets
/// decoded alone: an answer's tokens do not depend on how many positions
/// each of its steps carried (the WAN benchmark's drafting client once
/// answered otherwise than the same client run locally).
#[test]
fn a_kept_quantized_step_of_several_positions_is_each_position_alone_bit_for_bit() {
    use corolla_model::random_gguf::WeightQuant;
    use corolla_tests::span_batching::kept_quantized_with_heads;
    const WIDTH: usize = 1024;
    let dir = tempfile::tempdir().unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        values.into_iter().map(f32::to_bits).collect()
    };
    // Heads of 64 (grouped, two per KV head) and one head as wide as the
    // model (the wire-shaped model's: long dot products are where summation
    // orders part).
    for (quant, heads) in [(WeightQuant::Q8_0, (1, 1)), (WeightQuant::Q4_1, (16, 8))] {
        let name = format!("{quant:?}-{}-heads", heads.0);
        let checkpoint =
            kept_quantized_with_heads(dir.path(), &name, WIDTH, 256, heads, quant, 5).unwrap();
        let span = BlockSpan::load(&checkpoint, 0, 2, DType::F32, &Device::Cpu).unwrap();
        let prompt = hidden_of_width(9, WIDTH, 3);
        // Up to a prompt's length: every step of one session attends row
        // by row on the CPU.
        for positions in [2, 5, 17, 32, 70] {
            let step = hidden_of_width(positions, WIDTH, 11);
            let mut together = span.new_cache(128).unwrap();
            span.forward(&prompt, 0, &mut together).unwrap();
            let got = span.forward(&step, 9, &mut together).unwrap();
            let mut alone = span.new_cache(128).unwrap();
            span.forward(&prompt, 0, &mut alone).unwrap();
            let one_by_one: Vec<Tensor> = (0..positions)
                .map(|j| {
                    let row = step.narrow(1, j, 1).unwrap();
                    span.forward(&row, 9 + j, &mut alone).unwrap()
                })
                .collect();
            let want = Tensor::cat(&one_by_one, 1).unwrap();
            assert!(
                bits(&got) == bits(&want),
                "{quant:?}, {heads:?} heads, a step of {positions}: differs from the positions alone by {} of the RMS",
                relative_difference(&got, &want)
            );
        }
    }
}

#[test]
fn a_prefill_in_chunks_equals_the_prefill_at_once() {
    let span = span();
    let prompt = hidden(45, 3);
    let mut whole = span.new_cache(64).unwrap();
    let expected = span.forward(&prompt, 0, &mut whole).unwrap();
    let mut chunked = span.new_cache(64).unwrap();
    let mut outputs = Vec::new();
    for (start, len) in [(0, 16), (16, 16), (32, 13)] {
        let chunk = prompt.narrow(1, start, len).unwrap();
        outputs.push(span.forward(&chunk, start, &mut chunked).unwrap());
    }
    let got = Tensor::cat(&outputs, 1).unwrap();
    let d = relative_difference(&got, &expected);
    assert!(d < 1e-4, "chunked prefill differs by {d} of the RMS");
    // The next decode step sees the same cache either way.
    let next = hidden(1, 9);
    let a = span.forward(&next, 45, &mut whole).unwrap();
    let b = span.forward(&next, 45, &mut chunked).unwrap();
    assert!(relative_difference(&b, &a) < 1e-4);
}

#[test]
fn a_batch_refuses_mixed_steps() {
    let span = span();
    let mut caches = prefilled(&span, &[3, 3]);
    let [a, b] = caches.as_mut_slice() else {
        unreachable!()
    };
    // Two positions in a decode batch.
    let mut steps = vec![(hidden(1, 1), 3, a), (hidden(2, 2), 3, b)];
    assert!(span.forward_decode_batch(&mut steps).is_err());
    // A position gap.
    let mut caches = prefilled(&span, &[3]);
    let mut steps = vec![(hidden(1, 1), 5, &mut caches[0])];
    assert!(span.forward_decode_batch(&mut steps).is_err());
    assert!(span.forward_decode_batch(&mut []).unwrap().is_empty());
}
