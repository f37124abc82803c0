use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::{BlockSpan, Checkpoint, DType, Device, Tensor};
use std::time::Instant;

#[test]
fn timing() {
    let spec = RandomSpec {
        hidden_size: 512,
        num_layers: 8,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 1376,
        vocab_size: 4096,
        max_positions: 1024,
        seed: 7,
    };
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &spec).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let span = BlockSpan::load(&ck, 0, 8, DType::F32, &Device::Cpu).unwrap();
    for b in [1usize, 4, 16] {
        let mut caches: Vec<_> = (0..b).map(|_| span.new_cache(256).unwrap()).collect();
        for c in caches.iter_mut() {
            let p = Tensor::randn(0f32, 1.0, (1, 64, 512), &Device::Cpu).unwrap();
            span.forward(&p, 0, c).unwrap();
        }
        let x = Tensor::randn(0f32, 1.0, (1, 1, 512), &Device::Cpu).unwrap();
        let n = 30;
        let t = Instant::now();
        for i in 0..n {
            if b == 1 {
                span.forward(&x, 64 + i, &mut caches[0]).unwrap();
            } else {
                let mut steps: Vec<_> = caches.iter_mut().map(|c| (x.clone(), 64 + i, c)).collect();
                span.forward_decode_batch(&mut steps).unwrap();
            }
        }
        let per = t.elapsed().as_secs_f64() / n as f64;
        println!(
            "B={b}: {:.2} ms per step, {:.0} tok/s",
            per * 1e3,
            b as f64 / per
        );
        // Projections alone: the same matmuls on [b, 512].
        let w1 = Tensor::randn(0f32, 1.0, (512, 512), &Device::Cpu).unwrap();
        let w2 = Tensor::randn(0f32, 1.0, (512, 1376), &Device::Cpu).unwrap();
        let w3 = Tensor::randn(0f32, 1.0, (1376, 512), &Device::Cpu).unwrap();
        let xb = Tensor::randn(0f32, 1.0, (b, 512), &Device::Cpu).unwrap();
        let xi = Tensor::randn(0f32, 1.0, (b, 1376), &Device::Cpu).unwrap();
        let t = Instant::now();
        for _ in 0..n {
            for _ in 0..8 {
                for _ in 0..3 {
                    xb.matmul(&w1).unwrap();
                }
                xb.matmul(&w2).unwrap();
                xb.matmul(&w2).unwrap();
                xi.matmul(&w3).unwrap();
            }
        }
        println!(
            "   matmuls alone: {:.2} ms",
            t.elapsed().as_secs_f64() / n as f64 * 1e3
        );
    }
}
