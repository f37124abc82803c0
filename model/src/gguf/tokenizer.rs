//! A GGUF file's tokenizer and chat template, as its metadata describes them.

use candle_core::quantized::gguf_file::Value;

use crate::error::Result;

use super::{value_as_u64, GgufFile};

impl GgufFile {
    /// The tokenizer stored in the metadata, if any.
    pub fn tokenizer(&self) -> Result<Option<GgufTokenizer>> {
        let Some(model) = self.string("tokenizer.ggml.model") else {
            return Ok(None);
        };
        let strings = |key: &str| -> Result<Vec<String>> {
            match self.metadata.get(key) {
                None => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s.clone()),
                        _ => Err(self.invalid(format!("{key} holds a non-string"))),
                    })
                    .collect(),
                Some(_) => Err(self.invalid(format!("{key} is not an array"))),
            }
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(self.invalid("tokenizer.ggml.tokens is empty"));
        }
        let numbers = |key: &str| -> Result<Vec<f64>> {
            match self.metadata.get(key) {
                None => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| match v {
                        Value::F32(x) => Ok(*x as f64),
                        Value::F64(x) => Ok(*x),
                        Value::I32(x) => Ok(*x as f64),
                        other => value_as_u64(other)
                            .map(|x| x as f64)
                            .ok_or_else(|| self.invalid(format!("{key} holds a non-number"))),
                    })
                    .collect(),
                Some(_) => Err(self.invalid(format!("{key} is not an array"))),
            }
        };
        let scores: Vec<f32> = numbers("tokenizer.ggml.scores")?
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let token_types: Vec<i32> = numbers("tokenizer.ggml.token_type")?
            .into_iter()
            .map(|x| x as i32)
            .collect();
        for (key, len) in [
            ("tokenizer.ggml.scores", scores.len()),
            ("tokenizer.ggml.token_type", token_types.len()),
        ] {
            if len != 0 && len != tokens.len() {
                return Err(self.invalid(format!(
                    "{key} has {len} entries for {} tokens",
                    tokens.len()
                )));
            }
        }
        let id = |key: &str| {
            self.uint(key)
                .and_then(|v| u32::try_from(v).ok())
                .filter(|&v| (v as usize) < tokens.len())
        };
        Ok(Some(GgufTokenizer {
            model: model.to_string(),
            pre: self.string("tokenizer.ggml.pre").map(str::to_string),
            merges: strings("tokenizer.ggml.merges")?,
            scores,
            token_types,
            bos_token_id: id("tokenizer.ggml.bos_token_id"),
            eos_token_id: id("tokenizer.ggml.eos_token_id"),
            unknown_token_id: id("tokenizer.ggml.unknown_token_id"),
            add_bos_token: self.bool("tokenizer.ggml.add_bos_token"),
            add_space_prefix: self.bool("tokenizer.ggml.add_space_prefix"),
            tokens,
        }))
    }

    pub fn chat_template(&self) -> Option<String> {
        self.string("tokenizer.chat_template").map(str::to_string)
    }
}

/// A tokenizer as GGUF metadata describes it; the client turns it into a
/// `tokenizers::Tokenizer`.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTokenizer {
    /// `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE with byte fallback).
    pub model: String,
    /// The pre-tokenizer llama.cpp names for `gpt2` models (`smollm`, `llama-bpe`, …).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Vec<i32>,
    pub scores: Vec<f32>,
    /// `"left right"` pairs, highest priority first.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

impl GgufTokenizer {
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const BYTE: i32 = 6;
}
