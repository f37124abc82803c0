//! Counters for `/metrics`, in Prometheus' text format.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

#[derive(Default)]
pub(super) struct Metrics {
    pub(super) requests: Mutex<BTreeMap<&'static str, u64>>,
    pub(super) errors: Mutex<BTreeMap<&'static str, u64>>,
    pub(super) tokens_in: AtomicU64,
    pub(super) tokens_out: AtomicU64,
    pub(super) tokens_reused: AtomicU64,
    pub(super) ttft_micros: AtomicU64,
    pub(super) ttft_count: AtomicU64,
}

impl Metrics {
    pub(super) fn request(&self, endpoint: &'static str) {
        *self
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(endpoint)
            .or_default() += 1;
    }

    pub(super) fn error(&self, kind: &'static str) {
        *self
            .errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(kind)
            .or_default() += 1;
    }

    pub(super) fn tokens(&self, prompt: usize, completion: usize) {
        self.tokens_in.fetch_add(prompt as u64, Ordering::Relaxed);
        self.tokens_out
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    pub(super) fn time_to_first_token(&self, elapsed: Duration) {
        self.ttft_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        self.ttft_count.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP corolla_api_requests_total Requests by endpoint.\n");
        out.push_str("# TYPE corolla_api_requests_total counter\n");
        for (endpoint, n) in self
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            out.push_str(&format!(
                "corolla_api_requests_total{{endpoint=\"{endpoint}\"}} {n}\n"
            ));
        }
        out.push_str("# HELP corolla_api_errors_total Failed requests by kind.\n");
        out.push_str("# TYPE corolla_api_errors_total counter\n");
        for (kind, n) in self
            .errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            out.push_str(&format!(
                "corolla_api_errors_total{{kind=\"{kind}\"}} {n}\n"
            ));
        }
        let counters = [
            (
                "corolla_api_prompt_tokens_total",
                "Prompt tokens of answered requests.",
                self.tokens_in.load(Ordering::Relaxed),
            ),
            (
                "corolla_api_completion_tokens_total",
                "Tokens generated.",
                self.tokens_out.load(Ordering::Relaxed),
            ),
            (
                "corolla_api_reused_prompt_tokens_total",
                "Prompt tokens that open sessions of an earlier turn already held.",
                self.tokens_reused.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n"
            ));
        }
        let ttft = self.ttft_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let count = self.ttft_count.load(Ordering::Relaxed);
        let name = "corolla_api_time_to_first_token_seconds";
        out.push_str(&format!(
            "# HELP {name} Time from a request to its first token.\n# TYPE {name} summary\n\
             {name}_sum {ttft}\n{name}_count {count}\n"
        ));
        out
    }
}
