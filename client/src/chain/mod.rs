//! A session through remote servers, surviving their failures and their
//! lies: the chain keeps every input each span was sent and replays it to
//! replacements, refuses impossible outputs, and spot-checks sampled steps
//! against an independent witness (`crate::spot_check`).
//!
//! One file per concern, each adding methods to [`RemoteChain`]: `hop`
//! (a hop's sessions and history), `recovery` (reopening and replacing
//! servers, replaying), `push` (steps servers push to each other), `audit`
//! (spot checks, witnesses, third opinions).

mod audit;
mod hop;
mod push;
mod recovery;
mod slow;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use corolla_model::wire::{from_view, to_payload};
use corolla_model::{Device, Tensor};
use corolla_shared::node::{NodeHandle, Via};
use corolla_shared::protocol::OpenRequest;
use corolla_shared::session::{RemoteSession, SessionError};
use corolla_shared::TensorPayload;
use libp2p::PeerId;
use web_time::Instant;

pub use recovery::Recovery;

use crate::error::ClientError;
use crate::generate::BlockChain;
use crate::route::Hop;
use crate::session_settings::SessionSettings;
use crate::spot_check::Schedule;
use crate::swarm_view::SwarmView;
use hop::{run_sessions, HopState};
use recovery::failure_reason;

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
    /// The route's output of each step, as `(start, output)`: the last
    /// hop's counterpart of the next hop's history, for re-checks.
    returned: Vec<(u32, TensorPayload)>,
    /// The first position found computed from a server's lies, not yet
    /// taken by the generate loop (`BlockChain::take_tainted`).
    tainted: Option<usize>,
    recoveries: Vec<Recovery>,
    /// Servers spot checks caught returning wrong activations.
    suspects: Vec<String>,
    /// Servers that failed as witnesses of this chain: not asked again by
    /// it, however short their ban (a crowd of silent copies would be
    /// asked again each time a ban ran out).
    failed_witnesses: HashSet<String>,
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
            returned: Vec::new(),
            tainted: None,
            recoveries: Vec::new(),
            suspects: Vec::new(),
            failed_witnesses: HashSet::new(),
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
            match chain.open_all(&route, None).await {
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

    /// Draws whether to spot-check hop `index`'s output of this step, at
    /// the rate of its least checked server.
    fn check_now(&mut self, index: usize) -> bool {
        let clean = self.hops[index]
            .sessions
            .iter()
            .map(|(hop, _)| self.view.clean_checks(&hop.peer_id))
            .min()
            .unwrap_or(0);
        self.schedule.check_now(clean)
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
            truncate_steps(&mut hop.history, len);
            // The witness saw the cut entry whole; later steps overwrite it.
            if let Some((_, fed)) = &mut hop.witness {
                *fed = (*fed).min(hop.history.len());
            }
        }
        truncate_steps(&mut self.returned, len);
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
        self.view.route(from, to, &self.settings).await
    }

    // `&mut self`: a shared borrow held across an await would need the chain to be Sync.
    /// Opens a session on `hop`'s server that may push to `next`.
    async fn open(
        &mut self,
        hop: &Hop,
        next: Option<PeerId>,
    ) -> Result<RemoteSession, ClientError> {
        let peer = peer_of(hop)?;
        let request = OpenRequest {
            model: self.settings.model.clone(),
            fingerprint: self.view.span_hash(hop),
            start: hop.start as u32,
            end: hop.end as u32,
            max_length: self.settings.max_length as u32,
            dtype: self.settings.dtype,
            compression: self.settings.compression,
            flow_window: self.settings.flow_window,
            next,
            adapter: self.settings.adapter.clone(),
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

    /// Opens a session on each hop of `route`, each allowed to push to the
    /// next, the last to `after` (the server of the blocks after the route).
    async fn open_all(
        &mut self,
        route: &[Hop],
        after: Option<PeerId>,
    ) -> Result<Vec<RemoteSession>, ClientError> {
        let mut sessions = Vec::with_capacity(route.len());
        for (index, hop) in route.iter().enumerate() {
            let this = peer_of(hop)?;
            let next = match route.get(index + 1) {
                Some(next) => Some(peer_of(next)?),
                None => after,
            }
            // A server hosting the next blocks too cannot push to itself;
            // without push none is named (a named one is checked by its
            // server at the Open, a stream to it per session).
            .filter(|next| *next != this && self.settings.push);
            match self.open(hop, next).await {
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
}

/// Drops what `steps` (`(start, rows)` per step) hold of positions `len..`.
fn truncate_steps(steps: &mut Vec<(u32, TensorPayload)>, len: usize) {
    steps.retain(|(start, _)| (*start as usize) < len);
    if let Some((start, rows)) = steps.last_mut() {
        rows.truncate_axis1(len - *start as usize);
    }
}

fn peer_of(hop: &Hop) -> Result<PeerId, ClientError> {
    hop.peer_id
        .parse()
        .map_err(|_| ClientError::Network(format!("bad peer id {}", hop.peer_id)))
}

impl BlockChain for RemoteChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let mut payload = to_payload(&hidden, self.settings.dtype)?;
        let mut failures = 0;
        let mut after_pause = self.last_step_at.elapsed() > IDLE_BEFORE_EXPIRY_SUSPECTED;
        // By push first: the hops that answered are taken in order (spot
        // checks as usual); from the first that did not, the client carries
        // the step on itself, with the usual recovery.
        let pushed = self.forward_by_push(start, &mut payload).await;
        let (mut pending, mut missed) = (pushed.pending, pushed.missed);
        for index in pushed.carry_from..self.hops.len() {
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
                        Ok(out) if self.check_now(index) => {
                            self.spot_check(index, start as u32, &payload, out).await
                        }
                        other => other,
                    },
                };
                match outcome {
                    Ok(out) => {
                        let input = std::mem::replace(&mut payload, out);
                        self.hops[index].history.push((start as u32, input));
                        // The receiver of a push that did not come answered
                        // the step carried to it: the pusher answers for it.
                        if let Some(m) = missed.take_if(|m| m.receiver == index) {
                            self.settle_missed_push(m, start).await;
                        }
                        break;
                    }
                    Err(e) => {
                        // A receiver that fails the client's own step is
                        // recovered as usual; its pusher is not charged.
                        missed.take_if(|m| m.receiver == index);
                        let caught = matches!(
                            e,
                            SessionError::Caught { .. } | SessionError::PushLie { .. }
                        );
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
        self.returned.push((start as u32, payload.clone()));
        self.leave_slow_servers(start).await;
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

    fn take_tainted(&mut self) -> Option<usize> {
        self.tainted.take()
    }
}
