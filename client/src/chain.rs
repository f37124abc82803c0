//! A session through remote servers, surviving their failures: the chain
//! keeps every input each span was sent and replays it to replacements.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use corolla_model::fingerprint::span_hash;
use corolla_model::wire::{from_view, to_payload};
use corolla_model::{ClientHead, Device, Tensor};
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::OpenRequest;
use corolla_shared::session::{fetch_info, RemoteSession, SessionError, StepTimeout};
use corolla_shared::{ServerRecord, TensorPayload, WireDType};
use libp2p::PeerId;
use serde::Serialize;
use web_time::Instant;

use crate::error::ClientError;
use crate::generate::{generate, BlockChain, GenerateOutput, GenerateRequest};
use crate::route::{matching_servers, plan_route_between, Hop, RouteCosts};

/// Settings of the sessions a client opens.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    pub model: String,
    /// Hashes of every block of the model the client expects, when it knows them.
    pub expected_blocks: Option<Vec<String>>,
    pub num_layers: usize,
    pub max_length: usize,
    pub dtype: WireDType,
    /// How long one step may take before the server counts as failed.
    pub timeout: Duration,
    /// A tighter deadline for short steps (see [`StepTimeout`]); `None`: `timeout` for all.
    pub step_timeout: Option<StepTimeout>,
    /// How long to look for servers covering the blocks needed.
    pub discovery_timeout: Duration,
    /// Failures survived in one session before giving up.
    pub max_retries: usize,
    /// When set, only these peer ids are used.
    pub allowed_servers: Option<HashSet<String>>,
    /// Peer ids never used.
    pub blocked_servers: HashSet<String>,
    /// Flow control toward this client (see `corolla_shared::flow`): what
    /// browsers on WebRTC need; 0 for none.
    pub flow_window: u32,
}

impl SessionSettings {
    pub fn new(
        model: impl Into<String>,
        num_layers: usize,
        max_length: usize,
        dtype: WireDType,
    ) -> Self {
        SessionSettings {
            model: model.into(),
            expected_blocks: None,
            num_layers,
            max_length,
            dtype,
            timeout: Duration::from_secs(60),
            step_timeout: None,
            discovery_timeout: Duration::from_secs(30),
            max_retries: 8,
            allowed_servers: None,
            blocked_servers: HashSet::new(),
            flow_window: 0,
        }
    }

    fn admits(&self, peer: &str) -> bool {
        !self.blocked_servers.contains(peer)
            && self
                .allowed_servers
                .as_ref()
                .is_none_or(|a| a.contains(peer))
    }
}

/// One failure the chain survived.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    /// The forward call that failed: 0 is the prompt's prefill.
    pub step: usize,
    /// The first position of that call.
    pub position: usize,
    pub failed_peer: String,
    pub error: String,
    /// The blocks whose servers were replaced.
    pub start: usize,
    pub end: usize,
    pub replacement: Vec<Hop>,
    /// From the failure until the replacement had caught up.
    pub seconds: f64,
}

/// One hop of the original route: blocks `start..end`, served now by one
/// or more sessions, with every input it was sent, for replay.
struct HopState {
    start: usize,
    end: usize,
    sessions: Vec<(Hop, RemoteSession)>,
    history: Vec<(u32, TensorPayload)>,
}

async fn run_sessions(
    sessions: &mut [(Hop, RemoteSession)],
    start: u32,
    input: &TensorPayload,
) -> Result<TensorPayload, SessionError> {
    let mut rest = sessions.iter_mut();
    let Some((_, first)) = rest.next() else {
        return Ok(input.clone());
    };
    let mut x = first.step(start, input).await?;
    for (_, s) in rest {
        x = s.step(start, &x).await?;
    }
    Ok(x)
}

/// A block chain whose spans run on remote servers. When a server fails
/// (error, closed stream, timeout), the chain bans it, finds a replacement
/// route for exactly its blocks, replays every input those blocks were sent
/// to rebuild the caches, and goes on; the outputs are the same as without
/// the failure.
pub struct RemoteChain {
    node: NodeHandle,
    settings: SessionSettings,
    device: Device,
    hops: Vec<HopState>,
    costs: RouteCosts,
    /// Peer id -> (failures, banned until).
    bans: HashMap<String, (u32, Instant)>,
    /// The servers the last DHT lookup found: a recovery routes around a
    /// failed server from these first, without waiting on a lookup that may
    /// hang on the dead peer.
    known: Vec<ServerRecord>,
    recoveries: Vec<Recovery>,
    steps: usize,
}

const BAN_BASE: Duration = Duration::from_secs(2);
const BAN_MAX: Duration = Duration::from_secs(300);
/// Candidates whose round trip is measured before routing.
const MAX_PINGED: usize = 16;

impl RemoteChain {
    /// Finds servers for every block and opens a session on each.
    pub async fn connect(
        node: &NodeHandle,
        settings: SessionSettings,
        device: &Device,
    ) -> Result<Self, ClientError> {
        let mut chain = RemoteChain {
            node: node.clone(),
            costs: RouteCosts {
                max_length: settings.max_length,
                ..RouteCosts::default()
            },
            settings,
            device: device.clone(),
            hops: Vec::new(),
            bans: HashMap::new(),
            known: Vec::new(),
            recoveries: Vec::new(),
            steps: 0,
        };
        let num_layers = chain.settings.num_layers;
        let mut attempts = 0;
        loop {
            let route = chain.find_route(0, num_layers).await?;
            match chain.open_all(&route).await {
                Ok(sessions) => {
                    chain.hops = route
                        .into_iter()
                        .zip(sessions)
                        .map(|(hop, session)| HopState {
                            start: hop.start,
                            end: hop.end,
                            sessions: vec![(hop, session)],
                            history: Vec::new(),
                        })
                        .collect();
                    break;
                }
                // A server announced but gone (its entry has not expired yet):
                // route around it.
                Err(ClientError::Session(e)) if attempts < chain.settings.max_retries => {
                    attempts += 1;
                    tracing::debug!(error = %e, "cannot open a session; routing around that server");
                    chain.ban(&e.peer().to_string());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(chain)
    }

    /// The servers in use now, in order.
    pub fn route(&self) -> Vec<Hop> {
        self.hops
            .iter()
            .flat_map(|h| h.sessions.iter().map(|(hop, _)| hop.clone()))
            .collect()
    }

    pub fn recoveries(&self) -> &[Recovery] {
        &self.recoveries
    }

    pub async fn close(self) {
        for hop in self.hops {
            for (_, s) in hop.sessions {
                s.close().await;
            }
        }
    }

    fn banned(&self, peer: &str) -> bool {
        self.bans
            .get(peer)
            .is_some_and(|(_, until)| Instant::now() < *until)
    }

    fn ban(&mut self, peer: &str) {
        let entry = self
            .bans
            .entry(peer.to_string())
            .or_insert((0, Instant::now()));
        entry.0 += 1;
        let backoff = BAN_BASE.saturating_mul(1 << entry.0.min(8)).min(BAN_MAX);
        entry.1 = Instant::now() + backoff;
    }

    /// Looks the model up until servers cover `from..to` (or the discovery
    /// time is up) and picks the fastest chain among them.
    async fn find_route(&mut self, from: usize, to: usize) -> Result<Vec<Hop>, ClientError> {
        let deadline = Instant::now() + self.settings.discovery_timeout;
        let mut from_known = !self.known.is_empty();
        loop {
            let used_known = std::mem::take(&mut from_known);
            let found = if used_known {
                self.known.clone()
            } else {
                let found = self
                    .node
                    .discover(&self.settings.model, Duration::from_secs(5))
                    .await
                    .unwrap_or_default();
                self.known = found.clone();
                found
            };
            let mut records = matching_servers(found, self.settings.expected_blocks.as_deref());
            records.retain(|r| self.settings.admits(&r.peer_id) && !self.banned(&r.peer_id));
            self.measure_rtts(&records).await;
            match plan_route_between(&records, from, to, &self.costs) {
                Ok(route) => return Ok(route),
                Err(e) if Instant::now() >= deadline => return Err(e),
                // The known servers did not do: look them up now.
                Err(_) if used_known => {}
                Err(_) => corolla_shared::node::sleep(Duration::from_millis(300)).await,
            }
        }
    }

    /// Pings (over the info protocol) up to [`MAX_PINGED`] candidates, and
    /// folds the round trips into the moving averages.
    async fn measure_rtts(&mut self, records: &[ServerRecord]) {
        let node = &self.node;
        let pings = records.iter().take(MAX_PINGED).filter_map(|r| {
            let peer: PeerId = r.peer_id.parse().ok()?;
            let mut control = node.control();
            Some(async move {
                let started = Instant::now();
                let ok = fetch_info(&mut control, peer, Duration::from_secs(2))
                    .await
                    .is_ok();
                (
                    peer.to_string(),
                    ok.then(|| started.elapsed().as_secs_f64()),
                )
            })
        });
        for (peer, rtt) in futures::future::join_all(pings).await {
            match rtt {
                Some(rtt) => self.costs.record_rtt(&peer, rtt),
                None => self.costs.record_rtt(&peer, 1.0),
            }
        }
    }

    // `&mut self`: a shared borrow held across an await would need the chain to be Sync.
    async fn open(&mut self, hop: &Hop) -> Result<RemoteSession, ClientError> {
        let peer: PeerId = hop
            .peer_id
            .parse()
            .map_err(|_| ClientError::Network(format!("bad peer id {}", hop.peer_id)))?;
        let request = OpenRequest {
            model: self.settings.model.clone(),
            fingerprint: self
                .settings
                .expected_blocks
                .as_ref()
                .and_then(|h| h.get(hop.start..hop.end))
                .map(span_hash)
                .unwrap_or_default(),
            start: hop.start as u32,
            end: hop.end as u32,
            max_length: self.settings.max_length as u32,
            dtype: self.settings.dtype,
            flow_window: self.settings.flow_window,
        };
        let mut control = self.node.control();
        Ok(
            RemoteSession::open(&mut control, peer, request, self.settings.timeout)
                .await?
                .with_step_timeout(self.settings.step_timeout),
        )
    }

    /// Replaces the servers of hop `index` after `error`, replaying its history.
    async fn recover(
        &mut self,
        index: usize,
        error: &SessionError,
        position: usize,
    ) -> Result<(), ClientError> {
        let started = Instant::now();
        let failed = error.peer().to_string();
        tracing::warn!(peer = %failed, %error, "server failed; finding a replacement");
        self.ban(&failed);
        let (from, to) = (self.hops[index].start, self.hops[index].end);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let route = self.find_route(from, to).await?;
            match self.rebuild(index, &route).await {
                Ok(sessions) => {
                    let old = std::mem::replace(&mut self.hops[index].sessions, sessions);
                    for (_, s) in old {
                        drop(s);
                    }
                    self.recoveries.push(Recovery {
                        step: self.steps,
                        position,
                        failed_peer: failed,
                        error: error.to_string(),
                        start: from,
                        end: to,
                        replacement: route,
                        seconds: started.elapsed().as_secs_f64(),
                    });
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "replacement failed too");
                    if let ClientError::Session(se) = &e {
                        let peer = se.peer().to_string();
                        self.ban(&peer);
                    }
                    if attempts > self.settings.max_retries {
                        return Err(e);
                    }
                }
            }
        }
    }

    async fn open_all(&mut self, route: &[Hop]) -> Result<Vec<RemoteSession>, ClientError> {
        let mut sessions = Vec::with_capacity(route.len());
        for hop in route {
            match self.open(hop).await {
                Ok(s) => sessions.push(s),
                Err(e) => {
                    for s in sessions {
                        s.close().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(sessions)
    }

    /// Opens sessions along `route` and replays hop `index`'s history through them.
    async fn rebuild(
        &mut self,
        index: usize,
        route: &[Hop],
    ) -> Result<Vec<(Hop, RemoteSession)>, ClientError> {
        let mut sessions: Vec<(Hop, RemoteSession)> = route
            .iter()
            .cloned()
            .zip(self.open_all(route).await?)
            .collect();
        let history = std::mem::take(&mut self.hops[index].history);
        let mut replayed = Ok(());
        for (start, input) in &history {
            if let Err(e) = run_sessions(&mut sessions, *start, input).await {
                replayed = Err(e);
                break;
            }
        }
        self.hops[index].history = history;
        replayed?;
        Ok(sessions)
    }
}

impl BlockChain for RemoteChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let mut payload = to_payload(&hidden, self.settings.dtype)?;
        let mut failures = 0;
        for index in 0..self.hops.len() {
            loop {
                match run_sessions(&mut self.hops[index].sessions, start as u32, &payload).await {
                    Ok(out) => {
                        let input = std::mem::replace(&mut payload, out);
                        self.hops[index].history.push((start as u32, input));
                        break;
                    }
                    Err(e) => {
                        failures += 1;
                        if failures > self.settings.max_retries {
                            return Err(e.into());
                        }
                        self.recover(index, &e, start).await?;
                    }
                }
            }
        }
        self.steps += 1;
        Ok(from_view(&payload.view(), &self.device)?)
    }
}

/// One answer generated through the swarm, with the route that finished it
/// and the failures it survived (known even when the answer failed).
pub struct RemoteAnswer {
    pub output: Result<GenerateOutput, ClientError>,
    pub route: Vec<Hop>,
    pub recoveries: Vec<Recovery>,
}

/// Opens a chain through the swarm for `request`, generates, and closes the
/// sessions: what the CLI and the browser client do for each answer.
pub async fn generate_remote(
    node: &NodeHandle,
    settings: SessionSettings,
    head: &ClientHead,
    request: &GenerateRequest,
    on_token: impl FnMut(u32) -> std::ops::ControlFlow<()>,
) -> Result<RemoteAnswer, ClientError> {
    let mut chain = RemoteChain::connect(node, settings, head.device()).await?;
    let output = generate(head, &mut chain, request, on_token).await;
    // After recoveries, the servers that finished the answer.
    let route = chain.route();
    let recoveries = chain.recoveries().to_vec();
    chain.close().await;
    Ok(RemoteAnswer {
        output,
        route,
        recoveries,
    })
}
