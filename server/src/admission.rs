//! Who may hold what on this server: sessions and streams per peer and in
//! total, and the KV-cache tokens all sessions share. A slot or a
//! reservation is a guard; dropping it gives the place back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use libp2p::PeerId;

/// Counts what each peer holds, up to `per_peer` each and `total` together.
#[derive(Debug)]
pub(crate) struct Quota {
    per_peer: usize,
    total: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    by_peer: HashMap<PeerId, usize>,
    total: usize,
}

/// Why a slot was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The peer holds `per_peer` already.
    PeerFull { limit: usize },
    /// Every slot is taken.
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

    pub fn try_take(self: &Arc<Self>, peer: PeerId) -> Result<Slot, Refusal> {
        let mut held = self.held();
        if held.total >= self.total {
            return Err(Refusal::Full { limit: self.total });
        }
        let mine = held.by_peer.entry(peer).or_insert(0);
        if *mine >= self.per_peer {
            return Err(Refusal::PeerFull {
                limit: self.per_peer,
            });
        }
        *mine += 1;
        held.total += 1;
        Ok(Slot {
            quota: self.clone(),
            peer,
        })
    }

    /// Slots taken now, by everyone.
    pub fn in_use(&self) -> usize {
        self.held().total
    }

    /// Waits until nothing is held or `deadline` passes; what is still held.
    pub async fn drained_by(&self, deadline: tokio::time::Instant) -> usize {
        while self.in_use() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        self.in_use()
    }
}

/// One place held by one peer.
#[derive(Debug)]
pub(crate) struct Slot {
    quota: Arc<Quota>,
    peer: PeerId,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.quota.held();
        held.total = held.total.saturating_sub(1);
        if let Some(n) = held.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.by_peer.remove(&self.peer);
            }
        }
    }
}

/// The KV-cache positions every session of this server shares: a session
/// reserves its `max_length` when it opens and gives it back when it ends.
#[derive(Debug)]
pub(crate) struct CacheBudget {
    total: usize,
    reserved: Mutex<usize>,
}

/// Why a reservation was refused: `free` of `total` tokens are left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BudgetFull {
    pub free: usize,
    pub total: usize,
}

impl CacheBudget {
    pub fn new(total: usize) -> Arc<Self> {
        Arc::new(CacheBudget {
            total,
            reserved: Mutex::new(0),
        })
    }

    fn reserved(&self) -> std::sync::MutexGuard<'_, usize> {
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn try_reserve(self: &Arc<Self>, tokens: usize) -> Result<Reservation, BudgetFull> {
        let mut reserved = self.reserved();
        let free = self.total.saturating_sub(*reserved);
        if tokens > free {
            return Err(BudgetFull {
                free,
                total: self.total,
            });
        }
        *reserved += tokens;
        Ok(Reservation {
            budget: self.clone(),
            tokens,
        })
    }

    pub fn free(&self) -> usize {
        self.total.saturating_sub(*self.reserved())
    }

    /// Tokens reserved by open sessions now.
    pub fn used(&self) -> usize {
        *self.reserved()
    }
}

/// Cache tokens held by one session.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<CacheBudget>,
    tokens: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut reserved = self.budget.reserved();
        *reserved = reserved.saturating_sub(self.tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_budget_is_shared_and_given_back() {
        let budget = CacheBudget::new(1000);
        let a = budget.try_reserve(600).unwrap();
        assert_eq!(
            budget.try_reserve(500).unwrap_err(),
            BudgetFull {
                free: 400,
                total: 1000
            }
        );
        let _b = budget.try_reserve(400).unwrap();
        assert_eq!(budget.free(), 0);
        drop(a);
        assert_eq!(budget.free(), 600);
        assert!(budget.try_reserve(600).is_ok());
    }

    #[test]
    fn peers_get_their_share_and_slots_come_back() {
        let quota = Quota::new(2, 3);
        let (a, b) = (PeerId::random(), PeerId::random());
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
}
