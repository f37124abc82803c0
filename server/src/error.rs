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
}
