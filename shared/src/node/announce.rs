//! A server's announcement: a provider entry under the model's key plus its
//! signed [`ServerRecord`] under its own key, re-published every period and
//! expiring after two; and the last record of a server that leaves.

use std::time::Duration;

use futures::channel::oneshot;
use libp2p::kad::{QueryId, Quorum, Record};
use web_time::Instant;

use super::lookup::server_dht_key;
use super::Node;
use crate::protocol::model_dht_key;
use crate::record::ServerRecord;
use crate::time::unix_millis;

/// How long a leaving server waits for its last record to be stored.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(3);

/// The live fields of a server's record (sessions, free cache), read at
/// every announcement.
pub type LiveFigures = std::sync::Arc<dyn Fn(&mut ServerRecord) + Send + Sync>;

/// What a server publishes about itself.
#[derive(Clone)]
pub struct Announcement {
    pub record: ServerRecord,
    pub period: Duration,
    /// Fills in the record's live fields before each announcement.
    pub live: Option<LiveFigures>,
}

impl std::fmt::Debug for Announcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcement")
            .field("record", &self.record)
            .field("period", &self.period)
            .field("live", &self.live.is_some())
            .finish()
    }
}

impl Node {
    pub(super) fn announce(&mut self) {
        let Some(a) = &self.announcement else {
            self.next_announce.reset(Duration::from_secs(3600));
            return;
        };
        let period = a.period;
        let mut record = a.record.clone();
        if let Some(live) = &a.live {
            live(&mut record);
        }
        #[cfg(feature = "native")]
        {
            record.reachability = self.reach.status;
        }
        record.addresses = self
            .swarm
            .external_addresses()
            .map(|addr| {
                addr.clone()
                    .with_p2p(self.swarm.local_peer_id().to_owned())
                    .unwrap_or_else(|a| a)
                    .to_string()
            })
            .collect();
        let kad = &mut self.swarm.behaviour_mut().kad;
        if let Err(e) = kad.start_providing(model_dht_key(&record.model)) {
            tracing::warn!(error = %e, "cannot announce the model in the DHT");
        }
        self.publish(&mut record, period * 2);
        tracing::debug!(model = %record.model, start = record.start, end = record.end, "announced");
        self.next_announce.reset(period);
    }

    /// Signs `record` (stamped now) and stores it under this server's key,
    /// here and at the closest peers; returns the query.
    fn publish(&mut self, record: &mut ServerRecord, ttl: Duration) -> Option<QueryId> {
        let Some(key) = &self.signer else {
            tracing::warn!("a node without a signing key cannot publish records");
            return None;
        };
        record.published_at_ms = unix_millis();
        let bytes = match record.sign(key) {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(error = %e, "cannot sign the server record");
                return None;
            }
        };
        let mut dht_record = Record::new(server_dht_key(self.swarm.local_peer_id()), bytes);
        dht_record.expires = Some(Instant::now() + ttl);
        let kad = &mut self.swarm.behaviour_mut().kad;
        // Every closest peer gets the new copy: with a quorum of one, the
        // query ends at the first acknowledgement and the others keep
        // serving the old record to clients.
        match kad.put_record(dht_record, Quorum::All) {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::warn!(error = %e, "cannot publish the server record in the DHT");
                None
            }
        }
    }

    /// The last announcement: the record says the server leaves, and the
    /// model's provider entry is withdrawn here (others expire theirs).
    pub(super) fn leave(&mut self, reply: oneshot::Sender<()>) {
        let Some(a) = self.announcement.take() else {
            let _ = reply.send(());
            return;
        };
        self.next_announce.reset(Duration::from_secs(3600));
        let mut record = a.record;
        record.leaving = true;
        record.addresses.clear();
        self.swarm
            .behaviour_mut()
            .kad
            .stop_providing(&model_dht_key(&record.model));
        let query = self.publish(&mut record, a.period * 2);
        self.leaving = Some((query, reply, Instant::now() + LEAVE_TIMEOUT));
    }

    /// Answers a leaving server once its last record's time is up, stored or not.
    pub(super) fn expire_leaving(&mut self, now: Instant) {
        if self
            .leaving
            .as_ref()
            .is_some_and(|(_, _, until)| *until <= now)
        {
            if let Some((_, reply, _)) = self.leaving.take() {
                let _ = reply.send(());
            }
        }
    }

    /// A record was stored at the closest peers: a leaving server's last one
    /// lets it go.
    pub(super) fn on_record_stored(&mut self, id: QueryId) {
        if self
            .leaving
            .as_ref()
            .is_some_and(|(query, _, _)| *query == Some(id))
        {
            if let Some((_, reply, _)) = self.leaving.take() {
                let _ = reply.send(());
            }
        }
    }

    /// Publishes the record now rather than at the next period.
    #[cfg(feature = "native")]
    pub(super) fn announce_now(&mut self) {
        if self.announcement.is_some() {
            self.announce();
        }
    }
}
