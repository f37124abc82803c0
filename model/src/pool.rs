//! Where the math runs.

/// Runs `f` on a thread of rayon's pool while the caller waits. The
/// products inside then split their work with the thread they run on
/// instead of handing all of it to woken workers and sleeping, and the
/// workers stay warm between one product and the next: measured on 2 cores,
/// a decode step of the default model's 30 kept-quantized blocks took
/// 3.2 ms against 6.3 ms called from a thread outside the pool (the server's
/// compute thread, a client's generate loop), and 16 sessions' step 33 ms
/// against 42 ms (dequantized: 65 ms against 92 ms). A client's LM head is
/// one product, which gains nothing here (1.62 ms against 1.65), and stays
/// off the pool's queue.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    #[cfg(not(target_arch = "wasm32"))]
    {
        rayon::scope(|_| f())
    }
    #[cfg(target_arch = "wasm32")]
    {
        f()
    }
}
