//! A relay's reservations shared between source addresses. libp2p's relay
//! counts reservations per peer and in total, and ids are free: one host
//! took 60 of 64 slots in a tenth of a second. This limiter (plugged in as
//! one of the relay's reservation rate limiters, which see every request
//! and renewal) admits a peer while its host and network hold fewer than
//! their share of the peers that reserved within one reservation's life.

use std::collections::HashMap;
use std::time::Duration;

use libp2p::relay::RateLimiter;
use libp2p::{Multiaddr, PeerId};
use web_time::Instant;

use crate::source_address::{source_ip, AddressGroup};

/// Peers that reserved lately, per host and per network.
pub struct ReservationShares {
    per_host: usize,
    per_network: usize,
    /// A reservation not renewed within this long has expired.
    lifetime: Duration,
    recent: HashMap<AddressGroup, HashMap<PeerId, Instant>>,
}

impl ReservationShares {
    /// A host may hold an eighth of `max_reservations`, a network a quarter.
    pub fn new(max_reservations: usize, lifetime: Duration) -> Self {
        ReservationShares {
            per_host: (max_reservations / 8).max(1),
            per_network: (max_reservations / 4).max(1),
            lifetime,
            recent: HashMap::new(),
        }
    }

    fn admit(&mut self, peer: PeerId, addr: &Multiaddr, now: Instant) -> bool {
        // No address to count it by: a relayed request is refused by the
        // relay anyway (no reservations over circuits).
        let Some(ip) = source_ip(addr) else {
            return true;
        };
        let lifetime = self.lifetime;
        self.recent.retain(|_, peers| {
            peers.retain(|_, at| now.duration_since(*at) < lifetime);
            !peers.is_empty()
        });
        let groups = [
            (AddressGroup::host(ip), self.per_host),
            (AddressGroup::network(ip), self.per_network),
        ];
        let full = groups.iter().any(|(group, cap)| {
            self.recent
                .get(group)
                .is_some_and(|peers| !peers.contains_key(&peer) && peers.len() >= *cap)
        });
        if full {
            tracing::debug!(%peer, %ip, "relay reservation refused: its address holds its share");
            return false;
        }
        for (group, _) in groups {
            self.recent.entry(group).or_default().insert(peer, now);
        }
        true
    }
}

impl RateLimiter for ReservationShares {
    fn try_next(&mut self, peer: PeerId, addr: &Multiaddr, now: Instant) -> bool {
        self.admit(peer, addr, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ip: &str) -> Multiaddr {
        format!("/ip4/{ip}/tcp/4001").parse().unwrap()
    }

    #[test]
    fn one_host_gets_its_share_and_renewals_and_expiry_are_counted_right() {
        let mut shares = ReservationShares::new(64, Duration::from_secs(900));
        let now = Instant::now();
        let crowd: Vec<PeerId> = (0..60).map(|_| PeerId::random()).collect();
        let admitted = crowd
            .iter()
            .filter(|p| shares.admit(**p, &at("6.6.6.6"), now))
            .count();
        assert_eq!(admitted, 8, "an eighth of 64 per host");
        // A renewal by a peer that holds one is not a new reservation.
        assert!(shares.admit(crowd[0], &at("6.6.6.6"), now));
        // The same network's other hosts share a quarter.
        let neighbours = (0..20)
            .filter(|_| shares.admit(PeerId::random(), &at("6.6.6.7"), now))
            .count();
        assert_eq!(neighbours, 8);
        // Elsewhere, everyone still gets in.
        assert!(shares.admit(PeerId::random(), &at("9.9.9.9"), now));
        // Reservations not renewed within their life no longer count.
        let later = now + Duration::from_secs(901);
        assert!(shares.admit(PeerId::random(), &at("6.6.6.6"), later));
    }
}
