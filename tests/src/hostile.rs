//! A hostile peer for tests, as an attacker would write one: raw session
//! streams with chosen frames, forged DHT records, and a fake server that
//! copies an honest server's record, claims to be fast and returns lies.

use std::net::Ipv4Addr;
use std::time::Duration;

use corolla_model::wire::to_payload;
use corolla_shared::behaviour::{BehaviourEvent, NetworkLimits};
use corolla_shared::framing::{read_frame, write_frame};
use corolla_shared::native::build_swarm;
use corolla_shared::node::{Announcement, Node, NodeHandle};
use corolla_shared::peers::split_peer;
use corolla_shared::protocol::{
    ErrorCode, Request, Response, SessionToken, INFERENCE_PROTOCOL, INFO_PROTOCOL,
};
use corolla_shared::reach::ReachSettings;
use corolla_shared::{Limits, ServerRecord, TensorPayload, WireDType};
use futures::StreamExt;
use libp2p::kad::{self, Quorum, Record, RecordKey};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, Stream};

/// A server's answer: the error code (None for success) and its text;
/// `None` when the server closed the stream.
pub type Reply = Option<(Option<ErrorCode>, String)>;

/// Opens an inference stream to `peer` from `node`.
pub async fn open_stream(node: &NodeHandle, peer: PeerId) -> Stream {
    node.control()
        .open_stream(peer, INFERENCE_PROTOCOL)
        .await
        .expect("a stream to the server")
}

/// Reads one reply within `timeout` (`None` on a closed stream or silence).
pub async fn read_reply(stream: &mut Stream, timeout: Duration) -> Reply {
    let mut buf = Vec::new();
    let got = tokio::time::timeout(
        timeout,
        read_frame(stream, Limits::DEFAULT.max_frame_bytes(), &mut buf),
    )
    .await
    .ok()?
    .ok()?;
    if !got {
        return None;
    }
    Some(describe(Response::decode(&buf, &Limits::DEFAULT).ok()?))
}

/// A server's answer as its error code (None for success) and a text.
pub fn describe(response: Response<'_>) -> (Option<ErrorCode>, String) {
    match response {
        Response::Error { code, message } => (Some(code), message),
        Response::Opened { max_length, .. } => (None, format!("opened {max_length}")),
        Response::StepOut { hidden, .. } => (None, format!("step out {:?}", hidden.shape)),
        Response::PushRefused {
            step_id, reason, ..
        } => (None, format!("push of step {step_id} refused: {reason}")),
    }
}

/// What a server did with a stream on which bytes were sent.
#[derive(Debug)]
pub enum Door {
    /// No word within the patience: the server holds the stream (waiting
    /// for the rest of a frame, say).
    Held(Stream),
    /// The server answered: a refusal, usually.
    Answered(Option<ErrorCode>, String),
    /// Reset without a word. libp2p-stream hands a server one inbound
    /// stream at a time and drops those that arrive while its acceptor has
    /// not yet taken the one before (a burst on loaded cores); an honest
    /// client opens such a stream again, as [`knock_until_heard`] does.
    Dropped,
}

/// Opens a stream to `peer`, sends `bytes`, and waits up to `patience`
/// for the server's word.
pub async fn knock(node: &NodeHandle, peer: PeerId, bytes: &[u8], patience: Duration) -> Door {
    use futures::AsyncWriteExt;
    let mut stream = open_stream(node, peer).await;
    if stream.write_all(bytes).await.is_err() || stream.flush().await.is_err() {
        return Door::Dropped;
    }
    let mut buf = Vec::new();
    let read = read_frame(&mut stream, Limits::DEFAULT.max_frame_bytes(), &mut buf);
    match tokio::time::timeout(patience, read).await {
        Err(_) => Door::Held(stream),
        Ok(Ok(true)) => match Response::decode(&buf, &Limits::DEFAULT) {
            Ok(Response::Error { code, message }) => Door::Answered(Some(code), message),
            Ok(other) => Door::Answered(None, format!("{other:?}")),
            Err(e) => Door::Answered(None, format!("an undecodable answer: {e}")),
        },
        Ok(_) => Door::Dropped,
    }
}

/// [`knock`] again while the stream is dropped (at most 10 times, as
/// bursts pass within milliseconds); `Dropped` only when every try was.
pub async fn knock_until_heard(
    node: &NodeHandle,
    peer: PeerId,
    bytes: &[u8],
    patience: Duration,
) -> Door {
    for _ in 0..10 {
        match knock(node, peer, bytes, patience).await {
            Door::Dropped => tokio::time::sleep(Duration::from_millis(50)).await,
            door => return door,
        }
    }
    Door::Dropped
}

/// Sends `frame` and reads the reply.
pub async fn exchange(stream: &mut Stream, frame: &[u8]) -> Reply {
    write_frame(stream, frame).await.ok()?;
    read_reply(stream, Duration::from_secs(10)).await
}

/// The process's resident memory, in bytes (Linux; 0 elsewhere).
pub fn resident_memory_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// A fresh identity and a swarm for it with a client's reachability
/// settings (no listener yet).
async fn fresh_swarm(
    update_period: Duration,
    limits: &NetworkLimits,
) -> (
    libp2p::identity::Keypair,
    libp2p::Swarm<corolla_shared::behaviour::Behaviour>,
) {
    swarm_reaching(update_period, limits, &ReachSettings::client()).await
}

/// [`fresh_swarm`] with `reach`.
async fn swarm_reaching(
    update_period: Duration,
    limits: &NetworkLimits,
    reach: &ReachSettings,
) -> (
    libp2p::identity::Keypair,
    libp2p::Swarm<corolla_shared::behaviour::Behaviour>,
) {
    let key = libp2p::identity::Keypair::generate_ed25519();
    let swarm = build_swarm(key.clone(), update_period, limits, None, reach, None)
        .await
        .expect("a swarm");
    (key, swarm)
}

/// A client's reachability without hole punching: relayed connections stay
/// relayed (the relay's circuit counts are what a test looks at).
fn relayed_only() -> ReachSettings {
    ReachSettings {
        hole_punch: false,
        ..ReachSettings::client()
    }
}

/// Asks the DHT node at `target` (ending in `/p2p/<id>`) to store `value`
/// under `key`, from a fresh peer; returns once the request was answered.
pub async fn forge_record(target: &Multiaddr, key: RecordKey, value: Vec<u8>) {
    let (_, mut swarm) = fresh_swarm(Duration::from_secs(60), &NetworkLimits::client()).await;
    let (peer, base) = split_peer(target).expect("an address with a peer id");
    swarm.behaviour_mut().kad.add_address(&peer, base.clone());
    swarm.add_peer_address(peer, base);
    swarm.dial(peer).expect("dial");
    let mut put = None;
    let deadline = tokio::time::sleep(Duration::from_secs(10));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            event = swarm.select_next_some() => match event {
                SwarmEvent::ConnectionEstablished { .. } if put.is_none() => {
                    let record = Record::new(key.clone(), value.clone());
                    put = Some(swarm.behaviour_mut().kad.put_record(record, Quorum::One).expect("put"));
                }
                SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::OutboundQueryProgressed {
                    id, ..
                })) if Some(id) == put => return,
                _ => {}
            },
            _ = &mut deadline => panic!("the forged PUT got no answer"),
        }
    }
}

type TestSwarm = libp2p::Swarm<corolla_shared::behaviour::Behaviour>;
type TestEvent = SwarmEvent<corolla_shared::behaviour::BehaviourEvent>;

/// Runs `swarm` in a task after `begin` (false: it could not), answering
/// with the first verdict `judge` gives on its events, or false after
/// `wait`. The swarm runs on until the returned task is aborted.
async fn run_until_judged(
    mut swarm: TestSwarm,
    wait: Duration,
    begin: impl FnOnce(&mut TestSwarm) -> bool + Send + 'static,
    judge: impl Fn(&TestEvent) -> Option<bool> + Send + 'static,
) -> (bool, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut answer = Some(tx);
        if !begin(&mut swarm) {
            let _ = answer.take().map(|tx| tx.send(false));
            return;
        }
        loop {
            let event = swarm.select_next_some().await;
            if let Some(verdict) = judge(&event) {
                let _ = answer.take().map(|tx| tx.send(verdict));
            }
        }
    });
    let verdict = matches!(tokio::time::timeout(wait, rx).await, Ok(Ok(true)));
    (verdict, task)
}

/// A fresh peer asking the relay at `circuit` (`…/p2p/<relay>/p2p-circuit`)
/// for a slot: whether the relay granted one within `wait`, and the peer's
/// id. The peer holds its slot, and accepts relayed connections, until the
/// returned task is aborted.
pub async fn ask_relay_slot(
    circuit: Multiaddr,
    wait: Duration,
) -> (bool, PeerId, tokio::task::JoinHandle<()>) {
    let (key, swarm) = swarm_reaching(
        Duration::from_secs(60),
        &NetworkLimits::client(),
        &relayed_only(),
    )
    .await;
    let (granted, task) = run_until_judged(
        swarm,
        wait,
        |swarm| swarm.listen_on(circuit).is_ok(),
        |event| match event {
            SwarmEvent::NewListenAddr { address, .. }
                if address.iter().any(|p| p == Protocol::P2pCircuit) =>
            {
                Some(true)
            }
            SwarmEvent::ListenerClosed { .. } | SwarmEvent::ListenerError { .. } => Some(false),
            _ => None,
        },
    )
    .await;
    (granted, key.public().to_peer_id(), task)
}

/// A fresh peer connecting to `target` (a relayed address,
/// `…/p2p-circuit/p2p/<peer>`): whether the connection came up within
/// `wait`. It stays up until the returned task is aborted.
pub async fn connect_through_relay(
    target: Multiaddr,
    wait: Duration,
) -> (bool, tokio::task::JoinHandle<()>) {
    let (_, swarm) = swarm_reaching(
        Duration::from_secs(60),
        &NetworkLimits::client(),
        &relayed_only(),
    )
    .await;
    // The relay's own connection comes up first.
    let peer = match target.iter().last() {
        Some(Protocol::P2p(peer)) => peer,
        _ => panic!("{target} names no peer"),
    };
    run_until_judged(
        swarm,
        wait,
        |swarm| swarm.dial(target).is_ok(),
        move |event| match event {
            SwarmEvent::ConnectionEstablished { peer_id, .. } if *peer_id == peer => Some(true),
            SwarmEvent::OutgoingConnectionError {
                peer_id: Some(p), ..
            } if *p == peer => Some(false),
            _ => None,
        },
    )
    .await
}

/// What a lying server returns for a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lie {
    /// The right shape, all NaN.
    NotANumber,
    /// The right shape, an infinity in it.
    Infinity,
    /// One position more than was sent.
    ExtraPosition,
    /// Another hidden size.
    WrongHiddenSize,
    /// No step at all: every Open is refused as busy.
    Busy,
    /// Sessions open, steps are never answered.
    Silent,
}

fn lie_about(lie: Lie, input: &TensorPayload) -> TensorPayload {
    let (t, h) = (input.shape[1], input.shape[2]);
    let f32s = |n: usize, v: f32| v.to_le_bytes().repeat(n);
    let (shape, data) = match lie {
        Lie::NotANumber | Lie::Busy | Lie::Silent => (vec![1, t, h], f32s(t * h, f32::NAN)),
        Lie::Infinity => {
            let mut d = f32s(t * h, 0.5);
            d[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
            (vec![1, t, h], d)
        }
        Lie::ExtraPosition => (vec![1, t + 1, h], f32s((t + 1) * h, 0.5)),
        Lie::WrongHiddenSize => (vec![1, t, h - 1], f32s(t * (h - 1), 0.5)),
    };
    TensorPayload::new(WireDType::F32, shape, data).expect("a payload")
}

/// A peer with no weights that announces `honest`'s blocks and hashes as
/// its own, a billion tokens per second, and answers every step with `lie`.
/// Runs until the returned node handle and task are dropped.
pub async fn lying_server(
    bootstrap: &Multiaddr,
    honest: &ServerRecord,
    lie: Lie,
) -> (PeerId, tokio::task::JoinHandle<()>) {
    lying_server_at(Ipv4Addr::LOCALHOST, bootstrap, honest, lie).await
}

/// [`lying_server`] listening at `ip` (any `127.x.y.z` is this machine):
/// many of them at one address are a crowd from one host.
pub async fn lying_server_at(
    ip: Ipv4Addr,
    bootstrap: &Multiaddr,
    honest: &ServerRecord,
    lie: Lie,
) -> (PeerId, tokio::task::JoinHandle<()>) {
    lying_server_claiming(ip, bootstrap, honest, 1e9, lie).await
}

/// [`lying_server_at`] announcing `throughput` tokens per second (decode
/// and prefill): fakes claiming each a speed of its own announce records
/// of distinct shapes.
pub async fn lying_server_claiming(
    ip: Ipv4Addr,
    bootstrap: &Multiaddr,
    honest: &ServerRecord,
    throughput: f64,
    lie: Lie,
) -> (PeerId, tokio::task::JoinHandle<()>) {
    let DhtNode {
        node,
        handle,
        mut events,
        boot,
        base,
    } = dht_node_at(ip, bootstrap).await;
    let peer = handle.peer_id();
    let mut sessions = handle.control().accept(INFERENCE_PROTOCOL).unwrap();
    let mut info = handle.control().accept(INFO_PROTOCOL).unwrap();
    let task_handle = handle.clone();
    let mut record = honest.clone();
    record.peer_id = peer.to_string();
    record.throughput = throughput;
    record.prefill_throughput = throughput;
    let task = tokio::spawn(async move {
        let handle = task_handle;
        let serve = async {
            let _listening = events.next().await;
            // Connected to the bootstrap before announcing: a crowd dialling
            // one server at once on a loaded machine can see a dial fail.
            for _ in 0..60 {
                let dialed = handle
                    .dial(boot, vec![base.clone()], Duration::from_secs(5))
                    .await;
                if dialed.is_ok() {
                    break;
                }
                let _ = handle.add_address(boot, base.clone()).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            handle
                .announce(Some(Announcement {
                    record: record.clone(),
                    period: Duration::from_secs(1),
                    live: None,
                }))
                .await
                .unwrap();
            loop {
                tokio::select! {
                    Some((_, mut stream)) = info.next() => {
                        let bytes = record.to_bytes();
                        tokio::spawn(async move {
                            let _ = write_frame(&mut stream, &bytes).await;
                        });
                    }
                    Some((_, stream)) = sessions.next() => {
                        tokio::spawn(serve_lies(stream, lie));
                    }
                    else => break,
                }
            }
        };
        // One task: aborting it stops the node too.
        tokio::select! {
            _ = node.run() => {}
            _ = serve => {}
        }
    });
    (peer, task)
}

async fn serve_lies(mut stream: Stream, lie: Lie) {
    let mut buf = Vec::new();
    while let Ok(true) = read_frame(&mut stream, 64 << 20, &mut buf).await {
        let reply = match Request::decode(&buf, &Limits::DEFAULT) {
            Ok(Request::Open(_)) if lie == Lie::Busy => {
                Response::error(ErrorCode::Busy, "busy: 16/16 sessions in use").encode()
            }
            Ok(Request::Open(open)) => Response::Opened {
                max_length: open.max_length,
                token: SessionToken([7; 16]),
            }
            .encode(),
            Ok(Request::Step { .. }) if lie == Lie::Silent => continue,
            Ok(Request::Step { header, hidden }) => {
                let out = lie_about(lie, &hidden.to_owned());
                Response::StepOut {
                    step_id: header.step_id,
                    pushed: false,
                    input_proof: None,
                    hidden: out.view(),
                }
                .encode()
            }
            _ => return,
        };
        if write_frame(&mut stream, &reply).await.is_err() {
            return;
        }
    }
}

/// A node serving the DHT, listening at `ip`, that knows `bootstrap` (not
/// yet dialed): what the fakes and the DHT peer start from.
struct DhtNode {
    node: Node,
    handle: NodeHandle,
    events: futures::channel::mpsc::UnboundedReceiver<corolla_shared::node::NodeEvent>,
    boot: PeerId,
    base: Multiaddr,
}

async fn dht_node_at(ip: Ipv4Addr, bootstrap: &Multiaddr) -> DhtNode {
    let (key, swarm) = fresh_swarm(Duration::from_secs(1), &NetworkLimits::server()).await;
    let (mut node, handle, events) = Node::new(swarm);
    node.serve_dht(None, key);
    node.swarm_mut()
        .listen_on(
            Multiaddr::empty()
                .with(Protocol::Ip4(ip))
                .with(Protocol::Tcp(0)),
        )
        .unwrap();
    let (boot, base) = split_peer(bootstrap).expect("an address with a peer id");
    node.swarm_mut()
        .behaviour_mut()
        .kad
        .add_address(&boot, base.clone());
    node.swarm_mut().add_peer_address(boot, base.clone());
    DhtNode {
        node,
        handle,
        events,
        boot,
        base,
    }
}

/// A DHT node serving nothing, joined to the swarm through `bootstrap`: a
/// peer to join through that vouches for no server. Returns its address
/// (with its peer id); runs until the task is dropped.
pub async fn dht_peer(bootstrap: &Multiaddr) -> (Multiaddr, tokio::task::JoinHandle<()>) {
    let DhtNode {
        node,
        handle,
        mut events,
        boot,
        base,
    } = dht_node_at(Ipv4Addr::LOCALHOST, bootstrap).await;
    let peer = handle.peer_id();
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let serve = async {
            if let Some(corolla_shared::node::NodeEvent::Listening { address, .. }) =
                events.next().await
            {
                let _ = addr_tx.send(address.with(Protocol::P2p(peer)));
            }
            let _ = handle.dial(boot, vec![base], Duration::from_secs(10)).await;
            let _ = handle.bootstrap().await;
            std::future::pending::<()>().await
        };
        tokio::select! {
            _ = node.run() => {}
            _ = serve => {}
        }
    });
    let addr = addr_rx.await.expect("the DHT peer listens");
    (addr, task)
}

/// Plausible activations for a step of `t` positions (any numbers do).
pub fn hidden_payload(t: usize, h: usize) -> TensorPayload {
    let x = corolla_model::Tensor::ones(
        (1, t, h),
        corolla_model::DType::F32,
        &corolla_model::Device::Cpu,
    )
    .expect("a tensor");
    to_payload(&x, WireDType::F32).expect("a payload")
}

/// A server that starts accepting inference streams only after `stall`
/// (as one whose cores are busy does), then opens every session it is
/// asked for. libp2p's stream layer holds one stream until it accepts and
/// drops the others. Returns its address and a count of the sessions it
/// opened; runs until the task is dropped.
pub async fn slow_acceptor(
    stall: Duration,
) -> (
    Multiaddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    tokio::task::JoinHandle<()>,
) {
    let (_, swarm) = fresh_swarm(Duration::from_secs(1), &NetworkLimits::server()).await;
    let (mut node, handle, mut events) = Node::new(swarm);
    node.swarm_mut()
        .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        .unwrap();
    let mut sessions = handle.control().accept(INFERENCE_PROTOCOL).unwrap();
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = opened.clone();
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let peer = handle.peer_id();
    let task = tokio::spawn(async move {
        let _handle = handle;
        let serve = async {
            if let Some(corolla_shared::node::NodeEvent::Listening { address, .. }) =
                events.next().await
            {
                let _ = addr_tx.send(address.with(Protocol::P2p(peer)));
            }
            tokio::time::sleep(stall).await;
            while let Some((_, stream)) = sessions.next().await {
                let count = count.clone();
                tokio::spawn(async move {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    serve_lies(stream, Lie::NotANumber).await
                });
            }
        };
        tokio::select! {
            _ = node.run() => {}
            _ = serve => {}
        }
    });
    let addr = addr_rx.await.expect("the acceptor listens");
    (addr, opened, task)
}
