//! Telling weights apart: hashes that servers announce so that a client
//! never chains spans of different models that share a name.
//!
//! Each block has a hash of its tensors' names, dtypes, shapes and a sample
//! of their bytes (the first, middle and last 4 KiB; two independently
//! trained or fine-tuned checkpoints differ there), so a server can hash
//! what it holds without the rest of the model. A session names the blocks
//! it wants by [`span_hash`] of their block hashes, which the server checks
//! against its own. The model fingerprint combines the config, the client
//! part and every block. `corolla convert` stores all of these in its index,
//! so that a server or browser holding only a part still knows them.

use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};

const SAMPLE: usize = 4096;

fn hex(digest: &[u8]) -> String {
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

fn hash_tensors<'a>(
    checkpoint: &Checkpoint,
    names: impl Iterator<Item = &'a str>,
) -> Result<String> {
    let mut names: Vec<&str> = names.collect();
    names.sort_unstable();
    let mut hasher = Sha256::new();
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
    Ok(hex(&hasher.finalize()))
}

fn is_layer(name: &str, layer: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        == Some(layer)
}

/// Hashes of blocks `[start, end)` as loaded: the weights' hashes, marked
/// `+q` when quantized weights are kept quantized, since those blocks compute
/// (slightly) other numbers than the same weights dequantized. A client then
/// never chains servers that would answer differently from each other.
pub fn block_hashes(checkpoint: &Checkpoint, start: usize, end: usize) -> Result<Vec<String>> {
    let hashes = weight_hashes(checkpoint, start, end)?;
    if checkpoint.is_gguf() && !checkpoint.dequantizes() {
        return Ok(hashes
            .into_iter()
            .map(|h| format!("{h}{KEPT_QUANTIZED_MARK}"))
            .collect());
    }
    Ok(hashes)
}

/// What a block hash carries after the weights' hash when the server keeps
/// them quantized.
pub const KEPT_QUANTIZED_MARK: &str = "+q";

/// The weights' part of a block hash, whatever the server computes with.
pub fn weights_of(block_hash: &str) -> &str {
    block_hash
        .strip_suffix(KEPT_QUANTIZED_MARK)
        .unwrap_or(block_hash)
}

/// Whether a block hash says its server keeps the weights quantized.
pub fn keeps_quantized(block_hash: &str) -> bool {
    block_hash.ends_with(KEPT_QUANTIZED_MARK)
}

/// Hashes of the weights of blocks `[start, end)`, from the index when it has them.
pub fn weight_hashes(checkpoint: &Checkpoint, start: usize, end: usize) -> Result<Vec<String>> {
    checkpoint.check_layer_range(start, end)?;
    if let Some(hashes) = checkpoint
        .corolla_index()
        .and_then(|i| i.block_hashes.as_ref())
    {
        return hashes
            .get(start..end)
            .map(<[String]>::to_vec)
            .ok_or_else(|| {
                ModelError::invalid_file(
                    checkpoint.dir(),
                    "corolla-index.json lists too few block hashes",
                )
            });
    }
    (start..end)
        .map(|layer| {
            hash_tensors(
                checkpoint,
                checkpoint.tensor_names().filter(|n| is_layer(n, layer)),
            )
        })
        .collect()
}

/// What a session sends to name the weights of the blocks it opens.
pub fn span_hash(block_hashes: &[String]) -> String {
    let mut hasher = Sha256::new();
    for h in block_hashes {
        hasher.update(h.as_bytes());
        hasher.update(b"\n");
    }
    hex(&hasher.finalize())
}

/// The fingerprint of the whole model: config, client part and every block.
/// Needs every tensor, unless the checkpoint is a `corolla convert` output.
pub fn fingerprint(checkpoint: &Checkpoint) -> Result<String> {
    if let Some(fp) = checkpoint
        .corolla_index()
        .and_then(|i| i.fingerprint.clone())
    {
        return Ok(fp);
    }
    let config = serde_json::to_vec(checkpoint.config()).unwrap_or_default();
    let client = hash_tensors(
        checkpoint,
        checkpoint
            .tensor_names()
            .filter(|n| !n.starts_with("model.layers.")),
    )?;
    let blocks = weight_hashes(checkpoint, 0, checkpoint.config().num_hidden_layers)?;
    let mut hasher = Sha256::new();
    hasher.update((config.len() as u64).to_le_bytes());
    hasher.update(&config);
    hasher.update(client.as_bytes());
    hasher.update(span_hash(&blocks).as_bytes());
    Ok(hex(&hasher.finalize()))
}

/// The model's default name in the DHT: the name stored by `corolla convert`,
/// else the GGUF file's stem or the model folder's name.
pub fn default_model_name(checkpoint: &Checkpoint) -> String {
    if let Some(name) = checkpoint
        .corolla_index()
        .and_then(|i| i.model_name.clone())
    {
        return name;
    }
    if let Some(file) = checkpoint.single_file() {
        if let Some(stem) = file.file_stem() {
            return stem.to_string_lossy().into_owned();
        }
    }
    checkpoint
        .dir()
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}
