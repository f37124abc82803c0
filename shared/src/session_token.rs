//! A session's secret handle for pushes (see `protocol` and `push_proof`).

/// A session's secret handle for pushes: random, given to the session's
/// client in `Opened`, and by the client only to the servers before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionToken(pub [u8; 16]);

impl std::fmt::Debug for SessionToken {
    // Secrets stay out of logs: only a prefix, enough to tell sessions apart.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionToken({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}
