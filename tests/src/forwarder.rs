//! A TCP forwarder between a test's client and a server, which can cut
//! every connection after a number of bytes towards the client: a dropped
//! connection mid-download, on demand. Plain threads, so it works for any
//! protocol on top (HTTP, TLS).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Forwards `127.0.0.1:<port>` to a target until dropped.
pub struct Forwarder {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    accept: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Forwards to `target`; with `cut_after`, each connection is closed
    /// once it has carried that many bytes towards the client.
    pub fn start(target: SocketAddr, cut_after: Option<u64>) -> io::Result<Forwarder> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let accept = {
            let (stop, cuts) = (stop.clone(), cuts.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let cuts = cuts.clone();
                    std::thread::spawn(move || {
                        if let Err(e) = forward(client, target, cut_after, &cuts) {
                            eprintln!("forwarder: {e}");
                        }
                    });
                }
            })
        };
        Ok(Forwarder {
            addr,
            stop,
            cuts,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections closed because they reached `cut_after`.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees `stop`.
        let _ = TcpStream::connect(self.addr);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn forward(
    client: TcpStream,
    target: SocketAddr,
    cut_after: Option<u64>,
    cuts: &AtomicUsize,
) -> io::Result<()> {
    let server = TcpStream::connect(target)?;
    let (mut client_in, mut server_out) = (client.try_clone()?, server.try_clone()?);
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut client_in, &mut server_out);
        let _ = server_out.shutdown(Shutdown::Write);
    });
    let (mut server_in, mut client_out) = (server, client);
    let mut sent = 0u64;
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        let room = cut_after.map_or(buffer.len() as u64, |limit| limit - sent);
        if room == 0 {
            cuts.fetch_add(1, Ordering::SeqCst);
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
    }
    let _ = up.join();
    Ok(())
}
