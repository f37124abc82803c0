//! Flow-controlled sessions (what browsers on WebRTC ask for): every write a
//! flushed piece of at most 8000 bytes, at most 16000 unacknowledged bytes
//! toward the client. Through real servers, a prefill carrying more than
//! 1 MiB of hidden states each way gives the tokens a plain session gives.

use corolla_client::network::connect;
use corolla_client::{generate, GenerateRequest, LocalChain, RemoteChain, SessionSettings};
use corolla_model::fingerprint::block_hashes;
use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, SamplingParams};
use corolla_shared::flow::BROWSER_WINDOW;
use corolla_shared::WireDType;
use corolla_tests::start_model_server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_prefill_passes_under_flow_control() {
    let spec = RandomSpec {
        hidden_size: 1024,
        num_layers: 2,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 1024,
        vocab_size: 512,
        max_positions: 512,
        seed: 11,
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("wide");
    write_random_checkpoint(&dir, &spec).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let prompt: Vec<u32> = (0..300).map(|i| (i * 7 % 500) as u32 + 1).collect();
    // 300 positions x 1024 x 4 bytes: 1.2 MB of hidden states per hop and way.
    assert!(prompt.len() * spec.hidden_size * 4 > 1 << 20);
    let request = GenerateRequest {
        prompt_ids: prompt,
        max_new_tokens: 8,
        sampling: SamplingParams::greedy(),
        stop_at_eos: false,
        drafts: corolla_client::DEFAULT_DRAFTS,
    };
    let local = {
        let spans = [BlockSpan::load(&ck, 0, 2, DType::F32, &Device::Cpu).unwrap()];
        let mut chain = LocalChain::new(&spans, request.max_length()).unwrap();
        generate(&head, &mut chain, &request, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap()
    };

    let extra = ["--inference-max-length", "512"];
    let first = start_model_server(&dir, "0:1", None, &extra).await;
    let peer = first.tcp_addr().unwrap().to_string();
    let second = start_model_server(&dir, "1:2", Some(&peer), &extra).await;
    let node = connect(&[peer.parse().unwrap()]).await.unwrap();
    for window in [BROWSER_WINDOW, 0] {
        let mut settings =
            SessionSettings::new(first.model(), 2, request.max_length(), WireDType::F32);
        settings.expected_blocks = Some(block_hashes(&ck, 0, 2).unwrap());
        settings.flow_window = window;
        let mut chain = RemoteChain::connect(&node, settings, &Device::Cpu)
            .await
            .unwrap();
        assert_eq!(chain.route().len(), 2);
        let out = generate(&head, &mut chain, &request, |_| {
            std::ops::ControlFlow::Continue(())
        })
        .await
        .unwrap();
        chain.close().await;
        assert_eq!(out.generated_ids, local.generated_ids, "window {window}");
    }
    first.shutdown();
    second.shutdown();
}
