//! Each adapter the swarm serves as `model:adapter`.

use super::*;

/// POSTs `body` to the API's `/completions`: the HTTP status and the body.
/// `model:adapter` through the official SDK: listed among the models, and
/// a greedy chat equal to `corolla generate --chat --adapter` token for
/// token; an adapter no server runs is a 404 `model_not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_serves_each_adapter_as_model_colon_adapter() {
    let Some(python) = openai_python() else {
        return;
    };
    let model = corolla_tests::fixtures_dir().join("families/llama3");
    let adapter = corolla_tests::fixtures_dir().join("adapters/llama3-alpha");
    let flag = format!("alpha={}", adapter.display());
    let extra = ["--update-period", "2s", "--adapter", &flag];
    let first = start_model_server(&model, "0:2", None, &extra).await;
    let peer = first.tcp_addr().expect("tcp address").to_string();
    let second = start_model_server(&model, "2:3", Some(&peer), &extra).await;
    let name = first.model().to_string();
    tokio::task::spawn_blocking(move || {
        let prompt = "Where do the rivers of the mountains go?";
        let expected = generate_json(
            &model,
            &["--initial-peers", &peer, "--chat", "--prompt", prompt]
                .into_iter()
                .chain(["--adapter", "alpha", "--max-new-tokens", "12"])
                .collect::<Vec<_>>(),
        );
        let api = Api::start(&["--model", model.to_str().unwrap(), "--initial-peers", &peer]);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("api/openai_check.py");
        let with_adapter = format!("{name}:alpha");
        let out = Command::new(&python)
            .arg(script)
            .args(["--base-url", &api.base, "--api-key", KEY])
            .args([
                "--model",
                &with_adapter,
                "--prompt",
                prompt,
                "--mode",
                "adapter",
            ])
            .output()
            .expect("run the openai check");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        eprintln!("{got}");
        assert_eq!(
            got["models"],
            serde_json::json!([name, with_adapter]),
            "{got}"
        );
        assert_eq!(got["model"], with_adapter.as_str(), "{got}");
        assert_eq!(got["content"], expected["text"], "{got}");
        assert_eq!(
            got["completion_tokens"].as_u64(),
            Some(expected["generated_ids"].as_array().unwrap().len() as u64)
        );
        assert_eq!(got["unknown"]["status"], 404, "{got}");
        assert_eq!(error_code(&got["unknown"]), "model_not_found", "{got}");
    })
    .await
    .unwrap();
    for server in [first, second] {
        server.shutdown();
    }
}
