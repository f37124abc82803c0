//! A block chain that runs every span in this process: the baseline.

use corolla_model::{BlockSpan, SessionCache, Tensor};

use crate::error::ClientError;
use crate::generate::BlockChain;

/// Spans run in order in this process, each with its own session cache.
/// (A span is cheap to clone: its weights are shared.)
pub struct LocalChain {
    stages: Vec<(BlockSpan, SessionCache)>,
    capacity: usize,
}

impl LocalChain {
    /// A session over `spans` (which must cover the model's layers in
    /// order) for up to `max_length` positions.
    pub fn new(spans: &[BlockSpan], max_length: usize) -> Result<Self, ClientError> {
        let stages = spans
            .iter()
            .map(|span| Ok((span.clone(), span.new_cache(max_length)?)))
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(LocalChain {
            stages,
            capacity: max_length,
        })
    }

    /// [`Self::new`] with every step through `adapter` (PEFT or GGUF LoRA).
    pub fn with_adapter(
        spans: &[BlockSpan],
        max_length: usize,
        adapter: &corolla_model::AdapterFile,
    ) -> Result<Self, ClientError> {
        let mut chain = Self::new(spans, max_length)?;
        for (span, cache) in &mut chain.stages {
            cache.set_adapter(Some(span.adapter(adapter)?));
        }
        Ok(chain)
    }

    /// Positions the caches were allocated for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl BlockChain for LocalChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let mut x = hidden;
        for (span, cache) in &mut self.stages {
            x = span.forward(&x, start, cache)?;
        }
        Ok(x)
    }

    fn rewind(&mut self, len: usize) {
        for (_, cache) in &mut self.stages {
            cache.truncate(len);
        }
    }
}
