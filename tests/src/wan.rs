//! A WAN test world: real `corolla-server`s, each in its own network
//! namespace, and the `corolla` CLI in another, every link between them
//! given a round-trip delay. This kernel has no netem, so the delay comes
//! from user space: each server has one delaying TCP forwarder
//! ([`crate::forwarder`]) on the host side, and announces that forwarder's
//! address (`--public-name`). The host does not forward between
//! namespaces, so a namespace reaches only the host's own addresses (the
//! forwarders), never another namespace's inner address: no peer can
//! bypass a delay, whatever addresses identify or the DHT hand out.
//!
//! Every link (client–server or server–server) passes exactly one
//! forwarder, the one of the server it was dialled to, so each has the
//! world's round trip.
//!
//! Everything (processes, forwarders, namespaces) goes when the world is
//! dropped; the host's `ip_forward` is restored when the last world in
//! this process goes.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::forwarder::{Forwarder, LinkShape};
use crate::netns::Namespace;
use crate::{corolla_bin, corolla_server_bin};

mod generation;

use generation::finish;
pub use generation::{generate_local, write_wire_model, Generation};

/// Every server listens on this port inside its namespace, and its
/// forwarder on the same port at the host side's address: the server
/// announces its listen port with `--public-name`'s host, so the two must
/// match. Different addresses, so many servers share the number.
pub const SERVER_PORT: u16 = 41_000;

/// Each server's `/api/status`, on its inner address: the host reaches
/// every namespace directly (it is the other end of each veth pair), so
/// the test reads servers' figures without going through a delay.
pub const HTTP_PORT: u16 = SERVER_PORT + 10;

/// The longest a generation may take before it counts as hung.
pub const GENERATION_TIMEOUT: Duration = Duration::from_secs(300);

/// How each link is delayed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkDelay {
    /// Added to each direction: a link's round trip is twice this.
    pub one_way: Duration,
    /// Up to this much more per chunk, uniformly (order is kept).
    pub jitter: Duration,
    /// Chance per chunk of a ~200 ms stall, standing in for a lost segment
    /// and TCP's retransmission timeout.
    pub loss: f64,
}

impl LinkDelay {
    /// The presets are 20, 50 and 100 ms round trips.
    pub fn rtt_ms(ms: u64) -> LinkDelay {
        LinkDelay {
            one_way: Duration::from_micros(ms * 500),
            jitter: Duration::ZERO,
            loss: 0.0,
        }
    }

    pub fn with_jitter(self, jitter: Duration) -> LinkDelay {
        LinkDelay { jitter, ..self }
    }

    pub fn with_loss(self, loss: f64) -> LinkDelay {
        LinkDelay { loss, ..self }
    }

    /// The round trip without jitter or stalls.
    pub fn rtt(&self) -> Duration {
        self.one_way * 2
    }
}

/// The host's `ip_forward` before the first live world, and how many
/// worlds are alive: the last to go restores it.
static IP_FORWARD: Mutex<(usize, Option<String>)> = Mutex::new((0, None));
const IP_FORWARD_PATH: &str = "/proc/sys/net/ipv4/ip_forward";

/// Holds `ip_forward` at 0 while alive. Nothing in this project's tests
/// needs it at 1 (the browser tests' namespace talks to the host only);
/// a test that did could not run beside a WAN world.
struct NoForwarding;

impl NoForwarding {
    fn hold() -> Option<NoForwarding> {
        let mut state = IP_FORWARD.lock().unwrap_or_else(|e| e.into_inner());
        if state.0 == 0 {
            let old = std::fs::read_to_string(IP_FORWARD_PATH).ok()?;
            if old.trim() != "0" {
                std::fs::write(IP_FORWARD_PATH, "0").ok()?;
            }
            state.1 = Some(old);
        }
        state.0 += 1;
        Some(NoForwarding)
    }
}

impl Drop for NoForwarding {
    fn drop(&mut self) {
        let mut state = IP_FORWARD.lock().unwrap_or_else(|e| e.into_inner());
        state.0 -= 1;
        if state.0 == 0 {
            if let Some(old) = state.1.take() {
                if old.trim() != "0" {
                    let _ = std::fs::write(IP_FORWARD_PATH, old.trim());
                }
            }
        }
    }
}

/// One server of the world, in its own namespace behind its forwarder;
/// killed when dropped.
pub struct WanServer {
    child: Child,
    pub start: usize,
    pub end: usize,
    pub peer_id: String,
    /// Carries (and delays) every connection to this server.
    pub forwarder: Forwarder,
    pub log: PathBuf,
    ns: Namespace,
}

impl WanServer {
    /// The address the server announces: its forwarder's, with `/p2p/`.
    pub fn public_addr(&self) -> String {
        format!(
            "/ip4/{}/tcp/{SERVER_PORT}/p2p/{}",
            self.ns.host_ip, self.peer_id
        )
    }

    /// Where it really listens, inside its namespace.
    pub fn inner_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ns.inner_ip, SERVER_PORT))
    }

    /// `/api/status` read from the host (`Null` when it does not answer).
    pub fn status(&self) -> Value {
        let url = format!("http://{}:{HTTP_PORT}/api/status", self.ns.inner_ip);
        ureq::get(&url)
            .timeout(Duration::from_secs(5))
            .call()
            .ok()
            .and_then(|r| r.into_json::<Value>().ok())
            .unwrap_or_default()
    }

    /// Decode steps its compute core has run, all sessions together.
    pub fn decode_steps(&self) -> u64 {
        self.status()["compute"]["decode_steps"]
            .as_u64()
            .unwrap_or(0)
    }

    pub fn host_ip(&self) -> Ipv4Addr {
        self.ns.host_ip
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().is_ok_and(|s| s.is_none())
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The servers and the client's namespace.
pub struct WanWorld {
    pub servers: Vec<WanServer>,
    client: Namespace,
    shape: Arc<LinkShape>,
    delay: LinkDelay,
    dir: tempfile::TempDir,
    _no_forwarding: NoForwarding,
}

impl WanWorld {
    /// An empty world (the client's namespace only) whose links will have
    /// `delay`. `None` where namespaces cannot be made (not root, no
    /// iproute2) or `ip_forward` cannot be held at 0.
    pub fn create(delay: LinkDelay) -> Option<WanWorld> {
        let client = Namespace::create()?;
        let no_forwarding = NoForwarding::hold()?;
        Some(WanWorld {
            servers: Vec::new(),
            client,
            shape: LinkShape::new(delay.one_way, delay.jitter, delay.loss),
            delay,
            dir: tempfile::tempdir().ok()?,
            _no_forwarding: no_forwarding,
        })
    }

    /// A folder that lives as long as the world (models, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn delay(&self) -> LinkDelay {
        self.delay
    }

    /// Changes every link's delay, for connections open and new.
    pub fn set_delay(&mut self, delay: LinkDelay) {
        self.shape.set(delay.one_way, delay.jitter, delay.loss);
        self.delay = delay;
    }

    /// Starts one server of blocks `start..end` and waits until it serves.
    /// The first starts the swarm; the others join through the first one's
    /// forwarder. `extra` goes on the command line.
    pub fn start_server(&mut self, model: &Path, start: usize, end: usize, extra: &[&str]) {
        let i = self.spawn_server(model, start, end, extra);
        self.wait_ready(i);
    }

    /// Starts servers of `spans`: the first alone (the others join it),
    /// then the rest at once.
    pub fn start_servers(&mut self, model: &Path, spans: &[(usize, usize)], extra: &[&str]) {
        let Some((&(start, end), rest)) = spans.split_first() else {
            return;
        };
        if self.servers.is_empty() {
            self.start_server(model, start, end, extra);
        } else {
            let i = self.spawn_server(model, start, end, extra);
            self.wait_ready(i);
        }
        let started: Vec<usize> = rest
            .iter()
            .map(|&(a, b)| self.spawn_server(model, a, b, extra))
            .collect();
        for i in started {
            self.wait_ready(i);
        }
    }

    fn addr_file(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("server-{i}.json"))
    }

    fn spawn_server(&mut self, model: &Path, start: usize, end: usize, extra: &[&str]) -> usize {
        let i = self.servers.len();
        let ns = Namespace::create().expect("a namespace for a server");
        let inner = SocketAddr::V4(SocketAddrV4::new(ns.inner_ip, SERVER_PORT));
        let listen = SocketAddr::V4(SocketAddrV4::new(ns.host_ip, SERVER_PORT));
        let forwarder =
            Forwarder::delaying_from(listen, inner, self.shape.clone(), Namespace::host_side_of)
                .unwrap_or_else(|e| panic!("cannot listen on {listen}: {e}"));
        let log = self.dir.path().join(format!("server-{i}.log"));
        let mut cmd = ns.command(corolla_server_bin());
        cmd.arg("--model")
            .arg(model)
            .args(["--block-indices", &format!("{start}:{end}")])
            .args(["--host", &ns.inner_ip.to_string()])
            .args(["--port", &SERVER_PORT.to_string()])
            .args(["--public-name", &ns.host_ip.to_string()])
            .args(["--http-port", &HTTP_PORT.to_string()])
            .arg("--addr-file")
            .arg(self.addr_file(i))
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("COROLLA_WAN_LOG").unwrap_or("warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("server log"));
        match self.servers.first() {
            None => cmd.arg("--new-swarm"),
            Some(first) => cmd.args(["--initial-peers", &first.public_addr()]),
        };
        let child = cmd.spawn().expect("start corolla-server");
        self.servers.push(WanServer {
            child,
            start,
            end,
            peer_id: String::new(),
            forwarder,
            log,
            ns,
        });
        i
    }

    fn wait_ready(&mut self, i: usize) {
        let addr_file = self.addr_file(i);
        let started = Instant::now();
        while !addr_file.is_file() {
            let server = &mut self.servers[i];
            if !server.is_running() || started.elapsed() > Duration::from_secs(300) {
                panic!("server {i} did not start:\n{}", server.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let info: Value = serde_json::from_slice(&std::fs::read(&addr_file).expect("addr file"))
            .expect("addr file JSON");
        self.servers[i].peer_id = info["peer_id"].as_str().expect("peer_id").to_string();
    }

    /// The client's way in: the first server's forwarded address.
    pub fn bootstrap(&self) -> String {
        self.servers
            .first()
            .expect("a server started")
            .public_addr()
    }

    /// `corolla generate --json` in the client's namespace through the
    /// world: greedy, past end-of-sequence, spot checks off (they would
    /// add the client's own compute to what is measured). `extra` last.
    pub fn generate_command(
        &self,
        model: &Path,
        prompt: &str,
        new_tokens: usize,
        extra: &[&str],
    ) -> Command {
        let mut cmd = self.client.command(corolla_bin());
        cmd.arg("generate")
            .arg("--model")
            .arg(model)
            .args(["--initial-peers", &self.bootstrap()])
            .args(["--prompt", prompt])
            .args(["--max-new-tokens", &new_tokens.to_string()])
            .args(["--ignore-eos", "--json", "--spot-check", "0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Runs [`Self::generate_command`] to the end (at most
    /// [`GENERATION_TIMEOUT`]).
    pub fn generate(
        &self,
        model: &Path,
        prompt: &str,
        new_tokens: usize,
        extra: &[&str],
    ) -> Result<Generation, String> {
        let started = Instant::now();
        let child = self
            .generate_command(model, prompt, new_tokens, extra)
            .spawn()
            .map_err(|e| format!("cannot run corolla: {e}"))?;
        Self::wait_generation(child, started)
    }

    /// Waits for a spawned [`Self::generate_command`]; one that hangs is
    /// killed after [`GENERATION_TIMEOUT`] and reported with its stderr.
    pub fn wait_generation(mut child: Child, started: Instant) -> Result<Generation, String> {
        // Read both pipes meanwhile, so a chatty child never blocks on them.
        let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut pipe) = pipe {
                    let _ = pipe.read_to_end(&mut buf);
                }
                buf
            })
        };
        let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
        let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if started.elapsed() < GENERATION_TIMEOUT => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        let out = std::process::Output {
            status: status.unwrap_or_default(),
            stdout: stdout.join().unwrap_or_default(),
            stderr: stderr.join().unwrap_or_default(),
        };
        if status.is_none() {
            return Err(format!(
                "corolla generate hung: killed after {GENERATION_TIMEOUT:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        finish(out, started.elapsed())
    }

    /// Bytes each server's forwarder has carried so far, both ways.
    pub fn traffic(&self) -> Vec<u64> {
        self.servers.iter().map(|s| s.forwarder.bytes()).collect()
    }

    /// Waits until one of `candidates` has carried `bytes` more than in
    /// `before` (a [`Self::traffic`] snapshot) and returns the one that
    /// carried most: the server an answer is routed through, told from its
    /// replicas by the activations on its link.
    pub fn wait_for_traffic(
        &self,
        before: &[u64],
        candidates: &[usize],
        bytes: u64,
        timeout: Duration,
    ) -> Option<usize> {
        let started = Instant::now();
        while started.elapsed() < timeout {
            let now = self.traffic();
            let grown = |i: usize| now[i].saturating_sub(before.get(i).copied().unwrap_or(0));
            if let Some(&busiest) = candidates.iter().max_by_key(|&&i| grown(i)) {
                if grown(busiest) >= bytes {
                    return Some(busiest);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Waits until one of `candidates` has run `steps` decode steps more
    /// than in `before` (a [`Self::decode_steps`] snapshot) and returns
    /// it: the server an answer is routed through, told from its replicas
    /// by its work (its link's bytes would not tell, once servers push
    /// activations to each other over connections either of them dialled).
    pub fn wait_for_decode_steps(
        &self,
        before: &[u64],
        candidates: &[usize],
        steps: u64,
        timeout: Duration,
    ) -> Option<usize> {
        let started = Instant::now();
        while started.elapsed() < timeout {
            for &i in candidates {
                let done = self.servers[i].decode_steps();
                if done >= before.get(i).copied().unwrap_or(0) + steps {
                    return Some(i);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Every server's [`WanServer::decode_steps`].
    pub fn decode_steps(&self) -> Vec<u64> {
        self.servers.iter().map(WanServer::decode_steps).collect()
    }

    /// Whether a TCP connection to `addr` from the client's namespace
    /// succeeds (within 3 s).
    pub fn client_can_connect(&self, addr: SocketAddr) -> bool {
        self.client
            .command("timeout")
            .args([
                "3",
                "bash",
                "-c",
                &format!("exec 3<>/dev/tcp/{}/{}", addr.ip(), addr.port()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Every server's log (the last 4000 characters of each), for failure
    /// messages.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        for (i, s) in self.servers.iter().enumerate() {
            let log = s.log_text();
            let from = log.len().saturating_sub(4000);
            let tail: String = log
                .char_indices()
                .skip_while(|(at, _)| *at < from)
                .map(|(_, c)| c)
                .collect();
            all.push_str(&format!(
                "--- server {i} (blocks {}..{}, {}) ---\n{tail}\n",
                s.start, s.end, s.peer_id
            ));
        }
        all
    }
}

impl Drop for WanServer {
    fn drop(&mut self) {
        // Before its namespace goes (a field, dropped after this).
        self.kill();
    }
}
