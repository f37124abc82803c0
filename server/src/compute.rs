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

use corolla_model::{BlockSpan, ModelError, SessionCache, SpanAdapter, Tensor};
use corolla_shared::hop_trace;
use tokio::sync::oneshot;

use crate::admission::CacheBudget;
use crate::error::ComputeError;
use crate::metrics::ServerMetrics;
use crate::shared_prefix::{InputHistory, SharedPrefixes, PAGE_POSITIONS};

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
    /// Whether sessions reuse the pages of prefixes other sessions computed
    /// (`shared_prefix.rs`).
    pub share_prefixes: bool,
}

impl Default for ComputeSettings {
    fn default() -> Self {
        ComputeSettings {
            max_chunk_tokens: 256,
            max_batch: 64,
            max_batch_wait: Duration::from_millis(10),
            share_prefixes: true,
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
    /// Prefill positions answered from shared prefix pages.
    pub prefix_positions_reused: u64,
    pub prefix_pages_stored: u64,
    pub prefix_pages_evicted: u64,
    /// Cache positions the shared prefix pages hold now.
    pub prefix_tokens_held: u64,
}

impl ComputeStats {
    pub fn figures(&self) -> ComputeFigures {
        let get = |n: &AtomicU64| n.load(Ordering::Relaxed);
        ComputeFigures {
            decode_batches: get(&self.decode_batches),
            decode_steps: get(&self.decode_steps),
            largest_batch: get(&self.largest_batch),
            prefill_chunks: get(&self.prefill_chunks),
            ..ComputeFigures::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SessionId(u64);

type StepReply = oneshot::Sender<Result<Tensor, ComputeError>>;

enum Job {
    Open {
        id: SessionId,
        cache: SessionCache,
        /// The name of the adapter the cache runs with.
        adapter: Option<String>,
    },
    Step(StepJob),
    Close {
        id: SessionId,
    },
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
    prefixes: Option<Arc<SharedPrefixes>>,
}

impl ComputeCore {
    /// Starts the core's thread; it ends when the last handle is dropped.
    /// Shared prefix pages take their room from `budget`.
    pub fn start(
        span: Arc<BlockSpan>,
        settings: ComputeSettings,
        metrics: ServerMetrics,
        budget: Arc<CacheBudget>,
    ) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel();
        let stats = Arc::new(ComputeStats::default());
        let prefixes = settings.share_prefixes.then(|| SharedPrefixes::new(budget));
        let scheduler = Scheduler {
            span: span.clone(),
            settings,
            stats: stats.clone(),
            metrics,
            prefixes: prefixes.clone(),
            histories: HashMap::new(),
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
            prefixes,
        })
    }

    /// The span's shared prefix pages, unless sharing is off.
    pub fn prefixes(&self) -> Option<&Arc<SharedPrefixes>> {
        self.prefixes.as_ref()
    }

    pub fn span(&self) -> &Arc<BlockSpan> {
        &self.span
    }

    /// What the core and its shared prefix pages have done so far.
    pub fn figures(&self) -> ComputeFigures {
        let mut figures = self.stats.figures();
        if let Some(prefixes) = &self.prefixes {
            let stats = prefixes.stats();
            let get = |n: &AtomicU64| n.load(Ordering::Relaxed);
            figures.prefix_positions_reused = get(&stats.reused_positions);
            figures.prefix_pages_stored = get(&stats.stored_pages);
            figures.prefix_pages_evicted = get(&stats.evicted_pages);
            figures.prefix_tokens_held = prefixes.tokens_held() as u64;
        }
        figures
    }

    /// Allocates a cache for `layers` and `max_length` positions whose
    /// steps run with `adapter` (a name and its matrices), off the async
    /// threads, and off the core's, so no batch waits for it, and hands it
    /// to the core.
    pub async fn open(
        &self,
        layers: Range<usize>,
        max_length: usize,
        adapter: Option<(String, SpanAdapter)>,
    ) -> Result<CacheLease, ComputeError> {
        let span = self.span.clone();
        let (name, adapter) = adapter.unzip();
        let cache = tokio::task::spawn_blocking(move || {
            let mut cache = span.new_cache_for(layers, max_length)?;
            cache.set_adapter(adapter);
            Ok::<_, ModelError>(cache)
        })
        .await
        .map_err(|_| ComputeError::Lost("the cache allocation failed"))??;
        let id = SessionId(self.next_id.fetch_add(1, Ordering::Relaxed));
        self.jobs
            .send(Job::Open {
                id,
                cache,
                adapter: name,
            })
            .map_err(|_| ComputeError::Lost("the compute core has stopped"))?;
        Ok(CacheLease {
            id,
            jobs: self.jobs.clone(),
            span: self.span.clone(),
        })
    }
}

/// One session's cache inside the core; dropping the lease frees it.
pub(crate) struct CacheLease {
    id: SessionId,
    jobs: mpsc::Sender<Job>,
    span: Arc<BlockSpan>,
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
        // The core's thread wakes for this step; its gang wakes with it.
        self.span.expect_work();
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
    prefixes: Option<Arc<SharedPrefixes>>,
    /// The inputs each session's cache holds, while prefixes are shared.
    histories: HashMap<SessionId, InputHistory>,
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
            Job::Open { id, cache, adapter } => {
                if self.prefixes.is_some() {
                    let history =
                        InputHistory::new(cache.layers(), self.span.dtype(), adapter.as_deref());
                    self.histories.insert(id, history);
                }
                self.caches.insert(id, cache);
            }
            Job::Close { id } => {
                self.caches.remove(&id);
                self.histories.remove(&id);
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
            self.record_inputs(job.id, job.start, &job.input);
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
        let block = span.range().start;
        tracing::trace!(name: hop_trace::FORWARD_STARTED, target: hop_trace::TARGET, block);
        let outputs = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Tensor>, ModelError> {
            let mut steps: Vec<(Tensor, usize, &mut SessionCache)> = batch
                .iter_mut()
                .map(|(job, cache)| (job.input.clone(), job.start, cache))
                .collect();
            span.forward_decode_batch(&mut steps)
        }));
        tracing::trace!(name: hop_trace::FORWARD_DONE, target: hop_trace::TARGET, block);
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
        let Some(cache) = self.caches.get(&id) else {
            prefill
                .job
                .answer(Err(ComputeError::Lost("the session was closed")));
            return;
        };
        let total = prefill.job.input.dims().get(1).copied().unwrap_or(0);
        if prefill.done == 0 {
            let (dims, start) = (prefill.job.input.dims(), prefill.job.start);
            if let Err(e) = self.span.check_step(dims, start, cache) {
                prefill.job.answer(Err(e.into()));
                return;
            }
            self.record_inputs(id, start, &prefill.job.input);
            prefill.outputs = self.reuse_prefix(id, start, total);
            prefill.done = prefill.outputs.len() * PAGE_POSITIONS;
            if prefill.done == total {
                self.finish_prefill(prefill);
                return;
            }
        }
        let Some(cache) = self.caches.get_mut(&id) else {
            return prefill
                .job
                .answer(Err(ComputeError::Lost("the session was closed")));
        };
        let input = &prefill.job.input;
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
                self.finish_prefill(prefill);
            }
            Ok(Err(e)) => prefill.job.answer(Err(e.into())),
            Err(_) => {
                tracing::error!("a prefill chunk panicked; its session ends");
                self.caches.remove(&id);
                self.histories.remove(&id);
                prefill
                    .job
                    .answer(Err(ComputeError::Lost("the step computation panicked")));
            }
        }
    }

    /// Answers a prefill all of whose positions are computed or reused, and
    /// keeps its new pages for later sessions.
    fn finish_prefill(&mut self, mut prefill: Prefill) {
        let whole = match prefill.outputs.len() {
            1 => prefill.outputs.remove(0),
            _ => match Tensor::cat(&prefill.outputs, 1) {
                Ok(whole) => whole,
                Err(e) => return prefill.job.answer(Err(ModelError::Candle(e).into())),
            },
        };
        let id = prefill.job.id;
        let positions = prefill.job.start..prefill.job.start + prefill.done;
        if let (Some(prefixes), Some(history), Some(cache)) = (
            &self.prefixes,
            self.histories.get(&id),
            self.caches.get(&id),
        ) {
            if let Err(e) = prefixes.keep(history, positions, &whole, cache) {
                tracing::warn!(error = %e, "a prefix page could not be kept");
            }
        }
        prefill.job.answer(Ok(whole));
    }

    /// Notes the inputs of a step that passed its checks.
    fn record_inputs(&mut self, id: SessionId, start: usize, input: &Tensor) {
        let Some(history) = self.histories.get_mut(&id) else {
            return;
        };
        let recorded = input
            .to_dtype(self.span.dtype())
            .map_err(ModelError::from)
            .and_then(|input| history.record(start, &input));
        if let Err(e) = recorded {
            // Without its inputs the session neither reuses nor shares pages.
            tracing::warn!(error = %e, "a step's inputs could not be hashed");
            self.histories.remove(&id);
        }
    }

    /// Copies the stored pages a prefill starts with into its session's
    /// cache; their output rows, in order.
    fn reuse_prefix(&mut self, id: SessionId, start: usize, total: usize) -> Vec<Tensor> {
        let (Some(prefixes), Some(history), Some(cache)) = (
            &self.prefixes,
            self.histories.get(&id),
            self.caches.get_mut(&id),
        ) else {
            return Vec::new();
        };
        match prefixes.reuse(history, start, start + total, cache) {
            Ok(outputs) => outputs,
            Err(e) => {
                tracing::warn!(error = %e, "stored prefix pages could not be reused");
                Vec::new()
            }
        }
    }
}
