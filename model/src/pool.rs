//! Where a span's math runs: a thread pool and a gang of its own.

#[cfg(not(target_arch = "wasm32"))]
mod gang;

/// A span's (or a head's) threads: the products of Corolla's kernels in its
/// forwards share their items with its [`gang::Gang`], whose workers spin
/// between one product and the next of a forward, the calling thread
/// taking items too (a pool the caller only waits on cost a decode step of
/// the default model's 30 kept-quantized blocks 6.3 ms against 2.7 ms).
///
/// The rayon pool is for candle's own parallel math (a dense span's
/// products). A span whose weights Corolla's kernels multiply has none: its
/// forwards run on the caller's thread with the gang (candle's rare parallel
/// ops there, a long prompt's attention, use rayon's global pool), since
/// idle rayon workers spin by yielding the core and took turns with the
/// gang's (60 context switches a decode step of 30 blocks), and a hop to a
/// pool thread costs two wake-ups a forward.
///
/// A pool per span, not rayon's global one: a forward holds a pool thread
/// for its whole run, and a pool thread waiting for its products' parts
/// runs other queued work meanwhile, so spans sharing one pool (several
/// servers or clients in one process, as the tests run them) would wait on
/// each other's whole forwards.
#[derive(Debug, Clone, Default)]
pub(crate) struct ComputePool {
    #[cfg(not(target_arch = "wasm32"))]
    pool: Option<std::sync::Arc<rayon::ThreadPool>>,
    #[cfg(not(target_arch = "wasm32"))]
    gang: Option<std::sync::Arc<gang::Gang>>,
}

#[cfg(not(target_arch = "wasm32"))]
thread_local! {
    /// The gang of the forward this thread runs, if any.
    static CURRENT_GANG: std::cell::RefCell<Option<std::sync::Arc<gang::Gang>>> =
        const { std::cell::RefCell::new(None) };
}

impl ComputePool {
    /// A gang of `RAYON_NUM_THREADS` threads (the cores by default), and a
    /// rayon pool of as many where `candle_math` (candle multiplies some of
    /// the weights). Where threads cannot be started, the caller's thread
    /// computes.
    pub fn new(candle_math: bool) -> Self {
        #[cfg(not(target_arch = "wasm32"))]
        {
            let threads = candle_core::utils::get_num_threads();
            let pool = candle_math.then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("corolla-span-{i}"))
                    .build()
                    .map_err(|e| {
                        tracing::warn!(
                            "no thread pool for a span ({e}): computing on the caller's thread"
                        )
                    })
                    .ok()
            });
            let pool = pool.flatten().map(std::sync::Arc::new);
            let gang = (threads > 1).then(|| std::sync::Arc::new(gang::Gang::new(threads)));
            ComputePool { pool, gang }
        }
        #[cfg(target_arch = "wasm32")]
        {
            let _ = candle_math;
            ComputePool {}
        }
    }

    /// Runs `f` on a thread of the rayon pool (where there is one) while
    /// the caller waits, its products shared with the gang.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let with_gang = || {
            let previous = CURRENT_GANG.replace(self.gang.clone());
            // Restored on unwinding too, so a panic does not leave a pool
            // thread posting to another span's gang.
            struct Restore(Option<std::sync::Arc<gang::Gang>>);
            impl Drop for Restore {
                fn drop(&mut self) {
                    CURRENT_GANG.set(self.0.take());
                }
            }
            let _restore = Restore(previous);
            let _hold = self.gang.as_ref().map(|g| g.hold());
            f()
        };
        if let Some(pool) = &self.pool {
            return pool.install(with_gang);
        }
        with_gang()
    }

    /// Wakes the gang to spin for a forward about to be posted (see
    /// [`gang::Gang::expect_work`]).
    pub fn expect_work(&self) {
        #[cfg(not(target_arch = "wasm32"))]
        if let Some(gang) = &self.gang {
            gang.expect_work();
        }
    }

    /// A page has one thread (and values that are not `Send`).
    #[cfg(target_arch = "wasm32")]
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }
}

/// Threads that share the items of [`for_each`] here.
pub(crate) fn threads() -> usize {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let gang = CURRENT_GANG.with_borrow(|g| g.as_ref().map(|g| g.threads()));
        gang.unwrap_or_else(rayon::current_num_threads)
    }
    #[cfg(target_arch = "wasm32")]
    1
}

/// Calls `run(item)` for every item in `0..items`, shared with the gang of
/// the forward this thread runs, or else with rayon's current pool.
pub(crate) fn for_each(items: usize, run: &(dyn Fn(usize) + Sync)) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        if let Some(gang) = CURRENT_GANG.with_borrow(|g| g.clone()) {
            return gang.run(items, run);
        }
        use rayon::prelude::*;
        (0..items).into_par_iter().for_each(run)
    }
    #[cfg(target_arch = "wasm32")]
    (0..items).for_each(run)
}
