//! Frames over transports with small message and buffer limits: WebRTC data
//! channels as libp2p-webrtc and browsers have them (see TOOLCHAIN.md).
//!
//! Two rules make megabyte frames pass:
//! - every write is a piece of at most [`MAX_PIECE`] bytes, flushed on its
//!   own (the server side of a data channel takes ~8 KB per message, and
//!   unflushed writes merge into one message);
//! - toward a receiver that holds only so many unread bytes (a browser:
//!   16 KiB per stream), the sender keeps at most `window` bytes unacknowledged,
//!   and the receiver acknowledges, as a cumulative byte count in an `Ack`
//!   frame, only what it has read.
//!
//! Both ends count every byte of the flow-controlled direction since the
//! stream opened, frame headers included.

use std::io;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::framing::{length_prefixed, FrameReader};
use crate::limits::Limits;
use crate::protocol::{Request, MAX_MESSAGE_LEN};

/// The largest write on a flow-controlled stream.
pub const MAX_PIECE: usize = 8000;

/// The smallest window a server grants: below one piece, every piece would
/// wait for its own acknowledgement, and a peer could hold a session with a
/// trickle.
pub const MIN_WINDOW: u32 = MAX_PIECE as u32;

/// The window a browser asks for: under its 16 KiB of unread bytes per stream.
pub const BROWSER_WINDOW: u32 = 16_000;

/// Writes `bytes` in flushed pieces of at most `piece` bytes.
async fn write_pieces<W: AsyncWrite + Unpin>(
    io: &mut W,
    bytes: &[u8],
    piece: usize,
) -> io::Result<()> {
    for chunk in bytes.chunks(piece.max(1)) {
        io.write_all(chunk).await?;
        io.flush().await?;
    }
    Ok(())
}

/// Writes one length-prefixed frame in flushed pieces of at most [`MAX_PIECE`]
/// bytes (the direction toward a server, which needs no window).
pub async fn write_frame_in_pieces<W: AsyncWrite + Unpin>(
    io: &mut W,
    payload: &[u8],
) -> io::Result<()> {
    write_pieces(io, &length_prefixed(payload)?, MAX_PIECE).await
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// The sending end of a flow-controlled direction.
#[derive(Debug)]
pub struct FlowSender {
    window: u64,
    sent: u64,
    acked: u64,
}

impl FlowSender {
    /// `window` is the most unacknowledged bytes in flight (at least 1).
    pub fn new(window: u32) -> Self {
        FlowSender {
            window: u64::from(window.max(1)),
            sent: 0,
            acked: 0,
        }
    }

    /// Takes the receiver's cumulative count; it may not go back or past
    /// what was sent.
    pub fn on_ack(&mut self, received: u64) -> io::Result<()> {
        if received < self.acked || received > self.sent {
            return Err(invalid(format!(
                "acknowledgement of {received} bytes, with {} acknowledged and {} sent",
                self.acked, self.sent
            )));
        }
        self.acked = received;
        Ok(())
    }

    /// Writes one frame, waiting for acknowledgements (read from `io`
    /// through `reader`, the stream's one reader, where nothing else may
    /// arrive meanwhile) whenever the window is full.
    pub async fn write_frame<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        reader: &mut FrameReader,
        payload: &[u8],
    ) -> io::Result<()> {
        let frame = length_prefixed(payload)?;
        let piece = (self.window as usize).min(MAX_PIECE);
        for chunk in frame.chunks(piece) {
            while self.sent + chunk.len() as u64 > self.acked + self.window {
                let Some(ack) = reader.next_frame(io).await? else {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                };
                if ack.len() > MAX_MESSAGE_LEN {
                    return Err(invalid("expected an acknowledgement while sending"));
                }
                match Request::decode(ack, &Limits::DEFAULT) {
                    Ok(Request::Ack { received }) => self.on_ack(received)?,
                    _ => return Err(invalid("expected an acknowledgement while sending")),
                }
            }
            io.write_all(chunk).await?;
            io.flush().await?;
            self.sent += chunk.len() as u64;
        }
        Ok(())
    }
}

/// The receiving end of a flow-controlled direction.
#[derive(Debug)]
pub struct FlowReceiver {
    /// Acknowledge after this many unacknowledged bytes have been read.
    ack_every: u64,
    received: u64,
    acked: u64,
}

impl FlowReceiver {
    /// For a sender with `window`: acknowledging every half window keeps it
    /// sending while the receiver reads.
    pub fn new(window: u32) -> Self {
        FlowReceiver {
            ack_every: u64::from((window / 2).max(1)),
            received: 0,
            acked: 0,
        }
    }

    async fn ack<S: AsyncWrite + Unpin>(&mut self, io: &mut S, force: bool) -> io::Result<()> {
        if self.received > self.acked && (force || self.received - self.acked >= self.ack_every) {
            let frame = Request::Ack {
                received: self.received,
            }
            .encode();
            write_frame_in_pieces(io, &frame).await?;
            self.acked = self.received;
        }
        Ok(())
    }

    async fn read_acking<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        out: &mut [u8],
    ) -> io::Result<usize> {
        let mut filled = 0;
        while filled < out.len() {
            let want = (out.len() - filled).min(self.ack_every as usize);
            let n = io.read(&mut out[filled..filled + want]).await?;
            if n == 0 {
                break;
            }
            filled += n;
            self.received += n as u64;
            self.ack(io, false).await?;
        }
        Ok(filled)
    }

    /// Reads one frame into `buf`, acknowledging as it reads and once more at
    /// its end. Returns `false` on a clean end of stream before a frame.
    pub async fn read_frame<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut S,
        max_len: usize,
        buf: &mut Vec<u8>,
    ) -> io::Result<bool> {
        let mut len = [0u8; 4];
        let got = self.read_acking(io, &mut len).await?;
        if got == 0 {
            return Ok(false);
        }
        if got < 4 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > max_len {
            return Err(invalid(format!(
                "frame of {len} bytes exceeds the limit of {max_len}"
            )));
        }
        buf.clear();
        let mut piece = vec![0u8; (self.ack_every as usize).min(len)];
        while buf.len() < len {
            let want = (len - buf.len()).min(piece.len());
            let got = self.read_acking(io, &mut piece[..want]).await?;
            if got < want {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf.extend_from_slice(&piece[..got]);
        }
        self.ack(io, true).await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing::read_frame;
    use futures::executor::block_on;
    use futures::io::{AsyncRead, AsyncWrite};
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Waker};

    /// One direction of an in-memory stream that behaves like a WebRTC data
    /// channel toward a browser: each flushed write is one message of at most
    /// `max_message` bytes, and more than `max_unread` unread bytes is an error.
    #[derive(Default)]
    struct Pipe {
        unread: std::collections::VecDeque<u8>,
        pending_message: usize,
        max_message: usize,
        max_unread: usize,
        messages: Vec<usize>,
        reader: Option<Waker>,
    }

    #[derive(Clone)]
    struct End {
        incoming: Arc<Mutex<Pipe>>,
        outgoing: Arc<Mutex<Pipe>>,
    }

    /// (server end, browser end): messages of at most `max_message` bytes
    /// both ways; at most `browser_unread` unread bytes toward the browser.
    fn pair(max_message: usize, browser_unread: usize) -> (End, End) {
        let a = Arc::new(Mutex::new(Pipe {
            max_message,
            max_unread: usize::MAX,
            ..Pipe::default()
        }));
        let b = Arc::new(Mutex::new(Pipe {
            max_message,
            max_unread: browser_unread,
            ..Pipe::default()
        }));
        (
            End {
                incoming: a.clone(),
                outgoing: b.clone(),
            },
            End {
                incoming: b,
                outgoing: a,
            },
        )
    }

    impl AsyncRead for End {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut [u8],
        ) -> Poll<io::Result<usize>> {
            let mut p = self.incoming.lock().unwrap();
            if p.unread.is_empty() {
                p.reader = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let n = buf.len().min(p.unread.len());
            for b in buf.iter_mut().take(n) {
                *b = p.unread.pop_front().unwrap();
            }
            Poll::Ready(Ok(n))
        }
    }

    impl AsyncWrite for End {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let mut p = self.outgoing.lock().unwrap();
            p.pending_message += buf.len();
            if p.pending_message > p.max_message {
                return Poll::Ready(Err(invalid(format!(
                    "message of {} bytes",
                    p.pending_message
                ))));
            }
            p.unread.extend(buf);
            if p.unread.len() > p.max_unread {
                return Poll::Ready(Err(invalid(format!(
                    "{} unread bytes: overloaded",
                    p.unread.len()
                ))));
            }
            if let Some(w) = p.reader.take() {
                w.wake();
            }
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            let mut p = self.outgoing.lock().unwrap();
            let size = std::mem::take(&mut p.pending_message);
            if size > 0 {
                p.messages.push(size);
            }
            Poll::Ready(Ok(()))
        }
        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn four_mib_pass_both_ways_within_the_limits() {
        let (mut server, mut browser) = pair(8187, 16384);
        let big = payload(4 << 20);
        block_on(async {
            // Browser to server: pieces only.
            let up = async {
                write_frame_in_pieces(&mut browser.clone(), &big)
                    .await
                    .unwrap();
            };
            let down = async {
                let mut buf = Vec::new();
                assert!(read_frame(&mut server.clone(), 8 << 20, &mut buf)
                    .await
                    .unwrap());
                buf
            };
            let (_, got) = futures::join!(up, down);
            assert_eq!(got, big);

            // Server to browser: pieces under the window, acknowledged.
            let mut sender = FlowSender::new(BROWSER_WINDOW);
            let mut receiver = FlowReceiver::new(BROWSER_WINDOW);
            let send = async {
                let mut reader = FrameReader::new(1 << 20);
                sender
                    .write_frame(&mut server, &mut reader, &big)
                    .await
                    .unwrap();
                sender
                    .write_frame(&mut server, &mut reader, b"small")
                    .await
                    .unwrap();
            };
            let recv = async {
                let mut a = Vec::new();
                let mut b = Vec::new();
                assert!(receiver
                    .read_frame(&mut browser, 8 << 20, &mut a)
                    .await
                    .unwrap());
                assert!(receiver
                    .read_frame(&mut browser, 8 << 20, &mut b)
                    .await
                    .unwrap());
                (a, b)
            };
            let (_, (a, b)) = futures::join!(send, recv);
            assert_eq!(a, big);
            assert_eq!(b, b"small");
        });
        let (server_in, browser_in) = (
            server.incoming.lock().unwrap(),
            browser.incoming.lock().unwrap(),
        );
        assert!(server_in.messages.iter().all(|&m| m <= MAX_PIECE));
        assert!(browser_in.messages.iter().all(|&m| m <= MAX_PIECE));
        assert!(browser_in.messages.len() > (4 << 20) / MAX_PIECE);
    }

    #[test]
    fn the_plain_framing_overloads_the_browser() {
        let (mut server, _browser) = pair(usize::MAX, 16384);
        let err =
            block_on(crate::framing::write_frame(&mut server, &payload(64 << 10))).unwrap_err();
        assert!(err.to_string().contains("overloaded"), "{err}");
    }

    #[test]
    fn bad_acknowledgements_are_errors() {
        let mut s = FlowSender::new(100);
        assert!(s.on_ack(1).is_err(), "nothing was sent");
        s.sent = 50;
        s.on_ack(40).unwrap();
        assert!(s.on_ack(30).is_err(), "went back");
        assert!(s.on_ack(51).is_err(), "past what was sent");
    }
}
