//! The web chat in Debian's headless Chromium (driven by
//! `tests/browser/chat.mjs`), for the browser tests and the benchmark; the
//! servers it talks to run in a [`crate::netns::NetnsSwarm`]. Also the
//! servers' swarm monitor page (`tests/browser/monitor.mjs`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

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
    let missing = chromium_missing().or_else(|| {
        (!web_dist().join("corolla-wasm_bg.wasm").is_file())
            .then(|| "the web page is not built (trunk build)".into())
    });
    if let Some(why) = &missing {
        assert!(!browser_required(), "browser tests required, but {why}");
    }
    missing
}

/// Why Chromium cannot be driven here, if it cannot (pages that need no
/// built web chat, like the swarm monitor, need only this).
pub fn chromium_missing() -> Option<String> {
    let missing = if !Path::new("/usr/bin/chromium").is_file() {
        Some("/usr/bin/chromium is not installed".to_string())
    } else if !repo_root()
        .join("tests/browser/node_modules/playwright-core")
        .is_dir()
    {
        Some("tests/browser/node_modules is missing (npm ci in tests/browser)".into())
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

    fn event(&self, name: &str) -> Option<&Value> {
        self.events.iter().find(|e| e["event"] == name)
    }

    /// What the page's client said about its model (`info()`).
    pub fn ready_info(&self) -> Option<&Value> {
        self.event("ready").map(|e| &e["info"])
    }

    /// The system prompt the page's element was given, if any.
    pub fn system(&self) -> Option<String> {
        self.event("ready")?["system"].as_str().map(str::to_string)
    }

    /// Whether the run failed before any token with only network-change
    /// errors on its page (see [`run_page_with`]).
    fn lost_to_a_network_change(&self) -> bool {
        let errors = self
            .event("page_errors")
            .and_then(|e| e["errors"].as_array())
            .filter(|errors| !errors.is_empty());
        !self.success
            && self.event("token").is_none()
            && errors.is_some_and(|errors| {
                errors.iter().all(|e| {
                    e.as_str()
                        .is_some_and(|e| e.contains("ERR_NETWORK_CHANGED"))
                })
            })
    }

    /// Whether the page fit its viewport's width (no sideways scrolling).
    pub fn fits_width(&self) -> bool {
        self.event("layout").is_some_and(|e| {
            matches!(
                (e["scroll_width"].as_u64(), e["viewport_width"].as_u64()),
                (Some(used), Some(available)) if used <= available
            )
        })
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
    on_first_token: impl FnMut(),
) -> PageRun {
    run_page_with(url, prompts, max_new_tokens, name, &[], on_first_token)
}

/// [`run_page`] with more of chat.mjs's options (`--stop-after-tokens N`,
/// `--viewport WxH`).
///
/// A run whose page lost a load to `ERR_NETWORK_CHANGED` before its first
/// token runs once more: the kernel removes an earlier test's namespace
/// (and its veth) in the background, seconds later, and Chromium aborts
/// its loads when it sees a link go; chat.mjs retries a navigation so, but
/// a module or a part of the model loading then fails as well.
pub fn run_page_with(
    url: &str,
    prompts: &[&str],
    max_new_tokens: usize,
    name: &str,
    options: &[&str],
    mut on_first_token: impl FnMut(),
) -> PageRun {
    let run = run_page_once(
        url,
        prompts,
        max_new_tokens,
        name,
        options,
        &mut on_first_token,
    );
    if !run.lost_to_a_network_change() {
        return run;
    }
    eprintln!("[browser] {name}: a load failed with ERR_NETWORK_CHANGED before any token; running the page again");
    run_page_once(
        url,
        prompts,
        max_new_tokens,
        name,
        options,
        &mut on_first_token,
    )
}

fn run_page_once(
    url: &str,
    prompts: &[&str],
    max_new_tokens: usize,
    name: &str,
    options: &[&str],
    on_first_token: &mut impl FnMut(),
) -> PageRun {
    let screenshot = artifacts_dir().join(format!("{name}.png"));
    let mut cmd = Command::new("node");
    cmd.arg(repo_root().join("tests/browser/chat.mjs"))
        .args(options)
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

/// Opens a server's swarm monitor (`url`, its `/monitor`) in Chromium through
/// `tests/browser/monitor.mjs`: waits for `servers` rows and `blocks`
/// segments at desktop and phone widths (light and dark), then a failed
/// refresh; screenshots `name-*.png` in the artifacts.
pub fn run_monitor_page(url: &str, servers: usize, blocks: usize, name: &str) -> PageRun {
    let out = Command::new("node")
        .arg(repo_root().join("tests/browser/monitor.mjs"))
        .args(["--url", url])
        .args(["--servers", &servers.to_string()])
        .args(["--blocks", &blocks.to_string()])
        .arg("--screenshot-dir")
        .arg(artifacts_dir())
        .args(["--name", name])
        .output()
        .expect("run node (is Node.js installed?)");
    PageRun {
        events: String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
        success: out.status.success(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
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
    native_chat_with(model, bootstrap, prompt, system, max_new_tokens, &[])
}

/// [`native_chat`] with more flags (such as `--adapter NAME`).
pub fn native_chat_with(
    model: &Path,
    bootstrap: &str,
    prompt: &str,
    system: Option<&str>,
    max_new_tokens: usize,
    extra: &[&str],
) -> Value {
    let mut cmd = Command::new(crate::corolla_bin());
    cmd.arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--initial-peers", bootstrap, "--chat", "--json"])
        .args(["--prompt", prompt])
        .args(["--max-new-tokens", &max_new_tokens.to_string()])
        .args(extra);
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
