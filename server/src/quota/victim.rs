//! Which holder gives its slot up when every slot is taken: the rules of
//! the quota's header, in their order.

use std::time::{Duration, Instant};

use corolla_shared::fair_share;

use super::{Entry, Held, Holder, RECLAIM_AFTER, RESERVED_IDLE, STALE_AFTER};

type Candidates<'a> = Vec<(u64, &'a Entry)>;

impl Held {
    /// Which slot `newcomer` may take when all `total` are held.
    pub(super) fn victim_for(&self, newcomer: &Holder, total: usize, now: Instant) -> Option<u64> {
        self.idle_for(STALE_AFTER, now, |_| true)
            .or_else(|| self.over_share(newcomer, total, now))
            .or_else(|| self.idle_for(RECLAIM_AFTER, now, |_| true))
            .or_else(|| {
                let known = |holder: &Holder| self.served_well.knows(holder, now);
                if known(newcomer) {
                    self.idle_for(RESERVED_IDLE, now, |e| !known(&e.holder))
                } else {
                    None
                }
            })
    }

    /// Among holders `keep` selects that made no progress for `at_least`:
    /// those from hosts not served well first, then the one keeping the
    /// most without progress.
    fn idle_for(
        &self,
        at_least: Duration,
        now: Instant,
        keep: impl Fn(&Entry) -> bool,
    ) -> Option<u64> {
        let candidates: Candidates = self
            .slots
            .iter()
            .map(|(id, e)| (*id, e))
            .filter(|(_, e)| e.idle(now) >= at_least && keep(e))
            .collect();
        let unknown: Candidates = candidates
            .iter()
            .filter(|(_, e)| !self.served_well.knows(&e.holder, now))
            .copied()
            .collect();
        most_idle_holding(
            if unknown.is_empty() {
                candidates
            } else {
                unknown
            },
            now,
        )
    }

    /// Rule 2 ([`fair_share::crowded`]): the group over its share gives
    /// way, the holder keeping the most without progress first.
    fn over_share(&self, newcomer: &Holder, total: usize, now: Instant) -> Option<u64> {
        let crowded = fair_share::crowded(
            self.slots.iter().map(|(id, e)| (*id, e.holder.source)),
            newcomer.source,
            total,
        );
        most_idle_holding(
            crowded
                .into_iter()
                .filter_map(|id| self.slots.get(&id).map(|e| (id, e)))
                .collect(),
            now,
        )
    }
}

/// The candidate keeping the most without progress ([`Entry::idle_holding`];
/// the idlest among equals).
fn most_idle_holding(candidates: Candidates, now: Instant) -> Option<u64> {
    candidates
        .into_iter()
        .max_by(|(_, a), (_, b)| {
            a.idle_holding(now)
                .total_cmp(&b.idle_holding(now))
                .then(b.last_progress.cmp(&a.last_progress))
        })
        .map(|(id, _)| id)
}
