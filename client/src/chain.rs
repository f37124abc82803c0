//! A session through remote servers, surviving their failures: the chain
//! keeps every input each span was sent and replays it to replacements.

use std::collections::HashSet;
use std::time::Duration;

use corolla_model::fingerprint::span_hash;
use corolla_model::wire::{from_view, to_payload};
use corolla_model::{Device, Tensor};
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::OpenRequest;
use corolla_shared::session::{RemoteSession, SessionError, StepTimeout};
use corolla_shared::{TensorPayload, WireDType};
use libp2p::PeerId;
use serde::Serialize;
use web_time::Instant;

use crate::error::ClientError;
use crate::generate::BlockChain;
use crate::route::Hop;
use crate::swarm_view::SwarmView;

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

impl Default for SessionSettings {
    /// For [`crate::Assistant::swarm`], which fills in the model's part.
    fn default() -> Self {
        Self::new("", 0, 0, WireDType::F32)
    }
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
/// the failure. A chain can be rewound ([`RemoteChain::rewind`]) and stepped
/// on, which is how a conversation's next turn sends only its new tokens.
pub struct RemoteChain {
    view: SwarmView,
    settings: SessionSettings,
    device: Device,
    hops: Vec<HopState>,
    recoveries: Vec<Recovery>,
    steps: usize,
    last_step_at: Instant,
}

/// After this long without a step, a failing server may only have expired
/// the session: it is reopened and replayed before anyone is banned.
const IDLE_BEFORE_EXPIRY_SUSPECTED: Duration = Duration::from_secs(20);

impl RemoteChain {
    /// Finds servers for every block and opens a session on each, routing
    /// from a view of the swarm of its own.
    pub async fn connect(
        node: &NodeHandle,
        settings: SessionSettings,
        device: &Device,
    ) -> Result<Self, ClientError> {
        let view = SwarmView::new(node.clone(), &settings);
        Self::connect_via(&view, settings, device).await
    }

    /// Finds servers for every block in `view` and opens a session on each.
    pub async fn connect_via(
        view: &SwarmView,
        settings: SessionSettings,
        device: &Device,
    ) -> Result<Self, ClientError> {
        let mut chain = RemoteChain {
            view: view.clone(),
            settings,
            device: device.clone(),
            hops: Vec::new(),
            recoveries: Vec::new(),
            steps: 0,
            last_step_at: Instant::now(),
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
                    chain.view.ban(&e.peer().to_string());
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

    /// The recoveries so far, leaving none behind (one answer's worth).
    pub fn take_recoveries(&mut self) -> Vec<Recovery> {
        std::mem::take(&mut self.recoveries)
    }

    /// Positions the sessions were opened for.
    pub fn capacity(&self) -> usize {
        self.settings.max_length
    }

    /// Forgets positions `len..`: the next step may start at `len`, and
    /// replays onto replacement servers send only what comes before it.
    pub fn rewind(&mut self, len: usize) {
        for hop in &mut self.hops {
            hop.history.retain(|(start, _)| (*start as usize) < len);
            if let Some((start, input)) = hop.history.last_mut() {
                input.truncate_axis1(len - *start as usize);
            }
        }
    }

    /// Sends every hop's last step again, exactly as it was sent (so the
    /// caches are rewritten with the same numbers): servers count it as
    /// activity and keep the sessions of an idle conversation open. A
    /// failure is left for the next answer's recovery.
    pub async fn keep_alive(&mut self) -> Result<(), SessionError> {
        for hop in &mut self.hops {
            if let Some((start, input)) = hop.history.last() {
                run_sessions(&mut hop.sessions, *start, input).await?;
            }
        }
        self.last_step_at = Instant::now();
        Ok(())
    }

    pub async fn close(self) {
        for hop in self.hops {
            for (_, s) in hop.sessions {
                s.close().await;
            }
        }
    }

    // `&mut self` for the same reason as `open`.
    async fn find_route(&mut self, from: usize, to: usize) -> Result<Vec<Hop>, ClientError> {
        let s = &self.settings;
        self.view
            .route(from, to, s.max_length, s.discovery_timeout)
            .await
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
        let mut control = self.view.node().control();
        Ok(
            RemoteSession::open(&mut control, peer, request, self.settings.timeout)
                .await?
                .with_step_timeout(self.settings.step_timeout),
        )
    }

    /// After a pause, reopens hop `index` on the servers it had and replays
    /// its history: servers expire idle sessions, which is no fault of theirs.
    async fn reopen_expired(
        &mut self,
        index: usize,
        error: &SessionError,
        position: usize,
    ) -> bool {
        let started = Instant::now();
        let route: Vec<Hop> = self.hops[index]
            .sessions
            .iter()
            .map(|(hop, _)| hop.clone())
            .collect();
        match self.rebuild(index, &route).await {
            Ok(sessions) => {
                tracing::debug!(%error, "reopened sessions after a pause");
                self.hops[index].sessions = sessions;
                self.recoveries.push(Recovery {
                    step: self.steps,
                    position,
                    failed_peer: error.peer().to_string(),
                    error: error.to_string(),
                    start: self.hops[index].start,
                    end: self.hops[index].end,
                    replacement: route,
                    seconds: started.elapsed().as_secs_f64(),
                });
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "reopening after a pause failed");
                false
            }
        }
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
        self.view.ban(&failed);
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
                        self.view.ban(&se.peer().to_string());
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
        let mut after_pause = self.last_step_at.elapsed() > IDLE_BEFORE_EXPIRY_SUSPECTED;
        for index in 0..self.hops.len() {
            loop {
                match run_sessions(&mut self.hops[index].sessions, start as u32, &payload).await {
                    Ok(out) => {
                        let input = std::mem::replace(&mut payload, out);
                        self.hops[index].history.push((start as u32, input));
                        break;
                    }
                    Err(e) => {
                        if std::mem::take(&mut after_pause)
                            && self.reopen_expired(index, &e, start).await
                        {
                            continue;
                        }
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
        self.last_step_at = Instant::now();
        Ok(from_view(&payload.view(), &self.device)?)
    }
}
