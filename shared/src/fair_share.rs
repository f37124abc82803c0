//! Who gives way when every place of some kind is taken (sessions, streams,
//! connections, handshakes) and a newcomer's addresses hold less than their
//! share. One rule for all of them: from the widest [`Level`] down, the
//! places are shared equally between the groups holding them (the
//! newcomer's counted), so the share shrinks as more groups compete; when
//! the newcomer's group holds less than its share and the largest group
//! more than one over the newcomer's, the largest gives way, its most
//! crowded host first. When the newcomer's group holds its share, the same
//! question is asked inside that group, one level down (hosts of one
//! network share that network's places).

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;

use crate::source_address::{AddressGroup, Level};

/// Of `holders` (a key and the source address of each place held; `None`:
/// unknown, one group for all), those of which one may give way to a
/// newcomer from `newcomer` when all `total` places are held: the places
/// of the most crowded host in the group over its share. Empty when the
/// newcomer's addresses hold their share already (it should wait).
pub fn crowded<K: Copy>(
    holders: impl IntoIterator<Item = (K, Option<IpAddr>)>,
    newcomer: Option<IpAddr>,
    total: usize,
) -> Vec<K> {
    let mut scope: Vec<(K, Option<IpAddr>)> = holders.into_iter().collect();
    let mut room = total;
    let group = |level: Level, ip: Option<IpAddr>| ip.map(|ip| AddressGroup::at(level, ip));
    for (depth, level) in Level::WIDEST_FIRST.into_iter().enumerate() {
        let counts = counts(scope.iter().map(|(_, ip)| group(level, *ip)));
        let mine_group = group(level, newcomer);
        let mine = counts.get(&mine_group).copied().unwrap_or(0);
        let groups = counts.len() + usize::from(mine == 0);
        let share = (room / groups.max(1)).max(1);
        let Some((largest, theirs)) = largest(counts) else {
            return Vec::new();
        };
        if mine < share && theirs > mine + 1 {
            scope.retain(|(_, ip)| group(level, *ip) == largest);
            // The most crowded host of that group pays first.
            for narrower in &Level::WIDEST_FIRST[depth + 1..] {
                if let Some((largest, _)) =
                    largest_of(scope.iter().map(|(_, ip)| group(*narrower, *ip)))
                {
                    scope.retain(|(_, ip)| group(*narrower, *ip) == largest);
                }
            }
            return scope.into_iter().map(|(key, _)| key).collect();
        }
        scope.retain(|(_, ip)| group(level, *ip) == mine_group);
        room = scope.len();
    }
    Vec::new()
}

fn counts<G: Hash + Eq>(groups: impl Iterator<Item = G>) -> HashMap<G, usize> {
    let mut counts = HashMap::new();
    for group in groups {
        *counts.entry(group).or_insert(0) += 1;
    }
    counts
}

/// The group holding the most, and how many; ties go to the smaller group
/// key so every caller decides alike.
fn largest<G: Hash + Eq + Ord>(counts: HashMap<G, usize>) -> Option<(G, usize)> {
    counts
        .into_iter()
        .max_by(|(a, n), (b, m)| n.cmp(m).then(b.cmp(a)))
}

fn largest_of<G: Hash + Eq + Ord>(groups: impl Iterator<Item = G>) -> Option<(G, usize)> {
    largest(counts(groups))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn the_share_shrinks_as_groups_compete_and_the_most_crowded_host_pays() {
        // Eight places: 6.6.0.1 holds four, 6.6.0.2 two, 7.7.0.1 two.
        let holders = [
            (0, ip("6.6.0.1")),
            (1, ip("6.6.0.1")),
            (2, ip("6.6.0.1")),
            (3, ip("6.6.0.1")),
            (4, ip("6.6.0.2")),
            (5, ip("6.6.0.2")),
            (6, ip("7.7.0.1")),
            (7, ip("7.7.0.1")),
        ];
        // A third region's share is 8/3 = 2: the 6.6/16 region (six)
        // gives way, from its most crowded host.
        assert_eq!(
            {
                let mut v = crowded(holders, ip("9.9.0.1"), 8);
                v.sort();
                v
            },
            vec![0, 1, 2, 3]
        );
        // A newcomer of 7.7/16 (two, of a share of four) takes from 6.6/16's six.
        assert!(!crowded(holders, ip("7.7.1.1"), 8).is_empty());
        // Inside 6.6.0.0/24, 6.6.0.3 is a third host: 6.6.0.1 gives way.
        let inside = crowded(holders, ip("6.6.0.3"), 8);
        assert!(inside.iter().all(|k| *k < 4), "{inside:?}");
        // Two hosts in two regions holding four each: either one waits.
        let even = [0, 1, 2, 3]
            .map(|k| (k, ip("6.6.0.1")))
            .into_iter()
            .chain([4, 5, 6, 7].map(|k| (k, ip("7.7.0.1"))));
        assert!(crowded(even, ip("7.7.0.1"), 8).is_empty());
    }

    #[test]
    fn one_place_per_group_everywhere_leaves_nobody_to_give_way() {
        let holders: Vec<(usize, Option<IpAddr>)> = (0..16)
            .map(|i| (i, ip(&format!("{}.1.0.1", 10 + i))))
            .collect();
        assert!(crowded(holders, ip("99.1.0.1"), 16).is_empty());
    }
}
