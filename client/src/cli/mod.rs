//! The `corolla` command line: argument parsing and the commands' bodies.
//! The binary is a thin `main` over [`run`] so that it relinks quickly.
//! Flags several commands share are in `args`; `chat` and `demo` in `chat`.

mod args;
mod chat;
mod printer;

use args::*;
pub use args::{init_runtime, SamplingArgs};

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use corolla_model::convert::{convert, ConvertProgress};
use corolla_model::fingerprint::default_model_name;
use corolla_shared::{ErrorKind, ServerRecord};
use indicatif::{ProgressBar, ProgressStyle};
use libp2p::Multiaddr;
use serde::Serialize;

use crate::assistant::{Answer, Conversation};
use crate::chain::Recovery;
use crate::chat::ChatMessage;
use crate::draft_model::DraftModel;
use crate::generate::GenerateRequest;
use crate::network::connect_with;
use crate::route::Hop;
use corolla_shared::peers::parse_peer_list;
use corolla_shared::swarm_report::{rtts_by_peer, SwarmReport};

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
    Chat(chat::ChatArgs),
    /// Start a local swarm of three servers on the default model and chat with it.
    Demo(chat::DemoArgs),
    /// Fetch the default model into the cache and print its path.
    FetchModel,
    /// Serve an OpenAI-compatible HTTP API in front of a swarm or a local model.
    Api(ApiArgs),
    /// Write a GGUF model with a real 70B-class shape and random weights (for tests and benchmarks).
    #[cfg(feature = "random-model")]
    RandomModel(RandomModelArgs),
}

#[cfg(feature = "random-model")]
#[derive(Args, Debug)]
struct RandomModelArgs {
    /// llama-2-70b, llama-3-70b, qwen2.5-72b, qwen3-32b, mixtral-8x7b or qwen3-30b-a3b.
    #[arg(long)]
    shape: corolla_model::random_gguf::ModelShape,
    /// Decoder blocks: the real model's layer shape on a short stack.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Weight matrices' type: q4_k, q4_1, q8_0 or f16.
    #[arg(long, default_value = "q4_k")]
    quant: corolla_model::random_gguf::WeightQuant,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The GGUF file to write (replaced if it exists).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct ApiArgs {
    #[command(flatten)]
    blocks: BlocksArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// 0: any free port (the address is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests must send `Authorization: Bearer KEY`.
    #[arg(long, env = "COROLLA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Answers generated at once, shared between client addresses; further
    /// requests wait in line up to 20 s (a freed place goes to the address
    /// holding the fewest), else are refused busy (429, Retry-After).
    #[arg(long, default_value_t = 16)]
    max_concurrent: usize,
    /// Finished conversations whose server sessions stay open for follow-ups.
    #[arg(long, default_value_t = 8)]
    kept_conversations: usize,
    /// Peer ids the API speaks to the swarm as (each a node of its own):
    /// servers grant one peer a quarter of their sessions, so answers at
    /// once beyond that need more identities (at most 16).
    #[arg(long, default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=crate::identities::MAX_IDENTITIES as i64))]
    identities: u16,
    /// The longest draft a step checks (prompt lookup); 0: one token per step.
    #[arg(long, default_value_t = crate::DEFAULT_DRAFTS)]
    drafts: usize,
    /// The most tokens one request may ask for (`max_tokens`); more is refused (400).
    #[arg(long, default_value_t = 4096)]
    max_tokens_cap: usize,
    /// HTTP connections at once; more are closed on arrival.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// A request's head must arrive within this many seconds.
    #[arg(long, default_value = "10", value_parser = args::parse_seconds)]
    header_timeout: std::time::Duration,
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
    #[command(flatten)]
    blocks: BlocksArgs,
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
    /// Answer with this LoRA adapter, which the swarm's servers announce
    /// (`corolla swarm` lists them); only servers running it are used.
    #[arg(long, value_parser = args::parse_adapter_name, conflicts_with = "local")]
    adapter: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
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
    let json = match &cli.command {
        Command::Generate(args) => args.json,
        Command::Swarm(args) => args.json,
        _ => false,
    };
    let result = run_command(cli.command);
    if let (Err(e), true) = (&result, json) {
        // A program reading stdout gets the failure in the same shape as
        // the answer it waited for; a person (or a log) reads stderr, as
        // without --json; the exit status still says it failed.
        println!("{}", serde_json::json!({ "error": error_json(e) }));
        eprintln!("Error: {e:#}");
        std::process::exit(1);
    }
    result
}

/// `{"kind", "message", "retryable", "uncovered"?}` for `--json`: the kind
/// of the client error behind `e`, or of the failure it wraps.
fn error_json(e: &anyhow::Error) -> serde_json::Value {
    if let Some(client) = e
        .chain()
        .find_map(|c| c.downcast_ref::<crate::error::ClientError>())
    {
        let mut json = client.to_json();
        json["message"] = serde_json::json!(format!("{e:#}"));
        return json;
    }
    let kind = if let Some(session) = e
        .chain()
        .find_map(|c| c.downcast_ref::<corolla_shared::session::SessionError>())
    {
        session.kind()
    } else if e.chain().any(|c| c.is::<corolla_shared::node::NodeError>()) {
        ErrorKind::Unreachable
    } else if e.chain().any(|c| c.is::<std::io::Error>()) {
        // Files and folders the command was given.
        ErrorKind::BadRequest
    } else {
        ErrorKind::Internal
    };
    serde_json::json!({
        "kind": kind,
        "message": format!("{e:#}"),
        "retryable": kind.retryable(),
    })
}

fn run_command(command: Command) -> Result<()> {
    match command {
        Command::Generate(args) => run_generate(args),
        Command::Convert(args) => run_convert(args),
        Command::Swarm(args) => runtime()?.block_on(run_swarm(args)),
        Command::Chat(args) => chat::run_chat(args),
        Command::Demo(args) => chat::run_demo(args),
        Command::FetchModel => {
            println!("{}", fetch_default_model()?.display());
            Ok(())
        }
        Command::Api(args) => runtime()?.block_on(run_api(args)),
        #[cfg(feature = "random-model")]
        Command::RandomModel(args) => run_random_model(args),
    }
}

#[cfg(feature = "random-model")]
fn run_random_model(args: RandomModelArgs) -> Result<()> {
    use corolla_model::random_gguf::{write_random_gguf, RandomGguf};
    if args.layers == 0 {
        bail!("--layers must be at least 1");
    }
    let spec = RandomGguf::new(args.shape, args.layers, args.quant, args.seed);
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(spec.name.clone());
    write_random_gguf(&args.out, &spec, |written, total| {
        bar.set_length(total);
        bar.set_position(written);
    })
    .with_context(|| format!("cannot write {}", args.out.display()))?;
    bar.finish_and_clear();
    let size = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({} layers of {}, {:?}): {:.2} GB",
        args.out.display(),
        args.layers,
        args.shape.name(),
        args.quant,
        size as f64 / 1e9
    );
    Ok(())
}

async fn run_api(args: ApiArgs) -> Result<()> {
    let mut assistant = open_assistant(&args.blocks).await?;
    if assistant.swarm_view().is_some() && args.identities > 1 {
        let swarm = &args.blocks.swarm;
        let nodes =
            futures::future::try_join_all((1..args.identities).map(|_| swarm.connect())).await?;
        assistant = assistant.also_speaking_as(nodes)?;
    }
    let settings = crate::api::ApiSettings {
        addr: std::net::SocketAddr::new(args.host, args.port),
        api_key: args.api_key.filter(|k| !k.is_empty()),
        max_concurrent: args.max_concurrent,
        kept_conversations: args.kept_conversations,
        drafts: args.drafts,
        max_tokens_cap: args.max_tokens_cap.max(1),
        http: corolla_http::HttpLimits {
            max_connections: args.max_connections.max(1),
            header_timeout: args.header_timeout,
            ..corolla_http::HttpLimits::default()
        },
        ..crate::api::ApiSettings::default()
    };
    let server = crate::api::serve(std::sync::Arc::new(assistant), settings)
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    eprintln!(
        "OpenAI-compatible API: http://{}/v1 (Ctrl-C stops it)",
        server.addr()
    );
    wait_for_stop_signal().await;
    eprintln!("stopping the API");
    server.shutdown().await?;
    Ok(())
}

/// Ctrl-C, or SIGTERM/SIGHUP on Unix.
async fn wait_for_stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut term), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
                _ = hup.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
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
    /// Chain steps after the prefill, draft tokens checked and accepted.
    steps: usize,
    drafted: usize,
    accepted: usize,
    dtype: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    route: Option<&'a [Hop]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    recoveries: Option<&'a [Recovery]>,
    /// Servers spot checks caught returning wrong activations.
    #[serde(skip_serializing_if = "Option::is_none")]
    suspects: Option<&'a [String]>,
    /// Steps that went down the whole route by server-to-server push.
    pushed_steps: usize,
    /// The model that proposed the drafts (prompt lookup where absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_model: Option<&'a str>,
    /// Times the answer was computed again after a server was caught lying
    /// about earlier positions, and the tokens shown then withdrawn.
    rechecks: usize,
    withdrawn: usize,
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let rt = runtime()?;
    let assistant = rt.block_on(open_assistant(&args.blocks))?;
    let prompt_ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::user(args.prompt.clone()));
        assistant.chat_prompt(&messages)?
    } else {
        assistant.tokenizer().encode(&args.prompt)?
    };
    let request = GenerateRequest {
        prompt_ids,
        max_new_tokens: args.max_new_tokens,
        sampling: args.sampling.params(),
        stop_at_eos: !args.ignore_eos,
        drafts: args.sampling.drafts,
    };

    let tokenizer = assistant.tokenizer();
    let mut printer = printer::AnswerPrinter::new(tokenizer);
    let mut print_error = None;
    let on_event = |event| {
        if !args.json {
            if let Err(e) = printer.show(event) {
                print_error = Some(e);
            }
        }
        ControlFlow::Continue(())
    };
    let mut conversation = Conversation::one_shot().with_adapter(args.adapter.clone());
    let answer = rt.block_on(assistant.answer(&mut conversation, &request, on_event))?;
    rt.block_on(conversation.close());
    let Answer {
        output,
        route,
        recoveries,
        suspects,
        pushed_steps,
        ..
    } = answer;
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
            steps: output.steps,
            drafted: output.drafted,
            accepted: output.accepted,
            dtype: format!("{:?}", assistant.dtype()).to_lowercase(),
            recoveries: route.as_ref().map(|_| recoveries.as_slice()),
            suspects: route.as_ref().map(|_| suspects.as_slice()),
            route: route.as_deref(),
            pushed_steps,
            draft_model: assistant.draft_model().map(DraftModel::name),
            rechecks: output.rechecks,
            withdrawn: output.withdrawn,
        };
        writeln!(stdout, "{}", serde_json::to_string(&json)?)?;
    } else {
        writeln!(stdout)?;
        if !suspects.is_empty() {
            eprintln!(
                "spot checks caught {} returning wrong activations; banned, the answer used honest servers",
                suspects.join(", ")
            );
        }
        eprintln!(
            "{} tokens, {:.1} tokens/s ({:?})",
            output.generated_ids.len(),
            output.tokens_per_second(),
            output.stop_reason
        );
    }
    Ok(())
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
    let allowed = parse_peer_list(&args.swarm.allowed_peers).map_err(anyhow::Error::msg)?;
    let node = connect_with(
        &args.swarm.initial_peers,
        allowed,
        &args.swarm.reach_settings(),
    )
    .await?;
    let records = node.discover(&model, args.swarm.discovery_timeout).await?;
    let num_layers = checkpoint
        .as_ref()
        .map(|c| c.config().num_hidden_layers as u32)
        .or_else(|| records.iter().map(|r| r.num_layers).max())
        .unwrap_or(0);
    let rtts = measure_rtts(&node, &records).await;
    let report = SwarmReport::build(&model, num_layers, &records, &rtts_by_peer(rtts));
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}

/// How long `corolla swarm` waits for the round trips to the servers found.
const RTT_WAIT: Duration = Duration::from_secs(3);

/// The last ping round trip from this node to each server of `records`:
/// dials those not connected yet (libp2p pings as soon as a connection is
/// up) and waits until every reachable one has a figure, or [`RTT_WAIT`].
async fn measure_rtts(
    node: &corolla_shared::node::NodeHandle,
    records: &[ServerRecord],
) -> std::collections::HashMap<libp2p::PeerId, Duration> {
    let peers: Vec<(libp2p::PeerId, Vec<Multiaddr>)> = records
        .iter()
        .filter(|r| !r.leaving)
        .filter_map(|r| {
            let peer = r.peer_id.parse().ok()?;
            let addrs = r.addresses.iter().filter_map(|a| a.parse().ok()).collect();
            Some((peer, addrs))
        })
        .collect();
    // Connected peers have been pinged already (or will be shortly).
    let connected = node.peer_rtts().await.unwrap_or_default();
    let connected = &connected;
    let dials = peers.iter().map(|(peer, addrs)| async move {
        if connected.contains_key(peer) {
            return Ok(());
        }
        node.dial(*peer, addrs.clone(), RTT_WAIT).await
    });
    let reached: Vec<libp2p::PeerId> = futures::future::join_all(dials)
        .await
        .into_iter()
        .zip(&peers)
        .filter_map(|(dialed, (peer, _))| match dialed {
            Ok(()) => Some(*peer),
            Err(e) => {
                tracing::debug!(%peer, error = %e, "cannot reach a server to time it");
                None
            }
        })
        .collect();
    let deadline = std::time::Instant::now() + RTT_WAIT;
    loop {
        let rtts = node.peer_rtts().await.unwrap_or_default();
        if reached.iter().all(|p| rtts.contains_key(p)) || std::time::Instant::now() > deadline {
            return rtts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
