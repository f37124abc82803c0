//! What one `corolla generate --json` run answered (tokens, timings, the
//! route, recoveries), the local reference run, and the wire-shaped model
//! both run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::corolla_bin;

/// What `corolla generate --json` answered, and how long it took.
#[derive(Debug, Clone)]
pub struct Generation {
    pub json: Value,
    pub generated_ids: Vec<u32>,
    pub prefill_seconds: f64,
    pub total_seconds: f64,
    /// The command's whole run, start-up and discovery included.
    pub wall: Duration,
    /// What the command logged (stderr), for a failing test's message.
    pub log: String,
}

impl Generation {
    fn parse(stdout: &[u8], stderr: &[u8], wall: Duration) -> Result<Generation, String> {
        let text = String::from_utf8_lossy(stdout);
        let line = text
            .lines()
            .rev()
            .find(|l| l.trim_start().starts_with('{'))
            .ok_or_else(|| format!("no JSON in the output: {text}"))?;
        let json: Value =
            serde_json::from_str(line).map_err(|e| format!("bad JSON ({e}): {line}"))?;
        let generated_ids = json["generated_ids"]
            .as_array()
            .ok_or_else(|| format!("no generated_ids: {line}"))?
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect();
        Ok(Generation {
            generated_ids,
            prefill_seconds: json["prefill_seconds"].as_f64().unwrap_or(0.0),
            total_seconds: json["total_seconds"].as_f64().unwrap_or(0.0),
            json,
            wall,
            log: String::from_utf8_lossy(stderr).into_owned(),
        })
    }

    /// Time per token after the first (which the prefill gives).
    pub fn decode_ms_per_token(&self) -> f64 {
        let steps = self.generated_ids.len().saturating_sub(1).max(1);
        (self.total_seconds - self.prefill_seconds) * 1e3 / steps as f64
    }

    /// Time per chain step after the prefill: one trip down the route,
    /// which may yield several tokens when the client drafts. Clients
    /// that do not report `steps` take one step per token.
    pub fn decode_ms_per_step(&self) -> f64 {
        let steps = self.json["steps"]
            .as_u64()
            .map_or(self.generated_ids.len().saturating_sub(1), |s| s as usize);
        (self.total_seconds - self.prefill_seconds) * 1e3 / steps.max(1) as f64
    }

    /// Decode tokens per second (the prefill left out).
    pub fn decode_tokens_per_second(&self) -> f64 {
        1e3 / self.decode_ms_per_token().max(1e-9)
    }

    /// The route's hops: `(peer id, start, end)`.
    pub fn route(&self) -> Vec<(String, usize, usize)> {
        self.json["route"]
            .as_array()
            .map(|hops| {
                hops.iter()
                    .map(|h| {
                        (
                            h["peer_id"].as_str().unwrap_or_default().to_string(),
                            h["start"].as_u64().unwrap_or(0) as usize,
                            h["end"].as_u64().unwrap_or(0) as usize,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn recoveries(&self) -> Vec<Value> {
        self.json["recoveries"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

pub(super) fn finish(out: std::process::Output, wall: Duration) -> Result<Generation, String> {
    if !out.status.success() {
        return Err(format!(
            "corolla generate failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Generation::parse(&out.stdout, &out.stderr, wall)
}

/// `corolla generate --local --json` on this host: the reference answer.
pub fn generate_local(model: &Path, prompt: &str, new_tokens: usize) -> Result<Generation, String> {
    let started = Instant::now();
    let out = Command::new(corolla_bin())
        .arg("generate")
        .arg("--model")
        .arg(model)
        .arg("--local")
        .args(["--prompt", prompt])
        .args(["--max-new-tokens", &new_tokens.to_string()])
        .args(["--ignore-eos", "--json"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run corolla: {e}"))?;
    finish(out, started.elapsed())
}

/// Writes the wire-shaped model
/// ([`corolla_model::random_gguf::RandomGguf::wire_shaped`]) of `layers`
/// layers into `dir`.
pub fn write_wire_model(dir: &Path, layers: usize) -> PathBuf {
    use corolla_model::random_gguf::{write_random_gguf, RandomGguf};
    let path = dir.join(format!("wire-shaped-{layers}l.gguf"));
    write_random_gguf(&path, &RandomGguf::wire_shaped(layers, 11), |_, _| {})
        .expect("write the wire-shaped model");
    path
}
