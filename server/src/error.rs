//! The server's one error type.

use corolla_model::ModelError;
use libp2p::Multiaddr;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("identity: {0}")]
    Identity(String),
    #[error("{0}")]
    Config(String),
    #[error("network: {0}")]
    Network(String),
    #[error("cannot listen on {addr}: {message}")]
    Listen { addr: Multiaddr, message: String },
    #[error(transparent)]
    AddrFile(#[from] corolla_shared::addr_file::AddrFileError),
    #[error(transparent)]
    InitialPeer(#[from] corolla_shared::peers::NoPeerId),
}

/// Why the compute core could not run a step.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A batch this step was part of failed (the session goes on).
    #[error("the step failed: {0}")]
    Failed(String),
    /// The session's cache is gone (the computation panicked, or the core stopped).
    #[error("the session's cache is gone: {0}")]
    Lost(&'static str),
}
