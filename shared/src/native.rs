//! Building a native node's swarm: TCP and QUIC with noise and yamux between
//! native peers, WebSocket and WebRTC-direct so that browsers can dial
//! servers, circuit relay for peers behind NATs (see [`crate::reach`]), and
//! byte counters per transport for the server's metrics.

use std::time::Duration;

use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::upgrade::Version;
use libp2p::core::Transport;
use libp2p::identity::Keypair;
use libp2p::{noise, tcp, yamux, PeerId, Swarm};

use crate::behaviour::{Behaviour, NetworkLimits};
use crate::handshake_shares::{HandshakeShares, Shared};
use crate::port_reuse::FreshPortOnRefusal;
use crate::reach::{Reach, ReachSettings};

pub use libp2p::metrics::{Metrics as Libp2pMetrics, Registry as MetricsRegistry};
pub use libp2p::websocket::tls::Config as WebSocketTls;
pub use libp2p_webrtc::tokio::Certificate as WebRtcCertificate;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A TCP connection (with its noise and yamux handshakes) not up after this
/// long is given up: a peer behind a NAT that drops unsolicited packets
/// never refuses, and the kernel would retry its SYN for two minutes. Under
/// the 10 s an AutoNAT v2 server gives a whole test: a dial-back that the
/// client's router drops must fail inside it, or the client learns nothing
/// and the test repeats forever.
pub const TCP_DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// What a server's swarm needs beyond a client's.
pub struct ServerTransports {
    pub webrtc: WebRtcCertificate,
    /// For `/tls/ws` listeners (pages served over https need `wss`).
    pub websocket_tls: Option<WebSocketTls>,
}

/// A swarm for a server (TCP, QUIC, WebSocket with optional TLS,
/// WebRTC-direct) or, without `server`, a native client (TCP); both dial
/// through relays. Byte counts per transport go to `metrics` when given.
pub async fn build_swarm(
    keypair: Keypair,
    update_period: Duration,
    limits: &NetworkLimits,
    server: Option<ServerTransports>,
    reach: &ReachSettings,
    metrics: Option<&mut MetricsRegistry>,
) -> Result<Swarm<Behaviour>, BoxError> {
    // Both rustls back-ends are in the dependency graph (QUIC and WebRTC
    // pull in one each); without a process-wide choice, the first TLS or
    // DTLS handshake panics. Installing twice is harmless.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let mut unused = MetricsRegistry::default();
    let metrics = metrics.unwrap_or(&mut unused);
    let swarm_config =
        |c: libp2p::swarm::Config| c.with_idle_connection_timeout(Duration::from_secs(120));
    let behaviour = |key: &Keypair, relay_client| {
        let reach = Reach::new(key.public().to_peer_id(), relay_client, reach);
        Behaviour::new(key, update_period, limits, Some(reach))
    };
    let builder = libp2p::SwarmBuilder::with_existing_identity(keypair).with_tokio();
    // Every inbound handshake of a server, whichever transport, holds a
    // place of one table shared between source addresses.
    let handshakes = HandshakeShares::new(limits.max_pending_incoming as usize);
    let shared = |transport| Shared::new(transport, handshakes.clone());
    let swarm = match server {
        Some(server) => builder
            .with_other_transport(|key| Ok::<_, BoxError>(shared(quic_transport(key))))?
            .with_other_transport(|key| Ok::<_, BoxError>(shared(tcp_transport(key)?)))?
            .with_other_transport(|key| {
                Ok::<_, BoxError>(shared(
                    libp2p_webrtc::tokio::Transport::new(key.clone(), server.webrtc)
                        .map(|(peer, connection), _| (peer, StreamMuxerBox::new(connection)))
                        .boxed(),
                ))
            })?
            .with_other_transport(|key| {
                let mut ws = libp2p::websocket::Config::new(libp2p::dns::tokio::Transport::system(
                    tcp::tokio::Transport::new(tcp_config()),
                )?);
                if let Some(tls) = server.websocket_tls {
                    ws.set_tls_config(tls);
                }
                Ok::<_, BoxError>(shared(
                    ws.upgrade(Version::V1Lazy)
                        .authenticate(noise::Config::new(key)?)
                        .multiplex(yamux::Config::default())
                        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
                        .boxed(),
                ))
            })?
            .with_dns()?
            .with_relay_client(noise::Config::new, yamux::Config::default)?
            .with_bandwidth_metrics(metrics)
            .with_behaviour(behaviour)?
            .with_swarm_config(swarm_config)
            .build(),
        // Native clients dial over TCP only: a dead server's TCP port refuses
        // at once, where QUIC would wait out a handshake timeout.
        None => builder
            .with_other_transport(tcp_transport)?
            .with_dns()?
            .with_relay_client(noise::Config::new, yamux::Config::default)?
            .with_bandwidth_metrics(metrics)
            .with_behaviour(behaviour)?
            .with_swarm_config(swarm_config)
            .build(),
    };
    Ok(swarm)
}

/// QUIC, giving up quickly on a peer that never answers (a dead peer's UDP
/// port stays silent).
fn quic_transport(key: &Keypair) -> Boxed<(PeerId, StreamMuxerBox)> {
    let mut config = libp2p::quic::Config::new(key);
    config.handshake_timeout = Duration::from_secs(3);
    libp2p::quic::tokio::Transport::new(config)
        .map(|(peer, connection), _| (peer, StreamMuxerBox::new(connection)))
        .boxed()
}

fn tcp_config() -> tcp::Config {
    tcp::Config::default().nodelay(true)
}

/// TCP with noise and yamux, bounded by [`TCP_DIAL_TIMEOUT`]. Dials reuse
/// the listening port, which is what lets a TCP hole punch through a NAT,
/// and use a fresh one when the kernel refuses that ([`FreshPortOnRefusal`]).
fn tcp_transport(key: &Keypair) -> Result<Boxed<(PeerId, StreamMuxerBox)>, BoxError> {
    Ok(FreshPortOnRefusal::new(
        tcp::tokio::Transport::new(tcp_config()),
        tcp::tokio::Transport::new(tcp_config()),
    )
    .upgrade(Version::V1Lazy)
    .authenticate(noise::Config::new(key)?)
    .multiplex(yamux::Config::default())
    .timeout(TCP_DIAL_TIMEOUT)
    .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
    .boxed())
}

/// A fresh WebRTC certificate.
pub fn new_webrtc_certificate() -> Result<WebRtcCertificate, String> {
    WebRtcCertificate::generate(&mut rand::rng()).map_err(|e| e.to_string())
}
