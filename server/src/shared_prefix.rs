//! Shared prefixes: the KV cache of a prompt's beginning, computed once and
//! reused by every later session (of any client) that starts the same way.
//!
//! A server sees hidden states, not tokens, so a page is keyed by what its
//! span actually received: the SHA-256 of each input row, chained from the
//! first position (the keys and values of a position depend only on the
//! inputs up to it). A client therefore cannot plant a page under another
//! prompt's key: the server computed every page it holds from the very inputs
//! the key names. Pages are [`PAGE_POSITIONS`] positions long and hold their
//! span's output rows too, so a reused page answers its positions without
//! computing them and the next server sees the same inputs (and reuses its
//! own pages). A session gets a copy of a page's keys and values in its own
//! cache (a copy costs microseconds; attention reads one contiguous cache per
//! session), and stored pages are never written: copy on reuse.
//!
//! Pages count against `--cache-tokens` ([`CacheBudget`]): a page is stored
//! only when the budget has room for it or an older page makes way, and a
//! session that finds the budget full first evicts pages, least recently used
//! first, before any session is evicted for it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use corolla_model::{CachedPositions, DType, SessionCache, Tensor};
use sha2::{Digest, Sha256};

use crate::admission::{CacheBudget, Reservation};

/// Positions per page: a prompt shorter than this shares nothing.
pub(crate) const PAGE_POSITIONS: usize = 64;

/// Identifies a page: the inputs of its positions and of all before them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PageKey([u8; 32]);

/// The inputs one session's cache holds, as row hashes, and the keys of its
/// full pages.
#[derive(Debug)]
pub(crate) struct InputHistory {
    /// Names the layers, dtype and adapter: pages of other layers, or
    /// computed with another adapter, never match.
    root: PageKey,
    rows: Vec<[u8; 32]>,
    /// Keys of the pages `rows` completes, in order.
    pages: Vec<PageKey>,
}

impl InputHistory {
    pub fn new(layers: Range<usize>, dtype: DType, adapter: Option<&str>) -> Self {
        let mut h = Sha256::new();
        h.update(b"corolla shared prefix v1");
        h.update((layers.start as u64).to_le_bytes());
        h.update((layers.end as u64).to_le_bytes());
        h.update(dtype.as_str().as_bytes());
        if let Some(adapter) = adapter {
            // Length first: no name runs into the fields after it.
            h.update(b"adapter");
            h.update((adapter.len() as u64).to_le_bytes());
            h.update(adapter.as_bytes());
        }
        InputHistory {
            root: PageKey(h.finalize().into()),
            rows: Vec::new(),
            pages: Vec::new(),
        }
    }

    /// Records the rows of `input` (`[1, T, hidden]`, in the span's dtype)
    /// at positions `start..start + T`, forgetting what followed `start`.
    pub fn record(&mut self, start: usize, input: &Tensor) -> corolla_model::Result<()> {
        let rows = input.dim(1)?;
        let values = input
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let width = values.len() / rows.max(1);
        self.rows.truncate(start);
        self.pages.truncate(start / PAGE_POSITIONS);
        // Each row's values as little-endian bytes, hashed in one update
        // (an update per value cost more than the hash itself, on the
        // path of every decode step).
        let mut bytes = Vec::with_capacity(4 * width);
        for row in values.chunks(width.max(1)) {
            bytes.clear();
            bytes.extend(row.iter().flat_map(|v| v.to_bits().to_le_bytes()));
            self.rows.push(Sha256::digest(&bytes).into());
        }
        while (self.pages.len() + 1) * PAGE_POSITIONS <= self.rows.len() {
            let page = self.pages.len();
            let mut h = Sha256::new();
            h.update(self.pages.last().unwrap_or(&self.root).0);
            for row in &self.rows[page * PAGE_POSITIONS..(page + 1) * PAGE_POSITIONS] {
                h.update(row);
            }
            self.pages.push(PageKey(h.finalize().into()));
        }
        Ok(())
    }

    /// The key of page `index` (positions `index * PAGE_POSITIONS..`), once recorded.
    pub fn page(&self, index: usize) -> Option<PageKey> {
        self.pages.get(index).copied()
    }
}

/// One stored page: its positions' keys and values and the span's output rows.
#[derive(Debug, Clone)]
pub(crate) struct Page {
    pub kv: CachedPositions,
    /// `[1, PAGE_POSITIONS, hidden]`.
    pub output: Tensor,
}

struct StoredPage {
    page: Page,
    last_used: u64,
    _tokens: Reservation,
}

#[derive(Default)]
struct Pages {
    by_key: HashMap<PageKey, StoredPage>,
    clock: u64,
}

impl Pages {
    fn evict_least_recently_used(&mut self) -> bool {
        let oldest = self
            .by_key
            .iter()
            .min_by_key(|(_, p)| p.last_used)
            .map(|(key, _)| *key);
        oldest.is_some_and(|key| self.by_key.remove(&key).is_some())
    }
}

/// What the shared pages have done, for status pages, the record and tests.
#[derive(Debug, Default)]
pub(crate) struct PrefixStats {
    /// Positions answered from a stored page instead of computed.
    pub reused_positions: AtomicU64,
    pub stored_pages: AtomicU64,
    pub evicted_pages: AtomicU64,
}

/// The pages of one span, shared by its compute core (which stores and
/// reuses them) and its session handlers (which evict them for room).
pub(crate) struct SharedPrefixes {
    pages: Mutex<Pages>,
    budget: Arc<CacheBudget>,
    stats: PrefixStats,
}

impl SharedPrefixes {
    pub fn new(budget: Arc<CacheBudget>) -> Arc<Self> {
        Arc::new(SharedPrefixes {
            pages: Mutex::new(Pages::default()),
            budget,
            stats: PrefixStats::default(),
        })
    }

    fn pages(&self) -> std::sync::MutexGuard<'_, Pages> {
        self.pages.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> &PrefixStats {
        &self.stats
    }

    /// The page stored under `key`, now the most recently used.
    pub fn get(&self, key: PageKey) -> Option<Page> {
        let mut pages = self.pages();
        pages.clock += 1;
        let now = pages.clock;
        let stored = pages.by_key.get_mut(&key)?;
        stored.last_used = now;
        Some(stored.page.clone())
    }

    #[cfg(test)]
    pub fn contains(&self, key: PageKey) -> bool {
        self.pages().by_key.contains_key(&key)
    }

    /// Stores `page` under `key` if the cache budget has room for it, or
    /// makes room by evicting the least recently used page.
    #[cfg(test)]
    pub fn store(&self, key: PageKey, page: Page) {
        let stored = self.store_with(key, || Ok(page));
        debug_assert!(stored.is_ok());
    }

    /// Stores the page `make` copies under `key`, if no page has that key
    /// and the cache budget has room for one (evicting the least recently
    /// used pages): the copy is made only then, not for every page of every
    /// prefill while sessions hold the whole budget.
    pub fn store_with(
        &self,
        key: PageKey,
        make: impl FnOnce() -> corolla_model::Result<Page>,
    ) -> corolla_model::Result<()> {
        let mut pages = self.pages();
        if pages.by_key.contains_key(&key) {
            return Ok(());
        }
        let tokens = loop {
            match self.budget.try_reserve(PAGE_POSITIONS) {
                Ok(tokens) => break tokens,
                Err(_) if pages.evict_least_recently_used() => {
                    self.stats.evicted_pages.fetch_add(1, Ordering::Relaxed);
                }
                // The sessions hold the whole budget.
                Err(_) => return Ok(()),
            }
        };
        // A failed copy drops `tokens`: the room goes back to the budget.
        let page = make()?;
        pages.clock += 1;
        let last_used = pages.clock;
        pages.by_key.insert(
            key,
            StoredPage {
                page,
                last_used,
                _tokens: tokens,
            },
        );
        self.stats.stored_pages.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Evicts pages, least recently used first, until `tokens` of the cache
    /// budget are free or no page is left; `true` when any was evicted.
    pub fn make_room(&self, tokens: usize) -> bool {
        let mut pages = self.pages();
        let mut evicted = false;
        while self.budget.free() < tokens && pages.evict_least_recently_used() {
            self.stats.evicted_pages.fetch_add(1, Ordering::Relaxed);
            evicted = true;
        }
        evicted
    }

    /// Answers from stored pages the positions of a step from `start` (a
    /// page boundary) to at most `end`, whose inputs `history` recorded: the
    /// pages found one after another are copied into `cache`, and their
    /// output rows returned, in order (none when the first is missing).
    pub fn reuse(
        &self,
        history: &InputHistory,
        start: usize,
        end: usize,
        cache: &mut SessionCache,
    ) -> corolla_model::Result<Vec<Tensor>> {
        let mut outputs = Vec::new();
        if !start.is_multiple_of(PAGE_POSITIONS) {
            return Ok(outputs);
        }
        let mut index = start / PAGE_POSITIONS;
        while (index + 1) * PAGE_POSITIONS <= end {
            let Some(page) = history.page(index).and_then(|key| self.get(key)) else {
                break;
            };
            cache.copy_in(index * PAGE_POSITIONS, &page.kv)?;
            outputs.push(page.output);
            index += 1;
        }
        let reused = outputs.len() * PAGE_POSITIONS;
        self.stats
            .reused_positions
            .fetch_add(reused as u64, Ordering::Relaxed);
        Ok(outputs)
    }

    /// Stores the pages that lie wholly inside `positions`, a step whose
    /// inputs `history` recorded and whose output rows are `output`, and
    /// whose keys and values `cache` now holds.
    pub fn keep(
        &self,
        history: &InputHistory,
        positions: Range<usize>,
        output: &Tensor,
        cache: &SessionCache,
    ) -> corolla_model::Result<()> {
        let first = positions.start.div_ceil(PAGE_POSITIONS);
        for index in first..positions.end / PAGE_POSITIONS {
            let Some(key) = history.page(index) else {
                continue;
            };
            let at = index * PAGE_POSITIONS;
            self.store_with(key, || {
                Ok(Page {
                    kv: cache.copy_out(at..at + PAGE_POSITIONS)?,
                    output: output
                        .narrow(1, at - positions.start, PAGE_POSITIONS)?
                        .force_contiguous()?,
                })
            })?;
        }
        Ok(())
    }

    /// Cache positions the stored pages hold.
    pub fn tokens_held(&self) -> usize {
        self.pages().by_key.len() * PAGE_POSITIONS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corolla_model::Device;

    fn input(rows: usize, seed: f32) -> Tensor {
        let values: Vec<f32> = (0..rows * 4).map(|i| i as f32 * 0.5 + seed).collect();
        Tensor::from_vec(values, (1, rows, 4), &Device::Cpu).unwrap()
    }

    #[test]
    fn page_keys_follow_the_inputs_from_the_first_position() {
        let mut a = InputHistory::new(0..4, DType::F32, None);
        a.record(0, &input(130, 0.0)).unwrap();
        assert!(a.page(1).is_some() && a.page(2).is_none());
        // The same inputs in other steps give the same keys.
        let mut b = InputHistory::new(0..4, DType::F32, None);
        let whole = input(130, 0.0);
        b.record(0, &whole.narrow(1, 0, 10).unwrap()).unwrap();
        for p in 10..130 {
            b.record(p, &whole.narrow(1, p, 1).unwrap()).unwrap();
        }
        assert_eq!(a.page(0), b.page(0));
        assert_eq!(a.page(1), b.page(1));
        // Another first page changes every later key; other layers match nothing.
        let mut c = InputHistory::new(0..4, DType::F32, None);
        c.record(0, &input(130, 1.0)).unwrap();
        c.record(64, &whole.narrow(1, 64, 66).unwrap()).unwrap();
        assert_ne!(a.page(1), c.page(1));
        let mut d = InputHistory::new(0..3, DType::F32, None);
        d.record(0, &whole).unwrap();
        assert_ne!(a.page(0), d.page(0));
        // Pages computed with an adapter are the adapter's alone.
        for adapter in ["alpha", "beta"] {
            let mut e = InputHistory::new(0..4, DType::F32, Some(adapter));
            e.record(0, &whole).unwrap();
            assert_ne!(a.page(0), e.page(0), "{adapter}");
            let mut f = InputHistory::new(0..4, DType::F32, Some("alpha"));
            f.record(0, &whole).unwrap();
            assert_eq!(e.page(0) == f.page(0), adapter == "alpha");
        }
        // A rewind forgets the pages past it.
        a.record(70, &input(1, 9.0)).unwrap();
        assert!(a.page(0).is_some() && a.page(1).is_none());
    }

    fn page(seed: f32) -> Page {
        let rows = input(PAGE_POSITIONS, seed);
        let kv = rows.reshape((1, 1, PAGE_POSITIONS, 4)).unwrap();
        Page {
            kv: CachedPositions::new(0, vec![(kv.clone(), kv)]).unwrap(),
            output: rows,
        }
    }

    #[test]
    fn pages_take_cache_budget_and_the_least_recently_used_goes_first() {
        let budget = CacheBudget::new(3 * PAGE_POSITIONS);
        let store = SharedPrefixes::new(budget.clone());
        let key = |n: u8| PageKey([n; 32]);
        store.store(key(1), page(1.0));
        store.store(key(2), page(2.0));
        assert_eq!(store.tokens_held(), 2 * PAGE_POSITIONS);
        assert_eq!(budget.free(), PAGE_POSITIONS);
        // Page 1 is used; a session needing two pages' room evicts page 2 only.
        assert!(store.get(key(1)).is_some());
        assert!(store.make_room(2 * PAGE_POSITIONS));
        assert!(store.contains(key(1)) && !store.contains(key(2)));
        // A session holding the rest: a new page replaces the oldest one.
        let _session = budget.try_reserve(2 * PAGE_POSITIONS).unwrap();
        store.store(key(3), page(3.0));
        assert!(store.contains(key(3)) && !store.contains(key(1)));
        assert_eq!(store.stats().evicted_pages.load(Ordering::Relaxed), 2);
        // With no page left to give way, nothing is stored beyond the budget.
        drop(store);
        let store = SharedPrefixes::new(budget.clone());
        let _rest = budget.try_reserve(budget.free()).unwrap();
        store.store(key(4), page(4.0));
        assert_eq!(store.tokens_held(), 0);
        // ... and no copy is made for it; a copy that fails gives its room back.
        let copied = std::cell::Cell::new(false);
        let made = store.store_with(key(5), || {
            copied.set(true);
            Ok(page(5.0))
        });
        assert!(made.is_ok() && !copied.get());
        drop(_rest);
        let free = budget.free();
        let failed = store.store_with(key(6), || {
            Err(corolla_model::ModelError::CachedPositionsShape)
        });
        assert!(failed.is_err());
        assert_eq!((budget.free(), store.tokens_held()), (free, 0));
    }
}
