//! Real servers in a network namespace, for tests that need a non-loopback
//! address: ICE (WebRTC) ignores loopback. The namespace gets one end of a
//! veth pair, this side keeps the other, and clients here dial the servers
//! there. Everything is stopped and removed when the [`NetnsSwarm`] is dropped.
//! [`Namespace`] is the wiring alone, for worlds of many namespaces
//! (`crate::wan`).

use std::net::{IpAddr, Ipv4Addr};
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
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

static NAMESPACES: AtomicU32 = AtomicU32::new(0);

/// Where the owners of this machine's test namespaces are noted, so a
/// namespace left by a test process that died can be told from one in use.
const OWNERS: &str = "/tmp/corolla-netns";

/// Ids (and so names, subnets and interface names) taken by other test
/// processes are skipped; those whose owner died are taken back.
const IDS: std::ops::Range<u32> = 20..250;

/// A network namespace wired to this one by a veth pair: `10.202.<id>.1`
/// here, `10.202.<id>.2` inside, a default route inside through this side
/// and loopback up. Deleted (with its veth pair) when dropped.
pub struct Namespace {
    pub name: String,
    pub id: u32,
    /// This side's end of the veth pair: a local address of the host.
    pub host_ip: Ipv4Addr,
    /// The address inside the namespace.
    pub inner_ip: Ipv4Addr,
}

impl Namespace {
    /// `None` where namespaces cannot be made (not root, no iproute2).
    pub fn create() -> Option<Namespace> {
        let ns = Self::bare()?;
        ns.wire();
        Some(ns)
    }

    /// The host's end of the link of the namespace whose inside address is
    /// `inner` (`10.202.<id>.2` -> `10.202.<id>.1`): a local address that
    /// stands for that namespace here, e.g. as the source a forwarder
    /// connects from on its behalf. `None` for any other address.
    pub fn host_side_of(inner: IpAddr) -> Option<IpAddr> {
        match inner {
            IpAddr::V4(ip) => match ip.octets() {
                [10, 202, id, 2] if IDS.contains(&u32::from(id)) => {
                    Some(IpAddr::V4(Ipv4Addr::new(10, 202, id, 1)))
                }
                _ => None,
            },
            IpAddr::V6(_) => None,
        }
    }

    /// A namespace with loopback up and no link out: the caller wires it
    /// (see [`Namespace::link`]). Its `host_ip`/`inner_ip` are unused.
    pub fn bare() -> Option<Namespace> {
        if !ip(&["netns", "list"]) {
            return None;
        }
        let _ = std::fs::create_dir_all(OWNERS);
        let n = NAMESPACES.fetch_add(1, Ordering::SeqCst);
        let span = IDS.end - IDS.start;
        let first = std::process::id()
            .wrapping_mul(7)
            .wrapping_add(n.wrapping_mul(13))
            % span;
        for k in 0..span {
            let id = IDS.start + (first + k) % span;
            let name = format!("corolla-{id}");
            let owner = Path::new(OWNERS).join(&name);
            if !ip(&["netns", "add", &name]) {
                // Taken: by a live test, or left by one that died.
                let pid = std::fs::read_to_string(&owner).unwrap_or_default();
                let dead = pid
                    .trim()
                    .parse::<u32>()
                    .is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
                if !(dead && ip(&["netns", "del", &name]) && ip(&["netns", "add", &name])) {
                    continue;
                }
            }
            let _ = std::fs::write(&owner, std::process::id().to_string());
            let ns = Namespace {
                name,
                id,
                host_ip: Ipv4Addr::new(10, 202, id as u8, 1),
                inner_ip: Ipv4Addr::new(10, 202, id as u8, 2),
            };
            let _ = ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
            return Some(ns);
        }
        None
    }

    fn wire(&self) {
        let (outer, inner) = (format!("cns{}a", self.id), format!("cns{}b", self.id));
        // A host-side end left by a namespace deleted outside a test.
        let _ = ip(&["link", "del", &outer]);
        let name = self.name.as_str();
        let ok = ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]) && ip(&["link", "set", &inner, "netns", name])
            && ip(&[
                "addr",
                "add",
                &format!("{}/24", self.host_ip),
                "dev",
                &outer,
            ])
            && ip(&["link", "set", &outer, "up"])
            && ip(&[
                "-n",
                name,
                "addr",
                "add",
                &format!("{}/24", self.inner_ip),
                "dev",
                &inner,
            ])
            && ip(&["-n", name, "link", "set", &inner, "up"])
            && ip(&["-n", name, "link", "set", "lo", "up"])
            && ip(&[
                "-n",
                name,
                "route",
                "add",
                "default",
                "via",
                &self.host_ip.to_string(),
            ]);
        assert!(ok, "could not wire the namespace {name}");
    }

    /// A veth pair between this namespace (interface `here`, address
    /// `here_cidr`) and `other` (`there`, `there_cidr`), both ends up.
    /// Interface names are the namespaces' own, so they never clash.
    pub fn link(
        &self,
        here: &str,
        here_cidr: &str,
        other: &Namespace,
        there: &str,
        there_cidr: &str,
    ) {
        let ok = ip(&[
            "-n",
            &self.name,
            "link",
            "add",
            here,
            "type",
            "veth",
            "peer",
            "name",
            there,
            "netns",
            &other.name,
        ]) && ip(&["-n", &self.name, "addr", "add", here_cidr, "dev", here])
            && ip(&["-n", &other.name, "addr", "add", there_cidr, "dev", there])
            && ip(&["-n", &self.name, "link", "set", here, "up"])
            && ip(&["-n", &other.name, "link", "set", there, "up"]);
        assert!(ok, "could not link {} and {}", self.name, other.name);
    }

    /// Runs `program args` in the namespace; panics with its output when it fails.
    pub fn run(&self, program: &str, args: &[&str]) {
        let out = self
            .command(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {} in {} failed: {}",
            args.join(" "),
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `program` run inside the namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = std::fs::remove_file(Path::new(OWNERS).join(&self.name));
    }
}

/// A server started in the namespace, with what its addr file says; killed
/// when dropped (a test that fails or panics included).
pub struct NetnsServer {
    child: Child,
    pub start: usize,
    pub end: usize,
    /// The addr file: `peer_id`, `addrs`, `http`.
    pub info: Value,
}

impl NetnsServer {
    /// Starts `corolla-server` for blocks `start..end` of `model` in `ns`
    /// (a new swarm, or joining `bootstrap`) and waits until it is ready.
    /// Its addr file and log (at `rust_log`) go to `dir/<label>.*`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        ns: &Namespace,
        dir: &Path,
        label: &str,
        model: &Path,
        (start, end): (usize, usize),
        bootstrap: Option<&str>,
        extra: &[&str],
        rust_log: &str,
    ) -> NetnsServer {
        let addr_file = dir.join(format!("{label}.json"));
        let log = dir.join(format!("{label}.log"));
        let mut cmd = ns.command(corolla_server_bin());
        cmd.arg("--model")
            .arg(model)
            .args(["--block-indices", &format!("{start}:{end}")])
            .arg("--addr-file")
            .arg(&addr_file)
            .args(extra)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("server log"));
        match bootstrap {
            None => cmd.arg("--new-swarm"),
            Some(addr) => cmd.args(["--initial-peers", addr]),
        };
        let child = cmd.spawn().expect("start corolla-server");
        let mut server = NetnsServer {
            child,
            start,
            end,
            info: Value::Null,
        };
        let started = Instant::now();
        while !addr_file.is_file() {
            if !server.is_running() || started.elapsed() > Duration::from_secs(300) {
                panic!(
                    "server {label} did not start:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        server.info = serde_json::from_slice(&std::fs::read(&addr_file).expect("addr file"))
            .expect("addr file JSON");
        server
    }

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
    // Dropped first: the servers live in the namespace.
    pub servers: Vec<NetnsServer>,
    ns: Namespace,
    pub host_ip: String,
    pub inner_ip: String,
    dir: tempfile::TempDir,
}

impl NetnsSwarm {
    /// `None` where namespaces cannot be made (not root, no iproute2).
    pub fn create() -> Option<Self> {
        let ns = Namespace::create()?;
        Some(NetnsSwarm {
            host_ip: ns.host_ip.to_string(),
            inner_ip: ns.inner_ip.to_string(),
            ns,
            dir: tempfile::tempdir().ok()?,
            servers: Vec::new(),
        })
    }

    /// Starts `corolla-server` for blocks `start..end` of `model` in the
    /// namespace and waits until it is ready. The first server starts the
    /// swarm; the others join it. `extra` goes on the command line.
    pub fn start_server(&mut self, model: &Path, start: usize, end: usize, extra: &[&str]) {
        let i = self.servers.len();
        let mut args = vec!["--host", self.inner_ip.as_str(), "--port", "0"];
        args.extend_from_slice(extra);
        let bootstrap = self.servers.first().map(NetnsServer::tcp_addr);
        let server = NetnsServer::start(
            &self.ns,
            self.dir.path(),
            &format!("server-{i}"),
            model,
            (start, end),
            bootstrap.as_deref(),
            &args,
            "warn",
        );
        self.servers.push(server);
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

impl Drop for NetnsServer {
    fn drop(&mut self) {
        // `ip netns exec` execs the server, so this pid is the server's.
        self.kill();
    }
}

/// Set by the README's test command, which installs iproute2 and iptables
/// and runs as root: then a world that cannot be built is a failure, not a
/// skip.
pub fn netns_required() -> bool {
    std::env::var_os("COROLLA_REQUIRE_NETNS").is_some_and(|v| v == "1")
}
