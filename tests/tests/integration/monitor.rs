//! The swarm monitor against real servers on loopback: every server's
//! `/api/swarm` and `corolla swarm` (`--json` and text) report the servers
//! that were started, how many hold each block, the summed throughput per
//! block and the blocks nobody serves; `/monitor` is a self-contained page.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use corolla_server::RunningServer;
use corolla_tests::{corolla_bin, start_server, tiny_llama};
use serde_json::Value;

/// The tiny Llama's blocks.
const BLOCKS: usize = 4;

async fn start(blocks: &str, join: Option<&RunningServer>) -> RunningServer {
    let join = join.map(|first| first.tcp_addr().expect("tcp address").to_string());
    start_server(
        blocks,
        join.as_deref(),
        &["--update-period", "2s", "--http-port", "0"],
    )
    .await
}

/// GET `url` off the async threads: status, body and Cache-Control.
async fn get(url: String) -> (u16, String, Option<String>, Option<String>) {
    tokio::task::spawn_blocking(move || {
        let response = match ureq::get(&url).call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("GET {url}: {e}"),
        };
        let status = response.status();
        let cache = response.header("cache-control").map(str::to_string);
        let kind = response.header("content-type").map(str::to_string);
        let body = response.into_string().expect("body");
        (status, body, cache, kind)
    })
    .await
    .expect("GET task")
}

async fn corolla(args: &[&str]) -> String {
    let out = tokio::process::Command::new(corolla_bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run corolla");
    assert!(
        out.status.success(),
        "corolla {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn spans(report: &Value) -> BTreeSet<(String, u64, u64)> {
    report["servers"]
        .as_array()
        .unwrap_or_else(|| panic!("no servers in {report}"))
        .iter()
        .map(|s| {
            (
                s["peer_id"].as_str().expect("peer_id").to_string(),
                s["start"].as_u64().expect("start"),
                s["end"].as_u64().expect("end"),
            )
        })
        .collect()
}

fn expected_spans(servers: &[RunningServer]) -> BTreeSet<(String, u64, u64)> {
    servers
        .iter()
        .map(|s| {
            let (a, b) = s.blocks();
            (s.peer_id().to_string(), a as u64, b as u64)
        })
        .collect()
}

/// What every report of these servers must say, whoever built it.
fn assert_report(report: &Value, servers: &[RunningServer]) {
    assert_eq!(report["model"], servers[0].model(), "{report}");
    assert_eq!(report["num_layers"], BLOCKS as u64, "{report}");
    assert_eq!(spans(report), expected_spans(servers), "{report}");
    let blocks = report["blocks"].as_array().expect("blocks");
    let counts: Vec<u64> = blocks
        .iter()
        .map(|b| b["servers"].as_u64().unwrap())
        .collect();
    // 0:2, 1:2 and 3:4: block 1 twice, block 2 by nobody.
    assert_eq!(counts, [1, 2, 0, 1], "{report}");
    let indices: Vec<u64> = blocks
        .iter()
        .map(|b| b["block"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2, 3]);
    for b in blocks {
        let i = b["block"].as_u64().unwrap();
        let sum: f64 = report["servers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["start"].as_u64().unwrap() <= i && i < s["end"].as_u64().unwrap())
            .map(|s| s["throughput"].as_f64().unwrap())
            .sum();
        let got = b["throughput"].as_f64().unwrap();
        assert!(
            (got - sum).abs() <= 1e-9 * sum.max(1.0),
            "block {i}: {got} vs {sum}"
        );
        assert_eq!(got > 0.0, i != 2, "block {i}: {report}");
    }
    assert_eq!(report["gaps"], serde_json::json!([[2, 3]]), "{report}");
    assert_eq!(report["complete"], false);
    assert!(report["generated_at_ms"].as_u64().unwrap() > 0);
    for s in report["servers"].as_array().unwrap() {
        for field in [
            "cache_tokens_left",
            "sessions",
            "max_sessions",
            "version",
            "dtype",
        ] {
            assert!(!s[field].is_null(), "{field} missing in {s}");
        }
        assert!(
            ["public", "private", "unknown"].contains(&s["reachability"].as_str().unwrap()),
            "{s}"
        );
        assert!(!s["addresses"].as_array().unwrap().is_empty(), "{s}");
    }
}

/// The report of `http`'s `/api/swarm`, once it lists `n` servers, and
/// once the servers `with_rtt` have a round trip in it.
async fn swarm_of(http: &str, n: usize, with_rtt: &[String]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body, cache, _) = get(format!("{http}/api/swarm")).await;
        if status == 200 {
            assert_eq!(cache.as_deref(), Some("no-store"));
            let report: Value = serde_json::from_str(&body).expect("JSON report");
            let timed = with_rtt.iter().all(|peer| {
                report["servers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|s| s["peer_id"] == peer.as_str() && s["rtt_ms"].as_f64().is_some())
            });
            if report["servers"].as_array().map(Vec::len) == Some(n) && timed {
                return report;
            }
            assert!(Instant::now() < deadline, "{http}/api/swarm: {report}");
        } else {
            assert!(
                Instant::now() < deadline,
                "{http}/api/swarm: {status} {body}"
            );
        }
        // Reports are cached for 2 s.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_swarm_and_corolla_swarm_report_the_servers_coverage_and_gaps() {
    let first = start("0:2", None).await;
    let second = start("1:2", Some(&first)).await;
    let third = start("3:4", Some(&first)).await;
    let servers = [first, second, third];
    let others: Vec<String> = servers[1..]
        .iter()
        .map(|s| s.peer_id().to_string())
        .collect();

    // The first server: the others joined through it, so it pings them.
    let http = servers[0].http_url().expect("http").to_string();
    let report = swarm_of(&http, 3, &others).await;
    assert_report(&report, &servers);
    assert_eq!(report["observer"], servers[0].peer_id().to_string());
    for s in report["servers"].as_array().unwrap() {
        let is_self = s["peer_id"] == servers[0].peer_id().to_string();
        assert_eq!(s["rtt_ms"].is_null(), is_self, "{s}");
        if let Some(ms) = s["rtt_ms"].as_f64() {
            assert!(ms > 0.0 && ms < 5000.0, "{s}");
        }
    }
    // Any server answers for the whole swarm.
    let third_http = servers[2].http_url().expect("http").to_string();
    let report = swarm_of(&third_http, 3, &[]).await;
    assert_report(&report, &servers);
    assert_eq!(report["observer"], servers[2].peer_id().to_string());

    // The page: HTML, self-contained, polling the relative api/swarm.
    let (status, page, cache, kind) = get(format!("{http}/monitor")).await;
    assert_eq!(status, 200);
    assert!(kind.unwrap_or_default().starts_with("text/html"));
    assert_eq!(cache.as_deref(), Some("no-cache"));
    assert!(
        page.contains("fetch('api/swarm'"),
        "the page polls api/swarm"
    );
    for external in [
        "src=\"http",
        "href=\"http",
        "src=\"//",
        "href=\"//",
        "@import",
    ] {
        assert!(!page.contains(external), "the page loads {external}…");
    }

    // The CLI, from its own node: the same report, round trips to every server.
    let bootstrap = servers[0].tcp_addr().expect("tcp").to_string();
    let model = tiny_llama();
    let common = [
        "swarm",
        "--initial-peers",
        &bootstrap,
        "--model",
        model.to_str().unwrap(),
        "--discovery-timeout",
        "5",
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    let cli = loop {
        let out = corolla(&[&common[..], &["--json"]].concat()).await;
        let report: Value = serde_json::from_str(&out).expect("swarm --json");
        if report["servers"].as_array().map(Vec::len) == Some(3) || Instant::now() > deadline {
            break report;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_report(&cli, &servers);
    assert!(cli["observer"].is_null(), "the CLI is no server: {cli}");
    for s in cli["servers"].as_array().unwrap() {
        assert!(
            s["rtt_ms"].as_f64().is_some(),
            "no round trip from the CLI: {s}"
        );
    }
    let text = corolla(&common).await;
    assert!(text.contains("coverage [12X1]"), "{text}");
    assert!(text.contains("blocks not served: 2..3"), "{text}");
    for s in &servers {
        assert!(text.contains(&s.peer_id().to_string()), "{text}");
    }

    for s in servers {
        s.shutdown();
    }
}
