//! Joining the swarm: the server's identity and transports, its listeners
//! (TCP required; QUIC, WebSocket, WebRTC-direct and TLS WebSocket where
//! they start), the initial peers dialled, and the node's loop running.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use corolla_shared::address_limits::AddressCaps;
use corolla_shared::behaviour::NetworkLimits;
use corolla_shared::native;
use corolla_shared::node::{Node, NodeEvent, NodeHandle};
use corolla_shared::peers::parse_peer_list;
use futures::channel::mpsc::UnboundedReceiver;
use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use tokio::task::JoinHandle;

use crate::config::ServerArgs;
use crate::error::ServerError;
use crate::identity::{load_or_create_certificate, load_or_create_keypair};
use crate::metrics::ServerMetrics;
use crate::tls::TlsIdentity;

/// How long the listeners have to report their addresses.
const LISTEN_TIME: Duration = Duration::from_secs(10);

/// A server's place in the swarm once its listeners are up.
pub(super) struct JoinedSwarm {
    pub node: NodeHandle,
    /// The node's event loop.
    pub task: JoinHandle<()>,
    /// Listen addresses, each ending in `/p2p/<peer id>`.
    pub addrs: Vec<Multiaddr>,
    pub metrics: ServerMetrics,
    /// `--tls-cert`/`--tls-key`, loaded: the secure WebSocket's and HTTPS's.
    pub tls: Option<Arc<TlsIdentity>>,
    /// The server's key (its peer id's), which signs its pushes.
    pub identity: libp2p::identity::Keypair,
}

impl JoinedSwarm {
    pub async fn join(
        args: &ServerArgs,
        initial_peers: &[(PeerId, Multiaddr)],
    ) -> Result<Self, ServerError> {
        let keypair = load_or_create_keypair(args.identity.as_deref(), args.allow_shared_identity)?;
        let allowed_peers = parse_peer_list(&args.allowed_peers).map_err(ServerError::BadArgs)?;
        let certificate =
            load_or_create_certificate(args.identity.as_deref(), args.allow_shared_identity)?;
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(Arc::new(TlsIdentity::load(cert, key)?)),
            _ => None,
        };
        let transports = native::ServerTransports {
            webrtc: certificate,
            websocket_tls: tls.as_ref().map(|t| t.websocket()).transpose()?,
        };
        let defaults = NetworkLimits::server();
        let max_established = args.max_connections.max(1);
        let limits = NetworkLimits {
            max_per_peer: args.max_connections_per_peer.max(1),
            max_established,
            per_address: Some(AddressCaps::share_of(max_established)),
            ..defaults
        }
        .with_allowed_peers(allowed_peers.clone());
        // libp2p's byte counts per transport go into the registry `/metrics` serves.
        let mut registry = native::MetricsRegistry::default();
        let swarm = native::build_swarm(
            keypair.clone(),
            args.update_period,
            &limits,
            Some(transports),
            &args.reach_settings(),
            Some(&mut registry),
        )
        .await
        .map_err(|e| ServerError::Network(e.to_string()))?;
        let (mut node, handle, events) = Node::new(swarm);
        node.record_metrics(&mut registry);
        let metrics = ServerMetrics::new(registry);
        node.serve_dht(args.public_name.clone(), keypair.clone());
        node.allow_only(allowed_peers);
        node.prefer_relays(initial_peers.iter().map(|(peer, _)| *peer));

        let tcp = listen_address(args.host, args.port, Protocol::Tcp);
        let pending = listen(&mut node, args, tcp.clone(), tls.is_some())?;
        dial_initial_peers(&mut node, initial_peers);
        let task = tokio::spawn(node.run());
        let addrs = wait_for_listeners(events, pending, handle.peer_id()).await?;
        if !addrs
            .iter()
            .any(|a| a.iter().any(|p| matches!(p, Protocol::Tcp(_))))
        {
            return Err(ServerError::Listen {
                addr: tcp,
                message: "no TCP address".into(),
            });
        }
        Ok(JoinedSwarm {
            node: handle,
            task,
            addrs,
            metrics,
            tls,
            identity: keypair,
        })
    }
}

/// `/ip4|ip6/HOST/<transport>(PORT)`.
fn listen_address(host: IpAddr, port: u16, transport: fn(u16) -> Protocol<'static>) -> Multiaddr {
    let ip = match host {
        IpAddr::V4(ip) => Protocol::Ip4(ip),
        IpAddr::V6(ip) => Protocol::Ip6(ip),
    };
    Multiaddr::empty().with(ip).with(transport(port))
}

/// Starts the listeners: TCP on `--port` (required), QUIC on the same port,
/// WebSocket and WebRTC-direct on the next, TLS WebSocket on the one after
/// (each 0 when `--port` is). Returns the listeners yet to report.
fn listen(
    node: &mut Node,
    args: &ServerArgs,
    tcp: Multiaddr,
    with_tls: bool,
) -> Result<HashSet<ListenerId>, ServerError> {
    let port_after = |n: u16| {
        if args.port == 0 {
            0
        } else {
            args.port.saturating_add(n)
        }
    };
    let at = |port, transport| listen_address(args.host, port, transport);
    let mut listeners = vec![
        (tcp, true),
        (at(args.port, Protocol::Udp).with(Protocol::QuicV1), false),
        (
            at(port_after(1), Protocol::Tcp).with(Protocol::Ws("/".into())),
            false,
        ),
        (
            at(port_after(1), Protocol::Udp).with(Protocol::WebRTCDirect),
            false,
        ),
    ];
    if with_tls {
        let wss = at(port_after(2), Protocol::Tcp)
            .with(Protocol::Tls)
            .with(Protocol::Ws("/".into()));
        listeners.push((wss, true));
    }
    let mut pending = HashSet::new();
    for (addr, required) in listeners {
        match node.swarm_mut().listen_on(addr.clone()) {
            Ok(id) => {
                pending.insert(id);
            }
            Err(e) if required => {
                return Err(ServerError::Listen {
                    addr,
                    message: e.to_string(),
                })
            }
            Err(e) => tracing::warn!(%addr, error = %e, "listener not started"),
        }
    }
    Ok(pending)
}

/// Dials `--initial-peers` and, when there are any, fills the routing
/// table from them.
fn dial_initial_peers(node: &mut Node, initial_peers: &[(PeerId, Multiaddr)]) {
    let swarm = node.swarm_mut();
    for (peer, addr) in initial_peers {
        swarm.behaviour_mut().kad.add_address(peer, addr.clone());
        swarm.add_peer_address(*peer, addr.clone());
        if let Err(e) = swarm.dial(*peer) {
            tracing::warn!(%peer, error = %e, "cannot dial an initial peer");
        }
    }
    if !initial_peers.is_empty() {
        let _ = swarm.behaviour_mut().kad.bootstrap();
    }
}

/// The addresses the listeners report within [`LISTEN_TIME`]; one that
/// fails leaves its transport out.
async fn wait_for_listeners(
    mut events: UnboundedReceiver<NodeEvent>,
    mut pending: HashSet<ListenerId>,
    peer_id: PeerId,
) -> Result<Vec<Multiaddr>, ServerError> {
    let mut addrs = Vec::new();
    let deadline = tokio::time::sleep(LISTEN_TIME);
    tokio::pin!(deadline);
    while !pending.is_empty() {
        tokio::select! {
            event = events.next() => match event {
                Some(NodeEvent::Listening { listener_id, address }) => {
                    pending.remove(&listener_id);
                    addrs.push(address.with_p2p(peer_id).unwrap_or_else(|a| a));
                }
                Some(NodeEvent::ListenFailed { listener_id, error }) => {
                    pending.remove(&listener_id);
                    tracing::warn!(%error, "a listener failed; that transport is unavailable");
                }
                None => return Err(ServerError::Network("the network loop stopped".into())),
            },
            _ = &mut deadline => {
                tracing::warn!("some listeners did not report an address in time");
                break;
            }
        }
    }
    Ok(addrs)
}
