//! Turning a stream away: a short error frame, then the stream closes.
//! Shared by the session and push acceptors and their handlers.

use std::time::Duration;

use corolla_shared::framing;
use corolla_shared::protocol::{ErrorCode, Response};
use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::{PeerId, Stream};

use crate::metrics::ServerMetrics;

/// Bad requests in a row after which a stream is closed.
pub(crate) const MAX_BAD_REQUESTS_IN_A_ROW: usize = 3;

/// A stream that sends nothing this long after it opened is closed: idle
/// streams hold slots, and an honest peer writes at once.
pub(crate) const FIRST_FRAME_WITHIN: Duration = Duration::from_secs(5);

/// How long, and for how many bytes, a refused stream still takes in what
/// its peer sends after the refusal left: a half-closed yamux stream that
/// is dropped is reset, and a peer whose request was on its way then sees
/// its write fail instead of reading why it was refused.
const DRAIN_AFTER_REFUSAL: Duration = Duration::from_millis(250);
const DRAIN_AFTER_REFUSAL_BYTES: usize = 64 * 1024;

/// Tells a peer why its stream is not served, briefly, and closes.
pub(crate) async fn refuse_stream(
    mut stream: Stream,
    peer: PeerId,
    code: ErrorCode,
    message: String,
    metrics: ServerMetrics,
) {
    tracing::debug!(%peer, %message, "refused a stream");
    metrics.error_sent(code);
    let frame = Response::error(code, message).encode();
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = framing::write_frame(&mut stream, &frame).await;
        let _ = stream.close().await;
    })
    .await;
    let _ = tokio::time::timeout(DRAIN_AFTER_REFUSAL, async {
        let mut sink = [0u8; 4096];
        let mut taken = 0;
        while taken < DRAIN_AFTER_REFUSAL_BYTES {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => taken += n,
            }
        }
    })
    .await;
}
