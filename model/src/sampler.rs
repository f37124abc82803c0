//! Seeded token sampling: greedy, temperature, top-k, top-p and repetition
//! penalty, with the distributions candle-transformers' `LogitsProcessor`
//! samples from, drawn by position (see [`Sampler`]).

use candle_core::{DType, Tensor};
use candle_transformers::generation::Sampling;

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    /// 1.0 means no penalty.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidSampling(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            ));
        }
        if self.top_k == Some(0) {
            return bad("top-k must be at least 1".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad(format!("top-p {p} must be in (0, 1]"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition penalty {} must be > 0",
                self.repetition_penalty
            ));
        }
        Ok(())
    }

    fn sampling(&self) -> Sampling {
        let temperature = self.temperature;
        if temperature == 0.0 {
            return Sampling::ArgMax;
        }
        match (self.top_k, self.top_p.filter(|&p| p < 1.0)) {
            (None, None) => Sampling::All { temperature },
            (Some(k), None) => Sampling::TopK { k, temperature },
            (None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

/// Picks the next token from logits. A sampled token is a function of the
/// seed, its position (the length of the context before it) and the
/// logits alone: drawn by inverse transform from one uniform number per
/// position, and speculative checks use that same number. So an answer is
/// the same token for token with or without drafts, and positions computed
/// again (a replay, a re-check after a server was caught lying) give the
/// tokens they gave before unless their logits changed.
pub struct Sampler {
    sampling: Sampling,
    repetition_penalty: f32,
    seed: u64,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            sampling: params.sampling(),
            repetition_penalty: params.repetition_penalty,
            seed: params.seed,
        })
    }

    /// `logits` with the repetition penalty of `context` applied.
    fn penalized(&self, logits: &Tensor, context: &[u32]) -> Result<Tensor> {
        Ok(if self.repetition_penalty == 1.0 {
            logits.clone()
        } else {
            candle_transformers::utils::apply_repeat_penalty(
                logits,
                self.repetition_penalty,
                context,
            )?
        })
    }

    /// `logits` is `[vocab]`; `context` holds the tokens seen so far (prompt
    /// and generated), penalised when `repetition_penalty != 1`.
    pub fn sample(&self, logits: &Tensor, context: &[u32]) -> Result<u32> {
        if self.is_greedy() {
            return first_argmax(&self.penalized(logits, context)?);
        }
        let probs = self.probabilities(logits, context)?;
        pick(&probs, uniform_at(self.seed, context.len())).ok_or_else(|| {
            ModelError::InvalidSampling("logits give no distribution to sample".into())
        })
    }

    /// Whether greedy: the same logits always give the same token.
    pub fn is_greedy(&self) -> bool {
        matches!(self.sampling, Sampling::ArgMax)
    }
    /// The distribution [`Self::sample`] draws from for `logits` after
    /// `context` (penalty, temperature, top-k, top-p, as candle's
    /// `LogitsProcessor` computes them), over the whole vocabulary and
    /// summing to 1. Greedy: all of it on the argmax.
    pub fn probabilities(&self, logits: &Tensor, context: &[u32]) -> Result<Vec<f32>> {
        let logits = self.penalized(logits, context)?.to_dtype(DType::F32)?;
        let temperature = match &self.sampling {
            Sampling::ArgMax | Sampling::GumbelSoftmax { .. } => {
                let mut probs = vec![0.0; logits.dim(0)?];
                let best = first_argmax(&logits)? as usize;
                if let Some(p) = probs.get_mut(best) {
                    *p = 1.0;
                }
                return Ok(probs);
            }
            Sampling::All { temperature }
            | Sampling::TopK { temperature, .. }
            | Sampling::TopP { temperature, .. }
            | Sampling::TopKThenTopP { temperature, .. } => *temperature,
        };
        let mut probs =
            candle_nn::ops::softmax_last_dim(&(&logits / temperature)?)?.to_vec1::<f32>()?;
        match &self.sampling {
            Sampling::TopP { p, .. } if *p > 0.0 && *p < 1.0 => top_p(&mut probs, *p as f32),
            Sampling::TopK { k, .. } => top_k(&mut probs, *k),
            Sampling::TopKThenTopP { k, p, .. } => {
                top_k(&mut probs, *k);
                // As candle does: top-p on the top k's own (unnormalised)
                // mass, and only when it cuts into it.
                let kept: f32 = probs.iter().sum();
                let p = *p as f32;
                if p > 0.0 && p < kept {
                    top_p(&mut probs, p);
                }
            }
            _ => {}
        }
        let total: f32 = probs.iter().sum();
        if !(total.is_finite() && total > 0.0) {
            return Err(ModelError::InvalidSampling(format!(
                "logits give no distribution to sample (total {total})"
            )));
        }
        probs.iter_mut().for_each(|p| *p /= total);
        Ok(probs)
    }

    /// Speculative sampling's check of a `draft` token proposed after
    /// `context`, where `logits` are the model's at that position: `None`
    /// accepts it, `Some(token)` rejects it and says what comes instead.
    /// The token is the one [`Self::sample`] draws there, and the draft is
    /// accepted when it is that token: so with probability p(draft) (prompt
    /// lookup's and draft models' drafts are point masses), the token that
    /// results is distributed as p, and drafts never change an answer.
    pub fn check_draft(&self, logits: &Tensor, context: &[u32], draft: u32) -> Result<Option<u32>> {
        let token = self.sample(logits, context)?;
        Ok((token != draft).then_some(token))
    }
}

/// The token at which `probs` (weights, not necessarily normalised)
/// accumulate past `u` times their total; `None` if they have no mass.
fn pick(probs: &[f32], u: f64) -> Option<u32> {
    let total: f64 = probs.iter().map(|&p| f64::from(p.max(0.0))).sum();
    if !(total.is_finite() && total > 0.0) {
        return None;
    }
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last = None;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cumulative += f64::from(p);
            last = Some(i as u32);
            if target < cumulative {
                return last;
            }
        }
    }
    // Rounding left the target past the sum: the last token with mass.
    last
}

/// The uniform number in `[0, 1)` that decides the token at `position`.
fn uniform_at(seed: u64, position: usize) -> f64 {
    SplitMix64(seed ^ (position as u64).wrapping_mul(POSITION_STREAM)).next_f64()
}

/// Keeps the `k` most likely tokens (ties as candle breaks them).
fn top_k(probs: &mut [f32], k: usize) {
    if k >= probs.len() {
        return;
    }
    let mut order = (0..probs.len()).collect::<Vec<_>>();
    order.select_nth_unstable_by(k, |&i, &j| probs[j].total_cmp(&probs[i]));
    for &i in &order[k..] {
        probs[i] = 0.0;
    }
}

/// Keeps the most likely tokens until their mass reaches `p`, as candle's
/// nucleus sampling does.
fn top_p(probs: &mut [f32], p: f32) {
    let mut order = (0..probs.len()).collect::<Vec<_>>();
    order.sort_by(|&i, &j| probs[j].total_cmp(&probs[i]));
    let mut cumulative = 0.0;
    for i in order {
        if cumulative >= p {
            probs[i] = 0.0;
        } else {
            cumulative += probs[i];
        }
    }
}

/// Spreads positions over SplitMix64's states (an odd constant).
const POSITION_STREAM: u64 = 0xd1b5_4a32_d192_ed03;

/// SplitMix64 (Steele, Lea, Flood 2014): small, seedable, and the same on
/// every target, which is all a sampler's uniform draws need.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The index of the largest of `logits` (a vector), the first of equals,
/// as candle's `argmax` picks it. A plain loop rather than candle's reduce:
/// that is one 73 KB WebAssembly function (every dtype's loop in one), and
/// V8 recompiling it once it runs hot took 48 MB of the page for a moment.
fn first_argmax(logits: &Tensor) -> Result<u32> {
    let logits = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let Some(&first) = logits.first() else {
        return Err(ModelError::Candle(candle_core::Error::EmptyTensor {
            op: "argmax",
        }));
    };
    let (mut best, mut value) = (0, first);
    for (i, &v) in logits.iter().enumerate() {
        if value < v {
            (best, value) = (i, v);
        }
    }
    Ok(best as u32)
}

#[cfg(test)]
mod tests;
