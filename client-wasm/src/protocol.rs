//! The messages between the page and its head worker. A call is
//! `{id, call, data?}`, its reply `{id, value?, data?, error?}`; hidden
//! states travel as `data`, a transferred `Float32Array`. While loading,
//! the worker also posts `{progress}`; once its wasm runs, `{ready: true}`.

use corolla_client::ChatMessage;
use corolla_model::{LlamaConfig, SamplingParams};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Call {
    /// Downloads the client part the server at `server` serves.
    Load {
        server: String,
    },
    ChatPrompt {
        messages: Vec<ChatMessage>,
    },
    Encode {
        text: String,
    },
    /// A fresh sampler and text stream for the next answer.
    Begin {
        sampling: Sampling,
    },
    /// Replies with `[ids.len(), hidden]` hidden states as `data`.
    Embed {
        ids: Vec<u32>,
    },
    /// `data` holds the last position's hidden state; replies [`NextToken`].
    NextToken {
        context: Vec<u32>,
    },
    /// `data` holds the last `drafts.len() + 1` positions' hidden states
    /// (`[rows, hidden]`): a multi-token step's check; replies [`Verified`].
    VerifyDrafts {
        context: Vec<u32>,
        drafts: Vec<u32>,
    },
    /// The answer's tokens after its first `kept` are sampled again: the
    /// text stream forgets them.
    Rewind {
        kept: usize,
    },
    Decode {
        ids: Vec<u32>,
    },
    /// Replies with the worker's [`crate::download::Traffic`] and memory.
    Traffic,
}

/// [`SamplingParams`] as they cross `postMessage` (the page never sets a
/// repetition penalty).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl From<&Sampling> for SamplingParams {
    fn from(s: &Sampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            repetition_penalty: 1.0,
            seed: s.seed,
        }
    }
}

/// The reply to [`Call::Load`].
#[derive(Serialize, Deserialize)]
pub struct Loaded {
    pub model: String,
    pub config: LlamaConfig,
    /// How the worker holds the embeddings: "dense" or "fetched".
    pub embeddings: String,
}

/// The reply to [`Call::NextToken`]: the token and the text it completes.
#[derive(Serialize, Deserialize)]
pub struct NextToken {
    pub token: u32,
    pub piece: String,
}

/// The reply to [`Call::VerifyDrafts`]: the accepted drafts and the next
/// token ([`corolla_client::draft::verify_drafts`]), each with its text.
#[derive(Serialize, Deserialize)]
pub struct Verified {
    pub tokens: Vec<u32>,
    pub pieces: Vec<String>,
}
