//! What the page's connections carry and survive: the loss of the server
//! in use, prefills over 1 MiB, `wss` from an https page.

use super::*;

/// A server's open sessions and the decode steps it has computed.
fn session_load(http: &str) -> (u64, u64) {
    let status = ureq::get(&format!("{http}/api/status"))
        .timeout(Duration::from_secs(5))
        .call()
        .ok()
        .and_then(|r| r.into_json::<Value>().ok())
        .unwrap_or_default();
    (
        status["sessions"].as_u64().unwrap_or(0),
        status["compute"]["decode_steps"].as_u64().unwrap_or(0),
    )
}

/// The replica that carries the page's answer: the page spot-checks a
/// sampled step on the other replica, whose witness session then stays
/// open too, so an open session alone does not tell them apart. The one in
/// use is the one that decodes every token.
fn replica_in_use(replicas: &[String]) -> Option<usize> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let load: Vec<(u64, u64)> = replicas.iter().map(|r| session_load(r)).collect();
        let busiest = (0..load.len())
            .filter(|&i| load[i].0 > 0)
            .max_by_key(|&i| load[i].1);
        if let Some(i) = busiest {
            let others_max = (0..load.len())
                .filter(|&j| j != i)
                .map(|j| load[j].1)
                .max()
                .unwrap_or(0);
            if load[i].1 > others_max {
                return Some(i);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn page_recovers_when_the_server_in_use_is_killed() {
    let _one = serial();
    let Some(model) = default_model() else { return };
    let Some(mut swarm) = ready("kill and recover") else {
        return;
    };
    swarm.start_page_server(&model, 0, 15, &[]);
    // Slow replicas keep the answer going long after the first poll finds
    // its session (a fast answer could end before the kill).
    let slow = ["--http-port", "0", "--step-delay-ms", "300"];
    swarm.start_server(&model, 15, 30, &slow);
    swarm.start_server(&model, 15, 30, &slow);
    let http = swarm.servers[0].http().expect("http").to_string();
    let replicas: Vec<String> = swarm.servers[1..]
        .iter()
        .map(|s| s.http().expect("http").to_string())
        .collect();

    let mut killed = None;
    // The browser logs its failed redials of the killed server.
    let run = run_page_with(
        &format!("{http}/?transport=webrtc-direct"),
        &[GERMANY],
        40,
        "chat-page-recovered",
        &[
            "--allow-console-error",
            "^WebSocket connection to '[^']+' failed: Error in connection establishment",
        ],
        || {
            if let Some(i) = replica_in_use(&replicas) {
                swarm.servers[i + 1].kill();
                killed = Some(i + 1);
            }
        },
    );
    let killed = killed.expect("one replica of blocks 15..30 had the page's session");
    let answer = first_answer(&run);
    let recoveries = answer["recoveries"].as_array().expect("recoveries");
    assert!(
        !recoveries.is_empty(),
        "the page reported no recovery: {answer}"
    );
    let survivor = if killed == 1 { 2 } else { 1 };
    assert_eq!(
        recoveries[0]["replacement"][0]["peer_id"].as_str(),
        Some(swarm.servers[survivor].peer_id()),
        "{recoveries:?}"
    );
    let native = native_chat(&model, &swarm.servers[0].tcp_addr(), GERMANY, None, 40);
    assert_same_tokens(&answer, &native);
}

/// Hidden size 2048 f32: 8 KiB per token, so a prompt of 128+ tokens sends
/// more than 1 MiB in the prefill.
const WIDE_HIDDEN: usize = 2048;

fn wide_model(dir: &Path) {
    let vocab = corolla_tests::read_config(&tiny_llama())["vocab_size"]
        .as_u64()
        .unwrap() as usize;
    write_random_checkpoint(
        dir,
        &RandomSpec {
            hidden_size: WIDE_HIDDEN,
            num_layers: 2,
            num_heads: 16,
            num_kv_heads: 8,
            intermediate_size: 1024,
            vocab_size: vocab,
            max_positions: 1024,
            seed: 11,
        },
    )
    .unwrap();
    for side in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny_llama().join(side), dir.join(side)).unwrap();
    }
}

#[test]
fn prefills_over_one_mib_cross_both_browser_transports() {
    let _one = serial();
    let Some(mut swarm) = ready("1 MiB prefills") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("wide");
    wide_model(&model);
    swarm.start_page_server(&model, 0, 1, &[]);
    swarm.start_server(&model, 1, 2, &[]);
    let http = swarm.servers[0].http().expect("http").to_string();
    let prompt = "The quick brown fox jumps over the lazy dog while the garden grows. ".repeat(12);
    for (page, transport) in [("", "webrtc-direct"), ("widget-demo.html", "websocket")] {
        let name = format!("wide-prefill-{transport}");
        let run = run_page(
            &format!("{http}/{page}?transport={transport}"),
            &[&prompt],
            8,
            &name,
            || {},
        );
        let answer = first_answer(&run);
        let prefill_bytes = ids(&answer["prompt_ids"]).len() * WIDE_HIDDEN * 4;
        assert!(prefill_bytes > 1 << 20, "prefill of {prefill_bytes} bytes");
        let system = run.system();
        let native = native_chat(
            &model,
            &swarm.servers[0].tcp_addr(),
            &prompt,
            system.as_deref(),
            8,
        );
        assert_same_tokens(&answer, &native);
        assert_route_covers(&answer, 2);
    }
}

#[test]
fn https_page_reaches_the_swarm_over_wss() {
    let _one = serial();
    let Some(mut swarm) = ready("https and wss") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let tls = test_certificate(tmp.path(), &swarm.inner_ip);
    let model = tiny_llama();
    swarm.start_page_server(&model, 0, 4, &tls.args());
    let server = &swarm.servers[0];
    let http = server.http().expect("http").to_string();
    assert!(http.starts_with("https://"), "{http}");
    let wss = server
        .addr(|a| a.contains("/tls/ws"))
        .expect("a /tls/ws address");
    let prompt = "Hello there";
    // At phone width, which the page must fit.
    let run = run_page_with(
        &format!("{http}/?bootstrap={wss}"),
        &[prompt],
        12,
        "chat-page-https-wss-phone",
        &["--viewport", "360x740", "--reload-check"],
        || {},
    );
    let answer = first_answer(&run);
    assert!(
        run.fits_width(),
        "the page scrolls sideways at 360 px: {:?}",
        run.events
    );
    assert_steady_layout(&run);
    // An https page keeps the client part in the Cache API: a second visit
    // downloads none of it.
    let reload = run
        .events
        .iter()
        .find(|e| e["event"] == "reload")
        .unwrap_or_else(|| panic!("no reload: {:?}", run.events));
    assert_eq!(reload["model_files_fetched"], 0, "{reload}");
    let native = native_chat(&model, &server.tcp_addr(), prompt, None, 12);
    assert_same_tokens(&answer, &native);
}
