//! Length-prefixed frames over any async byte stream: a `u32` little-endian
//! length, then that many bytes. The length is checked against the limit,
//! and the buffer grows only as the bytes arrive: an announced length costs
//! nothing until the peer has sent that much.

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use std::io;

/// Reads one frame into `buf` (replacing its contents). Returns `false` on a
/// clean end of stream before a new frame.
pub async fn read_frame<R: AsyncRead + Unpin>(
    io: &mut R,
    max_len: usize,
    buf: &mut Vec<u8>,
) -> io::Result<bool> {
    let mut len = [0u8; 4];
    let mut filled = 0;
    while filled < 4 {
        let n = io.read(&mut len[filled..]).await?;
        if n == 0 {
            return if filled == 0 {
                Ok(false)
            } else {
                Err(io::ErrorKind::UnexpectedEof.into())
            };
        }
        filled += n;
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max_len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max_len}"),
        ));
    }
    read_body(io, len, buf).await?;
    Ok(true)
}

/// Reads exactly `len` bytes into `buf` (replacing its contents), growing it
/// as they arrive rather than to `len` up front.
pub(crate) async fn read_body<R: AsyncRead + Unpin>(
    io: &mut R,
    len: usize,
    buf: &mut Vec<u8>,
) -> io::Result<()> {
    buf.clear();
    if buf.capacity() > len.max(GROWTH_STEP) {
        // Do not keep a past frame's megabytes for small frames.
        buf.shrink_to(len.max(GROWTH_STEP));
    }
    while buf.len() < len {
        let want = (len - buf.len()).min(GROWTH_STEP);
        let got = (&mut *io).take(want as u64).read_to_end(buf).await?;
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

/// How much a frame's buffer grows per read at most.
const GROWTH_STEP: usize = 64 * 1024;

/// Reads frames one after another and keeps a partly read frame between
/// calls, so [`FrameReader::next_frame`] may be cancelled (a `select!` arm
/// losing to another) without losing or desynchronising a byte: each await
/// is one read whose bytes are stored before anything else awaits.
#[derive(Debug)]
pub struct FrameReader {
    max_len: usize,
    header: [u8; 4],
    header_filled: usize,
    body: Vec<u8>,
    /// The body's announced length, once the header is complete.
    body_len: Option<usize>,
    /// The last frame was handed out; the next call starts a new one.
    done: bool,
}

impl FrameReader {
    pub fn new(max_len: usize) -> Self {
        FrameReader {
            max_len,
            header: [0; 4],
            header_filled: 0,
            body: Vec::new(),
            body_len: None,
            done: false,
        }
    }

    /// Frames longer than `max_len` are refused from the next frame on.
    pub fn set_max_len(&mut self, max_len: usize) {
        self.max_len = max_len;
    }

    /// The frame [`Self::next_frame`] returned last (empty before any).
    pub fn frame(&self) -> &[u8] {
        if self.done {
            &self.body
        } else {
            &[]
        }
    }

    /// Bytes of a frame read but not yet complete.
    pub fn in_progress(&self) -> bool {
        !self.done && (self.header_filled > 0 || self.body_len.is_some())
    }

    /// The next frame's body, or `None` at a clean end of stream. Cancel-safe.
    pub async fn next_frame<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
    ) -> io::Result<Option<&[u8]>> {
        if self.done {
            self.done = false;
            self.header_filled = 0;
            self.body_len = None;
            self.body.clear();
            if self.body.capacity() > GROWTH_STEP {
                self.body.shrink_to(GROWTH_STEP);
            }
        }
        while self.header_filled < 4 {
            let n = io.read(&mut self.header[self.header_filled..]).await?;
            if n == 0 {
                return if self.header_filled == 0 {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
            self.header_filled += n;
        }
        let len = match self.body_len {
            Some(len) => len,
            None => {
                let len = u32::from_le_bytes(self.header) as usize;
                if len > self.max_len {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("frame of {len} bytes exceeds the limit of {}", self.max_len),
                    ));
                }
                self.body_len = Some(len);
                len
            }
        };
        let mut chunk = [0u8; 8192];
        while self.body.len() < len {
            let want = (len - self.body.len()).min(chunk.len());
            let n = io.read(&mut chunk[..want]).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // Grows with what arrived, never from the announced length.
            self.body.extend_from_slice(&chunk[..n]);
        }
        self.done = true;
        Ok(Some(&self.body))
    }
}

/// Frames up to this size leave in one write, their length copied in front:
/// over yamux each write is a frame of its own (a message to the connection
/// task, a noise message, a wake-up of the reader), which a decode step's
/// few KiB paid twice on every hop.
const ONE_WRITE_UP_TO: usize = 1 << 20;

/// `payload` with its `u32` little-endian length in front.
pub(crate) fn length_prefixed(payload: &[u8]) -> io::Result<Vec<u8>> {
    let len = frame_len(payload)?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(payload);
    Ok(frame)
}

fn frame_len(payload: &[u8]) -> io::Result<u32> {
    u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame larger than 4 GiB"))
}

/// Writes one frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin>(io: &mut W, payload: &[u8]) -> io::Result<()> {
    if payload.len() <= ONE_WRITE_UP_TO {
        io.write_all(&length_prefixed(payload)?).await?;
    } else {
        io.write_all(&frame_len(payload)?.to_le_bytes()).await?;
        io.write_all(payload).await?;
    }
    io.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use futures::io::Cursor;

    #[test]
    fn frames_round_trip_and_limits_hold() {
        block_on(async {
            let mut wire = Cursor::new(Vec::new());
            write_frame(&mut wire, b"hello").await.unwrap();
            write_frame(&mut wire, b"").await.unwrap();
            let bytes = wire.into_inner();
            let mut r = Cursor::new(bytes.clone());
            let mut buf = Vec::new();
            assert!(read_frame(&mut r, 16, &mut buf).await.unwrap());
            assert_eq!(buf, b"hello");
            assert!(read_frame(&mut r, 16, &mut buf).await.unwrap());
            assert!(buf.is_empty());
            assert!(!read_frame(&mut r, 16, &mut buf).await.unwrap());

            let err = read_frame(&mut Cursor::new(bytes.clone()), 4, &mut buf)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            let err = read_frame(&mut Cursor::new(bytes[..6].to_vec()), 16, &mut buf)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        });
    }

    #[test]
    fn a_frame_reader_survives_cancellation_mid_frame() {
        use futures::FutureExt;
        // A reader that yields one byte per poll and is Pending every other poll.
        struct Trickle {
            bytes: Vec<u8>,
            at: usize,
            pending: bool,
        }
        impl AsyncRead for Trickle {
            fn poll_read(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                out: &mut [u8],
            ) -> std::task::Poll<io::Result<usize>> {
                self.pending = !self.pending;
                if self.pending {
                    cx.waker().wake_by_ref();
                    return std::task::Poll::Pending;
                }
                if self.at == self.bytes.len() || out.is_empty() {
                    return std::task::Poll::Ready(Ok(0));
                }
                out[0] = self.bytes[self.at];
                self.at += 1;
                std::task::Poll::Ready(Ok(1))
            }
        }
        let mut wire = Cursor::new(Vec::new());
        block_on(async {
            write_frame(&mut wire, b"first frame").await.unwrap();
            write_frame(&mut wire, b"second").await.unwrap();
        });
        let mut io = Trickle {
            bytes: wire.into_inner(),
            at: 0,
            pending: false,
        };
        let mut reader = FrameReader::new(64);
        let mut frames = Vec::new();
        // Poll once and drop the future, over and over: every byte still lands.
        for _ in 0..1000 {
            let next = reader.next_frame(&mut io).now_or_never();
            match next {
                Some(Ok(Some(frame))) => frames.push(frame.to_vec()),
                Some(Ok(None)) => break,
                Some(Err(e)) => panic!("{e}"),
                None => {}
            }
        }
        assert_eq!(frames, vec![b"first frame".to_vec(), b"second".to_vec()]);
    }

    #[test]
    fn an_announced_length_allocates_only_what_arrived() {
        block_on(async {
            // 100 MB announced, 10 bytes sent.
            let mut wire = (100_000_000u32).to_le_bytes().to_vec();
            wire.extend_from_slice(&[7; 10]);
            let mut buf = Vec::new();
            let err = read_frame(&mut Cursor::new(wire), 200_000_000, &mut buf)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
            assert!(buf.capacity() <= 2 * GROWTH_STEP, "{}", buf.capacity());

            let big = vec![3u8; 1_000_000];
            let mut wire = Cursor::new(Vec::new());
            write_frame(&mut wire, &big).await.unwrap();
            let mut r = Cursor::new(wire.into_inner());
            assert!(read_frame(&mut r, 2_000_000, &mut buf).await.unwrap());
            assert_eq!(buf, big);
        });
    }
}
