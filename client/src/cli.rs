//! The `corolla` command line: argument parsing and the commands' bodies.
//! The binary is a thin `main` over [`run`] so that it relinks quickly.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use corolla_model::convert::{convert, ConvertProgress};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, Device, ModelDType, SamplingParams};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::generate::{generate, GenerateOutput, GenerateRequest};
use crate::local::LocalChain;
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
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// Model folder: Hugging Face layout or the output of `corolla convert`.
    #[arg(long)]
    model: PathBuf,
    /// Run every block in this process.
    #[arg(long)]
    local: bool,
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
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    if !args.local {
        bail!("generation through a swarm is not available yet; pass --local to run the whole model in this process");
    }
    let checkpoint = open_checkpoint(&args.model)?;
    let tokenizer = TextTokenizer::from_file(&checkpoint.tokenizer_path())?;
    let device = Device::Cpu;
    let dtype = args.dtype.resolve(checkpoint.config(), &device);
    let head = ClientHead::load(&checkpoint, dtype, &device)?;
    let spans = [BlockSpan::load(
        &checkpoint,
        0,
        checkpoint.config().num_hidden_layers,
        dtype,
        &device,
    )?];
    let request = GenerateRequest {
        prompt_ids: tokenizer.encode(&args.prompt)?,
        max_new_tokens: args.max_new_tokens,
        sampling: args.sampling.params(),
        stop_at_eos: !args.ignore_eos,
    };
    let mut chain = LocalChain::new(&spans, request.max_length().max(1))?;

    let mut stream = TextStream::default();
    let mut stdout = std::io::stdout().lock();
    let mut print_error = None;
    let output: GenerateOutput =
        futures::executor::block_on(generate(&head, &mut chain, &request, |token| {
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
        }))?;
    if let Some(e) = print_error {
        return Err(e.into());
    }
    let text = tokenizer.decode(&output.generated_ids)?;
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
