//! Who this client stopped trusting and for how long: bans with backoff,
//! suspicion shared by records of one shape and servers of one host and,
//! while failures are recent, by servers it knows nothing good of; and the
//! clean spot checks that earn a server its place back.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use corolla_shared::source_address::AddressGroup;
use corolla_shared::{ErrorKind, ServerRecord};
use libp2p::PeerId;
use web_time::Instant;

use super::{
    SwarmView, ViewState, BAN_BASE, BAN_MAX, BUSY_COOL_OFF, SUSPECT_PENALTY, UNKNOWN_PENALTY,
};

impl SwarmView {
    /// Lifts the bans of servers that only refused for want of sessions
    /// (after this client released some of its own).
    pub fn forgive_busy(&self) {
        let mut state = self.state();
        let busy: Vec<String> = state
            .last_failure
            .iter()
            .filter(|(_, (kind, _))| *kind == ErrorKind::Busy)
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in busy {
            state.last_failure.remove(&peer);
            state.bans.remove(&peer);
        }
        state.busy_until.clear();
    }

    /// Bans `peer` after `why`, kept for error messages; see [`Self::ban`].
    /// A busy server itself is only passed over for [`BUSY_COOL_OFF`]
    /// (being full is no fault, and a burst's refusals must end with it);
    /// its host and record become suspect as for any failure, so a crowd
    /// of copies refusing as busy still costs one try.
    pub fn ban_for(&self, peer: &str, kind: ErrorKind, why: &str) {
        self.state()
            .last_failure
            .insert(peer.to_string(), (kind, why.to_string()));
        self.pass_over(peer, kind == ErrorKind::Busy);
    }

    /// Bans `peer` with exponential backoff (4 s, 8 s, … at most 5 min) and
    /// refreshes the view in the background: it may have left the swarm.
    /// The host this client reaches it at, and the record it announced,
    /// become suspect for as long (see [`SUSPECT_PENALTY`]).
    pub fn ban(&self, peer: &str) {
        self.pass_over(peer, false);
    }

    fn pass_over(&self, peer: &str, busy: bool) {
        let host = self.host_of(peer);
        {
            let mut state = self.state();
            if busy {
                state
                    .busy_until
                    .insert(peer.to_string(), Instant::now() + BUSY_COOL_OFF);
            } else {
                let lasts = backoff(state.bans.entry(peer.to_string()));
                tracing::debug!(%peer, ?lasts, "server banned");
            }
            if let Some(host) = host {
                backoff(state.failed_hosts.entry(host));
            }
            let shape = state
                .records
                .iter()
                .find(|r| r.peer_id == peer)
                .map(RecordShape::of);
            if let Some(shape) = shape {
                backoff(state.failed_shapes.entry(shape));
            }
        }
        self.refresh_in_background();
    }

    /// When blocks `0..num_layers` that no usable server runs with
    /// `adapter` are run by servers only passed over for being busy (the
    /// swarm is full, not short of blocks): how long until the first of
    /// those is tried again.
    pub fn busy_covers(&self, num_layers: usize, adapter: Option<&str>) -> Option<Duration> {
        let now = Instant::now();
        let state = self.state();
        let next_try = state
            .busy_until
            .values()
            .filter(|until| now < **until)
            .min()?
            .duration_since(now);
        let not_banned: Vec<ServerRecord> = state
            .records
            .iter()
            .filter(|r| {
                self.shared.filter.admits(&r.peer_id)
                    && super::can_dial(r)
                    && state
                        .bans
                        .get(&r.peer_id)
                        .is_none_or(|(_, until)| now >= *until)
                    && adapter.is_none_or(|name| r.adapters.iter().any(|a| a == name))
            })
            .cloned()
            .collect();
        crate::route::uncovered_blocks(&not_banned, num_layers)
            .is_empty()
            .then_some(next_try)
    }

    /// The host `peer` is connected at now, if it is.
    fn host_of(&self, peer: &str) -> Option<AddressGroup> {
        let peer: PeerId = peer.parse().ok()?;
        self.shared.node.sources().of(&peer).map(AddressGroup::host)
    }

    /// Each usable server's penalty, while any failure is recent, for
    /// sharing a host or the record it announced with failed servers, and
    /// for being unknown (see [`UNKNOWN_PENALTY`]).
    pub(super) fn suspicion(&self) -> HashMap<String, f64> {
        let now = Instant::now();
        let (hosts, shapes, known) = {
            let state = self.state();
            (
                still_suspect(&state.failed_hosts, now),
                still_suspect(&state.failed_shapes, now),
                state.known_good(),
            )
        };
        if hosts.is_empty() && shapes.is_empty() {
            return HashMap::new();
        }
        let initial: HashSet<String> = self
            .shared
            .node
            .initial_peers()
            .iter()
            .map(PeerId::to_string)
            .collect();
        self.usable_servers()
            .into_iter()
            .filter_map(|r| {
                let by_host = self
                    .host_of(&r.peer_id)
                    .and_then(|host| hosts.get(&host))
                    .copied()
                    .unwrap_or(0);
                let by_shape = shapes.get(&RecordShape::of(&r)).copied().unwrap_or(0);
                let unknown = !known.contains(&r.peer_id) && !initial.contains(&r.peer_id);
                let penalty = SUSPECT_PENALTY * f64::from(by_host + by_shape)
                    + if unknown { UNKNOWN_PENALTY } else { 0.0 };
                (penalty > 0.0).then_some((r.peer_id, penalty))
            })
            .collect()
    }

    pub fn is_banned(&self, peer: &str) -> bool {
        self.state().banned(peer)
    }

    /// Spot checks `peer`'s output passed so far.
    pub fn clean_checks(&self, peer: &str) -> u32 {
        self.state().clean_checks.get(peer).copied().unwrap_or(0)
    }

    /// Counts a spot check `peer`'s output passed.
    pub fn record_clean_check(&self, peer: &str) {
        let mut state = self.state();
        let count = state.clean_checks.entry(peer.to_string()).or_insert(0);
        *count = count.saturating_add(1);
    }
}

impl ViewState {
    /// Servers this client measured answering steps and never saw fail.
    fn known_good(&self) -> HashSet<String> {
        self.step_per_block
            .keys()
            .filter(|peer| !self.bans.contains_key(*peer))
            .cloned()
            .collect()
    }
}

/// The entries of `failed` still suspect at `now`, with their failures.
fn still_suspect<K: std::hash::Hash + Eq + Clone>(
    failed: &HashMap<K, (u32, Instant)>,
    now: Instant,
) -> HashMap<K, u32> {
    failed
        .iter()
        .filter(|(_, (_, until))| now < *until)
        .map(|(key, (failures, _))| (key.clone(), *failures))
        .collect()
}

/// What a record claims, without who claims it and where: copies of one
/// record (a crowd of fakes copying an honest server's, with a better speed)
/// have one shape, so the first copy's failure demotes them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct RecordShape(u64);

impl RecordShape {
    fn of(r: &ServerRecord) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&r.model, &r.fingerprint, &r.block_hashes, r.start, r.end).hash(&mut h);
        (r.num_layers, r.hidden_size, &r.dtype, &r.version).hash(&mut h);
        (r.throughput.to_bits(), r.prefill_throughput.to_bits()).hash(&mut h);
        // Not the load (sessions, cache left): it changes with every announcement.
        (r.max_length, r.max_sessions).hash(&mut h);
        RecordShape(h.finish())
    }
}

/// Counts one more failure of an entry and extends its end with
/// exponential backoff; returns how long it lasts.
pub(super) fn backoff<K: std::hash::Hash + Eq>(
    entry: std::collections::hash_map::Entry<'_, K, (u32, Instant)>,
) -> Duration {
    let entry = entry.or_insert((0, Instant::now()));
    entry.0 += 1;
    let backoff = BAN_BASE.saturating_mul(1 << entry.0.min(8)).min(BAN_MAX);
    entry.1 = Instant::now() + backoff;
    backoff
}
