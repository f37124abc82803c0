//! The generate loop: embed, run the block chain, sample, repeat.

use std::future::Future;
use std::ops::ControlFlow;

use corolla_model::{ClientHead, LlamaConfig, Sampler, SamplingParams, Tensor};
use web_time::{Duration, Instant};

use crate::draft::{check_verified, prompt_lookup, verify_drafts, DraftLength};
use crate::draft_model::{DraftModel, DraftSession};
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

    /// Forgets positions `len..` (a multi-token step's rejected drafts):
    /// the next step starts at `len`. Caches may keep the old values, as
    /// later steps overwrite them and never attend past their own positions.
    fn rewind(&mut self, len: usize);

    /// The first position whose output turned out, since the last call,
    /// to have been computed from a server's lies (a spot check caught a
    /// server, and its inputs replayed to a replacement gave other outputs
    /// from there on), if any. The generate loop then rewinds to it and
    /// computes everything after it again. Chains that cannot be lied to
    /// never say so.
    fn take_tainted(&mut self) -> Option<usize> {
        None
    }
}

/// What an answer shows as it is generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerEvent {
    /// The answer's next token.
    Token(u32),
    /// The answer's tokens after its first `kept` are withdrawn: they were
    /// sampled from a server's lies, found out later in the answer, and
    /// the tokens computed again in their place follow as `Token`s. Only
    /// tokens that came out different are withdrawn (a token is a function
    /// of its position's logits, see [`corolla_model::Sampler`]).
    Withdraw { kept: usize },
}

/// Re-checks in one answer after which the generate loop gives up: each
/// follows a server caught lying (and banned), so a swarm of that many
/// liars on one route is not worth waiting out.
const MAX_RECHECKS: usize = 8;

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

    /// A multi-token step's tokens: `hidden`'s last `drafts.len() + 1` rows
    /// are the chain's output for the last token of `context` (the tokens
    /// so far) and each of `drafts`. Returns the drafts the model agrees
    /// with, in order, then its own token at the first disagreement or
    /// after the last draft ([`crate::draft::verify_drafts`]: greedy checks,
    /// or speculative sampling coupled to the sampler's own draw).
    fn verify_drafts(
        &mut self,
        hidden: &Tensor,
        context: &[u32],
        drafts: &[u32],
    ) -> impl Future<Output = Result<Vec<u32>, ClientError>>;

    /// Forgets the answer's tokens after its first `kept`: they are
    /// sampled again (a head that detokenizes as it samples starts again
    /// from there). Sampling itself keeps no state to rewind.
    fn rewind(&mut self, kept: usize) -> impl Future<Output = Result<(), ClientError>> {
        let _ = kept;
        std::future::ready(Ok(()))
    }

    /// Up to `k` tokens likely to follow `context` (the tokens so far), for
    /// the next step to check: prompt lookup unless the head has something
    /// better (a [`DraftModel`]).
    fn propose_drafts(
        &mut self,
        context: &[u32],
        k: usize,
    ) -> impl Future<Output = Result<Vec<u32>, ClientError>> {
        std::future::ready(Ok(prompt_lookup(context, k).to_vec()))
    }
}

/// A [`ClientHead`] and one answer's sampler, in this thread; drafts come
/// from prompt lookup, or from a draft model's session.
pub struct LocalHead<'a> {
    head: &'a ClientHead,
    sampler: Sampler,
    draft: Option<DraftSession<'a>>,
}

impl<'a> LocalHead<'a> {
    pub fn new(head: &'a ClientHead, sampling: &SamplingParams) -> Result<Self, ClientError> {
        Ok(LocalHead {
            head,
            sampler: Sampler::new(sampling)?,
            draft: None,
        })
    }

    /// Drafts from `model` (which must share the head's tokenizer, see
    /// [`DraftModel::check_tokenizer`]) for an answer of up to
    /// `max_length` positions.
    pub fn with_draft_model(
        mut self,
        model: &'a DraftModel,
        max_length: usize,
    ) -> Result<Self, ClientError> {
        self.draft = Some(model.session(max_length)?);
        Ok(self)
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

    async fn verify_drafts(
        &mut self,
        hidden: &Tensor,
        context: &[u32],
        drafts: &[u32],
    ) -> Result<Vec<u32>, ClientError> {
        verify_drafts(self.head, &mut self.sampler, hidden, context, drafts)
    }

    async fn propose_drafts(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, ClientError> {
        match &mut self.draft {
            Some(session) => session.propose(context, k),
            None => Ok(prompt_lookup(context, k).to_vec()),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at the model's end-of-sequence tokens.
    pub stop_at_eos: bool,
    /// The longest draft a step checks (prompt lookup,
    /// [`crate::draft`]); 0 turns multi-token steps off. Greedy output is
    /// the same either way, and so is sampled output (see
    /// [`corolla_model::Sampler`]).
    pub drafts: usize,
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
    /// Chain steps after the prefill (fewer than the tokens when drafts
    /// were accepted).
    pub steps: usize,
    /// Draft tokens checked, and those accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Times the answer was computed again from a position a server's lies
    /// had reached (see [`BlockChain::take_tainted`]), and the tokens shown
    /// then withdrawn because they came out different.
    pub rechecks: usize,
    pub withdrawn: usize,
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

/// Generates up to `max_new_tokens` after the prompt. `on_event` sees each
/// new token as soon as it is sampled (and withdrawals, see
/// [`AnswerEvent`]) and may stop the generation.
pub async fn generate<C: BlockChain>(
    head: &ClientHead,
    chain: &mut C,
    request: &GenerateRequest,
    on_event: impl FnMut(AnswerEvent) -> ControlFlow<()>,
) -> Result<GenerateOutput, ClientError> {
    let mut head = LocalHead::new(head, &request.sampling)?;
    generate_after(&mut head, chain, request, 0, on_event).await
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
    on_event: impl FnMut(AnswerEvent) -> ControlFlow<()>,
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
    let (mut steps, mut drafted, mut accepted, mut rechecks) = (0, 0, 0, 0);
    let mut shown = Shown::new(on_event);
    // Timing may shorten drafts only where it cannot change the answer.
    let greedy = request.sampling.temperature == 0.0;
    let mut draft_length = DraftLength::new(request.drafts, greedy);
    // The tokens the caches lack (the last one sampled, after the prefill),
    // fed at `position`; drafts follow them in the same step.
    let mut input = prompt[reused..].to_vec();
    let mut position = reused;
    let mut drafts: Vec<u32> = Vec::new();
    'steps: while generated.len() < request.max_new_tokens {
        let step_started = Instant::now();
        let mut step = input.clone();
        step.extend_from_slice(&drafts);
        let hidden = chain.forward(head.embed(&step).await?, position).await?;
        if let Some(tainted) = chain.take_tainted() {
            // The tokens sampled from outputs at `tainted` and after are
            // suspect: the caches are rewound there and what follows is
            // computed again (the tokens shown meanwhile stay on screen
            // until one comes out different).
            rechecks += 1;
            if rechecks > MAX_RECHECKS {
                return Err(ClientError::KeptLying { rechecks });
            }
            let tainted = tainted.min(position);
            let kept = (tainted + 1)
                .saturating_sub(prompt.len())
                .min(generated.len());
            tracing::warn!(
                position = tainted,
                kept,
                "a server lied about earlier positions: computing the answer again from there"
            );
            generated.truncate(kept);
            context.truncate(prompt.len() + kept);
            head.rewind(kept).await?;
            chain.rewind(tainted);
            input = context[tainted..].to_vec();
            position = tainted;
            drafts.clear();
            continue;
        }
        let tokens = if drafts.is_empty() {
            vec![head.next_token(&hidden, &context).await?]
        } else {
            let tokens = head.verify_drafts(&hidden, &context, &drafts).await?;
            check_verified(&drafts, &tokens)?;
            tokens
        };
        let agreed = tokens.len() - 1;
        if generated.is_empty() {
            prefill_time = started.elapsed();
        } else {
            steps += 1;
            let seconds = step_started.elapsed().as_secs_f64();
            draft_length.record(drafts.len(), agreed, seconds);
        }
        drafted += drafts.len();
        accepted += agreed;
        // The caches now hold the input and the accepted drafts; the
        // rejected drafts' positions are dropped.
        position += input.len() + agreed;
        if agreed < drafts.len() {
            chain.rewind(position);
        }
        for token in tokens {
            let flow = shown.token(generated.len(), token);
            generated.push(token);
            context.push(token);
            let last = generated.len() == request.max_new_tokens;
            if flow.is_break() {
                stop_reason = StopReason::Cancelled;
            } else if request.stop_at_eos && eos.contains(&token) {
                stop_reason = StopReason::EndOfSequence;
            } else if !last {
                continue;
            }
            // Stopped inside the step: what the caches hold past the
            // tokens fed back is not part of the answer.
            let fed = prompt.len() + generated.len() - 1;
            if fed < position {
                chain.rewind(fed);
            }
            break 'steps;
        }
        input = context[context.len() - 1..].to_vec();
        // Never more tokens than the answer has left, so the step fits
        // the positions the session was opened for (`max_length`).
        let room = request.max_new_tokens - generated.len() - 1;
        drafts = head
            .propose_drafts(&context, draft_length.get().min(room))
            .await?;
        if drafts.len() > room {
            return Err(ClientError::Head(format!(
                "{} drafts proposed where {room} fit",
                drafts.len()
            )));
        }
    }
    // Tokens shown past where the answer now ends (an end of sequence came
    // sooner when computed again) are withdrawn too.
    shown.end(generated.len());
    Ok(GenerateOutput {
        prompt_ids: prompt.clone(),
        generated_ids: generated,
        stop_reason,
        prefill_time,
        total_time: started.elapsed(),
        steps,
        drafted,
        accepted,
        rechecks,
        withdrawn: shown.withdrawn,
    })
}

/// The tokens the consumer has been shown: after a re-check the tokens
/// computed again are compared with them, and only the first that differs
/// withdraws what follows.
struct Shown<F> {
    on_event: F,
    tokens: Vec<u32>,
    withdrawn: usize,
}

impl<F: FnMut(AnswerEvent) -> ControlFlow<()>> Shown<F> {
    fn new(on_event: F) -> Self {
        Shown {
            on_event,
            tokens: Vec::new(),
            withdrawn: 0,
        }
    }

    /// The answer's token at `index` (all before it settled).
    fn token(&mut self, index: usize, token: u32) -> ControlFlow<()> {
        match self.tokens.get(index) {
            Some(&seen) if seen == token => return ControlFlow::Continue(()),
            Some(_) => {
                let flow = self.withdraw(index);
                if flow.is_break() {
                    return flow;
                }
            }
            None => {}
        }
        self.tokens.push(token);
        (self.on_event)(AnswerEvent::Token(token))
    }

    fn withdraw(&mut self, kept: usize) -> ControlFlow<()> {
        self.withdrawn += self.tokens.len() - kept;
        self.tokens.truncate(kept);
        (self.on_event)(AnswerEvent::Withdraw { kept })
    }

    /// The answer ended at `len` tokens.
    fn end(&mut self, len: usize) {
        if self.tokens.len() > len {
            let _ = self.withdraw(len);
        }
    }
}

#[cfg(test)]
mod tests;
