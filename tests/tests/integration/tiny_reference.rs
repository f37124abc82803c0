//! The tiny model's reference and the helpers the attack tests share: the
//! session settings and requests honest clients use, the whole model in
//! this process (what every honest answer must equal), raw Open frames and
//! a watcher's view of a server's sessions.

use std::time::Duration;

use corolla_client::network::connect;
use corolla_client::{generate, GenerateRequest, LocalChain, RemoteChain, SessionSettings};
use corolla_model::fingerprint::{block_hashes, span_hash};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::{OpenRequest, Request};
use corolla_shared::session::fetch_info;
use corolla_shared::WireDType;
use corolla_tests::tiny_llama;

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
        let req = request(seed);
        let mut chain = LocalChain::new(&self.spans, req.max_length()).unwrap();
        generate(&self.head, &mut chain, &req, |_| {
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
    let mut chain = RemoteChain::connect(node, settings, &Device::Cpu)
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
