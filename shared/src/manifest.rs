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

/// A tensor of the client part kept in a file of its own, its stored
/// bytes only, so a page can stream it straight into its storage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorFile {
    /// One of `files`.
    pub file: String,
    /// The stored type, as llama.cpp names it (`q4_k`, `q6_k`, `f16`, …).
    pub dtype: String,
    /// `[rows, columns]`.
    pub shape: Vec<u64>,
}

/// The embedding table, which a page does not download: it fetches the
/// rows it needs with HTTP range requests and checks each against its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowsFile {
    /// Served beside the others but not one of `files`.
    pub file: String,
    pub size: u64,
    pub dtype: String,
    pub rows: u64,
    pub hidden: u64,
    /// Row `i` is bytes `i * row_bytes .. (i + 1) * row_bytes` of `file`.
    pub row_bytes: u64,
    /// One of `files`: the 32-byte SHA-256 of each row, in order.
    pub digests: String,
}

/// Rows and columns beyond these are no model's (152064 and 8192 today).
pub const MAX_ROWS: u64 = 1 << 22;
pub const MAX_HIDDEN: u64 = 1 << 17;

/// Every file of the client part but the manifest itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientManifest {
    pub model: String,
    pub files: Vec<ClientFile>,
    /// An untied quantized model's LM head, apart from the client file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lm_head: Option<TensorFile>,
    /// An untied quantized model's embedding table, fetched by rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_rows: Option<RowsFile>,
}

fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
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
            if !plain_name(&file.name) {
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
        manifest.check_split()?;
        Ok(manifest)
    }

    pub fn file(&self, name: &str) -> Option<&ClientFile> {
        self.files.iter().find(|f| f.name == name)
    }

    fn check_split(&self) -> Result<(), String> {
        if let Some(head) = &self.lm_head {
            if self.file(&head.file).is_none() {
                return Err(format!("lm_head {:?} is not one of the files", head.file));
            }
            let [rows, columns] = head.shape[..] else {
                return Err("lm_head must have two dimensions".into());
            };
            if rows == 0 || rows > MAX_ROWS || columns == 0 || columns > MAX_HIDDEN {
                return Err(format!("lm_head of {rows}x{columns} is out of bounds"));
            }
        }
        if let Some(rows) = &self.embedding_rows {
            if !plain_name(&rows.file) || self.file(&rows.file).is_some() {
                return Err(format!(
                    "embedding rows {:?} must be a plain name outside the files",
                    rows.file
                ));
            }
            if rows.rows == 0
                || rows.rows > MAX_ROWS
                || rows.hidden == 0
                || rows.hidden > MAX_HIDDEN
                || rows.row_bytes == 0
                || rows.row_bytes > 4 * rows.hidden
                || rows.rows.checked_mul(rows.row_bytes) != Some(rows.size)
            {
                return Err(format!(
                    "embedding rows: {} rows of {} bytes ({} values) in {} bytes do not add up",
                    rows.rows, rows.row_bytes, rows.hidden, rows.size
                ));
            }
            match self.file(&rows.digests) {
                Some(d) if d.size == rows.rows * 32 => {}
                _ => {
                    return Err(format!(
                        "embedding row digests {:?} must be a file of 32 bytes per row",
                        rows.digests
                    ))
                }
            }
        }
        Ok(())
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

    #[test]
    fn split_tensors_must_add_up() {
        let sha = "a".repeat(64);
        let manifest = |rows_size: u64, digests_size: u64| {
            format!(
                r#"{{"model":"m","files":[
                {{"name":"lm_head.bin","size":10,"sha256":"{sha}"}},
                {{"name":"embeddings.sha256","size":{digests_size},"sha256":"{sha}"}}],
                "lm_head":{{"file":"lm_head.bin","dtype":"q4_k","shape":[4,256]}},
                "embedding_rows":{{"file":"embeddings.bin","size":{rows_size},"dtype":"q4_k",
                "rows":4,"hidden":256,"row_bytes":144,"digests":"embeddings.sha256"}}}}"#
            )
        };
        let good = ClientManifest::parse(manifest(576, 128).as_bytes()).unwrap();
        assert_eq!(good.embedding_rows.unwrap().row_bytes, 144);
        for bad in [
            manifest(575, 128),
            manifest(576, 96),
            manifest(576, 128).replace(r#""file":"embeddings.bin""#, r#""file":"../x""#),
            manifest(576, 128).replace(r#""file":"lm_head.bin""#, r#""file":"other.bin""#),
            manifest(576, 128).replace("[4,256]", "[4]"),
        ] {
            assert!(ClientManifest::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
