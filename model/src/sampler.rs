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
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits() -> Tensor {
        Tensor::new(&[0.1f32, 2.0, 1.9, -1.0, 0.5, 1.5], &Device::Cpu).unwrap()
    }

    /// A context of `n` tokens: where draws happen (no penalty in these
    /// tests, so only its length counts).
    fn at(n: usize) -> Vec<u32> {
        vec![0; n]
    }

    fn draw(params: &SamplingParams, n: usize) -> Vec<u32> {
        let s = Sampler::new(params).unwrap();
        (0..n)
            .map(|i| s.sample(&logits(), &at(i)).unwrap())
            .collect()
    }

    #[test]
    fn greedy_and_top_k_one_pick_the_argmax() {
        assert!(draw(&SamplingParams::greedy(), 5).iter().all(|&t| t == 1));
        let p = SamplingParams {
            temperature: 1.0,
            top_k: Some(1),
            seed: 9,
            ..Default::default()
        };
        assert!(draw(&p, 20).iter().all(|&t| t == 1));
    }

    /// The plain argmax picks what candle's does: the first of equal
    /// maxima, index 0 when the first value is NaN, the same through f16.
    #[test]
    fn first_argmax_is_candles_argmax() {
        let cases: &[&[f32]] = &[
            &[0.5, 2.0, -1.0, 2.0, 1.9],
            &[3.0, 3.0, 3.0],
            &[-5.0, -4.0, f32::NEG_INFINITY, -4.0],
            &[f32::NAN, 1.0, 2.0],
            &[1.0, f32::NAN, 2.0, 0.5],
            &[f32::INFINITY, 1e30, f32::INFINITY],
            &[7.0],
        ];
        for values in cases {
            let t = Tensor::new(*values, &Device::Cpu).unwrap();
            for t in [t.clone(), t.to_dtype(DType::F16).unwrap()] {
                let candle = t
                    .argmax(candle_core::D::Minus1)
                    .unwrap()
                    .to_scalar::<u32>()
                    .unwrap();
                assert_eq!(first_argmax(&t).unwrap(), candle, "{values:?}");
            }
        }
        let empty = Tensor::new(&[] as &[f32], &Device::Cpu).unwrap();
        assert!(first_argmax(&empty).is_err());
    }

    #[test]
    fn same_seed_same_tokens_and_seeds_differ() {
        let p = SamplingParams {
            temperature: 1.5,
            seed: 42,
            ..Default::default()
        };
        let a = draw(&p, 64);
        assert_eq!(a, draw(&p, 64));
        let b = draw(
            &SamplingParams {
                seed: 43,
                ..p.clone()
            },
            64,
        );
        assert_ne!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 2);
    }

    #[test]
    fn top_p_restricts_to_the_nucleus() {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: Some(0.5),
            seed: 1,
            ..Default::default()
        };
        assert!(draw(&p, 100).iter().all(|&t| t == 1 || t == 2));
    }

    #[test]
    fn repetition_penalty_moves_away_from_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 10.0,
            ..Default::default()
        };
        let s = Sampler::new(&p).unwrap();
        assert_eq!(s.sample(&logits(), &[1]).unwrap(), 2);
    }

    fn softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
        let e: Vec<f64> = logits
            .iter()
            .map(|&l| f64::from(l / temperature).exp())
            .collect();
        let total: f64 = e.iter().sum();
        e.iter().map(|x| x / total).collect()
    }

    /// Pearson's chi-square of `counts` against `expected` probabilities
    /// (cells of zero probability must stay empty).
    fn chi_square(counts: &[usize], expected: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .map(|(&c, &p)| {
                if p == 0.0 {
                    assert_eq!(c, 0, "a token of probability 0 was drawn");
                    0.0
                } else {
                    let e = p * n as f64;
                    (c as f64 - e).powi(2) / e
                }
            })
            .sum()
    }

    // Five degrees of freedom: 30 is far past the 1e-5 tail (~28.3), so
    // only a biased rule fails, and the seeds make it deterministic.
    const CHI_SQUARE_BOUND: f64 = 30.0;
    const DRAWS: usize = 20_000;

    #[test]
    fn probabilities_match_what_sample_draws() {
        let l = [0.1f32, 2.0, 1.9, -1.0, 0.5, 1.5];
        for (params, kept) in [
            (
                SamplingParams {
                    temperature: 0.8,
                    seed: 3,
                    ..Default::default()
                },
                6,
            ),
            (
                SamplingParams {
                    temperature: 1.0,
                    top_k: Some(3),
                    seed: 4,
                    ..Default::default()
                },
                3,
            ),
            (
                SamplingParams {
                    temperature: 1.0,
                    top_p: Some(0.7),
                    seed: 5,
                    ..Default::default()
                },
                3,
            ),
            (
                SamplingParams {
                    temperature: 1.2,
                    top_k: Some(4),
                    top_p: Some(0.6),
                    seed: 6,
                    ..Default::default()
                },
                2,
            ),
        ] {
            let s = Sampler::new(&params).unwrap();
            let probs = s.probabilities(&logits(), &[]).unwrap();
            assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            assert_eq!(
                probs.iter().filter(|&&p| p > 0.0).count(),
                kept,
                "{params:?}"
            );
            let mut counts = vec![0; l.len()];
            let positions = at(DRAWS);
            for i in 0..DRAWS {
                counts[s.sample(&logits(), &positions[..i]).unwrap() as usize] += 1;
            }
            let expected: Vec<f64> = probs.iter().map(|&p| f64::from(p)).collect();
            let chi = chi_square(&counts, &expected);
            assert!(chi < CHI_SQUARE_BOUND, "{params:?}: chi-square {chi}");
        }
        let greedy = Sampler::new(&SamplingParams::greedy()).unwrap();
        assert_eq!(
            greedy.probabilities(&logits(), &[]).unwrap(),
            vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        );
    }

    #[test]
    fn speculative_checks_keep_the_distribution() {
        let l = [0.1f32, 2.0, 1.9, -1.0, 0.5, 1.5];
        let expected = softmax(&l, 1.0);
        // A likely draft, an unlikely one, and one outside the vocabulary.
        for (seed, draft) in [(11u64, 1u32), (12, 3), (13, 4), (14, 99)] {
            let s = Sampler::new(&SamplingParams {
                temperature: 1.0,
                seed,
                ..Default::default()
            })
            .unwrap();
            let mut counts = vec![0; l.len()];
            let mut accepted = 0;
            let positions = at(DRAWS);
            for i in 0..DRAWS {
                let token = match s.check_draft(&logits(), &positions[..i], draft).unwrap() {
                    None => {
                        accepted += 1;
                        draft
                    }
                    Some(token) => {
                        assert_ne!(token, draft, "a rejected draft came back");
                        token
                    }
                };
                counts[token as usize] += 1;
            }
            let chi = chi_square(&counts, &expected);
            assert!(chi < CHI_SQUARE_BOUND, "draft {draft}: chi-square {chi}");
            // Acceptance itself happens at rate p(draft).
            let p = expected.get(draft as usize).copied().unwrap_or(0.0);
            let rate = accepted as f64 / DRAWS as f64;
            assert!(
                (rate - p).abs() < 0.02,
                "draft {draft}: accepted {rate}, p {p}"
            );
        }
        // With top-k the residual stays inside the top k.
        let s = Sampler::new(&SamplingParams {
            temperature: 1.0,
            top_k: Some(2),
            seed: 15,
            ..Default::default()
        })
        .unwrap();
        let top2 = softmax(&[2.0, 1.9], 1.0);
        let mut counts = vec![0; 2];
        let positions = at(DRAWS);
        for i in 0..DRAWS {
            let token = s
                .check_draft(&logits(), &positions[..i], 2)
                .unwrap()
                .unwrap_or(2);
            assert!(token == 1 || token == 2, "{token} is outside the top 2");
            counts[token as usize - 1] += 1;
        }
        assert!(chi_square(&counts, &top2) < CHI_SQUARE_BOUND);
    }

    #[test]
    fn greedy_checks_accept_exactly_the_argmax() {
        let s = Sampler::new(&SamplingParams::greedy()).unwrap();
        assert_eq!(s.check_draft(&logits(), &[], 1).unwrap(), None);
        assert_eq!(s.check_draft(&logits(), &[], 2).unwrap(), Some(1));
        // The penalty applies with the row's own context.
        let s = Sampler::new(&SamplingParams {
            repetition_penalty: 10.0,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.check_draft(&logits(), &[1], 2).unwrap(), None);
        assert_eq!(s.check_draft(&logits(), &[], 2).unwrap(), Some(1));
    }

    /// A token depends on the seed, its position and its logits only: the
    /// order of calls, draws at other positions and whether it came from a
    /// draft check change nothing (drafts cannot change an answer, and a
    /// position computed again gives its token again).
    #[test]
    fn a_token_is_a_function_of_seed_position_and_logits() {
        let params = SamplingParams {
            temperature: 1.3,
            top_p: Some(0.95),
            seed: 77,
            ..Default::default()
        };
        let s = Sampler::new(&params).unwrap();
        let forward: Vec<u32> = (0..200)
            .map(|i| s.sample(&logits(), &at(i)).unwrap())
            .collect();
        let other = Sampler::new(&params).unwrap();
        for i in (0..200).rev() {
            assert_eq!(
                other.sample(&logits(), &at(i)).unwrap(),
                forward[i],
                "position {i}"
            );
            // A draft check there accepts exactly that token, else names it.
            for draft in 0..6 {
                let checked = other.check_draft(&logits(), &at(i), draft).unwrap();
                assert_eq!(
                    checked.unwrap_or(draft),
                    forward[i],
                    "position {i}, draft {draft}"
                );
            }
        }
        assert!(
            forward
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len()
                > 2
        );
    }

    #[test]
    fn rejects_bad_settings() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f64::NAN,
                ..Default::default()
            },
            SamplingParams {
                top_k: Some(0),
                ..Default::default()
            },
            SamplingParams {
                top_p: Some(1.5),
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(&p).is_err(), "{p:?}");
        }
    }
}
