//! The server's settings: command-line flags, each also readable from an
//! environment variable `COROLLA_<FLAG>` and from a TOML config file
//! (`--config FILE`, keys named like the flags). Precedence: flag, then
//! environment, then file.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use clap::Parser;
use corolla_model::{ModelDType, QuantizedWeights};
use libp2p::Multiaddr;

/// Blocks `A:B`, meaning layers `[A, B)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRange {
    pub start: usize,
    pub end: usize,
}

impl FromStr for BlockRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?} is not A:B (e.g. 0:20)"))?;
        let start: usize = a
            .trim()
            .parse()
            .map_err(|_| format!("{a:?} is not a block index"))?;
        let end: usize = b
            .trim()
            .parse()
            .map_err(|_| format!("{b:?} is not a block index"))?;
        if start >= end {
            return Err(format!("block range {start}:{end} is empty"));
        }
        Ok(BlockRange { start, end })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

/// `--num-blocks`: a count, or as many as fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumBlocks {
    Auto,
    Count(usize),
}

fn parse_num_blocks(s: &str) -> Result<NumBlocks, String> {
    match s.trim() {
        "auto" => Ok(NumBlocks::Auto),
        n => match n.parse::<usize>() {
            Ok(n) if n > 0 => Ok(NumBlocks::Count(n)),
            _ => Err(format!("{s:?} is not a block count (N >= 1) or auto")),
        },
    }
}

/// A size in bytes: a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB, TiB).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 8GiB, 512MiB)"))?;
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024f64.powi(2),
        "gib" | "g" => 1024f64.powi(3),
        "tib" | "t" => 1024f64.powi(4),
        _ => {
            return Err(format!(
                "unknown unit {unit:?} in {s:?}; use B, MB, GB, MiB, GiB"
            ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?} is not a size this machine can have"));
    }
    Ok(bytes as u64)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let value: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 30s, 500ms)"))?;
    let secs = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" | "min" => value * 60.0,
        _ => return Err(format!("unknown unit {unit:?} in {s:?}; use ms, s or m")),
    };
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("duration {s:?} must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration that may be zero (`0`, `0ms`, `0s`: not at all).
fn parse_wait(s: &str) -> Result<Duration, String> {
    match s.trim() {
        "0" | "0ms" | "0s" => Ok(Duration::ZERO),
        _ => parse_duration(s),
    }
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "corolla-server",
    version,
    about = "Serve a span of a model's blocks to the Corolla swarm"
)]
pub struct ServerArgs {
    /// TOML file with settings named like the flags (e.g. `port = 31337`).
    #[arg(long, env = "COROLLA_CONFIG")]
    pub config: Option<PathBuf>,
    /// Model: a folder (Hugging Face layout or `corolla convert` output), a
    /// GGUF file, or a Hugging Face repo id (owner/name).
    #[arg(long, env = "COROLLA_MODEL")]
    pub model: PathBuf,
    /// The model's name in the DHT; defaults to one derived from the model.
    #[arg(long, env = "COROLLA_MODEL_NAME")]
    pub model_name: Option<String>,
    /// Serve layers [A, B).
    #[arg(long, env = "COROLLA_BLOCK_INDICES", conflicts_with = "num_blocks")]
    pub block_indices: Option<BlockRange>,
    /// Serve N consecutive layers, chosen where the swarm is weakest; `auto`
    /// (the default without --block-indices): as many as fit in --memory-limit.
    #[arg(long, env = "COROLLA_NUM_BLOCKS", value_parser = parse_num_blocks)]
    pub num_blocks: Option<NumBlocks>,
    /// Memory this server may use for weights and KV cache (e.g. 8GiB, 512MiB;
    /// default: the memory available at start-up). Sizes `--num-blocks auto`.
    #[arg(long, env = "COROLLA_MEMORY_LIMIT", value_parser = parse_bytes)]
    pub memory_limit: Option<u64>,
    /// TCP and QUIC port; WebSocket and WebRTC-direct use the next one (0: any free ports).
    #[arg(long, env = "COROLLA_PORT", default_value_t = 31337)]
    pub port: u16,
    #[arg(long, env = "COROLLA_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// Host name or IP announced instead of the listen address (behind port forwarding).
    #[arg(long, env = "COROLLA_PUBLIC_NAME")]
    pub public_name: Option<String>,
    /// Multiaddrs (with /p2p/) of servers already in the swarm.
    #[arg(long, env = "COROLLA_INITIAL_PEERS", num_args = 1.., value_delimiter = ',', conflicts_with = "new_swarm")]
    pub initial_peers: Vec<Multiaddr>,
    /// Start a new swarm instead of joining one.
    #[arg(long, env = "COROLLA_NEW_SWARM")]
    pub new_swarm: bool,
    #[arg(long, env = "COROLLA_DEVICE", value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Compute dtype: auto, f32, f16 or bf16.
    #[arg(long, env = "COROLLA_DTYPE", default_value = "auto")]
    pub dtype: ModelDType,
    /// Quantized (GGUF) weights: keep (least memory, fastest on CPU),
    /// dequantize (exact float math) or auto (Corolla's choice for the
    /// model; today keep for every GGUF).
    #[arg(long, env = "COROLLA_QUANTIZED", default_value = "auto")]
    pub quantized: QuantizedWeights,
    /// File holding this server's key, created if absent, for a stable peer id.
    #[arg(long, env = "COROLLA_IDENTITY")]
    pub identity: Option<PathBuf>,
    /// Start even when the identity file (or the WebRTC certificate beside
    /// it, `NAME.webrtc.pem` for `NAME.key`) is readable by other users; by
    /// default such a key is refused.
    #[arg(long, env = "COROLLA_ALLOW_SHARED_IDENTITY")]
    pub allow_shared_identity: bool,
    /// Longest session (prompt plus generated tokens) accepted.
    #[arg(long, env = "COROLLA_INFERENCE_MAX_LENGTH", default_value_t = 2048)]
    pub inference_max_length: usize,
    #[arg(long, env = "COROLLA_MAX_SESSIONS", default_value_t = 16)]
    pub max_sessions: usize,
    /// Write the server's addresses here, as JSON, once it is ready to serve.
    #[arg(long, env = "COROLLA_ADDR_FILE")]
    pub addr_file: Option<PathBuf>,
    /// How often the server re-announces itself; entries expire after two periods.
    #[arg(long, env = "COROLLA_UPDATE_PERIOD", default_value = "60s", value_parser = parse_duration)]
    pub update_period: Duration,
    /// Serve HTTP on this port (0: any free port): the web page, the client
    /// part of the model for browsers, and `/api/status`.
    #[arg(long, env = "COROLLA_HTTP_PORT")]
    pub http_port: Option<u16>,
    /// The built web page (trunk's `dist` folder) to serve over HTTP.
    #[arg(long, env = "COROLLA_WEB_DIR", requires = "http_port")]
    pub web_dir: Option<PathBuf>,
    /// PEM certificate chain for pages served over https: adds a `wss`
    /// listener (`/tls/ws`, port + 2) and makes `--http-port` serve https.
    #[arg(long, env = "COROLLA_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "COROLLA_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Adds a fixed delay to every step (for tests of routing around slow servers).
    #[arg(long, env = "COROLLA_STEP_DELAY_MS", default_value_t = 0)]
    pub step_delay_ms: u64,
    /// A session without progress (an opened session or a computed step)
    /// this long is closed and its cache freed.
    #[arg(long, env = "COROLLA_SESSION_TIMEOUT", default_value = "300s", value_parser = parse_duration)]
    pub session_timeout: Duration,
    /// Sessions one peer may hold at once (default: a quarter of
    /// --max-sessions, at least 1).
    #[arg(long, env = "COROLLA_MAX_SESSIONS_PER_PEER")]
    pub max_sessions_per_peer: Option<usize>,
    /// libp2p connections one peer may hold with this server.
    #[arg(long, env = "COROLLA_MAX_CONNECTIONS_PER_PEER", default_value_t = 8)]
    pub max_connections_per_peer: u32,
    /// libp2p connections in total.
    #[arg(long, env = "COROLLA_MAX_CONNECTIONS", default_value_t = 512)]
    pub max_connections: u32,
    /// A private swarm: the only peers spoken to (peer ids, comma-separated,
    /// or files holding one per line); everyone else is refused.
    #[arg(long, env = "COROLLA_ALLOWED_PEERS", value_delimiter = ',')]
    pub allowed_peers: Vec<String>,
    /// HTTP connections served at once; more are closed on arrival (the
    /// libp2p side keeps its own descriptors).
    #[arg(long, env = "COROLLA_HTTP_MAX_CONNECTIONS", default_value_t = 256)]
    pub http_max_connections: usize,
    /// A request's head must arrive within this.
    #[arg(long, env = "COROLLA_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,
    /// TESTING AID, never for a real swarm: answer this share of steps with
    /// plausible but wrong activations (noise of a tenth of their RMS), to
    /// test clients' spot checks, like --step-delay-ms tests routing.
    #[arg(long, env = "COROLLA_CORRUPT_OUTPUTS", default_value_t = 0.0, value_parser = parse_rate)]
    pub corrupt_outputs: f64,
    /// TESTING AID, never for a real swarm: push this share of steps to the
    /// next server with wrong activations while returning the right ones to
    /// the client (signed as what was pushed), to test that clients blame
    /// the pusher and never the server after it.
    #[arg(long, env = "COROLLA_CORRUPT_PUSHES", default_value_t = 0.0, value_parser = parse_rate)]
    pub corrupt_pushes: f64,
    /// TESTING AID, never for a real swarm: answer the client honestly but
    /// fail every push to the next server: `silent` (say pushed, send
    /// nothing), `forged` (a proof another key signed), `replayed` (the
    /// previous step's push again), `intrude` (its own output pushed into
    /// the session after the next one first) or `late:MS` (the honest push,
    /// MS late),
    /// to test that clients blame the pusher and never the server after it.
    #[arg(long, env = "COROLLA_PUSH_FAULT")]
    pub push_fault: Option<crate::push_fault::PushFault>,
    /// TESTING AID, never for a real swarm: answer every step this many
    /// milliseconds late without counting it in the announced speed (a
    /// server slower than it claims), to test that clients leave it.
    #[arg(long, env = "COROLLA_LATE_STEPS_MS", default_value_t = 0)]
    pub late_steps_ms: u64,
    /// Prefill positions computed at a time between decode batches, so one
    /// long prompt does not stall every other session (0: no limit).
    #[arg(long, env = "COROLLA_MAX_CHUNK_TOKENS", default_value_t = 256)]
    pub max_chunk_tokens: usize,
    /// Do not reuse the KV cache of prompt beginnings other sessions
    /// computed (shared prefixes: a widget's system prompt is computed once
    /// per server, not once per visitor). Sharing tells a client, by timing,
    /// whether another client sent the same beginning lately.
    #[arg(long, env = "COROLLA_NO_SHARED_PREFIXES")]
    pub no_shared_prefixes: bool,
    /// A LoRA adapter sessions may run with, as NAME=PATH: PATH a PEFT
    /// folder (adapter_config.json, adapter_model.safetensors) or a GGUF
    /// adapter; NAME what clients ask for (`corolla --adapter NAME`), best a
    /// hub id such as user/name. Repeat the flag (or separate with commas)
    /// for more; every server of the model that offers NAME must load the
    /// same adapter.
    #[arg(long = "adapter", env = "COROLLA_ADAPTERS", value_delimiter = ',')]
    pub adapters: Vec<crate::adapters::AdapterArg>,
    /// KV-cache positions all sessions share; a session reserves its
    /// max_length when it opens (default: what --max-sessions sessions of
    /// --inference-max-length need, at most half the memory available).
    #[arg(long, env = "COROLLA_CACHE_TOKENS", value_parser = clap::value_parser!(u64).range(1..))]
    pub cache_tokens: Option<u64>,
    /// On SIGTERM or Ctrl-C, how long open sessions get to end before the
    /// server stops anyway.
    #[arg(long, env = "COROLLA_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// A server that chose its blocks itself moves them when that raises
    /// the swarm's weakest block throughput by more than this share
    /// (0.15: 15 %); `off` keeps them where they are.
    #[arg(long, env = "COROLLA_BALANCE_QUALITY", default_value = "0.15", value_parser = parse_balance_quality)]
    pub balance_quality: BalanceQuality,
    /// How long a decode batch may wait for sessions that were decoding a
    /// moment ago to send their next step (never more than a quarter of
    /// the last batch's time).
    #[arg(long, env = "COROLLA_MAX_BATCH_WAIT", default_value = "10ms", value_parser = parse_wait)]
    pub max_batch_wait: Duration,
    /// Do not offer circuit relay v2 to servers behind NATs (a public
    /// server offers it by default; a private one is never chosen).
    #[arg(long, env = "COROLLA_NO_RELAY")]
    pub no_relay: bool,
    /// Private servers holding a relay slot on this one at once.
    #[arg(long, env = "COROLLA_RELAY_MAX_RESERVATIONS", default_value_t = 64)]
    pub relay_max_reservations: usize,
    /// Relayed connections carried at once.
    #[arg(long, env = "COROLLA_RELAY_MAX_CIRCUITS", default_value_t = 32)]
    pub relay_max_circuits: usize,
    /// A relayed connection is closed after this many bytes (the client
    /// then replays to another route).
    #[arg(long, env = "COROLLA_RELAY_MAX_CIRCUIT_BYTES", default_value = "1GiB", value_parser = parse_bytes)]
    pub relay_max_circuit_bytes: u64,
    /// ... or after this long.
    #[arg(long, env = "COROLLA_RELAY_MAX_CIRCUIT_DURATION", default_value = "30m", value_parser = parse_duration)]
    pub relay_max_circuit_duration: Duration,
    /// Do not ask the router for a port mapping (UPnP).
    #[arg(long, env = "COROLLA_NO_UPNP")]
    pub no_upnp: bool,
    /// Do not try to turn relayed connections into direct ones (DCUtR).
    #[arg(long, env = "COROLLA_NO_HOLE_PUNCH")]
    pub no_hole_punch: bool,
    /// Decode steps computed in one batched forward.
    #[arg(long, env = "COROLLA_MAX_BATCH", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_batch: u32,
}

/// A share in `0..=1`.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a rate between 0 and 1")),
    }
}

/// `--balance-quality`: the least gain worth a move, or never move.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BalanceQuality {
    Off,
    /// A share of the swarm's weakest block throughput (0.15: 15 %).
    Gain(f64),
}

/// `off`, or a share from 0 to 10 (a swarm eleven times stronger).
fn parse_balance_quality(s: &str) -> Result<BalanceQuality, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(BalanceQuality::Off);
    }
    match s.trim().parse::<f64>() {
        Ok(q) if (0.0..=10.0).contains(&q) => Ok(BalanceQuality::Gain(q)),
        _ => Err(format!(
            "{s:?} is neither `off` nor a share between 0 and 10 (0.15 is 15 %)"
        )),
    }
}

impl ServerArgs {
    pub(crate) fn reach_settings(&self) -> corolla_shared::reach::ReachSettings {
        use corolla_shared::reach::{ReachSettings, RelayLimits};
        ReachSettings {
            relay: (!self.no_relay).then(|| RelayLimits {
                max_reservations: self.relay_max_reservations,
                max_circuits: self.relay_max_circuits,
                max_circuit_bytes: self.relay_max_circuit_bytes,
                max_circuit_duration: self.relay_max_circuit_duration,
                ..RelayLimits::default()
            }),
            hole_punch: !self.no_hole_punch,
            upnp: !self.no_upnp,
            ..ReachSettings::server()
        }
    }

    pub(crate) fn compute_settings(&self) -> crate::compute::ComputeSettings {
        crate::compute::ComputeSettings {
            max_chunk_tokens: self.max_chunk_tokens,
            max_batch: self.max_batch as usize,
            max_batch_wait: self.max_batch_wait,
            share_prefixes: !self.no_shared_prefixes,
        }
    }

    /// Parses the process's arguments, with environment and config file.
    pub fn from_env() -> Result<Self, ArgsError> {
        let args: Vec<String> = std::env::args().collect();
        Self::from_args_and_file(args)
    }

    /// Parses `args` after loading the config file they (or the
    /// environment) name into `COROLLA_*` variables not already set.
    pub fn from_args_and_file(args: Vec<String>) -> Result<Self, ArgsError> {
        let config = args
            .iter()
            .position(|a| a == "--config")
            .and_then(|i| args.get(i + 1).cloned())
            .or_else(|| {
                args.iter()
                    .find_map(|a| a.strip_prefix("--config=").map(str::to_owned))
            })
            .or_else(|| std::env::var("COROLLA_CONFIG").ok());
        if let Some(path) = config {
            apply_config_file(Path::new(&path))?;
        }
        Ok(Self::try_parse_from(args)?)
    }
}

/// Why the server's settings could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    #[error("cannot read config file {}: {source}", path.display())]
    ReadConfig {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {source}", path.display())]
    ConfigToml {
        path: PathBuf,
        source: toml::de::Error,
    },
    /// Bad flags, and also `--help` and `--version`: `clap::Error::exit`
    /// prints those to stdout and exits 0.
    #[error(transparent)]
    Flags(#[from] clap::Error),
}

fn apply_config_file(path: &Path) -> Result<(), ArgsError> {
    let text = std::fs::read_to_string(path).map_err(|source| ArgsError::ReadConfig {
        path: path.to_path_buf(),
        source,
    })?;
    let table: toml::Table = text.parse().map_err(|source| ArgsError::ConfigToml {
        path: path.to_path_buf(),
        source,
    })?;
    for (key, value) in table {
        let var = format!("COROLLA_{}", key.replace('-', "_").to_uppercase());
        let value = match value {
            toml::Value::String(s) => s,
            toml::Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        if std::env::var_os(&var).is_none() {
            // Set before any thread is started, in `main`.
            std::env::set_var(var, value);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_and_balance_qualities_parse() {
        assert_eq!(parse_wait("0ms"), Ok(Duration::ZERO));
        assert_eq!(parse_wait("0"), Ok(Duration::ZERO));
        assert_eq!(parse_wait("10ms"), Ok(Duration::from_millis(10)));
        assert!(parse_wait("-1ms").is_err());
        assert_eq!(
            parse_balance_quality("0.15"),
            Ok(BalanceQuality::Gain(0.15))
        );
        assert_eq!(parse_balance_quality("OFF"), Ok(BalanceQuality::Off));
        assert!(parse_balance_quality("15%").is_err());
        assert!(parse_balance_quality("-0.1").is_err());
    }

    #[test]
    fn block_ranges_and_durations_parse() {
        assert_eq!(
            "2:5".parse::<BlockRange>().unwrap(),
            BlockRange { start: 2, end: 5 }
        );
        assert!("5:5".parse::<BlockRange>().is_err());
        assert!("a:5".parse::<BlockRange>().is_err());
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("3h").is_err());
    }

    #[test]
    fn flags_parse_with_defaults() {
        let args = ServerArgs::try_parse_from([
            "corolla-server",
            "--model",
            "m",
            "--block-indices",
            "0:2",
            "--new-swarm",
        ])
        .unwrap();
        assert_eq!(args.port, 31337);
        assert_eq!(args.block_indices, Some(BlockRange { start: 0, end: 2 }));
        assert!(ServerArgs::try_parse_from([
            "corolla-server",
            "--model",
            "m",
            "--block-indices",
            "0:2",
            "--num-blocks",
            "2"
        ])
        .is_err());
    }

    #[test]
    fn sizes_and_block_counts_parse() {
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5 GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1GiB").is_err());
        assert!(parse_bytes("1e30TiB").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert_eq!(parse_num_blocks("auto"), Ok(NumBlocks::Auto));
        assert_eq!(parse_num_blocks("6"), Ok(NumBlocks::Count(6)));
        assert!(parse_num_blocks("0").is_err());
    }
}
