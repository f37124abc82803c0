//! Where a peer's connections come from, as the unit that limits count.
//!
//! Peer ids cost nothing, so a limit that counts per id limits nothing; IP
//! addresses cost something. One host is an IPv4 address or an IPv6 /64
//! (what one customer line gets); one network is an IPv4 /24 or an IPv6
//! /48 (what one hoster or one customer's block holds); one region is an
//! IPv4 /16 or an IPv6 /32 (what one provider's allocation often is, so a
//! crowd renting many /24s from one provider still counts as one). Limits
//! count them all, widest first ([`Level::WIDEST_FIRST`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};

/// A block of addresses sharing a prefix: the masked address and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddressGroup {
    prefix: IpAddr,
    bits: u8,
}

impl AddressGroup {
    fn masked(ip: IpAddr, bits: u8) -> Self {
        let prefix = match ip {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
                IpAddr::V4((u32::from(v4) & mask).into())
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
                IpAddr::V6((u128::from(v6) & mask).into())
            }
        };
        AddressGroup { prefix, bits }
    }

    /// The host `ip` is: itself (IPv4) or its /64 (IPv6).
    pub fn host(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::masked(ip, 32),
            IpAddr::V6(_) => Self::masked(ip, 64),
        }
    }

    /// The network `ip` is in: its /24 (IPv4) or /48 (IPv6).
    pub fn network(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::masked(ip, 24),
            IpAddr::V6(_) => Self::masked(ip, 48),
        }
    }

    /// The region `ip` is in: its /16 (IPv4) or /32 (IPv6).
    pub fn region(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::masked(ip, 16),
            IpAddr::V6(_) => Self::masked(ip, 32),
        }
    }

    /// Whether `ip` is in this group.
    pub fn contains(&self, ip: IpAddr) -> bool {
        Self::masked(ip, self.bits) == *self
    }

    /// The group of `ip` at `level`.
    pub fn at(level: Level, ip: IpAddr) -> Self {
        match level {
            Level::Region => Self::region(ip),
            Level::Network => Self::network(ip),
            Level::Host => Self::host(ip),
        }
    }
}

/// How wide a group of addresses is; see the module's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    Region,
    Network,
    Host,
}

impl Level {
    /// Shares are decided between regions first, then between the networks
    /// of one region, then between the hosts of one network.
    pub const WIDEST_FIRST: [Level; 3] = [Level::Region, Level::Network, Level::Host];
}

impl std::fmt::Display for AddressGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.prefix, self.bits)
    }
}

/// The IP address a connection's remote end has, read from the address it
/// was seen at. `None` for a relayed connection: its first IP is the
/// relay's, and the relay limits the circuits each source gets.
pub fn source_ip(remote: &Multiaddr) -> Option<IpAddr> {
    if remote.iter().any(|p| matches!(p, Protocol::P2pCircuit)) {
        return None;
    }
    remote.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

/// The source address of every connected peer, kept by the node's
/// behaviour and read by whoever admits streams (which arrive knowing only
/// their peer id).
#[derive(Debug, Clone, Default)]
pub struct PeerSources {
    inner: Arc<Mutex<ConnectionsByPeer>>,
}

/// Each peer's live connections with a known source, oldest first.
type ConnectionsByPeer = HashMap<PeerId, Vec<(ConnectionId, IpAddr)>>;

impl PeerSources {
    fn lock(&self) -> std::sync::MutexGuard<'_, ConnectionsByPeer> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn connected(&self, peer: PeerId, connection: ConnectionId, ip: IpAddr) {
        self.lock().entry(peer).or_default().push((connection, ip));
    }

    pub(crate) fn closed(&self, peer: PeerId, connection: ConnectionId) {
        let mut map = self.lock();
        if let Some(list) = map.get_mut(&peer) {
            list.retain(|(c, _)| *c != connection);
            if list.is_empty() {
                map.remove(&peer);
            }
        }
    }

    /// Where `peer` connected from (its oldest live connection's address);
    /// `None` when only relayed or not connected.
    pub fn of(&self, peer: &PeerId) -> Option<IpAddr> {
        self.lock()
            .get(peer)
            .and_then(|list| list.first())
            .map(|(_, ip)| *ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn hosts_and_networks_mask_the_right_bits() {
        assert_eq!(
            AddressGroup::host(ip("10.1.2.3")).to_string(),
            "10.1.2.3/32"
        );
        assert_eq!(
            AddressGroup::network(ip("10.1.2.3")),
            AddressGroup::network(ip("10.1.2.250"))
        );
        assert_ne!(
            AddressGroup::network(ip("10.1.2.3")),
            AddressGroup::network(ip("10.1.3.3"))
        );
        assert_eq!(
            AddressGroup::host(ip("2001:db8:1:2:aaaa::1")),
            AddressGroup::host(ip("2001:db8:1:2:bbbb::9"))
        );
        assert_eq!(
            AddressGroup::network(ip("2001:db8:1:2::1")).to_string(),
            "2001:db8:1::/48"
        );
        assert_eq!(
            AddressGroup::region(ip("10.1.2.3")).to_string(),
            "10.1.0.0/16"
        );
        assert_eq!(
            AddressGroup::at(Level::Region, ip("2001:db8:1:2::1")).to_string(),
            "2001:db8::/32"
        );
    }

    #[test]
    fn relayed_connections_have_no_source_address() {
        let direct: Multiaddr = "/ip4/1.2.3.4/tcp/5".parse().unwrap();
        assert_eq!(source_ip(&direct), Some(ip("1.2.3.4")));
        let relayed: Multiaddr = format!("/ip4/1.2.3.4/tcp/5/p2p/{}/p2p-circuit", PeerId::random())
            .parse()
            .unwrap();
        assert_eq!(source_ip(&relayed), None);
        let dns: Multiaddr = "/dns4/example.org/tcp/5".parse().unwrap();
        assert_eq!(source_ip(&dns), None);
    }

    #[test]
    fn a_peer_is_placed_at_its_oldest_live_connection() {
        let sources = PeerSources::default();
        let peer = PeerId::random();
        let (a, b) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
        );
        sources.connected(peer, a, ip("1.1.1.1"));
        sources.connected(peer, b, ip("2.2.2.2"));
        assert_eq!(sources.of(&peer), Some(ip("1.1.1.1")));
        sources.closed(peer, a);
        assert_eq!(sources.of(&peer), Some(ip("2.2.2.2")));
        sources.closed(peer, b);
        assert_eq!(sources.of(&peer), None);
    }
}
