//! Corolla's wire format, shared by servers, native clients and the browser.
//!
//! This crate holds what crosses the network and nothing that computes: the
//! tensor payload codec and the limits every decoder enforces before it
//! allocates. It depends on neither candle nor tokio so that it builds for
//! every target, wasm32 included.

pub mod limits;
pub mod tensor;

pub use limits::Limits;
pub use tensor::{Compression, TensorCodecError, TensorPayload, TensorView, WireDType};
