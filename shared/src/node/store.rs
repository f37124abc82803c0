//! Records other nodes ask this one to store: only a correctly signed server
//! record, under the key of the peer it names, newer than the copy held.

use libp2p::kad::store::RecordStore;
use libp2p::kad::Record;
use libp2p::PeerId;

use super::lookup::server_dht_key;
use super::Node;
use crate::record::ServerRecord;

impl Node {
    /// Another node asks this one to store a record: only a correctly signed
    /// server record under its own peer's key, newer than the one held.
    pub(super) fn on_inbound_record(&mut self, source: PeerId, record: Record) {
        let checked = check_stored_record(&record).and_then(|r| {
            let held = self
                .swarm
                .behaviour_mut()
                .kad
                .store_mut()
                .get(&record.key)
                .and_then(|old| ServerRecord::from_signed_bytes(&old.value, None).ok());
            match held {
                Some(old) if old.published_at_ms >= r.published_at_ms => {
                    Err("not newer than the record held".to_string())
                }
                _ => Ok(()),
            }
        });
        match checked {
            Ok(()) => {
                if let Err(e) = self.swarm.behaviour_mut().kad.store_mut().put(record) {
                    tracing::debug!(error = %e, "cannot store a record");
                }
            }
            Err(why) => tracing::debug!(%source, %why, "refused a record"),
        }
    }
}

/// A record another node asks this one to store, checked: a signed server
/// record stored under the key of the peer it names.
fn check_stored_record(record: &Record) -> Result<ServerRecord, String> {
    let r = ServerRecord::from_signed_bytes(&record.value, None).map_err(|e| e.to_string())?;
    let peer: PeerId = r.peer_id.parse().map_err(|_| "bad peer id".to_string())?;
    if record.key != server_dht_key(&peer) {
        return Err(format!("stored under another key than {peer}'s"));
    }
    Ok(r)
}
