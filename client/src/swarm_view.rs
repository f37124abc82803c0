//! A client's long-lived view of the swarm: the servers of its model and
//! their records, moving averages of their round trips, and the servers it
//! banned with their backoff. Every chain of a client routes from one view,
//! so an answer neither waits for a DHT lookup nor forgets which servers
//! failed; lookups refresh the view in the background and after failures.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use corolla_shared::node::NodeHandle;
use corolla_shared::session::fetch_info;
use corolla_shared::source_address::AddressGroup;
use corolla_shared::{ErrorKind, ServerRecord};
use libp2p::PeerId;
use web_time::Instant;

use corolla_model::fingerprint::{keeps_quantized, span_hash};

use crate::error::ClientError;
use crate::route::{
    announced_seconds, matching_servers, plan_route_between, uncovered_blocks, update_rtt_average,
    Hop, RouteCosts,
};
use crate::session_settings::SessionSettings;

mod bans;
mod dialing;
mod push_faults;
use bans::RecordShape;
pub use dialing::can_dial;
use dialing::unreachable_reason;
pub use push_faults::PushBlame;

/// A lookup older than this is refreshed in the background at the next use.
const REFRESH_PERIOD: Duration = Duration::from_secs(30);
/// How long one DHT lookup may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the info-protocol round trip of one server may take.
const PING_TIMEOUT: Duration = Duration::from_secs(2);
/// Round trip recorded for a server that did not answer the ping.
const UNREACHABLE_RTT: f64 = 1.0;
/// Candidates whose round trip is measured at each lookup.
const MAX_PINGED: usize = 16;
/// The first ban lasts `2 × BAN_BASE`; each further failure doubles it.
const BAN_BASE: Duration = Duration::from_secs(2);
const BAN_MAX: Duration = Duration::from_secs(300);
/// How long a server that refused for want of room is passed over: being
/// full is no fault, so it neither grows with repeats nor makes its host
/// or record suspect, and a burst's refusals end with the burst.
const BUSY_COOL_OFF: Duration = Duration::from_secs(2);
/// Seconds per step added to the cost of servers reached at a host where a
/// server failed, or announcing what a failed server announced, for each
/// such failure while its ban lasts: any other server that is not far
/// slower goes first.
const SUSPECT_PENALTY: f64 = 10.0;
/// Seconds per step added, while any failure is recent, to servers this
/// client knows nothing good of: neither a peer the user named to join
/// through nor one it measured answering without ever failing. Records
/// and hosts are free, so a crowd of fakes each with a record and a
/// network of its own must not outrank, one after another, the servers
/// the client has reason to trust.
const UNKNOWN_PENALTY: f64 = 10.0;

/// Which servers of which model a client uses (from [`SessionSettings`]).
#[derive(Debug, Clone)]
struct Filter {
    model: String,
    expected_blocks: Option<Vec<String>>,
    allowed: Option<HashSet<String>>,
    blocked: HashSet<String>,
}

impl Filter {
    fn admits(&self, peer: &str) -> bool {
        !self.blocked.contains(peer) && self.allowed.as_ref().is_none_or(|a| a.contains(peer))
    }
}

#[derive(Debug, Default)]
struct ViewState {
    /// Servers of the model whose weights match, as the last lookup found them.
    records: Vec<ServerRecord>,
    /// Servers of the same weights that compute with the other quantization.
    other_compute: Vec<ServerRecord>,
    refreshed_at: Option<Instant>,
    /// Moving averages of round trips, in seconds, by peer id.
    rtt: HashMap<String, f64>,
    /// Moving averages of measured decode-step seconds per block, by peer id.
    step_per_block: HashMap<String, f64>,
    /// The last refusal or failure of each server, for error messages.
    last_failure: HashMap<String, (ErrorKind, String)>,
    /// Peer id -> (failures so far, banned until).
    bans: HashMap<String, (u32, Instant)>,
    /// Peer id -> passed over until, after a refusal for want of room.
    busy_until: HashMap<String, Instant>,
    /// Hosts this client reached failed servers at -> (failures, suspect until).
    failed_hosts: HashMap<AddressGroup, (u32, Instant)>,
    /// What failed servers announced ([`RecordShape`]) -> (failures,
    /// suspect until): copies of one record fail alike, wherever they run.
    failed_shapes: HashMap<RecordShape, (u32, Instant)>,
    /// Spot checks each server's output passed, by peer id: a server this
    /// client has seldom checked is checked more often.
    clean_checks: HashMap<String, u32>,
    /// Pushers whose pushes did not reach the next server -> (failures,
    /// not pushed through until): their outputs go through the client.
    push_faults: HashMap<String, (u32, Instant)>,
    /// Receivers -> the pushers whose pushes they did not get, and when.
    push_misses: HashMap<String, Vec<(String, Instant)>>,
    refreshing: bool,
}

impl ViewState {
    fn banned(&self, peer: &str) -> bool {
        let now = Instant::now();
        self.bans.get(peer).is_some_and(|(_, until)| now < *until)
            || self.busy_until.get(peer).is_some_and(|until| now < *until)
    }
}

struct Shared {
    node: NodeHandle,
    filter: Filter,
    state: Mutex<ViewState>,
}

/// Cheap to clone: clones share one view.
#[derive(Clone)]
pub struct SwarmView {
    shared: Arc<Shared>,
}

impl SwarmView {
    /// An empty view of `settings.model`'s servers, as `settings` filters
    /// them (expected block hashes, allowed and blocked servers).
    pub fn new(node: NodeHandle, settings: &SessionSettings) -> Self {
        SwarmView {
            shared: Arc::new(Shared {
                node,
                filter: Filter {
                    model: settings.model.clone(),
                    expected_blocks: settings.expected_blocks.clone(),
                    allowed: settings.allowed_servers.clone(),
                    blocked: settings.blocked_servers.clone(),
                },
                state: Mutex::new(ViewState::default()),
            }),
        }
    }

    pub fn node(&self) -> &NodeHandle {
        &self.shared.node
    }

    pub fn model(&self) -> &str {
        &self.shared.filter.model
    }

    fn state(&self) -> MutexGuard<'_, ViewState> {
        // A panic while the lock was held leaves plain data behind: keep using it.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Looks the model's servers up in the DHT and measures the round trip
    /// of (up to [`MAX_PINGED`] of) those the client may use.
    pub async fn refresh(&self) {
        let filter = &self.shared.filter;
        let found = self
            .shared
            .node
            .discover(&filter.model, LOOKUP_TIMEOUT)
            .await;
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                tracing::debug!(error = %e, "lookup failed; keeping the servers known");
                self.state().refreshing = false;
                return;
            }
        };
        let matched = matching_servers(found, filter.expected_blocks.as_deref());
        let records = matched.chosen;
        let candidates: Vec<ServerRecord> = {
            let state = self.state();
            records
                .iter()
                .filter(|r| filter.admits(&r.peer_id) && can_dial(r) && !state.banned(&r.peer_id))
                .take(MAX_PINGED)
                .cloned()
                .collect()
        };
        let rtts = self.ping(&candidates).await;
        let mut state = self.state();
        for (peer, rtt) in rtts {
            update_rtt_average(&mut state.rtt, &peer, rtt.unwrap_or(UNREACHABLE_RTT));
        }
        tracing::debug!(servers = records.len(), "swarm view refreshed");
        state.records = records;
        state.other_compute = matched.other_compute;
        state.refreshed_at = Some(Instant::now());
        state.refreshing = false;
    }

    async fn ping(&self, records: &[ServerRecord]) -> Vec<(String, Option<f64>)> {
        let pings = records.iter().filter_map(|r| {
            let peer: PeerId = r.peer_id.parse().ok()?;
            let mut control = self.shared.node.control();
            Some(async move {
                let started = Instant::now();
                let ok = fetch_info(&mut control, peer, PING_TIMEOUT).await.is_ok();
                (
                    peer.to_string(),
                    ok.then(|| started.elapsed().as_secs_f64()),
                )
            })
        });
        futures::future::join_all(pings).await
    }

    /// Starts a lookup without waiting for it, unless one is running.
    pub fn refresh_in_background(&self) {
        {
            let mut state = self.state();
            if state.refreshing {
                return;
            }
            state.refreshing = true;
        }
        let view = self.clone();
        spawn(async move { view.refresh().await });
    }

    /// Refreshes in the background when the last lookup is older than
    /// [`REFRESH_PERIOD`]; looks up now when there has been none.
    pub async fn ensure_fresh(&self) {
        let refreshed_at = self.state().refreshed_at;
        match refreshed_at {
            None => self.refresh().await,
            Some(at) if at.elapsed() > REFRESH_PERIOD => self.refresh_in_background(),
            Some(_) => {}
        }
    }

    /// The servers this client may use now: known, admitted, dialable from
    /// here, not banned.
    pub fn usable_servers(&self) -> Vec<ServerRecord> {
        let state = self.state();
        state
            .records
            .iter()
            .filter(|r| {
                self.shared.filter.admits(&r.peer_id) && can_dial(r) && !state.banned(&r.peer_id)
            })
            .cloned()
            .collect()
    }

    /// The longest session (in positions) that usable servers of every block
    /// in `0..num_layers` running `adapter` accept, or `None` while some
    /// block is uncovered.
    pub fn max_session_length(&self, num_layers: usize, adapter: Option<&str>) -> Option<usize> {
        let servers = self.usable_servers_with(adapter);
        (0..num_layers)
            .map(|block| {
                servers
                    .iter()
                    .filter(|r| (r.start as usize..r.end as usize).contains(&block))
                    .map(|r| r.max_length as usize)
                    .max()
            })
            .try_fold(usize::MAX, |min, longest| Some(min.min(longest?)))
    }

    /// Blocks of `0..num_layers` no usable server (running `adapter`, if
    /// one is named) covers.
    pub fn uncovered(&self, num_layers: usize, adapter: Option<&str>) -> Vec<(usize, usize)> {
        uncovered_blocks(&self.usable_servers_with(adapter), num_layers)
    }

    /// The usable servers running `adapter` (all of them for `None`).
    fn usable_servers_with(&self, adapter: Option<&str>) -> Vec<ServerRecord> {
        let mut servers = self.usable_servers();
        if let Some(name) = adapter {
            servers.retain(|r| r.adapters.iter().any(|a| a == name));
        }
        servers
    }

    /// The least-latency chain for blocks `from..to` of servers that run
    /// `session`'s adapter, with room for its `max_length` positions, whose
    /// first step prefills its `prompt_tokens`. Plans from the view first;
    /// when that does not cover the blocks, looks the swarm up again until
    /// its `discovery_timeout` is over.
    pub async fn route(
        &self,
        from: usize,
        to: usize,
        session: &SessionSettings,
    ) -> Result<Vec<Hop>, ClientError> {
        let deadline = Instant::now() + session.discovery_timeout;
        let mut just_refreshed = false;
        // Every server of a block having refused is a final answer only
        // once a fresh lookup found no other.
        let mut looked_up = false;
        if self.state().refreshed_at.is_none() {
            self.refresh().await;
            just_refreshed = true;
            looked_up = true;
        }
        loop {
            let costs = RouteCosts {
                prompt_tokens: session.prompt_tokens,
                ..self.costs(session.max_length)
            };
            match plan_route_between(&self.servers_for(session), from, to, &costs) {
                Ok(route) => return Ok(route),
                Err(e)
                    if Instant::now() >= deadline
                        || looked_up && self.all_refused(from, to, session) =>
                {
                    return Err(self.explain(e, from, to, session))
                }
                // What the view knows does not do: look the swarm up now.
                Err(_) if !just_refreshed => {
                    self.refresh().await;
                    just_refreshed = true;
                    looked_up = true;
                }
                Err(_) => {
                    corolla_shared::time::sleep(Duration::from_millis(300)).await;
                    just_refreshed = false;
                }
            }
        }
    }

    /// A route for `from..to` for `session` from what the view knows now,
    /// using none of `exclude` (spot checks want independent servers).
    pub fn plan_excluding(
        &self,
        from: usize,
        to: usize,
        session: &SessionSettings,
        exclude: &HashSet<String>,
    ) -> Option<Vec<Hop>> {
        let servers: Vec<ServerRecord> = self
            .servers_for(session)
            .into_iter()
            .filter(|r| !exclude.contains(&r.peer_id))
            .collect();
        plan_route_between(&servers, from, to, &self.costs(session.max_length)).ok()
    }

    /// The usable servers that run `session`'s adapter.
    fn servers_for(&self, session: &SessionSettings) -> Vec<ServerRecord> {
        self.usable_servers_with(session.adapter.as_deref())
    }

    /// Adapters usable servers announce, each once, in order.
    pub fn adapters(&self) -> Vec<String> {
        let names: std::collections::BTreeSet<String> = self
            .usable_servers()
            .into_iter()
            .flat_map(|r| r.adapters)
            .collect();
        names.into_iter().collect()
    }

    /// What the router knows now: round trips and measured step times.
    fn costs(&self, max_length: usize) -> RouteCosts {
        let suspicion = self.suspicion();
        let state = self.state();
        RouteCosts {
            suspicion,
            rtt: state.rtt.clone(),
            max_length,
            prompt_tokens: 0,
            measured_step: state.step_per_block.clone(),
        }
    }

    /// What an Open names the weights of `hop` by: the span hash of the
    /// blocks as its server announced them (its quantization included; the
    /// weights already matched the client's), else as the client expects them.
    pub fn span_hash(&self, hop: &Hop) -> String {
        let state = self.state();
        let announced = state
            .records
            .iter()
            .find(|r| r.peer_id == hop.peer_id)
            .and_then(|r| {
                let at = hop.start.checked_sub(r.start as usize)?;
                r.block_hashes.get(at..at + (hop.end - hop.start))
            });
        match announced {
            Some(hashes) => span_hash(hashes),
            None => self
                .shared
                .filter
                .expected_blocks
                .as_ref()
                .and_then(|h| h.get(hop.start..hop.end))
                .map(span_hash)
                .unwrap_or_default(),
        }
    }

    /// Seconds a decode step of `hop`'s blocks takes on its server, as this
    /// client measured it (a moving average), if it did.
    pub fn measured_seconds(&self, hop: &Hop) -> Option<f64> {
        let per_block = *self.state().step_per_block.get(&hop.peer_id)?;
        Some(per_block * (hop.end - hop.start) as f64)
    }

    /// Seconds a decode step of `hop` is expected to take, one link
    /// included: as measured, else as its server announced; without the
    /// penalties route planning adds (a deadline, not a preference).
    pub fn expected_step_seconds(&self, hop: &Hop) -> f64 {
        if let Some(measured) = self.measured_seconds(hop) {
            return measured;
        }
        let state = self.state();
        let rtt = state.rtt.get(&hop.peer_id).copied();
        state
            .records
            .iter()
            .find(|r| r.peer_id == hop.peer_id)
            .map_or(0.0, |r| announced_seconds(r, hop.start, hop.end, rtt))
    }

    /// Seconds a decode step through `route` is expected to take: what
    /// route planning compares (measured, else announced, speeds).
    pub fn expected_seconds(&self, route: &[Hop], max_length: usize) -> f64 {
        let costs = self.costs(max_length);
        let state = self.state();
        route
            .iter()
            .filter_map(|hop| {
                let record = state.records.iter().find(|r| r.peer_id == hop.peer_id)?;
                Some(costs.hop_cost(record, hop.start, hop.end))
            })
            .sum()
    }

    /// Folds a measured decode step of `blocks` blocks on `peer` into its average.
    pub fn record_step(&self, peer: &str, seconds: f64, blocks: usize) {
        let per_block = seconds / blocks.max(1) as f64;
        update_rtt_average(&mut self.state().step_per_block, peer, per_block);
    }

    /// Whether every known server of some block in `from..to` is banned
    /// after a failure: waiting for the lookup's patience would not help.
    fn all_refused(&self, from: usize, to: usize, session: &SessionSettings) -> bool {
        let state = self.state();
        (from..to).any(|block| {
            let mut servers = state
                .records
                .iter()
                .filter(|r| session.served_by(r))
                .filter(|r| (r.start as usize..r.end as usize).contains(&block))
                .peekable();
            servers.peek().is_some()
                && servers.all(|r| {
                    !can_dial(r)
                        || state.banned(&r.peer_id) && state.last_failure.contains_key(&r.peer_id)
                })
        })
    }

    /// `error` with the last refusal of each server that could have served
    /// `from..to`: "busy: 16/16 sessions", "max_length 300 exceeds 256", ….
    fn explain(
        &self,
        error: ClientError,
        from: usize,
        to: usize,
        session: &SessionSettings,
    ) -> ClientError {
        let state = self.state();
        if let (ClientError::NoRoute { .. }, Some(adapter)) = (&error, &session.adapter) {
            // Blocks no known server announces the adapter for, banned or
            // not: those the adapter lacks (a refusal of the adapter's
            // servers is explained below, as any refusal).
            let announcing: Vec<ServerRecord> = state
                .records
                .iter()
                .filter(|r| session.served_by(r))
                .cloned()
                .collect();
            let lacking: Vec<(usize, usize)> = uncovered_blocks(&announcing, to)
                .into_iter()
                .filter(|&(a, b)| b > from && a < to)
                .map(|(a, b)| (a.max(from), b.min(to)))
                .collect();
            if !lacking.is_empty() {
                return ClientError::AdapterNotServed {
                    adapter: adapter.clone(),
                    uncovered: lacking,
                };
            }
        }
        let mut failures: Vec<(ErrorKind, String)> = state
            .records
            .iter()
            .filter(|r| session.served_by(r))
            .filter(|r| (r.start as usize) < to && (r.end as usize) > from)
            .filter_map(|r| {
                let (kind, why) = match state.last_failure.get(&r.peer_id) {
                    Some(failure) => failure.clone(),
                    None if !can_dial(r) => (ErrorKind::Unreachable, unreachable_reason(r)),
                    None => return None,
                };
                let reason = format!("{} (blocks {}..{}): {why}", r.peer_id, r.start, r.end);
                Some((kind, reason))
            })
            .collect();
        failures.sort_by(|a, b| a.1.cmp(&b.1));
        failures.dedup_by(|a, b| a.1 == b.1);
        let cause = main_cause(failures.iter().map(|(kind, _)| *kind));
        let reasons: Vec<String> = failures.into_iter().map(|(_, reason)| reason).collect();
        if let ClientError::NoRoute { uncovered } = &error {
            // Servers of the other quantization hold part of a gap.
            let other_covers = uncovered.iter().any(|&(a, b)| {
                state
                    .other_compute
                    .iter()
                    .any(|r| (r.start as usize) < b && (r.end as usize) > a)
            });
            if other_covers {
                let kept = state
                    .other_compute
                    .iter()
                    .any(|r| r.block_hashes.iter().any(|h| keeps_quantized(h)));
                return ClientError::MixedQuantization {
                    uncovered: uncovered.clone(),
                    others: if kept { "keep" } else { "dequantize" },
                };
            }
        }
        match error {
            ClientError::NoRoute { uncovered } if !reasons.is_empty() => ClientError::Refused {
                uncovered,
                reasons,
                cause,
            },
            other => other,
        }
    }
}

/// What a crowd of failures amounts to: busy when any server was (asking
/// later can help), else the kind most of them had.
fn main_cause(kinds: impl Iterator<Item = ErrorKind>) -> ErrorKind {
    let mut counts: Vec<(ErrorKind, usize)> = Vec::new();
    for kind in kinds {
        if kind == ErrorKind::Busy {
            return ErrorKind::Busy;
        }
        match counts.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => counts.push((kind, 1)),
        }
    }
    // The first of the most frequent, so that the order of servers decides ties.
    let mut best: Option<(ErrorKind, usize)> = None;
    for (kind, n) in counts {
        if best.is_none_or(|(_, most)| n > most) {
            best = Some((kind, n));
        }
    }
    best.map_or(ErrorKind::NoCoverage, |(kind, _)| kind)
}

/// Runs `fut` on the runtime of the platform, without waiting for it.
#[cfg(not(target_arch = "wasm32"))]
fn spawn(fut: impl std::future::Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(fut);
        }
        Err(_) => tracing::debug!("no runtime to refresh the swarm view on"),
    }
}

#[cfg(target_arch = "wasm32")]
fn spawn(fut: impl std::future::Future<Output = ()> + 'static) {
    wasm_bindgen_futures::spawn_local(fut);
}
