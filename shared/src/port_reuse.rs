//! TCP dials from the listening port, falling back to a fresh port when the
//! kernel refuses that one.
//!
//! Dialing from the port a node listens on is what lets a TCP hole punch
//! through a NAT, so libp2p does it by default. But the kernel sometimes
//! refuses to bind or connect a second socket from that port ("address
//! already in use": seen for 30 s on end between two servers on loopback,
//! so that one server never reached the peer it joined through and stayed
//! out of the DHT). libp2p retries from a fresh port only when the connect
//! reports the address unavailable; this wrapper does it for both refusals,
//! at bind or at connect. A fresh port loses nothing but the hole punch,
//! which a refused dial would not have made either.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::FutureExt;
use libp2p::core::transport::{DialOpts, ListenerId, PortUse, TransportError, TransportEvent};
use libp2p::core::Transport;
use libp2p::Multiaddr;

/// `inner` for listening and for dials; `fresh` (the same transport without
/// listeners) for dials the kernel refused from the listening port.
pub struct FreshPortOnRefusal<T> {
    inner: T,
    fresh: Arc<Mutex<T>>,
}

impl<T> FreshPortOnRefusal<T> {
    pub fn new(inner: T, fresh: T) -> Self {
        FreshPortOnRefusal {
            inner,
            fresh: Arc::new(Mutex::new(fresh)),
        }
    }
}

/// The errors that say the socket's local address, not the peer, is the
/// trouble.
fn local_port_refused(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::AddrInUse | io::ErrorKind::AddrNotAvailable
    )
}

fn into_io(e: TransportError<io::Error>) -> io::Error {
    match e {
        TransportError::Other(e) => e,
        TransportError::MultiaddrNotSupported(addr) => {
            io::Error::other(format!("{addr} is not a TCP address"))
        }
    }
}

impl<T> Transport for FreshPortOnRefusal<T>
where
    T: Transport<Error = io::Error> + Unpin + Send + 'static,
    T::Output: Send + 'static,
    T::Dial: Send + 'static,
{
    type Output = T::Output;
    type Error = io::Error;
    type ListenerUpgrade = T::ListenerUpgrade;
    type Dial = BoxFuture<'static, io::Result<T::Output>>;

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
        let first = self.inner.dial(addr.clone(), opts)?;
        if opts.port_use == PortUse::New {
            return Ok(first.boxed());
        }
        let fresh = self.fresh.clone();
        Ok(async move {
            match first.await {
                Err(e) if local_port_refused(&e) => {
                    tracing::debug!(%addr, error = %e, "the listening port cannot dial there now; dialing from a fresh port");
                    let dial = fresh
                        .lock()
                        .map_err(|_| io::Error::other("the fresh-port transport panicked"))?
                        .dial(
                            addr,
                            DialOpts {
                                port_use: PortUse::New,
                                ..opts
                            },
                        )
                        .map_err(into_io)?;
                    dial.await
                }
                other => other,
            }
        }
        .boxed())
    }

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<TransportEvent<Self::ListenerUpgrade, io::Error>> {
        Pin::new(&mut self.get_mut().inner).poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::{ready, Ready};
    use libp2p::core::Endpoint;

    /// Answers dials from the listening port with `reused_fails` (when
    /// set) and dials from fresh ports with success; records each dial.
    struct Scripted {
        reused_fails: Option<io::ErrorKind>,
        dials: Arc<Mutex<Vec<PortUse>>>,
    }

    impl Transport for Scripted {
        type Output = PortUse;
        type Error = io::Error;
        type ListenerUpgrade = Ready<io::Result<PortUse>>;
        type Dial = Ready<io::Result<PortUse>>;

        fn listen_on(
            &mut self,
            _: ListenerId,
            a: Multiaddr,
        ) -> Result<(), TransportError<io::Error>> {
            Err(TransportError::MultiaddrNotSupported(a))
        }

        fn remove_listener(&mut self, _: ListenerId) -> bool {
            false
        }

        fn dial(
            &mut self,
            _: Multiaddr,
            opts: DialOpts,
        ) -> Result<Self::Dial, TransportError<io::Error>> {
            self.dials.lock().unwrap().push(opts.port_use);
            Ok(ready(match (opts.port_use, self.reused_fails) {
                (PortUse::Reuse, Some(kind)) => Err(io::Error::from(kind)),
                (port_use, _) => Ok(port_use),
            }))
        }

        fn poll(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<TransportEvent<Self::ListenerUpgrade, io::Error>> {
            Poll::Pending
        }
    }

    /// Dials once with `port_use` through the wrapper; returns the outcome
    /// and every dial the scripted transports saw, in order.
    fn dial_once(
        reused_fails: Option<io::ErrorKind>,
        port_use: PortUse,
    ) -> (io::Result<PortUse>, Vec<PortUse>) {
        let dials = Arc::new(Mutex::new(Vec::new()));
        let scripted = || Scripted {
            reused_fails,
            dials: dials.clone(),
        };
        let mut transport = FreshPortOnRefusal::new(scripted(), scripted());
        let opts = DialOpts {
            role: Endpoint::Dialer,
            port_use,
        };
        let addr: Multiaddr = "/ip4/127.0.0.1/tcp/4001".parse().unwrap();
        let outcome = futures::executor::block_on(transport.dial(addr, opts).unwrap());
        let seen = dials.lock().unwrap().clone();
        (outcome, seen)
    }

    #[test]
    fn a_refused_listening_port_is_dialed_again_from_a_fresh_one() {
        for kind in [io::ErrorKind::AddrInUse, io::ErrorKind::AddrNotAvailable] {
            let (outcome, dials) = dial_once(Some(kind), PortUse::Reuse);
            assert_eq!(outcome.unwrap(), PortUse::New, "{kind:?}");
            assert_eq!(dials, [PortUse::Reuse, PortUse::New], "{kind:?}");
        }
    }

    #[test]
    fn a_peer_refusing_is_not_dialed_twice() {
        let (outcome, dials) = dial_once(Some(io::ErrorKind::ConnectionRefused), PortUse::Reuse);
        assert_eq!(
            outcome.unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
        assert_eq!(dials, [PortUse::Reuse]);
    }

    #[test]
    fn dials_that_work_or_asked_for_a_fresh_port_are_dialed_once() {
        let (outcome, dials) = dial_once(None, PortUse::Reuse);
        assert_eq!(outcome.unwrap(), PortUse::Reuse);
        assert_eq!(dials, [PortUse::Reuse]);
        let (outcome, dials) = dial_once(Some(io::ErrorKind::AddrInUse), PortUse::New);
        assert_eq!(outcome.unwrap(), PortUse::New);
        assert_eq!(dials, [PortUse::New]);
    }
}
