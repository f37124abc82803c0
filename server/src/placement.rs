//! Where a server's blocks go: the window of the swarm that is weakest when
//! it joins, and later whether moving there would help the swarm enough to
//! be worth a drain and a reload (Petals' block selection and rebalancing).
//!
//! The swarm's strength at a block is the announced decode throughput summed
//! over the servers holding it; the swarm is as strong as its weakest block,
//! because every generation passes through every block.

use corolla_shared::coverage;
use corolla_shared::ServerRecord;

/// Announced throughput per block, `0..num_layers` (this server's own
/// model); lies (NaN, negative, infinite) count as nothing.
fn block_throughput(num_layers: usize, records: &[ServerRecord]) -> Vec<f64> {
    let num_layers = u32::try_from(num_layers).unwrap_or(u32::MAX);
    coverage::of_records(num_layers, records)
        .iter()
        .map(|b| b.throughput)
        .collect()
}

fn weakest(throughput: &[f64]) -> f64 {
    throughput.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Picks `n` consecutive blocks where the swarm is weakest: the window whose
/// least-served block has the lowest throughput, then the lowest total, then
/// the lowest start.
pub fn choose_blocks(num_layers: usize, n: usize, records: &[ServerRecord]) -> (usize, usize) {
    let n = n.clamp(1, num_layers.max(1));
    let throughput = block_throughput(num_layers, records);
    let score = |s: usize| {
        let w = &throughput[s..s + n];
        (weakest(w), w.iter().sum::<f64>())
    };
    let best = (0..=num_layers.saturating_sub(n))
        .min_by(|&a, &b| {
            let (x, y) = (score(a), score(b));
            x.0.total_cmp(&y.0)
                .then(x.1.total_cmp(&y.1))
                .then(a.cmp(&b))
        })
        .unwrap_or(0);
    (best, best + n)
}

/// One server moving its blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Move {
    pub peer_id: String,
    pub from: (usize, usize),
    pub to: (usize, usize),
    /// The swarm's weakest block throughput before and after.
    pub weakest_before: f64,
    pub weakest_after: f64,
}

/// The one move of a rebalancing server that raises the swarm's weakest
/// block the most, if it raises it by more than `quality` (0.15: 15 %; from
/// nothing, any gain counts). Each candidate moves to where
/// [`choose_blocks`] would put it were it joining now, keeping its size.
///
/// Every server that sees the same records picks the same move (ties go to
/// the lowest peer id), so two servers of one overlap never both leave it.
pub fn best_move(num_layers: usize, records: &[ServerRecord], quality: f64) -> Option<Move> {
    if num_layers == 0 {
        return None;
    }
    let before = weakest(&block_throughput(num_layers, records));
    let mut best: Option<Move> = None;
    for (i, r) in records.iter().enumerate() {
        let from = (r.start as usize, r.end as usize);
        if !r.rebalances || from.0 >= from.1 || from.1 > num_layers {
            continue;
        }
        let mut others: Vec<ServerRecord> = records
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, o)| o.clone())
            .collect();
        let to = choose_blocks(num_layers, from.1 - from.0, &others);
        if to == from {
            continue;
        }
        let mut moved = r.clone();
        (moved.start, moved.end) = (to.0 as u32, to.1 as u32);
        others.push(moved);
        let after = weakest(&block_throughput(num_layers, &others));
        let worth_it = if before > 0.0 {
            after > before * (1.0 + quality)
        } else {
            after > 0.0
        };
        if !worth_it {
            continue;
        }
        let better = match &best {
            None => true,
            Some(b) => after
                .total_cmp(&b.weakest_after)
                .then_with(|| b.peer_id.cmp(&r.peer_id))
                .is_gt(),
        };
        if better {
            best = Some(Move {
                peer_id: r.peer_id.clone(),
                from,
                to,
                weakest_before: before,
                weakest_after: after,
            });
        }
    }
    best
}

/// A record of model `m` for tests: `peer` serving `start..end` at `throughput`.
#[cfg(test)]
pub(crate) fn sample_record(peer: &str, start: u32, end: u32, throughput: f64) -> ServerRecord {
    let json = format!(
        r#"{{"peer_id":"{peer}","model":"m","fingerprint":"","start":{start},"end":{end},"num_layers":8,
        "hidden_size":8,"throughput":1.0,"prefill_throughput":1.0,"cache_tokens_left":1,"max_length":1,
        "sessions":0,"max_sessions":1,"dtype":"f32","version":"0","addresses":[],"rebalances":true}}"#
    );
    let mut r = ServerRecord::from_bytes(json.as_bytes()).expect("a sample record parses");
    r.throughput = throughput;
    r
}

#[cfg(test)]
mod tests {
    use super::sample_record as record;
    use super::*;

    #[test]
    fn new_servers_fill_the_thinnest_blocks() {
        let r = |start, end| record("p", start, end, 1.0);
        assert_eq!(choose_blocks(8, 3, &[]), (0, 3));
        assert_eq!(choose_blocks(8, 3, &[r(0, 4)]), (4, 7));
        assert_eq!(choose_blocks(8, 2, &[r(0, 4), r(4, 6)]), (6, 8));
        assert_eq!(choose_blocks(8, 20, &[]), (0, 8));
    }

    #[test]
    fn new_servers_go_where_throughput_is_lowest() {
        let r = |start, end, speed| record("p", start, end, speed);
        // Both halves served once, the second slowly: a new server joins it.
        assert_eq!(choose_blocks(8, 4, &[r(0, 4, 100.0), r(4, 8, 5.0)]), (4, 8));
        // Two slow servers of a half weigh less than one fast one.
        let swarm = [r(0, 4, 3.0), r(0, 4, 3.0), r(4, 8, 50.0)];
        assert_eq!(choose_blocks(8, 4, &swarm), (0, 4));
        // A lying NaN counts as nothing.
        assert_eq!(
            choose_blocks(8, 4, &[r(0, 4, f64::NAN), r(4, 8, 1.0)]),
            (0, 4)
        );
    }

    #[test]
    fn one_of_two_overlapping_servers_moves_to_the_gap() {
        let swarm = [
            record("b", 0, 3, 10.0),
            record("a", 0, 3, 10.0),
            record("c", 3, 6, 10.0),
        ];
        let m = best_move(8, &swarm, 0.15).expect("a gap is worth a move");
        // The lower peer id of the two equals moves; the other stays.
        assert_eq!(m.peer_id, "a");
        assert_eq!((m.from, m.to), ((0, 3), (5, 8)));
        assert_eq!((m.weakest_before, m.weakest_after), (0.0, 10.0));
        // Once it has moved, nobody gains by moving again.
        let moved = [
            record("b", 0, 3, 10.0),
            record("a", 5, 8, 10.0),
            record("c", 3, 6, 10.0),
        ];
        assert_eq!(best_move(8, &moved, 0.15), None);
        // While it is away (its record withdrawn), the other one stays too.
        assert_eq!(best_move(8, &swarm[..1], 0.15), None);
        assert_eq!(
            best_move(8, &[swarm[0].clone(), swarm[2].clone()], 0.15),
            None
        );
    }

    #[test]
    fn small_gains_and_fixed_servers_do_not_move() {
        // Moving a to the slow half raises the weakest block from 10 to 11:
        // 10 %, under the 15 % asked.
        let swarm = [
            record("a", 0, 4, 1.0),
            record("x", 0, 4, 20.0),
            record("c", 4, 8, 10.0),
        ];
        assert_eq!(best_move(8, &swarm, 0.15), None);
        let m = best_move(8, &swarm, 0.05).expect("over 5 %");
        assert_eq!((m.peer_id.as_str(), m.to), ("a", (4, 8)));
        // A server with fixed blocks (--block-indices) is never moved.
        let mut fixed = swarm.clone();
        fixed[0].rebalances = false;
        assert_eq!(best_move(8, &fixed, 0.05), None);
    }
}
