//! The tiny model's reference and the helpers the attack tests share: the
//! session settings and requests honest clients use, the whole model in
//! this process (what every honest answer must equal), raw Open frames and
//! a watcher's view of a server's sessions.

use std::time::Duration;

use corolla_client::network::connect;
use corolla_client::swarm_view::SwarmView;
use corolla_client::{generate, GenerateRequest, LocalChain, RemoteChain, SessionSettings};
use corolla_model::fingerprint::{block_hashes, span_hash};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::{OpenRequest, Request};
use corolla_shared::session::fetch_info;
use corolla_shared::{ServerRecord, WireDType};
use corolla_tests::{start_server, tiny_llama};
use libp2p::{Multiaddr, PeerId};

pub(crate) const MODEL: &str = "tiny-llama-a";
pub(crate) const NEW_TOKENS: usize = 12;

pub(crate) fn expected_hashes() -> Vec<String> {
    block_hashes(&Checkpoint::open(tiny_llama()).unwrap(), 0, 4).unwrap()
}

pub(crate) fn settings(max_length: usize) -> SessionSettings {
    let mut s = SessionSettings::new(MODEL, 4, max_length, WireDType::F32);
    s.expected_blocks = Some(expected_hashes());
    s.timeout = Duration::from_secs(10);
    s.discovery_timeout = Duration::from_secs(10);
    s
}

pub(crate) fn request(seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: vec![1, 5 + seed as u32 % 40, 17, 3, 9],
        max_new_tokens: NEW_TOKENS,
        sampling: SamplingParams {
            temperature: 0.8,
            seed,
            ..Default::default()
        },
        stop_at_eos: false,
        drafts: corolla_client::DEFAULT_DRAFTS,
    }
}

/// The whole model in this process: what every honest answer must equal.
pub(crate) struct Reference {
    pub head: ClientHead,
    pub spans: Vec<BlockSpan>,
}

impl Reference {
    pub fn load() -> Self {
        let ck = Checkpoint::open(tiny_llama()).unwrap();
        Reference {
            head: ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap(),
            spans: vec![BlockSpan::load(&ck, 0, 4, DType::F32, &Device::Cpu).unwrap()],
        }
    }

    pub async fn tokens(&self, seed: u64) -> Vec<u32> {
        self.tokens_for(&request(seed)).await
    }

    /// The whole model's answer to `req`.
    pub async fn tokens_for(&self, req: &GenerateRequest) -> Vec<u32> {
        let mut chain = LocalChain::new(&self.spans, req.max_length()).unwrap();
        generate(&self.head, &mut chain, req, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap()
        .generated_ids
    }
}

pub(crate) async fn swarm_tokens(
    reference: &Reference,
    node: &NodeHandle,
    settings: SessionSettings,
    seed: u64,
) -> (Vec<u32>, RemoteChain) {
    let view = SwarmView::new(node.clone(), &settings);
    swarm_tokens_via(reference, &view, settings, seed).await
}

/// [`swarm_tokens`] through `view`: a client that answers many times keeps
/// one view (what it measured, whom it banned) for all its answers.
pub(crate) async fn swarm_tokens_via(
    reference: &Reference,
    view: &SwarmView,
    settings: SessionSettings,
    seed: u64,
) -> (Vec<u32>, RemoteChain) {
    let mut chain = RemoteChain::connect_via(view, settings, &Device::Cpu)
        .await
        .unwrap();
    let out = generate(&reference.head, &mut chain, &request(seed), |_| {
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    (out.generated_ids, chain)
}

pub(crate) fn open_frame(max_length: u32, flow_window: u32) -> Vec<u8> {
    Request::Open(OpenRequest {
        model: MODEL.into(),
        fingerprint: span_hash(&expected_hashes()),
        start: 0,
        end: 4,
        max_length,
        dtype: WireDType::F32,
        compression: corolla_shared::Compression::None,
        flow_window,
        next: None,
        adapter: None,
    })
    .encode()
}

pub(crate) async fn sessions_in_use(watcher: &NodeHandle, server: &RunningServer) -> u32 {
    fetch_info(
        &mut watcher.control(),
        server.peer_id(),
        Duration::from_secs(5),
    )
    .await
    .unwrap()
    .sessions
}

pub(crate) async fn client_of(server: &RunningServer) -> NodeHandle {
    connect(&[server.tcp_addr().unwrap().clone()])
        .await
        .unwrap()
}

/// A server of the whole tiny model for liars to copy: its announced speed
/// counts a 5 ms step delay, so a liar claiming more is chosen first
/// whatever loopback round trips do under load. Returns it, its address
/// and its record as a client fetches it.
pub(crate) async fn server_to_copy() -> (RunningServer, Multiaddr, ServerRecord) {
    let server = start_server(
        "0:4",
        None,
        &["--update-period", "1s", "--step-delay-ms", "5"],
    )
    .await;
    let boot = server.tcp_addr().unwrap().clone();
    let watcher = client_of(&server).await;
    let record = fetch_info(
        &mut watcher.control(),
        server.peer_id(),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    (server, boot, record)
}

/// Waits (at most 60 s) until `node`'s lookups list every one of `peers`
/// as a server of the model. A crowd's provider records get in as the
/// previous crowd's expire (kad keeps 20 providers per key and node), and
/// under a loaded test run that took over 20 s once in a few runs.
pub(crate) async fn until_announced(node: &NodeHandle, peers: &[PeerId]) {
    until_most_announced(node, peers, peers.len()).await;
}

/// [`until_announced`], content after 60 s with `at_least` of `peers`: a
/// crowd's last provider records can wait on the previous crowd's expiry
/// for longer (a minute and more, once in a few loaded runs), and a crowd
/// one short is still a crowd.
pub(crate) async fn until_most_announced(node: &NodeHandle, peers: &[PeerId], at_least: usize) {
    let started = std::time::Instant::now();
    loop {
        let found = node.discover(MODEL, Duration::from_secs(2)).await.unwrap();
        let missing: Vec<&PeerId> = peers
            .iter()
            .filter(|p| !found.iter().any(|r| r.peer_id == p.to_string()))
            .collect();
        if missing.is_empty() {
            return;
        }
        let waited = started.elapsed();
        if waited >= Duration::from_secs(60) && peers.len() - missing.len() >= at_least {
            eprintln!(
                "{} of {} peers announced after {waited:?}: going on with them",
                peers.len() - missing.len(),
                peers.len()
            );
            return;
        }
        assert!(
            waited < Duration::from_secs(90),
            "{} of {} peers never announced: {missing:?}",
            missing.len(),
            peers.len()
        );
    }
}
