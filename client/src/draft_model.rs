//! Drafts from a small local model: a native client that holds a model
//! with the same tokenizer (a 1B beside a 70B, say) runs it greedily for a
//! few tokens and lets the chain check them in one step. Unlike prompt
//! lookup it guesses text the conversation has not seen yet; what it costs
//! is its own compute, one token at a time, in the client.

use corolla_model::{
    BlockSpan, Checkpoint, ClientHead, DType, Device, Sampler, SamplingParams, SessionCache,
};

use crate::error::ClientError;
use crate::text::TextTokenizer;
use crate::tokens::common_prefix;

/// A whole model in this process, used only to propose drafts.
pub struct DraftModel {
    name: String,
    head: ClientHead,
    blocks: BlockSpan,
    tokenizer: TextTokenizer,
}

impl DraftModel {
    pub fn load(checkpoint: &Checkpoint, dtype: DType) -> Result<Self, ClientError> {
        let device = Device::Cpu;
        let layers = checkpoint.config().num_hidden_layers;
        Ok(DraftModel {
            name: corolla_model::fingerprint::default_model_name(checkpoint),
            head: ClientHead::load(checkpoint, dtype, &device)?,
            blocks: BlockSpan::load(checkpoint, 0, layers, dtype, &device)?,
            tokenizer: TextTokenizer::for_checkpoint(checkpoint)?,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Drafts are token ids, so they mean something only where both models
    /// share the tokenizer: the same vocabulary size and the same token
    /// behind every id.
    pub fn check_tokenizer(
        &self,
        target: &TextTokenizer,
        vocab_size: usize,
    ) -> Result<(), ClientError> {
        let ours = self.head.config().vocab_size;
        if ours != vocab_size {
            return Err(ClientError::BadRequest(format!(
                "the draft model {} has {ours} tokens, the model {vocab_size}: a draft model must share the model's tokenizer",
                self.name
            )));
        }
        if let Some(id) = (0..vocab_size as u32)
            .find(|&id| self.tokenizer.id_to_token(id) != target.id_to_token(id))
        {
            return Err(ClientError::BadRequest(format!(
                "the draft model {}'s tokenizer differs from the model's: token {id} is {:?} there and {:?} here",
                self.name,
                self.tokenizer.id_to_token(id).unwrap_or_default(),
                target.id_to_token(id).unwrap_or_default(),
            )));
        }
        Ok(())
    }

    /// One answer's drafting state, for up to `max_length` positions (or
    /// as many as the draft model has: past them it proposes nothing, and
    /// the answer goes on a token a step).
    pub fn session(&self, max_length: usize) -> Result<DraftSession<'_>, ClientError> {
        let positions = max_length.min(self.head.config().max_position_embeddings);
        Ok(DraftSession {
            model: self,
            cache: self.blocks.new_cache(positions)?,
            cached: Vec::new(),
            greedy: Sampler::new(&SamplingParams::greedy())?,
        })
    }
}

/// A draft model's cache over one answer, kept in step with the context:
/// each proposal feeds only the tokens the cache lacks.
pub struct DraftSession<'a> {
    model: &'a DraftModel,
    cache: SessionCache,
    /// The tokens whose positions the cache holds.
    cached: Vec<u32>,
    greedy: Sampler,
}

impl DraftSession<'_> {
    /// The model's greedy continuation of `context`, up to `k` tokens
    /// (fewer where the session's positions run out).
    pub fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, ClientError> {
        if k == 0 || context.is_empty() {
            return Ok(Vec::new());
        }
        // Keep what still matches; the last token is always fed again, as
        // its logits are where the continuation starts.
        let keep = common_prefix(&self.cached, context).min(context.len() - 1);
        self.cache.truncate(keep);
        self.cached.truncate(keep);
        let mut input = context[keep..].to_vec();
        let mut drafts = Vec::with_capacity(k);
        while drafts.len() < k && self.cached.len() + input.len() <= self.cache.capacity() {
            let token = self.next(&input)?;
            self.cached.extend_from_slice(&input);
            drafts.push(token);
            input = vec![token];
        }
        Ok(drafts)
    }

    fn next(&mut self, input: &[u32]) -> Result<u32, ClientError> {
        let model = self.model;
        let hidden = model.head.embed(input)?;
        let hidden = model
            .blocks
            .forward(&hidden, self.cached.len(), &mut self.cache)?;
        let logits = model.head.last_logits(&hidden)?;
        Ok(self.greedy.sample(&logits, &self.cached)?)
    }
}
