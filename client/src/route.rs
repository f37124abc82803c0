//! Choosing servers to cover every block: coverage, weight checks and the
//! least-latency route.

use std::collections::HashMap;

use corolla_shared::coverage;
use corolla_shared::node::Via;
use corolla_shared::ServerRecord;
use serde::Serialize;

use corolla_model::fingerprint::{keeps_quantized, weights_of};

use crate::error::ClientError;

/// One server in a chain and the blocks it runs for us.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hop {
    pub peer_id: String,
    pub start: usize,
    pub end: usize,
    /// How the client reached the server, once it has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<Via>,
}

/// Blocks of `0..num_layers` that no record covers, as `[start, end)` ranges.
pub fn uncovered_blocks(records: &[ServerRecord], num_layers: usize) -> Vec<(usize, usize)> {
    let num_layers = u32::try_from(num_layers).unwrap_or(u32::MAX);
    coverage::gaps(&coverage::of_records(num_layers, records))
        .into_iter()
        .map(|(start, end)| (start as usize, end as usize))
        .collect()
}

/// What the router knows beyond the records: measured round trips and the
/// session length a server must have room for.
#[derive(Debug, Clone, Default)]
pub struct RouteCosts {
    /// Moving average of round-trip times, in seconds, by peer id.
    pub rtt: HashMap<String, f64>,
    /// Tokens of cache a session needs; servers with less are penalised.
    pub max_length: usize,
    /// Positions the session's first step prefills (0: not known): a server
    /// announcing shared prefix pages may skip that much of the prefill.
    pub prompt_tokens: usize,
    /// Moving average of the decode-step time the client measured, per block
    /// a server ran, in seconds, by peer id: once known, it replaces what the
    /// server announced (and its round trip, which it includes).
    pub measured_step: HashMap<String, f64>,
    /// Seconds added to a server's cost because it is reached at the same
    /// address (host) as a server that failed this client lately: a crowd
    /// of fakes from one machine is tried once, not once per identity.
    pub suspicion: HashMap<String, f64>,
}

/// Assumed round trip for a server not measured yet.
const DEFAULT_RTT: f64 = 0.005;
/// Added to a server's cost when it lacks cache for the session.
const SHORT_OF_CACHE_PENALTY: f64 = 1.0;
const RTT_WEIGHT_OF_NEW_SAMPLE: f64 = 0.3;

impl RouteCosts {
    pub fn record_rtt(&mut self, peer: &str, seconds: f64) {
        update_rtt_average(&mut self.rtt, peer, seconds);
    }

    /// Expected seconds per step for running blocks `start..end` on `r`.
    pub(crate) fn hop_cost(&self, r: &ServerRecord, start: usize, end: usize) -> f64 {
        let expected = match self.measured_step.get(&r.peer_id) {
            Some(per_block) => per_block * (end - start) as f64,
            None => announced_seconds(r, start, end, self.rtt.get(&r.peer_id).copied()),
        };
        let penalty = if (r.cache_tokens_left as usize) < self.max_length {
            SHORT_OF_CACHE_PENALTY
        } else {
            0.0
        };
        let suspicion = self.suspicion.get(&r.peer_id).copied().unwrap_or(0.0);
        // The saving rests on the server's own figures (a slower announced
        // prefill claims a larger one): it may at most halve the hop's cost.
        let saving = self.prefix_saving(r, start, end).min(expected / 2.0);
        (expected + penalty + suspicion - saving).max(0.0)
    }

    /// Seconds per step a server holding shared prefix pages is expected to
    /// save: the prefill of the prompt positions its pages may cover (at
    /// its announced prefill speed), spread over the session's other steps.
    /// The pages may hold another prompt's beginning: the announcement is a
    /// count, so this is an expectation, at most one prompt's prefill.
    fn prefix_saving(&self, r: &ServerRecord, start: usize, end: usize) -> f64 {
        if self.prompt_tokens == 0 || r.prefix_tokens == 0 {
            return 0.0;
        }
        let covered = r.prefix_tokens.min(self.prompt_tokens as u64) as f64;
        let span = (r.end - r.start).max(1) as f64;
        let prefill = covered * (end - start) as f64 / (r.prefill_throughput.max(1e-9) * span);
        let steps = self.max_length.saturating_sub(self.prompt_tokens).max(1);
        prefill / steps as f64
    }
}

/// Seconds per step for blocks `start..end` on `r` by its announced speed
/// and the round trip `rtt` measured to it (`None`: [`DEFAULT_RTT`]).
pub(crate) fn announced_seconds(
    r: &ServerRecord,
    start: usize,
    end: usize,
    rtt: Option<f64>,
) -> f64 {
    let span = (r.end - r.start).max(1) as f64;
    rtt.unwrap_or(DEFAULT_RTT) + (end - start) as f64 / (r.throughput.max(1e-9) * span)
}

/// Whether two route costs differ only by float rounding.
fn same_cost(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

/// Folds one round trip into `peer`'s moving average.
pub fn update_rtt_average(averages: &mut HashMap<String, f64>, peer: &str, seconds: f64) {
    let avg = averages.entry(peer.to_string()).or_insert(seconds);
    *avg += RTT_WEIGHT_OF_NEW_SAMPLE * (seconds - *avg);
}

/// The fewest hops covering `0..num_layers`, costs unknown.
pub fn plan_route(records: &[ServerRecord], num_layers: usize) -> Result<Vec<Hop>, ClientError> {
    plan_route_between(records, 0, num_layers, &RouteCosts::default())
}

/// The chain of servers covering blocks `from..to` with the least expected
/// time per step: a shortest path over block boundaries, where using server
/// `r` for blocks `s..e` costs its round trip plus `(e - s)` blocks at its
/// announced speed, plus a penalty when it lacks cache. Replicas of a span
/// are alternative edges. Ties go to fewer hops, then to lower peer ids, so
/// the choice is stable.
pub fn plan_route_between(
    records: &[ServerRecord],
    from: usize,
    to: usize,
    costs: &RouteCosts,
) -> Result<Vec<Hop>, ClientError> {
    if from >= to {
        return Ok(Vec::new());
    }
    // best[b - from]: (cost, hops, previous boundary, record index) to reach boundary b.
    let mut best: Vec<Option<(f64, usize, usize, usize)>> = vec![None; to - from + 1];
    best[0] = Some((0.0, 0, from, usize::MAX));
    for s in from..to {
        let Some((cost_here, hops_here, _, _)) = best[s - from] else {
            continue;
        };
        for (i, r) in records.iter().enumerate() {
            let (r_start, r_end) = (r.start as usize, (r.end as usize).min(to));
            if r_start > s || r_end <= s {
                continue;
            }
            for e in s + 1..=r_end {
                let candidate = (cost_here + costs.hop_cost(r, s, e), hops_here + 1, s, i);
                let slot = &mut best[e - from];
                let better = match slot {
                    None => true,
                    // Costs equal but for rounding are a tie: a span cut into
                    // pieces on one server sums the same per-block cost in
                    // another order, and must not win by the last bit.
                    Some((c, h, _, j)) if same_cost(candidate.0, *c) => {
                        (candidate.1, &records[i].peer_id) < (*h, &records[*j].peer_id)
                    }
                    Some((c, _, _, _)) => candidate.0 < *c,
                };
                if better {
                    *slot = Some(candidate);
                }
            }
        }
    }
    if best[to - from].is_none() {
        let mut uncovered = uncovered_blocks(records, to);
        uncovered.retain(|&(_, b)| b > from);
        for gap in &mut uncovered {
            gap.0 = gap.0.max(from);
        }
        return Err(ClientError::NoRoute { uncovered });
    }
    let mut route = Vec::new();
    let mut b = to;
    while b > from {
        let Some((_, _, prev, i)) = best[b - from] else {
            break;
        };
        route.push(Hop {
            peer_id: records[i].peer_id.clone(),
            start: prev,
            end: b,
            via: None,
        });
        b = prev;
    }
    route.reverse();
    Ok(route)
}

/// The servers of the model the client expects (`expected[i]`: block `i`'s
/// hash; with no expectation, all) that compute alike, as [`matching_servers`]
/// chose them, and those left out only for computing otherwise.
#[derive(Debug, Default)]
pub struct MatchingServers {
    pub chosen: Vec<ServerRecord>,
    /// Same weights, other quantization ([`corolla_model::fingerprint::keeps_quantized`]).
    pub other_compute: Vec<ServerRecord>,
}

/// Keeps the servers whose weights are those of the model the client expects
/// and, since a chain never mixes servers that compute differently (kept
/// quantized or dequantized), follows the quantization that covers the most
/// blocks: a client whose own choice differs uses the swarm's.
pub fn matching_servers(
    records: Vec<ServerRecord>,
    expected: Option<&[String]>,
) -> MatchingServers {
    let records: Vec<ServerRecord> = match expected {
        None => records,
        Some(expected) => records
            .into_iter()
            .filter(|r| {
                let ours = expected.get(r.start as usize..r.end as usize);
                let same = ours.is_some_and(|ours| {
                    ours.len() == r.block_hashes.len()
                        && ours
                            .iter()
                            .zip(&r.block_hashes)
                            .all(|(a, b)| weights_of(a) == weights_of(b))
                });
                if !same {
                    tracing::warn!(peer = %r.peer_id, "ignoring a server with other weights under the same name");
                }
                same
            })
            .collect(),
    };
    let kept = |r: &ServerRecord| r.block_hashes.iter().any(|h| keeps_quantized(h));
    let (quantized, dequantized): (Vec<_>, Vec<_>) = records.into_iter().partition(kept);
    if quantized.is_empty() || dequantized.is_empty() {
        let chosen = if quantized.is_empty() {
            dequantized
        } else {
            quantized
        };
        return MatchingServers {
            chosen,
            other_compute: Vec::new(),
        };
    }
    let expects_quantized = expected
        .and_then(|e| e.first())
        .is_some_and(|h| keeps_quantized(h));
    let prefer_quantized = match blocks_held(&quantized).cmp(&blocks_held(&dequantized)) {
        std::cmp::Ordering::Greater => true,
        std::cmp::Ordering::Less => false,
        std::cmp::Ordering::Equal => expects_quantized,
    };
    tracing::warn!(
        kept_quantized = quantized.len(),
        dequantized = dequantized.len(),
        "servers of this model compute with different quantizations (--quantized); routing only through the {} ones",
        if prefer_quantized { "kept-quantized" } else { "dequantized" }
    );
    let (chosen, other_compute) = if prefer_quantized {
        (quantized, dequantized)
    } else {
        (dequantized, quantized)
    };
    MatchingServers {
        chosen,
        other_compute,
    }
}

/// How many blocks at least one of `servers` holds: the union of their
/// ranges, counted without allocating by what a record claims.
fn blocks_held(servers: &[ServerRecord]) -> u64 {
    let mut ranges: Vec<(u32, u32)> = servers.iter().map(|r| (r.start, r.end)).collect();
    ranges.sort_unstable();
    let (mut held, mut reached) = (0u64, 0u32);
    for (start, end) in ranges {
        let start = start.max(reached);
        if end > start {
            held += u64::from(end - start);
            reached = end;
        }
    }
    held
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
            prefix_tokens: 0,
            adapters: Vec::new(),
            max_length: 1,
            sessions: 0,
            max_sessions: 1,
            dtype: "f32".into(),
            version: "0".into(),
            addresses: vec![],
            published_at_ms: 0,
            leaving: false,
            rebalances: false,
            reachability: Default::default(),
        }
    }

    #[test]
    fn routes_minimise_the_expected_time_per_step() {
        let mut fast = record("c", 3, 8);
        fast.throughput = 10.0;
        let records = [
            record("a", 0, 3),
            record("b", 0, 5),
            fast,
            record("d", 5, 8),
        ];
        // b runs a block in 1/5 s, a in 1/3 s; c is ten times faster than both.
        let route = plan_route(&records, 8).unwrap();
        assert_eq!(
            route,
            vec![
                Hop {
                    peer_id: "b".into(),
                    start: 0,
                    end: 3,
                    via: None
                },
                Hop {
                    peer_id: "c".into(),
                    start: 3,
                    end: 8,
                    via: None
                },
            ]
        );
    }

    #[test]
    fn slow_far_or_full_replicas_lose_and_ties_are_stable() {
        let replicas = |tp_a: f64, tp_b: f64| {
            let mut a = record("a", 0, 8);
            a.throughput = tp_a;
            let mut b = record("b", 0, 8);
            b.throughput = tp_b;
            vec![a, b]
        };
        let first = |records: &[ServerRecord], costs: &RouteCosts| {
            plan_route_between(records, 0, 8, costs).unwrap()[0]
                .peer_id
                .clone()
        };
        let costs = RouteCosts::default();
        assert_eq!(first(&replicas(1.0, 1.0), &costs), "a");
        assert_eq!(first(&replicas(1.0, 2.0), &costs), "b");
        let mut far = RouteCosts::default();
        far.record_rtt("b", 5.0);
        assert_eq!(first(&replicas(1.0, 2.0), &far), "a");
        let full = RouteCosts {
            max_length: 10,
            ..RouteCosts::default()
        };
        let mut records = replicas(1.0, 2.0);
        records[1].cache_tokens_left = 5;
        records[0].cache_tokens_left = 100;
        assert_eq!(first(&records, &full), "a");
        assert_eq!(
            plan_route_between(&records, 2, 5, &full).unwrap(),
            vec![Hop {
                peer_id: "a".into(),
                start: 2,
                end: 5,
                via: None
            }]
        );
    }

    #[test]
    fn a_replica_holding_shared_prefixes_wins_a_long_prompt() {
        let mut plain = record("a", 0, 8);
        plain.prefill_throughput = 1000.0;
        let mut holder = record("b", 0, 8);
        holder.prefill_throughput = 1000.0;
        holder.prefix_tokens = 640;
        let records = vec![plain, holder];
        let first = |costs: &RouteCosts| {
            plan_route_between(&records, 0, 8, costs).unwrap()[0]
                .peer_id
                .clone()
        };
        // Without a prompt to prefill (or a short one against a long answer) the tie stands.
        assert_eq!(first(&RouteCosts::default()), "a");
        let long_prompt = RouteCosts {
            max_length: 700,
            prompt_tokens: 600,
            ..RouteCosts::default()
        };
        assert_eq!(first(&long_prompt), "b");
        // A holder claiming a crawling prefill gains at most half its cost.
        let mut liar = records[1].clone();
        liar.prefill_throughput = 1e-9;
        let with_liar = vec![records[0].clone(), liar];
        let mut slower = long_prompt.clone();
        slower.measured_step.insert("b".into(), 0.3);
        assert_eq!(
            plan_route_between(&with_liar, 0, 8, &slower).unwrap()[0].peer_id,
            "a"
        );
        // A holder measured much slower per step loses all the same.
        let mut slow = long_prompt.clone();
        slow.measured_step.insert("b".into(), 1.0);
        assert_eq!(first(&slow), "a");
    }

    #[test]
    fn a_measured_server_is_one_hop_not_pieces_of_its_span() {
        // Measured costs are per block with no round trip per hop: pieces of
        // one span summed in another order differ in the last bit.
        let records = vec![record("a", 0, 8), record("b", 3, 8)];
        for per_block in [0.1, 0.7, 1.0 / 3.0, 0.013, 0.0271, 1e-3 / 7.0, 0.09] {
            let mut costs = RouteCosts::default();
            costs.measured_step.insert("a".into(), per_block);
            costs.measured_step.insert("b".into(), per_block);
            let route = plan_route_between(&records, 0, 8, &costs).unwrap();
            assert_eq!(route.len(), 1, "{per_block}: {route:?}");
        }
    }

    #[test]
    fn measured_step_times_beat_announced_speed() {
        let mut liar = record("a", 0, 8);
        liar.throughput = 1e9;
        let records = vec![liar, record("b", 0, 8)];
        let first = |costs: &RouteCosts| {
            plan_route_between(&records, 0, 8, costs).unwrap()[0]
                .peer_id
                .clone()
        };
        let mut costs = RouteCosts::default();
        assert_eq!(first(&costs), "a");
        // What the client saw: a's steps take 0.5 s a block, b's 0.01 s.
        costs.measured_step.insert("a".into(), 0.5);
        costs.measured_step.insert("b".into(), 0.01);
        assert_eq!(first(&costs), "b");
    }

    #[test]
    fn servers_with_other_weights_are_left_out() {
        let mut other = record("x", 0, 4);
        other.block_hashes[2] = "different".into();
        let records = vec![record("a", 0, 4), other, record("b", 4, 8)];
        let expected: Vec<String> = (0..8).map(|i| format!("h{i}")).collect();
        let kept: Vec<String> = matching_servers(records.clone(), Some(&expected))
            .chosen
            .into_iter()
            .map(|r| r.peer_id)
            .collect();
        assert_eq!(kept, ["a", "b"]);
        assert_eq!(matching_servers(records, None).chosen.len(), 3);
    }

    fn kept_quantized(mut r: ServerRecord) -> ServerRecord {
        for h in &mut r.block_hashes {
            h.push_str("+q");
        }
        r
    }

    /// A client expecting dequantized blocks follows a swarm of kept-quantized
    /// servers (and the other way round); a mixed swarm is never mixed in a route.
    #[test]
    fn clients_follow_the_swarms_quantization() {
        let expected: Vec<String> = (0..8).map(|i| format!("h{i}")).collect();
        let swarm = vec![
            kept_quantized(record("a", 0, 4)),
            kept_quantized(record("b", 4, 8)),
        ];
        let matched = matching_servers(swarm.clone(), Some(&expected));
        assert_eq!(matched.chosen.len(), 2);
        let quantized: Vec<String> = expected.iter().map(|h| format!("{h}+q")).collect();
        let plain = vec![record("a", 0, 4), record("b", 4, 8)];
        assert_eq!(
            matching_servers(plain.clone(), Some(&quantized))
                .chosen
                .len(),
            2
        );

        // Mixed: the quantization covering more blocks wins; the rest is set apart.
        let mut mixed = swarm;
        mixed.push(record("c", 0, 3));
        let matched = matching_servers(mixed, Some(&expected));
        let chosen: Vec<&str> = matched.chosen.iter().map(|r| r.peer_id.as_str()).collect();
        assert_eq!(chosen, ["a", "b"]);
        assert_eq!(matched.other_compute.len(), 1);
    }

    /// A record claiming blocks up to u32::MAX costs nothing to weigh.
    #[test]
    fn claimed_ranges_are_counted_without_allocating_by_them() {
        let mut huge = kept_quantized(record("a", 0, 4));
        huge.end = u32::MAX;
        let records = vec![huge, record("b", 0, 8), record("c", 2, 6)];
        assert_eq!(blocks_held(&records[1..]), 8);
        let matched = matching_servers(records, None);
        assert_eq!(matched.chosen[0].peer_id, "a");
        assert_eq!(matched.other_compute.len(), 2);
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
