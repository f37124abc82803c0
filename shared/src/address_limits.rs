//! Connection limits per source address: libp2p's `connection_limits`
//! counts per peer id and in total, and ids are free, so one host with many
//! ids could hold every handshake and connection slot. This behaviour
//! counts inbound connections per host and per network
//! ([`crate::source_address`]), still in their handshake and established,
//! and keeps [`PeerSources`] for those admitting streams.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

use libp2p::core::transport::PortUse;
use libp2p::core::Endpoint;
use libp2p::swarm::{
    dummy, ConnectionClosed, ConnectionDenied, ConnectionId, FromSwarm, ListenFailure,
    NetworkBehaviour, THandler, THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};

use crate::source_address::{source_ip, AddressGroup, PeerSources};

/// How many inbound connections one source may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressCaps {
    /// Still in their handshake, per host.
    pub pending_per_host: usize,
    /// Still in their handshake, per network.
    pub pending_per_network: usize,
    /// Established, per host.
    pub established_per_host: usize,
    /// Established, per network.
    pub established_per_network: usize,
}

impl AddressCaps {
    /// A host may take a quarter of the handshake slots and an eighth of
    /// the connections, a network twice that: a crowd of ids from one
    /// machine leaves most of the server to everyone else. (Handshakes are
    /// short; clients started together on one machine need a few at once.)
    pub fn share_of(max_pending: u32, max_established: u32) -> Self {
        let part = |total: u32, divisor: u32| (total / divisor).max(1) as usize;
        AddressCaps {
            pending_per_host: part(max_pending, 4),
            pending_per_network: part(max_pending, 2),
            established_per_host: part(max_established, 8),
            established_per_network: part(max_established, 4),
        }
    }
}

/// Counts per group; a group at zero is forgotten.
#[derive(Debug, Default)]
struct Counts(HashMap<AddressGroup, usize>);

impl Counts {
    fn get(&self, group: &AddressGroup) -> usize {
        self.0.get(group).copied().unwrap_or(0)
    }

    fn add(&mut self, ip: IpAddr) {
        for group in [AddressGroup::host(ip), AddressGroup::network(ip)] {
            *self.0.entry(group).or_insert(0) += 1;
        }
    }

    fn remove(&mut self, ip: IpAddr) {
        for group in [AddressGroup::host(ip), AddressGroup::network(ip)] {
            if let Some(n) = self.0.get_mut(&group) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.0.remove(&group);
                }
            }
        }
    }

    /// Refuses when `ip`'s host or network already holds its cap.
    fn check(&self, ip: IpAddr, per_host: usize, per_network: usize) -> Result<(), LimitReached> {
        let (host, network) = (AddressGroup::host(ip), AddressGroup::network(ip));
        for (group, limit) in [(host, per_host), (network, per_network)] {
            let held = self.get(&group);
            if held >= limit {
                return Err(LimitReached { group, limit });
            }
        }
        Ok(())
    }
}

/// The error a refused connection carries.
#[derive(Debug, thiserror::Error)]
#[error("{group} holds {limit} connections, the most one source may")]
pub struct LimitReached {
    pub group: AddressGroup,
    pub limit: usize,
}

/// The behaviour; without caps it only keeps [`PeerSources`].
#[derive(Debug)]
pub struct AddressLimits {
    caps: Option<AddressCaps>,
    pending: Counts,
    pending_by_connection: HashMap<ConnectionId, IpAddr>,
    established: Counts,
    established_by_connection: HashMap<ConnectionId, IpAddr>,
    sources: PeerSources,
}

impl AddressLimits {
    pub fn new(caps: Option<AddressCaps>) -> Self {
        AddressLimits {
            caps,
            pending: Counts::default(),
            pending_by_connection: HashMap::new(),
            established: Counts::default(),
            established_by_connection: HashMap::new(),
            sources: PeerSources::default(),
        }
    }

    /// Where each connected peer comes from; stays current as connections come and go.
    pub fn sources(&self) -> PeerSources {
        self.sources.clone()
    }

    fn pending_done(&mut self, connection: ConnectionId) {
        if let Some(ip) = self.pending_by_connection.remove(&connection) {
            self.pending.remove(ip);
        }
    }
}

impl NetworkBehaviour for AddressLimits {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        let (Some(caps), Some(ip)) = (self.caps, source_ip(remote)) else {
            return Ok(());
        };
        self.pending
            .check(ip, caps.pending_per_host, caps.pending_per_network)
            .map_err(ConnectionDenied::new)?;
        self.pending.add(ip);
        self.pending_by_connection.insert(connection_id, ip);
        Ok(())
    }

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _peer: PeerId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.pending_done(connection_id);
        if let (Some(caps), Some(ip)) = (self.caps, source_ip(remote)) {
            self.established
                .check(ip, caps.established_per_host, caps.established_per_network)
                .map_err(ConnectionDenied::new)?;
        }
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role_override: Endpoint,
        _port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                let Some(ip) = source_ip(e.endpoint.get_remote_address()) else {
                    return;
                };
                self.sources.connected(e.peer_id, e.connection_id, ip);
                if e.endpoint.is_listener() && self.caps.is_some() {
                    self.established.add(ip);
                    self.established_by_connection.insert(e.connection_id, ip);
                }
            }
            FromSwarm::ConnectionClosed(ConnectionClosed {
                peer_id,
                connection_id,
                ..
            }) => {
                self.sources.closed(peer_id, connection_id);
                if let Some(ip) = self.established_by_connection.remove(&connection_id) {
                    self.established.remove(ip);
                }
            }
            FromSwarm::ListenFailure(ListenFailure { connection_id, .. }) => {
                self.pending_done(connection_id);
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _connection: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_host_gets_its_share_of_handshakes_and_others_still_get_in() {
        let mut limits = AddressLimits::new(Some(AddressCaps {
            pending_per_host: 2,
            pending_per_network: 3,
            established_per_host: 8,
            established_per_network: 8,
        }));
        let local = addr("/ip4/10.0.0.1/tcp/1");
        let mut next = 0;
        let mut pend = |limits: &mut AddressLimits, remote: &str| {
            next += 1;
            let id = ConnectionId::new_unchecked(next);
            limits
                .handle_pending_inbound_connection(id, &local, &addr(remote))
                .map(|()| id)
        };
        let a = pend(&mut limits, "/ip4/5.5.5.5/tcp/1000").unwrap();
        pend(&mut limits, "/ip4/5.5.5.5/tcp/1001").unwrap();
        assert!(
            pend(&mut limits, "/ip4/5.5.5.5/tcp/1002").is_err(),
            "host cap"
        );
        pend(&mut limits, "/ip4/5.5.5.6/tcp/1000").unwrap();
        assert!(
            pend(&mut limits, "/ip4/5.5.5.7/tcp/1000").is_err(),
            "network cap"
        );
        pend(&mut limits, "/ip4/6.6.6.6/tcp/1000").unwrap();
        // A handshake that ends gives its place back.
        limits.on_swarm_event(FromSwarm::ListenFailure(ListenFailure {
            local_addr: &local,
            send_back_addr: &addr("/ip4/5.5.5.5/tcp/1000"),
            error: &libp2p::swarm::ListenError::Aborted,
            connection_id: a,
            peer_id: None,
        }));
        pend(&mut limits, "/ip4/5.5.5.5/tcp/1003").unwrap();
        // Relayed connections are the relay's to limit.
        let relayed = format!("/ip4/5.5.5.5/tcp/1/p2p/{}/p2p-circuit", PeerId::random());
        pend(&mut limits, &relayed).unwrap();
    }
}
