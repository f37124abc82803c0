//! How a server learns and keeps its reachability: AutoNAT tests, UPnP
//! mappings, relay slots when it is private, hole punches, and the relay it
//! offers others. Native only; the browser's stub is `reachability_stub.rs`.

use libp2p::{Multiaddr, PeerId};

use super::addresses::is_relayed;
use super::{Node, ReachReport};
use crate::record::Reachability;

impl Node {
    pub(super) fn reach_report(&self) -> ReachReport {
        ReachReport {
            reachability: self.reach.status,
            relays: self.reach.reserved().copied().collect(),
            relay_circuits: self.reach.circuits,
        }
    }

    pub(super) fn is_private(&self) -> bool {
        self.reach.status == Reachability::Private
    }

    pub(super) fn remember_dialed(&mut self, peer: PeerId, addr: Multiaddr) {
        self.reach.dialed(peer, addr);
    }

    pub(super) fn offer_relay(&mut self, peer: PeerId, protocols: &[libp2p::StreamProtocol]) {
        if protocols.contains(&crate::reach::RELAY_HOP_PROTOCOL) && self.reach.offers_relay(peer) {
            tracing::debug!(%peer, "peer offers a relay");
            self.reserve_relays();
        }
    }

    /// A relay's listener closed (its connection or reservation ended):
    /// another relay takes its place.
    pub(super) fn on_listener_closed(&mut self, addresses: &[Multiaddr]) {
        use libp2p::multiaddr::Protocol;
        for addr in addresses.iter().filter(|a| is_relayed(a)) {
            let relay = addr
                .iter()
                .take_while(|p| *p != Protocol::P2pCircuit)
                .filter_map(|p| match p {
                    Protocol::P2p(peer) => Some(peer),
                    _ => None,
                })
                .last();
            if let Some(relay) = relay {
                tracing::info!(%relay, "lost the slot on a relay");
                self.reach.forget_relay(&relay);
            }
        }
        self.reserve_relays();
    }

    /// A private server listens through relays, which announce it.
    pub(super) fn reserve_relays(&mut self) {
        if self.advertise.is_none() {
            return;
        }
        for addr in self.reach.relays_to_reserve() {
            match self.swarm.listen_on(addr.clone()) {
                Ok(_) => tracing::info!(relay = %addr, "asking a relay for a slot"),
                Err(e) => {
                    tracing::warn!(relay = %addr, error = %e, "cannot listen through a relay")
                }
            }
        }
        if self.reach.stranded() {
            tracing::warn!(
                "no relay offers this server a slot: clients cannot reach it until one does \
                 (a public server started without --no-relay) or until its port is forwarded"
            );
        }
    }

    pub(super) fn on_reach(&mut self, event: crate::reach::ReachEvent) {
        use crate::reach::{ReachAction, ReachEvent};
        use libp2p::{autonat, dcutr, relay, upnp};
        let action = match event {
            ReachEvent::Autonat(autonat::v2::client::Event {
                tested_addr,
                server,
                result,
                ..
            }) => {
                tracing::debug!(address = %tested_addr, %server, reachable = result.is_ok(), "AutoNAT test");
                self.reach.tested(tested_addr, result.is_ok())
            }
            ReachEvent::AutonatServer(event) => {
                tracing::debug!(client = %event.client, address = %event.tested_addr, ok = event.result.is_ok(), "tested a peer's address");
                ReachAction::Nothing
            }
            ReachEvent::Upnp(upnp::Event::NewExternalAddr { external_addr, .. }) => {
                tracing::info!(address = %external_addr, "the router mapped a port (UPnP)");
                self.reach.mapped(external_addr)
            }
            ReachEvent::Upnp(upnp::Event::ExpiredExternalAddr { external_addr, .. }) => {
                tracing::info!(address = %external_addr, "the router's port mapping expired (UPnP)");
                self.reach.unmapped(&external_addr)
            }
            ReachEvent::Upnp(upnp::Event::GatewayNotFound) => {
                tracing::debug!("no UPnP router answered");
                ReachAction::Nothing
            }
            ReachEvent::Upnp(upnp::Event::NonRoutableGateway) => {
                tracing::debug!("the UPnP router is itself behind another NAT");
                ReachAction::Nothing
            }
            ReachEvent::Dcutr(event) => {
                if let Some(metrics) = &self.metrics {
                    use libp2p::metrics::Recorder;
                    metrics.record(&event);
                }
                let dcutr::Event {
                    remote_peer_id,
                    result,
                } = event;
                match result {
                    Ok(_) => {
                        tracing::info!(peer = %remote_peer_id, "hole punched: direct connection");
                        self.punch_failed.remove(&remote_peer_id);
                    }
                    Err(e) => {
                        tracing::info!(peer = %remote_peer_id, error = %e, "no hole punched: the connection stays relayed");
                        self.punch_failed.insert(remote_peer_id);
                    }
                }
                self.settle_direct_waiters(remote_peer_id);
                ReachAction::Nothing
            }
            ReachEvent::Relay(event) => {
                if let Some(metrics) = &self.metrics {
                    use libp2p::metrics::Recorder;
                    metrics.record(&event);
                }
                match &event {
                    relay::Event::CircuitReqAccepted {
                        src_peer_id,
                        dst_peer_id,
                    } => {
                        self.reach.circuits += 1;
                        tracing::debug!(src = %src_peer_id, dst = %dst_peer_id, "relaying a circuit");
                    }
                    relay::Event::CircuitClosed { .. } => {
                        self.reach.circuits = self.reach.circuits.saturating_sub(1);
                    }
                    relay::Event::ReservationReqAccepted {
                        src_peer_id,
                        renewed: false,
                    } => {
                        tracing::info!(peer = %src_peer_id, "gave a private peer a relay slot");
                    }
                    _ => {}
                }
                ReachAction::Nothing
            }
            ReachEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => {
                tracing::info!(relay = %relay_peer_id, "holding a slot on a relay: reachable through it");
                self.announce_now();
                ReachAction::Nothing
            }
            ReachEvent::RelayClient(_) => ReachAction::Nothing,
        };
        if let ReachAction::Changed(status) = action {
            self.on_reachability_changed(status);
        }
    }

    /// Tells the owner, re-announces, and (behind a NAT) stops announcing
    /// addresses nobody reaches and listens through relays instead.
    pub(super) fn on_reachability_changed(&mut self, status: Reachability) {
        let listening: Vec<Multiaddr> = self.swarm.listeners().cloned().collect();
        let message = self.reach.owner_message(&listening);
        match status {
            Reachability::Private => tracing::warn!("{message}"),
            _ => tracing::info!("{message}"),
        }
        if let Some(None) = self.advertise {
            if status == Reachability::Private {
                let unreachable: Vec<Multiaddr> = self
                    .swarm
                    .external_addresses()
                    .filter(|a| !is_relayed(a))
                    .filter(|a| !self.reach.confirmed().any(|c| c == *a))
                    .cloned()
                    .collect();
                for addr in unreachable {
                    self.swarm.remove_external_address(&addr);
                }
            } else {
                for addr in listening.into_iter().filter(|a| !is_relayed(a)) {
                    self.swarm.add_external_address(addr);
                }
            }
        }
        self.reserve_relays();
        self.announce_now();
    }
}
