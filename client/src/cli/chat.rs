//! `corolla chat` and `corolla demo`: a multi-turn conversation in the
//! terminal, tokens streamed as they come, Ctrl-C stopping an answer; the
//! demo first starts a local swarm of `corolla-server` processes.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use corolla_model::{ModelDType, QuantizedWeights};
use corolla_shared::addr_file::AddrFile;
use libp2p::Multiaddr;
use tokio::sync::{mpsc, Notify};

use super::args::{open_assistant, runtime, BlocksArgs, ModelArgs, SamplingArgs, SwarmArgs};
use super::printer::AnswerPrinter;
use crate::assistant::{Answer, Assistant, Conversation};
use crate::chat::ChatMessage;
use crate::generate::{GenerateRequest, StopReason};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    blocks: BlocksArgs,
    #[command(flatten)]
    chat: ChatOptions,
}

#[derive(Args, Debug, Clone)]
struct ChatOptions {
    /// A system prompt opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Longest answer, in tokens.
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Answer with this LoRA adapter, which the swarm's servers announce
    /// (`corolla swarm` lists them); only servers running it are used.
    #[arg(long, value_parser = super::args::parse_adapter_name)]
    adapter: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// A model folder or GGUF file instead of the default SmolLM2-135M-Instruct.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Servers in the local swarm; the blocks are split evenly between them.
    #[arg(long, default_value_t = 3)]
    servers: usize,
    /// Quantized (GGUF) weights, for the servers and the client alike.
    #[arg(long, default_value = "auto")]
    quantized: QuantizedWeights,
    /// Ask this one question, print the answer and stop, instead of chatting.
    #[arg(long)]
    prompt: Option<String>,
    /// The built web chat (trunk's `dist` folder); `./dist` when it exists.
    #[arg(long, env = "COROLLA_WEB_DIR")]
    web_dir: Option<PathBuf>,
    /// The web chat's HTTP port on 127.0.0.1 (0: any free port).
    #[arg(long, default_value_t = 8080)]
    http_port: u16,
    #[command(flatten)]
    chat: ChatOptions,
}

pub fn run_chat(args: ChatArgs) -> Result<()> {
    let rt = runtime()?;
    let assistant = rt.block_on(open_assistant(&args.blocks))?;
    let signals = Signals::install(&rt);
    print_ready(&assistant);
    chat_loop(&rt, &signals, &assistant, &args.chat, None).map(drop)
}

fn print_ready(assistant: &Assistant) {
    if std::io::stdin().is_terminal() {
        eprintln!("Type a message and press Enter. Ctrl-C stops an answer; Ctrl-D (or Ctrl-C at the prompt) quits.");
    }
    tracing::debug!(template = assistant.template().kind, "chat template");
}

/// Ctrl-C stops an answer, or quits at the prompt; SIGTERM and SIGHUP stop
/// everything. Either way the loop returns, so the demo's servers are stopped.
struct Signals {
    generating: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    quit: Arc<Notify>,
    terminated: Arc<AtomicBool>,
}

impl Signals {
    fn install(rt: &tokio::runtime::Runtime) -> Self {
        let signals = Signals {
            generating: Arc::new(AtomicBool::new(false)),
            stop: Arc::new(AtomicBool::new(false)),
            quit: Arc::new(Notify::new()),
            terminated: Arc::new(AtomicBool::new(false)),
        };
        let _guard = rt.enter();
        let (generating, stop, quit, terminated) = (
            signals.generating.clone(),
            signals.stop.clone(),
            signals.quit.clone(),
            signals.terminated.clone(),
        );
        tokio::spawn(async move {
            while tokio::signal::ctrl_c().await.is_ok() {
                if generating.load(Ordering::SeqCst) {
                    stop.store(true, Ordering::SeqCst);
                } else {
                    terminated.store(true, Ordering::SeqCst);
                    quit.notify_one();
                }
            }
        });
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let (stop, quit, terminated) = (
                signals.stop.clone(),
                signals.quit.clone(),
                signals.terminated.clone(),
            );
            if let (Ok(mut term), Ok(mut hup)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::hangup()),
            ) {
                tokio::spawn(async move {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = hup.recv() => {}
                    }
                    terminated.store(true, Ordering::SeqCst);
                    stop.store(true, Ordering::SeqCst);
                    quit.notify_one();
                });
            }
        }
        signals
    }

    fn terminated(&self) -> bool {
        self.terminated.load(Ordering::SeqCst)
    }
}

/// While a chat waits for its next message, its sessions are kept open this
/// often, for at most `KEEP_ALIVE_FOR` after the last answer.
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(60);
const KEEP_ALIVE_FOR: Duration = Duration::from_secs(30 * 60);

/// What the chat loop reads: lines from stdin, their end, or a quit request.
enum Input {
    Line(String),
    End,
    Quit,
}

/// Why a chat ended.
#[derive(Debug, PartialEq, Eq)]
enum ChatEnd {
    /// Standard input ended (or the single message was answered).
    InputEnded,
    /// Ctrl-C at the prompt, SIGTERM or SIGHUP.
    Quit,
}

/// Runs the conversation until end of input or Ctrl-C at the prompt; with
/// `single`, answers that one message and returns.
fn chat_loop(
    rt: &tokio::runtime::Runtime,
    signals: &Signals,
    assistant: &Assistant,
    opts: &ChatOptions,
    single: Option<String>,
) -> Result<ChatEnd> {
    let interactive = single.is_none() && std::io::stdin().is_terminal();
    let (lines_tx, mut lines_rx) = mpsc::channel::<String>(1);
    match single {
        Some(line) => {
            let _ = lines_tx.try_send(line);
            drop(lines_tx);
        }
        None => {
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    if lines_tx.blocking_send(line).is_err() {
                        break;
                    }
                }
            });
        }
    }
    let Signals {
        generating,
        stop,
        quit,
        terminated,
    } = signals;
    rt.block_on(async {
        // One conversation for the whole chat: each turn sends only its new tokens.
        let mut conversation = Conversation::new().with_adapter(opts.adapter.clone());
        let mut last_answer = Instant::now();
        let mut messages: Vec<ChatMessage> = opts
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s.clone()))
            .collect();
        loop {
            if interactive {
                eprint!("> ");
                let _ = std::io::stderr().flush();
            }
            let input = loop {
                let idle = last_answer.elapsed();
                let keep_alive = conversation.is_open() && idle < KEEP_ALIVE_FOR;
                tokio::select! {
                    line = lines_rx.recv() => break line.map_or(Input::End, Input::Line),
                    _ = quit.notified() => break Input::Quit,
                    // While the user types, keep the servers' sessions open.
                    _ = tokio::time::sleep(KEEP_ALIVE_EVERY), if keep_alive => {
                        conversation.keep_alive().await;
                    }
                }
            };
            let line = match input {
                Input::Quit | Input::End if interactive => {
                    eprintln!();
                    return Ok(ChatEnd::Quit);
                }
                Input::Quit => return Ok(ChatEnd::Quit),
                Input::End => return Ok(ChatEnd::InputEnded),
                Input::Line(line) => line.trim().to_string(),
            };
            if line.is_empty() {
                continue;
            }
            if terminated.load(Ordering::SeqCst) {
                return Ok(ChatEnd::Quit);
            }
            messages.push(ChatMessage::user(line));
            let prompt_ids = match fit_prompt(assistant, &mut messages, opts.max_new_tokens) {
                Ok(ids) => ids,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    messages.pop();
                    continue;
                }
            };
            let request = GenerateRequest {
                prompt_ids,
                max_new_tokens: opts.max_new_tokens,
                sampling: opts.sampling.params(),
                stop_at_eos: true,
                drafts: opts.sampling.drafts,
            };
            stop.store(false, Ordering::SeqCst);
            generating.store(true, Ordering::SeqCst);
            let answer = stream_answer(assistant, &mut conversation, &request, stop).await;
            last_answer = Instant::now();
            generating.store(false, Ordering::SeqCst);
            match answer {
                Ok((text, answer)) => {
                    report(&answer);
                    messages.push(ChatMessage::assistant(text.trim().to_string()));
                }
                Err(e) => {
                    eprintln!("\nerror: {e:#}");
                    messages.pop();
                }
            }
        }
    })
}

/// The prompt ids for `messages`, dropping the oldest turns (never the
/// system prompt or the newest message) until the answer fits the model.
fn fit_prompt(
    assistant: &Assistant,
    messages: &mut Vec<ChatMessage>,
    max_new_tokens: usize,
) -> Result<Vec<u32>> {
    let max = assistant.max_positions();
    loop {
        let ids = assistant.chat_prompt(messages)?;
        if ids.len() + max_new_tokens <= max {
            return Ok(ids);
        }
        let first = usize::from(messages.first().is_some_and(|m| m.role == "system"));
        if messages.len() - first <= 1 {
            bail!(
                "the message takes {} tokens; with {max_new_tokens} for the answer that exceeds the model's {max}",
                ids.len()
            );
        }
        messages.remove(first);
    }
}

async fn stream_answer(
    assistant: &Assistant,
    conversation: &mut Conversation,
    request: &GenerateRequest,
    stop: &AtomicBool,
) -> Result<(String, Answer)> {
    let mut printer = AnswerPrinter::new(assistant.tokenizer());
    let mut print_error = None;
    let answer = assistant
        .answer(conversation, request, |event| {
            if stop.load(Ordering::SeqCst) {
                return ControlFlow::Break(());
            }
            if let Err(e) = printer.show(event) {
                print_error = Some(e);
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        })
        .await?;
    if let Some(e) = print_error {
        return Err(e.into());
    }
    let text = printer.text().to_owned();
    println!();
    Ok((text, answer))
}

fn report(answer: &Answer) {
    let out = &answer.output;
    let mut line = format!(
        "[{} tokens, {:.1} tokens/s",
        out.generated_ids.len(),
        out.tokens_per_second()
    );
    if let Some(route) = &answer.route {
        let hops: Vec<String> = route
            .iter()
            .map(|h| {
                let id = h.peer_id.to_string();
                let short = &id[id.len().saturating_sub(6)..];
                format!("…{short} {}..{}", h.start, h.end)
            })
            .collect();
        line.push_str(&format!(", servers: {}", hops.join(", ")));
        if !answer.recoveries.is_empty() {
            line.push_str(&format!(
                ", {} server(s) lost and replaced",
                answer.recoveries.len()
            ));
        }
    }
    if out.stop_reason == StopReason::Cancelled {
        line.push_str(", stopped");
    }
    eprintln!("{line}]");
}

/// `corolla-server` processes of the demo, stopped when dropped.
struct LocalSwarm {
    children: Vec<Child>,
    dir: PathBuf,
}

impl Drop for LocalSwarm {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What the first server of the demo serves over HTTP.
struct WebOptions {
    port: u16,
    dir: Option<PathBuf>,
}

/// The `corolla-server` binary: beside this one, else on the PATH.
fn server_binary() -> PathBuf {
    let name = format!("corolla-server{}", std::env::consts::EXE_SUFFIX);
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(&name)))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Splits `num_layers` into `parts` contiguous spans as even as possible.
fn even_spans(num_layers: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.clamp(1, num_layers.max(1));
    (0..parts)
        .map(|i| (i * num_layers / parts, (i + 1) * num_layers / parts))
        .collect()
}

impl LocalSwarm {
    fn start(
        model: &Path,
        num_layers: usize,
        servers: usize,
        quantized: &str,
        web: &WebOptions,
        signals: &Signals,
    ) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("corolla-demo-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let mut swarm = LocalSwarm {
            children: Vec::new(),
            dir,
        };
        let binary = server_binary();
        let spans = even_spans(num_layers, servers);
        for (i, (start, end)) in spans.iter().enumerate() {
            eprintln!(
                "starting server {}/{} (blocks {start}..{end})...",
                i + 1,
                spans.len()
            );
            let addr_file = swarm.dir.join(format!("server-{i}.json"));
            let log = swarm.dir.join(format!("server-{i}.log"));
            let mut cmd = Command::new(&binary);
            cmd.arg("--model")
                .arg(model)
                .args(["--block-indices", &format!("{start}:{end}")])
                .args(["--host", "127.0.0.1", "--port", "0"])
                .args(["--quantized", quantized])
                .arg("--addr-file")
                .arg(&addr_file)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?);
            if i == 0 {
                cmd.arg("--new-swarm")
                    .args(["--http-port", &web.port.to_string()]);
                if let Some(dir) = &web.dir {
                    cmd.arg("--web-dir").arg(dir);
                }
            } else {
                cmd.args(["--initial-peers", &swarm.bootstrap()?.to_string()]);
            }
            // Their own process group: Ctrl-C stops an answer, not the servers.
            #[cfg(unix)]
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            // And if the demo dies without cleaning up (SIGKILL, a crash), so do they.
            #[cfg(target_os = "linux")]
            // SAFETY: prctl is async-signal-safe, as a pre_exec hook must be.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd
                .spawn()
                .with_context(|| format!("cannot start {}", binary.display()))?;
            swarm.children.push(child);
            swarm.wait_for_addr_file(&addr_file, &log, signals)?;
        }
        Ok(swarm)
    }

    fn wait_for_addr_file(&mut self, path: &Path, log: &Path, signals: &Signals) -> Result<()> {
        let started = Instant::now();
        loop {
            if path.is_file() {
                return Ok(());
            }
            if signals.terminated() {
                bail!("interrupted while starting the servers");
            }
            let child = self
                .children
                .last_mut()
                .ok_or_else(|| anyhow!("no server"))?;
            if let Some(status) = child.try_wait()? {
                let log = std::fs::read_to_string(log).unwrap_or_default();
                bail!("a server exited ({status}) while starting:\n{log}");
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("a server did not start within 10 minutes");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn first_server(&self) -> Result<AddrFile> {
        Ok(AddrFile::read(&self.dir.join("server-0.json"))?)
    }

    fn bootstrap(&self) -> Result<Multiaddr> {
        self.first_server()?
            .tcp_addr()
            .ok_or_else(|| anyhow!("the first server announced no TCP address"))
    }
}

pub fn run_demo(args: DemoArgs) -> Result<()> {
    let model = ModelArgs {
        model: args.model.clone(),
        dtype: ModelDType::Auto,
        quantized: args.quantized,
    };
    let path = model.path()?;
    let num_layers = super::args::open_checkpoint(&path)?
        .config()
        .num_hidden_layers;
    let quantized = args.quantized.as_str();
    let rt = runtime()?;
    let signals = Signals::install(&rt);
    let web = WebOptions {
        port: args.http_port,
        dir: args
            .web_dir
            .clone()
            .or_else(|| Some(PathBuf::from("dist")).filter(|d| d.join("index.html").is_file())),
    };
    let swarm = LocalSwarm::start(&path, num_layers, args.servers, quantized, &web, &signals)?;
    let bootstrap = swarm.bootstrap()?;
    eprintln!("local swarm ready; bootstrap address {bootstrap}");
    // With --prompt the demo ends after one answer: no page to point at.
    let page = match (swarm.first_server()?.http, &web.dir) {
        (Some(url), Some(_)) if args.prompt.is_none() => {
            eprintln!("web chat: {url}/  (open it in a browser)");
            Some(url)
        }
        (Some(url), None) if args.prompt.is_none() => {
            eprintln!(
                "no web page to serve (build it with scripts/demo.sh, or pass --web-dir); the model and status are at {url}/api/status"
            );
            None
        }
        _ => None,
    };
    let swarm_args = SwarmArgs {
        initial_peers: vec![bootstrap],
        model_name: None,
        discovery_timeout: Duration::from_secs(60),
        step_timeout: Duration::from_secs(120),
        max_retries: 8,
        allowed_servers: Vec::new(),
        blocked_servers: Vec::new(),
        allowed_peers: Vec::new(),
        spot_check: 0.05,
        wire_dtype: None,
        wire_compression: corolla_shared::Compression::None,
        no_push: false,
        no_hole_punch: false,
    };
    let model = ModelArgs {
        model: Some(path),
        ..model
    };
    let assistant = rt.block_on(open_assistant(&BlocksArgs {
        model,
        local: false,
        draft_model: None,
        swarm: swarm_args,
    }))?;
    if args.prompt.is_none() {
        print_ready(&assistant);
    }
    let single = args.prompt.is_some();
    let result = chat_loop(&rt, &signals, &assistant, &args.chat, args.prompt.clone());
    if let (Ok(ChatEnd::InputEnded), Some(url), false) = (&result, &page, single) {
        // Started without a terminal (or its input closed): the page is the chat.
        eprintln!("standard input is closed; the web chat stays up at {url}/ until Ctrl-C");
        rt.block_on(signals.quit.notified());
    }
    drop(swarm);
    result.map(drop)
}

#[cfg(test)]
mod tests {
    use super::even_spans;

    #[test]
    fn spans_split_evenly_and_cover_all_blocks() {
        assert_eq!(even_spans(30, 3), vec![(0, 10), (10, 20), (20, 30)]);
        assert_eq!(even_spans(4, 3), vec![(0, 1), (1, 2), (2, 4)]);
        assert_eq!(even_spans(2, 5), vec![(0, 1), (1, 2)]);
    }
}
