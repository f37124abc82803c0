//! One event loop owning a node's libp2p swarm, and the handle through which
//! the rest of the program talks to it.
//!
//! Servers and clients run the same loop: it answers DHT lookups, keeps the
//! server's announcement fresh (a provider entry under the model's key plus
//! its [`ServerRecord`] under its own key, re-published every update period
//! and expiring after two), and reports listen addresses. Records are signed
//! by the server's key; the loop stores others' records only after checking
//! the signature (and that they are newer than what it holds), and lookups
//! answer only with records that pass the same check. Streams are opened
//! and accepted through the `libp2p_stream::Control` in the handle, outside
//! the loop. The loop is runtime-agnostic: the caller spawns [`Node::run`].

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, SinkExt, StreamExt};
use futures_timer::Delay;
use libp2p::core::transport::ListenerId;
use libp2p::identity::Keypair;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{
    self, GetProvidersOk, GetRecordOk, QueryId, QueryResult, Quorum, Record, RecordKey,
};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Swarm};
use web_time::Instant;

use crate::behaviour::{Behaviour, BehaviourEvent};
use crate::protocol::model_dht_key;
use crate::record::{Reachability, RecordError, ServerRecord};

/// The DHT key holding one server's record.
pub fn server_dht_key(peer: &PeerId) -> RecordKey {
    RecordKey::new(&format!("/corolla/server/{peer}"))
}

/// Most servers of one model whose records one lookup checks: providers are
/// cheap to announce, so a flood of them must not cost a client more.
pub const MAX_PROVIDERS_CHECKED: usize = 64;
/// How long a leaving server waits for its last record to be stored.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("the network event loop has stopped")]
    Stopped,
    #[error("DHT lookup failed: {0}")]
    Lookup(String),
    #[error("record refused: {0}")]
    Record(#[from] RecordError),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("cannot connect to {peer}: {error}")]
    Dial { peer: PeerId, error: String },
}

/// How this node is connected to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// A connection of its own: straight, or through a hole punched in NATs.
    Direct,
    /// Through a relay: the peer is behind a NAT and no hole could be punched.
    Relayed,
}

/// What a node knows of its own reachability (servers test it; clients
/// and browsers stay `Unknown`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReachReport {
    pub reachability: Reachability,
    /// Relays this node holds a slot on.
    pub relays: Vec<PeerId>,
    /// Relayed connections this node carries for others, open now.
    pub relay_circuits: usize,
}

/// The live fields of a server's record (sessions, free cache), read at
/// every announcement.
pub type LiveFigures = std::sync::Arc<dyn Fn(&mut ServerRecord) + Send + Sync>;

/// What a server publishes about itself.
#[derive(Clone)]
pub struct Announcement {
    pub record: ServerRecord,
    pub period: Duration,
    /// Fills in the record's live fields before each announcement.
    pub live: Option<LiveFigures>,
}

impl std::fmt::Debug for Announcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcement")
            .field("record", &self.record)
            .field("period", &self.period)
            .field("live", &self.live.is_some())
            .finish()
    }
}

enum Command {
    AddAddress(PeerId, Multiaddr),
    /// Answered when the lookup ends or its time is up, with what was found by then.
    GetProviders(
        RecordKey,
        Duration,
        oneshot::Sender<Result<HashSet<PeerId>, NodeError>>,
    ),
    GetRecord(PeerId, oneshot::Sender<Result<ServerRecord, NodeError>>),
    Announce(Option<Announcement>),
    /// Publishes a last record saying the server leaves, then stops announcing.
    Leave(oneshot::Sender<()>),
    Bootstrap,
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    PeerRtts(oneshot::Sender<HashMap<PeerId, Duration>>),
    Reach(oneshot::Sender<ReachReport>),
    /// Connects to a peer (if not connected) and, when only a relayed
    /// connection is up, waits a while for a hole punch.
    PreferDirect(PeerId, Duration, oneshot::Sender<Result<Via, NodeError>>),
    /// Answered when the connection is up or the dial has failed.
    Dial(
        PeerId,
        Vec<Multiaddr>,
        oneshot::Sender<Result<(), NodeError>>,
    ),
}

/// Which peer addresses a node may dial; see [`Node::only_dial`].
pub type AddressFilter = Box<dyn Fn(&Multiaddr) -> bool + Send>;

/// Listen outcomes reported to whoever started the node.
#[derive(Debug, Clone)]
pub enum NodeEvent {
    Listening {
        listener_id: ListenerId,
        address: Multiaddr,
    },
    ListenFailed {
        listener_id: ListenerId,
        error: String,
    },
}

/// `addr` with its IP replaced by `host` (an IP address or a DNS name).
pub fn with_host(addr: &Multiaddr, host: &str) -> Multiaddr {
    use libp2p::multiaddr::Protocol;
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
fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter()
        .any(|p| p == libp2p::multiaddr::Protocol::P2pCircuit)
}

#[cfg(feature = "native")]
fn hole_punch_enabled(reach: &crate::behaviour::Reach) -> bool {
    reach.dcutr.is_enabled()
}

#[cfg(not(feature = "native"))]
fn hole_punch_enabled(_reach: &crate::behaviour::Reach) -> bool {
    false
}

/// Cheap to clone; the loop stops when every handle is gone.
#[derive(Clone)]
pub struct NodeHandle {
    peer_id: PeerId,
    commands: mpsc::Sender<Command>,
    control: libp2p_stream::Control,
}

struct ProviderLookup {
    reply: oneshot::Sender<Result<HashSet<PeerId>, NodeError>>,
    found: HashSet<PeerId>,
    deadline: Instant,
}

/// How often pending lookups are checked against their deadlines.
const LOOKUP_TICK: Duration = Duration::from_millis(100);

/// A caller of [`NodeHandle::prefer_direct`] waiting for a connection or
/// a hole punch.
struct DirectWaiter {
    peer: PeerId,
    deadline: Instant,
    reply: oneshot::Sender<Result<Via, NodeError>>,
}

/// A connection's peer and whether it goes through a relay.
#[derive(Debug, Clone, Copy)]
struct Connection {
    peer: PeerId,
    relayed: bool,
}

pub struct Node {
    swarm: Swarm<Behaviour>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::UnboundedSender<NodeEvent>,
    providers: HashMap<QueryId, ProviderLookup>,
    records: HashMap<QueryId, RecordLookup>,
    announcement: Option<Announcement>,
    next_announce: Delay,
    lookup_tick: Delay,
    /// Servers advertise their listen addresses (or their public name) as external.
    advertise: Option<Option<String>>,
    dials: HashMap<libp2p::swarm::ConnectionId, (PeerId, oneshot::Sender<Result<(), NodeError>>)>,
    address_filter: Option<AddressFilter>,
    /// A server's key, which signs its records.
    signer: Option<Keypair>,
    /// When set, providers outside it are not even looked at.
    allowed_peers: Option<HashSet<PeerId>>,
    leaving: Option<(Option<QueryId>, oneshot::Sender<()>, Instant)>,
    connections: HashMap<libp2p::swarm::ConnectionId, Connection>,
    /// The last ping round trip to each connected peer.
    rtts: HashMap<PeerId, Duration>,
    direct_waiters: Vec<DirectWaiter>,
    /// Peers a hole punch to failed: their relayed connection is what there is.
    punch_failed: HashSet<PeerId>,
    #[cfg(feature = "native")]
    reach: crate::reach::ReachState,
    #[cfg(feature = "native")]
    metrics: Option<libp2p::metrics::Metrics>,
}

struct RecordLookup {
    peer: PeerId,
    reply: oneshot::Sender<Result<ServerRecord, NodeError>>,
    /// Why the records found so far were refused.
    refused: Option<RecordError>,
    /// The newest valid copy so far, how many valid copies were seen, and
    /// when the lookup answers with it at the latest.
    newest: Option<(ServerRecord, usize, Instant)>,
}

/// Valid copies of a record after which a lookup answers with the newest.
const RECORD_COPIES_COMPARED: usize = 3;
/// How long a lookup that found one valid copy waits for newer ones: nodes
/// that missed a re-announcement still hold the older copy.
const RECORD_GRACE: Duration = Duration::from_millis(300);

impl Node {
    /// Wraps a built swarm. Returns the loop to spawn, its handle, and the
    /// stream of listen events.
    pub fn new(
        mut swarm: Swarm<Behaviour>,
    ) -> (Node, NodeHandle, mpsc::UnboundedReceiver<NodeEvent>) {
        let (tx, rx) = mpsc::channel(64);
        let (events_tx, events_rx) = mpsc::unbounded();
        let handle = NodeHandle {
            peer_id: *swarm.local_peer_id(),
            commands: tx,
            control: swarm.behaviour_mut().stream.new_control(),
        };
        let node = Node {
            swarm,
            commands: rx,
            events: events_tx,
            providers: HashMap::new(),
            records: HashMap::new(),
            announcement: None,
            next_announce: Delay::new(Duration::from_secs(3600)),
            lookup_tick: Delay::new(LOOKUP_TICK),
            advertise: None,
            dials: HashMap::new(),
            address_filter: None,
            signer: None,
            allowed_peers: None,
            leaving: None,
            connections: HashMap::new(),
            rtts: HashMap::new(),
            direct_waiters: Vec::new(),
            punch_failed: HashSet::new(),
            #[cfg(feature = "native")]
            reach: crate::reach::ReachState::default(),
            #[cfg(feature = "native")]
            metrics: None,
        };
        (node, handle, events_rx)
    }

    /// Makes this node a DHT server that advertises its listen addresses,
    /// with the host part replaced by `public_host` when given, and signs
    /// its records with `key` (the swarm's own).
    pub fn serve_dht(&mut self, public_host: Option<String>, key: Keypair) {
        self.signer = Some(key);
        self.swarm
            .behaviour_mut()
            .kad
            .set_mode(Some(kad::Mode::Server));
        self.advertise = Some(public_host);
    }

    /// Makes this node a DHT client: it queries but stores nothing for others.
    pub fn client_dht(&mut self) {
        self.swarm
            .behaviour_mut()
            .kad
            .set_mode(Some(kad::Mode::Client));
    }

    /// Learns only the peer addresses `filter` admits (from the DHT, identify
    /// and [`NodeHandle::add_address`]): a browser that must use one transport.
    pub fn only_dial(&mut self, filter: AddressFilter) {
        self.address_filter = Some(filter);
    }

    /// Looks only at these peers' records (a private swarm); the connection
    /// level refuses the others through [`crate::behaviour::NetworkLimits`].
    pub fn allow_only(&mut self, peers: Option<HashSet<PeerId>>) {
        self.allowed_peers = peers;
    }

    fn admits(&self, addr: &Multiaddr) -> bool {
        self.address_filter.as_ref().is_none_or(|f| f(addr))
    }

    /// Counts libp2p's events (connections, DHT queries, relay circuits,
    /// hole punches) into `registry`, under `libp2p_`.
    #[cfg(feature = "native")]
    pub fn record_metrics(&mut self, registry: &mut libp2p::metrics::Registry) {
        self.metrics = Some(libp2p::metrics::Metrics::new(registry));
    }

    /// Peers the owner named to enter the swarm: asked first for a relay slot.
    #[cfg(feature = "native")]
    pub fn prefer_relays(&mut self, peers: impl IntoIterator<Item = PeerId>) {
        self.reach.prefer(peers);
    }

    pub fn swarm_mut(&mut self) -> &mut Swarm<Behaviour> {
        &mut self.swarm
    }

    pub async fn run(mut self) {
        loop {
            futures::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                command = self.commands.next() => match command {
                    Some(c) => self.on_command(c),
                    None => break,
                },
                _ = (&mut self.next_announce).fuse() => self.announce(),
                _ = (&mut self.lookup_tick).fuse() => self.expire_lookups(),
            }
        }
        tracing::debug!("node event loop stopped");
    }

    /// Ends provider lookups whose time is up: a lookup can wait long on
    /// peers that died without closing their connections, and what it found
    /// before that is the answer.
    fn expire_lookups(&mut self) {
        self.lookup_tick.reset(LOOKUP_TICK);
        let now = Instant::now();
        if self
            .leaving
            .as_ref()
            .is_some_and(|(_, _, until)| *until <= now)
        {
            if let Some((_, reply, _)) = self.leaving.take() {
                let _ = reply.send(());
            }
        }
        let expired: Vec<QueryId> = self
            .providers
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some(lookup) = self.providers.remove(&id) {
                let _ = lookup.reply.send(Ok(lookup.found));
            }
            if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                q.finish();
            }
        }
        let settled: Vec<QueryId> = self
            .records
            .iter()
            .filter(|(_, l)| l.newest.as_ref().is_some_and(|(_, _, until)| *until <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in settled {
            self.answer_record_lookup(id);
        }
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
    fn via(&self, peer: &PeerId) -> Option<Via> {
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
    fn settle_direct_waiters(&mut self, peer: PeerId) {
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

    /// Answers a record lookup with the newest valid copy found (or why none
    /// was), and ends its query.
    fn answer_record_lookup(&mut self, id: QueryId) {
        if let Some(lookup) = self.records.remove(&id) {
            let answer = match (lookup.newest, lookup.refused) {
                (Some((record, _, _)), _) => Ok(record),
                (None, Some(e)) => Err(NodeError::Record(e)),
                (None, None) => Err(NodeError::Lookup("record not found".into())),
            };
            let _ = lookup.reply.send(answer);
        }
        if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id) {
            q.finish();
        }
    }

    fn announce(&mut self) {
        let Some(a) = &self.announcement else {
            self.next_announce.reset(Duration::from_secs(3600));
            return;
        };
        let period = a.period;
        let mut record = a.record.clone();
        if let Some(live) = &a.live {
            live(&mut record);
        }
        #[cfg(feature = "native")]
        {
            record.reachability = self.reach.status;
        }
        record.addresses = self
            .swarm
            .external_addresses()
            .map(|addr| {
                addr.clone()
                    .with_p2p(self.swarm.local_peer_id().to_owned())
                    .unwrap_or_else(|a| a)
                    .to_string()
            })
            .collect();
        let kad = &mut self.swarm.behaviour_mut().kad;
        if let Err(e) = kad.start_providing(model_dht_key(&record.model)) {
            tracing::warn!(error = %e, "cannot announce the model in the DHT");
        }
        self.publish(&mut record, period * 2);
        tracing::debug!(model = %record.model, start = record.start, end = record.end, "announced");
        self.next_announce.reset(period);
    }

    /// Signs `record` (stamped now) and stores it under this server's key,
    /// here and at the closest peers; returns the query.
    fn publish(&mut self, record: &mut ServerRecord, ttl: Duration) -> Option<QueryId> {
        let Some(key) = &self.signer else {
            tracing::warn!("a node without a signing key cannot publish records");
            return None;
        };
        record.published_at_ms = unix_millis();
        let bytes = match record.sign(key) {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(error = %e, "cannot sign the server record");
                return None;
            }
        };
        let mut dht_record = Record::new(server_dht_key(self.swarm.local_peer_id()), bytes);
        dht_record.expires = Some(Instant::now() + ttl);
        let kad = &mut self.swarm.behaviour_mut().kad;
        // Every closest peer gets the new copy: with a quorum of one, the
        // query ends at the first acknowledgement and the others keep
        // serving the old record to clients.
        match kad.put_record(dht_record, Quorum::All) {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::warn!(error = %e, "cannot publish the server record in the DHT");
                None
            }
        }
    }

    /// The last announcement: the record says the server leaves, and the
    /// model's provider entry is withdrawn here (others expire theirs).
    fn leave(&mut self, reply: oneshot::Sender<()>) {
        let Some(a) = self.announcement.take() else {
            let _ = reply.send(());
            return;
        };
        self.next_announce.reset(Duration::from_secs(3600));
        let mut record = a.record;
        record.leaving = true;
        record.addresses.clear();
        self.swarm
            .behaviour_mut()
            .kad
            .stop_providing(&model_dht_key(&record.model));
        let query = self.publish(&mut record, a.period * 2);
        self.leaving = Some((query, reply, Instant::now() + LEAVE_TIMEOUT));
    }

    /// Another node asks this one to store a record: only a correctly signed
    /// server record under its own peer's key, newer than the one held.
    fn on_inbound_record(&mut self, source: PeerId, record: Record) {
        let checked = check_stored_record(&record).and_then(|r| {
            let held = self
                .swarm
                .behaviour_mut()
                .kad
                .store_mut()
                .get(&record.key)
                .and_then(|old| ServerRecord::from_signed_bytes(&old.value, None).ok());
            match held {
                Some(old) if old.published_at_ms >= r.published_at_ms => {
                    Err("not newer than the record held".to_string())
                }
                _ => Ok(()),
            }
        });
        match checked {
            Ok(()) => {
                if let Err(e) = self.swarm.behaviour_mut().kad.store_mut().put(record) {
                    tracing::debug!(error = %e, "cannot store a record");
                }
            }
            Err(why) => tracing::debug!(%source, %why, "refused a record"),
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::AddAddress(peer, addr) => {
                if self.admits(&addr) {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, addr.clone());
                    self.swarm.add_peer_address(peer, addr);
                }
            }
            Command::Dial(peer, addrs, reply) => self.dial(peer, addrs, reply),
            Command::GetProviders(key, timeout, reply) => {
                let id = self.swarm.behaviour_mut().kad.get_providers(key);
                let deadline = Instant::now() + timeout;
                self.providers.insert(
                    id,
                    ProviderLookup {
                        reply,
                        found: HashSet::new(),
                        deadline,
                    },
                );
            }
            Command::GetRecord(peer, reply) => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_record(server_dht_key(&peer));
                self.records.insert(
                    id,
                    RecordLookup {
                        peer,
                        reply,
                        refused: None,
                        newest: None,
                    },
                );
            }
            Command::Announce(a) => {
                self.announcement = a;
                self.announce();
            }
            Command::Leave(reply) => self.leave(reply),
            Command::Bootstrap => {
                let _ = self.swarm.behaviour_mut().kad.bootstrap();
            }
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::PeerRtts(reply) => {
                let _ = reply.send(self.rtts.clone());
            }
            Command::Reach(reply) => {
                let _ = reply.send(self.reach_report());
            }
            Command::PreferDirect(peer, wait, reply) => {
                self.direct_waiters.push(DirectWaiter {
                    peer,
                    deadline: Instant::now() + wait,
                    reply,
                });
                if self.via(&peer).is_some() {
                    self.settle_direct_waiters(peer);
                } else {
                    let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                        .condition(
                            libp2p::swarm::dial_opts::PeerCondition::DisconnectedAndNotDialing,
                        )
                        .build();
                    if let Err(e) = self.swarm.dial(opts) {
                        if !matches!(e, libp2p::swarm::DialError::DialPeerConditionFalse(_)) {
                            self.fail_direct_waiters(peer, e.to_string());
                        }
                    }
                }
            }
        }
    }

    fn fail_direct_waiters(&mut self, peer: PeerId, error: String) {
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

    #[cfg(feature = "native")]
    fn reach_report(&self) -> ReachReport {
        ReachReport {
            reachability: self.reach.status,
            relays: self.reach.reserved().copied().collect(),
            relay_circuits: self.reach.circuits,
        }
    }

    #[cfg(not(feature = "native"))]
    fn reach_report(&self) -> ReachReport {
        ReachReport::default()
    }

    /// Starts a dial whose outcome (connection up, or failed) answers `reply`.
    fn dial(
        &mut self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        reply: oneshot::Sender<Result<(), NodeError>>,
    ) {
        let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
            .addresses(addrs)
            .condition(libp2p::swarm::dial_opts::PeerCondition::Always)
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

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
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
            } => {
                if let Some((peer, reply)) = self.dials.remove(&connection_id) {
                    let _ = reply.send(Err(NodeError::Dial {
                        peer,
                        error: error.to_string(),
                    }));
                }
                if let Some(peer) = peer_id {
                    if self.via(&peer).is_none()
                        && !self.swarm.is_connected(&peer)
                        && self.direct_waiters.iter().any(|w| w.peer == peer)
                    {
                        self.fail_direct_waiters(peer, error.to_string());
                    }
                }
            }
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

    #[cfg(feature = "native")]
    fn is_private(&self) -> bool {
        self.reach.status == Reachability::Private
    }

    #[cfg(not(feature = "native"))]
    fn is_private(&self) -> bool {
        false
    }

    #[cfg(feature = "native")]
    fn remember_dialed(&mut self, peer: PeerId, addr: Multiaddr) {
        self.reach.dialed(peer, addr);
    }

    #[cfg(not(feature = "native"))]
    fn remember_dialed(&mut self, _peer: PeerId, _addr: Multiaddr) {}

    #[cfg(feature = "native")]
    fn offer_relay(&mut self, peer: PeerId, protocols: &[libp2p::StreamProtocol]) {
        if protocols.contains(&crate::reach::RELAY_HOP_PROTOCOL) && self.reach.offers_relay(peer) {
            tracing::debug!(%peer, "peer offers a relay");
            self.reserve_relays();
        }
    }

    #[cfg(not(feature = "native"))]
    fn offer_relay(&mut self, _peer: PeerId, _protocols: &[libp2p::StreamProtocol]) {}

    /// A relay's listener closed (its connection or reservation ended):
    /// another relay takes its place.
    #[cfg(feature = "native")]
    fn on_listener_closed(&mut self, addresses: &[Multiaddr]) {
        use libp2p::multiaddr::Protocol;
        for addr in addresses.iter().filter(|a| is_relayed(a)) {
            let relay = addr
                .iter()
                .take_while(|p| *p != Protocol::P2pCircuit)
                .filter_map(|p| match p {
                    Protocol::P2p(peer) => Some(peer),
                    _ => None,
                })
                .last();
            if let Some(relay) = relay {
                tracing::info!(%relay, "lost the slot on a relay");
                self.reach.forget_relay(&relay);
            }
        }
        self.reserve_relays();
    }

    #[cfg(not(feature = "native"))]
    fn on_listener_closed(&mut self, _addresses: &[Multiaddr]) {}

    /// A private server listens through relays, which announce it.
    #[cfg(feature = "native")]
    fn reserve_relays(&mut self) {
        if self.advertise.is_none() {
            return;
        }
        for addr in self.reach.relays_to_reserve() {
            match self.swarm.listen_on(addr.clone()) {
                Ok(_) => tracing::info!(relay = %addr, "asking a relay for a slot"),
                Err(e) => {
                    tracing::warn!(relay = %addr, error = %e, "cannot listen through a relay")
                }
            }
        }
        if self.reach.stranded() {
            tracing::warn!(
                "no relay offers this server a slot: clients cannot reach it until one does \
                 (a public server started without --no-relay) or until its port is forwarded"
            );
        }
    }

    #[cfg(feature = "native")]
    fn on_reach(&mut self, event: crate::reach::ReachEvent) {
        use crate::reach::{ReachAction, ReachEvent};
        use libp2p::{autonat, dcutr, relay, upnp};
        let action = match event {
            ReachEvent::Autonat(autonat::v2::client::Event {
                tested_addr,
                server,
                result,
                ..
            }) => {
                tracing::debug!(address = %tested_addr, %server, reachable = result.is_ok(), "AutoNAT test");
                self.reach.tested(tested_addr, result.is_ok())
            }
            ReachEvent::AutonatServer(event) => {
                tracing::debug!(client = %event.client, address = %event.tested_addr, ok = event.result.is_ok(), "tested a peer's address");
                ReachAction::Nothing
            }
            ReachEvent::Upnp(upnp::Event::NewExternalAddr { external_addr, .. }) => {
                tracing::info!(address = %external_addr, "the router mapped a port (UPnP)");
                self.reach.mapped(external_addr)
            }
            ReachEvent::Upnp(upnp::Event::ExpiredExternalAddr { external_addr, .. }) => {
                tracing::info!(address = %external_addr, "the router's port mapping expired (UPnP)");
                self.reach.unmapped(&external_addr)
            }
            ReachEvent::Upnp(upnp::Event::GatewayNotFound) => {
                tracing::debug!("no UPnP router answered");
                ReachAction::Nothing
            }
            ReachEvent::Upnp(upnp::Event::NonRoutableGateway) => {
                tracing::debug!("the UPnP router is itself behind another NAT");
                ReachAction::Nothing
            }
            ReachEvent::Dcutr(event) => {
                if let Some(metrics) = &self.metrics {
                    use libp2p::metrics::Recorder;
                    metrics.record(&event);
                }
                let dcutr::Event {
                    remote_peer_id,
                    result,
                } = event;
                match result {
                    Ok(_) => {
                        tracing::info!(peer = %remote_peer_id, "hole punched: direct connection");
                        self.punch_failed.remove(&remote_peer_id);
                    }
                    Err(e) => {
                        tracing::info!(peer = %remote_peer_id, error = %e, "no hole punched: the connection stays relayed");
                        self.punch_failed.insert(remote_peer_id);
                    }
                }
                self.settle_direct_waiters(remote_peer_id);
                ReachAction::Nothing
            }
            ReachEvent::Relay(event) => {
                if let Some(metrics) = &self.metrics {
                    use libp2p::metrics::Recorder;
                    metrics.record(&event);
                }
                match &event {
                    relay::Event::CircuitReqAccepted {
                        src_peer_id,
                        dst_peer_id,
                    } => {
                        self.reach.circuits += 1;
                        tracing::debug!(src = %src_peer_id, dst = %dst_peer_id, "relaying a circuit");
                    }
                    relay::Event::CircuitClosed { .. } => {
                        self.reach.circuits = self.reach.circuits.saturating_sub(1);
                    }
                    relay::Event::ReservationReqAccepted {
                        src_peer_id,
                        renewed: false,
                    } => {
                        tracing::info!(peer = %src_peer_id, "gave a private peer a relay slot");
                    }
                    _ => {}
                }
                ReachAction::Nothing
            }
            ReachEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => {
                tracing::info!(relay = %relay_peer_id, "holding a slot on a relay: reachable through it");
                self.announce_now();
                ReachAction::Nothing
            }
            ReachEvent::RelayClient(_) => ReachAction::Nothing,
        };
        if let ReachAction::Changed(status) = action {
            self.on_reachability_changed(status);
        }
    }

    #[cfg(not(feature = "native"))]
    fn on_reach(
        &mut self,
        event: <crate::behaviour::Reach as libp2p::swarm::NetworkBehaviour>::ToSwarm,
    ) {
        match event {}
    }

    /// Tells the owner, re-announces, and (behind a NAT) stops announcing
    /// addresses nobody reaches and listens through relays instead.
    #[cfg(feature = "native")]
    fn on_reachability_changed(&mut self, status: Reachability) {
        let listening: Vec<Multiaddr> = self.swarm.listeners().cloned().collect();
        let message = self.reach.owner_message(&listening);
        match status {
            Reachability::Private => tracing::warn!("{message}"),
            _ => tracing::info!("{message}"),
        }
        if let Some(None) = self.advertise {
            if status == Reachability::Private {
                let unreachable: Vec<Multiaddr> = self
                    .swarm
                    .external_addresses()
                    .filter(|a| !is_relayed(a))
                    .filter(|a| !self.reach.confirmed().any(|c| c == *a))
                    .cloned()
                    .collect();
                for addr in unreachable {
                    self.swarm.remove_external_address(&addr);
                }
            } else {
                for addr in listening.into_iter().filter(|a| !is_relayed(a)) {
                    self.swarm.add_external_address(addr);
                }
            }
        }
        self.reserve_relays();
        self.announce_now();
    }

    /// Publishes the record now rather than at the next period.
    #[cfg(feature = "native")]
    fn announce_now(&mut self) {
        if self.announcement.is_some() {
            self.announce();
        }
    }

    fn on_query(&mut self, id: QueryId, result: QueryResult, last: bool) {
        match result {
            QueryResult::GetProviders(result) => {
                if let Some(lookup) = self.providers.get_mut(&id) {
                    if let Ok(GetProvidersOk::FoundProviders { providers, .. }) = &result {
                        let allowed = self.allowed_peers.as_ref();
                        let room = MAX_PROVIDERS_CHECKED.saturating_sub(lookup.found.len());
                        lookup.found.extend(
                            providers
                                .iter()
                                .filter(|p| allowed.is_none_or(|a| a.contains(p)))
                                .take(room)
                                .copied(),
                        );
                    }
                }
                if last {
                    if let Some(lookup) = self.providers.remove(&id) {
                        // A lookup that found nobody in a reachable DHT is
                        // an empty answer, not a failure.
                        let _ = lookup.reply.send(Ok(lookup.found));
                    }
                }
            }
            QueryResult::GetRecord(result) => {
                if let (Ok(GetRecordOk::FoundRecord(found)), Some(lookup)) =
                    (result, self.records.get_mut(&id))
                {
                    // A copy from a node that stored garbage does not end
                    // the lookup: another may hold the real one.
                    match ServerRecord::from_signed_bytes(&found.record.value, Some(&lookup.peer)) {
                        Ok(record) => {
                            let (newest, copies, until) = match lookup.newest.take() {
                                Some((old, n, until))
                                    if old.published_at_ms >= record.published_at_ms =>
                                {
                                    (old, n + 1, until)
                                }
                                Some((_, n, until)) => (record, n + 1, until),
                                None => (record, 1, Instant::now() + RECORD_GRACE),
                            };
                            lookup.newest = Some((newest, copies, until));
                            if copies >= RECORD_COPIES_COMPARED {
                                self.answer_record_lookup(id);
                            }
                        }
                        Err(e) => lookup.refused = Some(e),
                    }
                }
                if last {
                    self.answer_record_lookup(id);
                }
            }
            QueryResult::PutRecord(_)
                if self
                    .leaving
                    .as_ref()
                    .is_some_and(|(query, _, _)| *query == Some(id)) =>
            {
                if let Some((_, reply, _)) = self.leaving.take() {
                    let _ = reply.send(());
                }
            }
            _ => {}
        }
    }
}

impl NodeHandle {
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    pub fn control(&self) -> libp2p_stream::Control {
        self.control.clone()
    }

    async fn send(&self, command: Command) -> Result<(), NodeError> {
        self.commands
            .clone()
            .send(command)
            .await
            .map_err(|_| NodeError::Stopped)
    }

    pub async fn add_address(&self, peer: PeerId, addr: Multiaddr) -> Result<(), NodeError> {
        self.send(Command::AddAddress(peer, addr)).await
    }

    /// Tells the DHT this server leaves (a signed last record), and stops
    /// announcing; returns once that record is stored or after a few seconds.
    pub async fn leave(&self) -> Result<(), NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Leave(tx)).await?;
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
        self.send(Command::Dial(peer, addrs, tx)).await?;
        with_timeout(timeout, rx)
            .await?
            .map_err(|_| NodeError::Stopped)?
    }

    /// The last ping round trip to each connected peer.
    pub async fn peer_rtts(&self) -> Result<HashMap<PeerId, Duration>, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::PeerRtts(tx)).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// This node's reachability, relays and relayed circuits.
    pub async fn reach(&self) -> Result<ReachReport, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Reach(tx)).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Connects to `peer` (at the addresses its record gave) and says how:
    /// when the only way is a relay and hole punching is on, waits up to
    /// `wait` for a direct connection, and once one is up closes the relayed
    /// ones, so that the streams opened next go direct.
    pub async fn prefer_direct(&self, peer: PeerId, wait: Duration) -> Result<Via, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::PreferDirect(peer, wait, tx)).await?;
        rx.await.map_err(|_| NodeError::Stopped)?
    }

    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::ListenAddrs(tx)).await?;
        rx.await.map_err(|_| NodeError::Stopped)
    }

    /// Servers announcing `model`: all the lookup found within `timeout`.
    pub async fn providers(
        &self,
        model: &str,
        timeout: Duration,
    ) -> Result<HashSet<PeerId>, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::GetProviders(model_dht_key(model), timeout, tx))
            .await?;
        rx.await.map_err(|_| NodeError::Stopped)?
    }

    /// The record `peer` published, checked to be its own; its addresses are
    /// handed to the swarm so that streams to it can be opened.
    pub async fn server_record(&self, peer: PeerId) -> Result<ServerRecord, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::GetRecord(peer, tx)).await?;
        let record = rx.await.map_err(|_| NodeError::Stopped)??;
        if record.leaving {
            return Err(NodeError::Lookup(format!("{peer} has left the swarm")));
        }
        for addr in &record.addresses {
            if let Ok(addr) = addr.parse::<Multiaddr>() {
                self.add_address(peer, addr).await?;
            }
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
        let lookups = peers.into_iter().map(|peer| async move {
            match with_timeout(timeout, self.server_record(peer)).await {
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

/// A record another node asks this one to store, checked: a signed server
/// record stored under the key of the peer it names.
fn check_stored_record(record: &Record) -> Result<ServerRecord, String> {
    let r = ServerRecord::from_signed_bytes(&record.value, None).map_err(|e| e.to_string())?;
    let peer: PeerId = r.peer_id.parse().map_err(|_| "bad peer id".to_string())?;
    if record.key != server_dht_key(&peer) {
        return Err(format!("stored under another key than {peer}'s"));
    }
    Ok(r)
}

fn unix_millis() -> u64 {
    web_time::SystemTime::now()
        .duration_since(web_time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Waits for `duration`, on any runtime.
pub async fn sleep(duration: Duration) {
    Delay::new(duration).await
}

/// Runs `fut` with a deadline, on any runtime.
pub async fn with_timeout<F: std::future::Future>(
    timeout: Duration,
    fut: F,
) -> Result<F::Output, NodeError> {
    futures::select! {
        out = fut.fuse() => Ok(out),
        _ = Delay::new(timeout).fuse() => Err(NodeError::Timeout(timeout)),
    }
}
