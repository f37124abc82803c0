use candle_core::{DType, Device, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::{ExpertConfig, LlamaConfig};
use crate::random_gguf::{write_random_gguf, ModelShape, RandomGguf, WeightQuant};
use crate::span::BlockSpan;

/// A small kept-quantized model of `shape`'s family (its biases, head
/// norms or experts) with `heads` query heads of 32.
fn small(
    dir: &std::path::Path,
    shape: ModelShape,
    heads: (usize, usize),
    quant: WeightQuant,
) -> Checkpoint {
    let base = shape.config(2);
    let config = LlamaConfig {
        hidden_size: 128,
        intermediate_size: 256,
        num_attention_heads: heads.0,
        num_key_value_heads: heads.1,
        head_dim: 32,
        vocab_size: 512,
        experts: base.experts.as_ref().map(|e| ExpertConfig {
            count: 4,
            intermediate_size: 256,
            ..e.clone()
        }),
        ..base
    };
    let path = dir.join(format!("{shape:?}-{quant:?}.gguf"));
    let spec = RandomGguf {
        config,
        // The smallest vocabulary whose tokenizer fits 512 ids.
        vocabulary: ModelShape::Llama2_70b,
        quant,
        seed: 7,
        name: format!("{shape:?}"),
    };
    write_random_gguf(&path, &spec, |_, _| {}).unwrap();
    Checkpoint::open(&path).unwrap()
}

/// `t` rows of hidden states, the same for every call with `seed`.
fn hidden(t: usize, width: usize, seed: usize) -> Tensor {
    let values: Vec<f32> = (0..t * width)
        .map(|i| (((i + seed * 7919) * 104_729) % 2003) as f32 / 1001.5 - 1.0)
        .collect();
    Tensor::from_vec(values, (1, t, width), &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// The steps a session takes (a prompt longer than the row kernel takes, a
/// short message, decode steps) and a batch of three sessions' decode
/// steps: the rows path gives every output the tensor path gives, bit for
/// bit, for each family's layer (QKV biases, head norms, experts) and for
/// dense weights.
#[test]
fn rows_and_tensors_give_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let models = [
        (ModelShape::Llama2_70b, (4, 2), WeightQuant::Q4_1),
        (ModelShape::Qwen25_72b, (4, 4), WeightQuant::Q8_0),
        (ModelShape::Qwen3_32b, (8, 2), WeightQuant::Q4K),
        (ModelShape::Mixtral8x7b, (4, 1), WeightQuant::Q4_1),
        // Dense: no 8-bit rounding of activations to hide a last-bit difference.
        (ModelShape::Llama2_70b, (4, 2), WeightQuant::F16),
    ];
    for (shape, heads, quant) in models {
        let ck = small(dir.path(), shape, heads, quant);
        let load = || BlockSpan::load(&ck, 0, 2, DType::F32, &Device::Cpu).unwrap();
        let rows = load();
        let mut tensors = load();
        assert!(rows.rows, "f32 on the CPU runs as rows");
        tensors.rows = false;
        let width = ck.config().hidden_size;
        let mut outputs = Vec::new();
        for span in [&rows, &tensors] {
            let mut out = Vec::new();
            let mut caches: Vec<_> = (0..3).map(|_| span.new_cache(128).unwrap()).collect();
            // Each session's own steps: 40 positions (matrix attention),
            // then 5 (the row kernel), then single positions.
            for (s, cache) in caches.iter_mut().enumerate() {
                let mut at = 0;
                for (i, t) in [40, 5, 1, 1].into_iter().enumerate() {
                    let x = hidden(t, width, s * 10 + i);
                    out.push(bits(&span.forward(&x, at, cache).unwrap()));
                    at += t;
                }
            }
            // The three as one batch of decode steps, twice.
            for round in 0..2 {
                let mut steps: Vec<_> = caches
                    .iter_mut()
                    .enumerate()
                    .map(|(s, cache)| (hidden(1, width, 100 + s + round), 47 + round, cache))
                    .collect();
                for y in span.forward_decode_batch(&mut steps).unwrap() {
                    out.push(bits(&y));
                }
            }
            outputs.push(out);
        }
        assert_eq!(outputs[0].len(), outputs[1].len());
        for (i, (a, b)) in outputs[0].iter().zip(&outputs[1]).enumerate() {
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            assert_eq!(differ, 0, "{shape:?}: output {i}: {differ} values differ");
        }
    }
}
