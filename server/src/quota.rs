//! Who may hold the server's session and stream slots. Peer ids are free,
//! so a cap per id alone limits nothing: slots are also shared fairly
//! between source networks (IPv4 /24, IPv6 /48) and, inside one, between
//! hosts. When every slot is taken, a newcomer gets one by evicting, in
//! this order: a holder that made no progress for [`STALE_AFTER`], then one
//! of the network (and host) holding the most slots, when that one holds
//! more than the newcomer's share. Among those, the holder that keeps the
//! most without progress goes first: idle time times what it reserved
//! besides the slot (KV cache positions, [`Slot::holds`]), so a session
//! that reserved a long context must use it or lose it first. A slot is a
//! guard: dropping it gives the place back; an evicted holder learns so
//! through [`Slot::evicted`] and ends its session.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use corolla_shared::source_address::AddressGroup;
use libp2p::PeerId;
use std::time::Instant;

use tokio::sync::Notify;

/// A slot whose holder made no progress (an opened session, a computed
/// step) for this long goes first when the server is full. Honest steps
/// come every few milliseconds to seconds; a chat waiting on its user is
/// replayed elsewhere if evicted.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(10);

/// Who asks for a slot: the peer and where its connection comes from
/// (`None`: relayed, or gone already).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holder {
    pub peer: PeerId,
    pub source: Option<IpAddr>,
}

impl Holder {
    fn network(&self) -> Option<AddressGroup> {
        self.source.map(AddressGroup::network)
    }

    fn host(&self) -> Option<AddressGroup> {
        self.source.map(AddressGroup::host)
    }
}

/// Why a slot was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The peer holds `per_peer` already.
    PeerFull { limit: usize },
    /// Every slot is taken and no holder may be evicted for this one: its
    /// source holds its share already.
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
}

#[derive(Debug)]
struct Entry {
    holder: Holder,
    last_progress: Instant,
    /// What the holder reserved besides the slot (KV cache positions).
    reserved: usize,
    eviction: Arc<Notify>,
}

impl Entry {
    /// What it keeps without progress: idle time, weighted by what it reserved.
    fn idle_holding(&self, now: Instant) -> f64 {
        now.duration_since(self.last_progress).as_secs_f64() * (1 + self.reserved) as f64
    }
}

impl Held {
    fn count(&self, keep: impl Fn(&Entry) -> bool) -> usize {
        self.slots.values().filter(|e| keep(e)).count()
    }

    /// Among the slots `keep` selects, the one keeping the most without
    /// progress ([`Entry::idle_holding`]; the idlest among equals).
    fn most_idle_holding(&self, now: Instant, keep: impl Fn(&Entry) -> bool) -> Option<u64> {
        self.slots
            .iter()
            .filter(|(_, e)| keep(e))
            .max_by(|(_, a), (_, b)| {
                a.idle_holding(now)
                    .total_cmp(&b.idle_holding(now))
                    .then(b.last_progress.cmp(&a.last_progress))
            })
            .map(|(id, _)| *id)
    }

    /// The group (by `key`) holding the most slots, and how many.
    fn largest<K: std::hash::Hash + Eq + Copy>(
        &self,
        key: impl Fn(&Entry) -> K,
    ) -> Option<(K, usize)> {
        let mut counts: HashMap<K, usize> = HashMap::new();
        for e in self.slots.values() {
            *counts.entry(key(e)).or_insert(0) += 1;
        }
        counts.into_iter().max_by_key(|(_, n)| *n)
    }

    /// Which slot `newcomer` may take when all `total` are held.
    fn victim_for(&self, newcomer: &Holder, total: usize, now: Instant) -> Option<u64> {
        if let Some(id) =
            self.most_idle_holding(now, |e| now.duration_since(e.last_progress) >= STALE_AFTER)
        {
            return Some(id);
        }
        let network = newcomer.network();
        let mine = self.count(|e| e.holder.network() == network);
        let (largest, theirs) = self.largest(|e| e.holder.network())?;
        let networks = self
            .slots
            .values()
            .map(|e| e.holder.network())
            .chain([network])
            .collect::<std::collections::HashSet<_>>()
            .len();
        let share = (total / networks.max(1)).max(1);
        if mine < share && theirs > mine + 1 {
            return self.victim_in_network(largest, now);
        }
        // Inside the newcomer's own network, hosts share alike.
        let host = newcomer.host();
        let mine = self.count(|e| e.holder.host() == host);
        let (largest, theirs) = self.largest_host_in(network)?;
        (theirs > mine + 1).then(|| self.most_idle_holding(now, |e| e.holder.host() == largest))?
    }

    fn victim_in_network(&self, network: Option<AddressGroup>, now: Instant) -> Option<u64> {
        let (host, _) = self.largest_host_in(network)?;
        self.most_idle_holding(now, |e| e.holder.host() == host)
    }

    fn largest_host_in(
        &self,
        network: Option<AddressGroup>,
    ) -> Option<(Option<AddressGroup>, usize)> {
        let mut counts: HashMap<Option<AddressGroup>, usize> = HashMap::new();
        for e in self
            .slots
            .values()
            .filter(|e| e.holder.network() == network)
        {
            *counts.entry(e.holder.host()).or_insert(0) += 1;
        }
        counts.into_iter().max_by_key(|(_, n)| *n)
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
        self.quota.held().slots.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(source: &str) -> Holder {
        Holder {
            peer: PeerId::random(),
            source: Some(source.parse().unwrap()),
        }
    }

    #[tokio::test]
    async fn peers_get_their_share_and_slots_come_back() {
        let quota = Quota::new(2, 3);
        let a = from("1.1.1.1");
        let b = Holder {
            peer: PeerId::random(),
            ..a
        };
        let a1 = quota.try_take(a).unwrap();
        let _a2 = quota.try_take(a).unwrap();
        assert_eq!(
            quota.try_take(a).unwrap_err(),
            Refusal::PeerFull { limit: 2 }
        );
        let _b1 = quota.try_take(b).unwrap();
        assert_eq!(quota.try_take(b).unwrap_err(), Refusal::Full { limit: 3 });
        drop(a1);
        assert_eq!(quota.in_use(), 2);
        assert!(quota.try_take(b).is_ok());
    }

    #[tokio::test]
    async fn one_network_with_many_ids_is_cut_down_to_its_share() {
        let quota = Quota::new(4, 8);
        // Eight ids from one /24 fill the server while nobody else asks.
        let crowd: Vec<Slot> = (0..8)
            .map(|i| quota.try_take(from(&format!("6.6.6.{}", i % 3))).unwrap())
            .collect();
        let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
        // Seven other networks get in, each at the crowd's expense, until
        // every network holds one slot; the next one waits.
        let others: Vec<Slot> = (0..7)
            .map(|i| quota.try_take(from(&format!("9.9.{i}.1"))).unwrap())
            .collect();
        assert_eq!(crowd.iter().filter(|s| held(s)).count(), 1);
        assert!(others.iter().all(held));
        assert_eq!(
            quota.try_take(from("9.9.100.1")).unwrap_err(),
            Refusal::Full { limit: 8 }
        );
        // An evicted holder hears of it.
        let gone = crowd.iter().find(|s| !held(s)).unwrap();
        tokio::time::timeout(Duration::from_secs(1), gone.evicted())
            .await
            .expect("told");
    }

    #[tokio::test]
    async fn room_in_the_cache_comes_from_the_source_over_its_share() {
        let quota = Quota::new(4, 16);
        let crowd: Vec<Slot> = (0..3)
            .map(|_| quota.try_take(from("6.6.6.6")).unwrap())
            .collect();
        let honest = quota.try_take(from("9.9.9.9")).unwrap();
        let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
        // While the newcomer still lacks room, the crowd gives way, down to
        // one session (what a newcomer asking for a slot would leave it).
        assert!(quota.evict_for(&honest));
        assert!(quota.evict_for(&honest));
        assert!(!quota.evict_for(&honest));
        assert!(held(&honest));
        assert_eq!(crowd.iter().filter(|s| held(s)).count(), 1);
    }

    #[tokio::test]
    async fn hosts_share_their_network_and_stale_holders_go_first() {
        let quota = Quota::new(8, 4);
        let hog: Vec<Slot> = (0..4)
            .map(|_| quota.try_take(from("5.5.5.5")).unwrap())
            .collect();
        let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
        // Another host of the same /24 gets in at the hog's expense.
        let neighbour = quota.try_take(from("5.5.5.6")).unwrap();
        assert_eq!(hog.iter().filter(|s| held(s)).count(), 3);
        // Later every holder but one keeps working: the stale one goes first.
        let later = Instant::now() + STALE_AFTER + Duration::from_secs(1);
        let mut left = hog.iter().filter(|s| held(s));
        let stale = left.next().unwrap();
        for slot in left.chain([&neighbour]) {
            slot.progressed_at(later);
        }
        let _second = quota.take_at(from("5.5.5.6"), later).unwrap();
        assert!(!held(stale));
        assert_eq!(quota.in_use(), 4);
        // Each host now holds two of four: nobody is over its share.
        assert_eq!(
            quota.take_at(from("5.5.5.6"), later).unwrap_err(),
            Refusal::Full { limit: 4 }
        );
    }

    #[tokio::test]
    async fn a_long_reservation_left_idle_goes_before_a_short_one() {
        let quota = Quota::new(8, 3);
        let start = Instant::now();
        let short = quota.take_at(from("5.5.5.5"), start).unwrap();
        let long = quota.take_at(from("5.5.5.5"), start).unwrap();
        let _other = quota.take_at(from("5.5.5.6"), start).unwrap();
        short.holds(64);
        long.holds(2048);
        // Both stale; the short one has been idle longer, the long one keeps more.
        short.progressed_at(start);
        long.progressed_at(start + Duration::from_secs(2));
        let later = start + STALE_AFTER + Duration::from_secs(5);
        _other.progressed_at(later);
        let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
        let _newcomer = quota.take_at(from("9.9.9.9"), later).unwrap();
        assert!(!held(&long), "the idle long reservation went first");
        assert!(held(&short));
    }
}
