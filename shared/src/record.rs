//! What a server tells about itself: the answer of the info protocol and,
//! signed by the server's peer key, its entry in the DHT. A signed record
//! names its peer, carries that peer's public key and is checked against
//! both, so nobody else can write or alter a server's entry.

use libp2p::identity::{Keypair, PublicKey};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

/// Largest encoded record accepted.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;
/// Largest signed record accepted: the record, hex-encoded key and signature.
pub const MAX_SIGNED_RECORD_BYTES: usize = 2 * MAX_RECORD_BYTES + 1024;
/// Signatures cover this prefix and the record's bytes, so that a signature
/// made for anything else never passes for a record.
const SIGNING_DOMAIN: &[u8] = b"corolla server record v1:";

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
    /// Cache positions this server holds as shared prompt beginnings
    /// (reused by any session that starts with the same inputs).
    #[serde(default)]
    pub prefix_tokens: u64,
    /// Names of the LoRA adapters a session may run with here (see
    /// [`crate::adapter_name`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    pub max_length: u32,
    pub sessions: u32,
    pub max_sessions: u32,
    pub dtype: String,
    pub version: String,
    pub addresses: Vec<String>,
    /// When the server signed this record, in milliseconds since the Unix
    /// epoch: a DHT node keeps the newest, so an old record cannot be replayed.
    #[serde(default)]
    pub published_at_ms: u64,
    /// The server's last word: it is leaving, route elsewhere.
    #[serde(default)]
    pub leaving: bool,
    /// The server chose its blocks itself and moves them where the swarm
    /// needs them (servers with fixed `--block-indices` do not).
    #[serde(default)]
    pub rebalances: bool,
    /// Whether others reach this server directly (AutoNAT's verdict); a
    /// private server is reached through the relays in its addresses.
    #[serde(default)]
    pub reachability: Reachability,
}

/// Whether a server answers from outside its network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reachability {
    /// Others reached it at an address it announces.
    Public,
    /// Others tried and failed: it is behind a NAT or firewall.
    Private,
    /// Nobody has tested it yet (or it runs no test).
    #[default]
    Unknown,
}

impl std::fmt::Display for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reachability::Public => "public",
            Reachability::Private => "private",
            Reachability::Unknown => "unknown",
        })
    }
}

/// A record with its signature, as stored in the DHT.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SignedRecord {
    /// The record's JSON, exactly as signed.
    record: String,
    /// The signer's public key, protobuf-encoded, in hex.
    public_key: String,
    signature: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record of {0} bytes is too large")]
    TooLarge(usize),
    #[error("malformed record: {0}")]
    Malformed(String),
    #[error("the record is not signed by the peer it names")]
    WrongSigner,
    #[error("bad signature")]
    BadSignature,
    #[error("the record names {named}, not {expected}")]
    OtherPeer { named: String, expected: String },
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

    /// This record signed with `key`, whose peer id it must name.
    pub fn sign(&self, key: &Keypair) -> Result<Vec<u8>, RecordError> {
        let record = String::from_utf8(self.to_bytes())
            .map_err(|e| RecordError::Malformed(e.to_string()))?;
        let signature = key
            .sign(&signing_input(record.as_bytes()))
            .map_err(|e| RecordError::Malformed(e.to_string()))?;
        let signed = SignedRecord {
            record,
            public_key: hex(&key.public().encode_protobuf()),
            signature: hex(&signature),
        };
        serde_json::to_vec(&signed).map_err(|e| RecordError::Malformed(e.to_string()))
    }

    /// Decodes a signed record and checks it: signed by the key of the peer
    /// it names, and (when given) naming `expected`.
    pub fn from_signed_bytes(bytes: &[u8], expected: Option<&PeerId>) -> Result<Self, RecordError> {
        if bytes.len() > MAX_SIGNED_RECORD_BYTES {
            return Err(RecordError::TooLarge(bytes.len()));
        }
        let signed: SignedRecord =
            serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed(e.to_string()))?;
        let record =
            ServerRecord::from_bytes(signed.record.as_bytes()).map_err(RecordError::Malformed)?;
        let key_bytes = unhex(&signed.public_key)
            .ok_or_else(|| RecordError::Malformed("public key is not hex".into()))?;
        let key = PublicKey::try_decode_protobuf(&key_bytes)
            .map_err(|e| RecordError::Malformed(e.to_string()))?;
        if key.to_peer_id().to_string() != record.peer_id {
            return Err(RecordError::WrongSigner);
        }
        let signature = unhex(&signed.signature)
            .ok_or_else(|| RecordError::Malformed("signature is not hex".into()))?;
        if !key.verify(&signing_input(signed.record.as_bytes()), &signature) {
            return Err(RecordError::BadSignature);
        }
        if let Some(expected) = expected {
            if record.peer_id != expected.to_string() {
                return Err(RecordError::OtherPeer {
                    named: record.peer_id,
                    expected: expected.to_string(),
                });
            }
        }
        Ok(record)
    }
}

fn signing_input(record: &[u8]) -> Vec<u8> {
    [SIGNING_DOMAIN, record].concat()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(peer: &PeerId) -> ServerRecord {
        let json = format!(
            r#"{{"peer_id":"{peer}","model":"m","fingerprint":"","start":0,"end":2,"num_layers":2,
            "hidden_size":8,"throughput":1.0,"prefill_throughput":1.0,"cache_tokens_left":1,"max_length":1,
            "sessions":0,"max_sessions":1,"dtype":"f32","version":"0","addresses":[]}}"#
        );
        ServerRecord::from_bytes(json.as_bytes()).unwrap()
    }

    #[test]
    fn only_the_named_peer_can_sign_its_record() {
        let honest = Keypair::generate_ed25519();
        let peer = honest.public().to_peer_id();
        let r = record(&peer);
        let signed = r.sign(&honest).unwrap();
        assert_eq!(
            ServerRecord::from_signed_bytes(&signed, Some(&peer)).unwrap(),
            r
        );

        // Another key signing the honest peer's record.
        let forger = Keypair::generate_ed25519();
        assert_eq!(
            ServerRecord::from_signed_bytes(&r.sign(&forger).unwrap(), Some(&peer)).unwrap_err(),
            RecordError::WrongSigner
        );
        // The honest signature over altered content.
        let mut forged: SignedRecord = serde_json::from_slice(&signed).unwrap();
        forged.record = forged.record.replace("\"end\":2", "\"end\":1");
        let forged = serde_json::to_vec(&forged).unwrap();
        assert_eq!(
            ServerRecord::from_signed_bytes(&forged, Some(&peer)).unwrap_err(),
            RecordError::BadSignature
        );
        // A valid record of someone else under this peer's key.
        let other = forger.public().to_peer_id();
        let theirs = record(&other).sign(&forger).unwrap();
        assert!(matches!(
            ServerRecord::from_signed_bytes(&theirs, Some(&peer)),
            Err(RecordError::OtherPeer { .. })
        ));
        // Unsigned records and garbage.
        assert!(ServerRecord::from_signed_bytes(&r.to_bytes(), Some(&peer)).is_err());
        assert!(ServerRecord::from_signed_bytes(b"\xff{", None).is_err());
        assert!(matches!(
            ServerRecord::from_signed_bytes(&vec![b' '; MAX_SIGNED_RECORD_BYTES + 1], None),
            Err(RecordError::TooLarge(_))
        ));
    }
}
