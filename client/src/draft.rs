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

/// How long the next draft may be: all accepted lengthens it by two, a
/// rejection shortens it by one (transformers' "heuristic" schedule), so a
/// conversation that stopped repeating itself costs short steps.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    current: usize,
}

impl DraftLength {
    pub fn new(max: usize) -> Self {
        DraftLength { max, current: max }
    }

    pub fn get(&self) -> usize {
        self.current
    }

    /// After a step that checked `drafted` tokens and accepted `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.current = if accepted == drafted {
            (self.current + 2).min(self.max)
        } else {
            self.current.saturating_sub(1).max(1)
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
    fn draft_length_adapts() {
        let mut length = DraftLength::new(6);
        length.record(6, 2);
        assert_eq!(length.get(), 5);
        for _ in 0..10 {
            length.record(3, 0);
        }
        assert_eq!(length.get(), 1);
        length.record(1, 1);
        assert_eq!(length.get(), 3);
        length.record(0, 0);
        assert_eq!(length.get(), 3);
        length.record(3, 3);
        length.record(5, 5);
        assert_eq!(length.get(), 6);
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
