//! Real servers in a network namespace, for tests that need a non-loopback
//! address: ICE (WebRTC) ignores loopback. The namespace gets one end of a
//! veth pair, this side keeps the other, and clients here dial the servers
//! there. Everything is stopped and removed when the [`NetnsSwarm`] is dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::browser::web_dist;
use crate::corolla_server_bin;

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
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

    /// [`Self::start_server`] that also serves the built page over HTTP.
    pub fn start_page_server(&mut self, model: &Path, start: usize, end: usize, extra: &[&str]) {
        let web = web_dist();
        let mut args = vec![
            "--http-port",
            "0",
            "--web-dir",
            web.to_str().unwrap_or("dist"),
        ];
        args.extend_from_slice(extra);
        self.start_server(model, start, end, &args);
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
