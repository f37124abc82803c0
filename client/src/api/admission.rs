//! Who gets one of the API's answer places (answers generated at once),
//! shared between client addresses. One host's burst must not make every
//! other host wait behind it, nor be refused after it ended: a request
//! waits for a place at most [`PATIENCE`], a freed place goes to the
//! waiter whose host holds the fewest (the oldest among equals), a host
//! may queue at most as many requests as there are places, and a host
//! that holds its share (the places over the hosts holding or waiting)
//! while others wait is refused at once. Refusals are `busy` (429) with
//! `Retry-After`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use corolla_http::{host_of, Host};
use tokio::sync::Notify;

use super::error::ApiError;

/// The longest a request waits for an answer place.
pub(super) const PATIENCE: Duration = Duration::from_secs(20);

pub(super) struct Admission {
    places: usize,
    state: Mutex<State>,
    freed: Notify,
}

#[derive(Default)]
struct State {
    next_id: u64,
    held: HashMap<Host, usize>,
    /// Waiting requests, oldest first.
    waiting: Vec<(u64, Host)>,
}

impl State {
    fn held_by(&self, host: &Host) -> usize {
        self.held.get(host).copied().unwrap_or(0)
    }

    fn held(&self) -> usize {
        self.held.values().sum()
    }

    /// The places over the hosts holding or waiting (`host` counted).
    fn share(&self, places: usize, host: &Host) -> usize {
        let mut hosts: Vec<&Host> = self
            .held
            .keys()
            .chain(self.waiting.iter().map(|(_, h)| h))
            .chain([host])
            .collect();
        hosts.sort();
        hosts.dedup();
        (places / hosts.len().max(1)).max(1)
    }

    /// The waiter a freed place goes to: fewest held by its host, then oldest.
    fn next_in_line(&self) -> Option<u64> {
        self.waiting
            .iter()
            .min_by_key(|(id, host)| (self.held_by(host), *id))
            .map(|(id, _)| *id)
    }
}

/// One answer place; dropping it frees the place for the next in line.
pub(super) struct AnswerPlace {
    admission: Arc<Admission>,
    host: Host,
}

impl Drop for AnswerPlace {
    fn drop(&mut self) {
        let mut state = self.admission.state();
        if let Some(n) = state.held.get_mut(&self.host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                state.held.remove(&self.host);
            }
        }
        drop(state);
        self.admission.freed.notify_waiters();
    }
}

impl Admission {
    pub(super) fn new(places: usize) -> Arc<Self> {
        Arc::new(Admission {
            places: places.max(1),
            state: Mutex::new(State::default()),
            freed: Notify::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An answer place for a request from `from`, waiting for one at most
    /// [`PATIENCE`]; see the module's header.
    pub(super) async fn admit(
        self: &Arc<Self>,
        from: Option<IpAddr>,
    ) -> Result<AnswerPlace, ApiError> {
        let host = host_of(from);
        let id = {
            let mut state = self.state();
            let mine = state.held_by(&host);
            let queued = state.waiting.iter().filter(|(_, h)| *h == host).count();
            let full = state.held() >= self.places;
            let others_wait = state.waiting.iter().any(|(_, h)| *h != host);
            let share = state.share(self.places, &host);
            if full && (queued >= self.places || (others_wait && mine >= share)) {
                return Err(ApiError::busy(
                    format!(
                        "busy: this address holds {mine} of the {} answers generated at once \
                         (its share: {share}) and has {queued} waiting",
                        self.places
                    ),
                    Duration::from_secs(1),
                ));
            }
            let id = state.next_id;
            state.next_id += 1;
            state.waiting.push((id, host));
            id
        };
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let _leave = Waiting {
            admission: self,
            id,
        };
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut state = self.state();
                if state.held() < self.places && state.next_in_line() == Some(id) {
                    state.waiting.retain(|(w, _)| *w != id);
                    *state.held.entry(host).or_insert(0) += 1;
                    return Ok(AnswerPlace {
                        admission: self.clone(),
                        host,
                    });
                }
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(ApiError::busy(
                    format!(
                        "busy: all {} answer places stayed in use for {} s",
                        self.places,
                        PATIENCE.as_secs()
                    ),
                    Duration::from_secs(5),
                ));
            }
        }
    }

    /// Answers generated now.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> usize {
        self.state().held()
    }
}

/// Takes a waiter out of line when its request ends (answered, refused,
/// or its connection dropped), and lets the next one look.
struct Waiting<'a> {
    admission: &'a Admission,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let id = self.id;
        self.admission.state().waiting.retain(|(w, _)| *w != id);
        self.admission.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[tokio::test]
    async fn a_burst_from_one_host_leaves_room_for_another_and_ends_with_itself() {
        let admission = Admission::new(2);
        // One host takes both places and queues two more; the fifth is refused.
        let burst_a = admission.admit(ip("5.5.5.5")).await.unwrap();
        let burst_b = admission.admit(ip("5.5.5.5")).await.unwrap();
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let admission = admission.clone();
                tokio::spawn(async move { admission.admit(ip("5.5.5.5")).await.map(|_| ()) })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let refused = admission.admit(ip("5.5.5.5")).await.err().unwrap();
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        // Another host waits, and gets the first freed place before the burst's queue.
        let other = {
            let admission = admission.clone();
            tokio::spawn(async move { admission.admit(ip("9.9.9.9")).await.map(|p| p.host) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        // While it waits, the burst's host (at its share) is refused at once.
        let refused = admission.admit(ip("5.5.5.5")).await.err().unwrap();
        assert!(refused.message.contains("share"), "{}", refused.message);
        drop(burst_a);
        let got = tokio::time::timeout(Duration::from_secs(1), other)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(got, host_of(ip("9.9.9.9")));
        drop(burst_b);
        // The burst's queue is served after; nothing is left held.
        for w in waiting {
            tokio::time::timeout(Duration::from_secs(1), w)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
        assert_eq!(admission.in_use(), 0);
        assert!(admission.admit(ip("5.5.5.5")).await.is_ok());
    }
}
