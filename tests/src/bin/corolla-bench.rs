//! `corolla-bench`: tokens per second of generation through a swarm of
//! servers on loopback, divided by the same generation in one process, in
//! the same run. Writes its figures to BENCHMARKS.md.
//!
//! Usage: `corolla-bench [--rounds N] [--new-tokens N] [--only-chat | --only-batching | --only-swarm] [--write FILE]`,
//! or `corolla-bench --reliability DIR [--write FILE]` (RELIABILITY.md from its template and the
//! figures and logs of `scripts/reliability.sh`),
//! or `corolla-bench --page-figures DIR [--write FILE]` (the page tests' figures as a section),
//! or `corolla-bench --wan [--rounds N] [--new-tokens N] [--write FILE]` (as root: the CLI
//! through servers in network namespaces over delayed links, `corolla_tests::wan_bench`),
//! or `corolla-bench --compute [--rounds N] [--new-tokens N] [--write FILE]` (the default model's
//! decode speed, kept quantized and dequantized, against llama.cpp on the same GGUF),
//! or `corolla-bench --quantization-quality [--prompts N] [--new-tokens N] [--write FILE]` (the
//! default GGUF kept quantized against dequantized),
//! or `corolla-bench --wire-quality [--prompts N] [--new-tokens N] [--write FILE]` (what f16
//! and 8-bit activations on the wire do to the default model's answers),
//! or `corolla-bench --experts [--rounds N] [--write FILE]` (sessions batched through a
//! mixture-of-experts block),
//! or `corolla-bench --prefixes [--rounds N] [--write FILE]` (a second client's prefill after
//! the same system prompt, with and without shared prefixes).

use std::time::Duration;

use corolla_client::network::connect;
use corolla_client::{generate, GenerateRequest, LocalChain, RemoteChain, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::random::write_random_checkpoint;
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::WireDType;
use corolla_tests::batching_bench::{bench_batching, BATCHING_HEADING};
use corolla_tests::chat_bench::{bench_chat_turns, CHAT_HEADING};
use corolla_tests::demo_swarm::{bootstrap as bootstrap_of, demo_swarm, even_swarm};
use corolla_tests::report::{write_report, write_section, Run};
use corolla_tests::start_model_server;
use corolla_tests::{median, spread};

const NOTES: &str = "Notes: this machine has 2 noisy cores, and the servers, the client and the
local baseline all share them in one process. The swarm/local ratio of the
bench model has ranged from 0.76 to 0.96 between runs of one commit (each
section gives its own rounds' spread); each hop costs a few hundred
microseconds (framing, noise, yamux, a signed push and its check, a thread
hand-off to the compute core and back).";

/// What to measure: everything (no section flag, the whole report), or one
/// section written into an existing report.
#[derive(clap::Parser)]
#[command(
    name = "corolla-bench",
    about = "Corolla's benchmarks, side by side in one run"
)]
struct BenchArgs {
    /// Rounds after a warm-up [default: 5; 3 for --wan and --only-chat].
    #[arg(long)]
    rounds: Option<usize>,
    /// New tokens of each generation [default: 128; 8 for the quality sections].
    #[arg(long)]
    new_tokens: Option<usize>,
    /// Prompts of the quality sections.
    #[arg(long, default_value_t = 100)]
    prompts: usize,
    /// Writes the figures into this report (a section replaces its own).
    #[arg(long, value_name = "FILE")]
    write: Option<std::path::PathBuf>,
    /// RELIABILITY.md from its template, the figures the tests wrote to DIR
    /// and the test logs there (`scripts/reliability.sh`).
    #[arg(long, value_name = "DIR", group = "section")]
    reliability: Option<std::path::PathBuf>,
    /// The page tests' figures in DIR, as a section.
    #[arg(long, value_name = "DIR", group = "section")]
    page_figures: Option<std::path::PathBuf>,
    /// What f16 and 8-bit activations on the wire do to the default model's answers.
    #[arg(long, group = "section")]
    wire_quality: bool,
    /// The default model's decode speed, kept quantized and dequantized, against llama.cpp.
    #[arg(long, group = "section")]
    compute: bool,
    /// The default GGUF kept quantized against dequantized.
    #[arg(long, group = "section")]
    quantization_quality: bool,
    /// As root: the CLI through servers in network namespaces over delayed links.
    #[arg(long, group = "section")]
    wan: bool,
    /// Sessions batched through a mixture-of-experts block and its dense twin.
    #[arg(long, group = "section")]
    experts: bool,
    /// A second client's prefill after the same system prompt, shared and not.
    #[arg(long, group = "section")]
    prefixes: bool,
    /// Chat turns' time to first token.
    #[arg(long, group = "section")]
    only_chat: bool,
    /// One server, many sessions.
    #[arg(long, group = "section")]
    only_batching: bool,
    /// Swarm vs local on the bench model.
    #[arg(long, group = "section")]
    only_swarm: bool,
}

/// Prints a section and, with `--write`, writes it into the report.
fn emit(cli: &BenchArgs, run: &Run, heading: &str, section: &str) -> anyhow::Result<()> {
    println!("{section}");
    if let Some(file) = &cli.write {
        write_section(file, run, heading, section)?;
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    // Quiet unless RUST_LOG asks: the servers run in this process.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    // The hop events go to the compute section's timeline as well.
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(filter),
        )
        .with(corolla_tests::hop_timeline::layer())
        .try_init();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    let cli = <BenchArgs as clap::Parser>::parse();
    let run = Run::here();
    if let Some(dir) = &cli.reliability {
        return corolla_tests::reliability::regenerate(dir, cli.write.as_deref(), &run);
    }
    if let Some(dir) = &cli.page_figures {
        // Figures the Chromium tests measured, as a section of the report.
        use corolla_tests::page_figures::{page_section, PAGE_HEADING};
        let section = page_section(dir)?;
        return emit(&cli, &run, PAGE_HEADING, &section);
    }
    if cli.wire_quality {
        use corolla_tests::wire_quality::{wire_quality_section, WIRE_QUALITY_HEADING};
        let model = corolla_tests::default_model()
            .ok_or_else(|| anyhow::anyhow!("--wire-quality needs the default model"))?;
        let (prompts, new_tokens) = (cli.prompts, cli.new_tokens.unwrap_or(8));
        let section =
            tokio::task::spawn_blocking(move || wire_quality_section(&model, prompts, new_tokens))
                .await??;
        return emit(&cli, &run, WIRE_QUALITY_HEADING, &section);
    }
    if cli.compute {
        let section =
            bench_compute_section(cli.rounds.unwrap_or(5), cli.new_tokens.unwrap_or(128)).await?;
        use corolla_tests::compute_bench::COMPUTE_HEADING;
        return emit(&cli, &run, COMPUTE_HEADING, &section);
    }
    if cli.quantization_quality {
        use corolla_tests::wire_quality::{kept_quantized_section, KEPT_QUANTIZED_HEADING};
        let model = corolla_tests::default_model()
            .ok_or_else(|| anyhow::anyhow!("--quantization-quality needs the default model"))?;
        let (prompts, new_tokens) = (cli.prompts, cli.new_tokens.unwrap_or(8));
        let section = tokio::task::spawn_blocking(move || {
            kept_quantized_section(&model, prompts, new_tokens)
        })
        .await??;
        return emit(&cli, &run, KEPT_QUANTIZED_HEADING, &section);
    }
    if cli.experts {
        use corolla_tests::experts_bench::{experts_section, EXPERTS_HEADING};
        let rounds = cli.rounds.unwrap_or(3);
        let section = tokio::task::spawn_blocking(move || experts_section(rounds)).await??;
        return emit(&cli, &run, EXPERTS_HEADING, &section);
    }
    if cli.prefixes {
        use corolla_tests::prefix_bench::{prefix_section, PREFIX_HEADING};
        let model = corolla_tests::default_model()
            .ok_or_else(|| anyhow::anyhow!("--prefixes needs the default model"))?;
        let section = prefix_section(&model, cli.rounds.unwrap_or(3)).await?;
        return emit(&cli, &run, PREFIX_HEADING, &section);
    }
    if cli.wan {
        use corolla_tests::wan_bench::{bench_wan, WAN_HEADING};
        let (rounds, new_tokens) = (cli.rounds.unwrap_or(3), cli.new_tokens.unwrap_or(128));
        let section = tokio::task::spawn_blocking(move || bench_wan(rounds, new_tokens))
            .await??
            .ok_or_else(|| anyhow::anyhow!("--wan needs network namespaces (root, iproute2)"))?;
        return emit(&cli, &run, WAN_HEADING, &section);
    }
    if cli.only_chat {
        // One section alone, written into the existing report.
        let path = corolla_tests::default_model()
            .ok_or_else(|| anyhow::anyhow!("the chat benchmark needs the default model"))?;
        let section = bench_chat_turns(&path, cli.rounds.unwrap_or(3)).await?;
        return emit(&cli, &run, CHAT_HEADING, &section);
    }
    let rounds = cli.rounds.unwrap_or(5);
    let new_tokens = cli.new_tokens.unwrap_or(128);
    if cli.only_batching {
        let section = bench_batching(rounds, new_tokens).await?;
        return emit(&cli, &run, BATCHING_HEADING, &section);
    }
    let servers_n = 4;
    let spec = corolla_tests::bench_spec();
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("random-llama");
    write_random_checkpoint(&dir, &spec)?;
    let model = dir.to_string_lossy().into_owned();

    let ck = Checkpoint::open(&dir)?;
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu)?;
    let whole = [BlockSpan::load(
        &ck,
        0,
        spec.num_layers,
        DType::F32,
        &Device::Cpu,
    )?];
    let prompt: Vec<u32> = (0..16).map(|i| 1 + (i * 37) % 4000).collect();
    let request = GenerateRequest {
        prompt_ids: prompt,
        max_new_tokens: new_tokens,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: 0,
    };

    let per = spec.num_layers / servers_n;
    let mut servers = even_swarm(&dir, spec.num_layers, servers_n, &[]).await;
    let bootstrap = bootstrap_of(&servers)?.to_string();
    let node = connect(&[bootstrap.parse()?]).await?;
    let mut settings = SessionSettings::new(
        servers[0].model(),
        spec.num_layers,
        request.max_length(),
        WireDType::F32,
    );
    settings.expected_blocks = Some(block_hashes(&ck, 0, spec.num_layers)?);

    let (mut local_tps, mut swarm_tps, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds + 1 {
        // Alternate which runs first, so that neither always gets the warmer machine.
        let mut pair = [None, None];
        for which in [round % 2, 1 - round % 2] {
            let out = if which == 0 {
                let mut chain = LocalChain::new(&whole, request.max_length())?;
                generate(&head, &mut chain, &request, |_| {
                    std::ops::ControlFlow::Continue(())
                })
                .await?
            } else {
                let mut chain = RemoteChain::connect(&node, settings.clone(), &Device::Cpu).await?;
                assert_eq!(chain.route().len(), servers_n, "one hop per server");
                let out = generate(&head, &mut chain, &request, |_| {
                    std::ops::ControlFlow::Continue(())
                })
                .await?;
                chain.close().await;
                out
            };
            pair[which] = Some(out);
        }
        let [Some(local), Some(swarm)] = pair else {
            unreachable!("both runs happened")
        };
        assert_eq!(
            local.generated_ids, swarm.generated_ids,
            "swarm and local tokens differ"
        );
        if round == 0 {
            continue; // warm-up
        }
        local_tps.push(local.tokens_per_second());
        swarm_tps.push(swarm.tokens_per_second());
        ratios.push(swarm.tokens_per_second() / local.tokens_per_second());
        eprintln!(
            "round {round}: local {:.1} tok/s, swarm {:.1} tok/s",
            local.tokens_per_second(),
            swarm.tokens_per_second()
        );
    }
    let (local, swarm) = (median(local_tps), median(swarm_tps));
    let (lowest, highest) = spread(&ratios);
    let ratio = median(ratios);
    let per_hop_us = (1.0 / swarm - 1.0 / local) / servers_n as f64 * 1e6;
    let report = format!(
        "{SWARM_HEADING}\n\n\
         Command: `bash scripts/bench.sh` (runs `corolla-bench --rounds {rounds} --new-tokens {new_tokens}`; \
         this section alone: `corolla-bench --only-swarm --write BENCHMARKS.md`)\n\n\
         Random Llama: hidden {}, {} layers, {} heads, {} KV heads, FFN {}, vocab {}, f32, CPU. \
         Greedy generation of {new_tokens} tokens after a 16-token prompt; {servers_n} servers of {per} layers each \
         on loopback, in the benchmark's process; medians of {rounds} rounds after a warm-up.\n\n\
         | run | tokens/s |\n|---|---|\n| local (one process) | {local:.1} |\n| swarm ({servers_n} servers) | {swarm:.1} |\n\n\
         - ratio swarm / local (median of the rounds' ratios): **{ratio:.3}** (target >= 0.9); the rounds' ratios: {lowest:.3} to {highest:.3}\n\
         - added latency per hop: **{per_hop_us:.0} µs** per token\n",
        spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size
    );
    if cli.only_swarm {
        return emit(&cli, &run, SWARM_HEADING, &report);
    }
    let recovery = bench_recovery(
        &node,
        &head,
        &settings,
        &model,
        &bootstrap,
        per,
        &mut servers,
    )
    .await?;
    drop(servers);
    drop(node);
    let default_model = match corolla_tests::default_model() {
        Some(path) => bench_default_model(&path, rounds.min(3)).await?,
        None => String::from(
            "## Default model\n\nSkipped: the default model is not fetched (`corolla fetch-model`).\n",
        ),
    };
    let chat = match corolla_tests::default_model() {
        Some(path) => bench_chat_turns(&path, rounds.min(3)).await?,
        None => format!("{CHAT_HEADING}\n\nSkipped: the default model is not fetched.\n"),
    };
    let browser = match corolla_tests::default_model() {
        Some(path) => {
            tokio::task::spawn_blocking(move || bench_browser(&path, rounds.min(3))).await?
        }
        None => String::from("## Browser\n\nSkipped: the default model is not fetched.\n"),
    };
    let batching = bench_batching(rounds.min(3), new_tokens).await?;
    let compute = bench_compute_section(rounds.min(5), new_tokens).await?;
    let report =
        format!("{report}\n{recovery}\n{default_model}\n{chat}\n{compute}\n{batching}\n{browser}");
    println!("{report}");
    if let Some(path) = &cli.write {
        write_report(path, &run, &report, NOTES)?;
    }
    Ok(())
}

/// The compute section, or why it was skipped.
async fn bench_compute_section(rounds: usize, new_tokens: usize) -> anyhow::Result<String> {
    use corolla_tests::compute_bench::{bench_compute, COMPUTE_HEADING, LLAMACPP_DIR_ENV};
    let Some(model) = corolla_tests::default_model() else {
        return Ok(format!(
            "{COMPUTE_HEADING}\n\nSkipped: the default model is not fetched (`corolla fetch-model`).\n"
        ));
    };
    let llama_cpp = std::env::var_os(LLAMACPP_DIR_ENV).map(std::path::PathBuf::from);
    bench_compute(&model, llama_cpp.as_deref(), rounds, new_tokens).await
}

/// `corolla demo`'s layout: the default model local vs three servers of ten
/// blocks each, a chat prompt, greedy, the same tokens both ways.
async fn bench_default_model(path: &std::path::Path, rounds: usize) -> anyhow::Result<String> {
    use corolla_client::{ChatMessage, ChatTemplate, TextTokenizer};
    use corolla_model::QuantizedWeights;
    let ck = Checkpoint::open(path)?.with_quantized_weights(QuantizedWeights::Auto);
    let tokenizer = TextTokenizer::for_checkpoint(&ck)?;
    let template = ChatTemplate::new(ck.chat_template()?.as_deref(), &tokenizer, None, None)?;
    let prompt = template.render(
        &[ChatMessage::user("Write a short poem about the sea.")],
        true,
    )?;
    let new_tokens = 48;
    let request = GenerateRequest {
        prompt_ids: tokenizer.encode_chat(&prompt)?,
        max_new_tokens: new_tokens,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: 0,
    };
    let layers = ck.config().num_hidden_layers;
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu)?;
    let whole = [BlockSpan::load(&ck, 0, layers, DType::F32, &Device::Cpu)?];
    let servers = demo_swarm(path, layers, &[]).await;
    let node = connect(&[bootstrap_of(&servers)?]).await?;
    let mut settings = SessionSettings::new(
        servers[0].model(),
        layers,
        request.max_length(),
        WireDType::F32,
    );
    settings.expected_blocks = Some(block_hashes(&ck, 0, layers)?);
    let (mut local_tps, mut swarm_tps) = (Vec::new(), Vec::new());
    for round in 0..rounds + 1 {
        let mut chain = LocalChain::new(&whole, request.max_length())?;
        let local = generate(&head, &mut chain, &request, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await?;
        let mut chain = RemoteChain::connect(&node, settings.clone(), &Device::Cpu).await?;
        assert_eq!(chain.route().len(), 3, "one hop per server");
        let swarm = generate(&head, &mut chain, &request, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await?;
        chain.close().await;
        assert_eq!(
            local.generated_ids, swarm.generated_ids,
            "swarm and local tokens differ"
        );
        if round > 0 {
            local_tps.push(local.tokens_per_second());
            swarm_tps.push(swarm.tokens_per_second());
        }
        eprintln!(
            "default model round {round}: local {:.1} tok/s, swarm {:.1} tok/s",
            local.tokens_per_second(),
            swarm.tokens_per_second()
        );
    }
    drop(servers);
    let (local, swarm) = (median(local_tps), median(swarm_tps));
    Ok(format!(
        "## Default model, `corolla demo`'s layout (`corolla-bench`, same run)\n\n\
         SmolLM2-135M-Instruct Q4_1 GGUF, kept quantized (`--quantized auto`), CPU. A chat prompt of {} tokens, \
         {new_tokens} greedy tokens; local (one process) vs three servers of {} blocks each on loopback, in the \
         benchmark's process; medians of {rounds} rounds after a warm-up. Tokens per second include the prefill.\n\n\
         | run | tokens/s |\n|---|---|\n| local (one process) | {local:.1} |\n| swarm (3 servers) | {swarm:.1} |\n\n\
         - ratio swarm / local: **{:.3}**\n",
        request.prompt_ids.len(),
        layers / 3,
        swarm / local
    ))
}

/// Kills the server in use for blocks `per..2 per` once its history holds 256
/// positions, and measures what that costs the next token.
async fn bench_recovery(
    node: &corolla_shared::node::NodeHandle,
    head: &ClientHead,
    settings: &SessionSettings,
    model: &str,
    bootstrap: &str,
    per: usize,
    servers: &mut Vec<RunningServer>,
) -> anyhow::Result<String> {
    const HISTORY: usize = 256;
    const PROMPT: usize = 250;
    let blocks = format!("{per}:{}", 2 * per);
    let quiet = ["--update-period", "30s"];
    let model = std::path::Path::new(model);
    servers.push(start_model_server(model, &blocks, Some(bootstrap), &quiet).await);
    let expected = servers.len();
    for _ in 0..100 {
        if node
            .discover(servers[0].model(), Duration::from_secs(5))
            .await?
            .len()
            >= expected
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let request = GenerateRequest {
        prompt_ids: (0..PROMPT as u32).map(|i| 1 + (i * 53) % 4000).collect(),
        max_new_tokens: 16,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: 0,
    };
    let mut settings = settings.clone();
    settings.max_length = request.max_length();
    let mut chain = RemoteChain::connect(node, settings, &Device::Cpu).await?;
    let victim = chain
        .route()
        .into_iter()
        .find(|h| h.start == per)
        .map(|h| h.peer_id)
        .ok_or_else(|| anyhow::anyhow!("no hop starts at block {per}"))?;
    let kill_after = HISTORY - PROMPT; // tokens generated when the hop has seen 256 positions
    let mut times = Vec::new();
    let mut killed_at = None;
    generate(head, &mut chain, &request, |_| {
        times.push(std::time::Instant::now());
        if times.len() == kill_after {
            if let Some(i) = servers
                .iter()
                .position(|s| s.peer_id().to_string() == victim)
            {
                servers.remove(i).shutdown();
                killed_at = Some(std::time::Instant::now());
            }
        }
        std::ops::ControlFlow::Continue(())
    })
    .await?;
    let killed_at = killed_at.ok_or_else(|| anyhow::anyhow!("the victim was not running"))?;
    let recoveries = chain.recoveries().to_vec();
    chain.close().await;
    anyhow::ensure!(
        recoveries.len() == 1,
        "expected one recovery, got {recoveries:?}"
    );
    let to_next = (times[kill_after] - killed_at).as_secs_f64() * 1e3;
    let mut gaps: Vec<f64> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    gaps.remove(kill_after - 1);
    let normal = median(gaps);
    Ok(format!(
        "## Recovery (`corolla-bench`, same run)\n\n\
         A {PROMPT}-token prompt through the same 4 spans plus a replica of blocks {per}..{}; the server in use \
         for those blocks is killed once their history holds {HISTORY} positions.\n\n\
         | measure | ms |\n|---|---|\n| failure to next token | {to_next:.1} |\n| normal time per token | {normal:.1} |\n\
         | added by the recovery | **{:.1}** |\n| client's own count (failure to caught up) | {:.1} |\n",
        2 * per,
        to_next - normal,
        recoveries[0].seconds * 1e3,
    ))
}

/// The web chat in headless Chromium vs the native client (`corolla
/// generate`), on the same three-server swarm of the default model, over
/// WebRTC-direct and WebSocket; and the page's WebAssembly size.
fn bench_browser(model: &std::path::Path, rounds: usize) -> String {
    use corolla_tests::browser::{browser_missing, native_chat, run_page, web_dist};
    use corolla_tests::netns::NetnsSwarm;
    let wasm = web_dist().join("corolla-wasm_bg.wasm");
    let size = std::fs::metadata(&wasm).map(|m| m.len()).unwrap_or(0);
    let mut out = format!(
        "## Browser vs native client (`corolla-bench`, same run)\n\n\
         The page's WebAssembly (`dist/corolla-wasm_bg.wasm`, after `wasm-opt -Oz`): **{:.2} MiB**.\n\n",
        size as f64 / (1 << 20) as f64
    );
    if let Some(missing) = browser_missing() {
        out.push_str(&format!("Skipped the browser runs: {missing}.\n"));
        return out;
    }
    let Some(mut swarm) = NetnsSwarm::create() else {
        out.push_str("Skipped the browser runs: cannot create a network namespace (needs root).\n");
        return out;
    };
    let layers = 30;
    let web = web_dist();
    for (i, (start, end)) in [(0, 10), (10, 20), (20, layers)].into_iter().enumerate() {
        let extra: Vec<&str> = if i == 0 {
            vec![
                "--http-port",
                "0",
                "--web-dir",
                web.to_str().unwrap_or("dist"),
            ]
        } else {
            Vec::new()
        };
        swarm.start_server(model, start, end, &extra);
    }
    let http = swarm.servers[0].http().unwrap_or_default().to_string();
    let bootstrap = swarm.servers[0].tcp_addr();
    let prompt = "Write a short poem about the sea.";
    let new_tokens = 48;
    let mut rows = String::new();
    for transport in ["webrtc-direct", "websocket"] {
        let (mut native_tps, mut page_tps, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let native = native_chat(model, &bootstrap, prompt, None, new_tokens);
            let run = run_page(
                &format!("{http}/?transport={transport}"),
                &[prompt],
                new_tokens,
                &format!("bench-{transport}"),
                || {},
            );
            let Some(page) = run.answers().first().map(|a| (*a).clone()) else {
                out.push_str(&format!(
                    "The page failed over {transport}: {:?}\n",
                    run.events
                ));
                return out;
            };
            assert_eq!(
                page["generated_ids"], native["generated_ids"],
                "page and native tokens differ"
            );
            let (n, p) = (
                native["tokens_per_second"].as_f64().unwrap_or(0.0),
                page["tokens_per_second"].as_f64().unwrap_or(0.0),
            );
            eprintln!("browser {transport} round {round}: native {n:.1} tok/s, page {p:.1} tok/s");
            native_tps.push(n);
            page_tps.push(p);
            ratios.push(p / n);
        }
        rows.push_str(&format!(
            "| {transport} | {:.1} | {:.1} | **{:.3}** |\n",
            median(native_tps),
            median(page_tps),
            median(ratios)
        ));
    }
    out.push_str(&format!(
        "SmolLM2-135M-Instruct in `corolla demo`'s layout (three servers of 10 blocks) in a network namespace \
         (WebRTC ignores loopback); the same chat prompt, {new_tokens} greedy tokens, identical tokens both ways. \
         Native: `corolla generate --chat`; browser: the chat page in headless Chromium (Debian), driven by \
         `tests/browser/chat.mjs`. Medians of {rounds} rounds; tokens per second include the prefill.\n\n\
         | transport | native tokens/s | browser tokens/s | browser / native (target >= 0.8) |\n|---|---|---|---|\n{rows}"
    ));
    out
}

const SWARM_HEADING: &str = "## Swarm vs local (`corolla-bench`)";
