//! `GET /metrics` on a server's `--http-port`: a generation through two real
//! servers (one pushing to the other) and a refused request show up in
//! OpenMetrics text that parses, libp2p's byte counts included.

use std::collections::HashMap;
use std::io::Read;
use std::time::{Duration, Instant};

use corolla_client::network::connect;
use corolla_client::SessionSettings;
use corolla_model::{Checkpoint, ClientHead, DType, Device};
use corolla_shared::protocol::{ErrorCode, OpenRequest, Request};
use corolla_shared::WireDType;
use corolla_tests::hostile::{exchange, open_stream};
use corolla_tests::{concurrent_generations, greedy, start_server, tiny_llama, Golden};

/// Fetches `/metrics` and checks the content type.
fn scrape(http: &str) -> String {
    let response = ureq::get(&format!("{http}/metrics"))
        .call()
        .expect("GET /metrics");
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let mut text = String::new();
    response
        .into_reader()
        .read_to_string(&mut text)
        .expect("metrics text");
    text
}

/// Every sample of `text` as `(name, labels, value)`, after checking the
/// OpenMetrics text shape: comments, then `name{labels} value` lines, and
/// `# EOF` last.
fn parse(text: &str) -> Vec<(String, String, f64)> {
    let mut lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.pop(), Some("# EOF"), "the text must end in # EOF");
    assert!(text.ends_with("# EOF\n"));
    let mut samples = Vec::new();
    for line in lines {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line.starts_with("# UNIT ")
        {
            continue;
        }
        assert!(!line.starts_with('#'), "an unknown comment: {line:?}");
        let name_end = line
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or_else(|| panic!("no value in {line:?}"));
        let name = &line[..name_end];
        assert!(
            !name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit()),
            "bad metric name in {line:?}"
        );
        let rest = &line[name_end..];
        let (labels, rest) = match rest.strip_prefix('{') {
            Some(inner) => {
                let close = inner
                    .find("} ")
                    .unwrap_or_else(|| panic!("unclosed labels in {line:?}"));
                let labels = &inner[..close];
                for pair in labels.split("\",").filter(|p| !p.is_empty()) {
                    let (key, value) = pair
                        .split_once("=\"")
                        .unwrap_or_else(|| panic!("bad label {pair:?} in {line:?}"));
                    assert!(
                        !key.is_empty()
                            && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                        "bad label name {key:?} in {line:?}"
                    );
                    let _ = value;
                }
                (labels.to_string(), &inner[close + 1..])
            }
            None => (String::new(), rest),
        };
        let value = rest
            .strip_prefix(' ')
            .unwrap_or_else(|| panic!("no space before the value in {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("value {v:?} is not a number in {line:?}")),
        };
        samples.push((name.to_string(), labels, value));
    }
    samples
}

/// The sum of `name`'s samples (over all labels).
fn total(samples: &[(String, String, f64)], name: &str) -> f64 {
    samples
        .iter()
        .filter(|(n, _, _)| n == name)
        .map(|(_, _, v)| v)
        .sum()
}

/// Samples of `name` by their labels.
fn by_labels(samples: &[(String, String, f64)], name: &str) -> HashMap<String, f64> {
    samples
        .iter()
        .filter(|(n, _, _)| n == name)
        .map(|(_, l, v)| (l.clone(), *v))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_generation_through_two_servers() {
    let first = start_server("0:2", None, &["--http-port", "0"]).await;
    let join = first.tcp_addr().expect("tcp address").to_string();
    let second = start_server("2:4", Some(&join), &["--http-port", "0"]).await;
    let http_first = first.http_url().expect("http").to_string();
    let http_second = second.http_url().expect("http").to_string();

    let ck = Checkpoint::open(tiny_llama()).unwrap();
    let head = ClientHead::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let node = connect(&[first.tcp_addr().unwrap().clone()]).await.unwrap();
    // Push is on by default: the first server hands its outputs to the second.
    let settings = SessionSettings::new(first.model(), 4, 64, WireDType::F32);
    let prompt = Golden::load(&tiny_llama(), "float32").prompts[0]
        .input_ids
        .clone();
    let new_tokens = 12;
    let run = concurrent_generations(
        &node,
        &settings,
        &head,
        &[greedy(prompt.clone(), new_tokens)],
    )
    .await
    .expect("a generation through both servers");
    let generated = run.outputs[0].generated_ids.len();
    assert_eq!(generated, new_tokens);

    // A refused request is counted by its code.
    let mut stream = open_stream(&node, first.peer_id()).await;
    let open = Request::Open(OpenRequest {
        model: "not-this-model".into(),
        fingerprint: String::new(),
        start: 0,
        end: 2,
        max_length: 16,
        dtype: WireDType::F32,
        compression: corolla_shared::Compression::None,
        flow_window: 0,
        next: None,
        adapter: None,
    })
    .encode();
    let reply = exchange(&mut stream, &open).await;
    assert_eq!(
        reply.map(|(code, _)| code),
        Some(Some(ErrorCode::WrongModel))
    );
    drop(stream);

    for (http, server) in [(&http_first, "first"), (&http_second, "second")] {
        let samples = parse(&scrape(http));
        let steps = by_labels(&samples, "corolla_steps_total");
        assert!(
            total(&samples, "corolla_steps_total") > 0.0,
            "{server}: {steps:?}"
        );
        // Every generated token but the last went through every block.
        let tokens = total(&samples, "corolla_tokens_total");
        assert!(
            tokens >= (prompt.len() + generated - 1) as f64 && tokens >= generated as f64,
            "{server}: {tokens} positions for {generated} tokens"
        );
        assert!(
            total(&samples, "corolla_step_latency_seconds_count")
                >= total(&samples, "corolla_steps_total"),
            "{server}: every step's latency is observed"
        );
        assert!(total(&samples, "corolla_step_latency_seconds_count") > 0.0);
        assert!(
            total(&samples, "corolla_decode_batch_size_count") > 0.0,
            "{server}"
        );
        assert!(
            total(&samples, "corolla_sessions_opened_total") >= 1.0,
            "{server}"
        );
        let used = total(&samples, "corolla_cache_tokens_used");
        let left = total(&samples, "corolla_cache_tokens_left");
        assert!(
            left > 0.0 && used >= 0.0,
            "{server}: cache {used} used, {left} left"
        );
        assert!(
            samples
                .iter()
                .any(|(n, _, _)| n == "corolla_relay_circuits"),
            "{server}"
        );
        let bandwidth = by_labels(&samples, "libp2p_bandwidth_bytes_total");
        assert!(
            bandwidth.values().sum::<f64>() > 0.0,
            "{server}: libp2p byte counts: {bandwidth:?}"
        );
    }

    // The first server pushed its outputs to the second, which took them in.
    let first_samples = parse(&scrape(&http_first));
    let second_samples = parse(&scrape(&http_second));
    let pushes_out = by_labels(&first_samples, "corolla_push_steps_total");
    let pushes_in = by_labels(&second_samples, "corolla_push_steps_total");
    let sent = pushes_out
        .get("outcome=\"sent\"")
        .copied()
        .unwrap_or_default();
    let received = pushes_in
        .get("outcome=\"received\"")
        .copied()
        .unwrap_or_default();
    assert!(sent > 0.0, "pushes sent: {pushes_out:?}");
    assert!(received > 0.0, "pushes received: {pushes_in:?}");
    assert!(
        by_labels(&second_samples, "corolla_steps_total")
            .get("kind=\"push\"")
            .is_some_and(|n| *n > 0.0),
        "the second server computed pushed steps"
    );
    let errors = by_labels(&first_samples, "corolla_errors_total");
    assert_eq!(
        errors.get("code=\"wrong_model\"").copied(),
        Some(1.0),
        "{errors:?}"
    );

    // Once the sessions are closed, nothing is open and no cache is held.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let samples = parse(&scrape(&http_first));
        let open = total(&samples, "corolla_sessions_open");
        let used = total(&samples, "corolla_cache_tokens_used");
        if open == 0.0 && used == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} sessions still open, {used} cache tokens held"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
