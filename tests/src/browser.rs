//! Real servers in a network namespace and the web chat in Debian's
//! Chromium, for the browser tests and the browser benchmark.
//!
//! ICE ignores loopback, so WebRTC-direct needs the servers on another
//! interface: the namespace gets one end of a veth pair, this side keeps the
//! other, and Chromium (here) dials the servers (there). Everything is
//! stopped and removed when the [`NetnsSwarm`] is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::corolla_server_bin;

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Set by the README's test command, which installs Chromium and builds the
/// page: then a missing piece is a failure, not a skip.
fn browser_required() -> bool {
    std::env::var_os("COROLLA_REQUIRE_BROWSER").is_some_and(|v| v == "1")
}

/// Why the browser tests cannot run here, if they cannot.
pub fn browser_missing() -> Option<String> {
    let root = repo_root();
    let missing = if !Path::new("/usr/bin/chromium").is_file() {
        Some("/usr/bin/chromium is not installed".to_string())
    } else if !root
        .join("tests/browser/node_modules/playwright-core")
        .is_dir()
    {
        Some("tests/browser/node_modules is missing (npm ci in tests/browser)".into())
    } else if !web_dist().join("corolla-wasm_bg.wasm").is_file() {
        Some("the web page is not built (trunk build)".into())
    } else {
        None
    };
    if let Some(why) = &missing {
        assert!(!browser_required(), "browser tests required, but {why}");
    }
    missing
}

/// trunk's output folder.
pub fn web_dist() -> PathBuf {
    std::env::var_os("COROLLA_WEB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("dist"))
}

/// Where screenshots go: kept after the run, as test artifacts.
pub fn artifacts_dir() -> PathBuf {
    let dir = repo_root().join("tests/artifacts");
    std::fs::create_dir_all(&dir).expect("create tests/artifacts");
    dir
}

static NAMESPACES: AtomicU32 = AtomicU32::new(0);

/// A server started in the namespace, with what its addr file says.
pub struct NetnsServer {
    child: Child,
    pub start: usize,
    pub end: usize,
    /// The addr file: `peer_id`, `addrs`, `http`.
    pub info: Value,
}

impl NetnsServer {
    pub fn peer_id(&self) -> &str {
        self.info["peer_id"].as_str().unwrap_or_default()
    }

    pub fn http(&self) -> Option<&str> {
        self.info["http"].as_str()
    }

    /// The first address containing `part` (e.g. "/webrtc-direct", "/ws/", "/tcp/").
    pub fn addr(&self, matches: impl Fn(&str) -> bool) -> Option<String> {
        self.info["addrs"]
            .as_array()?
            .iter()
            .filter_map(|a| a.as_str())
            .find(|a| matches(a))
            .map(str::to_string)
    }

    pub fn tcp_addr(&self) -> String {
        self.addr(|a| a.contains("/tcp/") && !a.contains("/ws"))
            .expect("a TCP address")
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().is_ok_and(|s| s.is_none())
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A network namespace with a veth pair to this one and the servers in it.
pub struct NetnsSwarm {
    name: String,
    pub host_ip: String,
    pub inner_ip: String,
    dir: tempfile::TempDir,
    pub servers: Vec<NetnsServer>,
}

impl NetnsSwarm {
    /// `None` where namespaces cannot be made (not root, no iproute2).
    pub fn create() -> Option<Self> {
        let n = NAMESPACES.fetch_add(1, Ordering::SeqCst);
        let id = (std::process::id().wrapping_mul(7).wrapping_add(n * 13)) % 200 + 20;
        let name = format!("corolla-web-{id}");
        let (outer, inner) = (format!("cweb{id}a"), format!("cweb{id}b"));
        let swarm = NetnsSwarm {
            host_ip: format!("10.202.{id}.1"),
            inner_ip: format!("10.202.{id}.2"),
            name: name.clone(),
            dir: tempfile::tempdir().ok()?,
            servers: Vec::new(),
        };
        let _ = ip(&["netns", "del", &name]);
        if !ip(&["netns", "add", &name]) {
            return None;
        }
        let inner_cidr = format!("{}/24", swarm.inner_ip);
        let ok = ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]) && ip(&["link", "set", &inner, "netns", &name])
            && ip(&[
                "addr",
                "add",
                &format!("{}/24", swarm.host_ip),
                "dev",
                &outer,
            ])
            && ip(&["link", "set", &outer, "up"])
            && ip(&["-n", &name, "addr", "add", &inner_cidr, "dev", &inner])
            && ip(&["-n", &name, "link", "set", &inner, "up"])
            && ip(&["-n", &name, "link", "set", "lo", "up"]);
        assert!(ok, "could not wire the namespace {name}");
        Some(swarm)
    }

    /// Starts `corolla-server` for blocks `start..end` of `model` in the
    /// namespace and waits until it is ready. The first server starts the
    /// swarm; the others join it. `extra` goes on the command line.
    pub fn start_server(&mut self, model: &Path, start: usize, end: usize, extra: &[&str]) {
        let i = self.servers.len();
        let addr_file = self.dir.path().join(format!("server-{i}.json"));
        let log = self.dir.path().join(format!("server-{i}.log"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name])
            .arg(corolla_server_bin())
            .arg("--model")
            .arg(model)
            .args(["--block-indices", &format!("{start}:{end}")])
            .args(["--host", &self.inner_ip, "--port", "0"])
            .arg("--addr-file")
            .arg(&addr_file)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("server log"));
        match self.servers.first() {
            None => cmd.arg("--new-swarm"),
            Some(first) => cmd.args(["--initial-peers", &first.tcp_addr()]),
        };
        let child = cmd.spawn().expect("start corolla-server");
        self.servers.push(NetnsServer {
            child,
            start,
            end,
            info: Value::Null,
        });
        let started = Instant::now();
        while !addr_file.is_file() {
            let server = self.servers.last_mut().expect("just pushed");
            if !server.is_running() || started.elapsed() > Duration::from_secs(300) {
                panic!(
                    "server {i} did not start:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let info = serde_json::from_slice(&std::fs::read(&addr_file).expect("addr file"))
            .expect("addr file JSON");
        self.servers.last_mut().expect("just pushed").info = info;
    }

    /// A server's log so far, for failure messages.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("server-{i}.log"))).unwrap_or_default()
    }
}

impl Drop for NetnsSwarm {
    fn drop(&mut self) {
        for server in &mut self.servers {
            server.kill();
        }
        // Deleting the namespace deletes the veth pair with it.
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// What one page run reported (see tests/browser/chat.mjs).
#[derive(Debug)]
pub struct PageRun {
    pub events: Vec<Value>,
    pub success: bool,
    pub stderr: String,
}

impl PageRun {
    pub fn answers(&self) -> Vec<&Value> {
        self.events
            .iter()
            .filter(|e| e["event"] == "answer")
            .map(|e| &e["result"])
            .collect()
    }

    pub fn ready_info(&self) -> Option<&Value> {
        self.events
            .iter()
            .find(|e| e["event"] == "ready")
            .map(|e| &e["info"])
    }
}

/// Opens `url` in Chromium, sends `prompts` through the page's UI with
/// greedy sampling, saves a screenshot as `name.png` in the artifacts, and
/// calls `on_first_token` when the first answer starts streaming.
pub fn run_page(
    url: &str,
    prompts: &[&str],
    max_new_tokens: usize,
    name: &str,
    mut on_first_token: impl FnMut(),
) -> PageRun {
    let screenshot = artifacts_dir().join(format!("{name}.png"));
    let mut cmd = Command::new("node");
    cmd.arg(repo_root().join("tests/browser/chat.mjs"))
        .args(["--url", url])
        .args(["--max-new-tokens", &max_new_tokens.to_string()])
        .arg("--screenshot")
        .arg(&screenshot)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for p in prompts {
        cmd.args(["--prompt", p]);
    }
    let mut child = cmd.spawn().expect("run node (is Node.js installed?)");
    let stderr = child.stderr.take().expect("piped");
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let mut events = Vec::new();
    let mut token_seen = false;
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        let Ok(event) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if event["event"] == "token" && !token_seen {
            token_seen = true;
            on_first_token();
        }
        events.push(event);
    }
    let status = child.wait().expect("wait for node");
    PageRun {
        events,
        success: status.success(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// `corolla generate --chat --json` through the swarm: the native client's
/// answer to compare the page's with.
pub fn native_chat(
    model: &Path,
    bootstrap: &str,
    prompt: &str,
    system: Option<&str>,
    max_new_tokens: usize,
) -> Value {
    let mut cmd = Command::new(crate::corolla_bin());
    cmd.arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--initial-peers", bootstrap, "--chat", "--json"])
        .args(["--prompt", prompt])
        .args(["--max-new-tokens", &max_new_tokens.to_string()]);
    if let Some(system) = system {
        cmd.args(["--system", system]);
    }
    let out = cmd.output().expect("run corolla generate");
    assert!(
        out.status.success(),
        "corolla generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("generate --json output")
}
