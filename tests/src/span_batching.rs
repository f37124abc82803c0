//! What limits batching on this machine, measured without network or
//! clients: decode steps of B sessions through a whole span
//! (`BlockSpan::forward_decode_batch`, as the server's compute core runs
//! them), the client's LM head for one token, the memory's read bandwidth
//! (a stream test) and the rate the span's products reach when their
//! weights sit in the caches (the compute rate alone).

use std::path::Path;
use std::time::{Duration, Instant};

use crate::median;
use corolla_model::config::LlamaConfig;
use corolla_model::random_gguf::{write_random_gguf, ModelShape, RandomGguf, WeightQuant};
use corolla_model::{
    BlockSpan, Checkpoint, ClientHead, DType, Device, QuantizedWeights, SessionCache, Tensor,
};

/// Sessions per decode step, as in the full-stack table.
pub const BATCHES: [usize; 3] = [1, 4, 16];

/// Cached positions of every session when its steps are timed.
const HISTORY: usize = 64;

/// Decode steps of B sessions through one span.
#[derive(Debug, Clone)]
pub struct SpanBatching {
    /// `(B, milliseconds per step)`, median of the rounds.
    pub step_ms: Vec<(usize, f64)>,
    /// Bytes of the span's weights as stored (what one step reads).
    pub weight_bytes: u64,
    /// Multiply-adds of the span's matrices for one row.
    pub macs_per_row: u64,
}

impl SpanBatching {
    /// Rows per second at B over rows per second at 1.
    pub fn speedup(&self, batch: usize) -> f64 {
        let ms = |b: usize| {
            self.step_ms
                .iter()
                .find(|(n, _)| *n == b)
                .map_or(f64::NAN, |(_, ms)| *ms)
        };
        batch as f64 * ms(1) / ms(batch)
    }
}

fn hidden_row(width: usize, seed: usize) -> candle_core::Result<Tensor> {
    let values: Vec<f32> = (0..width)
        .map(|i| ((i * 31 + seed * 17) % 97) as f32 / 48.5 - 1.0)
        .collect();
    Tensor::from_vec(values, (1, 1, width), &Device::Cpu)
}

/// The bytes of the decoder blocks' tensors as stored in `checkpoint`.
fn block_bytes(checkpoint: &Checkpoint) -> anyhow::Result<u64> {
    let mut bytes = 0;
    for name in checkpoint.tensor_names() {
        if name.starts_with("model.layers.") {
            bytes += checkpoint.raw_tensor(name)?.data().len() as u64;
        }
    }
    Ok(bytes)
}

/// Multiply-adds of one row through every block's matrices.
fn block_macs(config: &LlamaConfig) -> u64 {
    let (h, i) = (config.hidden_size as u64, config.intermediate_size as u64);
    let hd = config.head_dim as u64;
    let (q, kv) = (
        config.num_attention_heads as u64 * hd,
        config.num_key_value_heads as u64 * hd,
    );
    let per_layer = h * (q + 2 * kv) + q * h + 3 * h * i;
    per_layer * config.num_hidden_layers as u64
}

/// Times decode steps of 1, 4 and 16 sessions (each with [`HISTORY`]
/// cached positions) through all of `checkpoint`'s blocks.
pub fn span_batching(checkpoint: &Checkpoint, rounds: usize) -> anyhow::Result<SpanBatching> {
    let config = checkpoint.config().clone();
    let layers = config.num_hidden_layers;
    let span = BlockSpan::load(checkpoint, 0, layers, DType::F32, &Device::Cpu)?;
    let width = config.hidden_size;
    let mut caches: Vec<SessionCache> = (0..BATCHES[BATCHES.len() - 1])
        .map(|i| -> anyhow::Result<SessionCache> {
            let mut cache = span.new_cache(HISTORY + 1)?;
            let values: Vec<f32> = (0..HISTORY * width)
                .map(|j| ((j * 13 + i * 7) % 89) as f32 / 44.5 - 1.0)
                .collect();
            let prompt = Tensor::from_vec(values, (1, HISTORY, width), &Device::Cpu)?;
            span.forward(&prompt, 0, &mut cache)?;
            Ok(cache)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut step_ms = Vec::new();
    for batch in BATCHES {
        // Enough steps for ~0.3 s a round at this machine's speed.
        let mut times = Vec::new();
        for round in 0..rounds + 1 {
            let mut steps = 0;
            let started = Instant::now();
            while steps < 3 || started.elapsed() < Duration::from_millis(300) {
                let mut batch_steps: Vec<(Tensor, usize, &mut SessionCache)> = caches
                    .iter_mut()
                    .take(batch)
                    .enumerate()
                    .map(|(i, cache)| Ok((hidden_row(width, i + steps)?, HISTORY, cache)))
                    .collect::<candle_core::Result<_>>()?;
                span.forward_decode_batch(&mut batch_steps)?;
                for (_, _, cache) in batch_steps {
                    cache.truncate(HISTORY);
                }
                steps += 1;
            }
            if round > 0 {
                times.push(started.elapsed().as_secs_f64() * 1e3 / steps as f64);
            }
        }
        step_ms.push((batch, median(times)));
    }
    Ok(SpanBatching {
        step_ms,
        weight_bytes: block_bytes(checkpoint)?,
        macs_per_row: block_macs(&config),
    })
}

/// Milliseconds of the client's head (final norm and LM head) for one token.
pub fn head_ms(checkpoint: &Checkpoint, rounds: usize) -> anyhow::Result<f64> {
    let head = ClientHead::load(checkpoint, DType::F32, &Device::Cpu)?;
    let row = hidden_row(checkpoint.config().hidden_size, 1)?;
    let mut times = Vec::new();
    for round in 0..rounds + 1 {
        let started = Instant::now();
        let mut n = 0;
        while n < 3 || started.elapsed() < Duration::from_millis(200) {
            head.logits(&head.final_norm(&row)?)?;
            n += 1;
        }
        if round > 0 {
            times.push(started.elapsed().as_secs_f64() * 1e3 / n as f64);
        }
    }
    Ok(median(times))
}

/// Read bandwidth of this machine's memory in GB/s: the threads of the
/// pool each sum their part of a 512 MiB buffer, median of `rounds`.
pub fn memory_read_gb_per_s(rounds: usize) -> f64 {
    use rayon::prelude::*;
    let words = (512usize << 20) / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let mut rates = Vec::new();
    for round in 0..rounds + 1 {
        let started = Instant::now();
        let sum: u64 = buffer
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        let seconds = started.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        if round > 0 {
            rates.push((words * 8) as f64 / seconds / 1e9);
        }
    }
    median(rates)
}

/// Multiply-adds per second of `quant`'s products at 16 rows when their
/// weights fit in the caches (two layers of hidden 512, ~4 MB in Q4_1,
/// within this machine's 32 MiB L3), so the rate is the kernels', not the
/// memory's.
pub fn compute_rate_macs_per_s(
    dir: &Path,
    quant: WeightQuant,
    rounds: usize,
) -> anyhow::Result<f64> {
    let checkpoint = small_kept_quantized(dir, "cache-resident", 512, 1536, quant, 3)?;
    let measured = span_batching(&checkpoint, rounds)?;
    let ms = measured
        .step_ms
        .iter()
        .find(|(b, _)| *b == 16)
        .map_or(f64::NAN, |(_, ms)| *ms);
    Ok(16.0 * measured.macs_per_row as f64 / (ms / 1e3))
}

/// A two-layer checkpoint of the 70B's Llama shape scaled down to
/// `hidden` (heads of 64, two query heads per KV head) with random `quant`
/// weights, written into `dir` and opened to compute kept quantized.
pub fn small_kept_quantized(
    dir: &Path,
    name: &str,
    hidden: usize,
    intermediate: usize,
    quant: WeightQuant,
    seed: u64,
) -> anyhow::Result<Checkpoint> {
    let heads = hidden / 64;
    kept_quantized_with_heads(
        dir,
        name,
        hidden,
        intermediate,
        (heads, heads / 2),
        quant,
        seed,
    )
}

/// [`small_kept_quantized`] with `(query heads, key/value heads)` of
/// `hidden / query heads` each (one head: as wide as the model, as in the
/// wire-shaped model).
pub fn kept_quantized_with_heads(
    dir: &Path,
    name: &str,
    hidden: usize,
    intermediate: usize,
    (heads, kv_heads): (usize, usize),
    quant: WeightQuant,
    seed: u64,
) -> anyhow::Result<Checkpoint> {
    let path = dir.join(format!("{name}.gguf"));
    let shape = ModelShape::Llama2_70b;
    let spec = RandomGguf {
        config: LlamaConfig {
            hidden_size: hidden,
            intermediate_size: intermediate,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: hidden / heads,
            vocab_size: 512,
            ..shape.config(2)
        },
        vocabulary: shape,
        quant,
        seed,
        name: name.into(),
    };
    write_random_gguf(&path, &spec, |_, _| {})?;
    Ok(Checkpoint::open(&path)?.with_quantized_weights(QuantizedWeights::Keep))
}
