//! Joining the swarm from a page: a DHT client node on the browser's
//! transports, dialed into the bootstrap peers with retries (a WebRTC dial
//! sometimes times out in ICE and works the second time).

use std::time::Duration;

use corolla_shared::browser::build_browser_swarm;
use corolla_shared::node::{Node, NodeHandle};
use corolla_shared::peers::split_peer;
use corolla_shared::ErrorKind;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};

const DIAL_ATTEMPTS: usize = 3;
const DIAL_TIMEOUT: Duration = Duration::from_secs(15);
/// Only servers announce; a page never does, so this value is unused but required.
const UPDATE_PERIOD: Duration = Duration::from_secs(60);

/// The browser transports a multiaddr uses, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BrowserTransport {
    WebRtcDirect,
    WebSocket,
}

fn transport_of(addr: &Multiaddr) -> Option<BrowserTransport> {
    if addr.iter().any(|p| matches!(p, Protocol::WebRTCDirect)) {
        Some(BrowserTransport::WebRtcDirect)
    } else if addr
        .iter()
        .any(|p| matches!(p, Protocol::Ws(_) | Protocol::Wss(_)))
    {
        Some(BrowserTransport::WebSocket)
    } else {
        None
    }
}

fn parse_bootstrap(bootstrap: &[String]) -> Result<Vec<(PeerId, Multiaddr)>, String> {
    if bootstrap.is_empty() {
        return Err("no bootstrap address given".into());
    }
    bootstrap
        .iter()
        .map(|text| {
            let addr: Multiaddr = text
                .trim()
                .parse()
                .map_err(|e| format!("{text:?} is not a multiaddr: {e}"))?;
            if transport_of(&addr).is_none() {
                return Err(format!(
                    "{addr}: a browser can dial only WebRTC-direct or WebSocket addresses"
                ));
            }
            split_peer(&addr).map_err(|e| e.to_string())
        })
        .collect()
}

/// Why the page could not join: bad addresses (`bad_request`) or no
/// bootstrap peer answering (`unreachable`).
#[derive(Debug)]
pub struct ConnectError {
    pub kind: ErrorKind,
    pub message: String,
}

impl ConnectError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ConnectError {
            kind,
            message: message.into(),
        }
    }
}

/// Starts the page's node and connects it to at least one bootstrap peer.
/// Servers found later are dialed only on the transports `bootstrap` uses.
pub async fn connect(bootstrap: &[String]) -> Result<NodeHandle, ConnectError> {
    let peers =
        parse_bootstrap(bootstrap).map_err(|e| ConnectError::new(ErrorKind::BadRequest, e))?;
    let allowed: Vec<BrowserTransport> = peers
        .iter()
        .filter_map(|(_, addr)| transport_of(addr))
        .collect();
    let key = libp2p::identity::Keypair::generate_ed25519();
    let swarm = build_browser_swarm(key, UPDATE_PERIOD)
        .map_err(|e| ConnectError::new(ErrorKind::Internal, e.to_string()))?;
    let (mut node, handle, _events) = Node::new(swarm);
    let handle = handle.with_initial_peers(peers.iter().map(|(peer, _)| *peer));
    node.client_dht();
    node.only_dial(Box::new(move |addr| {
        transport_of(addr).is_some_and(|t| allowed.contains(&t))
    }));
    for (peer, addr) in &peers {
        node.swarm_mut()
            .behaviour_mut()
            .kad
            .add_address(peer, addr.clone());
    }
    wasm_bindgen_futures::spawn_local(node.run());

    // All of a peer's addresses in one dial: libp2p tries them side by side,
    // so a transport that hangs (ICE) does not hold up one that works.
    let mut by_peer: Vec<(PeerId, Vec<Multiaddr>)> = Vec::new();
    for (peer, addr) in peers {
        match by_peer.iter_mut().find(|(p, _)| *p == peer) {
            Some((_, addrs)) => addrs.push(addr),
            None => by_peer.push((peer, vec![addr])),
        }
    }
    let mut errors = Vec::new();
    for (peer, addrs) in &by_peer {
        for attempt in 1..=DIAL_ATTEMPTS {
            match handle.dial(*peer, addrs.clone(), DIAL_TIMEOUT).await {
                Ok(()) => {
                    tracing::info!(%peer, attempt, "connected");
                    return Ok(handle);
                }
                Err(e) => {
                    tracing::warn!(%peer, attempt, error = %e, "dial failed");
                    errors.push(format!("{peer} (attempt {attempt}): {e}"));
                }
            }
        }
    }
    Err(ConnectError::new(
        ErrorKind::Unreachable,
        format!("cannot reach the swarm: {}", errors.join("; ")),
    ))
}
