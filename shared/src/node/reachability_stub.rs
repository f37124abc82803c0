//! The browser's reachability: a page is never reachable, holds no relay
//! slot, and has no reachability behaviour whose events it would handle.

use libp2p::{Multiaddr, PeerId};

use super::{Node, ReachReport};

impl Node {
    pub(super) fn reach_report(&self) -> ReachReport {
        ReachReport::default()
    }

    pub(super) fn is_private(&self) -> bool {
        false
    }

    pub(super) fn remember_dialed(&mut self, _peer: PeerId, _addr: Multiaddr) {}

    pub(super) fn offer_relay(&mut self, _peer: PeerId, _protocols: &[libp2p::StreamProtocol]) {}

    pub(super) fn on_listener_closed(&mut self, _addresses: &[Multiaddr]) {}

    pub(super) fn on_reach(
        &mut self,
        event: <crate::behaviour::Reach as libp2p::swarm::NetworkBehaviour>::ToSwarm,
    ) {
        match event {}
    }
}
