//! Building a browser node's swarm: WebRTC-direct and WebSocket, the two
//! ways a page can reach a native server without a certificate authority
//! (WebRTC-direct) or through one (`wss`). Dial-only: a page never listens.

use std::time::Duration;

use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::timeout::TransportTimeout;
use libp2p::core::upgrade::Version;
use libp2p::core::Transport;
use libp2p::identity::Keypair;
use libp2p::{noise, yamux, Swarm};

use crate::behaviour::{Behaviour, NetworkLimits};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const WEBRTC_DIAL_TIMEOUT: Duration = Duration::from_secs(5);

pub fn build_browser_swarm(
    keypair: Keypair,
    update_period: Duration,
) -> Result<Swarm<Behaviour>, BoxError> {
    let swarm = libp2p::SwarmBuilder::with_existing_identity(keypair)
        .with_wasm_bindgen()
        .with_other_transport(|key| {
            let webrtc =
                libp2p::webrtc_websys::Transport::new(libp2p::webrtc_websys::Config::new(key))
                    .map(|(peer, conn), _| (peer, StreamMuxerBox::new(conn)));
            // A healthy dial takes ~200 ms; one to a dead server would wait
            // out ICE and hold up DHT queries meanwhile.
            Ok::<_, BoxError>(TransportTimeout::with_outgoing_timeout(
                webrtc,
                WEBRTC_DIAL_TIMEOUT,
            ))
        })?
        .with_other_transport(|key| {
            Ok::<_, BoxError>(
                libp2p::websocket_websys::Transport::default()
                    .upgrade(Version::V1Lazy)
                    .authenticate(noise::Config::new(key)?)
                    .multiplex(yamux::Config::default())
                    .timeout(Duration::from_secs(20)),
            )
        })?
        .with_behaviour(|key| Behaviour::new(key, update_period, &NetworkLimits::client(), None))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(120)))
        .build();
    Ok(swarm)
}
