//! `--model owner/name` downloads through hf-hub, and only what the server
//! needs. The hub here is a small HTTP server in the test that answers the
//! way the Hugging Face hub does (`/{repo}/resolve/{revision}/{file}` with
//! range requests, `etag` and `x-repo-commit`), serving a converted fixture.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-llama-a")
}

/// Serves `dir` as repo `test-org/tiny-llama-a`; returns the endpoint and the log of files asked for.
fn fake_hub(dir: PathBuf) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let served = log.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            let mut range = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    range = Some(v.trim().to_string());
                }
            }
            let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
            let file = path
                .strip_prefix("/test-org/tiny-llama-a/resolve/main/")
                .map(str::to_owned);
            let body = file.as_ref().and_then(|f| std::fs::read(dir.join(f)).ok());
            let Some(body) = body else {
                let _ = conn.write_all(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                continue;
            };
            let file = file.unwrap_or_default();
            let size = body.len();
            let (start, end) = match range.as_deref().and_then(|r| r.split_once('-')) {
                Some((a, b)) => {
                    let a: usize = a.parse().unwrap_or(0);
                    let b: usize = b.parse().unwrap_or(size.saturating_sub(1));
                    (a.min(size), (b + 1).min(size))
                }
                None => (0, size),
            };
            if end - start > 1 {
                served.lock().unwrap().push(file.clone());
            }
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {}-{}/{}\r\n\
                 ETag: \"etag-{}\"\r\nX-Repo-Commit: 0123456789abcdef0123456789abcdef01234567\r\nConnection: close\r\n\r\n",
                end - start,
                start,
                end.saturating_sub(1),
                size,
                file.replace(['.', '-'], "_"),
            );
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body[start..end]);
            let mut rest = Vec::new();
            let _ = reader.read_to_end(&mut rest);
        }
    });
    (endpoint, log)
}

fn wait_for(path: &Path, child: &mut std::process::Child) -> serde_json::Value {
    let started = Instant::now();
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("server exited with {status}: {err}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no address file"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn a_repo_id_downloads_only_the_blocks_the_server_hosts() {
    let tmp = tempfile::tempdir().unwrap();
    let converted = tmp.path().join("repo");
    let source = corolla_model::Checkpoint::open(fixture()).unwrap();
    corolla_model::convert::convert(&source, &converted, 1, |_| {}).unwrap();
    let (endpoint, log) = fake_hub(converted);
    let addr_file = tmp.path().join("addr.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_corolla-server"))
        .args([
            "--model",
            "test-org/tiny-llama-a",
            "--block-indices",
            "1:3",
            "--new-swarm",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .arg("--addr-file")
        .arg(&addr_file)
        .env("HF_ENDPOINT", &endpoint)
        .env("HF_HOME", tmp.path().join("hf-home"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = wait_for(&addr_file, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(ready["model"], "tiny-llama-a");
    assert_eq!(
        (ready["start"].as_u64(), ready["end"].as_u64()),
        (Some(1), Some(3))
    );
    let mut fetched = log.lock().unwrap().clone();
    fetched.sort();
    fetched.dedup();
    assert_eq!(
        fetched,
        [
            "blocks-00001-00002.safetensors",
            "blocks-00002-00003.safetensors",
            "config.json",
            "corolla-index.json"
        ],
        "the server fetched more (or less) than its blocks"
    );
    assert!(tmp
        .path()
        .join("hf-home/hub/models--test-org--tiny-llama-a")
        .is_dir());

    // A repo that does not exist is one clear error.
    let out = Command::new(env!("CARGO_BIN_EXE_corolla-server"))
        .args([
            "--model",
            "test-org/missing",
            "--block-indices",
            "0:1",
            "--new-swarm",
            "--port",
            "0",
        ])
        .env("HF_ENDPOINT", &endpoint)
        .env("HF_HOME", tmp.path().join("hf-home"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot download config.json from the hub"),
        "{stderr}"
    );
}
