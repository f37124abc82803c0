//! Bounds applied to untrusted input before anything is allocated.

/// Upper bounds a decoder enforces on a tensor payload.
///
/// The defaults fit a Llama 2 70B prefill of a few thousand positions
/// (hidden 8192, f32) while refusing anything that could exhaust memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest number of dimensions a tensor may have.
    pub max_rank: usize,
    /// Largest size of one dimension.
    pub max_dim: u64,
    /// Largest payload, in bytes of tensor data.
    pub max_tensor_bytes: u64,
}

impl Limits {
    pub const DEFAULT: Limits = Limits {
        max_rank: 4,
        max_dim: 1 << 20,
        max_tensor_bytes: 256 << 20,
    };
}

impl Limits {
    /// Largest frame a peer may send: one tensor plus the message around it.
    pub fn max_frame_bytes(&self) -> usize {
        usize::try_from(self.max_tensor_bytes)
            .unwrap_or(usize::MAX)
            .saturating_add(64 * 1024)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}
