//! Where a swarm token's time goes: a tracing layer that timestamps the
//! hop events (`corolla_shared::hop_trace`) the client and the servers of
//! this process emit while it records, and the mean time per decode token
//! of each stage between them.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use corolla_shared::hop_trace as hop;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::{Filtered, Targets};
use tracing_subscriber::layer::{Context, Layer};

/// One hop event as it happened.
#[derive(Debug, Clone, Copy)]
struct Stamp {
    stage: &'static str,
    /// The emitting span's first block (server events).
    block: Option<u64>,
    /// Microseconds since the recorder was made.
    at_us: f64,
}

/// The process's recorder: off until [`HopRecorder::start`].
pub struct HopRecorder {
    on: AtomicBool,
    stamps: Mutex<Vec<Stamp>>,
    epoch: Instant,
}

/// The recorder every layer of this process feeds.
pub fn recorder() -> &'static HopRecorder {
    static RECORDER: OnceLock<HopRecorder> = OnceLock::new();
    RECORDER.get_or_init(|| HopRecorder {
        on: AtomicBool::new(false),
        stamps: Mutex::new(Vec::new()),
        epoch: Instant::now(),
    })
}

/// A layer for the process's subscriber that passes hop events to
/// [`recorder`] (and nothing else reaches it).
pub fn layer<S: Subscriber>() -> Filtered<RecorderLayer, Targets, S> {
    RecorderLayer.with_filter(Targets::new().with_target(hop::TARGET, tracing::Level::TRACE))
}

/// See [`layer`].
pub struct RecorderLayer;

#[derive(Default)]
struct Block(Option<u64>);

impl Visit for Block {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "block" {
            self.0 = Some(value);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_u64(field, value.max(0) as u64);
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for RecorderLayer {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let recorder = recorder();
        if !recorder.on.load(Ordering::Relaxed) {
            return;
        }
        let at_us = recorder.epoch.elapsed().as_secs_f64() * 1e6;
        let mut block = Block::default();
        event.record(&mut block);
        let stamp = Stamp {
            stage: event.metadata().name(),
            block: block.0,
            at_us,
        };
        recorder
            .stamps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stamp);
    }
}

impl HopRecorder {
    /// Records from now on (what was recorded before is dropped).
    pub fn start(&self) {
        self.stamps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.on.store(true, Ordering::SeqCst);
    }

    /// Stops recording and returns the stages of what was recorded.
    pub fn stop(&self) -> HopStages {
        self.on.store(false, Ordering::SeqCst);
        let stamps = std::mem::take(&mut *self.stamps.lock().unwrap_or_else(|p| p.into_inner()));
        HopStages::of(&stamps)
    }
}

/// The stages of a pushed decode step, in the order a token goes through
/// them, and what each named stage spans.
const STAGES: [&str; 10] = [
    "client to the first server (client's framing, network, the server's reading)",
    "into each server's compute thread (checks, the hand-off)",
    "the servers' forwards",
    "back from each compute thread to its session",
    "each push's proof signed",
    "each push written and carried to the next server",
    "each push's proof checked there",
    "each push through its session's inbox",
    "the last server to the client",
    "the client between steps (its head, sampling, the next embedding)",
];

/// Mean microseconds per decode token of each of [`STAGES`], over the
/// pushed decode steps recorded whole.
#[derive(Debug, Clone, Default)]
pub struct HopStages {
    pub mean_us: [f64; STAGES.len()],
    pub tokens: usize,
    pub servers: usize,
}

impl HopStages {
    fn of(stamps: &[Stamp]) -> Self {
        let mut steps: Vec<&[Stamp]> = Vec::new();
        let mut begin = None;
        for (i, s) in stamps.iter().enumerate() {
            if s.stage == hop::CLIENT_SENT {
                if let Some(b) = begin {
                    steps.push(&stamps[b..i]);
                }
                begin = Some(i);
            }
        }
        // The last one is whole only if the recording outlived it; it
        // ends the client time of the one before in any case.
        if let Some(b) = begin {
            steps.push(&stamps[b..]);
        }
        let mut sums = [0.0; STAGES.len()];
        let mut counted = [0usize; STAGES.len()];
        let mut tokens = 0;
        let mut servers = 0;
        for (n, step) in steps.iter().enumerate() {
            let Some(stages) = step_stages(step) else {
                continue;
            };
            servers = servers.max(stages.1);
            tokens += 1;
            for (k, us) in stages.0.iter().enumerate().take(STAGES.len() - 1) {
                sums[k] += us;
                counted[k] += 1;
            }
            // To the next step's send: the client's own time between them.
            let last = step.iter().rev().find(|s| s.stage == hop::CLIENT_RECEIVED);
            if let (Some(last), Some(next)) = (last, steps.get(n + 1).and_then(|s| s.first())) {
                let k = STAGES.len() - 1;
                sums[k] += next.at_us - last.at_us;
                counted[k] += 1;
            }
        }
        let mut mean_us = [0.0; STAGES.len()];
        for k in 0..STAGES.len() {
            mean_us[k] = sums[k] / counted[k].max(1) as f64;
        }
        HopStages {
            mean_us,
            tokens,
            servers,
        }
    }

    /// The token-weighted mean of several recordings.
    pub fn merged(all: &[HopStages]) -> HopStages {
        let tokens: usize = all.iter().map(|s| s.tokens).sum();
        let mut mean_us = [0.0; STAGES.len()];
        for s in all {
            for (m, us) in mean_us.iter_mut().zip(s.mean_us) {
                *m += us * s.tokens as f64 / tokens.max(1) as f64;
            }
        }
        HopStages {
            mean_us,
            tokens,
            servers: all.iter().map(|s| s.servers).max().unwrap_or(0),
        }
    }

    /// The stages as a table, and what they sum to.
    pub fn table(&self) -> String {
        let mut text = String::from("| stage | µs per token |\n|---|---|\n");
        for (name, us) in STAGES.iter().zip(self.mean_us) {
            let _ = writeln!(text, "| {name} | {us:.0} |");
        }
        let _ = writeln!(text, "| **all** | **{:.0}** |", self.total_us());
        text
    }

    /// Everything but the servers' forwards and the client's own time:
    /// what the network and the hand-offs add to a token.
    pub fn between_us(&self) -> f64 {
        self.total_us() - self.mean_us[2] - self.mean_us[STAGES.len() - 1]
    }

    pub fn total_us(&self) -> f64 {
        self.mean_us.iter().sum()
    }
}

/// The first `STAGES.len() - 1` stages of one step (the client's time
/// after it is the next step's), in µs, and the servers it went through;
/// `None` unless every event of a pushed route is there.
fn step_stages(step: &[Stamp]) -> Option<([f64; STAGES.len()], usize)> {
    let first = |stage: &str, block: Option<u64>| {
        step.iter()
            .find(|s| s.stage == stage && (block.is_none() || s.block == block))
            .map(|s| s.at_us)
    };
    let nth = |stage: &str, n: usize| {
        step.iter()
            .filter(|s| s.stage == stage)
            .nth(n)
            .map(|s| s.at_us)
    };
    let blocks: Vec<Option<u64>> = step
        .iter()
        .filter(|s| s.stage == hop::STEP_ARRIVED)
        .map(|s| s.block)
        .collect();
    if blocks.len() < 2 || blocks.iter().any(Option::is_none) {
        return None;
    }
    let mut us = [0.0; STAGES.len()];
    us[0] = first(hop::STEP_ARRIVED, blocks[0])? - step.first()?.at_us;
    for (k, &block) in blocks.iter().enumerate() {
        let arrived = first(hop::STEP_ARRIVED, block)?;
        let started = first(hop::FORWARD_STARTED, block)?;
        let done = first(hop::FORWARD_DONE, block)?;
        let ready = first(hop::OUTPUT_READY, block)?;
        us[1] += started - arrived;
        us[2] += done - started;
        us[3] += ready - done;
        if k + 1 < blocks.len() {
            let signed = nth(hop::PUSH_SIGNED, k)?;
            let read = nth(hop::PUSH_READ, k)?;
            let checked = nth(hop::PUSH_CHECKED, k)?;
            us[4] += signed - ready;
            us[5] += read - signed;
            us[6] += checked - read;
            us[7] += first(hop::STEP_ARRIVED, blocks[k + 1])? - checked;
        }
    }
    let last_ready = first(hop::OUTPUT_READY, *blocks.last()?)?;
    let received = step
        .iter()
        .rev()
        .find(|s| s.stage == hop::CLIENT_RECEIVED)?
        .at_us;
    us[8] = received - last_ready;
    Some((us, blocks.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(stage: &'static str, block: Option<u64>, at_us: f64) -> Stamp {
        Stamp {
            stage,
            block,
            at_us,
        }
    }

    /// Two servers, two tokens: each stage is the gap between its events.
    #[test]
    fn stages_are_the_gaps_between_events() {
        let mut stamps = Vec::new();
        for t in 0..2 {
            let o = t as f64 * 1000.0;
            stamps.extend([
                stamp(hop::CLIENT_SENT, None, o),
                stamp(hop::STEP_ARRIVED, Some(0), o + 10.0),
                stamp(hop::FORWARD_STARTED, Some(0), o + 30.0),
                stamp(hop::FORWARD_DONE, Some(0), o + 130.0),
                stamp(hop::OUTPUT_READY, Some(0), o + 135.0),
                stamp(hop::PUSH_SIGNED, None, o + 145.0),
                stamp(hop::PUSH_SENT, None, o + 150.0),
                stamp(hop::PUSH_READ, None, o + 170.0),
                stamp(hop::PUSH_CHECKED, None, o + 180.0),
                stamp(hop::STEP_ARRIVED, Some(5), o + 182.0),
                stamp(hop::CLIENT_RECEIVED, None, o + 190.0),
                stamp(hop::FORWARD_STARTED, Some(5), o + 200.0),
                stamp(hop::FORWARD_DONE, Some(5), o + 300.0),
                stamp(hop::OUTPUT_READY, Some(5), o + 304.0),
                stamp(hop::CLIENT_RECEIVED, None, o + 320.0),
            ]);
        }
        // The third send ends the second token's client time; its own
        // step is not whole and is left out.
        stamps.push(stamp(hop::CLIENT_SENT, None, 2000.0));
        let stages = HopStages::of(&stamps);
        assert_eq!((stages.tokens, stages.servers), (2, 2));
        let expected = [10.0, 38.0, 200.0, 9.0, 10.0, 25.0, 10.0, 2.0, 16.0, 680.0];
        for (got, want) in stages.mean_us.iter().zip(expected) {
            assert!((got - want).abs() < 1e-9, "{:?}", stages.mean_us);
        }
        assert!(
            (stages.between_us() - (10.0 + 38.0 + 9.0 + 10.0 + 25.0 + 10.0 + 2.0 + 16.0)).abs()
                < 1e-9
        );
    }

    /// A step without a server's events (a prefill, or a route the client
    /// carried on itself) is left out.
    #[test]
    fn incomplete_steps_are_left_out() {
        let stamps = [
            stamp(hop::CLIENT_SENT, None, 0.0),
            stamp(hop::STEP_ARRIVED, Some(0), 10.0),
            stamp(hop::STEP_ARRIVED, Some(5), 50.0),
            stamp(hop::CLIENT_RECEIVED, None, 60.0),
            stamp(hop::CLIENT_SENT, None, 100.0),
        ];
        let stages = HopStages::of(&stamps);
        assert_eq!(stages.tokens, 0);
    }
}
