//! The flow-controlled receiver reading frames from a peer's bytes: no
//! panic, no frame over the limit, buffers grown only as bytes arrive.
#![no_main]

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use corolla_shared::flow::FlowReceiver;
use futures::io::{AsyncRead, AsyncWrite};
use libfuzzer_sys::fuzz_target;

/// Reads the fuzzer's bytes in pieces of their own choosing; swallows writes.
struct Peer<'a> {
    data: &'a [u8],
}

impl AsyncRead for Peer<'_> {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let n = buf.len().min(self.data.len()).min(1 + usize::from(self.data.first().copied().unwrap_or(0)));
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for Peer<'_> {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

const MAX_FRAME: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Some((window, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let mut receiver = FlowReceiver::new(u32::from(u16::from_le_bytes(*window)));
    let mut peer = Peer { data: rest };
    let mut buf = Vec::new();
    futures::executor::block_on(async {
        while let Ok(true) = receiver.read_frame(&mut peer, MAX_FRAME, &mut buf).await {
            assert!(buf.len() <= MAX_FRAME);
        }
    });
});
