//! What a swarm looks like for one model, as the people who run it want to
//! see it: how many servers hold each block and how fast, which blocks
//! nobody serves, and every server's figures. `corolla swarm` prints it and
//! every server's `/api/swarm` (read by its `/monitor` page) serves it, so
//! both are built here, by one pure function over the records a lookup found.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::coverage::BlockCoverage;
use crate::coverage::{self, announced_speed};
use crate::record::{Reachability, ServerRecord};

/// The swarm of one model at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwarmReport {
    pub model: String,
    pub num_layers: u32,
    /// One entry per block, `0..num_layers`.
    pub blocks: Vec<BlockCoverage>,
    /// Runs of blocks no server holds, as `[start, end)`.
    pub gaps: Vec<(u32, u32)>,
    /// Servers not leaving, ordered by their first block.
    pub servers: Vec<ServerRow>,
    /// Every block has a server (and there is at least one block).
    pub complete: bool,
    /// When the report was built, in milliseconds since the Unix epoch.
    pub generated_at_ms: u64,
    /// The peer the round trips were measured from, when it is a server of
    /// the report (a server's own `/api/swarm`); lets a page mark "this server".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observer: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerRow {
    pub peer_id: String,
    pub start: u32,
    pub end: u32,
    /// Announced decode tokens/s through the server's span.
    pub throughput: f64,
    /// Last measured round trip from the observer, if it has one.
    pub rtt_ms: Option<f64>,
    pub cache_tokens_left: u64,
    pub sessions: u32,
    pub max_sessions: u32,
    pub reachability: Reachability,
    pub version: String,
    pub addresses: Vec<String>,
    pub dtype: String,
    /// The LoRA adapters sessions may run with there.
    #[serde(default)]
    pub adapters: Vec<String>,
}

impl SwarmReport {
    /// The report of `model` (of `num_layers` blocks) from the `records` a
    /// lookup found and the round trips `rtts` (by peer id) measured from
    /// the observing node. Records of other models and of servers leaving
    /// are left out; spans are clipped to `0..num_layers`.
    pub fn build(
        model: &str,
        num_layers: u32,
        records: &[ServerRecord],
        rtts: &HashMap<String, Duration>,
    ) -> SwarmReport {
        let mut servers: Vec<ServerRow> = records
            .iter()
            .filter(|r| r.model == model && !r.leaving && r.start < r.end)
            .map(|r| ServerRow {
                peer_id: r.peer_id.clone(),
                start: r.start,
                end: r.end,
                throughput: announced_speed(r.throughput),
                rtt_ms: rtts.get(&r.peer_id).map(|d| d.as_secs_f64() * 1000.0),
                cache_tokens_left: r.cache_tokens_left,
                sessions: r.sessions,
                max_sessions: r.max_sessions,
                reachability: r.reachability,
                version: r.version.clone(),
                addresses: r.addresses.clone(),
                dtype: r.dtype.clone(),
                adapters: r.adapters.clone(),
            })
            .collect();
        servers.sort_by(|a, b| (a.start, a.end, &a.peer_id).cmp(&(b.start, b.end, &b.peer_id)));
        // One row per peer: two copies of a record (from two lookups) would
        // count the same server twice.
        servers.dedup_by(|a, b| a.peer_id == b.peer_id);

        let blocks = coverage::per_block(
            num_layers,
            servers.iter().map(|s| (s.start, s.end, s.throughput)),
        );
        let gaps = coverage::gaps(&blocks);
        SwarmReport {
            model: model.to_string(),
            num_layers,
            complete: gaps.is_empty() && num_layers > 0,
            blocks,
            gaps,
            servers,
            generated_at_ms: web_time::SystemTime::now()
                .duration_since(web_time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            observer: None,
        }
    }

    /// For each adapter servers announce: whether its servers cover every block.
    pub fn adapter_lines(&self) -> Vec<String> {
        let names: std::collections::BTreeSet<&str> = self
            .servers
            .iter()
            .flat_map(|s| s.adapters.iter().map(String::as_str))
            .collect();
        names
            .into_iter()
            .map(|name| {
                let servers = self
                    .servers
                    .iter()
                    .filter(|s| s.adapters.iter().any(|a| a == name));
                let blocks = coverage::per_block(
                    self.num_layers,
                    servers.map(|s| (s.start, s.end, s.throughput)),
                );
                let gaps = coverage::gaps(&blocks);
                if gaps.is_empty() {
                    format!("adapter {name}: every block served")
                } else {
                    let gaps: Vec<String> = gaps.iter().map(|(a, b)| format!("{a}..{b}")).collect();
                    format!("adapter {name}: blocks {} not served", gaps.join(", "))
                }
            })
            .collect()
    }

    /// The report as a terminal shows it: a coverage bar, the gaps, the
    /// adapters' coverage, and a table of servers.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let state = if self.complete {
            "every block served".to_string()
        } else if self.num_layers == 0 {
            "no blocks known".to_string()
        } else {
            let missing: u32 = self.gaps.iter().map(|(a, b)| b - a).sum();
            format!("{missing} block{} not served", plural(missing))
        };
        let _ = writeln!(
            out,
            "model {}: {} server{}, {} blocks, {state}",
            self.model,
            self.servers.len(),
            plural(self.servers.len() as u32),
            self.num_layers,
        );
        if self.num_layers > 0 {
            let (bar, per) = self.coverage_bar(BAR_WIDTH);
            let _ = writeln!(out, "coverage [{bar}]");
            let unit = if per == 1 {
                "a char per block".to_string()
            } else {
                format!("a char per {per} blocks, the fewest servers among them")
            };
            let _ = writeln!(
                out,
                "          servers per block ({unit}): 1-9, + for 10 or more, X for none"
            );
            let _ = writeln!(out, "          blocks 0..{}", self.num_layers);
        }
        if !self.gaps.is_empty() {
            let gaps: Vec<String> = self.gaps.iter().map(|(a, b)| format!("{a}..{b}")).collect();
            let _ = writeln!(out, "blocks not served: {}", gaps.join(", "));
        }
        if let Some(weakest) = self
            .blocks
            .iter()
            .filter(|b| b.servers > 0)
            .min_by(|a, b| a.throughput.total_cmp(&b.throughput))
        {
            let _ = writeln!(
                out,
                "weakest served block: {} ({:.1} tokens/s over {} server{})",
                weakest.block,
                weakest.throughput,
                weakest.servers,
                plural(weakest.servers)
            );
        }
        for line in self.adapter_lines() {
            let _ = writeln!(out, "{line}");
        }
        if self.servers.is_empty() {
            let _ = writeln!(out, "no servers found");
            return out;
        }
        let header = [
            "PEER",
            "BLOCKS",
            "TOKENS/S",
            "RTT",
            "CACHE",
            "SESSIONS",
            "REACH",
            "VERSION",
            "DTYPE",
            "ADDRESSES",
        ];
        let rows: Vec<[String; 10]> = self
            .servers
            .iter()
            .map(|s| {
                [
                    s.peer_id.clone(),
                    format!("{}..{}", s.start, s.end),
                    format!("{:.1}", s.throughput),
                    s.rtt_ms.map_or("-".into(), |ms| format!("{ms:.1} ms")),
                    s.cache_tokens_left.to_string(),
                    format!("{}/{}", s.sessions, s.max_sessions),
                    s.reachability.to_string(),
                    s.version.clone(),
                    s.dtype.clone(),
                    s.addresses.join(" "),
                ]
            })
            .collect();
        let mut widths = header.map(|h| h.chars().count());
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut line = |cells: &[&str]| {
            let mut text = String::new();
            for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
                // Figures read best right-aligned; the last column is not padded.
                let right = (2..=5).contains(&i);
                let cell = if i + 1 == cells.len() {
                    cell.to_string()
                } else if right {
                    format!("{cell:>w$}  ")
                } else {
                    format!("{cell:<w$}  ")
                };
                text.push_str(&cell);
            }
            let _ = writeln!(out, "{}", text.trim_end());
        };
        line(&header);
        for row in &rows {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            line(&cells);
        }
        out
    }

    /// The blocks as at most `width` characters (each standing for `per`
    /// blocks: the fewest servers among them, so a gap is never hidden).
    pub fn coverage_bar(&self, width: usize) -> (String, usize) {
        let per = self.blocks.len().div_ceil(width.max(1)).max(1);
        let bar = self
            .blocks
            .chunks(per)
            .map(
                |chunk| match chunk.iter().map(|b| b.servers).min().unwrap_or(0) {
                    0 => 'X',
                    n @ 1..=9 => char::from_digit(n, 10).unwrap_or('+'),
                    _ => '+',
                },
            )
            .collect();
        (bar, per)
    }
}

/// The widest coverage bar a terminal gets.
const BAR_WIDTH: usize = 64;

fn plural(n: u32) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// Round trips keyed by peer id string, as [`SwarmReport::build`] takes them.
pub fn rtts_by_peer<K: ToString>(
    rtts: impl IntoIterator<Item = (K, Duration)>,
) -> HashMap<String, Duration> {
    rtts.into_iter().map(|(k, d)| (k.to_string(), d)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(peer: &str, start: u32, end: u32, throughput: f64) -> ServerRecord {
        let json = format!(
            r#"{{"peer_id":"{peer}","model":"m","fingerprint":"","start":{start},"end":{end},"num_layers":8,
            "hidden_size":8,"throughput":{throughput},"prefill_throughput":1.0,"cache_tokens_left":100,"max_length":1,
            "sessions":1,"max_sessions":4,"dtype":"f32","version":"0.1","addresses":["/ip4/1.2.3.4/tcp/1"]}}"#
        );
        ServerRecord::from_bytes(json.as_bytes()).unwrap()
    }

    fn counts(r: &SwarmReport) -> Vec<u32> {
        r.blocks.iter().map(|b| b.servers).collect()
    }

    #[test]
    fn coverage_counts_and_throughput_sum_over_servers() {
        let records = [
            record("a", 0, 4, 10.0),
            record("b", 2, 6, 5.0),
            record("c", 4, 8, 2.5),
        ];
        let r = SwarmReport::build("m", 8, &records, &HashMap::new());
        assert_eq!(counts(&r), [1, 1, 2, 2, 2, 2, 1, 1]);
        let tps: Vec<f64> = r.blocks.iter().map(|b| b.throughput).collect();
        assert_eq!(tps, [10.0, 10.0, 15.0, 15.0, 7.5, 7.5, 2.5, 2.5]);
        assert!(r.gaps.is_empty());
        assert!(r.complete);
        assert_eq!(r.servers.len(), 3);
        assert_eq!(
            r.blocks.iter().map(|b| b.block).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
    }

    #[test]
    fn gaps_at_the_start_middle_and_end() {
        let records = [record("a", 1, 3, 1.0), record("b", 5, 6, 1.0)];
        let r = SwarmReport::build("m", 8, &records, &HashMap::new());
        assert_eq!(r.gaps, [(0, 1), (3, 5), (6, 8)]);
        assert!(!r.complete);
        assert_eq!(r.coverage_bar(64), ("X11XX1XX".to_string(), 1));

        let none = SwarmReport::build("m", 4, &[], &HashMap::new());
        assert_eq!(none.gaps, [(0, 4)]);
        assert!(!none.complete);
        assert!(none.to_text().contains("no servers found"));

        let empty = SwarmReport::build("m", 0, &[], &HashMap::new());
        assert!(empty.gaps.is_empty() && empty.blocks.is_empty());
        assert!(
            !empty.complete,
            "a model of no known blocks is not complete"
        );
    }

    #[test]
    fn leaving_foreign_duplicate_and_overlong_records_are_handled() {
        let mut leaving = record("gone", 0, 8, 100.0);
        leaving.leaving = true;
        let mut other = record("other", 0, 8, 100.0);
        other.model = "another model".into();
        // Past the last block, and a speed JSON cannot carry.
        let mut weird = record("weird", 6, 12, 1.0);
        weird.throughput = f64::NAN;
        let records = [
            leaving,
            other,
            record("a", 0, 6, 3.0),
            record("a", 0, 6, 3.0),
            weird,
        ];
        let r = SwarmReport::build("m", 8, &records, &HashMap::new());
        let peers: Vec<&str> = r.servers.iter().map(|s| s.peer_id.as_str()).collect();
        assert_eq!(peers, ["a", "weird"]);
        assert_eq!(counts(&r), [1, 1, 1, 1, 1, 1, 1, 1]);
        assert_eq!(r.blocks[7].throughput, 0.0, "NaN announced counts as 0");
        assert!(r.complete);
        // It still encodes (JSON has no NaN) and decodes to the same report.
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<SwarmReport>(&json).unwrap(), r);
    }

    #[test]
    fn round_trips_and_the_text_view() {
        let records = [record("a", 0, 2, 10.0), record("b", 3, 4, 5.0)];
        let rtts = rtts_by_peer([("a", Duration::from_micros(12_500))]);
        let r = SwarmReport::build("m", 4, &records, &rtts);
        assert_eq!(r.servers[0].rtt_ms, Some(12.5));
        assert_eq!(r.servers[1].rtt_ms, None);
        assert_eq!(r.servers[0].reachability, Reachability::Unknown);
        let text = r.to_text();
        assert!(text.contains("coverage [11X1]"), "{text}");
        assert!(text.contains("blocks not served: 2..3"), "{text}");
        assert!(text.contains("12.5 ms"), "{text}");
        assert!(text.contains("/ip4/1.2.3.4/tcp/1"), "{text}");

        // Many blocks share a character, and a gap inside a bucket shows.
        let big = [record("a", 0, 100, 1.0), record("b", 101, 200, 1.0)];
        let r = SwarmReport::build("m", 200, &big, &HashMap::new());
        let (bar, per) = r.coverage_bar(64);
        assert_eq!(per, 4);
        assert_eq!(bar.len(), 50);
        assert_eq!(bar.matches('X').count(), 1);
    }
}
