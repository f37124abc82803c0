//! What the API's handlers share: its settings and its state (the
//! assistant, the answers' permits, the conversations kept for follow-ups).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use corolla_http::HttpLimits;

use super::admission::Admission;
use super::metrics::Metrics;
use crate::assistant::{Assistant, Conversation};
use crate::tokens::common_prefix;

/// How the API listens and what it admits.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    pub addr: SocketAddr,
    /// Requests must carry `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Longest request body accepted.
    pub max_body_bytes: usize,
    /// Answers generated at once; more requests wait their turn.
    pub max_concurrent: usize,
    /// Finished conversations kept open for follow-ups (oldest closed first).
    pub kept_conversations: usize,
    /// Answer length when a request names none (bounded by the context).
    pub default_max_tokens: usize,
    /// The longest draft of a multi-token step; 0: one token per step.
    pub drafts: usize,
    /// The most tokens one request may ask for (`max_tokens`); more is a
    /// bad request, not an answer that holds a session for minutes.
    pub max_tokens_cap: usize,
    /// Connections at once, the header deadline, a connection's lifetime.
    pub http: HttpLimits,
}

impl Default for ApiSettings {
    fn default() -> Self {
        ApiSettings {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            api_key: None,
            max_body_bytes: 1 << 20,
            max_concurrent: 16,
            kept_conversations: 8,
            default_max_tokens: 512,
            drafts: crate::DEFAULT_DRAFTS,
            max_tokens_cap: 4096,
            http: HttpLimits::default(),
        }
    }
}

pub(super) struct ApiState {
    pub(super) assistant: Arc<Assistant>,
    pub(super) settings: ApiSettings,
    pub(super) admission: Arc<Admission>,
    /// Finished conversations, oldest first.
    pub(super) kept: Mutex<Vec<Conversation>>,
    pub(super) metrics: Metrics,
}

impl ApiState {
    /// The kept conversation with `adapter` sharing the longest prefix
    /// with `prompt` (at least half of what it holds), else a new one.
    pub(super) fn take_conversation(&self, prompt: &[u32], adapter: Option<&str>) -> Conversation {
        let mut kept = lock(&self.kept);
        let best = kept
            .iter()
            .enumerate()
            .filter(|(_, c)| c.adapter() == adapter)
            .map(|(i, c)| (common_prefix(c.cached_tokens(), prompt), i))
            .filter(|&(shared, i)| shared > 0 && 2 * shared >= kept[i].cached_tokens().len())
            .max();
        match best {
            Some((_, i)) => kept.remove(i),
            None => Conversation::new().with_adapter(adapter.map(str::to_owned)),
        }
    }

    /// Closes every kept conversation.
    pub(super) async fn release_kept(&self) {
        let kept = std::mem::take(&mut *lock(&self.kept));
        for conversation in kept {
            conversation.close().await;
        }
    }

    pub(super) fn keep_conversation(&self, conversation: Conversation) {
        if !conversation.is_open() {
            return;
        }
        let evicted = {
            let mut kept = lock(&self.kept);
            kept.push(conversation);
            let excess = kept.len().saturating_sub(self.settings.kept_conversations);
            kept.drain(..excess).collect::<Vec<_>>()
        };
        for old in evicted {
            tokio::spawn(old.close());
        }
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
