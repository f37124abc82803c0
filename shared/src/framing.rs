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

/// Writes one frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin>(io: &mut W, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame larger than 4 GiB"))?;
    io.write_all(&len.to_le_bytes()).await?;
    io.write_all(payload).await?;
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
