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
//!
//! One file per concern, each adding methods to [`Node`]: `handle` (the
//! commands' sending side), `announce` and `lookup` (the DHT's two
//! directions), `store` (records kept for others), `direct` (dials and
//! waiting for direct connections), `events` (the swarm's events),
//! `reachability` (native; `reachability_stub` in the browser).

mod addresses;
mod announce;
mod direct;
mod events;
mod handle;
mod lookup;
#[cfg(feature = "native")]
mod reachability;
#[cfg(not(feature = "native"))]
#[path = "reachability_stub.rs"]
mod reachability;
mod store;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, StreamExt};
use futures_timer::Delay;
use libp2p::core::transport::ListenerId;
use libp2p::identity::Keypair;
use libp2p::kad::{self, QueryId, RecordKey};
use libp2p::{Multiaddr, PeerId, Swarm};
use web_time::Instant;

pub use addresses::{dialable_addresses, with_host, MAX_ADDRESSES_PER_PEER};
pub use announce::{Announcement, LiveFigures};
pub use direct::Via;
pub use handle::NodeHandle;
pub use lookup::{server_dht_key, MAX_PROVIDERS_CHECKED};

use crate::behaviour::Behaviour;
use crate::record::{Reachability, RecordError, ServerRecord};
use crate::time::TimedOut;
use direct::{Connection, DirectWaiter};
use lookup::{ProviderLookup, RecordLookup};

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

impl From<TimedOut> for NodeError {
    fn from(TimedOut(after): TimedOut) -> Self {
        NodeError::Timeout(after)
    }
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

/// What the handle asks of the loop; those that ask something carry where
/// the answer goes.
enum Command {
    /// Answered once the swarm knows the address, so that a stream opened
    /// right after dials it (the stream's dial request takes another path).
    AddAddress {
        peer: PeerId,
        address: Multiaddr,
        reply: oneshot::Sender<()>,
    },
    /// Answered when the lookup ends or its time is up, with what was found by then.
    GetProviders {
        key: RecordKey,
        timeout: Duration,
        reply: oneshot::Sender<Result<HashSet<PeerId>, NodeError>>,
    },
    GetRecord {
        peer: PeerId,
        reply: oneshot::Sender<Result<ServerRecord, NodeError>>,
    },
    Announce(Option<Announcement>),
    /// Publishes a last record saying the server leaves, then stops announcing.
    Leave {
        reply: oneshot::Sender<()>,
    },
    Bootstrap,
    ListenAddrs {
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    PeerRtts {
        reply: oneshot::Sender<HashMap<PeerId, Duration>>,
    },
    Reach {
        reply: oneshot::Sender<ReachReport>,
    },
    /// Connects to a peer (if not connected) and, when only a relayed
    /// connection is up, waits a while for a hole punch.
    PreferDirect {
        peer: PeerId,
        wait: Duration,
        reply: oneshot::Sender<Result<Via, NodeError>>,
    },
    /// Answered when the connection is up or the dial has failed.
    Dial {
        peer: PeerId,
        addresses: Vec<Multiaddr>,
        reply: oneshot::Sender<Result<(), NodeError>>,
    },
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

/// How often pending lookups and waiters are checked against their deadlines.
const LOOKUP_TICK: Duration = Duration::from_millis(100);

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
            sources: swarm.behaviour().addresses.sources(),
            initial_peers: Arc::from([]),
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
                _ = (&mut self.lookup_tick).fuse() => self.expire_lookups_and_waiters(),
            }
        }
        tracing::debug!("node event loop stopped");
    }

    /// Answers whatever waits past its deadline.
    fn expire_lookups_and_waiters(&mut self) {
        self.lookup_tick.reset(LOOKUP_TICK);
        let now = Instant::now();
        self.expire_leaving(now);
        self.expire_lookups(now);
        self.expire_direct_waiters(now);
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::AddAddress {
                peer,
                address,
                reply,
            } => {
                if self.admits(&address) {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, address.clone());
                    self.swarm.add_peer_address(peer, address);
                }
                let _ = reply.send(());
            }
            Command::Dial {
                peer,
                addresses,
                reply,
            } => self.dial(peer, addresses, reply),
            Command::GetProviders {
                key,
                timeout,
                reply,
            } => self.start_provider_lookup(key, timeout, reply),
            Command::GetRecord { peer, reply } => self.start_record_lookup(peer, reply),
            Command::Announce(a) => {
                self.announcement = a;
                self.announce();
            }
            Command::Leave { reply } => self.leave(reply),
            Command::Bootstrap => {
                let _ = self.swarm.behaviour_mut().kad.bootstrap();
            }
            Command::ListenAddrs { reply } => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::PeerRtts { reply } => {
                let _ = reply.send(self.rtts.clone());
            }
            Command::Reach { reply } => {
                let _ = reply.send(self.reach_report());
            }
            Command::PreferDirect { peer, wait, reply } => self.prefer_direct(peer, wait, reply),
        }
    }
}
