//! Starting a server: load the span, join the swarm, listen, announce, and
//! accept sessions until shut down.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use corolla_model::fingerprint::default_model_name;
use corolla_model::{Checkpoint, Device, LlamaConfig, ModelError};
use corolla_shared::addr_file::AddrFile;
use corolla_shared::behaviour::NetworkLimits;
use corolla_shared::node::{Node, NodeEvent, NodeHandle};

use corolla_shared::peers::{parse_peer_list, split_peer};
use corolla_shared::protocol::{ErrorCode, INFERENCE_PROTOCOL, INFO_PROTOCOL};
use corolla_shared::{framing, native, Limits, ServerRecord};
use futures::{AsyncWriteExt, StreamExt};
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use tokio::task::JoinHandle;

use crate::admission::{CacheBudget, Quota};
use crate::compute::ComputeFigures;
use crate::config::{BalanceQuality, DeviceArg, NumBlocks, ServerArgs};
use crate::error::ServerError;
use crate::host::{SpanHost, SpanLoader};
use crate::host_settings::HostSettings;
use crate::hub::ModelSource;
use crate::identity::{load_or_create_certificate, load_or_create_keypair};
use crate::metrics::ServerMetrics;
use crate::placement::choose_blocks;
use crate::push::{accept_pushes, PushInboxes};
use crate::rebalance::Rebalancer;
use crate::refuse::refuse_stream;
use crate::session::serve;

/// How long a leaving server stays reachable after its sessions ended, so
/// that clients between two steps still read why (and not a closed connection).
const GOODBYE_TIME: Duration = Duration::from_secs(2);

/// A server running in this process. Dropping it stops it.
pub struct RunningServer {
    peer_id: PeerId,
    addrs: Vec<Multiaddr>,
    model: String,
    node: NodeHandle,
    tasks: Vec<JoinHandle<()>>,
    /// Moves the blocks; stopped first when the server leaves.
    rebalancer: Option<JoinHandle<()>>,
    http: Option<String>,
    host: Arc<SpanHost>,
    sessions: Arc<Quota>,
    drain_timeout: Duration,
    metrics: ServerMetrics,
}

impl RunningServer {
    /// `http://HOST:PORT` when the server serves HTTP.
    pub fn http_url(&self) -> Option<&str> {
        self.http.as_deref()
    }

    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// Listen addresses, each ending in `/p2p/<peer id>`.
    pub fn addrs(&self) -> &[Multiaddr] {
        &self.addrs
    }

    /// The TCP address: what native peers dial.
    pub fn tcp_addr(&self) -> Option<&Multiaddr> {
        self.addrs.iter().find(|a| {
            a.iter().any(|p| matches!(p, Protocol::Tcp(_)))
                && !a.iter().any(|p| matches!(p, Protocol::Ws(_)))
        })
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// The blocks served now (a rebalancing server moves them).
    pub fn blocks(&self) -> (usize, usize) {
        self.host.blocks()
    }

    /// The announced record of the moment, live figures included.
    pub fn record(&self) -> ServerRecord {
        self.host.record()
    }

    pub fn node(&self) -> &NodeHandle {
        &self.node
    }

    /// The series `/metrics` serves.
    pub fn metrics(&self) -> &ServerMetrics {
        &self.metrics
    }

    /// What the compute core has done so far (decode batches, prefill chunks).
    pub fn compute_figures(&self) -> ComputeFigures {
        self.host
            .ctx()
            .map(|ctx| ctx.core.stats().figures())
            .unwrap_or_default()
    }

    /// Stops listening, announcing and serving at once, as a crash would.
    pub fn shutdown(mut self) {
        self.abort();
    }

    /// Leaves gracefully: new sessions are refused, running steps finish
    /// and then every open session gets an error frame saying the server
    /// is leaving (its client replays elsewhere at once), the DHT gets a
    /// signed last record saying so and loses the provider entry; it stops
    /// once every session has ended, or after `--drain-timeout`.
    pub async fn leave(mut self) {
        if let Some(r) = self.rebalancer.take() {
            r.abort();
        }
        let hosted = self.host.put_down();
        if let Some(h) = &hosted {
            h.tell_sessions_to_leave();
        }
        let started = tokio::time::Instant::now();
        if let Err(e) = self.node.leave().await {
            tracing::debug!(error = %e, "could not tell the DHT");
        }
        let deadline = started + self.drain_timeout;
        let left = self.sessions.drained_by(deadline).await;
        if left > 0 {
            tracing::warn!(
                sessions = left,
                "drain timeout: stopping with sessions open"
            );
        }
        // The goodbye frames are written; clients between steps read them
        // when they next write.
        let room = deadline.saturating_duration_since(tokio::time::Instant::now());
        tokio::time::sleep(GOODBYE_TIME.min(room)).await;
        self.abort();
    }

    fn abort(&mut self) {
        for t in self.tasks.drain(..).chain(self.rebalancer.take()) {
            t.abort();
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.abort();
    }
}

fn ip_proto(ip: IpAddr) -> Protocol<'static> {
    match ip {
        IpAddr::V4(ip) => Protocol::Ip4(ip),
        IpAddr::V6(ip) => Protocol::Ip6(ip),
    }
}

/// `--num-blocks auto`: the blocks that fit in `--memory-limit` (default:
/// the memory available now) with the KV cache they need.
fn auto_block_count(
    args: &ServerArgs,
    config: &LlamaConfig,
    device: &Device,
) -> Result<usize, ServerError> {
    let limit =
        match (args.memory_limit, device.is_cpu()) {
            (Some(limit), _) => limit,
            (None, true) => crate::memory::available_bytes().ok_or_else(|| {
                ServerError::Config(
                    "cannot read the available memory: pass --memory-limit or --num-blocks".into(),
                )
            })?,
            (None, false) => return Err(ServerError::Config(
                "--num-blocks auto on a GPU needs --memory-limit (the VRAM this server may use)"
                    .into(),
            )),
        };
    let dtype_bytes = args.dtype.resolve(config, device).size_in_bytes();
    let max_length = args
        .inference_max_length
        .min(config.max_position_embeddings);
    let cache_tokens = args
        .cache_tokens
        .unwrap_or((args.max_sessions as u64).saturating_mul(max_length as u64));
    let block_bytes = config.block_parameters().saturating_mul(dtype_bytes as u64);
    let n = crate::memory::blocks_that_fit(
        limit,
        block_bytes,
        cache_tokens,
        config.cache_bytes_per_token_per_block(dtype_bytes),
        config.num_hidden_layers,
    );
    tracing::info!(
        blocks = n,
        limit_mib = limit >> 20,
        block_mib = block_bytes >> 20,
        "--num-blocks auto"
    );
    Ok(n)
}

pub struct Server;

impl Server {
    pub async fn start(args: ServerArgs) -> Result<RunningServer, ServerError> {
        match crate::http_guard::raise_open_file_limit() {
            Some(n) => tracing::debug!(open_files = n, "open-file limit"),
            None => tracing::debug!("cannot read the open-file limit"),
        }
        if args.new_swarm != args.initial_peers.is_empty() {
            return Err(ServerError::Config(
                "pass --new-swarm to start a swarm, or --initial-peers to join one".into(),
            ));
        }
        let initial_peers = args
            .initial_peers
            .iter()
            .map(split_peer)
            .collect::<Result<Vec<_>, _>>()?;
        if args.max_sessions == 0 || args.inference_max_length == 0 {
            return Err(ServerError::Config(
                "--max-sessions and --inference-max-length must be positive".into(),
            ));
        }
        let device = match args.device {
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Cuda => cuda_device()?,
        };
        let source = {
            let model = args.model.clone();
            Arc::new(
                tokio::task::spawn_blocking(move || ModelSource::resolve(&model))
                    .await
                    .map_err(|e| ServerError::Config(e.to_string()))??,
            )
        };
        let checkpoint =
            Arc::new(Checkpoint::open(source.dir())?.with_quantized_weights(args.quantized));
        let config = checkpoint.config().clone();
        let num_layers = config.num_hidden_layers;
        let model = args
            .model_name
            .clone()
            .or_else(|| source.default_name(&checkpoint))
            .unwrap_or_else(|| default_model_name(&checkpoint));

        let keypair = load_or_create_keypair(args.identity.as_deref(), args.allow_shared_identity)?;
        let allowed_peers = parse_peer_list(&args.allowed_peers).map_err(ServerError::Config)?;
        let certificate =
            load_or_create_certificate(args.identity.as_deref(), args.allow_shared_identity)?;
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(Arc::new(crate::tls::TlsIdentity::load(cert, key)?)),
            _ => None,
        };
        let transports = native::ServerTransports {
            webrtc: certificate,
            websocket_tls: tls.as_ref().map(|t| t.websocket()).transpose()?,
        };
        let limits = NetworkLimits {
            max_per_peer: args.max_connections_per_peer.max(1),
            max_established: args.max_connections.max(1),
            ..NetworkLimits::server()
        }
        .with_allowed_peers(allowed_peers.clone());
        // libp2p's byte counts per transport go into the registry `/metrics` serves.
        let mut registry = native::MetricsRegistry::default();
        let swarm = native::build_swarm(
            keypair.clone(),
            args.update_period,
            &limits,
            Some(transports),
            &args.reach_settings(),
            Some(&mut registry),
        )
        .await
        .map_err(|e| ServerError::Network(e.to_string()))?;
        let (mut node, handle, mut events) = Node::new(swarm);
        node.record_metrics(&mut registry);
        let metrics = ServerMetrics::new(registry);
        node.serve_dht(args.public_name.clone(), keypair);
        node.allow_only(allowed_peers);
        node.prefer_relays(initial_peers.iter().map(|(peer, _)| *peer));
        let peer_id = handle.peer_id();

        let ip = ip_proto(args.host);
        let other_port = if args.port == 0 {
            0
        } else {
            args.port.saturating_add(1)
        };
        let tcp: Multiaddr = Multiaddr::empty()
            .with(ip.clone())
            .with(Protocol::Tcp(args.port));
        let listeners = [
            (tcp.clone(), true),
            (
                Multiaddr::empty()
                    .with(ip.clone())
                    .with(Protocol::Udp(args.port))
                    .with(Protocol::QuicV1),
                false,
            ),
            (
                Multiaddr::empty()
                    .with(ip.clone())
                    .with(Protocol::Tcp(other_port))
                    .with(Protocol::Ws("/".into())),
                false,
            ),
            (
                Multiaddr::empty()
                    .with(ip.clone())
                    .with(Protocol::Udp(other_port))
                    .with(Protocol::WebRTCDirect),
                false,
            ),
        ];
        let wss_port = if args.port == 0 {
            0
        } else {
            args.port.saturating_add(2)
        };
        let wss = tls.is_some().then(|| {
            (
                Multiaddr::empty()
                    .with(ip)
                    .with(Protocol::Tcp(wss_port))
                    .with(Protocol::Tls)
                    .with(Protocol::Ws("/".into())),
                true,
            )
        });
        let mut pending = HashSet::new();
        for (addr, required) in listeners.into_iter().chain(wss) {
            match node.swarm_mut().listen_on(addr.clone()) {
                Ok(id) => {
                    pending.insert(id);
                }
                Err(e) if required => {
                    return Err(ServerError::Listen {
                        addr,
                        message: e.to_string(),
                    })
                }
                Err(e) => tracing::warn!(%addr, error = %e, "listener not started"),
            }
        }
        for (peer, addr) in &initial_peers {
            node.swarm_mut()
                .behaviour_mut()
                .kad
                .add_address(peer, addr.clone());
            node.swarm_mut().add_peer_address(*peer, addr.clone());
            if let Err(e) = node.swarm_mut().dial(*peer) {
                tracing::warn!(%peer, error = %e, "cannot dial an initial peer");
            }
        }
        if !initial_peers.is_empty() {
            let _ = node.swarm_mut().behaviour_mut().kad.bootstrap();
        }
        let mut tasks = vec![tokio::spawn(node.run())];

        let mut addrs = Vec::new();
        let deadline = tokio::time::sleep(Duration::from_secs(10));
        tokio::pin!(deadline);
        while !pending.is_empty() {
            tokio::select! {
                event = events.next() => match event {
                    Some(NodeEvent::Listening { listener_id, address }) => {
                        pending.remove(&listener_id);
                        addrs.push(address.with_p2p(peer_id).unwrap_or_else(|a| a));
                    }
                    Some(NodeEvent::ListenFailed { listener_id, error }) => {
                        pending.remove(&listener_id);
                        tracing::warn!(%error, "a listener failed; that transport is unavailable");
                    }
                    None => return Err(ServerError::Network("the network loop stopped".into())),
                },
                _ = &mut deadline => {
                    tracing::warn!("some listeners did not report an address in time");
                    break;
                }
            }
        }
        if !addrs
            .iter()
            .any(|a| a.iter().any(|p| matches!(p, Protocol::Tcp(_))))
        {
            return Err(ServerError::Listen {
                addr: tcp,
                message: "no TCP address".into(),
            });
        }

        let (start, end) = match (args.block_indices, args.num_blocks) {
            (Some(r), None) => (r.start, r.end),
            (Some(_), Some(_)) => {
                return Err(ServerError::Config(
                    "pass --block-indices A:B or --num-blocks N|auto, not both".into(),
                ))
            }
            (None, n) => {
                let n = match n.unwrap_or(NumBlocks::Auto) {
                    NumBlocks::Count(n) => n,
                    NumBlocks::Auto => auto_block_count(&args, &config, &device)?,
                };
                let existing = if initial_peers.is_empty() {
                    Vec::new()
                } else {
                    handle
                        .discover(&model, Duration::from_secs(5))
                        .await
                        .unwrap_or_default()
                };
                choose_blocks(num_layers, n, &existing)
            }
        };
        if end > num_layers {
            return Err(ModelError::LayerRange {
                start,
                end,
                num_layers,
            }
            .into());
        }
        tracing::info!(%model, start, end, "loading blocks");
        let loader = SpanLoader {
            checkpoint: checkpoint.clone(),
            source: source.clone(),
            dtype: args.dtype.resolve(&config, &device),
            device: device.clone(),
            step_delay: Duration::from_millis(args.step_delay_ms),
        };
        let loaded = loader.load(start, end).await?;

        // No session is longer than the model's positions, whatever the flag says.
        let max_length = args
            .inference_max_length
            .min(config.max_position_embeddings);
        let rebalances =
            args.block_indices.is_none() && args.balance_quality != BalanceQuality::Off;
        let template = ServerRecord {
            peer_id: peer_id.to_string(),
            model: model.clone(),
            fingerprint: String::new(),
            block_hashes: Vec::new(),
            start: 0,
            end: 0,
            num_layers: num_layers as u32,
            hidden_size: config.hidden_size as u32,
            throughput: 0.0,
            prefill_throughput: 0.0,
            cache_tokens_left: 0,
            max_length: u32::try_from(max_length).unwrap_or(u32::MAX),
            sessions: 0,
            max_sessions: args.max_sessions as u32,
            dtype: String::new(),
            version: env!("CARGO_PKG_VERSION").into(),
            addresses: addrs.iter().map(ToString::to_string).collect(),
            published_at_ms: 0,
            leaving: false,
            rebalances,
            reachability: Default::default(),
        };
        let per_peer = args
            .max_sessions_per_peer
            .unwrap_or(args.max_sessions / 4)
            .max(1);
        let cache_bytes_per_token = loaded.span.cache_bytes_per_token();
        let cache_tokens = match args.cache_tokens {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => crate::memory::default_cache_tokens(
                args.max_sessions,
                max_length,
                cache_bytes_per_token,
                crate::memory::available_bytes(),
            ),
        };
        tracing::info!(
            cache_tokens,
            mib = (cache_tokens as u64).saturating_mul(cache_bytes_per_token as u64) >> 20,
            "KV-cache budget"
        );
        let sessions = Quota::new(per_peer, args.max_sessions);
        let settings = Arc::new(HostSettings {
            template,
            // No step can carry more than max_length positions of f32 hidden
            // states; frames are bounded by that before any buffer grows.
            limits: Limits {
                max_tensor_bytes: (max_length as u64)
                    .saturating_mul(config.hidden_size as u64)
                    .saturating_mul(4),
                ..Limits::DEFAULT
            },
            max_length,
            idle_timeout: args.session_timeout,
            step_delay: Duration::from_millis(args.step_delay_ms),
            sessions: sessions.clone(),
            cache: CacheBudget::new(cache_tokens),
            corrupt_outputs: args.corrupt_outputs,
            compute: args.compute_settings(),
            update_period: args.update_period,
            pushes: Arc::new(PushInboxes::default()),
            control: handle.control(),
            metrics: metrics.clone(),
        });
        metrics.watch(settings.sessions.clone(), settings.cache.clone());
        if args.corrupt_outputs > 0.0 {
            tracing::warn!(
                rate = args.corrupt_outputs,
                "--corrupt-outputs: this server returns wrong activations on purpose (a testing aid)"
            );
        }
        let hosted = settings.host(loaded)?;
        let announcement = settings.announcement(&hosted);
        let host = SpanHost::new(hosted);
        // Streams not yet holding a session cost a little each: a few more
        // than a peer's sessions, a few more than all sessions in total.
        let streams = Quota::new(per_peer + 2, args.max_sessions.saturating_mul(2) + 8);
        tasks.push(accept_sessions(
            &handle,
            host.clone(),
            streams.clone(),
            metrics.clone(),
        )?);
        tasks.push(accept_pushes(
            &mut handle.control(),
            settings.pushes.clone(),
            settings.limits,
            args.session_timeout,
            streams,
            metrics.clone(),
        )?);
        tasks.push(accept_info(&handle, host.clone())?);
        tasks.push(tokio::spawn(watch_relay_circuits(
            handle.clone(),
            metrics.clone(),
        )));
        let http = match crate::http::start(
            &args,
            checkpoint.clone(),
            source,
            &model,
            host.clone(),
            tls,
            &addrs,
            handle.clone(),
            metrics.clone(),
        )
        .await?
        {
            Some((url, task)) => {
                tasks.push(task);
                Some(url)
            }
            None => None,
        };
        handle
            .announce(Some(announcement))
            .await
            .map_err(|e| ServerError::Network(e.to_string()))?;
        let rebalancer = match args.balance_quality {
            BalanceQuality::Gain(quality) if rebalances => Some(tokio::spawn(
                Rebalancer {
                    node: handle.clone(),
                    host: host.clone(),
                    settings,
                    loader,
                    sessions: sessions.clone(),
                    num_layers,
                    period: args.update_period,
                    quality,
                    drain_timeout: args.drain_timeout,
                }
                .run(),
            )),
            _ => None,
        };

        if let Some(path) = &args.addr_file {
            AddrFile {
                peer_id: peer_id.to_string(),
                addrs: addrs.iter().map(ToString::to_string).collect(),
                model: model.clone(),
                start,
                end,
                http: http.clone(),
            }
            .write(path)?;
        }
        Ok(RunningServer {
            peer_id,
            addrs,
            model,
            node: handle,
            tasks,
            rebalancer,
            http,
            host,
            sessions,
            drain_timeout: args.drain_timeout,
            metrics,
        })
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Device, ServerError> {
    Device::new_cuda(0).map_err(|e| ServerError::Config(format!("no usable CUDA device: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Device, ServerError> {
    Err(ServerError::Config(
        "this build has no CUDA support; rebuild corolla-server with --features cuda".into(),
    ))
}

fn accept_sessions(
    handle: &NodeHandle,
    host: Arc<SpanHost>,
    streams: Arc<Quota>,
    metrics: ServerMetrics,
) -> Result<JoinHandle<()>, ServerError> {
    let mut incoming = handle
        .control()
        .accept(INFERENCE_PROTOCOL)
        .map_err(|e| ServerError::Network(e.to_string()))?;
    Ok(tokio::spawn(async move {
        // Sessions live in this set, so aborting the acceptor ends them all.
        let mut sessions = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                next = incoming.next() => match next {
                    Some((peer, stream)) => match (host.ctx(), streams.try_take(peer)) {
                        (Some(ctx), Ok(slot)) => {
                            sessions.spawn(serve(stream, peer, ctx, slot));
                        }
                        (None, _) => {
                            let message = "this server is changing its blocks or leaving; continue elsewhere";
                            sessions.spawn(refuse_stream(stream, peer, ErrorCode::ShuttingDown, message.into(), metrics.clone()));
                        }
                        (Some(_), Err(refusal)) => {
                            sessions.spawn(refuse_stream(stream, peer, ErrorCode::Busy, refusal.stream_message(), metrics.clone()));
                        }
                    },
                    None => break,
                },
                Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
            }
        }
    }))
}

/// Keeps `corolla_relay_circuits` current: the node counts the circuits,
/// the gauge shows the latest count.
async fn watch_relay_circuits(node: NodeHandle, metrics: ServerMetrics) {
    let mut tick = tokio::time::interval(RELAY_GAUGE_PERIOD);
    loop {
        tick.tick().await;
        match node.reach().await {
            Ok(report) => metrics.set_relay_circuits(report.relay_circuits),
            Err(_) => break,
        }
    }
}

/// How stale `corolla_relay_circuits` may be.
const RELAY_GAUGE_PERIOD: Duration = Duration::from_secs(2);

fn accept_info(handle: &NodeHandle, host: Arc<SpanHost>) -> Result<JoinHandle<()>, ServerError> {
    let mut incoming = handle
        .control()
        .accept(INFO_PROTOCOL)
        .map_err(|e| ServerError::Network(e.to_string()))?;
    Ok(tokio::spawn(async move {
        while let Some((_peer, mut stream)) = incoming.next().await {
            let bytes = host.record().to_bytes();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(10), async {
                    let _ = framing::write_frame(&mut stream, &bytes).await;
                    let _ = stream.close().await;
                })
                .await;
            });
        }
    }))
}

/// The `corolla-server` binary's body.
pub fn run_cli() -> anyhow::Result<()> {
    let args = match ServerArgs::from_env() {
        Ok(args) => args,
        Err(crate::config::ArgsError::Flags(e)) => e.exit(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libp2p=warn,webrtc=error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let server = Server::start(args).await?;
        tracing::info!(
            peer_id = %server.peer_id(),
            model = server.model(),
            blocks = ?server.blocks(),
            "ready; serving until Ctrl-C or SIGTERM"
        );
        for addr in server.addrs() {
            println!("{addr}");
        }
        stop_signal().await?;
        tracing::info!("leaving the swarm");
        server.leave().await;
        Ok(())
    })
}

/// Ctrl-C, or (on Unix) SIGTERM as service managers send it.
async fn stop_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}
