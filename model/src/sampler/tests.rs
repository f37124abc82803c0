//! The sampler's draws against their distributions (chi-square), and
//! draft checks against plain sampling.

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
