//! Joining the swarm from a native client: a DHT client node dialed into
//! the bootstrap peers, its event loop spawned on tokio, able to reach
//! servers behind NATs through relays and hole punches.

use std::collections::HashSet;
use std::time::Duration;

use corolla_shared::behaviour::NetworkLimits;
use corolla_shared::native::build_swarm;
use corolla_shared::node::{Node, NodeHandle};
use corolla_shared::peers::split_peer;
use corolla_shared::reach::ReachSettings;
use libp2p::{Multiaddr, PeerId};

use crate::error::ClientError;

/// How long reaching one bootstrap peer may take.
const BOOTSTRAP_DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts a client node and dials `bootstrap` (multiaddrs ending in
/// `/p2p/<id>`); fails, naming each peer and why, when none is reachable.
pub async fn connect(bootstrap: &[Multiaddr]) -> Result<NodeHandle, ClientError> {
    connect_with(bootstrap, None, &ReachSettings::client()).await
}

/// [`connect`] with settings: in a private swarm only `allowed_peers` are
/// spoken to; `reach` says whether to punch holes to servers behind NATs.
pub async fn connect_with(
    bootstrap: &[Multiaddr],
    allowed_peers: Option<HashSet<PeerId>>,
    reach: &ReachSettings,
) -> Result<NodeHandle, ClientError> {
    let identity = libp2p::identity::Keypair::generate_ed25519();
    connect_as(identity, bootstrap, allowed_peers, reach).await
}

/// [`connect_with`] under a given identity (a client's peer id is new on
/// every run otherwise; tests sign as the node they speak from).
pub async fn connect_as(
    identity: libp2p::identity::Keypair,
    bootstrap: &[Multiaddr],
    allowed_peers: Option<HashSet<PeerId>>,
    reach: &ReachSettings,
) -> Result<NodeHandle, ClientError> {
    if bootstrap.is_empty() {
        return Err(ClientError::Network("no --initial-peers given".into()));
    }
    let peers = bootstrap
        .iter()
        .map(split_peer)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ClientError::Network(e.to_string()))?;
    let limits = NetworkLimits::client().with_allowed_peers(allowed_peers.clone());
    let swarm = build_swarm(
        identity,
        Duration::from_secs(60),
        &limits,
        None,
        reach,
        None,
    )
    .await
    .map_err(|e| ClientError::Network(e.to_string()))?;
    let (mut node, handle, _events) = Node::new(swarm);
    let handle = handle.with_initial_peers(peers.iter().map(|(peer, _)| *peer));
    node.client_dht();
    node.allow_only(allowed_peers);
    // Nobody dials a client; it listens so that its dials leave from one
    // port, the one the relays see: a hole punch aims at that port.
    let any_port: Multiaddr = "/ip4/0.0.0.0/tcp/0"
        .parse()
        .map_err(|e| ClientError::Network(format!("listen address: {e}")))?;
    if let Err(e) = node.swarm_mut().listen_on(any_port) {
        tracing::debug!(error = %e, "no TCP listener: hole punching will not work");
    }
    for (peer, base) in &peers {
        let swarm = node.swarm_mut();
        swarm.behaviour_mut().kad.add_address(peer, base.clone());
        swarm.add_peer_address(*peer, base.clone());
    }
    tokio::spawn(node.run());
    let dials = peers.iter().map(|(peer, base)| {
        let handle = handle.clone();
        async move {
            handle
                .dial(*peer, vec![base.clone()], BOOTSTRAP_DIAL_TIMEOUT)
                .await
                .map_err(|e| format!("{base}/p2p/{peer}: {e}"))
        }
    });
    let outcomes = futures::future::join_all(dials).await;
    if outcomes.iter().all(Result::is_err) {
        let why: Vec<String> = outcomes.into_iter().filter_map(Result::err).collect();
        return Err(ClientError::Network(format!(
            "cannot reach the bootstrap peer{} {}",
            if why.len() == 1 { "" } else { "s" },
            why.join("; ")
        )));
    }
    handle.bootstrap().await?;
    Ok(handle)
}
