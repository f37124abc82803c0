//! The official `openai` package and curl against `corolla api`.

use super::*;

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
    // Cut after the first token, whatever the swarm's speed (a timed cut
    // missed the stream once answers got faster than the time).
    let response = ureq::post(&format!("{}/chat/completions", api.base))
        .set("Authorization", &format!("Bearer {KEY}"))
        .set("Content-Type", "application/json")
        .send_string(&long)
        .expect("a streamed answer");
    let mut partial = String::new();
    let mut stream = std::io::BufReader::new(response.into_reader());
    while !partial.contains("\"content\"") {
        let mut line = String::new();
        let read = std::io::BufRead::read_line(&mut stream, &mut line).expect("the stream");
        assert!(read > 0, "the stream ended before a token: {partial}");
        partial.push_str(&line);
    }
    drop(stream);
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
