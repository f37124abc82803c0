//! A NAT test world in network namespaces: a "public internet" namespace
//! with a bootstrap server that relays, and two homes, each a LAN behind a
//! router namespace that masquerades (iptables MASQUERADE) and drops what
//! nobody inside asked for, like a home router. A server in home 1 holds
//! blocks nobody else has; the client runs in home 2.
//!
//! ```text
//!  home1 (192.168.1.2) ── router1 ── 198.51.100.0/24 ── inet ── 203.0.113.0/24 ── router2 ── home2 (192.168.2.2)
//!   home server          NAT                      bootstrap + relay                NAT          client
//! ```
//!
//! Nothing routes into a home: the homes reach each other only through the
//! relay or a hole punched in both routers. Everything is stopped and the
//! namespaces deleted when the [`NatWorld`] is dropped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::corolla_bin;
use crate::netns::{Namespace, NetnsServer};
use crate::wan::{Generation, WanWorld};

/// How a home router maps ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NatKind {
    /// Linux MASQUERADE: keeps the inside port where it can, so the port a
    /// relay sees is the port a hole punch aims at.
    PortPreserving,
    /// MASQUERADE `--random-fully`: a new random port per destination (a
    /// symmetric NAT); hole punching cannot work, the relay must.
    Symmetric,
}

/// The port every server listens on (inside its own namespace).
pub const SERVER_PORT: u16 = 42_000;

pub struct NatWorld {
    // Dropped in this order: servers first (they live in the namespaces).
    pub bootstrap: NetnsServer,
    pub home_server: Option<NetnsServer>,
    dir: tempfile::TempDir,
    inet: Namespace,
    home1: Namespace,
    home2: Namespace,
    _routers: [Namespace; 2],
}

/// The bootstrap's address as each home sees it.
const INET_TO_HOME1: &str = "198.51.100.1";
const INET_TO_HOME2: &str = "203.0.113.1";

impl NatWorld {
    /// The namespaces, routers and the bootstrap server (blocks
    /// `bootstrap_blocks` of `model`, relaying unless `extra` says
    /// otherwise). `None` where namespaces or iptables are missing.
    pub fn create(
        nat: NatKind,
        model: &Path,
        bootstrap_blocks: (usize, usize),
        bootstrap_extra: &[&str],
    ) -> Option<NatWorld> {
        if Command::new("iptables")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_or(true, |s| !s.success())
        {
            return None;
        }
        let inet = Namespace::bare()?;
        let router1 = Namespace::bare()?;
        let router2 = Namespace::bare()?;
        let home1 = Namespace::bare()?;
        let home2 = Namespace::bare()?;
        let homes = [
            (&router1, &home1, INET_TO_HOME1, "198.51.100.2", "192.168.1"),
            (&router2, &home2, INET_TO_HOME2, "203.0.113.2", "192.168.2"),
        ];
        // The internet routes between the routers' public addresses.
        inet.run("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        for (i, (router, home, inet_ip, wan_ip, lan)) in homes.into_iter().enumerate() {
            inet.link(
                &format!("isp{i}"),
                &format!("{inet_ip}/24"),
                router,
                "wan",
                &format!("{wan_ip}/24"),
            );
            router.link(
                "lan",
                &format!("{lan}.1/24"),
                home,
                "eth0",
                &format!("{lan}.2/24"),
            );
            router.run("ip", &["route", "add", "default", "via", inet_ip]);
            home.run(
                "ip",
                &["route", "add", "default", "via", &format!("{lan}.1")],
            );
            router.run("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
            let mut masquerade = vec![
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-o",
                "wan",
                "-j",
                "MASQUERADE",
            ];
            if nat == NatKind::Symmetric {
                masquerade.push("--random-fully");
            }
            router.run("iptables", &masquerade);
            // A home router drops what nobody inside asked for, without a
            // reset: a hole punch's first SYN may arrive before the other
            // side's has opened the way, and must not kill the attempt.
            for chain in ["INPUT", "FORWARD"] {
                router.run(
                    "iptables",
                    &[
                        "-A",
                        chain,
                        "-i",
                        "wan",
                        "-m",
                        "conntrack",
                        "--ctstate",
                        "NEW,INVALID",
                        "-j",
                        "DROP",
                    ],
                );
            }
        }
        let dir = tempfile::tempdir().ok()?;
        let port = SERVER_PORT.to_string();
        let mut args = vec!["--host", "0.0.0.0", "--port", port.as_str()];
        args.extend_from_slice(bootstrap_extra);
        let bootstrap = NetnsServer::start(
            &inet,
            dir.path(),
            "bootstrap",
            model,
            bootstrap_blocks,
            None,
            &args,
            LOG_LEVEL,
        );
        Some(NatWorld {
            bootstrap,
            home_server: None,
            dir,
            inet,
            home1,
            home2,
            _routers: [router1, router2],
        })
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The bootstrap's TCP address as seen from home `n` (1 or 2).
    pub fn bootstrap_addr(&self, home: u8) -> String {
        let ip = if home == 1 {
            INET_TO_HOME1
        } else {
            INET_TO_HOME2
        };
        format!(
            "/ip4/{ip}/tcp/{SERVER_PORT}/p2p/{}",
            self.bootstrap.peer_id()
        )
    }

    /// Starts the server in home 1 for `blocks` of `model`, joining through
    /// the bootstrap.
    pub fn start_home_server(&mut self, model: &Path, blocks: (usize, usize), extra: &[&str]) {
        let port = SERVER_PORT.to_string();
        let mut args = vec!["--host", "0.0.0.0", "--port", port.as_str()];
        args.extend_from_slice(extra);
        let bootstrap = self.bootstrap_addr(1);
        self.home_server = Some(NetnsServer::start(
            &self.home1,
            self.dir.path(),
            "home-server",
            model,
            blocks,
            Some(&bootstrap),
            &args,
            LOG_LEVEL,
        ));
    }

    /// The home server's log so far.
    pub fn home_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("home-server.log")).unwrap_or_default()
    }

    pub fn bootstrap_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("bootstrap.log")).unwrap_or_default()
    }

    /// Both servers' logs, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- bootstrap ---\n{}\n--- home server ---\n{}",
            tail(&self.bootstrap_log()),
            tail(&self.home_log())
        )
    }

    /// Waits until the home server's log has a line containing `needle`.
    pub fn wait_home_log(&self, needle: &str, timeout: Duration) -> bool {
        let started = Instant::now();
        while started.elapsed() < timeout {
            if self.home_log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    }

    /// `corolla <args>` in home 2 (the client's home).
    pub fn client_command(&self, args: &[&str]) -> Command {
        let mut cmd = self.home2.command(corolla_bin());
        cmd.args(args)
            // The node's info lines say how each server was reached
            // (relayed, hole punched, or why not).
            .env("RUST_LOG", "warn,corolla_shared::node=info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// `corolla generate --json` in home 2 through the bootstrap: greedy,
    /// past end-of-sequence, spot checks off (no second replica exists).
    pub fn generate(
        &self,
        model: &Path,
        prompt: &str,
        new_tokens: usize,
        extra: &[&str],
    ) -> Result<Generation, String> {
        let bootstrap = self.bootstrap_addr(2);
        let new_tokens = new_tokens.to_string();
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap_or_default(),
            "--initial-peers",
            &bootstrap,
            "--prompt",
            prompt,
            "--max-new-tokens",
            &new_tokens,
            "--ignore-eos",
            "--json",
            "--spot-check",
            "0",
        ];
        args.extend_from_slice(extra);
        let started = Instant::now();
        let child = self
            .client_command(&args)
            .spawn()
            .map_err(|e| format!("cannot run corolla: {e}"))?;
        WanWorld::wait_generation(child, started)
    }

    /// `corolla swarm --json` in home 2: the records the client sees.
    pub fn swarm_json(&self, model: &Path) -> Result<serde_json::Value, String> {
        let bootstrap = self.bootstrap_addr(2);
        let out = self
            .client_command(&[
                "swarm",
                "--model",
                model.to_str().unwrap_or_default(),
                "--initial-peers",
                &bootstrap,
                "--json",
            ])
            .output()
            .map_err(|e| format!("cannot run corolla: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        serde_json::from_slice(&out.stdout).map_err(|e| {
            format!(
                "bad JSON from corolla swarm ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// Whether the client's home can open a TCP connection to `addr`
    /// (`ip:port`) within a second.
    pub fn client_can_connect(&self, addr: &str) -> bool {
        self.home2
            .command("timeout")
            .args([
                "2",
                "bash",
                "-c",
                &format!("exec 3<>/dev/tcp/{}", addr.replace(':', "/")),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// The internet's namespace (the bootstrap's).
    pub fn inet(&self) -> &Namespace {
        &self.inet
    }
}

/// Server logs at this level: the reachability lines the tests wait for
/// are `info` from the shared crate.
const LOG_LEVEL: &str = "warn,corolla_shared=info";

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// The model the NAT world serves: the tiny fixture (4 blocks), small
/// enough that a relayed answer takes seconds.
pub fn nat_model() -> PathBuf {
    crate::tiny_llama()
}
