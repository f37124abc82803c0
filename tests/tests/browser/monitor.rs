//! A server's `/monitor` page in Chromium.

use super::*;

/// A model of 24 small random blocks, so that the monitor's coverage bar
/// has something to show.
fn monitor_model(dir: &Path) {
    let vocab = corolla_tests::read_config(&tiny_llama())["vocab_size"]
        .as_u64()
        .unwrap() as usize;
    write_random_checkpoint(
        dir,
        &RandomSpec {
            hidden_size: 64,
            num_layers: 24,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 128,
            vocab_size: vocab,
            max_positions: 256,
            seed: 5,
        },
    )
    .unwrap();
    for side in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny_llama().join(side), dir.join(side)).unwrap();
    }
}

/// A server's `/monitor` in Chromium: at 1280x800 and 390x844, light and
/// dark, the table lists every server started and the bar has one segment
/// per block with the number of servers holding it; nothing overflows a
/// phone's width; a failed refresh shows its error and keeps the data; no
/// uncaught page error. Screenshots: `tests/artifacts/monitor-*.png`.
#[test]
fn monitor_page_shows_every_server_and_block_on_desktop_and_phone() {
    let _one = serial();
    if let Some(missing) = corolla_tests::browser::chromium_missing() {
        eprintln!("SKIPPED monitor page: {missing}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    monitor_model(tmp.path());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Overlaps of two and three servers, and blocks 14..17 served by nobody.
    let spans = ["0:10", "6:14", "8:12", "17:24"];
    let servers = runtime.block_on(async {
        let flags = ["--update-period", "2s", "--http-port", "0"];
        let model = tmp.path();
        let first = corolla_tests::start_model_server(model, spans[0], None, &flags).await;
        let join = first.tcp_addr().expect("tcp").to_string();
        let mut servers = vec![first];
        for span in &spans[1..] {
            servers.push(corolla_tests::start_model_server(model, span, Some(&join), &flags).await);
        }
        servers
    });
    let http = servers[0].http_url().expect("http").to_string();
    // Wait until the first server sees every server and has pinged the
    // others, so that the pictures show a settled swarm.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let report: Option<Value> = ureq::get(&format!("{http}/api/swarm"))
            .call()
            .ok()
            .and_then(|r| r.into_json().ok());
        let settled = report.as_ref().is_some_and(|r| {
            let rows = r["servers"].as_array().map_or(&[][..], Vec::as_slice);
            rows.len() == spans.len()
                && rows.iter().filter(|s| s["rtt_ms"].is_f64()).count() + 1 == spans.len()
        });
        if settled {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the swarm did not settle: {report:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    let run = corolla_tests::browser::run_monitor_page(
        &format!("{http}/monitor"),
        spans.len(),
        24,
        "monitor",
    );
    assert!(
        run.success,
        "the page failed: {:?}\n{}",
        run.events, run.stderr
    );
    let peers: std::collections::BTreeSet<String> =
        servers.iter().map(|s| s.peer_id().to_string()).collect();
    let mut expected = vec![0u64; 24];
    for s in &servers {
        let (a, b) = s.blocks();
        for c in &mut expected[a..b] {
            *c += 1;
        }
    }
    assert_eq!(expected.iter().filter(|&&c| c == 0).count(), 3);
    let views: Vec<&Value> = run.events.iter().filter(|e| e["event"] == "view").collect();
    assert_eq!(views.len(), 4, "{:?}", run.events);
    for view in &views {
        let rows: std::collections::BTreeSet<String> = view["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peer"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(rows, peers, "{view}");
        let segments: Vec<u64> = view["segments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .collect();
        assert_eq!(segments, expected, "{view}");
        assert!(view["gaps"].as_str().unwrap().contains("14–16"), "{view}");
        assert_eq!(view["state"], "ok", "{view}");
        assert!(
            view["scroll_width"].as_u64().unwrap() <= view["viewport_width"].as_u64().unwrap(),
            "the page overflows its width: {view}"
        );
        assert!(
            Path::new(view["screenshot"].as_str().unwrap()).is_file(),
            "{view}"
        );
    }
    assert!(views
        .iter()
        .any(|v| v["width"] == 390 && v["viewport_width"] == 390));
    let stale = event(&run, "stale");
    assert_eq!(stale["error_shown"], true, "{stale}");
    assert!(
        stale["error_text"]
            .as_str()
            .unwrap()
            .contains("test outage"),
        "{stale}"
    );
    assert_eq!(
        stale["rows"].as_array().map(Vec::len),
        Some(spans.len()),
        "the last data is kept: {stale}"
    );
    assert_eq!(event(&run, "recovered")["error_shown"], false);
    for s in servers {
        s.shutdown();
    }
}
