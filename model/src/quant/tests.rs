use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use std::sync::Arc;

use super::QuantMatrix;

/// The product by the scalar reference dot products (llama.cpp's generic
/// code as candle carries it), on the same 8-bit activations.
fn reference(m: &QuantMatrix, x: &Tensor) -> Tensor {
    let batch = x.dim(0).unwrap();
    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let super::Layout::Blocks(blocks) = &m.weights else {
        panic!("the reference reads the blocks as stored");
    };
    let out = blocks.reference(m.shape(batch), &xs);
    Tensor::from_vec(out, (batch, m.rows), &Device::Cpu).unwrap()
}

fn quantize(weight: &Tensor, format: GgmlDType) -> Arc<QTensor> {
    Arc::new(QTensor::quantize(weight, format).unwrap())
}

fn matrix(q: &Arc<QTensor>) -> QuantMatrix {
    QuantMatrix::new(q.clone()).unwrap().unwrap()
}

const FORMATS: [GgmlDType; 6] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

fn random(shape: (usize, usize), seed: u64) -> Tensor {
    // A fixed generator, so a failure repeats.
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let values: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Every format, one row and a batch, small and parallel shapes: the
/// product matches the scalar reference on the same 8-bit activations (the
/// same integer math, summed in another order), candle's quantized product
/// (which may round activations its own way) and the dequantized float
/// product up to the activations' 8-bit rounding.
#[test]
fn products_match_candle_and_the_float_product() {
    for format in FORMATS {
        for (rows, cols) in [(43, 256), (1536, 512), (266, 768)] {
            let weight = random((rows, cols), rows as u64 * 31 + cols as u64);
            let q = quantize(&weight, format);
            let ours = matrix(&q);
            let dense = q.dequantize(&Device::Cpu).unwrap();
            let candle = QMatMul::from_arc(q).unwrap();
            let interleaved = ours.clone().interleaved().unwrap();
            for batch in [1, 3, 6, 16] {
                let x = random((batch, cols), batch as u64 + 7);
                let want = candle.forward(&x).unwrap();
                let exact = reference(&ours, &x);
                let float = x.matmul(&dense.t().unwrap()).unwrap();
                let scale = max_abs_diff(&float, &float.zeros_like().unwrap());
                for (layout, m) in [("as stored", &ours), ("interleaved", &interleaved)] {
                    let got = m.forward(&x).unwrap();
                    let vs_reference = max_abs_diff(&got, &exact) / scale;
                    let vs_candle = max_abs_diff(&got, &want) / scale;
                    let vs_float = max_abs_diff(&got, &float) / scale;
                    let case = format!("{format:?} {layout} {rows}x{cols} batch {batch}");
                    assert!(
                        vs_reference < 1e-5,
                        "{case}: {vs_reference} from the reference"
                    );
                    assert!(vs_candle < 0.02, "{case}: {vs_candle} from candle's");
                    assert!(vs_float < 0.03, "{case}: {vs_float} from the float product");
                }
            }
        }
    }
}

#[test]
fn stacked_matrices_compute_their_parts() {
    let matrices: Vec<QuantMatrix> = [(64, 256), (32, 256), (32, 256)]
        .iter()
        .enumerate()
        .map(|(i, &shape)| matrix(&quantize(&random(shape, i as u64), GgmlDType::Q4_1)))
        .collect();
    let stacked = QuantMatrix::concat(&matrices.iter().collect::<Vec<_>>())
        .unwrap()
        .unwrap();
    assert_eq!(stacked.rows(), 128);
    let x = random((5, 256), 99);
    let whole = stacked.forward(&x).unwrap();
    let mut at = 0;
    for m in &matrices {
        let part = m.forward(&x).unwrap();
        assert_eq!(
            max_abs_diff(&whole.narrow(1, at, m.rows()).unwrap(), &part),
            0.0
        );
        at += m.rows();
    }
    let other = matrix(&quantize(&random((32, 256), 5), GgmlDType::Q8_0));
    assert!(QuantMatrix::concat(&[&matrices[0], &other])
        .unwrap()
        .is_none());
}

/// A wrong-width input is an error, not a panic.
#[test]
fn a_wrong_width_is_refused() {
    let m = matrix(&quantize(&random((32, 256), 1), GgmlDType::Q4_0));
    assert!(m.forward(&random((2, 128), 2)).is_err());
}

/// A session's output may not depend on who shares its step: each row of a
/// batch is bit for bit the product of that row alone, for every format,
/// batch size (the batched kernels take rows four at a time, the rest one
/// by one) and matrix size (small products stay on one thread).
#[test]
fn each_row_of_a_batch_is_the_row_alone_bit_for_bit() {
    for format in FORMATS {
        for (rows, cols) in [(43, 256), (1536, 512)] {
            let stored = matrix(&quantize(&random((rows, cols), 3), format));
            for (m, batch) in [2, 4, 5, 7, 16].into_iter().flat_map(|b| {
                [
                    (stored.clone(), b),
                    (stored.clone().interleaved().unwrap(), b),
                ]
            }) {
                let x = random((batch, cols), batch as u64 + 11);
                let together = m.forward(&x).unwrap();
                for r in 0..batch {
                    let alone = m.forward(&x.narrow(0, r, 1).unwrap()).unwrap();
                    let shared = together.narrow(0, r, 1).unwrap();
                    let (alone, shared) = (
                        alone.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        shared.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    );
                    let differ = alone
                        .iter()
                        .zip(&shared)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "{format:?} {rows}x{cols}: row {r} of a batch of {batch} differs from the row alone in {differ} outputs"
                    );
                }
            }
        }
    }
}
