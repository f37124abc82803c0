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
