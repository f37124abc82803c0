//! The tokenizer GGUF tokenizer metadata describes, in the pieces of a
//! `tokenizer.json` ([`TokenizerParts`]), so that GGUF models tokenize with
//! the same `tokenizers` library as Hugging Face ones.
//!
//! Two kinds are understood, as llama.cpp names them: `gpt2` (byte-level
//! BPE with merges; the pre-tokenizer regex comes from `tokenizer.ggml.pre`)
//! and `llama` (SentencePiece BPE: merges follow the scores of the merged
//! pieces, unknown bytes fall back to `<0xXX>` tokens).

use corolla_model::gguf::GgufTokenizer;
use serde_json::{json, Value};
use tokenizers::models::bpe::{Merges, Vocab};
use tokenizers::AddedToken;

use crate::error::ClientError;
use crate::tokenizer_parts::{BpeOptions, TokenizerParts};

/// Llama 3's split (`llama-bpe` in llama.cpp).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split (`qwen2` in llama.cpp): as Llama 3's, but digits one by one.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split_then_bytes(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// The pre-tokenizer llama.cpp applies for a `tokenizer.ggml.pre` value.
fn gpt2_pre_tokenizer(pre: Option<&str>) -> Result<Value, ClientError> {
    Ok(match pre.unwrap_or("default") {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        // Every digit on its own, then GPT-2's split.
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva" => {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]})
        }
        "llama-bpe" | "llama3" | "falcon3" => split_then_bytes(LLAMA3_SPLIT),
        "qwen2" => split_then_bytes(QWEN2_SPLIT),
        other => {
            return Err(ClientError::Tokenizer(format!(
                "GGUF pre-tokenizer {other:?} is not supported \
                 (supported: default, smollm and its kin, llama-bpe, qwen2)"
            )))
        }
    })
}

fn bos_template(t: &GgufTokenizer, default_add_bos: bool) -> Value {
    match t.bos_token_id {
        Some(bos) if t.add_bos_token.unwrap_or(default_add_bos) => {
            let token = &t.tokens[bos as usize];
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {token.as_str(): {"id": token, "ids": [bos], "tokens": [token]}},
            })
        }
        _ => Value::Null,
    }
}

fn added_tokens(t: &GgufTokenizer) -> Vec<AddedToken> {
    t.token_types
        .iter()
        .enumerate()
        .filter(|(_, &kind)| kind == GgufTokenizer::CONTROL || kind == GgufTokenizer::USER_DEFINED)
        .map(|(id, &kind)| AddedToken {
            content: t.tokens[id].clone(),
            single_word: false,
            lstrip: false,
            rstrip: false,
            normalized: false,
            special: kind == GgufTokenizer::CONTROL,
        })
        .collect()
}

fn vocab(t: &GgufTokenizer) -> Vocab {
    // A token that appears twice keeps its first id, as llama.cpp does.
    let mut vocab = Vocab::default();
    for (id, token) in t.tokens.iter().enumerate() {
        vocab.entry(token.clone()).or_insert(id as u32);
    }
    vocab
}

/// Everything of a `tokenizer.json` but its model and added tokens.
fn rest(
    normalizer: Value,
    pre_tokenizer: Value,
    post_processor: Value,
    decoder: Value,
) -> serde_json::Map<String, Value> {
    [
        ("version", json!("1.0")),
        ("normalizer", normalizer),
        ("pre_tokenizer", pre_tokenizer),
        ("post_processor", post_processor),
        ("decoder", decoder),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_string(), value))
    .collect()
}

fn gpt2(t: &GgufTokenizer) -> Result<TokenizerParts, ClientError> {
    let merges = t
        .merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ClientError::Tokenizer(format!("GGUF merge {m:?} has no space")))
        })
        .collect::<Result<Merges, _>>()?;
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    Ok(TokenizerParts {
        rest: rest(
            Value::Null,
            gpt2_pre_tokenizer(t.pre.as_deref())?,
            bos_template(t, false),
            decoder,
        ),
        vocab: vocab(t),
        merges,
        options: BpeOptions {
            fuse_unk: Some(false),
            byte_fallback: Some(false),
            ignore_merges: Some(false),
            ..BpeOptions::default()
        },
        added: added_tokens(t),
    })
}

/// SentencePiece BPE: a pair merges when the merged piece is in the vocab,
/// earlier the higher that piece's score.
fn spm_merges(t: &GgufTokenizer, vocab: &Vocab) -> Merges {
    let mut merges: Vec<(f32, usize, &str, &str)> = Vec::new();
    for (id, piece) in t.tokens.iter().enumerate() {
        if t.token_types.get(id).copied().unwrap_or(1) != 1 {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                let score = t.scores.get(id).copied().unwrap_or(0.0);
                merges.push((score, id, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    merges
        .into_iter()
        .map(|(_, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

fn llama(t: &GgufTokenizer) -> Result<TokenizerParts, ClientError> {
    let unk = t
        .unknown_token_id
        .map(|id| t.tokens[id as usize].clone())
        .unwrap_or_else(|| "<unk>".into());
    let mut normalizers = Vec::new();
    if t.add_space_prefix.unwrap_or(true) {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if t.add_space_prefix.unwrap_or(true) {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let vocab = vocab(t);
    let merges = spm_merges(t, &vocab);
    Ok(TokenizerParts {
        rest: rest(
            json!({"type": "Sequence", "normalizers": normalizers}),
            Value::Null,
            bos_template(t, true),
            json!({"type": "Sequence", "decoders": decoders}),
        ),
        vocab,
        merges,
        options: BpeOptions {
            unk_token: Some(unk),
            fuse_unk: Some(true),
            byte_fallback: Some(true),
            ignore_merges: Some(false),
            ..BpeOptions::default()
        },
        added: added_tokens(t),
    })
}

/// The tokenizer GGUF metadata describes, in the pieces a `tokenizer.json`
/// would hold.
pub fn tokenizer_parts(t: &GgufTokenizer) -> Result<TokenizerParts, ClientError> {
    match t.model.as_str() {
        "gpt2" => gpt2(t),
        "llama" => llama(t),
        other => Err(ClientError::Tokenizer(format!(
            "GGUF tokenizer model {other:?} is not supported (supported: gpt2, llama)"
        ))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const PIECES: &[&str] = &[
        "\u{2581}",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "\u{2581}h",
        "\u{2581}he",
        "ll",
        "llo",
        "\u{2581}hello",
        "\u{2581}w",
        "or",
        "\u{2581}wor",
        "ld",
        "\u{2581}world",
    ];

    /// A small SentencePiece vocabulary as llama.cpp's GGUF files store one:
    /// `<unk> <s> </s>`, 256 byte tokens, pieces, and `extra` control tokens.
    pub(crate) fn spm(extra: &[&str]) -> GgufTokenizer {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        let mut types = vec![2, 3, 3];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        types.extend([GgufTokenizer::BYTE; 256]);
        tokens.extend(PIECES.iter().map(|p| p.to_string()));
        types.extend(PIECES.iter().map(|_| 1));
        tokens.extend(extra.iter().map(|p| p.to_string()));
        types.extend(extra.iter().map(|_| GgufTokenizer::CONTROL));
        let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
        GgufTokenizer {
            model: "llama".into(),
            pre: None,
            tokens,
            token_types: types,
            scores,
            merges: Vec::new(),
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            unknown_token_id: Some(0),
            add_bos_token: None,
            add_space_prefix: None,
        }
    }

    /// The id of one of `spm`'s pieces.
    pub(crate) fn id(piece: &str) -> u32 {
        259 + PIECES.iter().position(|p| *p == piece).unwrap() as u32
    }

    #[test]
    fn unsupported_kinds_are_named() {
        let mut t = spm(&[]);
        t.model = "bert".into();
        let err = tokenizer_parts(&t).err().unwrap().to_string();
        assert!(err.contains("\"bert\""), "{err}");
        t.model = "gpt2".into();
        t.pre = Some("mystery".into());
        let err = tokenizer_parts(&t).err().unwrap().to_string();
        assert!(err.contains("\"mystery\""), "{err}");
    }
}
