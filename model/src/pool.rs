//! Where a span's math runs: a thread pool of its own.

/// A span's thread pool: its forward passes run on one of the pool's
/// threads while the caller waits. The products inside then split their
/// work with the thread they run on instead of handing all of it to woken
/// workers and sleeping, and the workers stay warm between one product and
/// the next: measured on 2 cores, a decode step of the default model's 30
/// kept-quantized blocks took 2.7 ms against 6.3 ms called from a thread
/// outside a pool (the server's compute thread, a client's generate loop),
/// and 16 sessions' step 26 ms against 42 ms (dequantized: 60 against 92).
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
}

impl ComputePool {
    /// A pool of `RAYON_NUM_THREADS` threads (the cores by default), or
    /// none (the caller's thread computes) where threads cannot be started.
    pub fn new() -> Self {
        #[cfg(not(target_arch = "wasm32"))]
        {
            let pool = rayon::ThreadPoolBuilder::new()
                .thread_name(|i| format!("corolla-span-{i}"))
                .build();
            if let Err(e) = &pool {
                tracing::warn!("no thread pool for a span ({e}): computing on the caller's thread");
            }
            ComputePool {
                pool: pool.ok().map(std::sync::Arc::new),
            }
        }
        #[cfg(target_arch = "wasm32")]
        ComputePool {}
    }

    /// Runs `f` on a thread of the pool while the caller waits.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        #[cfg(not(target_arch = "wasm32"))]
        if let Some(pool) = &self.pool {
            return pool.install(f);
        }
        f()
    }
}
