//! Building a native node's swarm: TCP and QUIC with noise and yamux between
//! native peers, plus WebSocket and WebRTC-direct so that browsers can dial
//! servers.

use std::time::Duration;

use libp2p::core::upgrade::Version;
use libp2p::core::Transport;
use libp2p::identity::Keypair;
use libp2p::{noise, tcp, yamux, Swarm};

use crate::behaviour::{Behaviour, NetworkLimits};

pub use libp2p::websocket::tls::Config as WebSocketTls;
pub use libp2p_webrtc::tokio::Certificate as WebRtcCertificate;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a server's swarm needs beyond a client's.
pub struct ServerTransports {
    pub webrtc: WebRtcCertificate,
    /// For `/tls/ws` listeners (pages served over https need `wss`).
    pub websocket_tls: Option<WebSocketTls>,
}

/// A swarm for a server (TCP, QUIC, WebSocket with optional TLS,
/// WebRTC-direct) or, without `server`, a native client (TCP).
pub async fn build_swarm(
    keypair: Keypair,
    update_period: Duration,
    limits: &NetworkLimits,
    server: Option<ServerTransports>,
) -> Result<Swarm<Behaviour>, BoxError> {
    // Both rustls back-ends are in the dependency graph (QUIC and WebRTC
    // pull in one each); without a process-wide choice, the first TLS or
    // DTLS handshake panics. Installing twice is harmless.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let builder = libp2p::SwarmBuilder::with_existing_identity(keypair)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )?;
    let swarm_config =
        |c: libp2p::swarm::Config| c.with_idle_connection_timeout(Duration::from_secs(120));
    let behaviour = |key: &Keypair| Behaviour::new(key, update_period, limits);
    let swarm = match server {
        Some(server) => builder
            .with_quic_config(|mut c| {
                // A dead peer's UDP port never answers: give up on it quickly.
                c.handshake_timeout = Duration::from_secs(3);
                c
            })
            .with_other_transport(|key| {
                Ok::<_, BoxError>(libp2p_webrtc::tokio::Transport::new(
                    key.clone(),
                    server.webrtc,
                ))
            })?
            .with_other_transport(|key| {
                let mut ws = libp2p::websocket::Config::new(libp2p::dns::tokio::Transport::system(
                    tcp::tokio::Transport::new(tcp::Config::default().nodelay(true)),
                )?);
                if let Some(tls) = server.websocket_tls {
                    ws.set_tls_config(tls);
                }
                Ok::<_, BoxError>(
                    ws.upgrade(Version::V1Lazy)
                        .authenticate(noise::Config::new(key)?)
                        .multiplex(yamux::Config::default()),
                )
            })?
            .with_dns()?
            .with_behaviour(behaviour)?
            .with_swarm_config(swarm_config)
            .build(),
        // Native clients dial over TCP only: a dead server's TCP port refuses
        // at once, where QUIC would wait out a handshake timeout.
        None => builder
            .with_dns()?
            .with_behaviour(behaviour)?
            .with_swarm_config(swarm_config)
            .build(),
    };
    Ok(swarm)
}

/// A fresh WebRTC certificate.
pub fn new_webrtc_certificate() -> Result<WebRtcCertificate, String> {
    WebRtcCertificate::generate(&mut rand::rng()).map_err(|e| e.to_string())
}
