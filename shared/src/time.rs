//! Time on any runtime (native or the browser's): the wall clock in
//! milliseconds, a sleep and a deadline, built on `futures-timer` so that
//! the wire crate needs no tokio.

use std::time::Duration;

use futures::FutureExt;
use futures_timer::Delay;

/// A future that did not finish before its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("timed out after {0:?}")]
pub struct TimedOut(pub Duration);

/// Milliseconds since the Unix epoch (0 on a clock set before it).
pub fn unix_millis() -> u64 {
    web_time::SystemTime::now()
        .duration_since(web_time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Waits for `duration`.
pub async fn sleep(duration: Duration) {
    Delay::new(duration).await
}

/// Runs `fut` with a deadline.
pub async fn with_timeout<F: std::future::Future>(
    timeout: Duration,
    fut: F,
) -> Result<F::Output, TimedOut> {
    futures::select! {
        out = fut.fuse() => Ok(out),
        _ = Delay::new(timeout).fuse() => Err(TimedOut(timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_ends_a_future_that_never_finishes() {
        let out = futures::executor::block_on(with_timeout(
            Duration::from_millis(20),
            futures::future::pending::<()>(),
        ));
        assert_eq!(out, Err(TimedOut(Duration::from_millis(20))));
        let out = futures::executor::block_on(with_timeout(Duration::from_secs(5), async { 7 }));
        assert_eq!(out, Ok(7));
    }
}
