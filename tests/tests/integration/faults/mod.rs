//! Servers dying mid-answer: the client replays to replacements and the
//! answer comes out token-identical; routing prefers fast servers and obeys
//! the user's block list.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_client::{generate, GenerateRequest, LocalChain, RemoteChain, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::node::NodeHandle;
use corolla_shared::WireDType;
use corolla_tests::{corolla_bin, greedy, start_server, tiny_llama, Golden};

mod chaos;
mod leaving;
mod recovery;

const SPANS: [&str; 3] = ["0:1", "1:3", "3:4"];

async fn start(blocks: &str, join: Option<&str>, extra: &[&str]) -> RunningServer {
    let flags = ["--update-period", "1s", "--inference-max-length", "128"];
    start_server(blocks, join, &[&flags[..], extra].concat()).await
}

fn addr(server: &RunningServer) -> String {
    server.tcp_addr().unwrap().to_string()
}

/// Two replicas of every span; `slow` adds a step delay to the middle span's servers.
async fn six_servers(slow_ms: u64) -> Vec<RunningServer> {
    let delay = slow_ms.to_string();
    let first = start(SPANS[0], None, &[]).await;
    let boot = addr(&first);
    let mut servers = vec![first];
    for (i, span) in SPANS.iter().enumerate() {
        for replica in 0..2 {
            if i == 0 && replica == 0 {
                continue;
            }
            let extra: Vec<&str> = if i == 1 {
                vec!["--step-delay-ms", &delay]
            } else {
                vec![]
            };
            servers.push(start(span, Some(&boot), &extra).await);
        }
    }
    servers
}

fn settings(max_length: usize) -> SessionSettings {
    let mut s = SessionSettings::new("tiny-llama-a", 4, max_length, WireDType::F32);
    s.expected_blocks = Some(block_hashes(&Checkpoint::open(tiny_llama()).unwrap(), 0, 4).unwrap());
    s.timeout = Duration::from_secs(10);
    s.discovery_timeout = Duration::from_secs(20);
    s
}

async fn chain_covering(
    node: &NodeHandle,
    settings: SessionSettings,
    servers: usize,
) -> RemoteChain {
    // Wait until every server is announced, so that routes are chosen among all.
    for _ in 0..100 {
        if node
            .discover("tiny-llama-a", Duration::from_secs(5))
            .await
            .unwrap()
            .len()
            >= servers
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    RemoteChain::connect(node, settings, &Device::Cpu)
        .await
        .unwrap()
}

/// Six servers (see [`six_servers`]), a greedy 32-token request for
/// `prompt` and a chain over all of them; the last item is the peer id of
/// the server the chain uses for the middle span.
async fn answer_through_six(
    slow_ms: u64,
    prompt: &corolla_tests::GoldenPrompt,
) -> (
    Arc<Mutex<Vec<RunningServer>>>,
    GenerateRequest,
    RemoteChain,
    String,
) {
    let servers = Arc::new(Mutex::new(six_servers(slow_ms).await));
    let boot = addr(&servers.lock().unwrap()[0]);
    let node = connect(&[boot.parse().unwrap()]).await.unwrap();
    // One chain step per token (no drafts), so "killed after token k" is step k.
    let request = GenerateRequest {
        drafts: 0,
        ..greedy(prompt.input_ids.clone(), 32)
    };
    let chain = chain_covering(&node, settings(request.max_length()), 6).await;
    let victim = chain
        .route()
        .into_iter()
        .find(|h| h.start == 1)
        .unwrap()
        .peer_id;
    (servers, request, chain, victim)
}

fn head() -> ClientHead {
    ClientHead::load(
        &Checkpoint::open(tiny_llama()).unwrap(),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}
