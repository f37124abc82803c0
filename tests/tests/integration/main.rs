//! Every cross-crate test that can share the machine, one module per area,
//! in one binary: each test binary links the whole stack (servers, client,
//! model, libp2p), and 19 of them took most of a fresh machine's test build.
//! The browser, WebRTC, WAN and NAT tests stay binaries of their own: their
//! figures and timeouts (ICE's among them: beside this binary's other tests a
//! WebRTC-direct dial timed out three times in a row) assume no other test's
//! servers compete for the two cores, and the WAN and NAT worlds change the
//! host's forwarding.
//!
//! One area's tests: `cargo test -p corolla-tests --test integration trust::`.

mod adapters;
mod api;
mod batch;
mod crowds;
mod default_model;
mod docs;
mod drafts;
mod engine;
mod errors;
mod faults;
mod fetch;
mod flow;
mod gguf;
mod gguf_shapes;
mod gguf_tiny;
mod golden;
mod http;
mod metrics;
mod monitor;
mod protocol;
mod routing;
mod shared_prefix;
mod sources;
mod structure;
mod swarm;
mod tiny_reference;
mod trust;
mod wire_quality;
