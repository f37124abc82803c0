//! Time on any runtime (native or the browser's): the wall clock in
//! milliseconds, a sleep and a deadline. Inside a tokio runtime (native
//! nodes) they run on its timer; elsewhere (the page, plain executors) on
//! `futures-timer`, whose native timer is a thread of its own that every
//! new deadline wakes: a few such wake-ups on each decode step of a client,
//! each putting a third thread on two cores mid-step.

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

/// Whether this thread runs inside a tokio runtime (every one in this
/// project enables its timer).
#[cfg(feature = "native")]
fn on_tokio() -> bool {
    tokio::runtime::Handle::try_current().is_ok()
}

/// Waits for `duration`.
pub async fn sleep(duration: Duration) {
    #[cfg(feature = "native")]
    if on_tokio() {
        return tokio::time::sleep(duration).await;
    }
    Delay::new(duration).await
}

/// Runs `fut` with a deadline.
pub async fn with_timeout<F: std::future::Future>(
    timeout: Duration,
    fut: F,
) -> Result<F::Output, TimedOut> {
    #[cfg(feature = "native")]
    if on_tokio() {
        return tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TimedOut(timeout));
    }
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

    /// The same on a tokio runtime's timer (where native nodes run).
    #[cfg(feature = "native")]
    #[tokio::test]
    async fn a_deadline_holds_on_tokio_too() {
        assert!(on_tokio());
        let out = with_timeout(Duration::from_millis(20), futures::future::pending::<()>()).await;
        assert_eq!(out, Err(TimedOut(Duration::from_millis(20))));
        assert_eq!(
            with_timeout(Duration::from_secs(5), async { 7 }).await,
            Ok(7)
        );
        let start = std::time::Instant::now();
        sleep(Duration::from_millis(15)).await;
        assert!(start.elapsed() >= Duration::from_millis(15));
    }
}
