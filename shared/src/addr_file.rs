//! The file `corolla-server --addr-file` writes once it serves: how the
//! demo, scripts and tests learn a server's peer id and addresses without
//! parsing its log.

use std::path::{Path, PathBuf};

use libp2p::Multiaddr;
use serde::{Deserialize, Serialize};

/// What a ready server wrote to its `--addr-file` (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddrFile {
    pub peer_id: String,
    /// Its listen addresses, each with `/p2p/<peer_id>`.
    pub addrs: Vec<String>,
    /// The model's name in the DHT.
    pub model: String,
    /// The blocks `[start, end)` it serves.
    pub start: usize,
    pub end: usize,
    /// `http://HOST:PORT` with `--http-port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
}

/// Why an address file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum AddrFileError {
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a server's address file: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

impl AddrFile {
    /// Writes the file whole or not at all (through a `.partial` file and a
    /// rename), so whoever polls for it never reads half of it.
    pub fn write(&self, path: &Path) -> Result<(), AddrFileError> {
        let write = |source| AddrFileError::Write {
            path: path.to_path_buf(),
            source,
        };
        let json = serde_json::to_vec_pretty(self).map_err(|e| write(e.into()))?;
        let partial = path.with_extension("partial");
        std::fs::write(&partial, json).map_err(write)?;
        std::fs::rename(&partial, path).map_err(write)
    }

    pub fn read(path: &Path) -> Result<Self, AddrFileError> {
        let text = std::fs::read(path).map_err(|source| AddrFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| AddrFileError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The first plain TCP address (not WebSocket): what another native
    /// node bootstraps from.
    pub fn tcp_addr(&self) -> Option<Multiaddr> {
        self.addrs
            .iter()
            .filter(|a| a.contains("/tcp/") && !a.contains("/ws"))
            .find_map(|a| a.parse().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_files_read_back_and_name_their_tcp_address() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.json");
        let peer = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";
        let file = AddrFile {
            peer_id: peer.into(),
            addrs: vec![
                format!("/ip4/127.0.0.1/tcp/4002/ws/p2p/{peer}"),
                format!("/ip4/127.0.0.1/tcp/4001/p2p/{peer}"),
            ],
            model: "tiny".into(),
            start: 0,
            end: 2,
            http: None,
        };
        file.write(&path).unwrap();
        assert!(!path.with_extension("partial").exists());
        let read = AddrFile::read(&path).unwrap();
        assert_eq!(read, file);
        assert_eq!(
            read.tcp_addr().map(|a| a.to_string()),
            Some(format!("/ip4/127.0.0.1/tcp/4001/p2p/{peer}"))
        );
        std::fs::write(&path, b"{\"peer_id\": 3}").unwrap();
        assert!(matches!(
            AddrFile::read(&path),
            Err(AddrFileError::Parse { .. })
        ));
    }
}
