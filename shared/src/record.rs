//! What a server tells about itself: the answer of the info protocol.

use serde::{Deserialize, Serialize};

/// Largest encoded record accepted.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerRecord {
    pub peer_id: String,
    /// The model's name in the DHT.
    pub model: String,
    /// Hash of the whole model's config and weights, when this server can
    /// know it (empty otherwise).
    pub fingerprint: String,
    /// Hashes of the blocks this server holds, `start..end` in order; a
    /// client chains only servers whose hashes match the model it expects.
    #[serde(default)]
    pub block_hashes: Vec<String>,
    pub start: u32,
    pub end: u32,
    pub num_layers: u32,
    pub hidden_size: u32,
    /// Decode tokens per second through this server's span, measured at start-up.
    pub throughput: f64,
    /// Prefill tokens per second through this server's span.
    pub prefill_throughput: f64,
    pub cache_tokens_left: u64,
    pub max_length: u32,
    pub sessions: u32,
    pub max_sessions: u32,
    pub dtype: String,
    pub version: String,
    pub addresses: Vec<String>,
}

impl ServerRecord {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() > MAX_RECORD_BYTES {
            return Err(format!("record of {} bytes is too large", bytes.len()));
        }
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }
}
