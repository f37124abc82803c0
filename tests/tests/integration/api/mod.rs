//! `corolla api` on a loopback swarm of the default model, driven by the
//! official `openai` Python package (a venv that `scripts/test.sh` makes
//! outside the clone) and by `curl -N`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use corolla_tests::{corolla_bin, default_model, start_model_server};
use serde_json::Value;

mod adapters;
mod bounds;
mod conversations;
mod openai_sdk;

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
