//! A `tokenizer.json` built from GGUF tokenizer metadata, so that GGUF
//! models tokenize with the same `tokenizers` library as Hugging Face ones.
//!
//! Two kinds are understood, as llama.cpp names them: `gpt2` (byte-level
//! BPE with merges; the pre-tokenizer regex comes from `tokenizer.ggml.pre`)
//! and `llama` (SentencePiece BPE: merges follow the scores of the merged
//! pieces, unknown bytes fall back to `<0xXX>` tokens).

use std::collections::HashMap;

use corolla_model::gguf::GgufTokenizer;
use serde_json::{json, Value};

use crate::error::ClientError;

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

fn added_tokens(t: &GgufTokenizer) -> Vec<Value> {
    t.token_types
        .iter()
        .enumerate()
        .filter(|(_, &kind)| kind == GgufTokenizer::CONTROL || kind == GgufTokenizer::USER_DEFINED)
        .map(|(id, &kind)| {
            json!({
                "id": id,
                "content": t.tokens[id],
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": kind == GgufTokenizer::CONTROL,
            })
        })
        .collect()
}

fn vocab(t: &GgufTokenizer) -> serde_json::Map<String, Value> {
    // A token that appears twice keeps its first id, as llama.cpp does.
    let mut vocab = serde_json::Map::new();
    for (id, token) in t.tokens.iter().enumerate() {
        vocab.entry(token.clone()).or_insert(json!(id));
    }
    vocab
}

fn gpt2(t: &GgufTokenizer) -> Result<Value, ClientError> {
    let merges = t
        .merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| ClientError::Tokenizer(format!("GGUF merge {m:?} has no space")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens(t),
        "normalizer": null,
        "pre_tokenizer": gpt2_pre_tokenizer(t.pre.as_deref())?,
        "post_processor": bos_template(t, false),
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab(t), "merges": merges,
        },
    }))
}

/// SentencePiece BPE: a pair merges when the merged piece is in the vocab,
/// earlier the higher that piece's score.
fn spm_merges(t: &GgufTokenizer) -> Vec<Value> {
    let ids: HashMap<&str, usize> = t
        .tokens
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    let mut merges: Vec<(f32, usize, &str, &str)> = Vec::new();
    for (id, piece) in t.tokens.iter().enumerate() {
        if t.token_types.get(id).copied().unwrap_or(1) != 1 {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if ids.contains_key(left) && ids.contains_key(right) {
                let score = t.scores.get(id).copied().unwrap_or(0.0);
                merges.push((score, id, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    merges
        .into_iter()
        .map(|(_, _, l, r)| json!([l, r]))
        .collect()
}

fn llama(t: &GgufTokenizer) -> Result<Value, ClientError> {
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
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens(t),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": bos_template(t, true),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab(t), "merges": spm_merges(t),
        },
    }))
}

/// The `tokenizer.json` equivalent of GGUF tokenizer metadata.
pub fn tokenizer_json(t: &GgufTokenizer) -> Result<String, ClientError> {
    let value = match t.model.as_str() {
        "gpt2" => gpt2(t)?,
        "llama" => llama(t)?,
        other => {
            return Err(ClientError::Tokenizer(format!(
                "GGUF tokenizer model {other:?} is not supported (supported: gpt2, llama)"
            )))
        }
    };
    Ok(value.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::text::TextTokenizer;

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

    fn id(piece: &str) -> u32 {
        259 + PIECES.iter().position(|p| *p == piece).unwrap() as u32
    }

    #[test]
    fn sentencepiece_merges_follow_the_vocabulary_and_fall_back_to_bytes() {
        let tok = TextTokenizer::from_gguf(&spm(&[])).unwrap();
        assert_eq!(
            tok.encode("hello world").unwrap(),
            vec![1, id("\u{2581}hello"), id("\u{2581}world")]
        );
        // "é" is not a piece: its UTF-8 bytes 0xC3 0xA9 become byte tokens.
        let ids = tok.encode("hé").unwrap();
        assert_eq!(ids, vec![1, id("\u{2581}h"), 3 + 0xC3, 3 + 0xA9]);
        assert_eq!(tok.decode(&ids).unwrap(), "hé");
        assert_eq!(
            tok.decode(&tok.encode("hello world").unwrap()).unwrap(),
            "hello world"
        );
        assert_eq!(
            tok.encode_chat("<s>hello").unwrap(),
            vec![1, id("\u{2581}hello")]
        );
    }

    #[test]
    fn unsupported_kinds_are_named() {
        let mut t = spm(&[]);
        t.model = "bert".into();
        let err = tokenizer_json(&t).unwrap_err().to_string();
        assert!(err.contains("\"bert\""), "{err}");
        t.model = "gpt2".into();
        t.pre = Some("mystery".into());
        let err = tokenizer_json(&t).unwrap_err().to_string();
        assert!(err.contains("\"mystery\""), "{err}");
    }
}
