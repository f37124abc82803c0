//! A block chain that runs every span in this process: the baseline.

use corolla_model::{BlockSpan, SessionCache, Tensor};

use crate::error::ClientError;
use crate::generate::BlockChain;

/// Spans run in order in this process, each with its own session cache.
pub struct LocalChain<'a> {
    stages: Vec<(&'a BlockSpan, SessionCache)>,
}

impl<'a> LocalChain<'a> {
    /// A session over `spans` (which must cover the model's layers in
    /// order) for up to `max_length` positions.
    pub fn new(spans: &'a [BlockSpan], max_length: usize) -> Result<Self, ClientError> {
        let stages = spans
            .iter()
            .map(|span| Ok((span, span.new_cache(max_length)?)))
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(LocalChain { stages })
    }
}

impl BlockChain for LocalChain<'_> {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let mut x = hidden;
        for (span, cache) in &mut self.stages {
            x = span.forward(&x, start, cache)?;
        }
        Ok(x)
    }
}
