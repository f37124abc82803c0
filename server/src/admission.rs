//! The KV-cache tokens all sessions of this server share (the slots
//! themselves are `quota.rs`'s). A reservation is a guard; dropping it
//! gives the tokens back.

use std::sync::{Arc, Mutex};

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
}
