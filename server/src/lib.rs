//! `corolla-server`: hosts a span of transformer blocks for the swarm.
//!
//! Not built yet. The libp2p host, DHT announcements and inference sessions
//! arrive with the swarm issue; the block math it will serve is
//! `corolla_model::BlockSpan`.
