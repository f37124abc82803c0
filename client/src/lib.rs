//! The Corolla client: everything between a prompt and generated text.
//!
//! Front ends (the `corolla` CLI, `corolla api`, the browser's
//! `corolla-wasm`) are thin adapters over [`Assistant`], which answers
//! [`Conversation`]s through this process or a swarm.
//!
//! The client keeps the [`corolla_model::ClientHead`] (embeddings, final
//! norm, LM head) and the sampler; the decoder blocks run behind a
//! [`BlockChain`]: in this process ([`LocalChain`]) or on servers ([`RemoteChain`]).
//! The same [`generate`] loop drives both, so a swarm run and a local run
//! with the same seed produce the same tokens.

pub mod assistant;
pub mod chain;
pub mod chat;
pub mod conversation;
pub mod draft;
pub mod draft_model;
mod error;
pub mod generate;
pub mod gguf_tokenizer;
pub mod identities;
pub mod local;
pub mod route;
pub mod session_settings;
pub mod spot_check;
pub mod stop;
pub mod swarm_view;
pub mod text;
pub mod tokenizer_parts;
pub mod tokens;

#[cfg(not(target_arch = "wasm32"))]
pub mod api;
#[cfg(not(target_arch = "wasm32"))]
pub mod cli;
#[cfg(not(target_arch = "wasm32"))]
pub mod models;
#[cfg(not(target_arch = "wasm32"))]
pub mod network;

pub use assistant::{Answer, Assistant, Blocks, Conversation};
pub use chain::{Recovery, RemoteChain};
pub use chat::{ChatMessage, ChatTemplate};
pub use draft::DEFAULT_DRAFTS;
pub use draft_model::DraftModel;
pub use error::ClientError;
pub use generate::{
    generate, generate_after, AnswerEvent, BlockChain, GenerateOutput, GenerateRequest, LocalHead,
    StopReason, TokenHead,
};
pub use local::LocalChain;
pub use route::{
    matching_servers, plan_route, plan_route_between, uncovered_blocks, Hop, MatchingServers,
    RouteCosts,
};
pub use session_settings::SessionSettings;
pub use stop::StopSequences;
pub use swarm_view::SwarmView;
pub use text::{TextStream, TextTokenizer};
