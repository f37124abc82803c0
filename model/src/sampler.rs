//! Seeded token sampling: greedy, temperature, top-k, top-p and repetition
//! penalty, on top of candle-transformers' `LogitsProcessor`.

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};

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

/// Picks the next token from logits; deterministic for a given seed and
/// sequence of calls.
pub struct Sampler {
    processor: LogitsProcessor,
    repetition_penalty: f32,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            processor: LogitsProcessor::from_sampling(params.seed, params.sampling()),
            repetition_penalty: params.repetition_penalty,
        })
    }

    /// `logits` is `[vocab]`; `context` holds the tokens seen so far (prompt
    /// and generated), penalised when `repetition_penalty != 1`.
    pub fn sample(&mut self, logits: &Tensor, context: &[u32]) -> Result<u32> {
        let logits = if self.repetition_penalty == 1.0 {
            logits.clone()
        } else {
            candle_transformers::utils::apply_repeat_penalty(
                logits,
                self.repetition_penalty,
                context,
            )?
        };
        Ok(self.processor.sample(&logits)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits() -> Tensor {
        Tensor::new(&[0.1f32, 2.0, 1.9, -1.0, 0.5, 1.5], &Device::Cpu).unwrap()
    }

    fn draw(params: &SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(params).unwrap();
        (0..n).map(|_| s.sample(&logits(), &[]).unwrap()).collect()
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
        let mut s = Sampler::new(&p).unwrap();
        assert_eq!(s.sample(&logits(), &[1]).unwrap(), 2);
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
