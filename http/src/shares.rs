//! Connection slots shared between source hosts: one host's idle sockets
//! must not refuse every other host. While slots are free anyone gets one;
//! when all are held, a newcomer from a host holding less than an equal
//! share (the slots over the hosts holding them, the newcomer's counted)
//! takes the newest connection of the host holding the most, if that host
//! holds more than its share; otherwise the newcomer is refused.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use corolla_shared::source_address::AddressGroup;
use tokio::task::AbortHandle;

/// Where a connection comes from; `None`: not known (one group for all).
pub type Host = Option<AddressGroup>;

/// The host (an IPv4 address, an IPv6 /64) of `ip`.
pub fn host_of(ip: Option<IpAddr>) -> Host {
    ip.map(AddressGroup::host)
}

/// The connection slots of one listener.
pub struct ConnectionShares {
    max: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Each host's connections, oldest first.
    hosts: HashMap<Host, Vec<Held>>,
    held: usize,
}

struct Held {
    id: u64,
    /// The connection's task, aborted to give its slot to another host.
    task: Option<AbortHandle>,
}

/// One connection's slot; dropping it frees the slot.
pub struct ConnectionSlot {
    shares: Arc<ConnectionShares>,
    host: Host,
    id: u64,
}

impl ConnectionShares {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(ConnectionShares {
            max: max.max(1),
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for a connection from `host`: a free one, or one taken from
    /// a host over its share; `None` when neither is there.
    pub fn admit(self: &Arc<Self>, host: Host) -> Option<ConnectionSlot> {
        let mut state = self.state();
        if state.held >= self.max {
            let holding = state.hosts.get(&host).map_or(0, Vec::len);
            let hosts = state.hosts.len() + usize::from(holding == 0);
            let share = self.max / hosts.max(1);
            let (biggest, most) = state
                .hosts
                .iter()
                .filter(|(other, _)| **other != host)
                .map(|(other, held)| (*other, held.len()))
                .max_by_key(|(_, count)| *count)?;
            if holding >= share || most <= share {
                return None;
            }
            let evicted = state.hosts.get_mut(&biggest).and_then(Vec::pop);
            if state.hosts.get(&biggest).is_some_and(Vec::is_empty) {
                state.hosts.remove(&biggest);
            }
            if let Some(held) = evicted {
                state.held -= 1;
                if let Some(task) = held.task {
                    task.abort();
                }
                tracing::debug!(from = ?biggest, to = ?host, "an HTTP connection gave its slot to another host");
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        state.held += 1;
        state
            .hosts
            .entry(host)
            .or_default()
            .push(Held { id, task: None });
        Some(ConnectionSlot {
            shares: self.clone(),
            host,
            id,
        })
    }

    #[cfg(test)]
    fn held_by(&self, host: Host) -> usize {
        self.state().hosts.get(&host).map_or(0, Vec::len)
    }
}

impl ConnectionSlot {
    /// The task serving the connection: aborted if its slot goes to another host.
    pub fn serve_in(&self, task: AbortHandle) {
        let mut state = self.shares.state();
        if let Some(held) = state
            .hosts
            .get_mut(&self.host)
            .and_then(|held| held.iter_mut().find(|h| h.id == self.id))
        {
            held.task = Some(task);
        }
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut state = self.shares.state();
        let Some(held) = state.hosts.get_mut(&self.host) else {
            return;
        };
        let before = held.len();
        held.retain(|h| h.id != self.id);
        let removed = before - held.len();
        if held.is_empty() {
            state.hosts.remove(&self.host);
        }
        state.held -= removed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(ip: &str) -> Host {
        host_of(Some(ip.parse().unwrap()))
    }

    #[test]
    fn one_host_holds_every_free_slot_until_another_comes_for_its_share() {
        let shares = ConnectionShares::new(8);
        let (a, b, c) = (host("10.0.0.1"), host("10.0.0.2"), host("10.0.0.3"));
        let mut held_by_a: Vec<_> = (0..8).map(|_| shares.admit(a).unwrap()).collect();
        assert!(shares.admit(a).is_none(), "no more than every slot");
        // Another host takes slots from the first up to an equal share.
        let held_by_b: Vec<_> = (0..4).map(|_| shares.admit(b).unwrap()).collect();
        assert_eq!((shares.held_by(a), shares.held_by(b)), (4, 4));
        assert!(shares.admit(b).is_none(), "not past its share");
        // A third host's share is 8 / 3: it takes from the biggest.
        let held_by_c: Vec<_> = (0..2).map(|_| shares.admit(c).unwrap()).collect();
        assert_eq!(
            (shares.held_by(a), shares.held_by(b), shares.held_by(c)),
            (3, 3, 2)
        );
        assert!(shares.admit(c).is_none());
        // A slot freed is anyone's again.
        held_by_a.clear();
        assert_eq!(shares.held_by(a), 0);
        assert!(shares.admit(c).is_some());
        drop((held_by_b, held_by_c));
    }

    #[test]
    fn ipv6_hosts_are_their_64s() {
        assert_eq!(host("2001:db8:1:2::1"), host("2001:db8:1:2:ffff::9"));
        assert_ne!(host("2001:db8:1:2::1"), host("2001:db8:1:3::1"));
    }
}
