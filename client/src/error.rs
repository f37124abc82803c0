//! The client crate's error type.

use corolla_shared::session::SessionError;
use corolla_shared::ErrorKind;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Model(#[from] corolla_model::ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("the prompt is empty after tokenization")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens plus {new} new tokens exceeds the model's {max} positions")]
    TooLong {
        prompt: usize,
        new: usize,
        max: usize,
    },
    #[error(
        "the answer needs {needed} positions but the servers accept sessions of at most {max} (their --inference-max-length)"
    )]
    SessionTooLong { needed: usize, max: usize },
    #[error("invalid request: {0}")]
    BadRequest(String),
    #[error("no server covers blocks {}", format_ranges(.uncovered))]
    NoRoute { uncovered: Vec<(usize, usize)> },
    /// Servers of the blocks exist, but none runs the adapter asked for.
    #[error("no server runs adapter {adapter:?} for blocks {}: servers announce the adapters they run (see `corolla swarm`)", format_ranges(.uncovered))]
    AdapterNotServed {
        adapter: String,
        uncovered: Vec<(usize, usize)>,
    },
    /// Servers of the blocks exist, but only with the other quantization
    /// than the servers the route already follows.
    #[error(
        "no server covers blocks {} with the quantization the rest of the route computes with; servers there run --quantized {others}: give every server of the model the same --quantized", format_ranges(.uncovered)
    )]
    MixedQuantization {
        uncovered: Vec<(usize, usize)>,
        /// The other servers' `--quantized` setting.
        others: &'static str,
    },
    /// Servers exist for the blocks, but each refused or failed.
    #[error("no server can serve blocks {}: {}", format_ranges(.uncovered), .reasons.join("; "))]
    Refused {
        uncovered: Vec<(usize, usize)>,
        /// `peer (blocks a..b): why`, one per server.
        reasons: Vec<String>,
        /// Busy when any of them was (asking later can help), else the
        /// kind of the failures most of them had.
        cause: ErrorKind,
    },
    #[error("spot checks found wrong activations and no honest server is left for blocks {start}..{end}")]
    NoHonestServer { start: usize, end: usize },
    /// Servers kept being caught lying about positions already answered.
    #[error("servers were caught lying {rechecks} times in one answer; it was computed again each time and is given up")]
    KeptLying { rechecks: usize },
    /// Tokens already streamed were computed from a server's lies, found
    /// out later in the answer (a stream cannot take them back).
    #[error("a server was caught returning wrong activations after {withdrawn} streamed tokens had been computed from them; they are withdrawn: ask again (that server is avoided now)")]
    Withdrawn { withdrawn: usize },
    /// Where the head runs apart from the loop (the page's worker).
    #[error("the client head: {0}")]
    Head(String),
    #[error("network: {0}")]
    Network(String),
    #[error(transparent)]
    Session(#[from] SessionError),
}

impl ClientError {
    /// What kind of failure this is, in the words every surface shares.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Model(corolla_model::ModelError::InvalidSampling(_))
            | ClientError::Tokenizer(_)
            | ClientError::EmptyPrompt
            | ClientError::BadRequest(_) => ErrorKind::BadRequest,
            ClientError::Model(_) | ClientError::Head(_) => ErrorKind::Internal,
            ClientError::TooLong { .. } | ClientError::SessionTooLong { .. } => {
                ErrorKind::ContextLengthExceeded
            }
            ClientError::NoRoute { .. } | ClientError::AdapterNotServed { .. } => {
                ErrorKind::NoCoverage
            }
            ClientError::MixedQuantization { .. } => ErrorKind::ModelMismatch,
            ClientError::Refused { cause, .. } => *cause,
            ClientError::NoHonestServer { .. }
            | ClientError::KeptLying { .. }
            | ClientError::Withdrawn { .. } => ErrorKind::BadServer,
            ClientError::Network(_) => ErrorKind::Unreachable,
            ClientError::Session(e) => e.kind(),
        }
    }

    /// The blocks no server could serve, when that is why it failed.
    pub fn uncovered(&self) -> Option<Vec<(usize, usize)>> {
        match self {
            ClientError::NoRoute { uncovered }
            | ClientError::AdapterNotServed { uncovered, .. }
            | ClientError::MixedQuantization { uncovered, .. }
            | ClientError::Refused { uncovered, .. } => Some(uncovered.clone()),
            ClientError::NoHonestServer { start, end } => Some(vec![(*start, *end)]),
            _ => None,
        }
    }

    /// `{"kind", "message", "retryable", "uncovered"?}`: how a program is
    /// told of this error (the CLI's `--json`, the page's client).
    pub fn to_json(&self) -> serde_json::Value {
        let kind = self.kind();
        let mut json = serde_json::json!({
            "kind": kind,
            "message": self.to_string(),
            "retryable": kind.retryable(),
        });
        if let Some(uncovered) = self.uncovered() {
            json["uncovered"] = serde_json::json!(uncovered);
        }
        json
    }
}

fn format_ranges(ranges: &[(usize, usize)]) -> String {
    ranges
        .iter()
        .map(|(a, b)| format!("{a}..{b}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl From<corolla_shared::node::NodeError> for ClientError {
    fn from(e: corolla_shared::node::NodeError) -> Self {
        ClientError::Network(e.to_string())
    }
}
