//! The tokenizers of `corolla random-model`'s shapes: a working vocabulary of
//! the real size with the real special tokens (SentencePiece for Llama 2,
//! byte-level BPE with Llama 3's and Qwen2's pre-tokenizers), and the chat
//! templates. Its pieces are grown from English letter frequencies, most
//! likely first, each one an earlier piece plus a letter, so every piece is
//! reachable by merges; quality does not matter, sizes and shapes do.

use std::collections::{BinaryHeap, HashSet};

use crate::error::{ModelError, Result};
use crate::model_shape::{ModelShape, LLAMA3_FIRST_SPECIAL, QWEN_FIRST_SPECIAL};

/// A tokenizer in GGUF's terms: tokens, their types, and the BPE merges
/// (byte-level models) or scores (SentencePiece).
pub(crate) struct Vocabulary {
    pub model: &'static str,
    pub pre: Option<&'static str>,
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub scores: Vec<f32>,
    pub merges: Vec<String>,
}

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

impl Vocabulary {
    pub(crate) fn build(shape: ModelShape, size: usize) -> Result<Self> {
        let too_small = |needed: usize| {
            Err(ModelError::InvalidConfig(format!(
                "a vocabulary of {size} is too small for {} (at least {needed})",
                shape.name()
            )))
        };
        match shape {
            ModelShape::Llama2_70b | ModelShape::Mixtral8x7b => {
                let base = 3 + 256;
                if size < base + 96 {
                    return too_small(base + 96);
                }
                let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
                let mut types = vec![2, CONTROL, CONTROL];
                tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
                types.extend([BYTE; 256]);
                let alphabet = spm_alphabet();
                let (grown, _) = grow_pieces(&alphabet, size - base - alphabet.len());
                tokens.extend(alphabet.into_iter().chain(grown));
                types.resize(tokens.len(), NORMAL);
                let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
                Ok(Vocabulary {
                    model: "llama",
                    pre: None,
                    tokens,
                    types,
                    scores,
                    merges: Vec::new(),
                })
            }
            ModelShape::Llama3_70b
            | ModelShape::Qwen25_72b
            | ModelShape::Qwen3_32b
            | ModelShape::Qwen3_30bA3b => {
                let (first_special, specials, pre) = if shape == ModelShape::Llama3_70b {
                    (
                        LLAMA3_FIRST_SPECIAL as usize,
                        llama3_specials(),
                        "llama-bpe",
                    )
                } else {
                    (QWEN_FIRST_SPECIAL as usize, qwen_specials(), "qwen2")
                };
                if size < first_special + specials.len() {
                    return too_small(first_special + specials.len());
                }
                let alphabet = byte_level_alphabet();
                let (grown, merges) = grow_pieces(&alphabet, first_special - alphabet.len());
                let mut tokens: Vec<String> = alphabet.clone();
                tokens.extend(grown);
                let mut types = vec![NORMAL; tokens.len()];
                for (i, special) in specials.iter().enumerate() {
                    tokens.push(special.clone());
                    // Llama 3's reserved tokens are control tokens too;
                    // Qwen's tool-call tags are plain added tokens.
                    types.push(if special.starts_with("<|") {
                        CONTROL
                    } else {
                        USER_DEFINED
                    });
                    debug_assert_eq!(tokens.len(), first_special + i + 1);
                }
                while tokens.len() < size {
                    tokens.push(format!("[PAD{}]", tokens.len()));
                    types.push(UNUSED);
                }
                Ok(Vocabulary {
                    model: "gpt2",
                    pre: Some(pre),
                    tokens,
                    types,
                    scores: Vec::new(),
                    merges,
                })
            }
        }
    }
}

/// GPT-2's printable stand-ins for the 256 byte values, in byte order.
fn byte_level_alphabet() -> Vec<String> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut shifted = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(c).map(String::from).unwrap_or_default()
        })
        .collect()
}

/// SentencePiece's single-character pieces: the word boundary, letters,
/// digits and punctuation.
fn spm_alphabet() -> Vec<String> {
    std::iter::once('\u{2581}')
        .chain('a'..='z')
        .chain('A'..='Z')
        .chain('0'..='9')
        .chain("'.,;:!?-()\"/&%$#@*+=<>[]{}_|~^`\\".chars())
        .map(String::from)
        .collect()
}

/// English letter frequencies (per mille), which order the grown pieces:
/// likely strings first, as a trained vocabulary would have them.
const LETTER_WEIGHTS: [(char, u32); 26] = [
    ('e', 127),
    ('t', 91),
    ('a', 82),
    ('o', 75),
    ('i', 70),
    ('n', 67),
    ('s', 63),
    ('h', 61),
    ('r', 60),
    ('d', 43),
    ('l', 40),
    ('c', 28),
    ('u', 28),
    ('m', 24),
    ('w', 24),
    ('f', 22),
    ('g', 20),
    ('y', 20),
    ('p', 19),
    ('b', 15),
    ('v', 10),
    ('k', 8),
    ('j', 2),
    ('x', 2),
    ('q', 1),
    ('z', 1),
];

/// Grows `count` multi-character pieces over `alphabet`: words of lower-case
/// letters, with and without a leading word boundary (`▁` or GPT-2's `Ġ`),
/// most likely first. Every piece is an earlier piece plus one letter, so
/// the merges (returned as `"left right"`, in order) build each of them.
fn grow_pieces(alphabet: &[String], count: usize) -> (Vec<String>, Vec<String>) {
    /// Highest weight first; among equal weights the alphabetically first piece.
    struct Candidate(f64, std::cmp::Reverse<String>, String);
    impl PartialEq for Candidate {
        fn eq(&self, other: &Self) -> bool {
            self.cmp(other).is_eq()
        }
    }
    impl Eq for Candidate {}
    impl PartialOrd for Candidate {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Candidate {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            self.0
                .total_cmp(&other.0)
                .then_with(|| self.1.cmp(&other.1))
        }
    }
    let boundary = if alphabet.iter().any(|s| s == "\u{2581}") {
        "\u{2581}"
    } else {
        "\u{120}"
    };
    let have: HashSet<&str> = alphabet.iter().map(String::as_str).collect();
    let letters: Vec<(String, f64)> = LETTER_WEIGHTS
        .iter()
        .map(|&(c, w)| (c.to_string(), w as f64 / 1000.0))
        .filter(|(c, _)| have.contains(c.as_str()))
        .collect();
    let mut heap = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<Candidate>, left: &str, weight: f64| {
        for (c, w) in &letters {
            let piece = format!("{left}{c}");
            heap.push(Candidate(
                weight * w,
                std::cmp::Reverse(piece),
                left.to_string(),
            ));
        }
    };
    push(&mut heap, boundary, 0.9);
    for (c, w) in &letters {
        push(&mut heap, c, *w);
    }
    let mut pieces = Vec::with_capacity(count);
    let mut merges = Vec::with_capacity(count);
    let mut seen: HashSet<String> = alphabet.iter().cloned().collect();
    while pieces.len() < count {
        let Some(Candidate(weight, std::cmp::Reverse(piece), left)) = heap.pop() else {
            break;
        };
        if !seen.insert(piece.clone()) {
            continue;
        }
        let right = &piece[left.len()..];
        merges.push(format!("{left} {right}"));
        push(&mut heap, &piece, weight);
        pieces.push(piece);
    }
    (pieces, merges)
}

fn llama3_specials() -> Vec<String> {
    let named = [
        (0, "<|begin_of_text|>"),
        (1, "<|end_of_text|>"),
        (4, "<|finetune_right_pad_id|>"),
        (6, "<|start_header_id|>"),
        (7, "<|end_header_id|>"),
        (8, "<|eom_id|>"),
        (9, "<|eot_id|>"),
        (10, "<|python_tag|>"),
    ];
    let mut reserved = 0;
    (0..256)
        .map(|i| match named.iter().find(|(at, _)| *at == i) {
            Some((_, name)) => name.to_string(),
            None => {
                reserved += 1;
                format!("<|reserved_special_token_{}|>", reserved - 1)
            }
        })
        .collect()
}

fn qwen_specials() -> Vec<String> {
    [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ]
    .map(String::from)
    .to_vec()
}

const LLAMA3_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}";

const QWEN_TEMPLATE: &str = "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}";

/// The chat template a shape's GGUF carries (Llama 2's has none: Corolla's fallback applies).
pub(crate) fn chat_template(shape: ModelShape) -> Option<&'static str> {
    match shape {
        ModelShape::Llama2_70b | ModelShape::Mixtral8x7b => None,
        ModelShape::Llama3_70b => Some(LLAMA3_TEMPLATE),
        ModelShape::Qwen25_72b | ModelShape::Qwen3_32b | ModelShape::Qwen3_30bA3b => {
            Some(QWEN_TEMPLATE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabularies_have_the_real_sizes_and_build_every_piece() {
        for shape in ModelShape::ALL {
            let size = shape.config(1).vocab_size;
            let v = Vocabulary::build(shape, size).unwrap();
            assert_eq!(v.tokens.len(), size, "{}", shape.name());
            assert_eq!(v.types.len(), size);
            let distinct: HashSet<&String> = v.tokens.iter().collect();
            assert_eq!(distinct.len(), size, "{}: duplicate tokens", shape.name());
            let index: HashSet<&str> = v.tokens.iter().map(String::as_str).collect();
            for merge in &v.merges {
                let (l, r) = merge.split_once(' ').unwrap();
                assert!(index.contains(l) && index.contains(r), "{merge}");
                assert!(index.contains(format!("{l}{r}").as_str()), "{merge}");
            }
        }
    }
}
