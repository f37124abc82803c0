//! `corolla-server`: hosts a span of transformer blocks for the swarm.
//!
//! A server loads layers `[a, b)` of a model, joins the DHT (or starts a new
//! swarm), announces what it serves every update period, and serves one
//! inference session per libp2p stream with its own KV cache. The binary is
//! a thin `main` over [`run_cli`]; tests start servers in-process with
//! [`Server::start`].

pub mod adapters;
mod admission;
mod cli;
mod compute;
pub mod config;
mod corruption;
mod error;
mod host;
mod host_settings;
mod http;
mod http_guard;
mod hub;
mod identity;
mod measure;
mod memory;
mod metrics;
mod monitor;
mod placement;
mod push;
pub mod push_fault;
mod push_stream;
mod quota;
mod rebalance;
mod refuse;
mod running;
mod session;
mod shared_prefix;
mod start;
mod successor;
mod tls;

pub use cli::run_cli;
pub use compute::ComputeFigures;
pub use config::{ArgsError, BlockRange, ServerArgs};
pub use error::ServerError;
pub use http::{ClientFile, ClientManifest};
pub use metrics::ServerMetrics;
pub use placement::{best_move, choose_blocks, Move};
pub use running::RunningServer;
pub use start::Server;
