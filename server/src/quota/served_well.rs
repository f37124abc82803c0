//! The hosts this server served well: a slot that carried
//! [`super::SERVED_WELL_STEPS`] steps leaves its host here for
//! [`REMEMBERED_FOR`], which keeps room for it (the quota's rule 4). Hosts,
//! not peer ids: an id costs nothing, an address does.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use corolla_shared::source_address::AddressGroup;

use super::Holder;

/// How long a host stays known as served well.
const REMEMBERED_FOR: Duration = Duration::from_secs(3600);

/// The most hosts remembered; the one remembered longest ago goes first.
const MOST_HOSTS: usize = 4096;

#[derive(Debug, Default)]
pub(super) struct ServedWell {
    hosts: HashMap<AddressGroup, Instant>,
}

impl ServedWell {
    pub fn remember(&mut self, holder: &Holder, now: Instant) {
        let Some(ip) = holder.source else {
            return;
        };
        if self.hosts.len() >= MOST_HOSTS {
            self.hosts
                .retain(|_, at| now.saturating_duration_since(*at) < REMEMBERED_FOR);
        }
        if self.hosts.len() >= MOST_HOSTS {
            if let Some(oldest) = self
                .hosts
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(h, _)| *h)
            {
                self.hosts.remove(&oldest);
            }
        }
        self.hosts.insert(AddressGroup::host(ip), now);
    }

    pub fn knows(&self, holder: &Holder, now: Instant) -> bool {
        holder.source.is_some_and(|ip| {
            self.hosts
                .get(&AddressGroup::host(ip))
                .is_some_and(|at| now.saturating_duration_since(*at) < REMEMBERED_FOR)
        })
    }
}
