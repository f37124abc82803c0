//! Token-id sequences, as the conversation cache, the draft model and the
//! API's session reuse compare them.

/// Length of the longest common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
