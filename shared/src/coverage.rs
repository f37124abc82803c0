//! Which blocks a set of servers covers and how strongly: the one answer the
//! swarm report, a joining server's placement and a client's route all ask
//! for. Spans come from records peers announced, so they are clipped to the
//! model's `0..num_layers` (the caller's own count), never trusted to size
//! anything.

use serde::{Deserialize, Serialize};

use crate::ServerRecord;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockCoverage {
    pub block: u32,
    /// Servers holding this block.
    pub servers: u32,
    /// The announced decode tokens/s of those servers, summed: what this
    /// block can carry at most, and so where the swarm is weakest.
    pub throughput: f64,
}

/// A figure a peer announced, made safe to add up and to encode: JSON has
/// no NaN or infinity, and a negative speed means nothing.
pub fn announced_speed(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

/// Coverage of blocks `0..num_layers` by `spans` (`start`, `end`, speed
/// already made sane).
pub fn per_block(
    num_layers: u32,
    spans: impl IntoIterator<Item = (u32, u32, f64)>,
) -> Vec<BlockCoverage> {
    let mut blocks: Vec<BlockCoverage> = (0..num_layers)
        .map(|block| BlockCoverage {
            block,
            servers: 0,
            throughput: 0.0,
        })
        .collect();
    for (start, end, speed) in spans {
        let end = end.min(num_layers) as usize;
        for b in blocks.iter_mut().take(end).skip(start as usize) {
            b.servers += 1;
            b.throughput += speed;
        }
    }
    blocks
}

/// Coverage of `0..num_layers` by `records`, each counted once as listed.
pub fn of_records(num_layers: u32, records: &[ServerRecord]) -> Vec<BlockCoverage> {
    per_block(
        num_layers,
        records
            .iter()
            .map(|r| (r.start, r.end, announced_speed(r.throughput))),
    )
}

/// The runs of blocks no server holds, as `[start, end)`.
pub fn gaps(blocks: &[BlockCoverage]) -> Vec<(u32, u32)> {
    let mut gaps: Vec<(u32, u32)> = Vec::new();
    for b in blocks.iter().filter(|b| b.servers == 0) {
        match gaps.last_mut() {
            Some((_, end)) if *end == b.block => *end += 1,
            _ => gaps.push((b.block, b.block + 1)),
        }
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_clipped_counted_and_summed() {
        let blocks = per_block(6, [(0, 2, 1.0), (1, 4, 2.0), (5, 99, 4.0)]);
        let servers: Vec<u32> = blocks.iter().map(|b| b.servers).collect();
        assert_eq!(servers, [1, 2, 1, 1, 0, 1]);
        assert_eq!(blocks[1].throughput, 3.0);
        assert_eq!(gaps(&blocks), [(4, 5)]);
        assert_eq!(gaps(&per_block(3, [])), [(0, 3)]);
        assert_eq!(announced_speed(f64::NAN), 0.0);
        assert_eq!(announced_speed(-1.0), 0.0);
        assert_eq!(announced_speed(f64::INFINITY), 0.0);
    }
}
