//! More kept conversations than one peer's session quota.

use super::*;

/// Servers grant one peer a share of their sessions; the API speaks as
/// several identities, so that its conversations are not limited to that
/// share (nor kept ones given up for every new user).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_holds_more_conversations_than_one_peer_may() {
    let model = corolla_tests::tiny_llama();
    let server = corolla_tests::start_server(
        "0:4",
        None,
        &["--http-port", "0", "--max-sessions-per-peer", "1"],
    )
    .await;
    let peer = server.tcp_addr().expect("tcp address").to_string();
    let status = vec![format!("{}/api/status", server.http_url().expect("http"))];
    let held = tokio::task::spawn_blocking(move || {
        let conversations_held = |identities: &str| {
            let api = Api::start(&[
                "--model",
                model.to_str().unwrap(),
                "--initial-peers",
                &peer,
                "--identities",
                identities,
            ]);
            for prompt in ["Hello there", "Once upon a time", "The weather today"] {
                let body = serde_json::json!({
                    "model": "tiny-llama-a", "prompt": prompt, "max_tokens": 4,
                })
                .to_string();
                let (status, out) = post_completion(&api, &body);
                assert_eq!(status, "200", "{out}");
            }
            // Kept conversations keep their sessions; closes are read soon.
            std::thread::sleep(Duration::from_millis(500));
            let held = open_sessions(&status);
            drop(api);
            let deadline = Instant::now() + Duration::from_secs(10);
            while open_sessions(&status) > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
            }
            held
        };
        (conversations_held("1"), conversations_held("3"))
    })
    .await
    .unwrap();
    println!(
        "conversations held on a server granting one session per peer: one identity {}, three {}",
        held.0, held.1
    );
    assert_eq!(held.0, 1, "one identity holds one session there");
    assert_eq!(held.1, 3, "three identities keep three conversations");
    server.shutdown();
    corolla_tests::reliability::Figures::of(
        "api::conversations::the_api_holds_more_conversations_than_one_peer_may",
    )
    .set("one_identity", held.0)
    .set("three_identities", held.1)
    .save();
}
