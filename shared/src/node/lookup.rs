//! DHT lookups: the servers providing a model (at most
//! [`MAX_PROVIDERS_CHECKED`], answered with what was found when time is up)
//! and one server's record (the newest of a few valid copies).

use std::collections::HashSet;
use std::time::Duration;

use futures::channel::oneshot;
use libp2p::kad::{GetProvidersOk, GetRecordOk, QueryId, QueryResult, RecordKey};
use libp2p::PeerId;
use web_time::Instant;

use super::{Node, NodeError};
use crate::record::{RecordError, ServerRecord};

/// The DHT key holding one server's record.
pub fn server_dht_key(peer: &PeerId) -> RecordKey {
    RecordKey::new(&format!("/corolla/server/{peer}"))
}

/// Most servers of one model whose records one lookup checks: providers are
/// cheap to announce, so a flood of them must not cost a client more.
pub const MAX_PROVIDERS_CHECKED: usize = 64;

pub(super) struct ProviderLookup {
    reply: oneshot::Sender<Result<HashSet<PeerId>, NodeError>>,
    found: HashSet<PeerId>,
    deadline: Instant,
}

pub(super) struct RecordLookup {
    peer: PeerId,
    reply: oneshot::Sender<Result<ServerRecord, NodeError>>,
    /// Why the records found so far were refused.
    refused: Option<RecordError>,
    /// The newest valid copy so far, how many valid copies were seen, and
    /// when the lookup answers with it at the latest.
    newest: Option<(ServerRecord, usize, Instant)>,
}

/// Valid copies of a record after which a lookup answers with the newest.
const RECORD_COPIES_COMPARED: usize = 3;
/// How long a lookup that found one valid copy waits for newer ones: nodes
/// that missed a re-announcement still hold the older copy.
const RECORD_GRACE: Duration = Duration::from_millis(300);

impl Node {
    pub(super) fn start_provider_lookup(
        &mut self,
        key: RecordKey,
        timeout: Duration,
        reply: oneshot::Sender<Result<HashSet<PeerId>, NodeError>>,
    ) {
        let id = self.swarm.behaviour_mut().kad.get_providers(key);
        let lookup = ProviderLookup {
            reply,
            found: HashSet::new(),
            deadline: Instant::now() + timeout,
        };
        self.providers.insert(id, lookup);
    }

    pub(super) fn start_record_lookup(
        &mut self,
        peer: PeerId,
        reply: oneshot::Sender<Result<ServerRecord, NodeError>>,
    ) {
        let id = self
            .swarm
            .behaviour_mut()
            .kad
            .get_record(server_dht_key(&peer));
        let lookup = RecordLookup {
            peer,
            reply,
            refused: None,
            newest: None,
        };
        self.records.insert(id, lookup);
    }

    /// Ends provider lookups whose time is up (a lookup can wait long on
    /// peers that died without closing their connections, and what it found
    /// before that is the answer) and record lookups whose grace is over.
    pub(super) fn expire_lookups(&mut self, now: Instant) {
        let expired: Vec<QueryId> = self
            .providers
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some(lookup) = self.providers.remove(&id) {
                let _ = lookup.reply.send(Ok(lookup.found));
            }
            if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                q.finish();
            }
        }
        let settled: Vec<QueryId> = self
            .records
            .iter()
            .filter(|(_, l)| l.newest.as_ref().is_some_and(|(_, _, until)| *until <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in settled {
            self.answer_record_lookup(id);
        }
    }

    /// Answers a record lookup with the newest valid copy found (or why none
    /// was), and ends its query.
    fn answer_record_lookup(&mut self, id: QueryId) {
        if let Some(lookup) = self.records.remove(&id) {
            let answer = match (lookup.newest, lookup.refused) {
                (Some((record, _, _)), _) => Ok(record),
                (None, Some(e)) => Err(NodeError::Record(e)),
                (None, None) => Err(NodeError::Lookup("record not found".into())),
            };
            let _ = lookup.reply.send(answer);
        }
        if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id) {
            q.finish();
        }
    }

    pub(super) fn on_query(&mut self, id: QueryId, result: QueryResult, last: bool) {
        match result {
            QueryResult::GetProviders(result) => {
                if let Some(lookup) = self.providers.get_mut(&id) {
                    if let Ok(GetProvidersOk::FoundProviders { providers, .. }) = &result {
                        admit_providers(&mut lookup.found, providers, self.allowed_peers.as_ref());
                    }
                }
                if last {
                    if let Some(lookup) = self.providers.remove(&id) {
                        // A lookup that found nobody in a reachable DHT is
                        // an empty answer, not a failure.
                        let _ = lookup.reply.send(Ok(lookup.found));
                    }
                }
            }
            QueryResult::GetRecord(result) => {
                if let (Ok(GetRecordOk::FoundRecord(found)), Some(lookup)) =
                    (result, self.records.get_mut(&id))
                {
                    // A copy from a node that stored garbage does not end
                    // the lookup: another may hold the real one.
                    match ServerRecord::from_signed_bytes(&found.record.value, Some(&lookup.peer)) {
                        Ok(record) => {
                            let (newest, copies, until) = match lookup.newest.take() {
                                Some((old, n, until))
                                    if old.published_at_ms >= record.published_at_ms =>
                                {
                                    (old, n + 1, until)
                                }
                                Some((_, n, until)) => (record, n + 1, until),
                                None => (record, 1, Instant::now() + RECORD_GRACE),
                            };
                            lookup.newest = Some((newest, copies, until));
                            if copies >= RECORD_COPIES_COMPARED {
                                self.answer_record_lookup(id);
                            }
                        }
                        Err(e) => lookup.refused = Some(e),
                    }
                }
                if last {
                    self.answer_record_lookup(id);
                }
            }
            QueryResult::PutRecord(_) => self.on_record_stored(id),
            _ => {}
        }
    }
}

/// Adds the `providers` one answer of a lookup named to those it `found`,
/// only `allowed` ones in a private swarm, until [`MAX_PROVIDERS_CHECKED`]
/// are found: however many a flood of announcements puts in the DHT, a
/// lookup checks no more records than that.
fn admit_providers(
    found: &mut HashSet<PeerId>,
    providers: &HashSet<PeerId>,
    allowed: Option<&HashSet<PeerId>>,
) {
    let room = MAX_PROVIDERS_CHECKED.saturating_sub(found.len());
    let new = providers
        .iter()
        .filter(|p| !found.contains(*p))
        .filter(|p| allowed.is_none_or(|a| a.contains(*p)))
        .take(room)
        .copied()
        .collect::<Vec<_>>();
    found.extend(new);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize) -> HashSet<PeerId> {
        (0..n).map(|_| PeerId::random()).collect()
    }

    #[test]
    fn a_flood_of_providers_is_checked_up_to_the_cap() {
        let mut found = HashSet::new();
        let flood = peers(100);
        admit_providers(&mut found, &flood, None);
        assert_eq!(found.len(), MAX_PROVIDERS_CHECKED);
        assert!(found.is_subset(&flood));
        // Later answers of the same lookup add nobody.
        admit_providers(&mut found, &peers(50), None);
        assert_eq!(found.len(), MAX_PROVIDERS_CHECKED);
    }

    #[test]
    fn answers_naming_known_providers_again_leave_room_for_new_ones() {
        let mut found = HashSet::new();
        let first = peers(40);
        admit_providers(&mut found, &first, None);
        // Forty named again and thirty new: the forty cost no room.
        let mut second = first.clone();
        second.extend(peers(30));
        admit_providers(&mut found, &second, None);
        assert_eq!(found.len(), MAX_PROVIDERS_CHECKED);
        assert!(first.is_subset(&found));
    }

    #[test]
    fn a_private_swarm_admits_only_its_peers() {
        let members = peers(3);
        let mut strangers = peers(80);
        strangers.extend(members.iter().copied());
        let mut found = HashSet::new();
        admit_providers(&mut found, &strangers, Some(&members));
        assert_eq!(found, members);
    }
}
