//! Length-prefixed frames over any async byte stream: a `u32` little-endian
//! length, then that many bytes. The length is checked against the limit
//! before the buffer grows.

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
    buf.clear();
    buf.resize(len, 0);
    io.read_exact(buf).await?;
    Ok(true)
}

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
}
