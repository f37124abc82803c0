//! The `corolla` command line: argument parsing and the commands' bodies.
//! The binary is a thin `main` over [`run`] so that it relinks quickly.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use corolla_model::convert::{convert, ConvertProgress};
use corolla_model::fingerprint::{block_hashes, default_model_name};
use corolla_model::wire::wire_dtype;
use corolla_model::{BlockSpan, Checkpoint, ClientHead, Device, ModelDType, SamplingParams};
use corolla_shared::ServerRecord;
use indicatif::{ProgressBar, ProgressStyle};
use libp2p::Multiaddr;
use serde::Serialize;

use crate::chain::{Recovery, RemoteChain, SessionSettings};
use crate::generate::{generate, GenerateRequest};
use crate::local::LocalChain;
use crate::network::connect;
use crate::route::{uncovered_blocks, Hop};
use crate::text::{TextStream, TextTokenizer};

#[derive(Parser, Debug)]
#[command(
    name = "corolla",
    version,
    about = "Run Llama-family models across a swarm of GPU servers"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt.
    Generate(GenerateArgs),
    /// Split a checkpoint into per-span block files plus a client part.
    Convert(ConvertArgs),
    /// Show which servers serve which blocks of a model, and any gaps.
    Swarm(SwarmCommandArgs),
}

#[derive(Args, Debug, Clone)]
struct SwarmArgs {
    /// Multiaddrs (with /p2p/) of servers to enter the swarm through.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    initial_peers: Vec<Multiaddr>,
    /// The model's name in the DHT; defaults to the one derived from --model.
    #[arg(long)]
    model_name: Option<String>,
    /// How long to look for servers covering every block.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    discovery_timeout: Duration,
    /// How long to wait for a server's answer to one step.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    step_timeout: Duration,
    /// Server failures survived in one generation before giving up.
    #[arg(long, default_value_t = 8)]
    max_retries: usize,
    /// Use only these servers (peer ids).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    allowed_servers: Vec<String>,
    /// Never use these servers (peer ids).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    blocked_servers: Vec<String>,
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("{s:?} must be a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[derive(Args, Debug)]
struct SwarmCommandArgs {
    #[command(flatten)]
    swarm: SwarmArgs,
    /// A model folder to take the model's name and block count from.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// Model folder: Hugging Face layout or the output of `corolla convert`.
    #[arg(long)]
    model: PathBuf,
    /// Run every block in this process.
    #[arg(long, conflicts_with = "initial_peers")]
    local: bool,
    #[command(flatten)]
    swarm: SwarmArgs,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Compute dtype: auto, f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    dtype: ModelDType,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
    }
}

#[derive(Args, Debug)]
struct ConvertArgs {
    /// Source model folder (Hugging Face layout).
    #[arg(long)]
    model: PathBuf,
    /// Output folder; must be empty or absent.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 1)]
    blocks_per_file: usize,
}

/// Parses the command line and runs the command.
pub fn run() -> Result<()> {
    init_runtime();
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Convert(args) => run_convert(args),
        Command::Swarm(args) => runtime()?.block_on(run_swarm(args)),
    }
}

/// Logging to stderr, and an explicit rayon pool size: unset, candle
/// re-reads the core count from /proc on every matmul.
pub fn init_runtime() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Runtime::new()?)
}

fn open_checkpoint(dir: &Path) -> Result<Checkpoint> {
    if !dir.is_dir() {
        bail!("model folder {} does not exist", dir.display());
    }
    Checkpoint::open(dir).with_context(|| format!("cannot open model {}", dir.display()))
}

#[derive(Serialize)]
struct GenerateJson<'a> {
    prompt_ids: &'a [u32],
    generated_ids: &'a [u32],
    text: String,
    tokens_per_second: f64,
    prefill_seconds: f64,
    total_seconds: f64,
    stop_reason: crate::StopReason,
    dtype: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    route: Option<&'a [Hop]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    recoveries: Option<&'a [Recovery]>,
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    if !args.local && args.swarm.initial_peers.is_empty() {
        bail!("pass --initial-peers to generate through a swarm, or --local to run the whole model in this process");
    }
    let checkpoint = open_checkpoint(&args.model)?;
    let tokenizer = TextTokenizer::from_file(&checkpoint.tokenizer_path())?;
    let device = Device::Cpu;
    let dtype = args.dtype.resolve(checkpoint.config(), &device);
    let head = ClientHead::load(&checkpoint, dtype, &device)?;
    let request = GenerateRequest {
        prompt_ids: tokenizer.encode(&args.prompt)?,
        max_new_tokens: args.max_new_tokens,
        sampling: args.sampling.params(),
        stop_at_eos: !args.ignore_eos,
    };
    request.sampling.validate()?;

    let mut stream = TextStream::default();
    let mut stdout = std::io::stdout().lock();
    let mut print_error = None;
    let on_token = |token| {
        if args.json {
            return ControlFlow::Continue(());
        }
        match stream.push(&tokenizer, token) {
            Ok(Some(piece)) => {
                let _ = write!(stdout, "{piece}");
                let _ = stdout.flush();
            }
            Ok(None) => {}
            Err(e) => print_error = Some(e),
        }
        ControlFlow::Continue(())
    };
    let (output, route) = runtime()?.block_on(async {
        if args.local {
            let num_layers = checkpoint.config().num_hidden_layers;
            let spans = [BlockSpan::load(&checkpoint, 0, num_layers, dtype, &device)?];
            let mut chain = LocalChain::new(&spans, request.max_length().max(1))?;
            let output = generate(&head, &mut chain, &request, on_token).await?;
            Ok::<_, anyhow::Error>((output, None))
        } else {
            let model = args
                .swarm
                .model_name
                .clone()
                .unwrap_or_else(|| default_model_name(&checkpoint));
            let node = connect(&args.swarm.initial_peers).await?;
            let num_layers = checkpoint.config().num_hidden_layers;
            let mut settings = SessionSettings::new(
                model,
                num_layers,
                request.max_length().max(1),
                wire_dtype(dtype)?,
            );
            settings.expected_blocks = block_hashes(&checkpoint, 0, num_layers).ok();
            settings.timeout = args.swarm.step_timeout;
            settings.discovery_timeout = args.swarm.discovery_timeout;
            settings.max_retries = args.swarm.max_retries;
            settings.allowed_servers = (!args.swarm.allowed_servers.is_empty())
                .then(|| args.swarm.allowed_servers.iter().cloned().collect());
            settings.blocked_servers = args.swarm.blocked_servers.iter().cloned().collect();
            let mut chain = RemoteChain::connect(&node, settings, &device).await?;
            let route = chain.route();
            let output = generate(&head, &mut chain, &request, on_token).await;
            let recoveries = chain.recoveries().to_vec();
            chain.close().await;
            Ok((output?, Some((route, recoveries))))
        }
    })?;
    if let Some(e) = print_error {
        return Err(e.into());
    }
    let text = tokenizer.decode(&output.generated_ids)?;
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let json = GenerateJson {
            prompt_ids: &output.prompt_ids,
            generated_ids: &output.generated_ids,
            text,
            tokens_per_second: output.tokens_per_second(),
            prefill_seconds: output.prefill_time.as_secs_f64(),
            total_seconds: output.total_time.as_secs_f64(),
            stop_reason: output.stop_reason,
            dtype: format!("{dtype:?}").to_lowercase(),
            route: route.as_ref().map(|(r, _)| r.as_slice()),
            recoveries: route.as_ref().map(|(_, r)| r.as_slice()),
        };
        writeln!(stdout, "{}", serde_json::to_string(&json)?)?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "{} tokens, {:.1} tokens/s ({:?})",
            output.generated_ids.len(),
            output.tokens_per_second(),
            output.stop_reason
        );
    }
    Ok(())
}

#[derive(Serialize)]
struct SwarmJson<'a> {
    model: &'a str,
    num_layers: usize,
    servers: &'a [ServerRecord],
    uncovered: Vec<(usize, usize)>,
    complete: bool,
}

async fn run_swarm(args: SwarmCommandArgs) -> Result<()> {
    let checkpoint = args.model.as_deref().map(open_checkpoint).transpose()?;
    let model = match (&args.swarm.model_name, &checkpoint) {
        (Some(name), _) => name.clone(),
        (None, Some(ck)) => default_model_name(ck),
        (None, None) => {
            bail!("pass --model-name NAME or --model DIR to say which model to look up")
        }
    };
    let node = connect(&args.swarm.initial_peers).await?;
    let records = node.discover(&model, args.swarm.discovery_timeout).await?;
    let num_layers = checkpoint
        .as_ref()
        .map(|c| c.config().num_hidden_layers)
        .or_else(|| records.iter().map(|r| r.num_layers as usize).max())
        .unwrap_or(0);
    let uncovered = uncovered_blocks(&records, num_layers);
    if args.json {
        let json = SwarmJson {
            model: &model,
            num_layers,
            servers: &records,
            complete: uncovered.is_empty() && num_layers > 0,
            uncovered,
        };
        println!("{}", serde_json::to_string(&json)?);
        return Ok(());
    }
    println!(
        "model {model}: {} servers, {num_layers} blocks",
        records.len()
    );
    for r in &records {
        println!(
            "  {}  blocks {:>3}..{:<3}  {:>8.1} tokens/s  {}  {}",
            r.peer_id, r.start, r.end, r.throughput, r.dtype, r.fingerprint
        );
    }
    if uncovered.is_empty() && num_layers > 0 {
        println!("all {num_layers} blocks are served");
    } else {
        let gaps: Vec<String> = uncovered.iter().map(|(a, b)| format!("{a}..{b}")).collect();
        println!("blocks not served: {}", gaps.join(", "));
    }
    Ok(())
}

fn run_convert(args: ConvertArgs) -> Result<()> {
    let checkpoint = open_checkpoint(&args.model)?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let index = convert(
        &checkpoint,
        &args.out,
        args.blocks_per_file,
        |p: &ConvertProgress| {
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
            bar.set_message(format!(
                "{}/{} {}",
                p.files_done, p.files_total, p.last_file
            ));
        },
    )
    .with_context(|| {
        format!(
            "cannot convert {} into {}",
            args.model.display(),
            args.out.display()
        )
    })?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} block files and the client part to {}",
        index.spans.len(),
        args.out.display()
    );
    Ok(())
}
