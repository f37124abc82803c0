//! `corolla api` on a loopback swarm of the default model, driven by the
//! official `openai` Python package (a venv that `scripts/test.sh` makes
//! outside the clone) and by `curl -N`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corolla_tests::{corolla_bin, default_model, start_model_server};
use serde_json::Value;

const GERMANY: &str = "What is the capital of Germany?";
const KEY: &str = "test-key";

/// The venv's python with `openai` installed: `COROLLA_OPENAI_PYTHON`, else
/// the cache's. Missing, the test fails when `COROLLA_REQUIRE_OPENAI` is set
/// (as `scripts/test.sh` does) and is skipped loudly otherwise.
fn openai_python() -> Option<PathBuf> {
    let python = std::env::var_os("COROLLA_OPENAI_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("COROLLA_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/corolla")
                });
            cache.join("openai-venv/bin/python")
        });
    if python.is_file() {
        return Some(python);
    }
    assert!(
        std::env::var_os("COROLLA_REQUIRE_OPENAI").is_none(),
        "no python with the openai package at {}",
        python.display()
    );
    eprintln!(
        "SKIPPED: no python with the openai package at {}",
        python.display()
    );
    None
}

/// A `corolla api` process, killed when dropped.
struct Api {
    child: Child,
    base: String,
}

impl Api {
    fn start(args: &[&str]) -> Api {
        let mut child = Command::new(corolla_bin())
            .arg("api")
            .args(args)
            .args(["--port", "0", "--api-key", KEY, "--discovery-timeout", "5"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run corolla api");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[api] {line}");
                if let Some(url) = line
                    .strip_prefix("OpenAI-compatible API: ")
                    .and_then(|rest| rest.split_whitespace().next())
                {
                    let _ = tx.send(url.to_string());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("corolla api prints its address");
        Api { child, base }
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_check(python: &Path, api: &Api, model: &str, mode: &str) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("api/openai_check.py");
    let out = Command::new(python)
        .arg(script)
        .args(["--base-url", &api.base, "--api-key", KEY, "--model", model])
        .args(["--prompt", GERMANY, "--mode", mode])
        .output()
        .expect("run the openai check");
    assert!(
        out.status.success(),
        "openai check failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the check prints JSON")
}

fn generate_json(model: &Path, args: &[&str]) -> Value {
    let out = Command::new(corolla_bin())
        .args(["generate", "--model", model.to_str().unwrap(), "--json"])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run corolla generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing: {text}"))
}

fn error_code(v: &Value) -> &str {
    v["body"]["error"]["code"]
        .as_str()
        .or_else(|| v["body"]["code"].as_str())
        .unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_and_curl_use_a_swarm_through_the_api() {
    let Some(model) = default_model() else { return };
    let Some(python) = openai_python() else {
        return;
    };
    // One API process is one peer holding sessions for many users (and its
    // kept conversations): a gateway's servers raise the per-peer cap.
    let extra = [
        "--update-period",
        "5s",
        "--http-port",
        "0",
        "--max-sessions-per-peer",
        "16",
    ];
    let first = start_model_server(&model, "0:10", None, &extra).await;
    let peer = first.tcp_addr().expect("tcp address").to_string();
    let second = start_model_server(&model, "10:20", Some(&peer), &extra).await;
    let third = start_model_server(&model, "20:30", Some(&peer), &extra).await;
    let third_id = third.peer_id().to_string();
    let name = first.model().to_string();
    let status: Vec<String> = [&first, &second, &third]
        .iter()
        .map(|s| format!("{}/api/status", s.http_url().expect("http")))
        .collect();
    tokio::task::spawn_blocking(move || {
        check_api(&model, &python, &peer, &name, &third_id, &status)
    })
    .await
    .unwrap();
    for server in [first, second, third] {
        server.shutdown();
    }
}

/// Sessions open on the servers whose `/api/status` URLs are given.
fn open_sessions(status: &[String]) -> u64 {
    status
        .iter()
        .map(|url| {
            let v: Value = serde_json::from_str(&curl(&["-s", url])).expect("status json");
            v["sessions"].as_u64().expect("sessions")
        })
        .sum()
}

fn check_api(model: &Path, python: &Path, peer: &str, name: &str, third: &str, status: &[String]) {
    let model_arg = model.to_str().unwrap();
    let expected = generate_json(
        model,
        &["--initial-peers", peer, "--chat", "--prompt", GERMANY],
    );
    let expected_short = generate_json(
        model,
        &[
            "--initial-peers",
            peer,
            "--chat",
            "--prompt",
            GERMANY,
            "--max-new-tokens",
            "24",
        ],
    );
    let expected_text = expected_short["text"].as_str().unwrap();
    let expected_tokens = expected_short["generated_ids"].as_array().unwrap().len();
    assert!(expected["text"].as_str().unwrap().contains("Berlin"));

    let api = Api::start(&["--model", model_arg, "--initial-peers", peer]);
    let got = run_check(python, &api, name, "full");
    eprintln!("{got:#}");

    assert_eq!(got["models"], serde_json::json!([name]));
    // Greedy through the API = `corolla generate --chat`, token for token.
    let chat = &got["chat"];
    assert_eq!(chat["content"], expected_text, "{chat}");
    assert_eq!(chat["usage"]["completion_tokens"], expected_tokens);
    assert_eq!(
        chat["usage"]["prompt_tokens"],
        expected_short["prompt_ids"].as_array().unwrap().len()
    );
    let finish = if expected_short["stop_reason"] == "end_of_sequence" {
        "stop"
    } else {
        "length"
    };
    assert_eq!(chat["finish_reason"], finish);
    let stream = &got["stream"];
    assert_eq!(stream["content"], expected_text, "{stream}");
    assert_eq!(stream["finish_reason"], finish);
    assert_eq!(stream["usage"]["completion_tokens"], expected_tokens);
    assert!(stream["chunks"].as_u64().unwrap() >= 3, "{stream}");

    let follow = &got["follow_up"];
    assert!(
        follow["content"].as_str().unwrap().contains("Rome"),
        "{follow}"
    );
    let completion = &got["completion"];
    assert_eq!(completion["finish_reason"], "length");
    assert_eq!(completion["usage"]["completion_tokens"], 8);
    let expected_completion = generate_json(
        model,
        &[
            "--initial-peers",
            peer,
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "8",
        ],
    );
    assert_eq!(completion["text"], expected_completion["text"]);

    let stop = &got["stop"];
    let stop_word = stop["stop"].as_str().unwrap();
    let cut = &expected_text[..expected_text.find(stop_word).unwrap()];
    assert_eq!(stop["content"], cut, "{stop}");
    assert_eq!(stop["finish_reason"], "stop");
    assert_eq!(got["short"]["finish_reason"], "length");
    assert_eq!(got["short"]["usage"]["completion_tokens"], 3);

    let errors = &got["errors"];
    assert_eq!(errors["unknown_model"]["status"], 404, "{errors}");
    assert_eq!(error_code(&errors["unknown_model"]), "model_not_found");
    assert_eq!(errors["wrong_key"]["status"], 401);
    assert_eq!(errors["too_long"]["status"], 400);
    let too_long = errors["too_long"]["message"].as_str().unwrap();
    assert!(too_long.contains("2048"), "the limit is named: {too_long}");
    assert_eq!(error_code(&errors["too_long"]), "context_length_exceeded");
    // Every refusal carries its kind as the code, the words the CLI's
    // --json and the page use too.
    for bad in ["wrong_type", "bad_role", "malformed"] {
        assert_eq!(errors[bad]["status"], 400, "{bad}: {errors}");
        assert_eq!(error_code(&errors[bad]), "bad_request", "{bad}: {errors}");
    }
    assert_eq!(errors["huge_max_tokens"]["status"], 400, "{errors}");
    assert_eq!(
        error_code(&errors["huge_max_tokens"]),
        "context_length_exceeded"
    );
    assert!(errors["malformed"]["body"]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("JSON"));
    assert_eq!(errors["huge_body"]["status"], 413);
    assert_eq!(error_code(&errors["huge_body"]), "bad_request");

    // The follow-up and the repeated questions reused their conversations' sessions.
    let metrics = curl(&[
        "-s",
        &format!("{}/metrics", api.base.trim_end_matches("/v1")),
    ]);
    assert!(
        metric(&metrics, "corolla_api_reused_prompt_tokens_total") > 0.0,
        "{metrics}"
    );
    assert!(metric(&metrics, "corolla_api_completion_tokens_total") > 0.0);
    assert!(metric(&metrics, "corolla_api_time_to_first_token_seconds_count") >= 5.0);
    assert!(
        metrics.contains("corolla_api_errors_total{kind=\"model_not_found\"} 1"),
        "{metrics}"
    );

    // curl -N: server-sent events, one chunk per piece, then [DONE].
    let body = serde_json::json!({
        "model": name, "stream": true, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": GERMANY}],
    })
    .to_string();
    let started = Instant::now();
    let sse = curl(&[
        "-sN",
        "-H",
        &format!("Authorization: Bearer {KEY}"),
        "-H",
        "Content-Type: application/json",
        "-d",
        &body,
        &format!("{}/chat/completions", api.base),
    ]);
    let events: Vec<&str> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{sse}");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).expect("chunk json"))
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, expected_text, "{sse}");
    eprintln!("curl stream took {:?}", started.elapsed());

    // A client that goes away mid-stream frees its chain on the servers.
    let before = open_sessions(status);
    let long = serde_json::json!({
        "model": name, "stream": true, "temperature": 0, "max_tokens": 400,
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
    })
    .to_string();
    let cut = Command::new("curl")
        .args([
            "-sN",
            "--max-time",
            "3",
            "-H",
            &format!("Authorization: Bearer {KEY}"),
        ])
        .args(["-H", "Content-Type: application/json", "-d", &long])
        .arg(format!("{}/chat/completions", api.base))
        .output()
        .expect("curl");
    let partial = String::from_utf8_lossy(&cut.stdout);
    assert!(
        partial.contains("\"content\""),
        "no token before the cut: {partial}"
    );
    assert!(
        !partial.contains("[DONE]"),
        "the answer ended before the cut"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while open_sessions(status) > before {
        assert!(
            Instant::now() < deadline,
            "the disconnected stream's sessions stay open"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(api);

    // Without the third server's blocks: 503 naming them, at once.
    let api = Api::start(&[
        "--model",
        model_arg,
        "--initial-peers",
        peer,
        "--blocked-servers",
        third,
    ]);
    let started = Instant::now();
    let got = run_check(python, &api, name, "no-route");
    let no_route = &got["no_route"];
    assert_eq!(no_route["status"], 503, "{no_route}");
    assert_eq!(error_code(no_route), "no_coverage", "{no_route}");
    assert!(
        no_route["message"].as_str().unwrap().contains("20..30"),
        "{no_route}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

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
}

/// The API's own bounds, on a local model (no swarm needed): idle sockets
/// cannot hold it (a connection cap, a header deadline), a request cannot
/// ask for more tokens than its cap.
#[test]
fn the_api_bounds_its_connections_header_time_and_tokens() {
    use std::io::{Read, Write};
    let model = corolla_tests::tiny_llama();
    let api = Api::start(&[
        "--model",
        model.to_str().unwrap(),
        "--local",
        "--max-connections",
        "8",
        "--header-timeout",
        "1",
        "--max-tokens-cap",
        "16",
    ]);
    let addr = api
        .base
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_string();
    // Eight sockets that never send a byte take every connection slot:
    // a ninth is closed on arrival.
    let idle: Vec<std::net::TcpStream> = (0..8)
        .map(|_| std::net::TcpStream::connect(&addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut ninth = std::net::TcpStream::connect(&addr).expect("connect");
    ninth
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = ninth.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut buf = [0u8; 64];
    let read = ninth.read(&mut buf);
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "a connection over the cap was served: {read:?}"
    );
    // The idle ones are closed at the header deadline, and the API serves again.
    let started = Instant::now();
    for mut socket in idle {
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let read = socket.read(&mut buf);
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    let closed_after = started.elapsed();
    assert!(closed_after < Duration::from_secs(3), "{closed_after:?}");
    let auth = format!("Authorization: Bearer {KEY}");
    let models = curl(&["-s", "-H", &auth, &format!("{}/models", api.base)]);
    assert!(models.contains("tiny-llama"), "{models}");
    // A request for more tokens than the cap is refused, naming the cap.
    let body = serde_json::json!({
        "model": "tiny-llama-a",
        "prompt": "Hello",
        "max_tokens": 17,
    })
    .to_string();
    let (status, json) = post_completion(&api, &body);
    assert_eq!(status, "400", "{json}");
    let json: Value = serde_json::from_str(&json).expect("a JSON error");
    assert_eq!(json["error"]["code"], "bad_request", "{json}");
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cap of 16"),
        "{json}"
    );
    println!("API bounds: 9th connection closed, 8 idle sockets closed after {closed_after:?}");
}

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

fn post_completion(api: &Api, body: &str) -> (String, String) {
    let out = curl(&[
        "-s",
        "-H",
        &format!("Authorization: Bearer {KEY}"),
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        "-w",
        "\n%{http_code}",
        &format!("{}/completions", api.base),
    ]);
    let (json, status) = out.rsplit_once('\n').expect("a status line");
    (status.to_string(), json.to_string())
}

fn curl(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(args)
        .output()
        .expect("curl is installed");
    assert!(out.status.success(), "curl {args:?}: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8")
}
