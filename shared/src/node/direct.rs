//! Connections to one peer: dials answered when they are up or failed, and
//! callers waiting for a direct connection (or a hole punch) rather than a
//! relayed one.

use std::time::Duration;

use futures::channel::oneshot;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use web_time::Instant;

use super::{Node, NodeError};

/// How this node is connected to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// A connection of its own: straight, or through a hole punched in NATs.
    Direct,
    /// Through a relay: the peer is behind a NAT and no hole could be punched.
    Relayed,
}

/// A caller of [`super::NodeHandle::prefer_direct`] waiting for a connection or
/// a hole punch.
pub(super) struct DirectWaiter {
    peer: PeerId,
    deadline: Instant,
    reply: oneshot::Sender<Result<Via, NodeError>>,
}

/// A connection's peer and whether it goes through a relay.
#[derive(Debug, Clone, Copy)]
pub(super) struct Connection {
    pub(super) peer: PeerId,
    pub(super) relayed: bool,
}

#[cfg(feature = "native")]
fn hole_punch_enabled(reach: &crate::behaviour::Reach) -> bool {
    reach.dcutr.is_enabled()
}

#[cfg(not(feature = "native"))]
fn hole_punch_enabled(_reach: &crate::behaviour::Reach) -> bool {
    false
}

impl Node {
    /// Starts a dial whose outcome (connection up, or failed) answers `reply`.
    pub(super) fn dial(
        &mut self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        reply: oneshot::Sender<Result<(), NodeError>>,
    ) {
        let opts = DialOpts::peer_id(peer)
            .addresses(addrs)
            .condition(PeerCondition::Always)
            .build();
        let id = opts.connection_id();
        match self.swarm.dial(opts) {
            Ok(()) => {
                self.dials.insert(id, (peer, reply));
            }
            Err(e) => {
                let _ = reply.send(Err(NodeError::Dial {
                    peer,
                    error: e.to_string(),
                }));
            }
        }
    }

    /// A dial failed: its caller learns why, and so do the callers waiting
    /// for a connection to that peer when none is left.
    pub(super) fn on_dial_failed(
        &mut self,
        connection: ConnectionId,
        peer: Option<PeerId>,
        error: String,
    ) {
        if let Some((peer, reply)) = self.dials.remove(&connection) {
            let _ = reply.send(Err(NodeError::Dial {
                peer,
                error: error.clone(),
            }));
        }
        if let Some(peer) = peer {
            if self.via(&peer).is_none()
                && !self.swarm.is_connected(&peer)
                && self.direct_waiters.iter().any(|w| w.peer == peer)
            {
                self.fail_direct_waiters(peer, error);
            }
        }
    }

    /// Connects to `peer` unless connected, and answers `reply` with how
    /// once a direct connection is up or no hole punch is coming.
    pub(super) fn prefer_direct(
        &mut self,
        peer: PeerId,
        wait: Duration,
        reply: oneshot::Sender<Result<Via, NodeError>>,
    ) {
        self.direct_waiters.push(DirectWaiter {
            peer,
            deadline: Instant::now() + wait,
            reply,
        });
        if self.via(&peer).is_some() {
            self.settle_direct_waiters(peer);
            return;
        }
        let opts = DialOpts::peer_id(peer)
            .condition(PeerCondition::DisconnectedAndNotDialing)
            .build();
        if let Err(e) = self.swarm.dial(opts) {
            if !matches!(e, libp2p::swarm::DialError::DialPeerConditionFalse(_)) {
                self.fail_direct_waiters(peer, e.to_string());
            }
        }
    }

    /// Answers the waiters whose time is up with how the peer is connected
    /// by then, if at all.
    pub(super) fn expire_direct_waiters(&mut self, now: Instant) {
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.direct_waiters)
            .into_iter()
            .partition(|w| w.deadline <= now);
        self.direct_waiters = waiting;
        for w in due {
            let answer = match self.via(&w.peer) {
                Some(via) => Ok(via),
                None => Err(NodeError::Dial {
                    peer: w.peer,
                    error: "no connection came up in time".into(),
                }),
            };
            let _ = w.reply.send(answer);
        }
    }

    /// How this node is connected to `peer` now, if at all.
    pub(super) fn via(&self, peer: &PeerId) -> Option<Via> {
        let mut kinds = self.connections.values().filter(|c| c.peer == *peer);
        let first = kinds.next()?;
        if !first.relayed || kinds.any(|c| !c.relayed) {
            Some(Via::Direct)
        } else {
            Some(Via::Relayed)
        }
    }

    /// Answers the waiters for `peer` that can be answered now: a direct
    /// connection is up (relayed ones to the peer are closed, so that
    /// streams take the direct one), or a relayed one is and no hole punch
    /// is coming.
    pub(super) fn settle_direct_waiters(&mut self, peer: PeerId) {
        let via = self.via(&peer);
        let punching = self.hole_punching() && !self.punch_failed.contains(&peer);
        let answer = match via {
            Some(Via::Direct) => Via::Direct,
            Some(Via::Relayed) if !punching => Via::Relayed,
            _ => return,
        };
        if answer == Via::Direct {
            let relayed: Vec<_> = self
                .connections
                .iter()
                .filter(|(_, c)| c.peer == peer && c.relayed)
                .map(|(id, _)| *id)
                .collect();
            for id in relayed {
                self.swarm.close_connection(id);
            }
        }
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.direct_waiters)
            .into_iter()
            .partition(|w| w.peer == peer);
        self.direct_waiters = later;
        for w in now {
            let _ = w.reply.send(Ok(answer));
        }
    }

    fn hole_punching(&self) -> bool {
        self.swarm
            .behaviour()
            .reach
            .as_ref()
            .is_some_and(hole_punch_enabled)
    }

    pub(super) fn fail_direct_waiters(&mut self, peer: PeerId, error: String) {
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.direct_waiters)
            .into_iter()
            .partition(|w| w.peer == peer);
        self.direct_waiters = later;
        for w in now {
            let _ = w.reply.send(Err(NodeError::Dial {
                peer,
                error: error.clone(),
            }));
        }
    }
}
