//! The libp2p behaviour every Corolla node runs: Kademlia under Corolla's
//! own protocol name, identify, ping, and raw streams for sessions.

use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::kad::{self, store::MemoryStore};
use libp2p::swarm::NetworkBehaviour;
use libp2p::{identify, ping};

use crate::protocol::{IDENTIFY_PROTOCOL_VERSION, KADEMLIA_PROTOCOL};

#[derive(NetworkBehaviour)]
pub struct Behaviour {
    pub kad: kad::Behaviour<MemoryStore>,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub stream: libp2p_stream::Behaviour,
}

impl Behaviour {
    /// `update_period` is how often servers re-announce; provider entries
    /// live for two periods, so a dead server vanishes by itself.
    pub fn new(key: &Keypair, update_period: Duration) -> Self {
        let peer_id = key.public().to_peer_id();
        let mut config = kad::Config::new(KADEMLIA_PROTOCOL);
        config
            .set_provider_record_ttl(Some(update_period * 2))
            .set_provider_publication_interval(None)
            .set_record_ttl(Some(update_period * 2))
            .set_query_timeout(Duration::from_secs(10));
        Behaviour {
            kad: kad::Behaviour::with_config(peer_id, MemoryStore::new(peer_id), config),
            identify: identify::Behaviour::new(identify::Config::new(
                IDENTIFY_PROTOCOL_VERSION.into(),
                key.public(),
            )),
            ping: ping::Behaviour::default(),
            stream: libp2p_stream::Behaviour::new(),
        }
    }
}
