//! A model's fingerprint: a hash of its config and weights that servers
//! announce, so that a client never chains spans of different models that
//! share a name.
//!
//! Hashing every weight of a 70B model would take minutes, so each tensor
//! contributes its name, dtype, shape and a sample of its bytes (the first,
//! middle and last 4 KiB): any two independently trained or fine-tuned
//! checkpoints differ there. `corolla convert` stores the source's
//! fingerprint in its index, so a server that downloaded only its blocks
//! still announces the fingerprint of the whole model.

use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::error::Result;

const SAMPLE: usize = 4096;

pub fn fingerprint(checkpoint: &Checkpoint) -> Result<String> {
    if let Some(fp) = checkpoint
        .corolla_index()
        .and_then(|i| i.fingerprint.clone())
    {
        return Ok(fp);
    }
    let mut hasher = Sha256::new();
    let config = serde_json::to_vec(checkpoint.config()).unwrap_or_default();
    hasher.update((config.len() as u64).to_le_bytes());
    hasher.update(&config);
    let mut names: Vec<&str> = checkpoint.tensor_names().collect();
    names.sort_unstable();
    for name in names {
        let raw = checkpoint.raw_tensor(name)?;
        hasher.update((name.len() as u64).to_le_bytes());
        hasher.update(name.as_bytes());
        hasher.update(format!("{:?}{:?}", raw.dtype, raw.shape).as_bytes());
        let data = raw.data();
        let mid = data.len() / 2;
        for range in [
            0..data.len().min(SAMPLE),
            mid.saturating_sub(SAMPLE / 2)..(mid + SAMPLE / 2).min(data.len()),
            data.len().saturating_sub(SAMPLE)..data.len(),
        ] {
            hasher.update(&data[range]);
        }
    }
    let digest = hasher.finalize();
    Ok(digest.iter().take(16).map(|b| format!("{b:02x}")).collect())
}

/// The model's default name in the DHT: the name stored by `corolla convert`,
/// else the model folder's name.
pub fn default_model_name(checkpoint: &Checkpoint) -> String {
    if let Some(name) = checkpoint
        .corolla_index()
        .and_then(|i| i.model_name.clone())
    {
        return name;
    }
    checkpoint
        .dir()
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}
