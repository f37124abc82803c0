//! A BPE tokenizer assembled from its parts, around the `tokenizers`
//! library's JSON route for the model.
//!
//! That route holds a vocabulary and its merges three times over while it
//! parses (serde's buffered content for an untagged enum, a
//! `serde_json::Value` for a flattened field, then the model's own maps).
//! For a 32k SentencePiece vocabulary that is ~30 MB, and in the page's
//! worker wasm memory never shrinks, so the transient stays for good. Here
//! the vocabulary and merges are read straight into the types the model is
//! built from; everything else (normalizer, pre-tokenizer, post-processor,
//! decoder) still goes through the library's own deserializers, so the
//! tokenizer is the one `Tokenizer::from_bytes` gives.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokenizers::models::bpe::{BpeBuilder, Merges, Vocab};
use tokenizers::{AddedToken, Tokenizer};

use crate::error::ClientError;

/// A BPE model's settings, as `tokenizer.json` names them.
#[derive(Debug, Default, Deserialize)]
pub struct BpeOptions {
    #[serde(default)]
    pub dropout: Option<f32>,
    #[serde(default)]
    pub unk_token: Option<String>,
    #[serde(default)]
    pub continuing_subword_prefix: Option<String>,
    #[serde(default)]
    pub end_of_word_suffix: Option<String>,
    #[serde(default)]
    pub fuse_unk: Option<bool>,
    #[serde(default)]
    pub byte_fallback: Option<bool>,
    #[serde(default)]
    pub ignore_merges: Option<bool>,
}

/// A tokenizer with a BPE model, in pieces.
pub struct TokenizerParts {
    /// The `tokenizer.json` keys other than `model` and `added_tokens`.
    pub rest: Map<String, Value>,
    pub vocab: Vocab,
    /// In priority order.
    pub merges: Merges,
    pub options: BpeOptions,
    pub added: Vec<AddedToken>,
}

/// The keys of `tokenizer.json` besides the model and the added tokens
/// that the library reads; others are ignored, as the library does.
const OTHER_KEYS: [&str; 7] = [
    "version",
    "truncation",
    "padding",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
];

#[derive(Deserialize)]
struct Document {
    model: BpeDocument,
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

#[derive(Deserialize)]
struct BpeDocument {
    vocab: Vocab,
    merges: Vec<Merge>,
    #[serde(flatten)]
    options: BpeOptions,
}

/// Only the model's `type`, read without keeping anything else.
#[derive(Deserialize)]
struct Probe {
    model: ProbeModel,
}

#[derive(Deserialize)]
struct ProbeModel {
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// A merge as `["a", "b"]` or, in older files, `"a b"`.
struct Merge(String, String);

impl<'de> Deserialize<'de> for Merge {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MergeVisitor;
        impl<'de> Visitor<'de> for MergeVisitor {
            type Value = Merge;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a merge: a pair of strings or \"a b\"")
            }

            fn visit_str<E: de::Error>(self, joined: &str) -> Result<Merge, E> {
                let mut parts = joined.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => Ok(Merge(a.to_string(), b.to_string())),
                    _ => Err(E::custom(format!("merge {joined:?} is not two pieces"))),
                }
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge, A::Error> {
                let a = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let b = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(3, &self));
                }
                Ok(Merge(a, b))
            }
        }
        deserializer.deserialize_any(MergeVisitor)
    }
}

impl TokenizerParts {
    /// Reads a `tokenizer.json` whose model is BPE; `None` for any other
    /// model, which the library reads as a whole.
    pub fn from_json(json: &[u8]) -> Result<Option<Self>, ClientError> {
        let bad = |e: serde_json::Error| ClientError::Tokenizer(e.to_string());
        let probe: Probe = serde_json::from_slice(json).map_err(bad)?;
        if probe.model.kind.as_deref() != Some("BPE") {
            return Ok(None);
        }
        let doc: Document = serde_json::from_slice(json).map_err(bad)?;
        let rest = doc
            .rest
            .into_iter()
            .filter(|(key, _)| OTHER_KEYS.contains(&key.as_str()))
            .collect();
        Ok(Some(TokenizerParts {
            rest,
            vocab: doc.model.vocab,
            merges: doc.model.merges.into_iter().map(|m| (m.0, m.1)).collect(),
            options: doc.model.options,
            added: doc.added_tokens,
        }))
    }

    /// The tokenizer: the library reads everything but the model's
    /// vocabulary and merges, the model is built from them, and the added
    /// tokens are added to it last, as the library's own reader does.
    pub fn build(self) -> Result<Tokenizer, ClientError> {
        let bad = |e: tokenizers::Error| ClientError::Tokenizer(e.to_string());
        let mut skeleton = self.rest;
        skeleton.insert(
            "model".into(),
            json!({"type": "BPE", "vocab": {}, "merges": []}),
        );
        let mut tokenizer: Tokenizer = serde_json::from_value(Value::Object(skeleton))
            .map_err(|e| ClientError::Tokenizer(e.to_string()))?;

        let options = self.options;
        let mut bpe = BpeBuilder::new().vocab_and_merges(self.vocab, self.merges);
        if let Some(p) = options.dropout {
            bpe = bpe.dropout(p);
        }
        if let Some(unk) = options.unk_token {
            bpe = bpe.unk_token(unk);
        }
        if let Some(prefix) = options.continuing_subword_prefix {
            bpe = bpe.continuing_subword_prefix(prefix);
        }
        if let Some(suffix) = options.end_of_word_suffix {
            bpe = bpe.end_of_word_suffix(suffix);
        }
        if let Some(fuse) = options.fuse_unk {
            bpe = bpe.fuse_unk(fuse);
        }
        if let Some(fallback) = options.byte_fallback {
            bpe = bpe.byte_fallback(fallback);
        }
        if let Some(ignore) = options.ignore_merges {
            bpe = bpe.ignore_merges(ignore);
        }
        tokenizer.with_model(bpe.build().map_err(bad)?);
        tokenizer.add_tokens(self.added).map_err(bad)?;
        Ok(tokenizer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name)
            .join("tokenizer.json");
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    const TEXTS: &[&str] = &[
        "Hello, world! The year 2024 had 366 days.",
        "  leading spaces and\ttabs\nnew lines\r\n",
        "naïve café — 東京 🙂 <s> </s> <|im_start|>user\nhi<|im_end|>",
        "",
    ];

    /// The parts give the tokenizer the library's reader gives: the same
    /// ids with and without special tokens, the same text back.
    #[test]
    fn parts_tokenize_as_the_library_does() {
        for name in [
            "tiny-llama-a",
            "families/llama3",
            "families/qwen2",
            "families/mistral",
        ] {
            let json = fixture(name);
            let library = Tokenizer::from_bytes(&json).unwrap();
            let parts = TokenizerParts::from_json(&json)
                .unwrap()
                .unwrap_or_else(|| panic!("{name} is a BPE tokenizer"))
                .build()
                .unwrap();
            assert_eq!(parts.get_vocab_size(true), library.get_vocab_size(true));
            for text in TEXTS {
                for special in [true, false] {
                    let want = library.encode(*text, special).unwrap();
                    let got = parts.encode(*text, special).unwrap();
                    assert_eq!(got.get_ids(), want.get_ids(), "{name}: {text:?}");
                    assert_eq!(
                        parts.decode(got.get_ids(), true).unwrap(),
                        library.decode(want.get_ids(), true).unwrap(),
                        "{name}: {text:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn legacy_merges_and_bad_ones() {
        let json = |merges: &str| {
            format!(
                r#"{{"version": "1.0", "model": {{"type": "BPE", "vocab": {{"a": 0, "b": 1, "ab": 2}},
                    "merges": {merges}}}}}"#
            )
        };
        for merges in [r#"["a b"]"#, r#"[["a", "b"]]"#] {
            let tokenizer = TokenizerParts::from_json(json(merges).as_bytes())
                .unwrap()
                .unwrap()
                .build()
                .unwrap();
            assert_eq!(tokenizer.encode("ab", false).unwrap().get_ids(), &[2]);
        }
        for merges in [r#"["a b c"]"#, r#"[["a"]]"#, r#"[["a", "b", "c"]]"#, "[1]"] {
            assert!(
                TokenizerParts::from_json(json(merges).as_bytes()).is_err(),
                "{merges}"
            );
        }
        let unknown = json(r#"[["a", "zz"]]"#);
        let parts = TokenizerParts::from_json(unknown.as_bytes())
            .unwrap()
            .unwrap();
        assert!(parts.build().is_err());
    }

    #[test]
    fn other_models_are_left_to_the_library() {
        let word_level =
            br#"{"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}"#;
        assert!(TokenizerParts::from_json(word_level).unwrap().is_none());
        assert!(TokenizerParts::from_json(b"{}").is_err());
    }
}
