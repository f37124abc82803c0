//! `corolla-gpu-check`: the checks run on a CUDA machine, in one command
//! (`scripts/gpu-check.sh` runs it there). Built with `--features cuda` by
//! `scripts/cuda.sh`; without CUDA it stops at once with a clear error.
//!
//! 1. The fixtures' golden greedy tokens through a real server on
//!    `--device cuda` in f32.
//! 2. f16 and bf16 logits against f32 on the GPU.
//! 3. Batched decode on the GPU: 1, 4 and 16 sessions of the bench model.
//! 4. A Llama-2-70B-shaped span (random weights, f16, then Q4_K kept quantized): the decode step time
//!    against the memory floor (bytes of the weights over the bandwidth).
//!
//! Prints a Markdown report (also written to `--out FILE`); exits non-zero
//! when a correctness check fails.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use corolla_client::network::connect;
use corolla_client::{GenerateRequest, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, Tensor};
use corolla_shared::WireDType;
use corolla_tests::{bench_spec, concurrent_generations, greedy, relative_l2, Golden};

/// The H200's memory bandwidth, for the floor of a memory-bound step.
const BANDWIDTH_BYTES_PER_S: f64 = 4.0e12;

struct Options {
    fixtures: PathBuf,
    out: Option<PathBuf>,
    layers_70b: usize,
}

fn options() -> Result<Options> {
    let mut o = Options {
        fixtures: PathBuf::from("tests/fixtures"),
        out: None,
        layers_70b: 4,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--fixtures" => o.fixtures = value()?.into(),
            "--out" => o.out = Some(value()?.into()),
            "--layers-70b" => {
                o.layers_70b = value()?.parse().context("--layers-70b")?;
                if !(1..=80).contains(&o.layers_70b) {
                    bail!("--layers-70b must be 1 to 80");
                }
            }
            "-h" | "--help" => {
                println!("corolla-gpu-check [--fixtures DIR] [--out FILE] [--layers-70b N]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    Ok(o)
}

fn main() -> Result<()> {
    let o = options()?;
    let gpu = Device::new_cuda(0).context("no usable CUDA device")?;
    let runtime = tokio::runtime::Runtime::new()?;
    let mut report = String::from("# GPU check\n\n");
    let mut failed = Vec::new();

    let started = Instant::now();
    let (section, ok) = runtime.block_on(golden_tokens(&o))?;
    report.push_str(&section);
    if !ok {
        failed.push("golden tokens");
    }
    eprintln!("golden tokens: {:?}", started.elapsed());

    let (section, ok) = dtype_closeness(&o, &gpu)?;
    report.push_str(&section);
    if !ok {
        failed.push("f16/bf16 closeness");
    }
    report.push_str(&batched_decode(&gpu)?);
    eprintln!("batching: {:?}", started.elapsed());
    report.push_str(&span_70b(&gpu, o.layers_70b)?);
    eprintln!("70B-shaped span: {:?}", started.elapsed());
    report.push_str(&span_70b_kept_quantized(&gpu, o.layers_70b)?);
    eprintln!("70B-shaped span kept quantized: {:?}", started.elapsed());

    if failed.is_empty() {
        report.push_str("\nAll correctness checks passed.\n");
    } else {
        report.push_str(&format!("\nFAILED: {}\n", failed.join(", ")));
    }
    print!("{report}");
    if let Some(out) = &o.out {
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
    }
    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    Ok(())
}

/// The golden prompts through a server on the GPU (f32), client on the CPU.
async fn golden_tokens(o: &Options) -> Result<(String, bool)> {
    let model = o.fixtures.join("tiny-llama-a");
    let ck = Checkpoint::open(&model)?;
    let layers = ck.config().num_hidden_layers;
    let args: Vec<String> = [
        "corolla-server",
        "--model",
        &model.to_string_lossy(),
        "--device",
        "cuda",
        "--dtype",
        "f32",
        "--block-indices",
        &format!("0:{layers}"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--new-swarm",
    ]
    .map(String::from)
    .to_vec();
    let args = corolla_server::ServerArgs::from_args_and_file(args)?;
    let server = corolla_server::Server::start(args).await?;
    let node = connect(&[server.tcp_addr().context("tcp address")?.clone()]).await?;
    let mut settings = SessionSettings::new(server.model(), layers, 128, WireDType::F32);
    settings.expected_blocks = Some(block_hashes(&ck, 0, layers)?);
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu)?;
    let golden = Golden::load(&model, "float32");
    let requests: Vec<GenerateRequest> = golden
        .prompts
        .iter()
        .map(|p| greedy(p.input_ids.clone(), p.generated_new_ids.len()))
        .collect();
    let run = concurrent_generations(&node, &settings, &head, &requests).await?;
    let mut ok = true;
    let mut section = String::from(
        "## Golden tokens on `--device cuda` (f32)\n\n| prompt | tokens | identical |\n|---|---|---|\n",
    );
    for (p, out) in golden.prompts.iter().zip(&run.outputs) {
        let same = out.generated_ids == p.generated_new_ids;
        ok &= same;
        section.push_str(&format!(
            "| {:?} | {} | {} |\n",
            p.prompt,
            p.generated_new_ids.len(),
            if same { "yes" } else { "NO" }
        ));
    }
    section.push('\n');
    server.shutdown();
    Ok((section, ok))
}

/// Logits of the first golden prompt with the span in f16 and bf16 against
/// f32, all on the GPU; the head (f32, CPU) is the same for all three.
fn dtype_closeness(o: &Options, gpu: &Device) -> Result<(String, bool)> {
    let model = o.fixtures.join("tiny-llama-a");
    let ck = Checkpoint::open(&model)?;
    let layers = ck.config().num_hidden_layers;
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu)?;
    let golden = Golden::load(&model, "float32");
    let ids = &golden.prompts[0].input_ids;
    let logits = |dtype: DType| -> Result<Tensor> {
        let span = BlockSpan::load(&ck, 0, layers, dtype, gpu)?;
        let mut cache = span.new_cache(ids.len())?;
        let hidden = span.forward(&head.embed(ids)?, 0, &mut cache)?;
        let hidden = hidden.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        Ok(head.logits(&hidden)?)
    };
    let reference = logits(DType::F32)?;
    let mut ok = true;
    let mut section = String::from(
        "## f16 and bf16 against f32 on the GPU\n\n| dtype | relative L2 of the logits | bound |\n|---|---|---|\n",
    );
    for (dtype, bound) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let err = relative_l2(&logits(dtype)?, &reference);
        ok &= err < bound;
        section.push_str(&format!("| {dtype:?} | {err:.2e} | < {bound:.0e} |\n"));
    }
    section.push('\n');
    Ok((section, ok))
}

/// Mean time of `steps` calls of `step`, after two warm-up calls, with the
/// device synchronised around the timing.
fn time_steps(
    gpu: &Device,
    steps: usize,
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    step(0)?;
    step(1)?;
    gpu.synchronize()?;
    let started = Instant::now();
    for i in 0..steps {
        step(2 + i)?;
    }
    gpu.synchronize()?;
    Ok(started.elapsed().as_secs_f64() / steps as f64)
}

/// Decode steps of 1, 4 and 16 sessions of the bench model in one batched
/// forward each, f32 and f16.
fn batched_decode(gpu: &Device) -> Result<String> {
    let spec = bench_spec();
    let dir = tempfile::tempdir()?;
    write_random_checkpoint(dir.path(), &spec)?;
    let ck = Checkpoint::open(dir.path())?;
    let mut section = String::from(
        "## Batched decode on the GPU (bench model: hidden 512, 8 layers)\n\n\
         | dtype | sessions | ms per step | tokens/s in all | over 1 session |\n|---|---|---|---|---|\n",
    );
    for dtype in [DType::F32, DType::F16] {
        let span = BlockSpan::load(&ck, 0, spec.num_layers, dtype, gpu)?;
        let mut single = 0.0;
        for b in [1usize, 4, 16] {
            let mut caches = (0..b)
                .map(|_| span.new_cache(512))
                .collect::<corolla_model::Result<Vec<_>>>()?;
            let prompt = Tensor::randn(0f32, 1.0, (1, 64, spec.hidden_size), gpu)?;
            for c in caches.iter_mut() {
                span.forward(&prompt, 0, c)?;
            }
            let x = Tensor::randn(0f32, 1.0, (1, 1, spec.hidden_size), gpu)?;
            let per_step = time_steps(gpu, 50, |i| {
                if b == 1 {
                    span.forward(&x, 64 + i, &mut caches[0])?;
                } else {
                    let mut steps: Vec<_> =
                        caches.iter_mut().map(|c| (x.clone(), 64 + i, c)).collect();
                    span.forward_decode_batch(&mut steps)?;
                }
                Ok(())
            })?;
            let aggregate = b as f64 / per_step;
            if b == 1 {
                single = aggregate;
            }
            section.push_str(&format!(
                "| {dtype:?} | {b} | {:.3} | {aggregate:.0} | {:.2}x |\n",
                per_step * 1e3,
                aggregate / single
            ));
        }
    }
    section.push('\n');
    Ok(section)
}

/// A span shaped like Llama 2 70B's blocks (hidden 8192, 64 query and 8 KV
/// heads, FFN 28672), `layers` of them with random weights, in f16: one
/// session's decode step against the time to read the weights once.
fn span_70b(gpu: &Device, layers: usize) -> Result<String> {
    let spec = RandomSpec {
        hidden_size: 8192,
        num_layers: layers,
        num_heads: 64,
        num_kv_heads: 8,
        intermediate_size: 28672,
        vocab_size: 256,
        max_positions: 4096,
        seed: 70,
    };
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    write_random_checkpoint(dir.path(), &spec)?;
    let written = started.elapsed();
    let ck = Checkpoint::open(dir.path())?;
    let span = BlockSpan::load(&ck, 0, layers, DType::F16, gpu)?;
    let loaded = started.elapsed();
    let bytes = ck.config().block_parameters() as f64 * layers as f64 * 2.0;
    let floor = bytes / BANDWIDTH_BYTES_PER_S;
    let mut section = format!(
        "## A Llama-2-70B-shaped span on the GPU ({layers} blocks, random weights, f16)\n\n\
         Weights {:.2} GB; memory floor {:.3} ms per step at {:.0} TB/s (checkpoint written in {:.0?}, loaded by {:.0?}).\n\n\
         | sessions | context | ms per step | over the floor |\n|---|---|---|---|\n",
        bytes / 1e9,
        floor * 1e3,
        BANDWIDTH_BYTES_PER_S / 1e12,
        written,
        loaded.saturating_sub(written),
    );
    section.push_str(&decode_rows(gpu, &span, floor)?);
    Ok(section)
}

/// Table rows: one and 8 sessions' decode step on `span` after a 512-token
/// prompt, against `floor` (seconds to read the weights once).
fn decode_rows(gpu: &Device, span: &BlockSpan, floor: f64) -> Result<String> {
    let hidden = span.config().hidden_size;
    let mut rows = String::new();
    for b in [1usize, 8] {
        let mut caches = (0..b)
            .map(|_| span.new_cache(1024))
            .collect::<corolla_model::Result<Vec<_>>>()?;
        let prompt = Tensor::randn(0f32, 1.0, (1, 512, hidden), gpu)?;
        for c in caches.iter_mut() {
            span.forward(&prompt, 0, c)?;
        }
        let x = Tensor::randn(0f32, 1.0, (1, 1, hidden), gpu)?;
        let per_step = time_steps(gpu, 20, |i| {
            if b == 1 {
                span.forward(&x, 512 + i, &mut caches[0])?;
            } else {
                let mut steps: Vec<_> =
                    caches.iter_mut().map(|c| (x.clone(), 512 + i, c)).collect();
                span.forward_decode_batch(&mut steps)?;
            }
            Ok(())
        })?;
        rows.push_str(&format!(
            "| {b} | 512 | {:.3} | {:.2}x |\n",
            per_step * 1e3,
            per_step / floor
        ));
    }
    rows.push('\n');
    Ok(rows)
}

/// The same Llama-2-70B-shaped blocks as a Q4_K GGUF kept quantized (what
/// every 70B swarm serves: `--quantized auto` keeps GGUF weights quantized), one
/// and 8 sessions' decode steps against the time to read the Q4_K weights once.
fn span_70b_kept_quantized(gpu: &Device, layers: usize) -> Result<String> {
    use corolla_model::random_gguf::{write_random_gguf, ModelShape, RandomGguf, WeightQuant};
    use corolla_model::QuantizedWeights;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("llama-2-70b-q4k.gguf");
    let started = Instant::now();
    let spec = RandomGguf::new(ModelShape::Llama2_70b, layers, WeightQuant::Q4K, 70);
    write_random_gguf(&path, &spec, |_, _| {})?;
    let written = started.elapsed();
    let ck = Checkpoint::open(&path)?.with_quantized_weights(QuantizedWeights::Keep);
    let span = BlockSpan::load(&ck, 0, layers, DType::F32, gpu)?;
    let loaded = started.elapsed();
    // Q4_K: 144 bytes per 256 weights.
    let bytes = ck.config().block_parameters() as f64 * layers as f64 * 144.0 / 256.0;
    let floor = bytes / BANDWIDTH_BYTES_PER_S;
    let mut section = format!(
        "## The same span as Q4_K kept quantized ({layers} blocks, candle's CUDA kernels)\n\n\
         Weights {:.2} GB; memory floor {:.3} ms per step (GGUF written in {:.0?}, loaded by {:.0?}).\n\n\
         | sessions | context | ms per step | over the floor |\n|---|---|---|---|\n",
        bytes / 1e9,
        floor * 1e3,
        written,
        loaded.saturating_sub(written),
    );
    section.push_str(&decode_rows(gpu, &span, floor)?);
    Ok(section)
}
