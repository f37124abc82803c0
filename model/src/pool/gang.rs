//! A gang of threads that share the items of one job at a time with the
//! thread that posts it, and spin a short while for the next job before
//! they park, as llama.cpp's thread pool polls between a graph's nodes.
//!
//! A decode step of a kept-quantized span is about four products per
//! layer, each 10-30 µs of work on two cores, with a little single-threaded
//! math between them. Rayon's workers park after a few idle yields, so most
//! products began by waking a parked thread, which cost about as much as the
//! product; a gang worker is still spinning when the next one arrives.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker spins for the next job of a forward before it parks:
/// longer than the gaps between a step's products.
const SPIN: Duration = Duration::from_micros(500);

/// Worker threads sharing jobs with the threads that post them.
pub(crate) struct Gang {
    shared: Arc<Shared>,
    /// One job at a time: a caller that finds the gang busy (two sessions
    /// of one span on two threads) runs its job alone.
    posting: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

struct Shared {
    /// The posted job, or null. Valid while `active` counts a worker that
    /// loaded it: its poster clears it, then waits for `active` to reach 0.
    job: AtomicPtr<Job<'static>>,
    /// Which job `job` is (pointers of jobs on one stack repeat).
    epoch: AtomicU64,
    active: AtomicUsize,
    parked: AtomicUsize,
    /// Forwards running with this gang: workers spin only while one runs
    /// (a worker spinning after a forward would take a core from whatever
    /// the thread does next, such as another span's or the head's products).
    holders: AtomicUsize,
    /// Until when workers spin for a forward announced to come
    /// ([`Gang::expect_work`]), in nanoseconds after `born`.
    expected_until: AtomicU64,
    born: Instant,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

/// A job: `items` calls of `run`, taken in turn by whoever is free.
struct Job<'a> {
    run: &'a (dyn Fn(usize) + Sync),
    items: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    fn work(&self) {
        loop {
            let item = self.next.fetch_add(1, Ordering::Relaxed);
            if item >= self.items {
                return;
            }
            (self.run)(item);
        }
    }
}

impl Gang {
    /// A gang of `threads` in all: the poster and `threads - 1` workers (fewer
    /// where the system refuses threads).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            holders: AtomicUsize::new(0),
            expected_until: AtomicU64::new(0),
            born: Instant::now(),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map_while(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("corolla-gang-{i}"))
                    .spawn(move || work(&shared))
                    .map_err(|e| tracing::warn!("a compute thread did not start: {e}"))
                    .ok()
            })
            .collect();
        Gang {
            shared,
            posting: Mutex::new(()),
            workers,
        }
    }

    /// Keeps the workers spinning between jobs until the hold is dropped
    /// (a forward pass holds its span's gang).
    pub fn hold(&self) -> Hold<'_> {
        self.shared.holders.fetch_add(1, Ordering::SeqCst);
        Hold(&self.shared)
    }

    /// Wakes the parked workers to spin for a forward that is about to
    /// start (for at most [`SPIN`]), so that their wake-up overlaps the
    /// poster's own instead of following its first product: a server
    /// step wakes its compute thread, which used to wake the gang only at
    /// its first product, ~40-80 µs later on these two cores.
    pub fn expect_work(&self) {
        let until = self.shared.now() + SPIN.as_nanos() as u64;
        self.shared
            .expected_until
            .fetch_max(until, Ordering::SeqCst);
        if self.shared.parked.load(Ordering::SeqCst) > 0 {
            let _lock = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
    }

    /// Threads that share a job: the workers and the poster.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `run(item)` for every item in `0..items`, on this thread and
    /// the workers, and returns when all are done.
    pub fn run(&self, items: usize, run: &(dyn Fn(usize) + Sync)) {
        let _posting = match self.posting.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return (0..items).for_each(run),
        };
        let job = Job {
            run,
            items,
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        let shared = &*self.shared;
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        // The lifetime is erased for the workers; `Posted`'s drop (also
        // on unwinding) waits until none of them holds the job any more.
        let pointer = (&job as *const Job<'_>).cast_mut().cast::<Job<'static>>();
        shared.job.store(pointer, Ordering::SeqCst);
        let posted = Posted(shared);
        if shared.parked.load(Ordering::SeqCst) > 0 {
            let _lock = shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            shared.wake.notify_all();
        }
        job.work();
        drop(posted);
        if job.panicked.load(Ordering::SeqCst) {
            panic!("a compute thread's share of a product panicked");
        }
    }
}

impl Shared {
    fn now(&self) -> u64 {
        self.born.elapsed().as_nanos() as u64
    }

    /// Whether a forward was announced and has not been waited for too long.
    fn expected(&self) -> bool {
        self.now() < self.expected_until.load(Ordering::Relaxed)
    }
}

/// While it lives, the gang's workers spin between jobs.
pub(crate) struct Hold<'a>(&'a Shared);

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.0.holders.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Unposts a job when its poster is done with it, and waits for the
/// workers that hold it.
struct Posted<'a>(&'a Shared);

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        self.0.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        let mut spins = 0u32;
        while self.0.active.load(Ordering::SeqCst) != 0 {
            spins += 1;
            match spins < 1 << 12 {
                true => std::hint::spin_loop(),
                false => std::thread::yield_now(),
            }
        }
    }
}

impl Drop for Gang {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _lock = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl std::fmt::Debug for Gang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gang")
            .field("threads", &self.threads())
            .finish()
    }
}

/// A worker: takes items of each new job, spins for the next, parks.
fn work(shared: &Shared) {
    let mut done_epoch = 0;
    let mut idle_since = Instant::now();
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let posted = !shared.job.load(Ordering::Relaxed).is_null();
        if posted && shared.epoch.load(Ordering::Relaxed) != done_epoch {
            shared.active.fetch_add(1, Ordering::SeqCst);
            let job = shared.job.load(Ordering::SeqCst);
            // Read after the pointer: at least the epoch of the job it points to.
            let epoch = shared.epoch.load(Ordering::SeqCst);
            if !job.is_null() {
                // SAFETY: the poster clears `job` and then waits for `active`
                // to reach 0 before the job leaves its stack; this worker
                // counted itself in `active` before it loaded the pointer.
                let job = unsafe { &*job };
                if catch_unwind(AssertUnwindSafe(|| job.work())).is_err() {
                    job.panicked.store(true, Ordering::SeqCst);
                }
                done_epoch = epoch;
            }
            shared.active.fetch_sub(1, Ordering::SeqCst);
            idle_since = Instant::now();
            continue;
        }
        let held = shared.holders.load(Ordering::Relaxed) > 0 && idle_since.elapsed() < SPIN;
        if held || shared.expected() {
            std::hint::spin_loop();
            continue;
        }
        let mut lock = shared.lock.lock().unwrap_or_else(|p| p.into_inner());
        shared.parked.fetch_add(1, Ordering::SeqCst);
        while !shared.stop.load(Ordering::SeqCst)
            && !shared.expected()
            && (shared.job.load(Ordering::SeqCst).is_null()
                || shared.epoch.load(Ordering::SeqCst) == done_epoch)
        {
            lock = shared.wake.wait(lock).unwrap_or_else(|p| p.into_inner());
        }
        shared.parked.fetch_sub(1, Ordering::SeqCst);
        drop(lock);
        idle_since = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Every item runs exactly once, job after job, held and not, with
    /// pauses long enough for the workers to park between some of them.
    #[test]
    fn every_item_runs_once_per_job() {
        let gang = Gang::new(3);
        let mut hold = Some(gang.hold());
        for round in 0..200 {
            if round == 100 {
                // The rest without a hold: workers park after each job.
                hold = None;
            }
            let counts: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
            gang.run(counts.len(), &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
            if round % 50 == 0 {
                std::thread::sleep(SPIN * 3);
            }
        }
        drop(hold);
    }

    /// An announced forward wakes a parked worker, which then takes part
    /// in the next job; with nothing posted it parks again after a while.
    #[test]
    fn an_announced_forward_wakes_the_workers() {
        let gang = Gang::new(2);
        let parked = |gang: &Gang| gang.shared.parked.load(Ordering::SeqCst);
        let wait_until = |done: &dyn Fn() -> bool| {
            let start = Instant::now();
            // Polled without sleeping: the worker is awake for `SPIN` only.
            while !done() {
                assert!(start.elapsed() < Duration::from_secs(5), "timed out");
                std::thread::yield_now();
            }
        };
        wait_until(&|| parked(&gang) == 1);
        // Announced again on every poll, so that a test thread that gets
        // the core late still finds the worker awake.
        wait_until(&|| {
            gang.expect_work();
            parked(&gang) == 0
        });
        let threads = Mutex::new(HashSet::new());
        gang.run(64, &|_| {
            threads.lock().unwrap().insert(std::thread::current().id());
            std::thread::sleep(Duration::from_micros(200));
        });
        assert_eq!(
            threads.into_inner().unwrap().len(),
            2,
            "both threads computed"
        );
        wait_until(&|| parked(&gang) == 1);
    }

    /// A second poster while a job runs computes its own job alone.
    #[test]
    fn concurrent_posters_both_finish() {
        let gang = Arc::new(Gang::new(2));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let gang = gang.clone();
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        let sum = AtomicUsize::new(0);
                        gang.run(64, &|i| {
                            sum.fetch_add(i, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    /// A panicking item reaches the poster, and the gang serves the next job.
    #[test]
    fn a_panic_reaches_the_poster() {
        let gang = Gang::new(2);
        let result = catch_unwind(AssertUnwindSafe(|| {
            gang.run(16, &|i| {
                if i == 9 {
                    panic!("item 9");
                }
            })
        }));
        assert!(result.is_err());
        let count = AtomicUsize::new(0);
        gang.run(16, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }
}
