//! Corolla's wire format, shared by servers, native clients and the browser.
//!
//! This crate holds what crosses the network and nothing that computes: the
//! tensor payload codec, the session protocol's messages and framing, the
//! server record, the limits every decoder enforces before it allocates, and
//! the libp2p behaviour all nodes share. It depends on neither candle nor
//! tokio so that it builds for every target, wasm32 included.

pub mod adapter_name;
#[cfg(feature = "native")]
pub mod addr_file;
pub mod address_limits;
pub mod behaviour;
#[cfg(all(feature = "browser", target_arch = "wasm32"))]
pub mod browser;
pub mod coverage;
pub mod error_kind;
pub mod fair_share;
pub mod flow;
pub mod framing;
#[cfg(feature = "native")]
pub mod handshake_shares;
pub mod hop_trace;
pub mod limits;
pub mod manifest;
#[cfg(feature = "native")]
pub mod native;
pub mod node;
pub mod peers;
#[cfg(feature = "native")]
pub mod port_reuse;
pub mod protocol;
pub mod push_proof;
#[cfg(feature = "native")]
pub mod reach;
pub mod record;
#[cfg(feature = "native")]
pub mod relay_reclaim;
#[cfg(feature = "native")]
pub mod relay_service;
#[cfg(feature = "native")]
pub mod relay_shares;
pub mod session;
pub mod session_token;
pub mod source_address;
pub mod swarm_report;
pub mod tensor;
pub mod time;

pub use error_kind::ErrorKind;
pub use limits::Limits;
pub use record::{Reachability, ServerRecord};
pub use tensor::{Compression, TensorCodecError, TensorPayload, TensorView, WireDType};
