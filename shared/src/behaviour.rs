//! The libp2p behaviour every Corolla node runs: Kademlia under Corolla's
//! own protocol name, identify, ping, raw streams for sessions, and the
//! limits that keep one peer from taking a node's connections: counts per
//! peer, per source address ([`crate::address_limits`]) and in total, a
//! memory ceiling (native nodes), and an optional list of the only peers
//! allowed (a private swarm). Native nodes add the
//! reachability parts of [`crate::reach`].

use std::collections::HashSet;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::kad::{self, store::MemoryStore};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{allow_block_list, connection_limits, identify, ping, PeerId};

use crate::address_limits::{AddressCaps, AddressLimits};
use crate::protocol::{IDENTIFY_PROTOCOL_VERSION, KADEMLIA_PROTOCOL};

/// Refuses connections while the process uses too much memory.
#[cfg(feature = "native")]
pub type MemoryLimit = libp2p::memory_connection_limits::Behaviour;
/// Browsers have no way to read their memory use: no ceiling there.
#[cfg(not(feature = "native"))]
pub type MemoryLimit = libp2p::swarm::dummy::Behaviour;

/// Relays, hole punching, AutoNAT and UPnP (native nodes).
#[cfg(feature = "native")]
pub type Reach = crate::reach::Reach;
/// Browsers dial public servers only: nothing to reach them through.
#[cfg(not(feature = "native"))]
pub type Reach = libp2p::swarm::dummy::Behaviour;

#[derive(NetworkBehaviour)]
pub struct Behaviour {
    pub allowed: Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
    pub limits: connection_limits::Behaviour,
    pub addresses: AddressLimits,
    pub memory: Toggle<MemoryLimit>,
    pub kad: kad::Behaviour<MemoryStore>,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub stream: libp2p_stream::Behaviour,
    pub reach: Toggle<Reach>,
}

/// How many connections a node takes, and from whom.
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkLimits {
    /// Connections one peer may hold with this node (both directions).
    pub max_per_peer: u32,
    /// Established connections in total.
    pub max_established: u32,
    /// Incoming connections still in their handshake.
    pub max_pending_incoming: u32,
    /// Incoming connections one source address may hold (none: uncounted).
    pub per_address: Option<AddressCaps>,
    /// New connections are refused while the process uses more than this
    /// share of the machine's memory (native nodes only).
    pub max_memory_fraction: Option<f64>,
    /// When set, every other peer is refused at the connection level.
    pub allowed_peers: Option<HashSet<PeerId>>,
}

impl NetworkLimits {
    /// A server's: room for many clients, a few connections each.
    pub fn server() -> Self {
        NetworkLimits {
            max_per_peer: 8,
            max_established: 512,
            max_pending_incoming: 64,
            per_address: Some(AddressCaps::share_of(512)),
            max_memory_fraction: Some(0.9),
            allowed_peers: None,
        }
    }

    /// A client's: it dials servers and is dialed by nobody much.
    pub fn client() -> Self {
        NetworkLimits {
            max_per_peer: 8,
            max_established: 256,
            max_pending_incoming: 16,
            per_address: None,
            max_memory_fraction: None,
            allowed_peers: None,
        }
    }

    pub fn with_allowed_peers(mut self, allowed: Option<HashSet<PeerId>>) -> Self {
        self.allowed_peers = allowed;
        self
    }
}

impl Behaviour {
    /// `update_period` is how often servers re-announce; provider entries
    /// live for two periods, so a dead server vanishes by itself.
    pub fn new(
        key: &Keypair,
        update_period: Duration,
        limits: &NetworkLimits,
        reach: Option<Reach>,
    ) -> Self {
        let peer_id = key.public().to_peer_id();
        let mut config = kad::Config::new(KADEMLIA_PROTOCOL);
        config
            .set_provider_record_ttl(Some(update_period * 2))
            .set_provider_publication_interval(None)
            .set_record_ttl(Some(update_period * 2))
            .set_query_timeout(Duration::from_secs(10))
            // Records are stored only after `Node` checked their signature.
            .set_record_filtering(kad::StoreInserts::FilterBoth);
        let allowed = limits.allowed_peers.as_ref().map(|peers| {
            let mut list = allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
            for peer in peers.iter().chain([&peer_id]) {
                list.allow_peer(*peer);
            }
            list
        });
        // A server's inbound connections and handshakes are shared between
        // source addresses (`AddressLimits`, the transports'
        // `HandshakeShares`), which may let a newcomer in before the place
        // it takes is closed: libp2p's totals are a backstop above them.
        let backstop = if limits.per_address.is_some() { 2 } else { 1 };
        let caps = connection_limits::ConnectionLimits::default()
            .with_max_established_per_peer(Some(limits.max_per_peer))
            .with_max_established(Some(limits.max_established.saturating_mul(backstop)))
            .with_max_pending_incoming(Some(limits.max_pending_incoming.saturating_mul(backstop)));
        Behaviour {
            allowed: allowed.into(),
            limits: connection_limits::Behaviour::new(caps),
            addresses: AddressLimits::new(limits.per_address),
            memory: memory_limit(limits.max_memory_fraction).into(),
            kad: kad::Behaviour::with_config(peer_id, MemoryStore::new(peer_id), config),
            identify: identify::Behaviour::new(identify::Config::new(
                IDENTIFY_PROTOCOL_VERSION.into(),
                key.public(),
            )),
            ping: ping::Behaviour::default(),
            stream: libp2p_stream::Behaviour::new(),
            reach: reach.into(),
        }
    }
}

#[cfg(feature = "native")]
fn memory_limit(fraction: Option<f64>) -> Option<MemoryLimit> {
    fraction.map(MemoryLimit::with_max_percentage)
}

#[cfg(not(feature = "native"))]
fn memory_limit(_fraction: Option<f64>) -> Option<MemoryLimit> {
    None
}
