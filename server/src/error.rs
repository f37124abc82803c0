//! The server's error types: [`ServerError`] for starting and moving, each
//! variant one cause with a stable [`ServerError::kind`]; [`ComputeError`]
//! for one step.

use std::net::SocketAddr;
use std::path::PathBuf;

use corolla_model::ModelError;
use libp2p::Multiaddr;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("adapter {name:?}: {source}")]
    Adapter {
        name: String,
        #[source]
        source: ModelError,
    },
    #[error("identity: {0}")]
    Identity(String),
    /// Flags that contradict each other, or that this machine cannot serve.
    #[error("{0}")]
    BadArgs(String),
    /// `--model` names neither a folder, nor a GGUF file, nor a hub repo.
    #[error("model {} does not exist (as a folder or GGUF file; nor is it a Hugging Face repo id like owner/name)", .0.display())]
    NoSuchModel(PathBuf),
    #[error("cannot download {what} from the hub: {message}")]
    Download { what: String, message: String },
    #[error("no usable device: {0}")]
    Device(String),
    #[error("{doing} {}: {source}", path.display())]
    File {
        doing: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("network: {0}")]
    Network(String),
    #[error("cannot listen on {addr}: {message}")]
    Listen { addr: Multiaddr, message: String },
    #[error("cannot listen for HTTP on {addr}: {source}")]
    HttpListen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot load blocks {start}..{end}: {message}")]
    LoadBlocks {
        start: usize,
        end: usize,
        message: String,
    },
    #[error("cannot start the compute thread: {0}")]
    ComputeThread(std::io::Error),
    /// A start-up step's own thread panicked or was cancelled.
    #[error("a start-up task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error(transparent)]
    AddrFile(#[from] corolla_shared::addr_file::AddrFileError),
    #[error(transparent)]
    InitialPeer(#[from] corolla_shared::peers::NoPeerId),
}

impl ServerError {
    /// A machine-readable name of the cause, the same in every release:
    /// what scripts and service managers match instead of the message.
    pub fn kind(&self) -> &'static str {
        match self {
            ServerError::Model(_) => "model",
            ServerError::Adapter { .. } => "adapter",
            ServerError::Identity(_) => "identity",
            ServerError::BadArgs(_) | ServerError::InitialPeer(_) => "bad_args",
            ServerError::NoSuchModel(_) => "no_such_model",
            ServerError::Download { .. } => "download",
            ServerError::Device(_) => "device",
            ServerError::File { .. } | ServerError::AddrFile(_) => "file",
            ServerError::Tls(_) => "tls",
            ServerError::Network(_) => "network",
            ServerError::Listen { .. } | ServerError::HttpListen { .. } => "listen",
            ServerError::LoadBlocks { .. } => "load_blocks",
            ServerError::ComputeThread(_) | ServerError::Task(_) => "internal",
        }
    }
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
