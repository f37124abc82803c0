//! Shared prefixes: a prompt beginning one client's session computed is
//! reused by another client's session on the same servers, page by page,
//! and the tokens stay those of the model run alone in one process; pages
//! count against `--cache-tokens` and give way to sessions.

use corolla_client::network::connect;
use corolla_client::{GenerateRequest, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_server::RunningServer;
use corolla_shared::WireDType;
use corolla_tests::{concurrent_generations, generate_local, greedy, start_model_server};

const LAYERS: usize = 4;

fn spec() -> RandomSpec {
    RandomSpec {
        hidden_size: 128,
        num_layers: LAYERS,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 344,
        vocab_size: 512,
        max_positions: 1024,
        seed: 23,
    }
}

/// A 150-token "system prompt" (two whole pages and a part) and a question.
fn prompt(question: u32) -> Vec<u32> {
    let system = (0..150u32).map(|j| 1 + (j * 37) % 500);
    let asked = (0..6u32).map(move |j| 1 + (question * 11 + j * 5) % 500);
    system.chain(asked).collect()
}

/// One client (a node of its own) generating `request` on the swarm of `servers`.
async fn answer_as_a_new_client(
    servers: &[&RunningServer],
    settings: &SessionSettings,
    head: &ClientHead,
    request: GenerateRequest,
) -> Vec<u32> {
    let addrs: Vec<_> = servers
        .iter()
        .map(|s| s.tcp_addr().unwrap().clone())
        .collect();
    let node = connect(&addrs).await.unwrap();
    let run = concurrent_generations(&node, settings, head, &[request])
        .await
        .unwrap();
    run.outputs[0].generated_ids.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_client_reuses_the_first_ones_prefix_with_identical_tokens() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &spec()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let whole = [BlockSpan::load(&ck, 0, LAYERS, DType::F32, &Device::Cpu).unwrap()];
    let expected = |p: &[u32]| generate_local(&head, &whole, p, 12, SamplingParams::greedy());

    // 448 cache tokens: a session of each question (167 positions) and two
    // pages fit beside each other; one of 411 positions does not.
    let flags = ["--cache-tokens", "448", "--max-chunk-tokens", "64"];
    let first = start_model_server(dir.path(), "0:2", None, &flags).await;
    let join = first.tcp_addr().unwrap().to_string();
    let second = start_model_server(dir.path(), "2:4", Some(&join), &flags).await;
    let servers = [&first, &second];
    // Each session's max_length is its request's (prompt and answer).
    let mut settings = SessionSettings::new(first.model(), LAYERS, 0, WireDType::F32);
    settings.expected_blocks = Some(block_hashes(&ck, 0, LAYERS).unwrap());

    let (a, b) = (prompt(1), prompt(2));
    let out_a = answer_as_a_new_client(&servers, &settings, &head, greedy(a.clone(), 12)).await;
    assert_eq!(out_a, expected(&a), "the first client's tokens");
    for server in servers {
        let figures = server.compute_figures();
        assert_eq!(figures.prefix_positions_reused, 0, "{figures:?}");
        assert_eq!(
            figures.prefix_pages_stored, 2,
            "two whole pages: {figures:?}"
        );
    }
    let announced = first.record();
    assert_eq!(announced.prefix_tokens, 128, "{announced:?}");

    let out_b = answer_as_a_new_client(&servers, &settings, &head, greedy(b.clone(), 12)).await;
    assert_eq!(out_b, expected(&b), "the second client's tokens");
    for server in servers {
        let figures = server.compute_figures();
        // Both pages of the system prompt, on each server: the second
        // server saw the same inputs, since the first reused its outputs too.
        assert_eq!(figures.prefix_positions_reused, 128, "{figures:?}");
        assert_eq!(figures.prefix_pages_stored, 2, "{figures:?}");
    }

    // A session that needs the pages' room gets it: they give way (and
    // no page is kept while that session holds the budget).
    let long: Vec<u32> = a
        .iter()
        .copied()
        .chain((0..244).map(|j| 1 + j % 500))
        .collect();
    let out = answer_as_a_new_client(&servers, &settings, &head, greedy(long.clone(), 12)).await;
    assert_eq!(out, expected(&long));
    for server in servers {
        let figures = server.compute_figures();
        assert_eq!(figures.prefix_pages_evicted, 2, "{figures:?}");
        assert_eq!(figures.prefix_positions_reused, 128, "{figures:?}");
        assert_eq!(figures.prefix_tokens_held, 0, "{figures:?}");
    }
    first.shutdown();
    second.shutdown();
}
