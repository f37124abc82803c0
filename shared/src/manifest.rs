//! The client part's manifest (`GET /model/manifest.json`): the files a
//! page downloads (config, tokenizer, embeddings, final norm, LM head) with
//! their sizes and SHA-256 digests. Servers write it; pages check it with
//! [`ClientManifest::parse`] before fetching anything it lists.

use serde::{Deserialize, Serialize};

/// A manifest is a short file list; anything larger is not one.
pub const MAX_MANIFEST_BYTES: usize = 1 << 20;
/// The most a page fetches in all: wasm32 memory ends at 4 GiB and the
/// head is expanded after download.
pub const MAX_PART_BYTES: u64 = 2 << 30;

/// One file of the client part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// Every file of the client part but the manifest itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientManifest {
    pub model: String,
    pub files: Vec<ClientFile>,
}

impl ClientManifest {
    /// Decodes and checks a manifest: plain file names (no paths, no
    /// dotfiles), 64-digit hex digests, and a total a page can hold.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(format!("{} bytes is too large for a manifest", bytes.len()));
        }
        let manifest: ClientManifest =
            serde_json::from_slice(bytes).map_err(|e| format!("not a model manifest: {e}"))?;
        let mut total = 0u64;
        for file in &manifest.files {
            let plain = !file.name.is_empty()
                && file.name.len() <= 255
                && !file.name.starts_with('.')
                && file
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
            if !plain {
                return Err(format!("{:?} is not a plain file name", file.name));
            }
            if file.sha256.len() != 64 || !file.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(format!("{}: bad SHA-256", file.name));
            }
            total = total.saturating_add(file.size);
        }
        if total > MAX_PART_BYTES {
            return Err(format!(
                "the client part is {total} bytes; a page can hold at most {MAX_PART_BYTES}"
            ));
        }
        Ok(manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_are_checked() {
        let sha = "a".repeat(64);
        let good = format!(
            r#"{{"model":"m","files":[{{"name":"config.json","size":10,"sha256":"{sha}"}}]}}"#
        );
        assert_eq!(
            ClientManifest::parse(good.as_bytes()).unwrap().files.len(),
            1
        );
        for bad in [
            good.replace("config.json", "../etc/passwd"),
            good.replace("config.json", ".hidden"),
            good.replace(&sha, "xyz"),
            good.replace("10", "99999999999"),
            "[]".to_string(),
        ] {
            assert!(ClientManifest::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
