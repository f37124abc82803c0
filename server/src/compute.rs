//! The compute core: one thread owns the span and every session's KV cache
//! and schedules their steps. Session handlers only parse and check requests
//! and hand steps over a queue. Decode steps (one position each) that are
//! waiting when the previous batch finishes run as one forward, so sixteen
//! users cost about one read of the weights per token, not sixteen; long
//! prefills run in chunks of at most `max_chunk_tokens` between the batches,
//! so one long prompt does not stall everybody else.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use corolla_model::{BlockSpan, ModelError, SessionCache, Tensor};
use tokio::sync::oneshot;

use crate::error::ComputeError;
use crate::metrics::ServerMetrics;

/// How the scheduler cuts work.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ComputeSettings {
    /// Prefill positions computed between two decode batches (0: no limit).
    pub max_chunk_tokens: usize,
    /// Decode steps in one forward.
    pub max_batch: usize,
    /// How long a decode batch may wait for the steps of sessions that were
    /// decoding a moment ago (at most a quarter of the last batch's time),
    /// so that sessions whose clients answer a little later join the batch
    /// instead of forming the next one.
    pub max_batch_wait: Duration,
}

impl Default for ComputeSettings {
    fn default() -> Self {
        ComputeSettings {
            max_chunk_tokens: 256,
            max_batch: 64,
            max_batch_wait: Duration::from_millis(10),
        }
    }
}

/// What the core has done, for status pages and tests.
#[derive(Debug, Default)]
pub(crate) struct ComputeStats {
    /// Forwards of decode steps (a batch of one counts).
    pub decode_batches: AtomicU64,
    /// Decode steps computed in those forwards.
    pub decode_steps: AtomicU64,
    /// The largest decode batch so far.
    pub largest_batch: AtomicU64,
    /// Prefill chunks computed.
    pub prefill_chunks: AtomicU64,
}

/// A copy of [`ComputeStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ComputeFigures {
    pub decode_batches: u64,
    pub decode_steps: u64,
    pub largest_batch: u64,
    pub prefill_chunks: u64,
}

impl ComputeStats {
    pub fn figures(&self) -> ComputeFigures {
        let get = |n: &AtomicU64| n.load(Ordering::Relaxed);
        ComputeFigures {
            decode_batches: get(&self.decode_batches),
            decode_steps: get(&self.decode_steps),
            largest_batch: get(&self.largest_batch),
            prefill_chunks: get(&self.prefill_chunks),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SessionId(u64);

type StepReply = oneshot::Sender<Result<Tensor, ComputeError>>;

enum Job {
    Open { id: SessionId, cache: SessionCache },
    Step(StepJob),
    Close { id: SessionId },
}

struct StepJob {
    id: SessionId,
    start: usize,
    input: Tensor,
    reply: StepReply,
}

impl StepJob {
    fn answer(self, result: Result<Tensor, ComputeError>) {
        // The handler may have gone (its stream closed): nobody to tell.
        let _ = self.reply.send(result);
    }
}

/// The handle every session handler holds; cloning it is cheap.
#[derive(Clone)]
pub(crate) struct ComputeCore {
    span: Arc<BlockSpan>,
    jobs: mpsc::Sender<Job>,
    next_id: Arc<AtomicU64>,
    stats: Arc<ComputeStats>,
}

impl ComputeCore {
    /// Starts the core's thread; it ends when the last handle is dropped.
    pub fn start(
        span: Arc<BlockSpan>,
        settings: ComputeSettings,
        metrics: ServerMetrics,
    ) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel();
        let stats = Arc::new(ComputeStats::default());
        let scheduler = Scheduler {
            span: span.clone(),
            settings,
            stats: stats.clone(),
            metrics,
            caches: HashMap::new(),
            decodes: Vec::new(),
            prefills: VecDeque::new(),
            decoding: HashMap::new(),
            last_batch_time: Duration::ZERO,
        };
        std::thread::Builder::new()
            .name("corolla-compute".into())
            .spawn(move || scheduler.run(queue))?;
        Ok(ComputeCore {
            span,
            jobs,
            next_id: Arc::new(AtomicU64::new(0)),
            stats,
        })
    }

    pub fn span(&self) -> &Arc<BlockSpan> {
        &self.span
    }

    pub fn stats(&self) -> &ComputeStats {
        &self.stats
    }

    /// Allocates a cache for `layers` and `max_length` positions (off the
    /// async threads, and off the core's, so no batch waits for it) and
    /// hands it to the core.
    pub async fn open(
        &self,
        layers: Range<usize>,
        max_length: usize,
    ) -> Result<CacheLease, ComputeError> {
        let span = self.span.clone();
        let cache = tokio::task::spawn_blocking(move || span.new_cache_for(layers, max_length))
            .await
            .map_err(|_| ComputeError::Lost("the cache allocation failed"))??;
        let id = SessionId(self.next_id.fetch_add(1, Ordering::Relaxed));
        self.jobs
            .send(Job::Open { id, cache })
            .map_err(|_| ComputeError::Lost("the compute core has stopped"))?;
        Ok(CacheLease {
            id,
            jobs: self.jobs.clone(),
        })
    }
}

/// One session's cache inside the core; dropping the lease frees it.
pub(crate) struct CacheLease {
    id: SessionId,
    jobs: mpsc::Sender<Job>,
}

impl CacheLease {
    /// Runs `input` (`[1, T, hidden]`) at positions from `start` through the span.
    pub async fn step(&self, input: Tensor, start: usize) -> Result<Tensor, ComputeError> {
        let (reply, answer) = oneshot::channel();
        let job = StepJob {
            id: self.id,
            start,
            input,
            reply,
        };
        self.jobs
            .send(Job::Step(job))
            .map_err(|_| ComputeError::Lost("the compute core has stopped"))?;
        answer
            .await
            .map_err(|_| ComputeError::Lost("the compute core has stopped"))?
    }
}

impl Drop for CacheLease {
    fn drop(&mut self) {
        let _ = self.jobs.send(Job::Close { id: self.id });
    }
}

struct Prefill {
    job: StepJob,
    done: usize,
    outputs: Vec<Tensor>,
}

struct Scheduler {
    span: Arc<BlockSpan>,
    settings: ComputeSettings,
    stats: Arc<ComputeStats>,
    metrics: ServerMetrics,
    caches: HashMap<SessionId, SessionCache>,
    decodes: Vec<StepJob>,
    prefills: VecDeque<Prefill>,
    /// When each session last sent a decode step.
    decoding: HashMap<SessionId, Instant>,
    /// How long the last decode batches took, one after another.
    last_batch_time: Duration,
}

impl Scheduler {
    fn run(mut self, queue: mpsc::Receiver<Job>) {
        loop {
            if self.decodes.is_empty() && self.prefills.is_empty() {
                match queue.recv() {
                    Ok(job) => self.take(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = queue.try_recv() {
                self.take(job);
            }
            self.gather_decodes(&queue);
            self.run_decodes();
            self.run_prefill_chunk();
        }
    }

    /// Waits a little for the decode steps of sessions that stepped during
    /// the last two batches and have not sent their next one yet; sessions
    /// that fall silent stop being waited for after two batches.
    fn gather_decodes(&mut self, queue: &mpsc::Receiver<Job>) {
        if self.decodes.is_empty() || !self.prefills.is_empty() {
            return;
        }
        let now = Instant::now();
        let recent = self.last_batch_time * 2;
        self.decoding
            .retain(|_, last| now.duration_since(*last) <= recent);
        let expected = self.decoding.len().min(self.settings.max_batch.max(1));
        let wait = (self.last_batch_time / 4).min(self.settings.max_batch_wait);
        let deadline = now + wait;
        while self.decodes.len() < expected {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match queue.recv_timeout(left) {
                Ok(job) => self.take(job),
                Err(_) => break,
            }
            // A prefill waiting is not held up for stragglers.
            if !self.prefills.is_empty() {
                break;
            }
        }
    }

    fn take(&mut self, job: Job) {
        match job {
            Job::Open { id, cache } => {
                self.caches.insert(id, cache);
            }
            Job::Close { id } => {
                self.caches.remove(&id);
                self.decoding.remove(&id);
            }
            Job::Step(step) => {
                if step.input.dims().get(1) == Some(&1) {
                    self.decoding.insert(step.id, Instant::now());
                    self.decodes.push(step);
                } else {
                    self.decoding.remove(&step.id);
                    self.prefills.push_back(Prefill {
                        job: step,
                        done: 0,
                        outputs: Vec::new(),
                    });
                }
            }
        }
    }

    /// Every waiting decode step, in batches of sessions that run the same layers.
    fn run_decodes(&mut self) {
        if self.decodes.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut groups: HashMap<Range<usize>, Vec<(StepJob, SessionCache)>> = HashMap::new();
        for job in std::mem::take(&mut self.decodes) {
            let Some(cache) = self.caches.remove(&job.id) else {
                job.answer(Err(ComputeError::Lost("the session was closed")));
                continue;
            };
            if let Err(e) = self.span.check_step(job.input.dims(), job.start, &cache) {
                self.caches.insert(job.id, cache);
                job.answer(Err(e.into()));
                continue;
            }
            groups.entry(cache.layers()).or_default().push((job, cache));
        }
        for (_, mut group) in groups {
            while !group.is_empty() {
                let rest = group.split_off(group.len().min(self.settings.max_batch.max(1)));
                self.run_batch(group);
                group = rest;
            }
        }
        self.last_batch_time = started.elapsed();
    }

    fn run_batch(&mut self, mut batch: Vec<(StepJob, SessionCache)>) {
        let size = batch.len();
        let _span = tracing::debug_span!("decode_batch", size).entered();
        let span = &self.span;
        let outputs = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Tensor>, ModelError> {
            let mut steps: Vec<(Tensor, usize, &mut SessionCache)> = batch
                .iter_mut()
                .map(|(job, cache)| (job.input.clone(), job.start, cache))
                .collect();
            span.forward_decode_batch(&mut steps)
        }));
        self.stats.decode_batches.fetch_add(1, Ordering::Relaxed);
        self.stats
            .decode_steps
            .fetch_add(size as u64, Ordering::Relaxed);
        self.stats
            .largest_batch
            .fetch_max(size as u64, Ordering::Relaxed);
        self.metrics.decode_batch(size);
        match outputs {
            Ok(Ok(outputs)) => {
                for ((job, cache), out) in batch.into_iter().zip(outputs) {
                    self.caches.insert(job.id, cache);
                    job.answer(Ok(out));
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, size, "a decode batch failed");
                let message = e.to_string();
                for (job, cache) in batch {
                    self.caches.insert(job.id, cache);
                    job.answer(Err(ComputeError::Failed(message.clone())));
                }
            }
            Err(_) => {
                // The caches may be half written: their sessions end.
                tracing::error!(size, "a decode batch panicked; its sessions end");
                for (job, _) in batch {
                    job.answer(Err(ComputeError::Lost("the step computation panicked")));
                }
            }
        }
    }

    /// The next chunk of the oldest prefill.
    fn run_prefill_chunk(&mut self) {
        let Some(mut prefill) = self.prefills.pop_front() else {
            return;
        };
        let id = prefill.job.id;
        let Some(cache) = self.caches.get_mut(&id) else {
            prefill
                .job
                .answer(Err(ComputeError::Lost("the session was closed")));
            return;
        };
        let input = &prefill.job.input;
        let total = input.dims().get(1).copied().unwrap_or(0);
        if prefill.done == 0 {
            if let Err(e) = self.span.check_step(input.dims(), prefill.job.start, cache) {
                prefill.job.answer(Err(e.into()));
                return;
            }
        }
        let limit = match self.settings.max_chunk_tokens {
            0 => total,
            n => n,
        };
        let len = (total - prefill.done).min(limit);
        let start = prefill.job.start + prefill.done;
        let _span = tracing::debug_span!("prefill_chunk", start, len).entered();
        let span = &self.span;
        let done = prefill.done;
        let computed = catch_unwind(AssertUnwindSafe(|| -> Result<Tensor, ModelError> {
            let chunk = input.narrow(1, done, len)?;
            span.forward(&chunk, start, cache)
        }));
        self.stats.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        match computed {
            Ok(Ok(out)) => {
                prefill.outputs.push(out);
                prefill.done += len;
                if prefill.done < total {
                    self.prefills.push_front(prefill);
                    return;
                }
                let whole = if prefill.outputs.len() == 1 {
                    Ok(prefill.outputs.remove(0))
                } else {
                    Tensor::cat(&prefill.outputs, 1).map_err(|e| ModelError::Candle(e).into())
                };
                prefill.job.answer(whole);
            }
            Ok(Err(e)) => prefill.job.answer(Err(e.into())),
            Err(_) => {
                tracing::error!("a prefill chunk panicked; its session ends");
                self.caches.remove(&id);
                prefill
                    .job
                    .answer(Err(ComputeError::Lost("the step computation panicked")));
            }
        }
    }
}
