//! The `corolla-server` binary: one clear line for bad input, and settings
//! from a config file and the environment.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-llama-a")
}

fn server() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_corolla-server"));
    c.env("RUST_LOG", "error");
    c
}

fn fails_with(args: &[&str], needle: &str) {
    let out = server().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(needle),
        "{args:?}: {stderr:?} should mention {needle:?}"
    );
}

#[test]
fn bad_input_is_one_clear_error() {
    let model = fixture();
    let model = model.to_str().unwrap();
    fails_with(
        &[
            "--model",
            "/nonexistent",
            "--new-swarm",
            "--block-indices",
            "0:1",
        ],
        "does not exist",
    );
    fails_with(
        &["--model", model, "--new-swarm", "--block-indices", "3"],
        "is not A:B",
    );
    fails_with(
        &[
            "--model",
            model,
            "--new-swarm",
            "--block-indices",
            "2:9",
            "--port",
            "0",
        ],
        "outside the model's 4 layers",
    );
    fails_with(&["--model", model, "--block-indices", "0:1"], "--new-swarm");
    fails_with(
        &[
            "--model",
            model,
            "--new-swarm",
            "--block-indices",
            "0:1",
            "--update-period",
            "3h",
        ],
        "unknown unit",
    );

    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    fails_with(
        &[
            "--model",
            model,
            "--new-swarm",
            "--block-indices",
            "0:1",
            "--host",
            "127.0.0.1",
            "--port",
            &port,
        ],
        "cannot listen on /ip4/127.0.0.1/tcp/",
    );
}

#[test]
fn settings_come_from_a_config_file_and_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let addr_file = tmp.path().join("addr.json");
    let config = tmp.path().join("server.toml");
    std::fs::write(
        &config,
        format!(
            "model = {:?}\nblock-indices = \"0:1\"\nnew-swarm = true\nhost = \"127.0.0.1\"\nport = 0\naddr_file = {:?}\nidentity = {:?}\n",
            fixture().to_str().unwrap(),
            addr_file.to_str().unwrap(),
            tmp.path().join("key").to_str().unwrap(),
        ),
    )
    .unwrap();
    let run = |envs: &[(&str, &str)]| {
        let _ = std::fs::remove_file(&addr_file);
        let mut child = server()
            .args(["--config", config.to_str().unwrap()])
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while !addr_file.exists() {
            if let Some(status) = child.try_wait().unwrap() {
                let out = child.wait_with_output().unwrap();
                panic!(
                    "server exited with {status}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no address file"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&addr_file).unwrap()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        json
    };
    let first = run(&[]);
    assert_eq!(
        (first["start"].as_u64(), first["end"].as_u64()),
        (Some(0), Some(1))
    );
    let peer = first["peer_id"].as_str().unwrap().to_string();
    let addrs: Vec<String> = serde_json::from_value(first["addrs"].clone()).unwrap();
    assert!(
        addrs
            .iter()
            .any(|a| a.starts_with("/ip4/127.0.0.1/tcp/") && a.ends_with(&format!("/p2p/{peer}"))),
        "{addrs:?}"
    );
    assert!(addrs.iter().any(|a| a.contains("/quic-v1/")), "{addrs:?}");
    assert!(addrs.iter().any(|a| a.contains("/ws/")), "{addrs:?}");

    // The environment beats the file; the identity file keeps the peer id.
    let second = run(&[("COROLLA_BLOCK_INDICES", "1:3")]);
    assert_eq!(
        (second["start"].as_u64(), second["end"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(second["peer_id"].as_str(), Some(peer.as_str()));
}

#[test]
fn sigterm_leaves_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    let addr_file = dir.path().join("addr.json");
    let mut child = server()
        .env("RUST_LOG", "info")
        .args([
            "--model",
            fixture().to_str().unwrap(),
            "--new-swarm",
            "--block-indices",
            "0:4",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--addr-file",
            addr_file.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !addr_file.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "server never ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let stopping = Instant::now();
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(15),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(exit.success(), "{exit:?}: {stderr}");
    assert!(stderr.contains("leaving the swarm"), "{stderr}");
}
