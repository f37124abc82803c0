//! `corolla-bench --compute`: decode speed on the default model's GGUF,
//! Corolla against llama.cpp (node-llama-cpp's prebuilt CPU build) on the
//! same file, the same threads and the same prompt, alternating rounds.

use std::ops::ControlFlow;
use std::path::Path;
use std::process::Command;

use corolla_client::network::connect;
use corolla_client::{
    generate, ChatMessage, ChatTemplate, GenerateOutput, GenerateRequest, LocalChain, RemoteChain,
    SessionSettings, TextTokenizer,
};
use corolla_model::fingerprint::block_hashes;
use corolla_model::{
    BlockSpan, Checkpoint, ClientHead, DType, Device, QuantizedWeights, SamplingParams,
};
use corolla_shared::WireDType;

use crate::hop_timeline::{self, HopStages};
use crate::{median, spread};

pub const COMPUTE_HEADING: &str = "## Compute: Corolla against llama.cpp on the same GGUF";

/// The folder where `scripts/bench.sh` installs node-llama-cpp and its script.
pub const LLAMACPP_DIR_ENV: &str = "COROLLA_LLAMACPP_DIR";

const THREADS: usize = 2;

#[derive(Debug, serde::Deserialize)]
struct LlamaCppRun {
    prefill_ms: f64,
    decode_tokens_per_s: f64,
    tokens: Vec<u32>,
    /// The ggml CPU build it loaded ("zen4", "haswell", ...).
    cpu_variant: Option<String>,
}

fn llama_cpp(
    dir: &Path,
    model: &Path,
    threads: usize,
    request: &GenerateRequest,
) -> anyhow::Result<LlamaCppRun> {
    let prompt: Vec<String> = request.prompt_ids.iter().map(u32::to_string).collect();
    let out = Command::new("node")
        .arg(dir.join("decode.mjs"))
        .arg(model)
        .arg(threads.to_string())
        .arg(request.max_new_tokens.to_string())
        .arg(prompt.join(","))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "llama.cpp run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("llama.cpp printed no figures: {stdout}"))?;
    Ok(serde_json::from_str(line)?)
}

/// Tokens per second after the first new token (the prompt's prefill
/// apart), and the prefill's milliseconds.
fn rates_of(out: &GenerateOutput) -> (f64, f64) {
    let secs = (out.total_time - out.prefill_time).as_secs_f64();
    let rate = out.generated_ids.len().saturating_sub(1) as f64 / secs.max(1e-9);
    (rate, out.prefill_time.as_secs_f64() * 1e3)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

struct Local {
    head: ClientHead,
    spans: Vec<BlockSpan>,
}

impl Local {
    fn load(model: &Path, weights: QuantizedWeights) -> anyhow::Result<(Self, Checkpoint)> {
        let ck = Checkpoint::open(model)?.with_quantized_weights(weights);
        let layers = ck.config().num_hidden_layers;
        let local = Local {
            head: ClientHead::load(&ck, DType::F32, &Device::Cpu)?,
            spans: vec![BlockSpan::load(&ck, 0, layers, DType::F32, &Device::Cpu)?],
        };
        Ok((local, ck))
    }

    async fn run(&self, request: &GenerateRequest) -> anyhow::Result<GenerateOutput> {
        let mut chain = LocalChain::new(&self.spans, request.max_length())?;
        Ok(generate(&self.head, &mut chain, request, |_| {
            ControlFlow::Continue(())
        })
        .await?)
    }
}

/// The compute section: local kept-quantized (Corolla's kernels and
/// candle's), local dequantized, a 3-server kept-quantized swarm on
/// loopback, and llama.cpp, decode tokens/s, medians of `rounds` rounds
/// after a warm-up, each round running them in a rotated order.
pub async fn bench_compute(
    model: &Path,
    llama_cpp_dir: Option<&Path>,
    rounds: usize,
    new_tokens: usize,
) -> anyhow::Result<String> {
    let (kept, ck) = Local::load(model, QuantizedWeights::Keep)?;
    std::env::set_var(corolla_model::KERNELS_ENV, "candle");
    let candle = Local::load(model, QuantizedWeights::Keep);
    std::env::remove_var(corolla_model::KERNELS_ENV);
    let (candle, _) = candle?;
    let (dequantized, _) = Local::load(model, QuantizedWeights::Dequantize)?;

    let tokenizer = TextTokenizer::for_checkpoint(&ck)?;
    let template = ChatTemplate::new(ck.chat_template()?.as_deref(), &tokenizer, None, None)?;
    let prompt = template.render(
        &[ChatMessage::user(
            "Explain in a few paragraphs how a lighthouse keeper's day went in 1900.",
        )],
        true,
    )?;
    let request = GenerateRequest {
        prompt_ids: tokenizer.encode_chat(&prompt)?,
        max_new_tokens: new_tokens,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: 0,
    };

    let layers = ck.config().num_hidden_layers;
    let model_arg = model.to_string_lossy().into_owned();
    let keep = ["--quantized", "keep", "--update-period", "30s"];
    let first = crate::start_model_server(model, &format!("0:{}", layers / 3), None, &keep).await;
    let bootstrap = first.tcp_addr().expect("tcp").to_string();
    let mut servers = vec![first];
    for (a, b) in [(layers / 3, 2 * layers / 3), (2 * layers / 3, layers)] {
        servers.push(
            crate::start_model_server(model, &format!("{a}:{b}"), Some(&bootstrap), &keep).await,
        );
    }
    let node = connect(&[bootstrap.parse()?]).await?;
    let mut settings = SessionSettings::new(
        servers[0].model(),
        layers,
        request.max_length(),
        WireDType::F32,
    );
    settings.expected_blocks = Some(block_hashes(&ck, 0, layers)?);

    const RUNS: [&str; 6] = [
        "llama.cpp",
        "Corolla local, kept quantized",
        "Corolla local, kept quantized, candle's kernels",
        "Corolla local, dequantized to f32",
        "Corolla swarm, 3 servers on loopback, kept quantized",
        "llama.cpp, 1 thread",
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); RUNS.len()];
    let mut prefills: Vec<Vec<f64>> = vec![Vec::new(); RUNS.len()];
    let (mut corolla_tokens, mut llama_tokens, mut dequantized_tokens, mut swarm_tokens) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut llama_variant = None;
    let mut hops: Vec<HopStages> = Vec::new();
    for round in 0..=rounds {
        for k in 0..RUNS.len() {
            let which = (round + k) % RUNS.len();
            let (rate, prefill_ms) = match which {
                0 | 5 => match llama_cpp_dir {
                    Some(dir) => {
                        let threads = if which == 0 { THREADS } else { 1 };
                        let run = llama_cpp(dir, model, threads, &request)?;
                        llama_tokens = run.tokens;
                        llama_variant = run.cpu_variant;
                        (run.decode_tokens_per_s, run.prefill_ms)
                    }
                    None => (f64::NAN, f64::NAN),
                },
                1 => {
                    let out = kept.run(&request).await?;
                    corolla_tokens = out.generated_ids.clone();
                    rates_of(&out)
                }
                2 => rates_of(&candle.run(&request).await?),
                3 => {
                    let out = dequantized.run(&request).await?;
                    dequantized_tokens = out.generated_ids.clone();
                    rates_of(&out)
                }
                4 => {
                    let mut chain =
                        RemoteChain::connect(&node, settings.clone(), &Device::Cpu).await?;
                    hop_timeline::recorder().start();
                    let out = generate(&kept.head, &mut chain, &request, |_| {
                        ControlFlow::Continue(())
                    })
                    .await;
                    let stages = hop_timeline::recorder().stop();
                    let out = out?;
                    chain.close().await;
                    if round > 0 {
                        hops.push(stages);
                    }
                    swarm_tokens = out.generated_ids.clone();
                    rates_of(&out)
                }
                _ => unreachable!("{which} indexes RUNS"),
            };
            eprintln!(
                "compute round {round}: {}: {rate:.1} tokens/s, prefill {prefill_ms:.1} ms",
                RUNS[which]
            );
            if round > 0 {
                rates[which].push(rate);
                prefills[which].push(prefill_ms);
            }
        }
    }
    drop(servers);
    // Each round's swarm against the same round's local run: the spread
    // shows how much of the ratio is this machine's noise.
    let round_ratios: Vec<f64> = rates[4].iter().zip(&rates[1]).map(|(s, l)| s / l).collect();
    let (lowest, highest) = spread(&round_ratios);
    let medians: Vec<f64> = rates.into_iter().map(median).collect();
    let prefill_medians: Vec<f64> = prefills.into_iter().map(median).collect();
    let llama = medians[0];
    let llama_best = medians[0].max(medians[5]);
    let mut table = String::from(
        "| run | decode tokens/s | vs llama.cpp | prompt's prefill (ms) |\n|---|---|---|---|\n",
    );
    for ((name, rate), prefill) in RUNS.iter().zip(&medians).zip(&prefill_medians) {
        table.push_str(&format!(
            "| {name} | {rate:.1} | {:.2}× | {prefill:.1} |\n",
            rate / llama
        ));
    }
    let agree_llama = common_prefix(&corolla_tokens, &llama_tokens);
    let agree_float = common_prefix(&corolla_tokens, &dequantized_tokens);
    let agree_swarm = common_prefix(&corolla_tokens, &swarm_tokens);
    let timeline = hop_section(&HopStages::merged(&hops), medians[1], medians[4]);
    Ok(format!(
        "{COMPUTE_HEADING}\n\n\
         Command: `corolla-bench --compute --rounds {rounds} --new-tokens {new_tokens} --write BENCHMARKS.md` \
         (also part of `bash scripts/bench.sh`).\n\n\
         {}, CPU, {THREADS} threads everywhere but the row that says 1 (`RAYON_NUM_THREADS`; llama.cpp's `threads`). A chat prompt of {} \
         tokens, {new_tokens} greedy tokens; decode tokens/s after the first new token (the prefill apart), and the time to the first new token (the prompt's prefill); \
         medians of {rounds} rounds after a warm-up, the six runs in a rotated order each round. \
         llama.cpp is node-llama-cpp 3.21.1's prebuilt CPU build{}.{}\n\n{table}\n\
         - Corolla local kept quantized / llama.cpp: **{:.2}×** (target >= 1.0); against llama.cpp's faster \
         thread count: {:.2}×\n\
         - swarm / local, kept quantized: **{:.2}×** (target >= 0.9); the rounds' own ratios: {lowest:.2} to {highest:.2}\n\
         - greedy tokens: Corolla kept quantized and llama.cpp agree on the first {agree_llama} of {new_tokens}; \
         kept quantized and dequantized agree on the first {agree_float}; the kept-quantized swarm and the local \
         run on the first {agree_swarm}\n{timeline}",
        model.file_name().map_or(model_arg.clone(), |n| n.to_string_lossy().into_owned()),
        request.prompt_ids.len(),
        llama_variant.map_or(String::new(), |v| format!(
            " (ggml's `{v}` CPU variant, the one it picked for this machine)"
        )),
        if llama_cpp_dir.is_some() {
            ""
        } else {
            " llama.cpp: skipped (node-llama-cpp is not installed; `scripts/bench.sh` installs it)."
        },
        medians[1] / llama,
        medians[1] / llama_best,
        medians[4] / medians[1],
    ))
}

/// Where the swarm's token goes, against the local run's: the stages'
/// means over the swarm rounds, and what 0.9x would leave for them.
fn hop_section(stages: &HopStages, local_rate: f64, swarm_rate: f64) -> String {
    if stages.tokens == 0 {
        return "\nWhere a swarm token's time goes: no pushed decode step was recorded whole.\n"
            .into();
    }
    let local_us = 1e6 / local_rate;
    let swarm_us = 1e6 / swarm_rate;
    let between = stages.between_us();
    let own = stages.total_us() - between;
    format!(
        "\nWhere a swarm token's time goes ({} decode tokens of the swarm rounds through {} servers, mean µs per token; \
         the client and the servers emit `corolla::hop` trace events at each stage, which the benchmark timestamps):\n\n{}\n\
         - the forwards and the client's own time: {own:.0} µs a token, the local run's whole token: {local_us:.0} µs\n\
         - the network and the hand-offs between them: **{between:.0} µs** a token ({:.0}% of the swarm's {swarm_us:.0} µs); \
         for 0.9× they would have to fit in {:.0} µs\n",
        stages.tokens,
        stages.servers,
        stages.table(),
        100.0 * between / swarm_us,
        (local_us / 0.9 - own).max(0.0),
    )
}
