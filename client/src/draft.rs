//! Multi-token steps: prompt-lookup drafts (tokens copied from earlier in
//! the conversation) and their check against the model, so one chain step
//! can yield several tokens while the output stays what plain decoding
//! gives (greedy) or is distributed as it (speculative sampling).

use corolla_model::{ClientHead, ModelError, Sampler, Tensor};

use crate::error::ClientError;

/// The default longest draft: what the CLI, the API and the page use.
pub const DEFAULT_DRAFTS: usize = 6;

/// The longest n-gram looked up (then shorter ones, down to one token):
/// longer matches predict better, shorter ones match more often.
pub const MAX_NGRAM: usize = 3;

/// Up to `k` tokens that followed the most recent earlier occurrence of
/// `context`'s last `n` tokens, for the largest `n <= MAX_NGRAM` that has one.
/// Free to compute and often right in code, quotes and summaries, where
/// the answer repeats the conversation.
pub fn prompt_lookup(context: &[u32], k: usize) -> &[u32] {
    let len = context.len();
    if k == 0 {
        return &[];
    }
    for n in (1..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let pattern = &context[len - n..];
        // An occurrence at `i` must end before the pattern itself does,
        // so at least one token follows it.
        if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == pattern) {
            let from = i + n;
            return &context[from..(from + k).min(len)];
        }
    }
    &[]
}

/// How many tokens to draft next: as many as pay for themselves.
///
/// Each step updates how often a draft token is accepted and what a step
/// costs (its time without drafts, and what each drafted token adds:
/// medians of the recent steps, so one slow step does not decide); the next
/// length is the one with the most expected tokens per second, none when
/// drafts cost more than they bring (a conversation that does not repeat
/// itself, a chain whose step time grows with its rows). Until the costs are
/// measured, for steps too short to time, and always when sampling (the
/// draft lengths decide which random draws a seed's answer takes, so they
/// must not depend on timing), the length follows transformers' "heuristic"
/// schedule (all accepted: +2, a rejection: -1). After [`PROBE_EVERY`] steps
/// without drafts the best nonzero length is tried again, so text that
/// starts repeating is noticed.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    /// Whether step times may decide (greedy answers only).
    timed: bool,
    /// The heuristic schedule's length.
    schedule: usize,
    /// Draft tokens accepted, and tokens tried (each accepted one and the
    /// first rejected), decayed so that recent steps weigh most.
    accepted: f64,
    tried: f64,
    /// Recent seconds of steps without drafts.
    plain_steps: Recent,
    /// Recent seconds each drafted token added to a step.
    per_draft: Recent,
    /// Steps since the last one with drafts.
    without_drafts: usize,
}

/// Steps without drafts after which drafting is tried again.
pub const PROBE_EVERY: usize = 16;
/// Steps faster than this (seconds) are not weighed: a few milliseconds of
/// jitter (a loopback swarm of a tiny model) would decide.
const MEASURABLE_STEP: f64 = 5e-3;
/// The acceptance counts keep this share of their past at each step.
const KEEP: f64 = 0.9;
/// Samples a cost needs before it is weighed.
const MIN_SAMPLES: usize = 3;

/// The last few samples of a time, and their median.
#[derive(Debug, Clone, Default)]
struct Recent(std::collections::VecDeque<f64>);

impl Recent {
    const KEPT: usize = 8;

    fn push(&mut self, sample: f64) {
        if self.0.len() == Self::KEPT {
            self.0.pop_front();
        }
        self.0.push_back(sample);
    }

    fn median(&self) -> Option<f64> {
        if self.0.len() < MIN_SAMPLES {
            return None;
        }
        let mut sorted: Vec<f64> = self.0.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        Some(sorted[sorted.len() / 2])
    }
}

impl DraftLength {
    /// At most `max` drafts; `timed`: whether step costs may decide (only
    /// where the answer does not depend on the lengths: greedy).
    pub fn new(max: usize, timed: bool) -> Self {
        DraftLength {
            max,
            timed,
            schedule: max,
            accepted: 1.0,
            tried: 2.0,
            plain_steps: Recent::default(),
            per_draft: Recent::default(),
            without_drafts: 0,
        }
    }

    /// The chance that a draft token is accepted once those before it were.
    pub fn acceptance(&self) -> f64 {
        (self.accepted / self.tried).clamp(0.0, 0.999)
    }

    /// Expected tokens per second of a step with `k` drafts.
    fn rate(&self, k: usize, plain: f64, per_draft: f64) -> f64 {
        let alpha = self.acceptance();
        // The step's own token, plus each draft accepted with all before it.
        let tokens: f64 = (0..=k as i32).map(|i| alpha.powi(i)).sum();
        tokens / (plain + k as f64 * per_draft).max(1e-9)
    }

    pub fn get(&self) -> usize {
        let costs = (self.plain_steps.median(), self.per_draft.median());
        let (true, (Some(plain), Some(per_draft))) = (self.timed, costs) else {
            return self.schedule;
        };
        if plain < MEASURABLE_STEP {
            // Steps this short are timer noise and scheduling: nothing to weigh.
            return self.schedule;
        }
        let best = |from: usize| {
            (from..=self.max).max_by(|&a, &b| {
                self.rate(a, plain, per_draft)
                    .total_cmp(&self.rate(b, plain, per_draft))
                    // Ties go to the shorter draft.
                    .then(b.cmp(&a))
            })
        };
        match best(0) {
            Some(0) if self.without_drafts >= PROBE_EVERY => best(1).unwrap_or(0),
            Some(k) => k,
            None => 0,
        }
    }

    /// After a decode step that checked `drafted` tokens, accepted
    /// `accepted` of them and took `seconds`.
    pub fn record(&mut self, drafted: usize, accepted: usize, seconds: f64) {
        if drafted == 0 {
            self.plain_steps.push(seconds);
            self.without_drafts += 1;
            return;
        }
        self.without_drafts = 0;
        let rejected = usize::from(accepted < drafted);
        self.accepted = self.accepted * KEEP + accepted as f64;
        self.tried = self.tried * KEEP + (accepted + rejected) as f64;
        if let Some(plain) = self.plain_steps.median() {
            // A drafted row costs at most what a whole step does.
            let extra = ((seconds - plain) / drafted as f64).clamp(0.0, plain);
            self.per_draft.push(extra);
        }
        self.schedule = if accepted == drafted {
            (self.schedule + 2).min(self.max)
        } else {
            self.schedule.saturating_sub(1).max(1)
        };
    }
}

/// The tokens one step yields: the `drafts` the model agrees with, in order,
/// then the model's own token at the first disagreement (or after the last
/// draft). `hidden`'s last `drafts.len() + 1` rows are the chain's output
/// for the last fed token and each draft; `context` holds the tokens so
/// far, that last fed token included. Each row is sampled with its own context (repetition penalty), and all
/// rows' logits come from one LM-head product.
pub fn verify_drafts(
    head: &ClientHead,
    sampler: &mut Sampler,
    hidden: &Tensor,
    context: &[u32],
    drafts: &[u32],
) -> Result<Vec<u32>, ClientError> {
    let logits = head.last_logits_rows(hidden, drafts.len() + 1)?;
    let mut row_context = context.to_vec();
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (i, &draft) in drafts.iter().enumerate() {
        match sampler.check_draft(&row(&logits, i)?, &row_context, draft)? {
            None => {
                tokens.push(draft);
                row_context.push(draft);
            }
            Some(token) => {
                tokens.push(token);
                return Ok(tokens);
            }
        }
    }
    tokens.push(sampler.sample(&row(&logits, drafts.len())?, &row_context)?);
    Ok(tokens)
}

fn row(logits: &Tensor, i: usize) -> Result<Tensor, ModelError> {
    Ok(logits.get(i)?)
}

/// Checks what a head answered for `drafts`: accepted drafts then one
/// token, never more than one past the drafts.
pub fn check_verified(drafts: &[u32], tokens: &[u32]) -> Result<(), ClientError> {
    let fits = match tokens.split_last() {
        Some((_, accepted)) => {
            accepted.len() <= drafts.len() && accepted == &drafts[..accepted.len()]
        }
        None => false,
    };
    if fits {
        Ok(())
    } else {
        Err(ClientError::Head(format!(
            "{} tokens {tokens:?} do not follow the drafts {drafts:?}",
            tokens.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn copies_what_followed_the_longest_recent_match() {
        // "1 2 3 4 5 ... 1 2 3" -> "4 5 9".
        let context = [1, 2, 3, 4, 5, 9, 7, 1, 2, 3];
        assert_eq!(prompt_lookup(&context, 3), &[4, 5, 9]);
        assert_eq!(prompt_lookup(&context, 10), &[4, 5, 9, 7, 1, 2, 3]);
        assert_eq!(prompt_lookup(&context, 0), &[] as &[u32]);
    }

    #[test]
    fn prefers_longer_ngrams_then_recent_ones() {
        // The bigram "8 3" occurs once (-> 6); the unigram "3" more
        // recently (-> 5): the longer match wins.
        let context = [8, 3, 6, 0, 3, 5, 8, 3];
        assert_eq!(prompt_lookup(&context, 1), &[6]);
        // Only unigrams match: the most recent earlier one.
        let context = [4, 1, 4, 2, 4];
        assert_eq!(prompt_lookup(&context, 2), &[2, 4]);
        // A repeated token proposes itself.
        assert_eq!(prompt_lookup(&[7, 7, 7, 7], 5), &[7]);
    }

    #[test]
    fn nothing_without_a_match() {
        assert!(prompt_lookup(&[], 4).is_empty());
        assert!(prompt_lookup(&[1], 4).is_empty());
        assert!(prompt_lookup(&[1, 2, 3, 4], 4).is_empty());
    }

    #[test]
    fn draft_length_follows_the_schedule_until_costs_are_known() {
        let mut length = DraftLength::new(6, true);
        length.record(6, 2, 0.01);
        assert_eq!(length.get(), 5);
        for _ in 0..10 {
            length.record(3, 0, 0.01);
        }
        assert_eq!(length.get(), 1);
        length.record(1, 1, 0.01);
        assert_eq!(length.get(), 3);
        length.record(3, 3, 0.01);
        length.record(5, 5, 0.01);
        assert_eq!(length.get(), 6);
    }

    /// Drafts that are never accepted and cost time stop, but are tried
    /// again every `PROBE_EVERY` steps.
    #[test]
    fn drafts_stop_when_they_do_not_pay() {
        let mut length = DraftLength::new(6, true);
        for _ in 0..3 {
            length.record(0, 0, 0.010);
        }
        for _ in 0..8 {
            let k = length.get().max(1);
            length.record(k, 0, 0.010 + 0.002 * k as f64);
        }
        assert_eq!(length.get(), 0);
        for step in 1..PROBE_EVERY {
            length.record(0, 0, 0.010);
            assert_eq!(length.get(), 0, "step {step}");
        }
        length.record(0, 0, 0.010);
        assert!(length.get() >= 1, "a probe after {PROBE_EVERY} steps");
    }

    /// Drafts that are accepted and nearly free run at full length; when
    /// each costs as much as a step, only near-certain ones pay.
    #[test]
    fn drafts_run_long_when_accepted_and_cheap() {
        let mut length = DraftLength::new(6, true);
        for _ in 0..3 {
            length.record(0, 0, 0.010);
        }
        for _ in 0..10 {
            let k = length.get().max(1);
            length.record(k, k, 0.010 + 0.0002 * k as f64);
        }
        assert_eq!(length.get(), 6);
        // Sampling: the schedule alone, whatever the times say.
        let mut sampled = DraftLength::new(6, false);
        for _ in 0..3 {
            sampled.record(0, 0, 0.010);
        }
        for _ in 0..10 {
            let k = sampled.get().max(1);
            sampled.record(k, 0, 0.010 + 0.010 * k as f64);
        }
        assert_eq!(sampled.get(), 1);
        let mut costly = DraftLength::new(6, true);
        for _ in 0..3 {
            costly.record(0, 0, 0.010);
        }
        for _ in 0..10 {
            let k = costly.get().max(1);
            costly.record(k, k / 2, 0.010 + 0.010 * k as f64);
        }
        assert_eq!(costly.get(), 0);
    }

    #[test]
    fn verified_tokens_must_follow_the_drafts() {
        assert!(check_verified(&[1, 2, 3], &[1, 2, 3, 4]).is_ok());
        assert!(check_verified(&[1, 2, 3], &[1, 9]).is_ok());
        assert!(check_verified(&[1, 2, 3], &[9]).is_ok());
        assert!(check_verified(&[], &[9]).is_ok());
        assert!(check_verified(&[1, 2, 3], &[]).is_err());
        assert!(check_verified(&[1, 2, 3], &[2, 9]).is_err());
        assert!(check_verified(&[1, 2], &[1, 2, 3, 4]).is_err());
    }

    proptest! {
        #[test]
        fn never_proposes_past_the_context(
            context in proptest::collection::vec(0u32..6, 0..64),
            k in 0usize..12,
        ) {
            let draft = prompt_lookup(&context, k);
            prop_assert!(draft.len() <= k);
            if !draft.is_empty() {
                // A slice of the context strictly before its end, right
                // after an occurrence of the context's last token(s).
                let from = draft.as_ptr() as usize - context.as_ptr() as usize;
                let from = from / std::mem::size_of::<u32>();
                prop_assert!(from >= 1 && from + draft.len() <= context.len());
                prop_assert!(from < context.len());
                prop_assert_eq!(context[from - 1], context[context.len() - 1]);
            }
        }

        #[test]
        fn finds_a_match_whenever_the_last_token_recurs(
            context in proptest::collection::vec(0u32..6, 2..64),
        ) {
            let last = context[context.len() - 1];
            let recurs = context[..context.len() - 1].contains(&last);
            prop_assert_eq!(!prompt_lookup(&context, 4).is_empty(), recurs);
        }
    }
}
