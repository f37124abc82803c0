//! A TCP forwarder between a test's client and a server, in one of two
//! modes. Cutting: every connection is closed after a number of bytes
//! towards the client (a dropped connection mid-download, on demand), or
//! never, with the server seeing it come from a chosen loopback address
//! (many clients behind one address, on one machine).
//! Delaying: every chunk is delivered a set time after it was read, with
//! jitter and loss-like stalls (a slow link, since this machine's kernel
//! has no netem), optionally leaving from an address chosen per client so
//! the target still tells its clients' addresses apart. Plain threads, so
//! it works for any protocol on top (HTTP, TLS, libp2p).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a delaying forwarder does to each chunk, changeable while it runs
/// (one world can run at 20 ms, then at 50 ms).
#[derive(Debug, Default)]
pub struct LinkShape {
    one_way_us: AtomicU64,
    jitter_us: AtomicU64,
    /// Chance per chunk of a stall, in millionths.
    loss_ppm: AtomicU32,
}

/// A lost segment costs TCP about one retransmission timeout (Linux's
/// minimum RTO is 200 ms); the stall stands in for it.
pub const LOSS_STALL: Duration = Duration::from_millis(200);

impl LinkShape {
    /// Each chunk waits `one_way` plus a uniform share of `jitter`; with
    /// probability `loss` per chunk it also stalls for [`LOSS_STALL`].
    pub fn new(one_way: Duration, jitter: Duration, loss: f64) -> Arc<LinkShape> {
        let shape = Arc::new(LinkShape::default());
        shape.set(one_way, jitter, loss);
        shape
    }

    pub fn set(&self, one_way: Duration, jitter: Duration, loss: f64) {
        self.one_way_us
            .store(one_way.as_micros() as u64, Ordering::SeqCst);
        self.jitter_us
            .store(jitter.as_micros() as u64, Ordering::SeqCst);
        self.loss_ppm
            .store((loss.clamp(0.0, 1.0) * 1e6) as u32, Ordering::SeqCst);
    }

    pub fn one_way(&self) -> Duration {
        Duration::from_micros(self.one_way_us.load(Ordering::SeqCst))
    }

    pub fn jitter(&self) -> Duration {
        Duration::from_micros(self.jitter_us.load(Ordering::SeqCst))
    }

    pub fn loss(&self) -> f64 {
        self.loss_ppm.load(Ordering::SeqCst) as f64 / 1e6
    }

    /// The delay of one chunk: `one_way`, jitter and perhaps a stall.
    fn sample(&self, rng: &mut SplitMix) -> Duration {
        let jitter = self.jitter_us.load(Ordering::SeqCst);
        let mut us = self.one_way_us.load(Ordering::SeqCst);
        if jitter > 0 {
            us += rng.next() % (jitter + 1);
        }
        let loss = self.loss_ppm.load(Ordering::SeqCst) as u64;
        if loss > 0 && rng.next() % 1_000_000 < loss {
            us += LOSS_STALL.as_micros() as u64;
        }
        Duration::from_micros(us)
    }
}

/// Enough randomness for jitter, without a dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn seeded() -> SplitMix {
        static STREAMS: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        SplitMix(now ^ STREAMS.fetch_add(1, Ordering::SeqCst).rotate_left(32))
    }
}

#[derive(Clone)]
enum Mode {
    Cut {
        cut_after: Option<u64>,
        source: Option<IpAddr>,
    },
    Delay {
        shape: Arc<LinkShape>,
        source: SourceRule,
    },
}

/// The local address a forwarded connection leaves from, chosen from the
/// client's address (`None`: the kernel's choice).
pub type SourceRule = fn(IpAddr) -> Option<IpAddr>;

/// What the forwarder's connections share with it.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    cuts: AtomicUsize,
    connections: AtomicUsize,
    to_target: AtomicU64,
    from_target: AtomicU64,
    /// Live connections' sockets by connection number, shut down when the
    /// forwarder is dropped.
    open: Mutex<HashMap<usize, [TcpStream; 2]>>,
}

/// Forwards a listening address to a target until dropped.
pub struct Forwarder {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shape: Option<Arc<LinkShape>>,
    accept: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Forwards `127.0.0.1:<any port>` to `target`; with `cut_after`, each
    /// connection is closed once it has carried that many bytes towards
    /// the client.
    pub fn start(target: SocketAddr, cut_after: Option<u64>) -> io::Result<Forwarder> {
        Self::listen(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            target,
            Mode::Cut {
                cut_after,
                source: None,
            },
        )
    }

    /// Forwards `127.0.0.1:<any port>` to `target` from `source` (any
    /// address of this host: every `127.x.y.z` is one): the target sees
    /// each connection come from there.
    pub fn from_source(source: IpAddr, target: SocketAddr) -> io::Result<Forwarder> {
        Self::listen(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            target,
            Mode::Cut {
                cut_after: None,
                source: Some(source),
            },
        )
    }

    /// Forwards `listen` (any address of this host; port 0 picks one) to
    /// `target`, delaying both directions as `shape` says at each moment.
    pub fn delaying(
        listen: SocketAddr,
        target: SocketAddr,
        shape: Arc<LinkShape>,
    ) -> io::Result<Forwarder> {
        Self::listen(
            listen,
            target,
            Mode::Delay {
                shape,
                source: |_| None,
            },
        )
    }

    /// [`Self::delaying`], each connection leaving from the address
    /// `source` picks for its client. Without it the target sees every
    /// client at one address (this host's), and its per-address limits
    /// would count a whole world of peers as one.
    pub fn delaying_from(
        listen: SocketAddr,
        target: SocketAddr,
        shape: Arc<LinkShape>,
        source: SourceRule,
    ) -> io::Result<Forwarder> {
        Self::listen(listen, target, Mode::Delay { shape, source })
    }

    fn listen(listen: SocketAddr, target: SocketAddr, mode: Mode) -> io::Result<Forwarder> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let shape = match &mode {
            Mode::Delay { shape, .. } => Some(shape.clone()),
            Mode::Cut { .. } => None,
        };
        let accept = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if shared.stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let (shared, mode) = (shared.clone(), mode.clone());
                    std::thread::spawn(move || {
                        let id = shared.connections.fetch_add(1, Ordering::SeqCst);
                        let done = match mode {
                            Mode::Cut { cut_after, source } => {
                                forward(client, target, source, cut_after, &shared, id)
                            }
                            Mode::Delay { shape, source } => {
                                forward_delayed(client, target, shape, source, &shared, id)
                            }
                        };
                        shared
                            .open
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&id);
                        // A refused target is expected once a test killed its server.
                        if let Err(e) = done {
                            if e.kind() != io::ErrorKind::ConnectionRefused {
                                eprintln!("forwarder to {target}: {e}");
                            }
                        }
                    });
                }
            })
        };
        Ok(Forwarder {
            addr,
            shared,
            shape,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections closed because they reached `cut_after`.
    pub fn cuts(&self) -> usize {
        self.shared.cuts.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Bytes carried towards the target, over all connections.
    pub fn bytes_to_target(&self) -> u64 {
        self.shared.to_target.load(Ordering::SeqCst)
    }

    /// Bytes carried back from the target, over all connections.
    pub fn bytes_from_target(&self) -> u64 {
        self.shared.from_target.load(Ordering::SeqCst)
    }

    /// Both directions together.
    pub fn bytes(&self) -> u64 {
        self.bytes_to_target() + self.bytes_from_target()
    }

    /// A delaying forwarder's settings (`None` for a cutting one).
    pub fn shape(&self) -> Option<&Arc<LinkShape>> {
        self.shape.as_ref()
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees `stop`.
        let wake = if self.addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], self.addr.port()))
        } else {
            self.addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let open = std::mem::take(&mut *self.shared.open.lock().unwrap_or_else(|e| e.into_inner()));
        for socket in open.values().flatten() {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// Keeps clones of a connection's sockets for the forwarder's drop.
fn register(shared: &Shared, id: usize, [a, b]: [&TcpStream; 2]) -> io::Result<()> {
    let sockets = [a.try_clone()?, b.try_clone()?];
    shared
        .open
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, sockets);
    Ok(())
}

/// A TCP connection to `target` leaving from `source` (port chosen by the
/// kernel).
pub fn connect_from(source: IpAddr, target: SocketAddr) -> io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
    socket.bind(&SocketAddr::new(source, 0).into())?;
    socket.connect(&target.into())?;
    Ok(socket.into())
}

fn forward(
    client: TcpStream,
    target: SocketAddr,
    source: Option<IpAddr>,
    cut_after: Option<u64>,
    shared: &Arc<Shared>,
    id: usize,
) -> io::Result<()> {
    let server = match source {
        Some(source) => connect_from(source, target)?,
        None => TcpStream::connect(target)?,
    };
    register(shared, id, [&client, &server])?;
    let (mut client_in, mut server_out) = (client.try_clone()?, server.try_clone()?);
    let up = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let _ = copy_counting(&mut client_in, &mut server_out, &shared.to_target);
            let _ = server_out.shutdown(Shutdown::Write);
        })
    };
    let (mut server_in, mut client_out) = (server, client);
    let mut sent = 0u64;
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        let room = cut_after.map_or(buffer.len() as u64, |limit| limit - sent);
        if room == 0 {
            shared.cuts.fetch_add(1, Ordering::SeqCst);
            // Both ways at once: the client sees the connection drop.
            let _ = client_out.shutdown(Shutdown::Both);
            let _ = server_in.shutdown(Shutdown::Both);
            break;
        }
        let want = buffer.len().min(room as usize);
        let n = match server_in.read(&mut buffer[..want]) {
            Ok(0) | Err(_) => {
                let _ = client_out.shutdown(Shutdown::Write);
                break;
            }
            Ok(n) => n,
        };
        if client_out.write_all(&buffer[..n]).is_err() {
            let _ = server_in.shutdown(Shutdown::Both);
            break;
        }
        sent += n as u64;
        shared.from_target.fetch_add(n as u64, Ordering::SeqCst);
    }
    let _ = up.join();
    Ok(())
}

fn copy_counting(from: &mut TcpStream, to: &mut TcpStream, count: &AtomicU64) -> io::Result<()> {
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        let n = from.read(&mut buffer)?;
        if n == 0 {
            return Ok(());
        }
        to.write_all(&buffer[..n])?;
        count.fetch_add(n as u64, Ordering::SeqCst);
    }
}

fn forward_delayed(
    client: TcpStream,
    target: SocketAddr,
    shape: Arc<LinkShape>,
    source: SourceRule,
    shared: &Arc<Shared>,
    id: usize,
) -> io::Result<()> {
    let server = match client.peer_addr().ok().and_then(|peer| source(peer.ip())) {
        Some(from) => connect_from(from, target)?,
        None => TcpStream::connect(target)?,
    };
    // Small writes (one token's activations end in a short piece) must not
    // wait for Nagle's acknowledgement: that would add a round trip.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    register(shared, id, [&client, &server])?;
    let up = delayed_direction(
        client.try_clone()?,
        server.try_clone()?,
        &shape,
        shared,
        true,
    )?;
    let down = delayed_direction(server, client, &shape, shared, false)?;
    for half in up.into_iter().chain(down) {
        let _ = half.join();
    }
    Ok(())
}

/// One direction of a delaying connection: a reader that stamps each chunk
/// with its delivery time and a writer that delivers it then. The
/// deadlines never decrease, so jitter does not reorder the stream.
fn delayed_direction(
    mut from: TcpStream,
    mut to: TcpStream,
    shape: &Arc<LinkShape>,
    shared: &Arc<Shared>,
    towards_target: bool,
) -> io::Result<[JoinHandle<()>; 2]> {
    // An empty chunk stands for the end of the stream.
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let from_again = from.try_clone()?;
    let reader = {
        let shape = shape.clone();
        std::thread::spawn(move || {
            let mut rng = SplitMix::seeded();
            let mut last = Instant::now();
            let mut buffer = vec![0u8; 64 << 10];
            loop {
                let n = from.read(&mut buffer).unwrap_or(0);
                last = last.max(Instant::now() + shape.sample(&mut rng));
                if tx.send((last, buffer[..n].to_vec())).is_err() || n == 0 {
                    break;
                }
            }
        })
    };
    let writer = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let count = if towards_target {
                &shared.to_target
            } else {
                &shared.from_target
            };
            for (deadline, chunk) in rx {
                let now = Instant::now();
                if deadline > now {
                    std::thread::sleep(deadline - now);
                }
                if chunk.is_empty() {
                    let _ = to.shutdown(Shutdown::Write);
                    return;
                }
                if to.write_all(&chunk).is_err() {
                    break;
                }
                count.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            }
            // Delivery failed: a reset, as a real link would show it, and
            // the reader wakes up and ends.
            let _ = from_again.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
        })
    };
    Ok([reader, writer])
}
