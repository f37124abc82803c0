//! The generate loop against toy heads and chains whose right answer is
//! known without a model: drafts, stops, cancels, re-checks.

use super::*;
use corolla_model::Device;

/// A toy model over 9 tokens whose next token depends on the last two:
/// it falls into short loops, which prompt lookup then predicts.
fn model(tokens: &[u32]) -> u32 {
    let last = tokens[tokens.len() - 1];
    let before = tokens.len().checked_sub(2).map_or(0, |i| tokens[i]);
    (3 * last + 5 * before + 1) % 9
}

/// Plain decoding of `model`: what every run must give.
fn rollout(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut context = prompt.to_vec();
    for _ in 0..n {
        context.push(model(&context));
    }
    context[prompt.len()..].to_vec()
}

/// Caches tokens by position as a real chain caches keys and values,
/// and refuses what a server refuses: skipping ahead, overflowing.
struct ToyChain {
    cached: Vec<u32>,
    capacity: usize,
}

impl BlockChain for ToyChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let ids: Vec<f32> = hidden.flatten_all().unwrap().to_vec1().unwrap();
        assert!(start <= self.cached.len(), "a step skipped ahead");
        assert!(start + ids.len() <= self.capacity, "a step past capacity");
        self.cached.truncate(start);
        let mut out = Vec::new();
        for id in ids {
            self.cached.push(id as u32);
            out.push(model(&self.cached) as f32);
        }
        let t = out.len();
        Ok(Tensor::from_vec(out, (1, t, 1), &Device::Cpu).unwrap())
    }

    fn rewind(&mut self, len: usize) {
        self.cached.truncate(len);
    }
}

/// Reads the toy chain's answer off each row; greedy draft checks.
struct ToyHead(LlamaConfig);

fn rows(hidden: &Tensor) -> Vec<u32> {
    let values: Vec<f32> = hidden.flatten_all().unwrap().to_vec1().unwrap();
    values.into_iter().map(|v| v as u32).collect()
}

impl TokenHead for ToyHead {
    fn config(&self) -> &LlamaConfig {
        &self.0
    }

    async fn embed(&mut self, ids: &[u32]) -> Result<Tensor, ClientError> {
        let values: Vec<f32> = ids.iter().map(|&id| id as f32).collect();
        Ok(Tensor::from_vec(values, (1, ids.len(), 1), &Device::Cpu).unwrap())
    }

    async fn next_token(&mut self, hidden: &Tensor, _: &[u32]) -> Result<u32, ClientError> {
        Ok(*rows(hidden).last().unwrap())
    }

    async fn verify_drafts(
        &mut self,
        hidden: &Tensor,
        _: &[u32],
        drafts: &[u32],
    ) -> Result<Vec<u32>, ClientError> {
        let rows = rows(hidden);
        let rows = &rows[rows.len() - drafts.len() - 1..];
        let agreed = drafts.iter().zip(rows).take_while(|(d, r)| d == r).count();
        Ok(rows[..=agreed].to_vec())
    }
}

fn config(eos: u32) -> LlamaConfig {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/tiny-llama-a/config.json"
    );
    let mut config = LlamaConfig::from_file(std::path::Path::new(path)).unwrap();
    config.eos_token_ids = vec![eos];
    config
}

fn block_on<F: Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

fn run(
    request: &GenerateRequest,
    eos: u32,
    on_event: impl FnMut(AnswerEvent) -> ControlFlow<()>,
) -> (GenerateOutput, ToyChain) {
    let mut chain = ToyChain {
        cached: Vec::new(),
        capacity: request.max_length(),
    };
    let mut head = ToyHead(config(eos));
    let out = block_on(generate_after(&mut head, &mut chain, request, 0, on_event)).unwrap();
    (out, chain)
}

fn request(prompt: &[u32], max_new_tokens: usize, drafts: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_at_eos: true,
        drafts,
    }
}

const PROMPTS: [&[u32]; 4] = [&[1], &[4, 2, 7], &[0, 8, 8, 3, 5, 1, 6], &[2, 2, 2, 2]];
// Not a token of the toy model: no end of sequence.
const NO_EOS: u32 = 99;

#[test]
fn drafts_give_plain_decoding_tokens_in_fewer_steps() {
    for prompt in PROMPTS {
        for max_new in [1, 2, 3, 5, 17, 40] {
            for drafts in [0, 1, 3, 6] {
                let (out, chain) = run(&request(prompt, max_new, drafts), NO_EOS, |_| {
                    ControlFlow::Continue(())
                });
                let case = format!("prompt {prompt:?}, {max_new} tokens, drafts {drafts}");
                assert_eq!(out.generated_ids, rollout(prompt, max_new), "{case}");
                assert_eq!(out.stop_reason, StopReason::MaxNewTokens, "{case}");
                // The caches end holding exactly the tokens fed back.
                let fed = [prompt, &out.generated_ids[..max_new - 1]].concat();
                assert_eq!(chain.cached, fed, "{case}");
                assert!(out.accepted <= out.drafted, "{case}");
                assert_eq!(out.steps + 1 + out.accepted, max_new, "{case}");
                if drafts == 0 {
                    assert_eq!(out.drafted, 0, "{case}");
                }
                if drafts > 0 && max_new == 40 {
                    assert!(out.accepted > 0, "{case}: nothing accepted");
                    assert!(out.steps < max_new - 1, "{case}: {} steps", out.steps);
                }
                if drafts == 6 && max_new == 40 {
                    assert!(out.steps < max_new / 2, "{case}: {} steps", out.steps);
                }
            }
        }
    }
}

#[test]
fn an_end_of_sequence_inside_a_step_ends_the_answer_there() {
    // The prompt holds the model's loop twice: drafts are accepted
    // from the first step on, and the end of sequence comes inside one.
    let prompt = &[PROMPTS[2], &rollout(PROMPTS[2], 24)].concat();
    let plain = rollout(prompt, 40);
    let eos = 3;
    let at = plain.iter().position(|&t| t == eos).unwrap();
    assert!(at > 4);
    for drafts in [0, 6] {
        let (out, chain) = run(&request(prompt, 40, drafts), eos, |_| {
            ControlFlow::Continue(())
        });
        assert_eq!(out.generated_ids, plain[..=at], "drafts {drafts}");
        assert_eq!(out.stop_reason, StopReason::EndOfSequence);
        assert_eq!(chain.cached, [prompt, &plain[..at]].concat());
    }
}

#[test]
fn a_cancel_inside_a_step_emits_nothing_more() {
    let prompt = PROMPTS[3];
    for drafts in [0, 6] {
        let mut seen = Vec::new();
        let (out, chain) = run(&request(prompt, 40, drafts), NO_EOS, |event| {
            let AnswerEvent::Token(token) = event else {
                panic!("{event:?} from an honest chain");
            };
            seen.push(token);
            if seen.len() == 25 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(seen, rollout(prompt, 25));
        assert_eq!(out.generated_ids, seen);
        assert_eq!(out.stop_reason, StopReason::Cancelled);
        assert_eq!(chain.cached.len(), prompt.len() + 24);
        if drafts > 0 {
            assert!(out.accepted > 0);
        }
    }
}

/// A [`ToyChain`] whose outputs at `lies` are wrong until, at the
/// first step starting at `found_at` or later, it tells the loop that
/// they were (as a remote chain does once a spot check catches the
/// liar and a replacement's replay disagrees from `lies.start` on).
struct LyingToyChain {
    honest: ToyChain,
    lies: std::ops::Range<usize>,
    found_at: usize,
    found: bool,
}

impl LyingToyChain {
    fn new(request: &GenerateRequest, lies: std::ops::Range<usize>, found_at: usize) -> Self {
        LyingToyChain {
            honest: ToyChain {
                cached: Vec::new(),
                capacity: request.max_length(),
            },
            lies,
            found_at,
            found: false,
        }
    }
}

impl BlockChain for LyingToyChain {
    async fn forward(&mut self, hidden: Tensor, start: usize) -> Result<Tensor, ClientError> {
        let out = self.honest.forward(hidden, start).await?;
        let mut rows = rows(&out);
        if !self.found {
            for (i, row) in rows.iter_mut().enumerate() {
                if self.lies.contains(&(start + i)) {
                    *row = (*row + 1) % 9;
                }
            }
        }
        let values: Vec<f32> = rows.iter().map(|&r| r as f32).collect();
        Ok(Tensor::from_vec(values, (1, rows.len(), 1), &Device::Cpu).unwrap())
    }

    fn rewind(&mut self, len: usize) {
        self.honest.rewind(len);
    }

    fn take_tainted(&mut self) -> Option<usize> {
        let cached = self.honest.cached.len();
        (!self.found && cached > self.found_at).then(|| {
            self.found = true;
            self.lies.start
        })
    }
}

/// What a consumer of the events ends up showing.
fn apply(shown: &mut Vec<u32>, event: AnswerEvent) {
    match event {
        AnswerEvent::Token(t) => shown.push(t),
        AnswerEvent::Withdraw { kept } => {
            assert!(
                kept < shown.len(),
                "withdrew nothing: {kept} of {}",
                shown.len()
            );
            shown.truncate(kept);
        }
    }
}

#[test]
fn lies_found_later_are_computed_again_and_what_changed_is_withdrawn() {
    let prompt = PROMPTS[2];
    let plain = rollout(prompt, 30);
    let p = prompt.len();
    // Lies inside the prompt (whose outputs no token is sampled from:
    // the toy's positions do not attend to each other), on the
    // prompt's last position, and on generated positions; found a few
    // steps later.
    for (lies, found_at, changed) in [
        (2..4, p + 5, false),
        (p - 1..p, p + 3, true),
        (p + 4..p + 9, p + 15, true),
    ] {
        for drafts in [0, 6] {
            let case = format!("lies {lies:?} found at {found_at}, drafts {drafts}");
            let request = request(prompt, 30, drafts);
            let mut chain = LyingToyChain::new(&request, lies.clone(), found_at);
            let mut shown = Vec::new();
            let out = block_on(generate_after(
                &mut ToyHead(config(NO_EOS)),
                &mut chain,
                &request,
                0,
                |event| {
                    apply(&mut shown, event);
                    ControlFlow::Continue(())
                },
            ))
            .unwrap();
            assert_eq!(out.generated_ids, plain, "{case}");
            assert_eq!(shown, plain, "{case}: what the consumer shows");
            assert_eq!(out.rechecks, 1, "{case}");
            assert_eq!(
                out.withdrawn > 0,
                changed,
                "{case}: {} withdrawn",
                out.withdrawn
            );
            let fed = [prompt, &plain[..29]].concat();
            assert_eq!(chain.honest.cached, fed, "{case}");
        }
    }
}

/// Tokens computed again that come out the same are not shown twice,
/// and a re-check finding the same answer withdraws nothing.
#[test]
fn a_recheck_that_changes_nothing_withdraws_nothing() {
    let prompt = PROMPTS[1];
    let request = request(prompt, 20, 0);
    // An empty lie: the chain only believes it was lied to.
    let mut chain = LyingToyChain::new(&request, 5..5, 12);
    let mut events = Vec::new();
    let out = block_on(generate_after(
        &mut ToyHead(config(NO_EOS)),
        &mut chain,
        &request,
        0,
        |event| {
            events.push(event);
            ControlFlow::Continue(())
        },
    ))
    .unwrap();
    let plain = rollout(prompt, 20);
    assert_eq!(out.generated_ids, plain);
    assert_eq!(out.rechecks, 1);
    assert_eq!(out.withdrawn, 0);
    let tokens: Vec<AnswerEvent> = plain.iter().map(|&t| AnswerEvent::Token(t)).collect();
    assert_eq!(events, tokens);
}

#[test]
fn a_head_answering_past_its_drafts_is_an_error() {
    struct Liar(LlamaConfig);
    impl TokenHead for Liar {
        fn config(&self) -> &LlamaConfig {
            &self.0
        }
        async fn embed(&mut self, ids: &[u32]) -> Result<Tensor, ClientError> {
            ToyHead(self.0.clone()).embed(ids).await
        }
        async fn next_token(&mut self, h: &Tensor, c: &[u32]) -> Result<u32, ClientError> {
            ToyHead(self.0.clone()).next_token(h, c).await
        }
        async fn verify_drafts(
            &mut self,
            _: &Tensor,
            _: &[u32],
            drafts: &[u32],
        ) -> Result<Vec<u32>, ClientError> {
            Ok([drafts, &[0, 0]].concat())
        }
    }
    let request = request(PROMPTS[3], 40, 6);
    let mut chain = ToyChain {
        cached: Vec::new(),
        capacity: request.max_length(),
    };
    let out = block_on(generate_after(
        &mut Liar(config(NO_EOS)),
        &mut chain,
        &request,
        0,
        |_| ControlFlow::Continue(()),
    ));
    assert!(matches!(out, Err(ClientError::Head(_))), "{out:?}");
}
