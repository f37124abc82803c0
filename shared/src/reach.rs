//! How a native node gets reached from behind a home router: AutoNAT (v2)
//! tells a server whether its addresses answer from outside, circuit relay
//! v2 lets public servers carry connections for private ones, DCUtR turns a
//! relayed connection into a direct one when both NATs allow it, and UPnP
//! asks the router for a port mapping first.
//!
//! [`Reach`] is the composed behaviour; [`ReachState`] is the node loop's
//! view of it: the server's [`Reachability`], the relays it reserved slots
//! on, and the one line the owner reads when that changes.

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroU32;
use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{autonat, dcutr, relay, upnp, Multiaddr, PeerId, StreamProtocol};

use crate::record::Reachability;
use crate::relay_service::{CircuitShares, RelayService};
use crate::relay_shares::ReservationShares;

/// The protocol a relay offers: peers listing it in identify can be asked
/// for a reservation.
pub const RELAY_HOP_PROTOCOL: StreamProtocol =
    StreamProtocol::new("/libp2p/circuit/relay/0.2.0/hop");

/// How long a relay slot lasts unless renewed (libp2p's relay clients renew
/// before it ends; libp2p's default is an hour, which let a crowd hold
/// slots long after it left).
pub const RESERVATION_LIFETIME: Duration = Duration::from_secs(15 * 60);

/// Relays a private server reserves slots on: one spare, so that losing a
/// relay leaves the server reachable while it finds another.
pub const RELAYS_PER_PRIVATE_SERVER: usize = 2;

/// What a public server's relay carries for others; owners change it with
/// `--relay-*` flags. libp2p's defaults (2 minutes, 128 KiB per circuit)
/// would cut an inference session after a few dozen steps: a session's
/// hidden states are megabytes, so circuits here are made for sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayLimits {
    /// Private peers holding a slot at once.
    pub max_reservations: usize,
    /// Relayed connections open at once.
    pub max_circuits: usize,
    /// Relayed connections one peer may have open at once.
    pub max_circuits_per_peer: usize,
    /// A relayed connection is closed after this long.
    pub max_circuit_duration: Duration,
    /// ... or after this many bytes (both directions together).
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        RelayLimits {
            max_reservations: 64,
            max_circuits: 32,
            max_circuits_per_peer: 8,
            max_circuit_duration: Duration::from_secs(30 * 60),
            max_circuit_bytes: 1 << 30,
        }
    }
}

/// Which reachability parts a node runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ReachSettings {
    /// Offer circuit relay v2 to others, within these limits (servers).
    pub relay: Option<RelayLimits>,
    /// Upgrade relayed connections to direct ones (DCUtR).
    pub hole_punch: bool,
    /// Ask the router for a port mapping (UPnP IGD).
    pub upnp: bool,
    /// Test this node's own addresses through others (AutoNAT v2 client)
    /// and answer their tests (AutoNAT v2 server): servers.
    pub autonat: bool,
    /// How often untested address candidates are put to a test.
    pub probe_interval: Duration,
}

impl ReachSettings {
    /// A server's defaults: everything on.
    pub fn server() -> Self {
        ReachSettings {
            relay: Some(RelayLimits::default()),
            hole_punch: true,
            upnp: true,
            autonat: true,
            probe_interval: Duration::from_secs(5),
        }
    }

    /// A native client's: it dials through relays and punches holes, and
    /// serves nobody.
    pub fn client() -> Self {
        ReachSettings {
            relay: None,
            hole_punch: true,
            upnp: false,
            autonat: false,
            probe_interval: Duration::from_secs(5),
        }
    }
}

#[derive(NetworkBehaviour)]
pub struct Reach {
    pub relay_client: relay::client::Behaviour,
    pub relay: Toggle<RelayService>,
    pub dcutr: Toggle<dcutr::Behaviour>,
    pub autonat: Toggle<autonat::v2::client::Behaviour>,
    pub autonat_server: Toggle<autonat::v2::server::Behaviour>,
    pub upnp: Toggle<upnp::tokio::Behaviour>,
}

impl Reach {
    pub fn new(
        peer_id: PeerId,
        relay_client: relay::client::Behaviour,
        settings: &ReachSettings,
    ) -> Self {
        let relay = settings.relay.as_ref().map(|limits| {
            let mut config = relay::Config {
                max_reservations: limits.max_reservations,
                max_circuits: limits.max_circuits,
                max_circuits_per_peer: limits.max_circuits_per_peer,
                max_circuit_duration: limits.max_circuit_duration,
                max_circuit_bytes: limits.max_circuit_bytes,
                reservation_duration: RESERVATION_LIFETIME,
                ..relay::Config::default()
            };
            // Slots shared between source addresses, beside libp2p's rates
            // per peer and per IP (one reservation every 2 min per peer, 30
            // an hour; 60 an hour per IP).
            config
                .reservation_rate_limiters
                .push(Box::new(ReservationShares::new(
                    limits.max_reservations,
                    RESERVATION_LIFETIME,
                )));
            // libp2p's default lets one source open one circuit every two
            // minutes: a client replaying to a replacement, or a route through
            // two private servers, needs more. Per source peer: 10 at once,
            // then one a minute; per source address, whatever its ids: as
            // many as the relay carries at once (the NAT tests' clients,
            // servers and relays behind one address open more than 8 in
            // seconds), then one every 2 s, so no crowd churns circuits.
            config.circuit_src_rate_limiters.clear();
            let all = NonZeroU32::new(limits.max_circuits.max(1) as u32).unwrap_or(NonZeroU32::MIN);
            config = config
                .circuit_src_per_peer(ten(), Duration::from_secs(60))
                .circuit_src_per_ip(all, Duration::from_secs(2));
            // Last: it counts what it admits until the circuit is set up.
            let shares = CircuitShares::new(limits.max_circuits);
            config.circuit_src_rate_limiters.push(shares.limiter());
            RelayService::new(peer_id, config, shares)
        });
        let autonat = settings.autonat.then(|| {
            autonat::v2::client::Behaviour::new(
                rand::make_rng::<rand::rngs::StdRng>(),
                autonat::v2::client::Config::default().with_probe_interval(settings.probe_interval),
            )
        });
        Reach {
            relay_client,
            relay: relay.into(),
            dcutr: settings
                .hole_punch
                .then(|| dcutr::Behaviour::new(peer_id))
                .into(),
            autonat: autonat.into(),
            autonat_server: settings
                .autonat
                .then(autonat::v2::server::Behaviour::default)
                .into(),
            upnp: settings.upnp.then(upnp::tokio::Behaviour::default).into(),
        }
    }
}

fn ten() -> NonZeroU32 {
    NonZeroU32::MIN.saturating_add(9)
}

/// Whether `addr` goes through a relay.
pub fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

/// The TCP or UDP port of an address, and which of the two.
fn port_of(addr: &Multiaddr) -> Option<(&'static str, u16)> {
    addr.iter().find_map(|p| match p {
        Protocol::Tcp(port) => Some(("TCP", port)),
        Protocol::Udp(port) => Some(("UDP", port)),
        _ => None,
    })
}

/// The node loop's view of its reachability.
#[derive(Debug, Default)]
pub struct ReachState {
    pub status: Reachability,
    /// Addresses others reached this node at (AutoNAT dial-backs, UPnP).
    confirmed: BTreeSet<Multiaddr>,
    /// Addresses others could not reach this node at.
    failed: BTreeSet<Multiaddr>,
    /// Peers this node dialed directly, at the address that answered.
    dialed: HashMap<PeerId, Multiaddr>,
    /// Peers offering a relay, with the direct address they were seen at.
    relays: HashMap<PeerId, Multiaddr>,
    /// Relays this node asked for a slot (listening through them).
    reserved: BTreeSet<PeerId>,
    /// Peers the owner named at start (`--initial-peers`): asked first.
    preferred: BTreeSet<PeerId>,
    /// Relayed circuits this node carries for others, open now.
    pub circuits: usize,
    /// The owner was told that no relay is to be had.
    told_no_relay: bool,
}

/// What the node loop should do after a reachability event.
#[derive(Debug, PartialEq)]
pub enum ReachAction {
    Nothing,
    /// The status changed: re-announce now.
    Changed(Reachability),
}

impl ReachState {
    pub fn prefer(&mut self, peers: impl IntoIterator<Item = PeerId>) {
        self.preferred.extend(peers);
    }

    /// This node dialed `peer` at `addr` and got through: an address other
    /// private nodes can most likely dial too.
    pub fn dialed(&mut self, peer: PeerId, addr: Multiaddr) {
        if !is_relayed(&addr) {
            self.dialed.insert(peer, addr);
        }
    }

    /// A peer offers a relay (it listed the hop protocol); only peers this
    /// node dialed are used, at the address it dialed them at: a peer that
    /// dialed in may itself be unreachable.
    pub fn offers_relay(&mut self, peer: PeerId) -> bool {
        match self.dialed.get(&peer) {
            Some(addr) => self.relays.insert(peer, addr.clone()).is_none(),
            None => false,
        }
    }

    pub fn forget_relay(&mut self, peer: &PeerId) {
        self.relays.remove(peer);
        self.reserved.remove(peer);
    }

    pub fn reserved(&self) -> impl Iterator<Item = &PeerId> {
        self.reserved.iter()
    }

    pub fn confirmed(&self) -> impl Iterator<Item = &Multiaddr> {
        self.confirmed.iter()
    }

    /// An AutoNAT test of `addr` ended.
    pub fn tested(&mut self, addr: Multiaddr, reachable: bool) -> ReachAction {
        if reachable {
            self.failed.remove(&addr);
            self.confirmed.insert(addr);
        } else {
            self.confirmed.remove(&addr);
            self.failed.insert(addr);
        }
        self.settle()
    }

    /// The router mapped a port (UPnP): reachable at `addr` from outside.
    pub fn mapped(&mut self, addr: Multiaddr) -> ReachAction {
        self.failed.remove(&addr);
        self.confirmed.insert(addr);
        self.settle()
    }

    pub fn unmapped(&mut self, addr: &Multiaddr) -> ReachAction {
        self.confirmed.remove(addr);
        self.settle()
    }

    fn settle(&mut self) -> ReachAction {
        let status = if !self.confirmed.is_empty() {
            Reachability::Public
        } else if !self.failed.is_empty() {
            Reachability::Private
        } else {
            Reachability::Unknown
        };
        if status == self.status {
            return ReachAction::Nothing;
        }
        self.status = status;
        ReachAction::Changed(status)
    }

    /// Relays to ask for a slot now: none while this node is reachable, else
    /// enough new ones (the owner's bootstrap peers first) to hold
    /// [`RELAYS_PER_PRIVATE_SERVER`] reservations.
    pub fn relays_to_reserve(&mut self) -> Vec<Multiaddr> {
        if self.status != Reachability::Private {
            return Vec::new();
        }
        let wanted = RELAYS_PER_PRIVATE_SERVER.saturating_sub(self.reserved.len());
        let mut candidates: Vec<(&PeerId, &Multiaddr)> = self
            .relays
            .iter()
            .filter(|(peer, _)| !self.reserved.contains(peer))
            .collect();
        candidates.sort_by_key(|(peer, _)| (!self.preferred.contains(peer), peer.to_bytes()));
        let chosen: Vec<(PeerId, Multiaddr)> = candidates
            .into_iter()
            .take(wanted)
            .map(|(peer, addr)| (*peer, addr.clone()))
            .collect();
        chosen
            .into_iter()
            .map(|(peer, addr)| {
                self.reserved.insert(peer);
                circuit_listen_addr(&addr, peer)
            })
            .collect()
    }

    /// True once, when this node is private and holds no relay slot nor
    /// knows a relay to ask: the owner must hear that nobody reaches it.
    pub fn stranded(&mut self) -> bool {
        let stranded = self.status == Reachability::Private
            && self.reserved.is_empty()
            && self.relays.is_empty();
        let first = stranded && !self.told_no_relay;
        self.told_no_relay |= stranded;
        first
    }

    /// The one line an owner reads about this node's reachability.
    pub fn owner_message(&self, listen_addrs: &[Multiaddr]) -> String {
        match self.status {
            Reachability::Public => format!(
                "reachable from the internet at {}: clients connect directly, nothing to do",
                join(self.confirmed.iter())
            ),
            Reachability::Private => {
                let mut ports: BTreeSet<(&str, u16)> = listen_addrs
                    .iter()
                    .filter(|a| !is_relayed(a))
                    .filter_map(port_of)
                    .collect();
                if ports.is_empty() {
                    ports.extend(self.failed.iter().filter_map(port_of));
                }
                let ports: Vec<String> = ports
                    .iter()
                    .map(|(proto, port)| format!("{proto} {port}"))
                    .collect();
                format!(
                    "not reachable from the internet (tested {}): clients reach this server \
                     through a relay, which is slower; for direct connections forward {} on \
                     your router to this machine, or enable UPnP on the router",
                    join(self.failed.iter()),
                    if ports.is_empty() {
                        "this server's ports".to_string()
                    } else {
                        ports.join(" and ")
                    }
                )
            }
            Reachability::Unknown => {
                "reachability unknown: no other server has tested this one's addresses yet"
                    .to_string()
            }
        }
    }
}

/// Where to listen to be reached through `relay` seen at `addr`.
pub fn circuit_listen_addr(addr: &Multiaddr, relay: PeerId) -> Multiaddr {
    let mut addr: Multiaddr = addr
        .iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect();
    addr.push(Protocol::P2p(relay));
    addr.push(Protocol::P2pCircuit);
    addr
}

fn join<'a>(addrs: impl Iterator<Item = &'a Multiaddr>) -> String {
    let all: Vec<String> = addrs.map(|a| a.to_string()).collect();
    if all.is_empty() {
        "no address".into()
    } else {
        all.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_failed_test_makes_a_node_private_until_one_address_answers() {
        let mut state = ReachState::default();
        assert_eq!(state.status, Reachability::Unknown);
        let tested = addr("/ip4/203.0.113.7/tcp/31337");
        assert_eq!(
            state.tested(tested.clone(), false),
            ReachAction::Changed(Reachability::Private)
        );
        assert_eq!(state.tested(tested.clone(), false), ReachAction::Nothing);
        let message = state.owner_message(&[addr("/ip4/192.168.1.2/tcp/31337")]);
        assert!(message.contains("forward TCP 31337"), "{message}");
        assert_eq!(
            state.mapped(addr("/ip4/203.0.113.7/tcp/40000")),
            ReachAction::Changed(Reachability::Public)
        );
        assert!(state.relays_to_reserve().is_empty());
    }

    #[test]
    fn a_private_node_reserves_two_relays_preferring_its_bootstrap_peers() {
        let mut state = ReachState::default();
        let peers: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        for (i, p) in peers.iter().enumerate() {
            state.dialed(*p, addr(&format!("/ip4/198.51.100.{i}/tcp/1")));
            assert!(state.offers_relay(*p));
        }
        let via_relay = PeerId::random();
        state.dialed(via_relay, addr("/ip4/198.51.100.9/tcp/1/p2p-circuit"));
        assert!(!state.offers_relay(via_relay), "only direct addresses");
        assert!(!state.offers_relay(PeerId::random()), "only peers dialed");
        state.prefer([peers[3]]);
        assert!(
            state.relays_to_reserve().is_empty(),
            "unknown: no relays yet"
        );
        state.tested(addr("/ip4/198.51.100.200/tcp/5"), false);
        let chosen = state.relays_to_reserve();
        assert_eq!(chosen.len(), RELAYS_PER_PRIVATE_SERVER);
        assert_eq!(
            chosen[0],
            addr(&format!(
                "/ip4/198.51.100.3/tcp/1/p2p/{}/p2p-circuit",
                peers[3]
            ))
        );
        assert!(chosen.iter().all(is_relayed));
        assert!(state.relays_to_reserve().is_empty(), "both slots held");
        let first = *state.reserved().next().unwrap();
        state.forget_relay(&first);
        assert_eq!(state.relays_to_reserve().len(), 1);
    }
}
