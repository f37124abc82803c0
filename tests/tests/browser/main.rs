//! The web chat and the widget in real headless Chromium against real
//! servers: the page's greedy answers equal `corolla generate`'s token for
//! token, over WebRTC-direct and over WebSocket (and `wss` from an https
//! page), with prefills over 1 MiB, and through the loss of the server in
//! use. Screenshots land in `tests/artifacts/`.
//!
//! The servers run in a network namespace (ICE ignores loopback); Chromium
//! runs here. Without Chromium, the built page or namespaces, the tests say
//! so and pass, unless `COROLLA_REQUIRE_BROWSER=1` (the README's test command).
//!
//! One module per area; this file holds what they share. One area's tests:
//! `cargo test -p corolla-tests --test browser monitor::`.

mod big_heads;
mod chat;
mod models;
mod monitor;
mod transports;

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use corolla_model::random::{write_random_checkpoint, RandomSpec};
use corolla_tests::browser::{browser_missing, native_chat, run_page, run_page_with, PageRun};
use corolla_tests::netns::NetnsSwarm;
use corolla_tests::tls::test_certificate;
use corolla_tests::{default_model, tiny_llama};
use serde_json::Value;

/// One Chromium and one swarm at a time: on two cores, parallel runs only
/// make every timeout tighter.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn ready(why: &str) -> Option<NetnsSwarm> {
    if let Some(missing) = browser_missing() {
        eprintln!("SKIPPED {why}: {missing}");
        return None;
    }
    let swarm = NetnsSwarm::create();
    if swarm.is_none() {
        eprintln!("SKIPPED {why}: cannot create a network namespace (needs root and iproute2)");
    }
    swarm
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("an id"))
        .collect()
}

/// The page's only (or first) answer, after checking the run succeeded.
fn first_answer(run: &PageRun) -> Value {
    assert!(
        run.success,
        "the page failed: {:?}\n{}",
        run.events, run.stderr
    );
    run.answers()
        .first()
        .map(|a| (*a).clone())
        .unwrap_or_else(|| panic!("no answer: {:?}\n{}", run.events, run.stderr))
}

fn assert_same_tokens(page: &Value, native: &Value) {
    assert_eq!(
        ids(&page["prompt_ids"]),
        ids(&native["prompt_ids"]),
        "prompt ids differ"
    );
    let generated = ids(&page["generated_ids"]);
    assert!(!generated.is_empty());
    assert_eq!(
        generated,
        ids(&native["generated_ids"]),
        "page: {:?}",
        page["text"]
    );
}

/// The page's route covers every block, on the servers of `swarm`.
fn assert_route_covers(page: &Value, num_layers: u64) {
    let route = page["route"].as_array().expect("route");
    let mut next = 0;
    for hop in route {
        assert_eq!(hop["start"].as_u64(), Some(next), "route {route:?}");
        next = hop["end"].as_u64().expect("end");
    }
    assert_eq!(next, num_layers, "route {route:?}");
}

const GERMANY: &str = "What is the capital of Germany?";

/// Nothing moves when an answer starts: Stop takes Send's place, the input
/// keeps its size, and the header stays one line.
fn assert_steady_layout(run: &PageRun) {
    let g = run
        .events
        .iter()
        .find(|e| e["event"] == "geometry")
        .unwrap_or_else(|| panic!("no geometry: {:?}", run.events));
    let (before, during) = (&g["before"], &g["during"]);
    assert!(during.is_object(), "no geometry while answering: {g}");
    for (part, field) in [
        ("button", "x"),
        ("button", "y"),
        ("button", "h"),
        ("input", "y"),
        ("input", "h"),
        ("header", "h"),
    ] {
        let (a, b) = (
            before[part][field].as_f64().unwrap(),
            during[part][field].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() < 1.0,
            "{part}.{field} moved from {a} to {b}: {g}"
        );
    }
    let header = before["header"]["h"].as_f64().unwrap();
    assert!(header < 56.0, "the header wraps ({header} px high): {g}");
}

/// Tasks that held the page's thread over 50 ms in a phase of the run
/// (`cold`: from navigation through the answers; `warm`: the reload and its
/// answer), as the page's long-task `PerformanceObserver` saw them: the
/// longest (ms) and how many, before the widget had its wasm module (the
/// document's own start-up) and after (loading the model and answering).
struct LongTasks {
    startup: (f64, usize),
    working: (f64, usize),
}

fn long_tasks(run: &PageRun, phase: &str) -> LongTasks {
    let event = run
        .events
        .iter()
        .find(|e| e["event"] == "long_tasks" && e["phase"] == phase)
        .unwrap_or_else(|| panic!("no {phase} long_tasks event: {:?}", run.events));
    let loaded = event["marks"]["corolla-wasm-loaded"]
        .as_f64()
        .unwrap_or_else(|| panic!("the widget set no corolla-wasm-loaded mark: {event}"));
    let (mut startup, mut working) = ((0.0, 0), (0.0, 0));
    for task in event["tasks"].as_array().into_iter().flatten() {
        let (start, duration) = (task["start_ms"].as_f64(), task["duration_ms"].as_f64());
        let (Some(start), Some(duration)) = (start, duration) else {
            panic!("a long task without start or duration: {task}");
        };
        let bucket: &mut (f64, usize) = if start < loaded {
            &mut startup
        } else {
            &mut working
        };
        bucket.0 = f64::max(bucket.0, duration);
        bucket.1 += 1;
    }
    LongTasks { startup, working }
}

fn event<'a>(run: &'a PageRun, name: &str) -> &'a Value {
    run.events
        .iter()
        .find(|e| e["event"] == name)
        .unwrap_or_else(|| panic!("no {name} event: {:?}\n{}", run.events, run.stderr))
}
