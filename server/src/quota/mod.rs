//! Who may hold the server's session and stream slots. Peer ids are free,
//! so a cap per id alone limits nothing, and an attacker may rent hundreds
//! of addresses: slots are shared between source regions, networks and
//! hosts ([`AddressGroup`], widest first), and a slot is kept by making
//! progress, not by holding on. When every slot is taken, a newcomer gets
//! one by evicting, in this order (`victim.rs`):
//! 1. a holder that made no progress (an opened session, a computed step)
//!    for [`STALE_AFTER`];
//! 2. one of the group holding the most slots, when the newcomer's group
//!    holds less than its share (`corolla_shared::fair_share`: the slots
//!    over the groups competing, so the share shrinks as more compete);
//! 3. a holder idle for [`RECLAIM_AFTER`] while the newcomer waits: a crowd
//!    that keeps its sessions with a step now and then gives them up to
//!    anyone who asks, one per newcomer, while clients mid-answer (a step
//!    every few milliseconds to a second) keep theirs;
//! 4. for a newcomer from a host this server served well before
//!    ([`SERVED_WELL_STEPS`] steps in one slot), a holder idle for
//!    [`RESERVED_IDLE`] from a host it did not.
//!
//! Holders from hosts served well go after the others under rule 3; among
//! equals, the holder that keeps the most without progress goes first:
//! idle time times what it reserved besides the slot (KV cache positions,
//! [`Slot::holds`]), so a session that reserved a long context must use it
//! or lose it first. A slot is a guard: dropping it gives the place back;
//! an evicted holder learns so through [`Slot::evicted`] and ends its
//! session.

mod served_well;
#[cfg(test)]
mod tests;
mod victim;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use tokio::sync::Notify;

use served_well::ServedWell;

/// A slot whose holder made no progress for this long goes first when the
/// server is full. Honest steps come every few milliseconds to seconds; a
/// chat waiting on its user is replayed elsewhere if evicted.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(10);

/// A holder idle this long gives its slot to a newcomer when nothing else
/// can (rule 3). Longer than the gap between two steps of an answer at one
/// server on a slow route (the other hops' time included), far shorter
/// than a keep-alive that costs its sender little.
pub(crate) const RECLAIM_AFTER: Duration = Duration::from_secs(3);

/// A holder from a host not served well, idle this long, gives its slot to
/// a newcomer from a host served well (rule 4): room kept for clients that
/// came back, without cutting a running answer.
pub(crate) const RESERVED_IDLE: Duration = Duration::from_secs(1);

/// An Open finding every slot held waits for one only while some holder is
/// idle this long (it may become reclaimable); clients mid-answer step
/// faster.
pub(crate) const WORTH_WAITING: Duration = Duration::from_millis(500);

/// Steps one slot must carry for its host to count as served well.
pub(crate) const SERVED_WELL_STEPS: u32 = 8;

/// Who asks for a slot: the peer and where its connection comes from
/// (`None`: relayed, or gone already).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holder {
    pub peer: PeerId,
    pub source: Option<IpAddr>,
}

/// Why a slot was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The peer holds `per_peer` already.
    PeerFull { limit: usize },
    /// Every slot is taken and no holder may be evicted for this one: its
    /// source holds its share already and every holder is making progress.
    Full { limit: usize },
}

impl Refusal {
    /// What a peer refused a stream slot is told.
    pub fn stream_message(self) -> String {
        match self {
            Refusal::PeerFull { limit } => {
                format!("busy: this peer has {limit} streams open, the most one peer may")
            }
            Refusal::Full { limit } => format!("busy: {limit}/{limit} streams in use"),
        }
    }
}

/// Counts what each peer and each source holds, up to `per_peer` each and
/// `total` together.
#[derive(Debug)]
pub(crate) struct Quota {
    per_peer: usize,
    total: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    slots: HashMap<u64, Entry>,
    next_id: u64,
    served_well: ServedWell,
}

#[derive(Debug)]
struct Entry {
    holder: Holder,
    last_progress: Instant,
    /// Times the holder made progress.
    steps: u32,
    /// What the holder reserved besides the slot (KV cache positions).
    reserved: usize,
    eviction: Arc<Notify>,
}

impl Entry {
    fn idle(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_progress)
    }

    /// What it keeps without progress: idle time, weighted by what it reserved.
    fn idle_holding(&self, now: Instant) -> f64 {
        self.idle(now).as_secs_f64() * (1 + self.reserved) as f64
    }
}

impl Held {
    fn count(&self, keep: impl Fn(&Entry) -> bool) -> usize {
        self.slots.values().filter(|e| keep(e)).count()
    }
}

impl Quota {
    pub fn new(per_peer: usize, total: usize) -> Arc<Self> {
        Arc::new(Quota {
            per_peer: per_peer.max(1),
            total: total.max(1),
            held: Mutex::new(Held::default()),
        })
    }

    /// The most slots one peer may hold.
    pub fn per_peer(&self) -> usize {
        self.per_peer
    }

    /// The most slots all peers together may hold.
    pub fn total(&self) -> usize {
        self.total
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for `holder`, evicting another holder when the quota is full
    /// and the rules in this module's header allow it.
    pub fn try_take(self: &Arc<Self>, holder: Holder) -> Result<Slot, Refusal> {
        self.take_at(holder, Instant::now())
    }

    /// A slot for `holder` as [`Self::try_take`] gives, waiting up to
    /// [`RECLAIM_AFTER`] while every slot is held and some holder is idle
    /// for [`WORTH_WAITING`]: a holder that only keeps its slot alive
    /// becomes reclaimable meanwhile (rule 3), however its keep-alives are
    /// timed. Holders all stepping fast mean busy at once.
    pub async fn take_waiting(self: &Arc<Self>, holder: Holder) -> Result<Slot, Refusal> {
        let deadline = Instant::now() + RECLAIM_AFTER;
        loop {
            match self.try_take(holder) {
                Err(Refusal::Full { .. })
                    if Instant::now() < deadline && self.someone_idle(WORTH_WAITING) =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                taken => return taken,
            }
        }
    }

    fn someone_idle(&self, at_least: Duration) -> bool {
        let now = Instant::now();
        self.held().slots.values().any(|e| e.idle(now) >= at_least)
    }

    fn take_at(self: &Arc<Self>, holder: Holder, now: Instant) -> Result<Slot, Refusal> {
        let mut held = self.held();
        if held.count(|e| e.holder.peer == holder.peer) >= self.per_peer {
            return Err(Refusal::PeerFull {
                limit: self.per_peer,
            });
        }
        if held.slots.len() >= self.total {
            let victim = held
                .victim_for(&holder, self.total, now)
                .ok_or(Refusal::Full { limit: self.total })?;
            if let Some(evicted) = held.slots.remove(&victim) {
                tracing::debug!(peer = %evicted.holder.peer, source = ?evicted.holder.source,
                    "evicting a slot holder to make room for another source");
                evicted.eviction.notify_one();
            }
        }
        let id = held.next_id;
        held.next_id += 1;
        let eviction = Arc::new(Notify::new());
        held.slots.insert(
            id,
            Entry {
                holder,
                last_progress: now,
                steps: 0,
                reserved: 0,
                eviction: eviction.clone(),
            },
        );
        Ok(Slot {
            quota: self.clone(),
            id,
            eviction,
        })
    }

    /// Gives `slot`'s holder room in something the slots' holders share
    /// besides the slots (the KV cache): evicts the holder the rules above
    /// would evict for it if every slot were taken, never `slot` itself.
    /// Whether one was evicted (its session then gives its share back).
    pub fn evict_for(&self, slot: &Slot) -> bool {
        let mut held = self.held();
        let Some(mine) = held.slots.remove(&slot.id) else {
            return false;
        };
        let victim = held.victim_for(&mine.holder, self.total, Instant::now());
        held.slots.insert(slot.id, mine);
        match victim.and_then(|id| held.slots.remove(&id)) {
            Some(evicted) => {
                tracing::debug!(peer = %evicted.holder.peer, source = ?evicted.holder.source,
                    "evicting a session to make room in the cache for another source");
                evicted.eviction.notify_one();
                true
            }
            None => false,
        }
    }

    /// Slots taken now, by everyone.
    pub fn in_use(&self) -> usize {
        self.held().slots.len()
    }

    /// Waits until nothing is held or `deadline` passes; what is still held.
    pub async fn drained_by(&self, deadline: tokio::time::Instant) -> usize {
        while self.in_use() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.in_use()
    }
}

/// One place held by one peer.
#[derive(Debug)]
pub(crate) struct Slot {
    quota: Arc<Quota>,
    id: u64,
    eviction: Arc<Notify>,
}

impl Slot {
    /// The holder made progress: it is not stale for a while.
    pub fn progressed(&self) {
        self.progressed_at(Instant::now());
    }

    fn progressed_at(&self, now: Instant) {
        if let Some(entry) = self.quota.held().slots.get_mut(&self.id) {
            entry.last_progress = now;
            entry.steps = entry.steps.saturating_add(1);
        }
    }

    /// The holder reserved `amount` besides the slot (KV cache positions):
    /// idle, it is evicted before holders that reserved less.
    pub fn holds(&self, amount: usize) {
        if let Some(entry) = self.quota.held().slots.get_mut(&self.id) {
            entry.reserved = amount;
        }
    }

    /// Completes when this slot was given to another holder.
    pub async fn evicted(&self) {
        self.eviction.notified().await
    }

    /// The eviction signal on its own, to wait for it while the slot's
    /// owner is borrowed elsewhere.
    pub fn eviction(&self) -> Eviction {
        Eviction(self.eviction.clone())
    }
}

/// See [`Slot::eviction`].
pub(crate) struct Eviction(Arc<Notify>);

impl Eviction {
    pub async fn happened(&self) {
        self.0.notified().await
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.quota.held();
        if let Some(entry) = held.slots.remove(&self.id) {
            if entry.steps >= SERVED_WELL_STEPS {
                held.served_well.remember(&entry.holder, Instant::now());
            }
        }
    }
}
