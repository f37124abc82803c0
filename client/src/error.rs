//! The client crate's error type.

use corolla_shared::session::SessionError;

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
    },
    #[error("spot checks found wrong activations and no honest server is left for blocks {start}..{end}")]
    NoHonestServer { start: usize, end: usize },
    /// Where the head runs apart from the loop (the page's worker).
    #[error("the client head: {0}")]
    Head(String),
    #[error("network: {0}")]
    Network(String),
    #[error(transparent)]
    Session(#[from] SessionError),
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
