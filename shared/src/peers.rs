//! Peers users name: lists of peer ids (`--allowed-peers`, inline ids or
//! files holding one per line) and initial peers' addresses, which must end
//! in the peer's id.

use std::collections::HashSet;
use std::path::Path;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};

/// An initial peer's address without the `/p2p/<peer id>` it needs.
#[derive(Debug, thiserror::Error)]
#[error("initial peer {addr} must end in /p2p/<peer id>")]
pub struct NoPeerId {
    pub addr: Multiaddr,
}

/// An initial peer's address split into its peer id and where to dial it.
pub fn split_peer(addr: &Multiaddr) -> Result<(PeerId, Multiaddr), NoPeerId> {
    let mut base = addr.clone();
    match base.pop() {
        Some(Protocol::P2p(peer)) => Ok((peer, base)),
        _ => Err(NoPeerId { addr: addr.clone() }),
    }
}

/// Most peer ids read from one file.
const MAX_LISTED: usize = 100_000;

/// Peer ids from `items`: each a peer id, or the path of a file with one
/// per line (blank lines and `#` comments skipped). `None` for no items.
pub fn parse_peer_list(items: &[String]) -> Result<Option<HashSet<PeerId>>, String> {
    let items: Vec<&str> = items
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Ok(None);
    }
    let mut peers = HashSet::new();
    for item in items {
        if let Ok(peer) = item.parse::<PeerId>() {
            peers.insert(peer);
            continue;
        }
        let path = Path::new(item);
        if !path.is_file() {
            return Err(format!(
                "{item:?} is neither a peer id nor a file of peer ids"
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let peer = line
                .parse::<PeerId>()
                .map_err(|_| format!("{}:{}: {line:?} is not a peer id", path.display(), n + 1))?;
            if peers.len() >= MAX_LISTED {
                return Err(format!("more than {MAX_LISTED} peer ids"));
            }
            peers.insert(peer);
        }
    }
    Ok(Some(peers))
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_initial_peer_splits_into_its_id_and_address() {
        let peer = PeerId::random();
        let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/4001/p2p/{peer}")
            .parse()
            .unwrap();
        let (id, base) = super::split_peer(&addr).unwrap();
        assert_eq!(
            (id, base.to_string()),
            (peer, "/ip4/127.0.0.1/tcp/4001".to_string())
        );
        let bare: Multiaddr = "/ip4/127.0.0.1/tcp/4001".parse().unwrap();
        let err = super::split_peer(&bare).unwrap_err();
        assert_eq!(
            err.to_string(),
            "initial peer /ip4/127.0.0.1/tcp/4001 must end in /p2p/<peer id>"
        );
    }

    use super::*;

    #[test]
    fn ids_inline_and_in_files() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let dir = std::env::temp_dir().join(format!("corolla-peers-{}", std::process::id()));
        std::fs::write(&dir, format!("# servers\n{b}\n\n")).unwrap();
        let got = parse_peer_list(&[a.to_string(), dir.display().to_string()])
            .unwrap()
            .unwrap();
        assert_eq!(got, HashSet::from([a, b]));
        assert_eq!(parse_peer_list(&[]).unwrap(), None);
        assert!(parse_peer_list(&["nonsense".into()]).is_err());
        std::fs::write(&dir, "garbage\n").unwrap();
        let err = parse_peer_list(&[dir.display().to_string()]).unwrap_err();
        assert!(err.contains(":1:"), "{err}");
        let _ = std::fs::remove_file(&dir);
    }
}
