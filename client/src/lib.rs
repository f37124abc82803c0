//! The Corolla client: everything between a prompt and generated text.
//!
//! The client keeps the [`corolla_model::ClientHead`] (embeddings, final
//! norm, LM head) and the sampler; the decoder blocks run behind a
//! [`BlockChain`]: in this process ([`LocalChain`]) or on servers ([`RemoteChain`]).
//! The same [`generate`] loop drives both, so a swarm run and a local run
//! with the same seed produce the same tokens.

pub mod chain;
pub mod chat;
mod error;
pub mod generate;
pub mod gguf_tokenizer;
pub mod local;
pub mod route;
pub mod text;

#[cfg(not(target_arch = "wasm32"))]
mod chat_cli;
#[cfg(not(target_arch = "wasm32"))]
pub mod cli;
#[cfg(not(target_arch = "wasm32"))]
pub mod models;
#[cfg(not(target_arch = "wasm32"))]
pub mod network;

pub use chain::{generate_remote, Recovery, RemoteAnswer, RemoteChain, SessionSettings};
pub use chat::{ChatMessage, ChatTemplate};
pub use error::ClientError;
pub use generate::{generate, BlockChain, GenerateOutput, GenerateRequest, StopReason};
pub use local::LocalChain;
pub use route::{
    matching_servers, plan_route, plan_route_between, uncovered_blocks, Hop, RouteCosts,
};
pub use text::{TextStream, TextTokenizer};
