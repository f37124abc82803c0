//! The server's Prometheus metrics, served as OpenMetrics text at `GET
//! /metrics` on `--http-port`: what its sessions and compute core have done,
//! its sessions and KV cache right now, and (in the same registry) libp2p's
//! byte counts per transport. Session handlers, the compute core and the
//! acceptors report events through [`ServerMetrics`]; what a figure means is
//! decided here.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use corolla_shared::protocol::ErrorCode;
use libp2p::PeerId;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::admission::CacheBudget;
use crate::quota::Quota;

/// What `GET /metrics` answers with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long after a session was cut short a new session of the same peer
/// for the same blocks counts as its recovery.
const RECOVERY_WINDOW: Duration = Duration::from_secs(600);
/// Sessions cut short remembered at once; a flood of them must not grow
/// the map without bound (recoveries past it go uncounted).
const MAX_REMEMBERED: usize = 4096;

/// What a step was, for the per-kind series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepKind {
    /// The client's step of several positions (a prompt, a replayed chunk,
    /// a step with drafts).
    Prefill,
    /// The client's step of one position.
    Decode,
    /// A step another server pushed to this session.
    Push,
}

impl StepKind {
    pub fn of(pushed_in: bool, positions: usize) -> Self {
        match (pushed_in, positions) {
            (true, _) => StepKind::Push,
            (false, 1) => StepKind::Decode,
            (false, _) => StepKind::Prefill,
        }
    }

    fn label(self) -> KindLabel {
        let kind = match self {
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
            StepKind::Push => "push",
        };
        KindLabel { kind }
    }
}

/// The `code` label: the protocol's error code in snake case.
fn code_name(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::BadFrame => "bad_frame",
        ErrorCode::UnknownSession => "unknown_session",
        ErrorCode::WrongModel => "wrong_model",
        ErrorCode::SpanNotServed => "span_not_served",
        ErrorCode::BadShape => "bad_shape",
        ErrorCode::TooLong => "too_long",
        ErrorCode::Busy => "busy",
        ErrorCode::Timeout => "timeout",
        ErrorCode::Internal => "internal",
        ErrorCode::ShuttingDown => "shutting_down",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

type HistogramFamily = Family<KindLabel, Histogram, fn() -> Histogram>;

/// 0.5 ms to ~16 s: a decode step on a small span to a long prefill on a slow one.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Where the live gauges are read from at each scrape.
struct Live {
    sessions: Arc<Quota>,
    cache: Arc<CacheBudget>,
}

/// Every series of this server, and the registry that encodes them.
/// Cloning is cheap: all clones report into the same series.
#[derive(Clone)]
pub struct ServerMetrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Mutex<Registry>,
    sessions_open: Gauge,
    sessions_opened: Counter,
    steps: Family<KindLabel, Counter>,
    step_latency: HistogramFamily,
    decode_batch_size: Histogram,
    tokens: Counter,
    cache_used: Gauge,
    cache_left: Gauge,
    errors: Family<CodeLabel, Counter>,
    recoveries: Counter,
    pushes: Family<OutcomeLabel, Counter>,
    relay_circuits: Gauge,
    live: OnceLock<Live>,
    /// Sessions that ended without their client closing them, by peer and
    /// blocks, and when.
    cut_short: Mutex<HashMap<(PeerId, Range<usize>), Instant>>,
}

impl ServerMetrics {
    /// Adds the server's series to `registry`, which may already hold
    /// others (libp2p's byte counts); all of it is served at `/metrics`.
    pub fn new(mut registry: Registry) -> Self {
        let inner = Inner {
            registry: Mutex::new(Registry::default()),
            sessions_open: Gauge::default(),
            sessions_opened: Counter::default(),
            steps: Family::default(),
            step_latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            decode_batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 13)),
            tokens: Counter::default(),
            cache_used: Gauge::default(),
            cache_left: Gauge::default(),
            errors: Family::default(),
            recoveries: Counter::default(),
            pushes: Family::default(),
            relay_circuits: Gauge::default(),
            live: OnceLock::new(),
            cut_short: Mutex::new(HashMap::new()),
        };
        let r = &mut registry;
        r.register(
            "corolla_sessions_open",
            "Inference sessions open now",
            inner.sessions_open.clone(),
        );
        r.register(
            "corolla_sessions_opened",
            "Inference sessions opened",
            inner.sessions_opened.clone(),
        );
        r.register(
            "corolla_steps",
            "Steps computed, by kind: the client's prefill (several positions) or \
             decode (one position), or a step another server pushed",
            inner.steps.clone(),
        );
        r.register_with_unit(
            "corolla_step_latency",
            "Time from a step's arrival to its output (queue, batch and compute), by kind",
            Unit::Seconds,
            inner.step_latency.clone(),
        );
        r.register(
            "corolla_decode_batch_size",
            "Decode steps computed in one batched forward",
            inner.decode_batch_size.clone(),
        );
        r.register(
            "corolla_tokens",
            "Positions computed through this server's blocks",
            inner.tokens.clone(),
        );
        r.register(
            "corolla_cache_tokens_used",
            "KV-cache positions reserved by open sessions",
            inner.cache_used.clone(),
        );
        r.register(
            "corolla_cache_tokens_left",
            "KV-cache positions free for new sessions",
            inner.cache_left.clone(),
        );
        r.register(
            "corolla_errors",
            "Error frames sent to peers, by protocol error code",
            inner.errors.clone(),
        );
        r.register(
            "corolla_recoveries_served",
            "Sessions opened to replay a prefix, as far as this server can tell: \
             a peer's new session for the same blocks within 10 minutes after its \
             earlier one here expired or broke (a replay moved here from another \
             server looks like any new session and is not counted)",
            inner.recoveries.clone(),
        );
        r.register(
            "corolla_push_steps",
            "Steps pushed between servers: received (taken into a session's inbox), \
             sent (the output reached the next server), failed (could not be sent; \
             the client carried it)",
            inner.pushes.clone(),
        );
        r.register(
            "corolla_relay_circuits",
            "Relay circuits this server holds open",
            inner.relay_circuits.clone(),
        );
        *inner.registry.lock().unwrap_or_else(|p| p.into_inner()) = registry;
        ServerMetrics {
            inner: Arc::new(inner),
        }
    }

    /// Reads the sessions and cache gauges from these at each scrape (the
    /// first call wins: every span a server hosts shares them).
    pub(crate) fn watch(&self, sessions: Arc<Quota>, cache: Arc<CacheBudget>) {
        let _ = self.inner.live.set(Live { sessions, cache });
    }

    /// A step computed: `positions` of them, in `elapsed` from arrival to output.
    pub(crate) fn step_served(&self, kind: StepKind, positions: usize, elapsed: Duration) {
        let label = kind.label();
        self.inner.steps.get_or_create(&label).inc();
        self.inner
            .step_latency
            .get_or_create(&label)
            .observe(elapsed.as_secs_f64());
        self.inner.tokens.inc_by(positions as u64);
    }

    pub(crate) fn decode_batch(&self, size: usize) {
        self.inner.decode_batch_size.observe(size as f64);
    }

    /// An error frame written (or about to be) to a peer.
    pub(crate) fn error_sent(&self, code: ErrorCode) {
        self.inner
            .errors
            .get_or_create(&CodeLabel {
                code: code_name(code),
            })
            .inc();
    }

    pub(crate) fn push_received(&self) {
        self.push_outcome("received");
    }

    /// A push this server tried: `delivered` when it left for the next server.
    pub(crate) fn push_sent(&self, delivered: bool) {
        self.push_outcome(if delivered { "sent" } else { "failed" });
    }

    fn push_outcome(&self, outcome: &'static str) {
        self.inner
            .pushes
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// A session opened by `peer` for `layers`.
    ///
    /// The protocol does not say whether a session is a replay (a replay
    /// sends the lost session's history exactly as it was first sent), so a
    /// recovery is what this server can recognise: `peer` comes back for the
    /// same blocks soon after its session here expired or broke, which is
    /// what a client does to rebuild a cache this server dropped.
    pub(crate) fn session_opened(&self, peer: PeerId, layers: Range<usize>) {
        self.inner.sessions_opened.inc();
        let earlier = self.cut_short().remove(&(peer, layers));
        if earlier.is_some_and(|at| at.elapsed() <= RECOVERY_WINDOW) {
            self.inner.recoveries.inc();
        }
    }

    /// `peer`'s session for `layers` ended without a Close: it idled past
    /// the session timeout, its stream broke, or a reply could not be sent.
    pub(crate) fn session_cut_short(&self, peer: PeerId, layers: Range<usize>) {
        let mut cut = self.cut_short();
        if cut.len() >= MAX_REMEMBERED {
            cut.retain(|_, at| at.elapsed() <= RECOVERY_WINDOW);
        }
        if cut.len() < MAX_REMEMBERED {
            cut.insert((peer, layers), Instant::now());
        }
    }

    /// Relay circuits held now (set by whoever watches the node's relay events).
    pub fn set_relay_circuits(&self, n: usize) {
        self.inner.relay_circuits.set(to_i64(n));
    }

    /// Registers further series (the registry is served whole at `/metrics`).
    pub fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        f(&mut self.registry())
    }

    /// Everything, as OpenMetrics text ending in `# EOF`.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        if let Some(live) = self.inner.live.get() {
            self.inner.sessions_open.set(to_i64(live.sessions.in_use()));
            self.inner.cache_used.set(to_i64(live.cache.used()));
            self.inner.cache_left.set(to_i64(live.cache.free()));
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry())?;
        Ok(out)
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.inner
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn cut_short(&self) -> MutexGuard<'_, HashMap<(PeerId, Range<usize>), Instant>> {
        self.inner
            .cut_short
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}

fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    #[test]
    fn events_become_series_and_the_text_ends_in_eof() {
        let metrics = ServerMetrics::new(Registry::default());
        let sessions = Quota::new(4, 4);
        let cache = CacheBudget::new(1000);
        metrics.watch(sessions.clone(), cache.clone());
        let _slot = sessions
            .try_take(crate::quota::Holder {
                peer: PeerId::random(),
                source: None,
            })
            .unwrap();
        let _reserved = cache.try_reserve(300).unwrap();
        metrics.step_served(StepKind::of(false, 7), 7, Duration::from_millis(3));
        metrics.step_served(StepKind::of(false, 1), 1, Duration::from_millis(1));
        metrics.step_served(StepKind::of(true, 1), 1, Duration::from_millis(1));
        metrics.decode_batch(3);
        metrics.error_sent(ErrorCode::Busy);
        metrics.push_sent(true);
        metrics.push_sent(false);
        metrics.set_relay_circuits(2);
        let text = metrics.encode().unwrap();
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(value(&text, "corolla_steps_total{kind=\"prefill\"}"), 1.0);
        assert_eq!(value(&text, "corolla_steps_total{kind=\"push\"}"), 1.0);
        assert_eq!(value(&text, "corolla_tokens_total"), 9.0);
        assert_eq!(
            value(&text, "corolla_step_latency_seconds_count{kind=\"decode\"}"),
            1.0
        );
        assert_eq!(value(&text, "corolla_decode_batch_size_count"), 1.0);
        assert_eq!(value(&text, "corolla_sessions_open"), 1.0);
        assert_eq!(value(&text, "corolla_cache_tokens_used"), 300.0);
        assert_eq!(value(&text, "corolla_cache_tokens_left"), 700.0);
        assert_eq!(value(&text, "corolla_errors_total{code=\"busy\"}"), 1.0);
        assert_eq!(
            value(&text, "corolla_push_steps_total{outcome=\"failed\"}"),
            1.0
        );
        assert_eq!(value(&text, "corolla_relay_circuits"), 2.0);
    }

    #[test]
    fn a_peer_back_for_the_blocks_of_a_broken_session_is_a_recovery() {
        let metrics = ServerMetrics::new(Registry::default());
        let (a, b) = (PeerId::random(), PeerId::random());
        metrics.session_opened(a, 0..2);
        metrics.session_cut_short(a, 0..2);
        metrics.session_opened(b, 0..2);
        metrics.session_opened(a, 1..2);
        assert_eq!(metrics.inner.recoveries.get(), 0);
        metrics.session_opened(a, 0..2);
        assert_eq!(metrics.inner.recoveries.get(), 1);
        metrics.session_opened(a, 0..2);
        assert_eq!(metrics.inner.recoveries.get(), 1, "counted once");
        assert_eq!(metrics.inner.sessions_opened.get(), 5);
    }
}
