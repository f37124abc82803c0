//! `corolla-bench --experts`: decode steps of 1, 4 and 16 sessions through a
//! mixture-of-experts block (Qwen3-30B-A3B's shape, Q4_K kept quantized, as
//! its GGUFs are served) next to a dense block of the same attention whose
//! MLP has the width of the experts one token uses, so both compute the same
//! per row alone; what differs is what a batch's rows read.

use corolla_model::config::Family;
use corolla_model::random_gguf::{write_random_gguf, ModelShape, RandomGguf, WeightQuant};
use corolla_model::{Checkpoint, QuantizedWeights};

use crate::span_batching::{span_batching, SpanBatching, BATCHES};

pub const EXPERTS_HEADING: &str = "## Mixture of experts: sessions batched through one block";

fn kept_block(dir: &std::path::Path, name: &str, spec: &RandomGguf) -> anyhow::Result<Checkpoint> {
    let path = dir.join(format!("{name}.gguf"));
    write_random_gguf(&path, spec, |_, _| {})?;
    Ok(Checkpoint::open(&path)?.with_quantized_weights(QuantizedWeights::Keep))
}

/// The section: step times of one Qwen3-30B-A3B-shaped block and of its dense twin.
pub fn experts_section(rounds: usize) -> anyhow::Result<String> {
    let dir = tempfile::tempdir()?;
    let shape = ModelShape::Qwen3_30bA3b;
    let mut moe = RandomGguf::new(shape, 1, WeightQuant::Q4K, 30);
    // The block is what is measured: a small vocabulary keeps the file to it.
    moe.config.vocab_size = 512;
    moe.vocabulary = ModelShape::Llama2_70b;
    let experts = moe
        .config
        .experts
        .clone()
        .ok_or_else(|| anyhow::anyhow!("{} has no experts", shape.name()))?;
    let mut dense = moe.clone();
    dense.config.family = Family::Qwen3;
    dense.config.experts = None;
    dense.config.intermediate_size = experts.per_token * experts.intermediate_size;
    let measure = |name: &str, spec: &RandomGguf| -> anyhow::Result<SpanBatching> {
        let checkpoint = kept_block(dir.path(), name, spec)?;
        eprintln!("experts bench: {name} written, measuring");
        span_batching(&checkpoint, rounds)
    };
    let moe_figures = measure("moe", &moe)?;
    let dense_figures = measure("dense", &dense)?;
    // The same dense block with candle's own products, side by side.
    std::env::set_var(corolla_model::KERNELS_ENV, "candle");
    let candle_figures = measure("dense-candle", &dense);
    std::env::remove_var(corolla_model::KERNELS_ENV);
    let candle_figures = candle_figures?;
    let step_ms = |f: &SpanBatching, batch: usize| {
        f.step_ms
            .iter()
            .find(|(b, _)| *b == batch)
            .map_or(f64::NAN, |(_, ms)| *ms)
    };
    let mut rows = String::new();
    for batch in BATCHES {
        rows.push_str(&format!(
            "| {batch} | {:.2} | {:.2}× | {:.2} | {:.2}× | {:.2} |\n",
            step_ms(&moe_figures, batch),
            moe_figures.speedup(batch),
            step_ms(&dense_figures, batch),
            dense_figures.speedup(batch),
            step_ms(&candle_figures, batch),
        ));
    }
    let mb = |bytes: u64| bytes as f64 / 1e6;
    Ok(format!(
        "{EXPERTS_HEADING}\n\n\
         `corolla-bench --experts --rounds {rounds}`: one block of Qwen3-30B-A3B's shape (hidden 2048, \
         32/4 heads of 128, {} experts of FFN {}, {} per token, renormalised; Q4_K kept quantized, \
         {:.0} MB) and a dense block of the same attention with one MLP of FFN {} (the width of the \
         experts a row uses; {:.0} MB). Decode steps of B sessions, each with 64 cached positions \
         (`BlockSpan::forward_decode_batch`, as the server's compute core runs them), medians of \
         {rounds} rounds. ×: rows per second over one session's.\n\n\
         | B | MoE ms / step | MoE × | dense ms / step | dense × | dense, candle's products: ms / step |\n\
         |---|---|---|---|---|---|\n{rows}\n\
         One session's step costs {:.2}× the dense twin's (the router, the rows gathered per \
         expert, {} products of width {} in place of one of {}); its {} experts are {:.1} MB of the \
         {:.0} MB. At 16 sessions the expert block reaches {:.2}× one session and the dense twin \
         {:.2}×: a batch reads each chosen expert once for every row that chose it \
         (`model/src/experts.rs`), and {} The last column is the dense block with candle's own \
         quantized products (`COROLLA_KERNELS=candle`, same run): {:.2}× Corolla's step time at one \
         session, {:.2}× at 16.\n",
        experts.count,
        experts.intermediate_size,
        experts.per_token,
        mb(moe_figures.weight_bytes),
        dense.config.intermediate_size,
        mb(dense_figures.weight_bytes),
        step_ms(&moe_figures, 1) / step_ms(&dense_figures, 1),
        experts.per_token,
        experts.intermediate_size,
        dense.config.intermediate_size,
        experts.per_token,
        mb(moe_figures.weight_bytes) * experts.per_token as f64 / experts.count as f64,
        mb(moe_figures.weight_bytes),
        moe_figures.speedup(16),
        dense_figures.speedup(16),
        q4_k_kernels(),
        step_ms(&candle_figures, 1) / step_ms(&dense_figures, 1),
        step_ms(&candle_figures, 16) / step_ms(&dense_figures, 16),
    ))
}

/// How this CPU multiplies a batch's rows by Q4_K weights.
fn q4_k_kernels() -> &'static str {
    match corolla_model::repacked_for_batches(corolla_model::quantized::GgmlDType::Q4K) {
        true => {
            "Q4_K is repacked sixteen rows to a unit (`model/src/quant/q4_k/interleaved.rs`, \
                 AVX-512 VNNI): one instruction meets sixteen weight rows, and a super-block's \
                 nibbles serve four sessions."
        }
        false => {
            "Q4_K goes through candle's one-row kernel with each super-block unpacked once \
                  for four rows (`model/src/quant/q4_k.rs`; the repacked layout needs AVX-512 \
                  VNNI, which this CPU lacks)."
        }
    }
}
