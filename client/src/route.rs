//! Choosing servers to cover every block, and running a session through them.

use std::time::Duration;

use corolla_model::fingerprint::span_hash;
use corolla_model::wire::{from_view, to_payload};
use corolla_model::{Device, Tensor};
use corolla_shared::node::NodeHandle;
use corolla_shared::protocol::OpenRequest;
use corolla_shared::session::RemoteSession;
use corolla_shared::{ServerRecord, WireDType};
use libp2p::PeerId;
use serde::Serialize;

use crate::error::ClientError;
use crate::generate::BlockChain;

/// One server in a chain and the blocks it runs for us.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hop {
    pub peer_id: String,
    pub start: usize,
    pub end: usize,
}

/// Blocks of `0..num_layers` that no record covers, as `[start, end)` ranges.
pub fn uncovered_blocks(records: &[ServerRecord], num_layers: usize) -> Vec<(usize, usize)> {
    let mut covered = vec![false; num_layers];
    for r in records {
        for c in covered
            .iter_mut()
            .take((r.end as usize).min(num_layers))
            .skip(r.start as usize)
        {
            *c = true;
        }
    }
    let mut gaps = Vec::new();
    let mut i = 0;
    while i < num_layers {
        if covered[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < num_layers && !covered[i] {
            i += 1;
        }
        gaps.push((start, i));
    }
    gaps
}

/// The fewest hops covering `0..num_layers`: from each boundary, the server
/// reaching farthest (ties broken by peer id, so the choice is stable).
pub fn plan_route(records: &[ServerRecord], num_layers: usize) -> Result<Vec<Hop>, ClientError> {
    let mut route = Vec::new();
    let mut position = 0;
    while position < num_layers {
        let best = records
            .iter()
            .filter(|r| (r.start as usize) <= position && (r.end as usize) > position)
            .max_by(|a, b| a.end.cmp(&b.end).then_with(|| b.peer_id.cmp(&a.peer_id)));
        let Some(r) = best else {
            return Err(ClientError::NoRoute {
                uncovered: uncovered_blocks(records, num_layers),
            });
        };
        let end = (r.end as usize).min(num_layers);
        route.push(Hop {
            peer_id: r.peer_id.clone(),
            start: position,
            end,
        });
        position = end;
    }
    Ok(route)
}

/// Keeps the servers whose block hashes are those of the model the client
/// expects (`expected[i]` for block `i`); with no expectation, keeps all.
pub fn matching_servers(
    records: Vec<ServerRecord>,
    expected: Option<&[String]>,
) -> Vec<ServerRecord> {
    let Some(expected) = expected else {
        return records;
    };
    records
        .into_iter()
        .filter(|r| {
            let ours = expected.get(r.start as usize..r.end as usize);
            let same = ours.is_some_and(|ours| ours == r.block_hashes.as_slice());
            if !same {
                tracing::warn!(peer = %r.peer_id, "ignoring a server with other weights under the same name");
            }
            same
        })
        .collect()
}

/// Settings of the sessions a client opens.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    pub model: String,
    /// Hashes of every block of the model the client expects, when it knows them.
    pub expected_blocks: Option<Vec<String>>,
    pub max_length: usize,
    pub dtype: WireDType,
    pub timeout: Duration,
}

/// A block chain whose spans run on remote servers, one session each.
pub struct RemoteChain {
    sessions: Vec<RemoteSession>,
    dtype: WireDType,
    device: Device,
}

impl RemoteChain {
    pub async fn open(
        node: &NodeHandle,
        route: &[Hop],
        settings: &SessionSettings,
        device: &Device,
    ) -> Result<Self, ClientError> {
        let mut control = node.control();
        let mut sessions = Vec::with_capacity(route.len());
        for hop in route {
            let peer: PeerId = hop
                .peer_id
                .parse()
                .map_err(|_| ClientError::Network(format!("bad peer id {}", hop.peer_id)))?;
            let request = OpenRequest {
                model: settings.model.clone(),
                fingerprint: settings
                    .expected_blocks
                    .as_ref()
                    .and_then(|h| h.get(hop.start..hop.end))
                    .map(span_hash)
                    .unwrap_or_default(),
                start: hop.start as u32,
                end: hop.end as u32,
                max_length: settings.max_length as u32,
                dtype: settings.dtype,
            };
            sessions
                .push(RemoteSession::open(&mut control, peer, request, settings.timeout).await?);
        }
        Ok(RemoteChain {
            sessions,
            dtype: settings.dtype,
            device: device.clone(),
        })
    }

    pub async fn close(self) {
        for s in self.sessions {
            s.close().await;
        }
    }
}

impl BlockChain for RemoteChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let mut payload = to_payload(&hidden, self.dtype)?;
        for session in &mut self.sessions {
            payload = session.step(start as u32, &payload).await?;
        }
        Ok(from_view(&payload.view(), &self.device)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(peer: &str, start: u32, end: u32) -> ServerRecord {
        ServerRecord {
            peer_id: peer.into(),
            model: "m".into(),
            fingerprint: String::new(),
            block_hashes: (start..end).map(|i| format!("h{i}")).collect(),
            start,
            end,
            num_layers: 8,
            hidden_size: 4,
            throughput: 1.0,
            prefill_throughput: 1.0,
            cache_tokens_left: 1,
            max_length: 1,
            sessions: 0,
            max_sessions: 1,
            dtype: "f32".into(),
            version: "0".into(),
            addresses: vec![],
        }
    }

    #[test]
    fn routes_take_the_farthest_reaching_server() {
        let records = [
            record("a", 0, 3),
            record("b", 0, 5),
            record("c", 3, 8),
            record("d", 5, 8),
        ];
        let route = plan_route(&records, 8).unwrap();
        assert_eq!(
            route,
            vec![
                Hop {
                    peer_id: "b".into(),
                    start: 0,
                    end: 5
                },
                Hop {
                    peer_id: "c".into(),
                    start: 5,
                    end: 8
                },
            ]
        );
    }

    #[test]
    fn servers_with_other_weights_are_left_out() {
        let mut other = record("x", 0, 4);
        other.block_hashes[2] = "different".into();
        let records = vec![record("a", 0, 4), other, record("b", 4, 8)];
        let expected: Vec<String> = (0..8).map(|i| format!("h{i}")).collect();
        let kept: Vec<String> = matching_servers(records.clone(), Some(&expected))
            .into_iter()
            .map(|r| r.peer_id)
            .collect();
        assert_eq!(kept, ["a", "b"]);
        assert_eq!(matching_servers(records, None).len(), 3);
    }

    #[test]
    fn gaps_are_named() {
        let records = [record("a", 0, 2), record("b", 3, 5)];
        assert_eq!(uncovered_blocks(&records, 8), vec![(2, 3), (5, 8)]);
        match plan_route(&records, 8) {
            Err(ClientError::NoRoute { uncovered }) => assert_eq!(uncovered, vec![(2, 3), (5, 8)]),
            other => panic!("{other:?}"),
        }
    }
}
