//! The generate loop: embed, run the block chain, sample, repeat.

use std::future::Future;
use std::ops::ControlFlow;

use corolla_model::{ClientHead, LlamaConfig, Sampler, SamplingParams, Tensor};
use web_time::{Duration, Instant};

use crate::error::ClientError;

/// Runs hidden states through every decoder block of the model, in order,
/// keeping whatever per-session state (KV caches) the blocks need.
pub trait BlockChain {
    /// `hidden` is `[1, T, hidden]` for positions `start..start + T`;
    /// returns the last block's output of the same shape.
    fn forward(
        &mut self,
        hidden: Tensor,
        start: usize,
    ) -> impl Future<Output = Result<Tensor, ClientError>>;
}

/// The client's side of every generate step: embedding the input, and
/// picking the next token from the last block's output. [`LocalHead`] runs
/// it in this thread; the page runs it in a Web Worker.
pub trait TokenHead {
    fn config(&self) -> &LlamaConfig;

    /// Hidden states `[1, T, hidden]` of `ids`.
    fn embed(&mut self, ids: &[u32]) -> impl Future<Output = Result<Tensor, ClientError>>;

    /// The token after `hidden`'s last position (`hidden` is `[1, T,
    /// hidden]`), given the tokens so far, `context`. Stateful: a sampler
    /// draws from one random sequence per answer.
    fn next_token(
        &mut self,
        hidden: &Tensor,
        context: &[u32],
    ) -> impl Future<Output = Result<u32, ClientError>>;
}

/// A [`ClientHead`] and one answer's sampler, in this thread.
pub struct LocalHead<'a> {
    head: &'a ClientHead,
    sampler: Sampler,
}

impl<'a> LocalHead<'a> {
    pub fn new(head: &'a ClientHead, sampling: &SamplingParams) -> Result<Self, ClientError> {
        Ok(LocalHead {
            head,
            sampler: Sampler::new(sampling)?,
        })
    }
}

impl TokenHead for LocalHead<'_> {
    fn config(&self) -> &LlamaConfig {
        self.head.config()
    }

    async fn embed(&mut self, ids: &[u32]) -> Result<Tensor, ClientError> {
        Ok(self.head.embed_fetching(ids).await?)
    }

    async fn next_token(&mut self, hidden: &Tensor, context: &[u32]) -> Result<u32, ClientError> {
        let logits = self.head.last_logits(hidden)?;
        Ok(self.sampler.sample(&logits, context)?)
    }
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at the model's end-of-sequence tokens.
    pub stop_at_eos: bool,
}

impl GenerateRequest {
    /// Positions the session needs: the prompt and every token fed back.
    pub fn max_length(&self) -> usize {
        self.prompt_ids
            .len()
            .saturating_add(self.max_new_tokens.saturating_sub(1))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    MaxNewTokens,
    EndOfSequence,
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub stop_reason: StopReason,
    /// Time from the start until the first new token was sampled.
    pub prefill_time: Duration,
    pub total_time: Duration,
}

impl GenerateOutput {
    pub fn tokens_per_second(&self) -> f64 {
        let secs = self.total_time.as_secs_f64();
        if secs > 0.0 {
            self.generated_ids.len() as f64 / secs
        } else {
            0.0
        }
    }
}

/// Generates up to `max_new_tokens` after the prompt. `on_token` sees each
/// new token as soon as it is sampled and may stop the generation.
pub async fn generate<C: BlockChain>(
    head: &ClientHead,
    chain: &mut C,
    request: &GenerateRequest,
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<GenerateOutput, ClientError> {
    let mut head = LocalHead::new(head, &request.sampling)?;
    generate_after(&mut head, chain, request, 0, on_token).await
}

/// [`generate`] on a chain whose caches already hold the first `reused`
/// positions of the prompt (an earlier turn of the conversation): only the
/// rest of the prompt is sent. `reused` must be below the prompt's length.
/// `head` must be fresh for this request (its sampler seeded by it).
pub async fn generate_after<H: TokenHead, C: BlockChain>(
    head: &mut H,
    chain: &mut C,
    request: &GenerateRequest,
    reused: usize,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<GenerateOutput, ClientError> {
    let started = Instant::now();
    let prompt = &request.prompt_ids;
    if prompt.is_empty() {
        return Err(ClientError::EmptyPrompt);
    }
    if reused >= prompt.len() {
        return Err(ClientError::BadRequest(format!(
            "cannot reuse {reused} positions of a {}-token prompt",
            prompt.len()
        )));
    }
    let max = head.config().max_position_embeddings;
    if request.max_length() > max {
        return Err(ClientError::TooLong {
            prompt: prompt.len(),
            new: request.max_new_tokens,
            max,
        });
    }
    let eos = head.config().eos_token_ids.clone();
    let mut context = prompt.clone();
    let mut generated = Vec::with_capacity(request.max_new_tokens);
    let mut prefill_time = Duration::ZERO;
    let mut stop_reason = StopReason::MaxNewTokens;
    let mut input = prompt[reused..].to_vec();
    let mut position = reused;
    while generated.len() < request.max_new_tokens {
        let hidden = chain.forward(head.embed(&input).await?, position).await?;
        let token = head.next_token(&hidden, &context).await?;
        if generated.is_empty() {
            prefill_time = started.elapsed();
        }
        position += input.len();
        generated.push(token);
        context.push(token);
        if on_token(token).is_break() {
            stop_reason = StopReason::Cancelled;
            break;
        }
        if request.stop_at_eos && eos.contains(&token) {
            stop_reason = StopReason::EndOfSequence;
            break;
        }
        input = vec![token];
    }
    Ok(GenerateOutput {
        prompt_ids: prompt.clone(),
        generated_ids: generated,
        stop_reason,
        prefill_time,
        total_time: started.elapsed(),
    })
}
