//! The handle through which the program talks to the loop: each call sends
//! one [`Command`] and, where it asks something, awaits the loop's answer.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::channel::{mpsc, oneshot};
use futures::SinkExt;
use libp2p::{Multiaddr, PeerId};

use super::addresses::dialable_addresses;
use super::{Announcement, Command, NodeError, ReachReport, Via};
use crate::protocol::model_dht_key;
use crate::record::ServerRecord;
use crate::source_address::PeerSources;
use crate::time::with_timeout;

/// Cheap to clone; the loop stops when every handle is gone.
#[derive(Clone)]
pub struct NodeHandle {
    pub(super) peer_id: PeerId,
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) control: libp2p_stream::Control,
    pub(super) sources: PeerSources,
    /// The peers the user named to join through.
    pub(super) initial_peers: Arc<[PeerId]>,
}

impl NodeHandle {
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// This handle, remembering `peers` as the ones the user named to join
    /// the swarm through: the only servers a new client has reason to
    /// trust before it has measured any (see the client's swarm view).
    pub fn with_initial_peers(mut self, peers: impl IntoIterator<Item = PeerId>) -> Self {
        self.initial_peers = peers.into_iter().collect();
        self
    }

    /// The peers the user named to join through (none for a server's node
    /// or a test's).
    pub fn initial_peers(&self) -> &[PeerId] {
        &self.initial_peers
    }

    pub fn control(&self) -> libp2p_stream::Control {
        self.control.clone()
    }

    /// Where each connected peer's connection goes to or comes from (see
    /// [`crate::source_address`]): facts, unlike the addresses a record claims.
    pub fn sources(&self) -> &PeerSources {
        &self.sources
    }

    async fn send(&self, command: Command) -> Result<(), NodeError> {
        self.commands
            .clone()
            .send(command)
            .await
            .map_err(|_| NodeError::Stopped)
    }

    /// Returns once the swarm knows `addr`: a stream opened after this
    /// dials it.
    pub async fn add_address(&self, peer: PeerId, addr: Multiaddr) -> Result<(), NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::AddAddress {
            peer,
            address: addr,
            reply: tx,
        })
        .await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Tells the DHT this server leaves (a signed last record), and stops
    /// announcing; returns once that record is stored or after a few seconds.
    pub async fn leave(&self) -> Result<(), NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Leave { reply: tx }).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Starts a Kademlia bootstrap (filling the routing table from the
    /// peers known so far).
    pub async fn bootstrap(&self) -> Result<(), NodeError> {
        self.send(Command::Bootstrap).await
    }

    /// Starts (or, with `None`, stops) announcing this server.
    pub async fn announce(&self, announcement: Option<Announcement>) -> Result<(), NodeError> {
        self.send(Command::Announce(announcement)).await
    }

    /// Connects to `peer` at `addrs` (with its own timeout: some transports
    /// hang instead of failing).
    pub async fn dial(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        timeout: Duration,
    ) -> Result<(), NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Dial {
            peer,
            addresses: addrs,
            reply: tx,
        })
        .await?;
        with_timeout(timeout, rx)
            .await?
            .map_err(|_| NodeError::Stopped)?
    }

    /// The last ping round trip to each connected peer.
    pub async fn peer_rtts(&self) -> Result<HashMap<PeerId, Duration>, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::PeerRtts { reply: tx }).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// This node's reachability, relays and relayed circuits.
    pub async fn reach(&self) -> Result<ReachReport, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Reach { reply: tx }).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Connects to `peer` (at the addresses its record gave) and says how:
    /// when the only way is a relay and hole punching is on, waits up to
    /// `wait` for a direct connection, and once one is up closes the relayed
    /// ones, so that the streams opened next go direct.
    pub async fn prefer_direct(&self, peer: PeerId, wait: Duration) -> Result<Via, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::PreferDirect {
            peer,
            wait,
            reply: tx,
        })
        .await?;
        rx.await.map_err(|_| NodeError::Stopped)?
    }

    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::ListenAddrs { reply: tx }).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Servers announcing `model`: all the lookup found within `timeout`.
    pub async fn providers(
        &self,
        model: &str,
        timeout: Duration,
    ) -> Result<HashSet<PeerId>, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::GetProviders {
            key: model_dht_key(model),
            timeout,
            reply: tx,
        })
        .await?;
        rx.await.map_err(|_| NodeError::Stopped)?
    }

    /// The record `peer` published, checked to be its own; its addresses are
    /// handed to the swarm so that streams to it can be opened.
    pub async fn server_record(&self, peer: PeerId) -> Result<ServerRecord, NodeError> {
        let own = self.listen_addrs().await?;
        self.server_record_from(peer, &own).await
    }

    /// [`Self::server_record`], for a node listening on `own` (which
    /// decides the private addresses worth dialing).
    async fn server_record_from(
        &self,
        peer: PeerId,
        own: &[Multiaddr],
    ) -> Result<ServerRecord, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::GetRecord { peer, reply: tx }).await?;
        let record = rx.await.map_err(|_| NodeError::Stopped)??;
        if record.leaving {
            return Err(NodeError::Lookup(format!("{peer} has left the swarm")));
        }
        for addr in dialable_addresses(&record.addresses, own) {
            self.add_address(peer, addr).await?;
        }
        Ok(record)
    }

    /// Every server of `model` currently announced in the DHT, with its record.
    pub async fn discover(
        &self,
        model: &str,
        timeout: Duration,
    ) -> Result<Vec<ServerRecord>, NodeError> {
        let peers = self.providers(model, timeout).await?;
        let own = self.listen_addrs().await?;
        let own = &own;
        let lookups = peers.into_iter().map(|peer| async move {
            match with_timeout(timeout, self.server_record_from(peer, own)).await {
                Ok(Ok(r)) => Some(r),
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "no usable record");
                    None
                }
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "record lookup timed out");
                    None
                }
            }
        });
        let mut records: Vec<ServerRecord> = futures::future::join_all(lookups)
            .await
            .into_iter()
            .flatten()
            .collect();
        records.retain(|r| r.model == model);
        records.sort_by(|a, b| (a.start, &a.peer_id).cmp(&(b.start, &b.peer_id)));
        Ok(records)
    }
}
