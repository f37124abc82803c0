//! What the swarm reports, turned into the node's state: listen addresses
//! (advertised as external for servers), connections and their round trips,
//! identify (servers join the DHT), records and providers stored for others,
//! and query progress.

use libp2p::kad;
use libp2p::kad::store::RecordStore;
use libp2p::swarm::SwarmEvent;

use super::addresses::{is_relayed, with_host};
use super::direct::Connection;
use super::{Node, NodeEvent};
use crate::behaviour::BehaviourEvent;

impl Node {
    pub(super) fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        #[cfg(feature = "native")]
        if let Some(metrics) = &self.metrics {
            use libp2p::metrics::Recorder;
            metrics.record(&event);
        }
        match event {
            SwarmEvent::NewListenAddr {
                address,
                listener_id,
            } => {
                tracing::info!(%address, "listening");
                if let Some(public_host) = &self.advertise {
                    let relayed = is_relayed(&address);
                    let external = match public_host {
                        Some(host) if !relayed => Some(with_host(&address, host)),
                        // Behind a NAT the listen addresses reach nobody.
                        None if !relayed && self.is_private() => None,
                        _ => Some(address.clone()),
                    };
                    if let Some(external) = external {
                        self.swarm.add_external_address(external);
                    }
                }
                let _ = self.events.unbounded_send(NodeEvent::Listening {
                    listener_id,
                    address,
                });
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                addresses,
            } => {
                self.on_listener_closed(&addresses);
                if let Err(e) = reason {
                    let _ = self.events.unbounded_send(NodeEvent::ListenFailed {
                        listener_id,
                        error: e.to_string(),
                    });
                }
            }
            SwarmEvent::ListenerError { error, .. } => {
                tracing::warn!(%error, "listener error");
            }
            SwarmEvent::ConnectionEstablished {
                connection_id,
                peer_id,
                endpoint,
                ..
            } => {
                let relayed = endpoint.is_relayed();
                self.connections.insert(
                    connection_id,
                    Connection {
                        peer: peer_id,
                        relayed,
                    },
                );
                tracing::debug!(peer = %peer_id, relayed, address = %endpoint.get_remote_address(), "connected");
                if !relayed && endpoint.is_dialer() {
                    self.remember_dialed(peer_id, endpoint.get_remote_address().clone());
                }
                if let Some((_, reply)) = self.dials.remove(&connection_id) {
                    let _ = reply.send(Ok(()));
                }
                self.settle_direct_waiters(peer_id);
            }
            SwarmEvent::ConnectionClosed {
                connection_id,
                peer_id,
                num_established,
                ..
            } => {
                self.connections.remove(&connection_id);
                if num_established == 0 {
                    self.rtts.remove(&peer_id);
                    self.punch_failed.remove(&peer_id);
                }
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                error,
                peer_id,
            } => self.on_dial_failed(connection_id, peer_id, error.to_string()),
            SwarmEvent::Behaviour(BehaviourEvent::Ping(libp2p::ping::Event {
                peer,
                result: Ok(rtt),
                ..
            })) => {
                self.rtts.insert(peer, rtt);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Reach(event)) => self.on_reach(event),
            // Only servers take part in the DHT; clients run Kademlia in
            // client mode and are never added.
            SwarmEvent::Behaviour(BehaviourEvent::Identify(
                libp2p::identify::Event::Received { peer_id, info, .. },
            )) if info.protocols.contains(&crate::protocol::KADEMLIA_PROTOCOL) => {
                self.offer_relay(peer_id, &info.protocols);
                for addr in info.listen_addrs {
                    if self.admits(&addr) {
                        self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::PutRecord {
                        source,
                        record: Some(record),
                        ..
                    },
            })) => self.on_inbound_record(source, record),
            SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::AddProvider {
                        record: Some(provider),
                    },
            })) => {
                // Kademlia has checked that the provider is the peer that
                // sent it; whether it serves anything is checked at use.
                if let Err(e) = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .store_mut()
                    .add_provider(provider)
                {
                    tracing::debug!(error = %e, "cannot store a provider");
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::OutboundQueryProgressed {
                id,
                result,
                step,
                ..
            })) => {
                self.on_query(id, result, step.last);
            }
            _ => {}
        }
    }
}
