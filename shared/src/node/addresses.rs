//! Multiaddress helpers of the loop: rewriting the host a server announces,
//! telling relayed addresses apart.

use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;

/// `addr` with its IP replaced by `host` (an IP address or a DNS name).
pub fn with_host(addr: &Multiaddr, host: &str) -> Multiaddr {
    let replacement = match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => Protocol::Ip4(ip),
        Ok(std::net::IpAddr::V6(ip)) => Protocol::Ip6(ip),
        Err(_) => Protocol::Dns(host.to_string().into()),
    };
    addr.iter()
        .map(|p| match p {
            Protocol::Ip4(_) | Protocol::Ip6(_) => replacement.clone(),
            other => other,
        })
        .collect()
}

/// Whether `addr` goes through a relay.
pub(super) fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

/// Addresses of one peer's record handed to the swarm at most: a record
/// listing a hundred host:ports must not make a client dial them all (a
/// reflection tool against third parties). With [`super::lookup::MAX_PROVIDERS_CHECKED`]
/// records per lookup, one lookup dials at most 256 addresses.
pub const MAX_ADDRESSES_PER_PEER: usize = 4;

/// How far an IP address reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    /// Reachable from anywhere.
    Public,
    /// One private network (RFC 1918, carrier-grade NAT, IPv6 unique local
    /// or link-local), by its range.
    Private(PrivateRange),
    Loopback,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PrivateRange {
    Ten,
    OneSevenTwo,
    OneNineTwo,
    CarrierNat,
    UniqueLocal,
    LinkLocal,
}

fn scope_of(ip: std::net::IpAddr) -> Scope {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(ip) if ip.is_loopback() || ip.is_unspecified() => Scope::Loopback,
        IpAddr::V4(ip) => {
            let [a, b, ..] = ip.octets();
            match (a, b) {
                (10, _) => Scope::Private(PrivateRange::Ten),
                (172, 16..=31) => Scope::Private(PrivateRange::OneSevenTwo),
                (192, 168) => Scope::Private(PrivateRange::OneNineTwo),
                (100, 64..=127) => Scope::Private(PrivateRange::CarrierNat),
                (169, 254) => Scope::Private(PrivateRange::LinkLocal),
                _ => Scope::Public,
            }
        }
        IpAddr::V6(ip) if ip.is_loopback() || ip.is_unspecified() => Scope::Loopback,
        IpAddr::V6(ip) => match ip.segments()[0] {
            s if s & 0xfe00 == 0xfc00 => Scope::Private(PrivateRange::UniqueLocal),
            s if s & 0xffc0 == 0xfe80 => Scope::Private(PrivateRange::LinkLocal),
            _ => match ip.to_ipv4_mapped() {
                Some(v4) => scope_of(IpAddr::V4(v4)),
                None => Scope::Public,
            },
        },
    }
}

/// The scope of the first IP in `addr` (a relayed address: the relay's);
/// a DNS name counts as public.
fn address_scope(addr: &Multiaddr) -> Scope {
    addr.iter()
        .find_map(|p| match p {
            Protocol::Ip4(ip) => Some(scope_of(ip.into())),
            Protocol::Ip6(ip) => Some(scope_of(ip.into())),
            Protocol::Dns(_) | Protocol::Dns4(_) | Protocol::Dns6(_) | Protocol::Dnsaddr(_) => {
                Some(Scope::Public)
            }
            _ => None,
        })
        .unwrap_or(Scope::Public)
}

/// The addresses of a server's record worth dialing, at most
/// [`MAX_ADDRESSES_PER_PEER`], public ones first: a private or loopback
/// address only when this node itself listens on that kind of network
/// (`own`; a node that knows none of its own, the page, keeps them all),
/// so a record cannot aim a client at hosts of its local network.
pub fn dialable_addresses(record: &[String], own: &[Multiaddr]) -> Vec<Multiaddr> {
    let own_scopes: Vec<Scope> = own.iter().map(address_scope).collect();
    let mut chosen: Vec<(Scope, Multiaddr)> = Vec::new();
    for text in record {
        let Ok(addr) = text.parse::<Multiaddr>() else {
            continue;
        };
        let scope = address_scope(&addr);
        let usable = scope == Scope::Public || own.is_empty() || own_scopes.contains(&scope);
        if usable && !chosen.iter().any(|(_, a)| *a == addr) {
            chosen.push((scope, addr));
        }
    }
    // Stable: the record's order within a scope.
    chosen.sort_by_key(|(scope, _)| *scope);
    chosen
        .into_iter()
        .take(MAX_ADDRESSES_PER_PEER)
        .map(|(_, addr)| addr)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<Multiaddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    fn texts(list: &[Multiaddr]) -> Vec<String> {
        list.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn a_record_cannot_make_a_client_dial_a_crowd_of_addresses() {
        let many: Vec<String> = (0..100)
            .map(|i| format!("/ip4/203.0.113.{}/tcp/{}", i % 250, 1000 + i))
            .collect();
        let own = addrs(&["/ip4/198.51.100.7/tcp/4001"]);
        let chosen = dialable_addresses(&many, &own);
        assert_eq!(texts(&chosen), many[..MAX_ADDRESSES_PER_PEER]);
    }

    #[test]
    fn public_addresses_come_first_and_private_ones_only_from_their_network() {
        let record: Vec<String> = [
            "/ip4/192.168.1.20/tcp/31337",
            "/ip4/127.0.0.1/tcp/31337",
            "/ip4/10.0.0.5/tcp/31337",
            "/ip4/203.0.113.9/tcp/31337",
            "/dns4/server.example/tcp/443/wss",
            "/ip6/fd00::1/tcp/31337",
            "not an address",
            "/ip4/203.0.113.9/tcp/31337",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // A client on a public address only: public addresses, deduplicated.
        let public = dialable_addresses(&record, &addrs(&["/ip4/198.51.100.7/tcp/1"]));
        assert_eq!(
            texts(&public),
            [
                "/ip4/203.0.113.9/tcp/31337",
                "/dns4/server.example/tcp/443/wss"
            ]
        );
        // A client in a 192.168 network and on loopback: those too, after the public ones.
        let home = dialable_addresses(
            &record,
            &addrs(&["/ip4/192.168.1.4/tcp/1", "/ip4/127.0.0.1/tcp/1"]),
        );
        assert_eq!(
            texts(&home),
            [
                "/ip4/203.0.113.9/tcp/31337",
                "/dns4/server.example/tcp/443/wss",
                "/ip4/192.168.1.20/tcp/31337",
                "/ip4/127.0.0.1/tcp/31337",
            ]
        );
        // The page knows no address of its own: the count still holds.
        assert_eq!(
            dialable_addresses(&record, &[]).len(),
            MAX_ADDRESSES_PER_PEER
        );
    }

    #[test]
    fn scopes_are_told_apart() {
        let scope = |a: &str| address_scope(&a.parse().unwrap());
        assert_eq!(
            scope("/ip4/172.20.0.1/tcp/1"),
            Scope::Private(PrivateRange::OneSevenTwo)
        );
        assert_eq!(scope("/ip4/172.32.0.1/tcp/1"), Scope::Public);
        assert_eq!(
            scope("/ip4/100.100.0.1/tcp/1"),
            Scope::Private(PrivateRange::CarrierNat)
        );
        assert_eq!(
            scope("/ip6/fe80::1/tcp/1"),
            Scope::Private(PrivateRange::LinkLocal)
        );
        assert_eq!(scope("/ip6/::1/tcp/1"), Scope::Loopback);
        assert_eq!(scope("/ip6/2001:db8::1/tcp/1"), Scope::Public);
        assert_eq!(
            scope("/ip4/10.1.2.3/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit"),
            Scope::Private(PrivateRange::Ten)
        );
    }
}
