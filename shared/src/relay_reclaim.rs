//! Relay reservations reclaimed for newcomers. [`crate::relay_shares`]
//! caps what one host or network reserves, but a crowd from many networks
//! can still hold every slot, renewing each, and libp2p's relay refuses
//! every newcomer while it is full (without asking its limiters). This
//! ledger follows the relay's reservations; when a newcomer is refused
//! because the relay is full and its addresses hold less than their share
//! ([`crate::fair_share`]), the newest reservation of the most crowded
//! addresses is ended (its peer's connections closed), so the newcomer's
//! next request finds a free slot.

use std::collections::HashMap;
use std::net::IpAddr;

use libp2p::relay;
use libp2p::PeerId;

use crate::fair_share;

/// Who holds the relay's reservations, and from where.
#[derive(Debug)]
pub struct ReservationLedger {
    max_reservations: usize,
    /// Each connected peer's source address (its first direct connection).
    sources: HashMap<PeerId, IpAddr>,
    /// Peers holding a reservation, in the order they first reserved.
    holders: Vec<PeerId>,
}

impl ReservationLedger {
    pub fn new(max_reservations: usize) -> Self {
        ReservationLedger {
            max_reservations: max_reservations.max(1),
            sources: HashMap::new(),
            holders: Vec::new(),
        }
    }

    pub fn connected(&mut self, peer: PeerId, source: Option<IpAddr>) {
        if let Some(ip) = source {
            self.sources.entry(peer).or_insert(ip);
        }
    }

    /// `peer` has no connection left.
    pub fn disconnected(&mut self, peer: &PeerId) {
        self.sources.remove(peer);
        self.holders.retain(|p| p != peer);
    }

    /// Follows the relay's `event`; the peer whose reservation should end
    /// to make room, if the event was a newcomer refused for want of one.
    pub fn on_event(&mut self, event: &relay::Event) -> Option<PeerId> {
        match event {
            relay::Event::ReservationReqAccepted { src_peer_id, .. } => {
                if !self.holders.contains(src_peer_id) {
                    self.holders.push(*src_peer_id);
                }
                None
            }
            relay::Event::ReservationClosed { src_peer_id }
            | relay::Event::ReservationTimedOut { src_peer_id } => {
                self.holders.retain(|p| p != src_peer_id);
                None
            }
            relay::Event::ReservationReqDenied {
                src_peer_id,
                status: relay::StatusCode::ResourceLimitExceeded,
            } => self.room_for(src_peer_id),
            _ => None,
        }
    }

    fn room_for(&mut self, newcomer: &PeerId) -> Option<PeerId> {
        if self.holders.len() < self.max_reservations || self.holders.contains(newcomer) {
            return None;
        }
        let source = *self.sources.get(newcomer)?;
        let crowded = fair_share::crowded(
            self.holders
                .iter()
                .map(|p| (*p, self.sources.get(p).copied())),
            Some(source),
            self.max_reservations,
        );
        let victim = *self.holders.iter().rev().find(|p| crowded.contains(p))?;
        self.holders.retain(|p| *p != victim);
        tracing::debug!(%victim, %newcomer, "ending a relay reservation of a crowd over its share for a newcomer");
        Some(victim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(ledger: &mut ReservationLedger, ip: &str) -> PeerId {
        let peer = PeerId::random();
        ledger.connected(peer, Some(ip.parse().unwrap()));
        ledger.on_event(&relay::Event::ReservationReqAccepted {
            src_peer_id: peer,
            renewed: false,
        });
        peer
    }

    fn refused(ledger: &mut ReservationLedger, peer: PeerId) -> Option<PeerId> {
        ledger.on_event(&relay::Event::ReservationReqDenied {
            src_peer_id: peer,
            status: relay::StatusCode::ResourceLimitExceeded,
        })
    }

    #[test]
    fn a_crowd_of_networks_holding_every_slot_makes_room_for_a_newcomer() {
        let mut ledger = ReservationLedger::new(8);
        // Eight networks of one region hold all eight slots.
        let crowd: Vec<PeerId> = (0..8)
            .map(|i| accepted(&mut ledger, &format!("6.6.{i}.1")))
            .collect();
        let newcomer = PeerId::random();
        ledger.connected(newcomer, Some("9.9.9.9".parse().unwrap()));
        let victim = refused(&mut ledger, newcomer).expect("room made");
        assert!(crowd.contains(&victim));
        // Its next request is accepted; one of the crowd's is not answered
        // with more room while the regions hold their shares.
        ledger.on_event(&relay::Event::ReservationReqAccepted {
            src_peer_id: newcomer,
            renewed: false,
        });
        let crowd_again = PeerId::random();
        ledger.connected(crowd_again, Some("6.6.100.1".parse().unwrap()));
        assert_eq!(refused(&mut ledger, crowd_again), None);
        // A refusal for another cause (the relay not full) ends nothing.
        ledger.disconnected(&crowd[0]);
        assert_eq!(refused(&mut ledger, crowd_again), None);
    }
}
