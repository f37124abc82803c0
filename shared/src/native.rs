//! Building a native node's swarm: TCP and QUIC with noise and yamux between
//! native peers, plus WebSocket and WebRTC-direct so that browsers can dial
//! servers.

use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::{noise, tcp, yamux, Swarm};

use crate::behaviour::Behaviour;

pub use libp2p_webrtc::tokio::Certificate as WebRtcCertificate;

/// A swarm for a server (`webrtc` given: TCP, QUIC, WebSocket, WebRTC-direct)
/// or a native client (TCP).
pub async fn build_swarm(
    keypair: Keypair,
    update_period: Duration,
    webrtc: Option<WebRtcCertificate>,
) -> Result<Swarm<Behaviour>, Box<dyn std::error::Error + Send + Sync>> {
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
    let behaviour = |key: &Keypair| Behaviour::new(key, update_period);
    let swarm = match webrtc {
        Some(cert) => builder
            .with_quic_config(|mut c| {
                // A dead peer's UDP port never answers: give up on it quickly.
                c.handshake_timeout = Duration::from_secs(3);
                c
            })
            .with_other_transport(|key| {
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                    libp2p_webrtc::tokio::Transport::new(key.clone(), cert),
                )
            })?
            .with_dns()?
            .with_websocket(noise::Config::new, yamux::Config::default)
            .await?
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
