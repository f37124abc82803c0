//! The server's engine: concurrent sessions run as batched decode steps and
//! chunked prefills, and every session's tokens stay those of the same
//! generation run alone in one process; a KV-cache budget refuses what does
//! not fit, and the DHT record carries the live figures.

use corolla_client::network::connect;
use corolla_client::{GenerateRequest, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use std::time::{Duration, Instant};

use corolla_model::fingerprint::span_hash;
use corolla_shared::protocol::{ErrorCode, OpenRequest, Request};
use corolla_shared::WireDType;
use corolla_tests::hostile::{exchange, open_stream};
use corolla_tests::{
    concurrent_generations, generate_local, greedy, start_model_server, start_server, tiny_llama,
    Golden,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_are_batched_and_give_the_tokens_of_each_alone() {
    let dir = tempfile::tempdir().unwrap();
    let spec = RandomSpec {
        hidden_size: 256,
        num_layers: 4,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 688,
        vocab_size: 512,
        max_positions: 512,
        seed: 11,
    };
    write_random_checkpoint(dir.path(), &spec).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let whole = [BlockSpan::load(&ck, 0, 4, DType::F32, &Device::Cpu).unwrap()];

    // Eight sessions of ragged lengths; two prompts span several prefill chunks.
    let requests: Vec<GenerateRequest> = (0..8u32)
        .map(|i| {
            let len = if i % 4 == 3 { 45 } else { 3 + i as usize };
            let prompt = (0..len as u32)
                .map(|j| 1 + (j * 31 + i * 7) % 500)
                .collect();
            greedy(prompt, 24)
        })
        .collect();
    let expected: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| generate_local(&head, &whole, &r.prompt_ids, 24, SamplingParams::greedy()))
        .collect();

    let server = start_model_server(
        dir.path(),
        "0:4",
        None,
        &[
            "--max-sessions",
            "16",
            "--max-sessions-per-peer",
            "16",
            "--max-chunk-tokens",
            "16",
        ],
    )
    .await;
    let node = connect(&[server.tcp_addr().unwrap().clone()])
        .await
        .unwrap();
    let mut settings = SessionSettings::new(server.model(), 4, 128, WireDType::F32);
    settings.expected_blocks = Some(block_hashes(&ck, 0, 4).unwrap());

    let run = concurrent_generations(&node, &settings, &head, &requests)
        .await
        .unwrap();
    for (i, (out, want)) in run.outputs.iter().zip(&expected).enumerate() {
        assert_eq!(&out.generated_ids, want, "session {i}");
    }
    let figures = server.compute_figures();
    assert!(
        figures.largest_batch >= 2,
        "concurrent decode steps were never batched: {figures:?}"
    );
    assert!(
        figures.decode_batches < figures.decode_steps,
        "no step shared a forward: {figures:?}"
    );
    // 45-token prompts in chunks of at most 16: three chunks each.
    assert!(
        figures.prefill_chunks >= 2 * 3 + 6,
        "long prefills were not chunked: {figures:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_give_the_reference_tokens() {
    let server = start_server("0:4", None, &["--max-sessions-per-peer", "16"]).await;
    let golden = Golden::load(&tiny_llama(), "float32");
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let layers = ck.config().num_hidden_layers;
    // Every reference prompt twice over, all at once.
    let requests: Vec<GenerateRequest> = golden
        .prompts
        .iter()
        .chain(&golden.prompts)
        .map(|p| greedy(p.input_ids.clone(), p.generated_new_ids.len()))
        .collect();
    let node = connect(&[server.tcp_addr().unwrap().clone()])
        .await
        .unwrap();
    let mut settings = SessionSettings::new(server.model(), layers, 128, WireDType::F32);
    settings.expected_blocks = Some(block_hashes(&ck, 0, layers).unwrap());
    let run = concurrent_generations(&node, &settings, &head, &requests)
        .await
        .unwrap();
    let expected = golden.prompts.iter().chain(&golden.prompts);
    for (out, prompt) in run.outputs.iter().zip(expected) {
        assert_eq!(
            out.generated_ids, prompt.generated_new_ids,
            "prompt {:?}",
            prompt.prompt
        );
    }
}

fn open_frame(model: &str, hashes: &[String], max_length: u32) -> Vec<u8> {
    Request::Open(OpenRequest {
        model: model.into(),
        fingerprint: span_hash(hashes),
        start: 2,
        end: 4,
        max_length,
        dtype: WireDType::F32,
        compression: corolla_shared::Compression::None,
        flow_window: 0,
        next: None,
        adapter: None,
    })
    .encode()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_budget_refuses_what_does_not_fit_and_the_dht_shows_live_figures() {
    let period = ["--update-period", "1s"];
    let first = start_server("0:2", None, &period).await;
    let boot = first.tcp_addr().unwrap().to_string();
    let budgeted = start_server(
        "2:4",
        Some(&boot),
        &[
            &period[..],
            &["--cache-tokens", "100", "--max-sessions-per-peer", "16"],
        ]
        .concat(),
    )
    .await;
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let hashes = block_hashes(&ck, 2, 4).unwrap();
    let client = connect(&[first.tcp_addr().unwrap().clone()]).await.unwrap();
    let peer = budgeted.peer_id();
    // Waits until the DHT's record of the server shows `sessions` and `free` tokens.
    let record_shows = |sessions: u32, free: u64| {
        let client = client.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let record = client.server_record(peer).await;
                if let Ok(r) = &record {
                    if r.sessions == sessions && r.cache_tokens_left == free {
                        return;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "the DHT record never showed {sessions} sessions and {free} free tokens: {record:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    record_shows(0, 100).await;

    let mut holder = open_stream(&client, peer).await;
    let opened = exchange(&mut holder, &open_frame(budgeted.model(), &hashes, 60)).await;
    assert_eq!(opened, Some((None, "opened 60".into())));
    let mut late = open_stream(&client, peer).await;
    let refused = exchange(&mut late, &open_frame(budgeted.model(), &hashes, 60))
        .await
        .expect("an answer");
    assert_eq!(refused.0, Some(ErrorCode::Busy), "{refused:?}");
    assert!(
        refused.1.contains("40 of 100 tokens free") && refused.1.contains("retry after"),
        "{}",
        refused.1
    );
    // What fits still opens.
    let fits = exchange(&mut late, &open_frame(budgeted.model(), &hashes, 40)).await;
    assert_eq!(fits, Some((None, "opened 40".into())));
    // A re-announced record reaches the client: the live figures change.
    record_shows(2, 0).await;
    drop(holder);
    record_shows(1, 60).await;
    drop(late);
    record_shows(0, 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_blocks_fill_the_memory_limit_where_the_swarm_is_weakest() {
    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let config = ck.config();
    // A limit for two of the four blocks (f32), each with 4096 cache positions,
    // over the margin of 256 MiB.
    let cache_tokens = 4096u64;
    let per_block =
        config.block_parameters() * 4 + cache_tokens * config.cache_bytes_per_token_per_block(4);
    let limit = ((256u64 << 20) + per_block * 5 / 2).to_string();
    let flags = [
        "--update-period",
        "1s",
        "--dtype",
        "f32",
        "--memory-limit",
        &limit,
        "--cache-tokens",
        "4096",
    ];
    let start_auto = |join: Option<String>| {
        let flags = flags.map(String::from);
        async move {
            let mut args: Vec<String> = ["corolla-server", "--model"].map(String::from).to_vec();
            args.push(tiny_llama().to_string_lossy().into_owned());
            args.extend(["--host", "127.0.0.1", "--port", "0"].map(String::from));
            match join {
                Some(peer) => args.extend(["--initial-peers".into(), peer]),
                None => args.push("--new-swarm".into()),
            }
            args.extend(flags);
            let args = corolla_server::ServerArgs::from_args_and_file(args).unwrap();
            corolla_server::Server::start(args).await.unwrap()
        }
    };
    let first = start_auto(None).await;
    assert_eq!(first.blocks(), (0, 2), "two blocks fit");
    let boot = first.tcp_addr().unwrap().to_string();
    let second = start_auto(Some(boot)).await;
    assert_eq!(
        second.blocks(),
        (2, 4),
        "the second fills the blocks nobody serves"
    );

    let golden = Golden::load(&tiny_llama(), "float32");
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let node = connect(&[first.tcp_addr().unwrap().clone()]).await.unwrap();
    let mut settings = SessionSettings::new(first.model(), 4, 128, WireDType::F32);
    settings.expected_blocks = Some(block_hashes(&ck, 0, 4).unwrap());
    let prompt = &golden.prompts[0];
    let requests = [greedy(
        prompt.input_ids.clone(),
        prompt.generated_new_ids.len(),
    )];
    let run = concurrent_generations(&node, &settings, &head, &requests)
        .await
        .unwrap();
    assert_eq!(run.outputs[0].generated_ids, prompt.generated_new_ids);
}

/// libp2p's stream layer holds one unaccepted inbound stream per protocol
/// and drops the rest, so a crowd arriving while a server's cores are busy
/// loses streams before the server sees them: every open must still succeed,
/// once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_opening_sessions_while_the_server_is_busy_all_get_one() {
    use corolla_shared::session::RemoteSession;
    use corolla_tests::hostile::slow_acceptor;
    use libp2p::multiaddr::Protocol;
    const CROWD: usize = 8;
    let (addr, opened, _acceptor) = slow_acceptor(Duration::from_millis(300)).await;
    let node = connect(std::slice::from_ref(&addr)).await.unwrap();
    let Some(Protocol::P2p(peer)) = addr.iter().last() else {
        panic!("{addr} names no peer")
    };
    let request = OpenRequest {
        model: "any".into(),
        fingerprint: String::new(),
        start: 0,
        end: 4,
        max_length: 32,
        dtype: WireDType::F32,
        compression: corolla_shared::Compression::None,
        flow_window: 0,
        next: None,
        adapter: None,
    };
    let opens =
        (0..CROWD).map(|_| {
            let mut control = node.control();
            let request = request.clone();
            async move {
                RemoteSession::open(&mut control, peer, request, Duration::from_secs(20)).await
            }
        });
    let results = futures::future::join_all(opens).await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {CROWD} opens failed: {failed:?}",
        failed.len()
    );
    assert_eq!(opened.load(std::sync::atomic::Ordering::SeqCst), CROWD);
}
