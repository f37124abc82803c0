//! Joining the swarm from a native client: a DHT client node dialed into
//! the bootstrap peers, its event loop spawned on tokio.

use std::time::Duration;

use corolla_shared::native::build_swarm;
use corolla_shared::node::{Node, NodeHandle};
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;

use crate::error::ClientError;

/// Starts a client node and dials `bootstrap` (multiaddrs ending in `/p2p/<id>`).
pub async fn connect(bootstrap: &[Multiaddr]) -> Result<NodeHandle, ClientError> {
    if bootstrap.is_empty() {
        return Err(ClientError::Network("no --initial-peers given".into()));
    }
    let key = libp2p::identity::Keypair::generate_ed25519();
    let swarm = build_swarm(key, Duration::from_secs(60), None)
        .await
        .map_err(|e| ClientError::Network(e.to_string()))?;
    let (mut node, handle, _events) = Node::new(swarm);
    node.client_dht();
    for addr in bootstrap {
        let mut base = addr.clone();
        let Some(Protocol::P2p(peer)) = base.pop() else {
            return Err(ClientError::Network(format!(
                "initial peer {addr} must end in /p2p/<peer id>"
            )));
        };
        let swarm = node.swarm_mut();
        swarm.behaviour_mut().kad.add_address(&peer, base.clone());
        swarm.add_peer_address(peer, base);
        if let Err(e) = swarm.dial(peer) {
            tracing::warn!(%peer, error = %e, "cannot dial an initial peer");
        }
    }
    let _ = node.swarm_mut().behaviour_mut().kad.bootstrap();
    tokio::spawn(node.run());
    Ok(handle)
}
