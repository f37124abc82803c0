//! Where a step's time goes between client and servers: trace events at
//! the stages of a hop, under one target, that a subscriber may time
//! (`corolla-bench --compute` does, for its swarm runs; `RUST_LOG=corolla::hop=trace`
//! prints them). Each event's name is its stage; the server's events
//! carry `block`, the first block of the span that emitted them.

/// The target of every hop event.
pub const TARGET: &str = "corolla::hop";

/// The client sends a step to the first server of a pushed route.
pub const CLIENT_SENT: &str = "client_sent";
/// The client has the output of hop `hop` of the route.
pub const CLIENT_RECEIVED: &str = "client_received";
/// A step reached its session on a server, checks not yet done.
pub const STEP_ARRIVED: &str = "step_arrived";
/// The server's compute thread starts a forward of the step's batch.
pub const FORWARD_STARTED: &str = "forward_started";
/// ... and has its outputs.
pub const FORWARD_DONE: &str = "forward_done";
/// The session has its step's output back from the compute thread.
pub const OUTPUT_READY: &str = "output_ready";
/// The server has signed the proof of what it pushes on.
pub const PUSH_SIGNED: &str = "push_signed";
/// The push has left the server (written to its stream).
pub const PUSH_SENT: &str = "push_sent";
/// A push was read off its stream at the next server.
pub const PUSH_READ: &str = "push_read";
/// Its proof holds; it goes to its session's inbox.
pub const PUSH_CHECKED: &str = "push_checked";
