//! A session through remote servers, surviving their failures and their
//! lies: the chain keeps every input each span was sent and replays it to
//! replacements, refuses impossible outputs, and spot-checks sampled steps
//! against an independent witness (`crate::spot_check`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use corolla_model::wire::{from_view, to_payload};
use corolla_model::{Device, Tensor};
use corolla_shared::node::{NodeHandle, Via};
use corolla_shared::protocol::{OpenRequest, PushTarget, StepHeader};
use corolla_shared::session::{RemoteSession, SessionError};
use corolla_shared::{ErrorKind, TensorPayload};
use libp2p::PeerId;
use serde::Serialize;
use web_time::Instant;

use crate::error::ClientError;
use crate::generate::BlockChain;
use crate::route::Hop;
use crate::session_settings::SessionSettings;
use crate::spot_check::{agree_within, tolerance_on_the_wire, Schedule, Witness, WitnessError};
use crate::swarm_view::SwarmView;

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
    /// Spot checks' independent computation of these blocks, and how many
    /// entries of `history` it has been fed.
    witness: Option<(Witness, usize)>,
}

impl HopState {
    fn new(hop: Hop, session: RemoteSession) -> Self {
        HopState {
            start: hop.start,
            end: hop.end,
            sessions: vec![(hop, session)],
            history: Vec::new(),
            witness: None,
        }
    }

    fn peers(&self) -> Vec<String> {
        self.sessions
            .iter()
            .map(|(h, _)| h.peer_id.clone())
            .collect()
    }
}

/// Runs `input` through `sessions` in turn; one-position steps are timed
/// into `view`, which routes by what the client measured.
async fn run_sessions(
    view: &SwarmView,
    sessions: &mut [(Hop, RemoteSession)],
    start: u32,
    input: &TensorPayload,
) -> Result<TensorPayload, SessionError> {
    let decode = input.shape.get(1) == Some(&1);
    let mut x = input.clone();
    for (hop, s) in sessions.iter_mut() {
        let started = Instant::now();
        x = s.step(start, &x).await?;
        if decode {
            view.record_step(
                &hop.peer_id,
                started.elapsed().as_secs_f64(),
                hop.end - hop.start,
            );
        }
    }
    Ok(x)
}

/// Where a pushed step stopped before the route's end.
enum PushStop {
    /// Hop `.0` failed (its server erred, closed, or timed out).
    Failed(usize, SessionError),
    /// The server before hop `.0` could not push to it: the client goes on
    /// from there itself.
    NotPushed(usize),
}

/// What a new witness is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Witness,
    ThirdOpinion,
}

/// The first of `peers` as a peer id (they came from parsed records).
fn first_peer(peers: &[String]) -> PeerId {
    peers
        .first()
        .and_then(|p| p.parse().ok())
        .unwrap_or(PeerId::random())
}

/// What a failed session says, without the peer's name (the caller adds it).
fn failure_reason(e: &SessionError) -> String {
    match e {
        SessionError::Remote { message, .. } => message.clone(),
        other => other.to_string(),
    }
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
    /// Servers spot checks caught returning wrong activations.
    suspects: Vec<String>,
    schedule: Schedule,
    steps: usize,
    /// Steps that went down the whole route by push.
    pushed_steps: usize,
    last_step_at: Instant,
    /// How each server was reached when its session was opened.
    via: HashMap<String, Via>,
}

/// How long opening a session on a server reached only through a relay
/// waits for a hole punch: a direct connection saves a relay hop on every
/// step for the rest of the session.
const HOLE_PUNCH_WAIT: Duration = Duration::from_secs(5);

/// After this long without a step, a failing server may only have expired
/// the session: it is reopened and replayed before anyone is banned.
const IDLE_BEFORE_EXPIRY_SUSPECTED: Duration = Duration::from_secs(20);

/// Witnesses (and third opinions) asked for one check before giving up:
/// servers that fail are replaced by others, then by the client's own
/// blocks where it has them.
const WITNESS_TRIES: usize = 3;

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
        let schedule = Schedule::new(settings.spot_check);
        let mut chain = RemoteChain {
            view: view.clone(),
            settings,
            device: device.clone(),
            hops: Vec::new(),
            recoveries: Vec::new(),
            suspects: Vec::new(),
            schedule,
            via: HashMap::new(),
            steps: 0,
            pushed_steps: 0,
            last_step_at: Instant::now(),
        };
        let num_layers = chain.settings.num_layers;
        let mut attempts = 0;
        // Servers whose connection broke under an Open once: tried again
        // before being banned (a fresh connection can be closed while the
        // node settles, and a lone server would otherwise end the answer).
        let mut reconnected = std::collections::HashSet::new();
        loop {
            let route = chain.find_route(0, num_layers).await?;
            match chain.open_all(&route).await {
                Ok(sessions) => {
                    chain.hops = route
                        .into_iter()
                        .zip(sessions)
                        .map(|(hop, session)| HopState::new(hop, session))
                        .collect();
                    break;
                }
                Err(ClientError::Session(SessionError::Io { peer, source }))
                    if reconnected.insert(peer) =>
                {
                    tracing::debug!(%peer, error = %source, "a connection broke under an Open; trying again");
                    corolla_shared::time::sleep(Duration::from_millis(100)).await;
                }
                // A server announced but gone (its entry has not expired yet):
                // route around it.
                Err(ClientError::Session(e)) if attempts < chain.settings.max_retries => {
                    attempts += 1;
                    tracing::debug!(error = %e, "cannot open a session; routing around that server");
                    chain
                        .view
                        .ban_for(&e.peer().to_string(), e.kind(), &failure_reason(&e));
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
            .flat_map(|h| {
                h.sessions.iter().map(|(hop, _)| Hop {
                    via: self.via.get(&hop.peer_id).copied(),
                    ..hop.clone()
                })
            })
            .collect()
    }

    pub fn recoveries(&self) -> &[Recovery] {
        &self.recoveries
    }

    /// The recoveries so far, leaving none behind (one answer's worth).
    pub fn take_recoveries(&mut self) -> Vec<Recovery> {
        std::mem::take(&mut self.recoveries)
    }

    /// Steps that went down the whole route by push so far, leaving none behind.
    pub fn take_pushed_steps(&mut self) -> usize {
        std::mem::take(&mut self.pushed_steps)
    }

    /// Servers caught by spot checks so far, leaving none behind.
    pub fn take_suspects(&mut self) -> Vec<String> {
        std::mem::take(&mut self.suspects)
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
            // The witness saw the cut entry whole; later steps overwrite it.
            if let Some((_, fed)) = &mut hop.witness {
                *fed = (*fed).min(hop.history.len());
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
                run_sessions(&self.view, &mut hop.sessions, *start, input).await?;
                if let Some((witness, _)) = &mut hop.witness {
                    if witness.step(*start, input).await.is_err() {
                        hop.witness = None;
                    }
                }
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
            if let Some((witness, _)) = hop.witness {
                witness.close().await;
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
            fingerprint: self.view.span_hash(hop),
            start: hop.start as u32,
            end: hop.end as u32,
            max_length: self.settings.max_length as u32,
            dtype: self.settings.dtype,
            compression: self.settings.compression,
            flow_window: self.settings.flow_window,
        };
        // A failure here is the session's to report, with its own error.
        if let Ok(via) = self.view.node().prefer_direct(peer, HOLE_PUNCH_WAIT).await {
            tracing::debug!(%peer, ?via, "connected");
            self.via.insert(hop.peer_id.clone(), via);
        }
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
        self.view
            .ban_for(&failed, error.kind(), &failure_reason(error));
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
                        self.view
                            .ban_for(&se.peer().to_string(), se.kind(), &failure_reason(se));
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
            if let Err(e) = run_sessions(&self.view, &mut sessions, *start, input).await {
                replayed = Err(e);
                break;
            }
        }
        self.hops[index].history = history;
        replayed?;
        Ok(sessions)
    }

    /// Whether the next step can go by push: asked for, more than one hop,
    /// and each hop on one server (a hop split by a recovery goes through
    /// the client).
    fn can_push(&self) -> bool {
        self.settings.push && self.hops.len() > 1 && self.hops.iter().all(|h| h.sessions.len() == 1)
    }

    /// Sends one step down the whole route by push and reads every hop's
    /// output from its session as it comes. Returns the outputs of the
    /// hops that answered, in order, and where it stopped short, if it did.
    async fn forward_pushed(
        &mut self,
        start: u32,
        input: &TensorPayload,
    ) -> (Vec<TensorPayload>, Option<PushStop>) {
        let step_id = self
            .hops
            .iter()
            .map(|h| h.sessions[0].1.next_step_id())
            .max()
            .unwrap_or(1);
        let push = self.hops[1..]
            .iter()
            .map(|h| PushTarget {
                peer: h.sessions[0].1.peer(),
                token: h.sessions[0].1.token(),
            })
            .collect();
        for hop in &mut self.hops {
            hop.sessions[0].1.expect_step(step_id);
        }
        let header = StepHeader {
            start_position: start,
            step_id,
            push,
        };
        let decode = input.shape.get(1) == Some(&1);
        let mut outputs = Vec::with_capacity(self.hops.len());
        let mut last = Instant::now();
        if let Err(e) = self.hops[0].sessions[0].1.send_step(&header, input).await {
            return (outputs, Some(PushStop::Failed(0, e)));
        }
        let hops = self.hops.len();
        for index in 0..hops {
            let (hop, session) = &mut self.hops[index].sessions[0];
            match session.receive_output(step_id, input).await {
                Ok((out, pushed)) => {
                    if decode {
                        // From the previous output to this one: one link and
                        // this hop's compute, what routing compares.
                        self.view.record_step(
                            &hop.peer_id,
                            last.elapsed().as_secs_f64(),
                            hop.end - hop.start,
                        );
                        last = Instant::now();
                    }
                    outputs.push(out);
                    if index + 1 < hops && !pushed {
                        return (outputs, Some(PushStop::NotPushed(index + 1)));
                    }
                }
                Err(e) => return (outputs, Some(PushStop::Failed(index, e))),
            }
        }
        (outputs, None)
    }

    /// Checks `primary`, hop `index`'s output for `input`, against a
    /// witness. Returns the output to go on with; `Err` names a primary
    /// server found lying (the caller replaces it and repeats the step).
    async fn spot_check(
        &mut self,
        index: usize,
        start: u32,
        input: &TensorPayload,
        primary: TensorPayload,
    ) -> Result<TensorPayload, SessionError> {
        let primary_peers = self.hops[index].peers();
        let Some(witnessed) = self
            .witness_output(index, start, input, &primary_peers)
            .await
        else {
            return Ok(primary);
        };
        let tolerance = tolerance_on_the_wire(primary.dtype, self.settings.compression);
        let agree = move |a: &TensorPayload, b: &TensorPayload| agree_within(a, b, tolerance);
        if agree(&primary, &witnessed) {
            return Ok(primary);
        }
        let witness_peers = self.hops[index]
            .witness
            .as_ref()
            .map(|(w, _)| w.peers())
            .unwrap_or_default();
        tracing::warn!(
            primary = ?primary_peers,
            witness = ?witness_peers,
            "spot check: outputs differ; asking a third opinion"
        );
        if witness_peers.is_empty() {
            // The client's own computation needs no second opinion.
            self.suspect(&primary_peers);
            return Err(SessionError::Caught {
                peer: first_peer(&primary_peers),
            });
        }
        let exclude: HashSet<String> = primary_peers
            .iter()
            .chain(&witness_peers)
            .cloned()
            .collect();
        let third = self.third_opinion(index, start, input, &exclude).await;
        let Some(third) = third else {
            // Nobody can tell which of the two lied: both are reported,
            // neither is banned.
            tracing::warn!("spot check undecided: no third opinion to be had");
            self.report(&primary_peers);
            self.report(&witness_peers);
            return Ok(primary);
        };
        match (agree(&third, &primary), agree(&third, &witnessed)) {
            (true, false) => {
                // The witness lied; the next check finds another.
                self.suspect(&witness_peers);
                if let Some((w, _)) = self.hops[index].witness.take() {
                    w.close().await;
                }
                Ok(primary)
            }
            (false, true) => {
                self.suspect(&primary_peers);
                Err(SessionError::Caught {
                    peer: first_peer(&primary_peers),
                })
            }
            _ => {
                tracing::warn!("spot check undecided: three different outputs");
                self.report(&primary_peers);
                self.report(&witness_peers);
                Ok(primary)
            }
        }
    }

    /// Bans `peers`, caught lying, and reports them.
    fn suspect(&mut self, peers: &[String]) {
        for peer in peers {
            self.view.ban_for(
                peer,
                ErrorKind::BadServer,
                "returned wrong activations (spot check)",
            );
        }
        self.report(peers);
    }

    /// Reports `peers` in the answer's suspects.
    fn report(&mut self, peers: &[String]) {
        for peer in peers {
            if !self.suspects.contains(peer) {
                self.suspects.push(peer.clone());
            }
        }
    }

    /// The witness's output for `input`, after feeding it what it has not
    /// seen of the history; a witness is found first when there is none:
    /// other servers of the hop's blocks, else the client's own copy.
    async fn witness_output(
        &mut self,
        index: usize,
        start: u32,
        input: &TensorPayload,
        primary_peers: &[String],
    ) -> Option<TensorPayload> {
        // A recovery may have moved the hop onto the witness's servers.
        if let Some((w, _)) = &self.hops[index].witness {
            if w.peers().iter().any(|p| primary_peers.contains(p)) {
                if let Some((w, _)) = self.hops[index].witness.take() {
                    w.close().await;
                }
            }
        }
        // A witness that fails (a server dying, leaving) is replaced: were
        // the step let through unchecked, a liar could wait for that moment.
        let mut exclude: HashSet<String> = primary_peers.iter().cloned().collect();
        for _ in 0..WITNESS_TRIES {
            if self.hops[index].witness.is_none() {
                let witness = self.new_witness(index, &exclude, Role::Witness).await?;
                self.hops[index].witness = Some((witness, 0));
            }
            let hop = &mut self.hops[index];
            let (witness, fed) = hop.witness.as_mut()?;
            // A caught step was fed but never entered the history.
            let fed_before = (*fed).min(hop.history.len());
            let result = match witness.replay(&hop.history[fed_before..]).await {
                Ok(_) => witness.step(start, input).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(out) => {
                    *fed = hop.history.len() + 1;
                    return Some(out);
                }
                Err(e) => {
                    let failed = witness.peers();
                    match e {
                        WitnessError::Server(e) => tracing::debug!(error = %e, "a witness failed"),
                        WitnessError::Local(e) => {
                            tracing::warn!(error = %e, "the client's own check failed")
                        }
                    }
                    if let Some((w, _)) = hop.witness.take() {
                        w.close().await;
                    }
                    if failed.is_empty() {
                        // The client's own blocks failed: nobody else to ask.
                        return None;
                    }
                    exclude.extend(failed);
                }
            }
        }
        None
    }

    /// A witness for hop `index` that uses none of `exclude`: other servers
    /// (when the view has them), else the client's own copy of the blocks:
    /// always as a third opinion, as the witness only when every step is
    /// checked (a local witness computes everything the hop computes).
    async fn new_witness(
        &mut self,
        index: usize,
        exclude: &HashSet<String>,
        role: Role,
    ) -> Option<Witness> {
        let (from, to) = (self.hops[index].start, self.hops[index].end);
        if let Some(route) = self
            .view
            .plan_excluding(from, to, self.settings.max_length, exclude)
        {
            match self.open_all(&route).await {
                Ok(sessions) => {
                    return Some(Witness::Servers(route.into_iter().zip(sessions).collect()))
                }
                Err(e) => tracing::debug!(error = %e, "cannot open a witness"),
            }
        }
        if role == Role::Witness && self.settings.spot_check < 1.0 {
            return None;
        }
        let referee = self.settings.referee.as_ref()?;
        match Witness::local(referee, (from, to), self.settings.max_length) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot check servers with the client's own blocks");
                None
            }
        }
    }

    /// A third computation of `input` on hop `index`, from scratch.
    async fn third_opinion(
        &mut self,
        index: usize,
        start: u32,
        input: &TensorPayload,
        exclude: &HashSet<String>,
    ) -> Option<TensorPayload> {
        let mut exclude = exclude.clone();
        for _ in 0..WITNESS_TRIES {
            let mut third = self
                .new_witness(index, &exclude, Role::ThirdOpinion)
                .await?;
            let history = std::mem::take(&mut self.hops[index].history);
            let out = match third.replay(&history).await {
                Ok(_) => third.step(start, input).await.ok(),
                Err(_) => None,
            };
            self.hops[index].history = history;
            let asked = third.peers();
            third.close().await;
            if out.is_some() || asked.is_empty() {
                return out;
            }
            // That server failed (not lied): ask another, at last the
            // client's own blocks.
            exclude.extend(asked);
        }
        None
    }
}

impl BlockChain for RemoteChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let mut payload = to_payload(&hidden, self.settings.dtype)?;
        let mut failures = 0;
        let mut after_pause = self.last_step_at.elapsed() > IDLE_BEFORE_EXPIRY_SUSPECTED;
        // By push first: the hops that answered are taken in order (spot
        // checks as usual); from the first that did not, the client carries
        // the step on itself, with the usual recovery.
        let mut first = 0;
        let mut pending: Option<SessionError> = None;
        if self.can_push() {
            let (outputs, stop) = self.forward_pushed(start as u32, &payload).await;
            let answered = outputs.len();
            if stop.is_none() {
                self.pushed_steps += 1;
            }
            for out in outputs {
                let out = if self.schedule.check_now() {
                    match self.spot_check(first, start as u32, &payload, out).await {
                        Ok(out) => out,
                        Err(e) => {
                            pending = Some(e);
                            break;
                        }
                    }
                } else {
                    out
                };
                let input = std::mem::replace(&mut payload, out);
                self.hops[first].history.push((start as u32, input));
                first += 1;
            }
            match stop {
                Some(PushStop::Failed(index, e)) if pending.is_none() && index == answered => {
                    tracing::debug!(error = %e, hop = index, "a pushed step failed; the client goes on");
                    pending = Some(e);
                }
                Some(PushStop::NotPushed(index)) => {
                    tracing::debug!(
                        hop = index,
                        "a server could not push; the client carries the step on"
                    );
                }
                _ => {}
            }
        }
        for index in first..self.hops.len() {
            loop {
                let outcome = match pending.take() {
                    Some(e) => Err(e),
                    None => match run_sessions(
                        &self.view,
                        &mut self.hops[index].sessions,
                        start as u32,
                        &payload,
                    )
                    .await
                    {
                        Ok(out) if self.schedule.check_now() => {
                            self.spot_check(index, start as u32, &payload, out).await
                        }
                        other => other,
                    },
                };
                match outcome {
                    Ok(out) => {
                        let input = std::mem::replace(&mut payload, out);
                        self.hops[index].history.push((start as u32, input));
                        break;
                    }
                    Err(e) => {
                        let caught = matches!(e, SessionError::Caught { .. });
                        if std::mem::take(&mut after_pause)
                            && !caught
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
        // The wire may be narrower than the compute dtype (f16 by default).
        let out = from_view(&payload.view(), &self.device)?;
        Ok(out
            .to_dtype(hidden.dtype())
            .map_err(corolla_model::ModelError::from)?)
    }

    fn rewind(&mut self, len: usize) {
        RemoteChain::rewind(self, len);
    }
}
