//! Connection limits per source address: libp2p's `connection_limits`
//! counts per peer id and in total, and ids are free, so one host with many
//! ids could hold every connection. This behaviour caps inbound
//! established connections per host and per network, and shares the total
//! between source addresses ([`crate::fair_share`]): when every place is
//! held, a newcomer whose addresses hold less than their share gets in and
//! the newest connection of the most crowded addresses is closed. (Inbound
//! handshakes are capped the same way, in the transports:
//! [`crate::handshake_shares`].) It also keeps [`PeerSources`] for those
//! admitting streams.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll, Waker};

use libp2p::core::transport::PortUse;
use libp2p::core::Endpoint;
use libp2p::swarm::{
    dummy, CloseConnection, ConnectionClosed, ConnectionDenied, ConnectionId, FromSwarm,
    NetworkBehaviour, THandler, THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};

use crate::fair_share;
use crate::source_address::{source_ip, AddressGroup, PeerSources};

/// How many inbound connections sources may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressCaps {
    /// Established, per host.
    pub per_host: usize,
    /// Established, per network.
    pub per_network: usize,
    /// Established in total; see the module's header for who gets in when
    /// all are held.
    pub total: usize,
}

impl AddressCaps {
    /// A host may take an eighth of the connections, a network a quarter:
    /// a crowd of ids from one machine leaves most of the server to
    /// everyone else, and a crowd from many is cut to its share.
    pub fn share_of(max_established: u32) -> Self {
        let part = |divisor: u32| (max_established / divisor).max(1) as usize;
        AddressCaps {
            per_host: part(8),
            per_network: part(4),
            total: part(1),
        }
    }
}

/// Why a connection was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("{group} holds {limit} connections, the most one source may")]
    GroupFull { group: AddressGroup, limit: usize },
    #[error("all {limit} connections are held and this source holds its share")]
    Full { limit: usize },
}

#[derive(Debug)]
struct Inbound {
    connection: ConnectionId,
    peer: PeerId,
    source: IpAddr,
    /// Asked to close for a newcomer; no longer counted.
    closing: bool,
}

/// The behaviour; without caps it only keeps [`PeerSources`].
#[derive(Debug)]
pub struct AddressLimits {
    caps: Option<AddressCaps>,
    /// Inbound established connections with a source address, oldest first.
    inbound: Vec<Inbound>,
    to_close: VecDeque<(PeerId, ConnectionId)>,
    waker: Option<Waker>,
    sources: PeerSources,
}

impl AddressLimits {
    pub fn new(caps: Option<AddressCaps>) -> Self {
        AddressLimits {
            caps,
            inbound: Vec::new(),
            to_close: VecDeque::new(),
            waker: None,
            sources: PeerSources::default(),
        }
    }

    /// Where each connected peer comes from; stays current as connections come and go.
    pub fn sources(&self) -> PeerSources {
        self.sources.clone()
    }

    /// Admits an inbound connection from `ip`, choosing one to close for
    /// it when every place is held.
    fn admit(&mut self, caps: AddressCaps, ip: IpAddr) -> Result<(), Refused> {
        let counted = || self.inbound.iter().filter(|c| !c.closing);
        for (group, limit) in [
            (AddressGroup::host(ip), caps.per_host),
            (AddressGroup::network(ip), caps.per_network),
        ] {
            if counted().filter(|c| group.contains(c.source)).count() >= limit {
                return Err(Refused::GroupFull { group, limit });
            }
        }
        if counted().count() < caps.total {
            return Ok(());
        }
        let crowded = fair_share::crowded(
            counted().map(|c| (c.connection, Some(c.source))),
            Some(ip),
            caps.total,
        );
        // The newest of the crowd's: older connections carry sessions more
        // often than a crowd's latest arrivals.
        let victim = self
            .inbound
            .iter_mut()
            .rev()
            .find(|c| !c.closing && crowded.contains(&c.connection))
            .ok_or(Refused::Full { limit: caps.total })?;
        victim.closing = true;
        tracing::debug!(peer = %victim.peer, source = %victim.source,
            "closing a connection of a source over its share for a newcomer");
        self.to_close.push_back((victim.peer, victim.connection));
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
        Ok(())
    }
}

impl NetworkBehaviour for AddressLimits {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _peer: PeerId,
        _local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        if let (Some(caps), Some(ip)) = (self.caps, source_ip(remote)) {
            self.admit(caps, ip).map_err(ConnectionDenied::new)?;
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
                    self.inbound.push(Inbound {
                        connection: e.connection_id,
                        peer: e.peer_id,
                        source: ip,
                        closing: false,
                    });
                }
            }
            FromSwarm::ConnectionClosed(ConnectionClosed {
                peer_id,
                connection_id,
                ..
            }) => {
                self.sources.closed(peer_id, connection_id);
                self.inbound.retain(|c| c.connection != connection_id);
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

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        match self.to_close.pop_front() {
            Some((peer_id, connection)) => Poll::Ready(ToSwarm::CloseConnection {
                peer_id,
                connection: CloseConnection::One(connection),
            }),
            None => {
                self.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::core::ConnectedPoint;
    use libp2p::swarm::behaviour::ConnectionEstablished;

    fn addr(ip: &str) -> Multiaddr {
        format!("/ip4/{ip}/tcp/4001").parse().unwrap()
    }

    /// Offers an inbound connection from `ip`; its id when let in.
    fn connect(limits: &mut AddressLimits, next: &mut usize, ip: &str) -> Option<ConnectionId> {
        *next += 1;
        let id = ConnectionId::new_unchecked(*next);
        let (peer, local, remote) = (PeerId::random(), addr("10.0.0.1"), addr(ip));
        limits
            .handle_established_inbound_connection(id, peer, &local, &remote)
            .ok()?;
        let endpoint = ConnectedPoint::Listener {
            local_addr: local,
            send_back_addr: remote,
        };
        limits.on_swarm_event(FromSwarm::ConnectionEstablished(ConnectionEstablished {
            peer_id: peer,
            connection_id: id,
            endpoint: &endpoint,
            failed_addresses: &[],
            other_established: 0,
        }));
        Some(id)
    }

    #[test]
    fn hosts_and_networks_hold_their_caps_and_crowds_give_way() {
        let mut limits = AddressLimits::new(Some(AddressCaps {
            per_host: 2,
            per_network: 3,
            total: 6,
        }));
        let mut next = 0;
        let mut let_in = |limits: &mut AddressLimits, ip: &str| connect(limits, &mut next, ip);
        assert!(let_in(&mut limits, "5.5.5.5").is_some());
        assert!(let_in(&mut limits, "5.5.5.5").is_some());
        assert!(let_in(&mut limits, "5.5.5.5").is_none(), "host cap");
        assert!(let_in(&mut limits, "5.5.5.6").is_some());
        assert!(let_in(&mut limits, "5.5.5.7").is_none(), "network cap");
        // Three more networks of the same region fill the server...
        let newest = ["5.5.6.1", "5.5.7.1", "5.5.8.1"].map(|ip| let_in(&mut limits, ip).unwrap());
        // ...and a client from another region still gets in: the crowded
        // region's newest connection of its most crowded host is closed.
        assert!(let_in(&mut limits, "9.9.9.9").is_some());
        let closed: Vec<_> = limits.to_close.iter().map(|(_, c)| *c).collect();
        assert_eq!(closed.len(), 1);
        assert!(!newest.contains(&closed[0]), "5.5.5.5 holds the most");
        // Every region at its share (three each of six): the next one waits.
        let _ = (
            let_in(&mut limits, "9.9.9.10"),
            let_in(&mut limits, "9.9.10.1"),
        );
        assert!(let_in(&mut limits, "5.5.9.1").is_none());
        // Relayed connections are the relay's to limit.
        let relayed = format!("/ip4/5.5.5.5/tcp/1/p2p/{}/p2p-circuit", PeerId::random());
        assert!(limits
            .handle_established_inbound_connection(
                ConnectionId::new_unchecked(999),
                PeerId::random(),
                &addr("10.0.0.1"),
                &relayed.parse().unwrap(),
            )
            .is_ok());
    }
}
