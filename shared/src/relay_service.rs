//! The relay this node offers, with its circuits shared between source
//! addresses. libp2p's relay caps circuits per peer and in total, and rates
//! them per IP, but ids are free and a burst from one host could open every
//! circuit at once: NAT'd servers would lose their way in. [`CircuitShares`]
//! (one of the relay's circuit limiters) admits a circuit while its source
//! host and network have fewer than their share open or being set up;
//! [`RelayService`] wraps the relay to tell it when circuits open and close.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use libp2p::core::transport::PortUse;
use libp2p::core::Endpoint;
use libp2p::relay::{self, RateLimiter};
use libp2p::swarm::{
    CloseConnection, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler,
    THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};
use web_time::Instant;

use crate::relay_reclaim::ReservationLedger;
use crate::source_address::{source_ip, AddressGroup};

/// A circuit admitted but neither accepted nor refused within this long is
/// no longer counted (its events were lost, say).
const SETUP_WITHIN: Duration = Duration::from_secs(30);

/// Circuits per source host and network, open or being set up; shared by
/// the limiter the relay asks and the wrapper that sees its events.
#[derive(Clone, Debug)]
pub struct CircuitShares {
    inner: Arc<Mutex<Counts>>,
}

#[derive(Debug)]
struct Counts {
    per_host: usize,
    per_network: usize,
    /// Admitted circuits not yet accepted, oldest first: source peer, its
    /// groups, when.
    setting_up: Vec<(PeerId, [AddressGroup; 2], Instant)>,
    /// Open circuits' groups by (source, destination).
    open: HashMap<(PeerId, PeerId), Vec<[AddressGroup; 2]>>,
}

impl Counts {
    fn held_by(&self, group: AddressGroup) -> usize {
        let setting_up = self
            .setting_up
            .iter()
            .filter(|(_, groups, _)| groups.contains(&group))
            .count();
        let open = self
            .open
            .values()
            .flatten()
            .filter(|groups| groups.contains(&group))
            .count();
        setting_up + open
    }

    /// The oldest circuit `src` is setting up, no longer counted as such.
    fn take_setting_up(&mut self, src: PeerId) -> Option<[AddressGroup; 2]> {
        let at = self.setting_up.iter().position(|(p, _, _)| *p == src)?;
        Some(self.setting_up.remove(at).1)
    }
}

impl CircuitShares {
    /// A host may hold half of `max_circuits`, a network three quarters: a
    /// household behind one address (servers, clients and their relays
    /// behind one NAT) opens several at once, a crowd cannot open them all.
    pub fn new(max_circuits: usize) -> Self {
        CircuitShares {
            inner: Arc::new(Mutex::new(Counts {
                per_host: (max_circuits / 2).max(1),
                per_network: (max_circuits * 3 / 4).max(1),
                setting_up: Vec::new(),
                open: HashMap::new(),
            })),
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The limiter to hand the relay's configuration.
    pub fn limiter(&self) -> Box<dyn RateLimiter> {
        Box::new(self.clone())
    }

    fn admit(&self, src: PeerId, addr: &Multiaddr, now: Instant) -> bool {
        // Circuits are asked for over direct connections only.
        let Some(ip) = source_ip(addr) else {
            return true;
        };
        let mut counts = self.counts();
        counts
            .setting_up
            .retain(|(_, _, at)| now.duration_since(*at) < SETUP_WITHIN);
        let groups = [AddressGroup::host(ip), AddressGroup::network(ip)];
        if counts.held_by(groups[0]) >= counts.per_host
            || counts.held_by(groups[1]) >= counts.per_network
        {
            tracing::debug!(%src, %ip, "circuit refused: its address holds its share");
            return false;
        }
        counts.setting_up.push((src, groups, now));
        true
    }

    /// Follows a circuit from admission to its end.
    // The failure events are deprecated upstream but still emitted.
    #[allow(deprecated)]
    fn on_event(&self, event: &relay::Event) {
        let mut counts = self.counts();
        match event {
            relay::Event::CircuitReqAccepted {
                src_peer_id,
                dst_peer_id,
            } => {
                if let Some(groups) = counts.take_setting_up(*src_peer_id) {
                    counts
                        .open
                        .entry((*src_peer_id, *dst_peer_id))
                        .or_default()
                        .push(groups);
                }
            }
            // A limit's refusal (this one's or the relay's own, all checked
            // before a circuit is admitted) ends a request that was never
            // counted: it must not free the place of one the same peer has
            // in set-up, or a peer could hide its circuits by asking twice.
            // A refusal whose cause is unknown (DenyFailed) frees nothing;
            // the set-up then stops counting after SETUP_WITHIN.
            relay::Event::CircuitReqDenied {
                src_peer_id,
                status,
                ..
            } if !matches!(status, relay::StatusCode::ResourceLimitExceeded) => {
                counts.take_setting_up(*src_peer_id);
            }
            relay::Event::CircuitReqOutboundConnectFailed { src_peer_id, .. }
            | relay::Event::CircuitReqAcceptFailed { src_peer_id, .. } => {
                counts.take_setting_up(*src_peer_id);
            }
            relay::Event::CircuitClosed {
                src_peer_id,
                dst_peer_id,
                ..
            } => {
                let key = (*src_peer_id, *dst_peer_id);
                if let Some(open) = counts.open.get_mut(&key) {
                    open.pop();
                    if open.is_empty() {
                        counts.open.remove(&key);
                    }
                }
            }
            _ => {}
        }
    }
}

impl RateLimiter for CircuitShares {
    fn try_next(&mut self, peer: PeerId, addr: &Multiaddr, now: Instant) -> bool {
        self.admit(peer, addr, now)
    }
}

/// libp2p's relay, telling [`CircuitShares`] when circuits open and close,
/// and ending reservations of crowds over their share when a newcomer is
/// refused ([`ReservationLedger`]).
pub struct RelayService {
    relay: relay::Behaviour,
    shares: CircuitShares,
    ledger: ReservationLedger,
    to_close: VecDeque<PeerId>,
}

impl RelayService {
    /// `config` must carry `shares.limiter()` among its circuit limiters.
    pub fn new(peer: PeerId, config: relay::Config, shares: CircuitShares) -> Self {
        RelayService {
            ledger: ReservationLedger::new(config.max_reservations),
            relay: relay::Behaviour::new(peer, config),
            shares,
            to_close: VecDeque::new(),
        }
    }
}

impl NetworkBehaviour for RelayService {
    type ConnectionHandler = <relay::Behaviour as NetworkBehaviour>::ConnectionHandler;
    type ToSwarm = relay::Event;

    fn handle_pending_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.relay
            .handle_pending_inbound_connection(connection_id, local_addr, remote_addr)
    }

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.relay.handle_established_inbound_connection(
            connection_id,
            peer,
            local_addr,
            remote_addr,
        )
    }

    fn handle_pending_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        maybe_peer: Option<PeerId>,
        addresses: &[Multiaddr],
        effective_role: Endpoint,
    ) -> Result<Vec<Multiaddr>, ConnectionDenied> {
        self.relay.handle_pending_outbound_connection(
            connection_id,
            maybe_peer,
            addresses,
            effective_role,
        )
    }

    fn handle_established_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        addr: &Multiaddr,
        role_override: Endpoint,
        port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.relay.handle_established_outbound_connection(
            connection_id,
            peer,
            addr,
            role_override,
            port_use,
        )
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match &event {
            FromSwarm::ConnectionEstablished(e) => self
                .ledger
                .connected(e.peer_id, source_ip(e.endpoint.get_remote_address())),
            FromSwarm::ConnectionClosed(e) if e.remaining_established == 0 => {
                self.ledger.disconnected(&e.peer_id)
            }
            _ => {}
        }
        self.relay.on_swarm_event(event)
    }

    fn on_connection_handler_event(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        self.relay
            .on_connection_handler_event(peer_id, connection_id, event)
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        if let Some(peer_id) = self.to_close.pop_front() {
            return Poll::Ready(ToSwarm::CloseConnection {
                peer_id,
                connection: CloseConnection::All,
            });
        }
        let polled = self.relay.poll(cx);
        if let Poll::Ready(ToSwarm::GenerateEvent(event)) = &polled {
            self.shares.on_event(event);
            if let Some(victim) = self.ledger.on_event(event) {
                self.to_close.push_back(victim);
                cx.waker().wake_by_ref();
            }
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ip: &str) -> Multiaddr {
        format!("/ip4/{ip}/tcp/4001").parse().unwrap()
    }

    #[test]
    fn a_host_holds_half_the_circuits_and_gets_them_back_when_they_close() {
        let shares = CircuitShares::new(8);
        let now = Instant::now();
        let dst = PeerId::random();
        let crowd: Vec<PeerId> = (0..8).map(|_| PeerId::random()).collect();
        let admitted: Vec<PeerId> = crowd
            .iter()
            .copied()
            .filter(|p| shares.admit(*p, &at("6.6.6.6"), now))
            .collect();
        assert_eq!(admitted.len(), 4, "half of 8 per host, set-ups counted");
        assert!(shares.admit(PeerId::random(), &at("9.9.9.9"), now));
        // Accepted, they stay counted; refused or closed, they free a place.
        for p in &admitted[..3] {
            shares.on_event(&relay::Event::CircuitReqAccepted {
                src_peer_id: *p,
                dst_peer_id: dst,
            });
        }
        shares.on_event(&relay::Event::CircuitReqDenied {
            src_peer_id: admitted[3],
            dst_peer_id: dst,
            status: relay::StatusCode::NoReservation,
        });
        assert!(shares.admit(crowd[7], &at("6.6.6.6"), now));
        assert!(!shares.admit(PeerId::random(), &at("6.6.6.6"), now));
        // A second request refused for a limit does not free the place of
        // the peer's circuit in set-up.
        shares.on_event(&relay::Event::CircuitReqDenied {
            src_peer_id: crowd[7],
            dst_peer_id: dst,
            status: relay::StatusCode::ResourceLimitExceeded,
        });
        assert!(!shares.admit(PeerId::random(), &at("6.6.6.6"), now));
        shares.on_event(&relay::Event::CircuitClosed {
            src_peer_id: admitted[0],
            dst_peer_id: dst,
            error: None,
        });
        assert!(shares.admit(PeerId::random(), &at("6.6.6.6"), now));
        // Set-ups whose outcome never came stop counting.
        let later = now + SETUP_WITHIN + Duration::from_secs(1);
        assert!(shares.admit(PeerId::random(), &at("6.6.6.6"), later));
    }
}
