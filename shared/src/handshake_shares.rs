//! Inbound handshakes shared between source addresses, the oldest evicted
//! first. A socket that connects and then stays silent holds a handshake
//! place until the transport's timeout; libp2p caps those places per peer
//! (there is no peer yet) and in total, so a crowd opening silent sockets
//! from a few hundred addresses held every place and no honest peer got
//! through. This wrapper around a server's transports keeps the places
//! itself: one host may hold a quarter, one network a half (hard caps: a
//! household or a test machine opens many at once);
//! when every place is held, a newcomer takes the oldest handshake of the
//! addresses holding more than their share ([`crate::fair_share`]), or
//! else the oldest of all once it is [`PATIENCE`] old (an honest handshake
//! is done in a few round trips), and is refused only when every handshake
//! is younger than that.

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::{select, BoxFuture, Either};
use futures::FutureExt;
use libp2p::core::transport::{DialOpts, ListenerId, TransportError, TransportEvent};
use libp2p::core::Transport;
use libp2p::Multiaddr;
use web_time::Instant;

use crate::fair_share;
use crate::source_address::{source_ip, AddressGroup};

/// A handshake this old gives its place to a newcomer when every place is
/// held: far more than a handshake needs over any real link.
pub const PATIENCE: Duration = Duration::from_secs(1);

/// The handshake places of all of a server's transports.
#[derive(Debug)]
pub struct HandshakeShares {
    max: usize,
    per_host: usize,
    per_network: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// Oldest first.
    pending: Vec<Pending>,
}

#[derive(Debug)]
struct Pending {
    id: u64,
    source: Option<IpAddr>,
    since: Instant,
    evict: Option<oneshot::Sender<()>>,
}

/// One handshake's place; dropping it gives the place back.
#[derive(Debug)]
pub struct HandshakePlace {
    shares: Arc<HandshakeShares>,
    id: u64,
    evicted: oneshot::Receiver<()>,
}

impl Drop for HandshakePlace {
    fn drop(&mut self) {
        let id = self.id;
        self.shares.state().pending.retain(|p| p.id != id);
    }
}

impl HandshakeShares {
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(HandshakeShares {
            max,
            per_host: (max / 4).max(1),
            per_network: (max / 2).max(1),
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Handshakes in progress now.
    pub fn in_progress(&self) -> usize {
        self.state().pending.len()
    }

    /// A place for a handshake from `source`, evicting another when every
    /// place is held and the rules in this module's header allow it.
    pub fn admit(self: &Arc<Self>, source: Option<IpAddr>, now: Instant) -> Option<HandshakePlace> {
        let mut state = self.state();
        if let Some(ip) = source {
            for (group, cap) in [
                (AddressGroup::host(ip), self.per_host),
                (AddressGroup::network(ip), self.per_network),
            ] {
                let held = state
                    .pending
                    .iter()
                    .filter(|p| p.source.is_some_and(|other| group.contains(other)))
                    .count();
                if held >= cap {
                    tracing::debug!(%group, cap, "handshake refused: its addresses hold their cap");
                    return None;
                }
            }
        }
        if state.pending.len() >= self.max {
            let crowded: Vec<u64> = fair_share::crowded(
                state.pending.iter().map(|p| (p.id, p.source)),
                source,
                self.max,
            );
            let victim = state
                .pending
                .iter()
                .position(|p| crowded.contains(&p.id))
                .or_else(|| {
                    state
                        .pending
                        .first()
                        .filter(|p| now.duration_since(p.since) >= PATIENCE)
                        .map(|_| 0)
                })?;
            let mut evicted = state.pending.remove(victim);
            tracing::debug!(source = ?evicted.source, "handshake evicted for a newcomer");
            if let Some(evict) = evicted.evict.take() {
                let _ = evict.send(());
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        let (evict, evicted) = oneshot::channel();
        state.pending.push(Pending {
            id,
            source,
            since: now,
            evict: Some(evict),
        });
        Some(HandshakePlace {
            shares: self.clone(),
            id,
            evicted,
        })
    }
}

/// A transport whose inbound handshakes hold places of one
/// [`HandshakeShares`]; dials are the inner transport's.
pub struct Shared<T> {
    inner: T,
    shares: Arc<HandshakeShares>,
}

impl<T> Shared<T> {
    pub fn new(inner: T, shares: Arc<HandshakeShares>) -> Self {
        Shared { inner, shares }
    }
}

impl<T> Transport for Shared<T>
where
    T: Transport<Error = io::Error> + Unpin,
    T::ListenerUpgrade: Send + 'static,
    T::Output: Send + 'static,
{
    type Output = T::Output;
    type Error = io::Error;
    type ListenerUpgrade = BoxFuture<'static, io::Result<T::Output>>;
    type Dial = T::Dial;

    fn listen_on(
        &mut self,
        id: ListenerId,
        addr: Multiaddr,
    ) -> Result<(), TransportError<io::Error>> {
        self.inner.listen_on(id, addr)
    }

    fn remove_listener(&mut self, id: ListenerId) -> bool {
        self.inner.remove_listener(id)
    }

    fn dial(
        &mut self,
        addr: Multiaddr,
        opts: DialOpts,
    ) -> Result<Self::Dial, TransportError<io::Error>> {
        self.inner.dial(addr, opts)
    }

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<TransportEvent<Self::ListenerUpgrade, io::Error>> {
        let this = self.get_mut();
        loop {
            let event = match Pin::new(&mut this.inner).poll(cx) {
                Poll::Ready(event) => event,
                Poll::Pending => return Poll::Pending,
            };
            let event = match event {
                TransportEvent::Incoming {
                    listener_id,
                    upgrade,
                    local_addr,
                    send_back_addr,
                } => {
                    let Some(place) = this
                        .shares
                        .admit(source_ip(&send_back_addr), Instant::now())
                    else {
                        // Dropping the upgrade closes the socket.
                        continue;
                    };
                    TransportEvent::Incoming {
                        listener_id,
                        upgrade: held_by(upgrade, Some(place)),
                        local_addr,
                        send_back_addr,
                    }
                }
                // Only `Incoming` carries an upgrade.
                other => other.map_upgrade(|upgrade| held_by(upgrade, None)),
            };
            return Poll::Ready(event);
        }
    }
}

/// `upgrade`, given up with an error when its place goes to a newcomer.
fn held_by<O: Send + 'static>(
    upgrade: impl std::future::Future<Output = io::Result<O>> + Send + 'static,
    place: Option<HandshakePlace>,
) -> BoxFuture<'static, io::Result<O>> {
    async move {
        let Some(mut place) = place else {
            return upgrade.await;
        };
        let evicted = (&mut place.evicted).map(|_| ());
        match select(Box::pin(upgrade), evicted).await {
            Either::Left((done, _)) => done,
            Either::Right(((), _)) => Err(io::Error::other(
                "handshake given up: every handshake place was held and a newcomer waited",
            )),
        }
    }
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn hosts_and_networks_hold_their_caps() {
        let shares = HandshakeShares::new(16);
        let now = Instant::now();
        let host: Vec<_> = (0..6)
            .filter_map(|_| shares.admit(ip("6.6.6.6"), now))
            .collect();
        assert_eq!(host.len(), 4, "a quarter of 16 per host");
        let network: Vec<_> = (0..6)
            .filter_map(|i| shares.admit(ip(&format!("6.6.6.{}", 10 + i)), now))
            .collect();
        assert_eq!(network.len(), 4, "half of 16 per network");
        drop(host);
        assert_eq!(shares.in_progress(), 4);
        assert!(shares.admit(ip("6.6.6.6"), now).is_some());
    }

    #[test]
    fn a_crowd_of_networks_loses_its_oldest_handshakes_to_newcomers() {
        let shares = HandshakeShares::new(16);
        let start = Instant::now();
        // Sixteen networks, one region: every place, all fresh.
        let mut crowd: Vec<HandshakePlace> = (0..16)
            .filter_map(|i| shares.admit(ip(&format!("6.6.{i}.1")), start))
            .collect();
        assert_eq!(crowd.len(), 16);
        // A newcomer from another region takes the crowd's oldest at once.
        assert!(shares.admit(ip("9.9.9.9"), start).is_some());
        assert!(crowd[0].evicted.try_recv().ok().flatten().is_some());
        // Sixteen regions with one each: nobody is over its share, but a
        // handshake older than PATIENCE gives way, oldest first.
        let spread = HandshakeShares::new(4);
        let mut held: Vec<HandshakePlace> = (0..4)
            .filter_map(|i| spread.admit(ip(&format!("{}.1.1.1", 10 + i)), start))
            .collect();
        assert!(spread.admit(ip("99.1.1.1"), start).is_none(), "all fresh");
        let later = start + PATIENCE;
        assert!(spread.admit(ip("99.1.1.1"), later).is_some());
        assert!(held[0].evicted.try_recv().ok().flatten().is_some());
        assert!(held[1].evicted.try_recv().ok().flatten().is_none());
    }
}
