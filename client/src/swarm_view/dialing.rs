//! Which servers this client can dial at all: a page speaks WebRTC-direct
//! and WebSocket and takes no relayed path; a native client speaks TCP,
//! straight or through a relay. Servers it cannot dial are left out of
//! routes, and named with the reason in errors.

use corolla_shared::ServerRecord;
use libp2p::Multiaddr;

/// Who dials: a page has WebRTC-direct and WebSocket transports and can
/// take no relayed path; a native client dials TCP, straight or through a
/// relay (its node has no WebSocket transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialer {
    Page,
    Native,
}

const THIS_CLIENT: Dialer = if cfg!(target_arch = "wasm32") {
    Dialer::Page
} else {
    Dialer::Native
};

/// Whether this client has a transport for one of `record`'s addresses.
pub fn can_dial(record: &ServerRecord) -> bool {
    dialer_can_dial(THIS_CLIENT, record)
}

fn dialer_can_dial(dialer: Dialer, record: &ServerRecord) -> bool {
    record
        .addresses
        .iter()
        .filter_map(|a| a.parse::<Multiaddr>().ok())
        .any(|a| dialable(dialer, &a))
}

fn dialable(dialer: Dialer, addr: &Multiaddr) -> bool {
    use libp2p::multiaddr::Protocol;
    let relayed = addr.iter().any(|p| p == Protocol::P2pCircuit);
    let websocket = addr
        .iter()
        .any(|p| matches!(p, Protocol::Ws(_) | Protocol::Wss(_)));
    match dialer {
        Dialer::Page => !relayed && (websocket || addr.iter().any(|p| p == Protocol::WebRTCDirect)),
        Dialer::Native => {
            // The first transport of the address is what this client must
            // speak: for a relayed address, the way to the relay.
            let first = addr.iter().find(|p| {
                matches!(
                    p,
                    Protocol::Tcp(_)
                        | Protocol::Udp(_)
                        | Protocol::Ws(_)
                        | Protocol::Wss(_)
                        | Protocol::QuicV1
                        | Protocol::WebRTCDirect
                )
            });
            matches!(first, Some(Protocol::Tcp(_))) && !websocket
        }
    }
}

/// Why a server this client cannot dial is left out, for error messages.
pub(super) fn unreachable_reason(record: &ServerRecord) -> String {
    dialer_unreachable_reason(THIS_CLIENT, record)
}

fn dialer_unreachable_reason(dialer: Dialer, record: &ServerRecord) -> String {
    let behind_nat = record.reachability == corolla_shared::Reachability::Private;
    match (record.addresses.is_empty(), behind_nat, dialer) {
        (true, true, _) => "unreachable: behind a NAT, and no relay holds a slot for it".into(),
        (true, false, _) => "unreachable: it announces no address".into(),
        (false, true, Dialer::Page) => {
            "unreachable from a browser: behind a NAT (a page cannot use its relayed address)"
                .into()
        }
        (false, false, Dialer::Page) => {
            "unreachable from a browser: no public WebRTC-direct or WebSocket address".into()
        }
        (false, _, Dialer::Native) => {
            "unreachable: no address this client has a transport for".into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corolla_shared::Reachability;

    fn relayed_address(peer: &str) -> String {
        let relay = libp2p::PeerId::random();
        format!("/ip4/198.51.100.1/tcp/42000/p2p/{relay}/p2p-circuit/p2p/{peer}")
    }

    fn record(addresses: &[String], reachability: Reachability) -> ServerRecord {
        ServerRecord {
            peer_id: libp2p::PeerId::random().to_string(),
            model: "m".into(),
            fingerprint: String::new(),
            block_hashes: vec!["h0".into()],
            start: 0,
            end: 1,
            num_layers: 1,
            hidden_size: 4,
            throughput: 1.0,
            prefill_throughput: 1.0,
            cache_tokens_left: 1,
            prefix_tokens: 0,
            adapters: Vec::new(),
            max_length: 1,
            sessions: 0,
            max_sessions: 1,
            dtype: "f32".into(),
            version: "0".into(),
            addresses: addresses.to_vec(),
            published_at_ms: 0,
            leaving: false,
            rebalances: false,
            reachability,
        }
    }

    #[test]
    fn native_clients_dial_tcp_straight_or_relayed_and_pages_only_public_browser_transports() {
        let tcp = "/ip4/203.0.113.5/tcp/31337".to_string();
        let relayed = relayed_address(&libp2p::PeerId::random().to_string());
        let ws = "/ip4/203.0.113.5/tcp/31338/ws".to_string();
        let webrtc = "/ip4/203.0.113.5/udp/31338/webrtc-direct".to_string();
        let quic = "/ip4/203.0.113.5/udp/31337/quic-v1".to_string();
        let cases = [
            (&tcp, true, false),
            (&relayed, true, false),
            (&ws, false, true),
            (&webrtc, false, true),
            (&quic, false, false),
        ];
        for (address, native, page) in cases {
            let r = record(std::slice::from_ref(address), Reachability::Public);
            assert_eq!(dialer_can_dial(Dialer::Native, &r), native, "{address}");
            assert_eq!(dialer_can_dial(Dialer::Page, &r), page, "{address}");
        }
    }

    #[test]
    fn the_reason_says_why_a_server_cannot_be_reached() {
        let stranded = record(&[], Reachability::Private);
        assert!(dialer_unreachable_reason(Dialer::Native, &stranded).contains("behind a NAT"));
        let relayed_only = record(
            &[relayed_address(&libp2p::PeerId::random().to_string())],
            Reachability::Private,
        );
        assert!(!dialer_can_dial(Dialer::Page, &relayed_only));
        let why = dialer_unreachable_reason(Dialer::Page, &relayed_only);
        assert!(why.contains("browser") && why.contains("NAT"), "{why}");
        let quic_only = record(
            &["/ip4/203.0.113.5/udp/31337/quic-v1".into()],
            Reachability::Public,
        );
        assert!(dialer_unreachable_reason(Dialer::Native, &quic_only).contains("transport"));
    }
}
