//! Text in and out: the model's tokenizer and incremental detokenization.

use std::path::Path;

use corolla_model::{Checkpoint, TokenizerSource};
use tokenizers::Tokenizer;

use crate::error::ClientError;
use crate::tokenizer_parts::TokenizerParts;

/// The model's `tokenizer.json`, encoding as transformers does (special
/// tokens such as `<s>` added by the tokenizer's own post-processor).
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl TextTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, ClientError> {
        let json = std::fs::read(path)
            .map_err(|e| ClientError::Tokenizer(format!("{}: {e}", path.display())))?;
        Self::from_bytes(&json).map_err(|e| match e {
            ClientError::Tokenizer(e) => ClientError::Tokenizer(format!("{}: {e}", path.display())),
            other => other,
        })
    }

    /// A `tokenizer.json`. A BPE model's vocabulary and merges are read
    /// straight into the model ([`TokenizerParts`]); other models go
    /// through the library's reader.
    pub fn from_bytes(json: &[u8]) -> Result<Self, ClientError> {
        let inner = match TokenizerParts::from_json(json)? {
            Some(parts) => parts.build()?,
            None => {
                Tokenizer::from_bytes(json).map_err(|e| ClientError::Tokenizer(e.to_string()))?
            }
        };
        Ok(TextTokenizer { inner })
    }

    /// The tokenizer GGUF metadata describes (see [`crate::gguf_tokenizer`]).
    pub fn from_gguf(t: &corolla_model::gguf::GgufTokenizer) -> Result<Self, ClientError> {
        let inner = crate::gguf_tokenizer::tokenizer_parts(t)?.build()?;
        Ok(TextTokenizer { inner })
    }

    /// The tokenizer that belongs to `checkpoint`: its `tokenizer.json` or
    /// its GGUF metadata.
    pub fn for_checkpoint(checkpoint: &Checkpoint) -> Result<Self, ClientError> {
        match checkpoint.tokenizer_source()? {
            TokenizerSource::Json(path) => Self::from_file(&path),
            TokenizerSource::JsonBytes(json) => Self::from_bytes(&json),
            TokenizerSource::Gguf(t) => Self::from_gguf(&t),
        }
    }

    /// Encodes plain text, adding the special tokens (such as BOS) the
    /// tokenizer's post-processor adds.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ClientError> {
        self.encode_with(text, true)
    }

    /// Encodes a rendered chat prompt: its template already wrote every
    /// special token it wants, so none are added.
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>, ClientError> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ClientError> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| ClientError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, ClientError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| ClientError::Tokenizer(e.to_string()))
    }
}

/// Turns a growing list of token ids into text pieces safe to print: a
/// piece is released only once it no longer ends inside a multi-byte
/// character.
#[derive(Default)]
pub struct TextStream {
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream {
    pub fn push(
        &mut self,
        tokenizer: &TextTokenizer,
        id: u32,
    ) -> Result<Option<String>, ClientError> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let piece = text.get(self.emitted..).map(str::to_owned);
        self.emitted = text.len();
        Ok(piece.filter(|p| !p.is_empty()))
    }

    /// Forgets the tokens after the first `kept` (an answer's withdrawn
    /// tokens, see [`crate::AnswerEvent`]); returns the text that had been
    /// released beyond what the kept tokens give, which the caller takes
    /// back. Later pieces follow on from the kept text.
    pub fn truncate(
        &mut self,
        tokenizer: &TextTokenizer,
        kept: usize,
    ) -> Result<String, ClientError> {
        let before = tokenizer.decode(&self.ids)?;
        let released = before.get(..self.emitted).unwrap_or(&before);
        self.ids.truncate(kept);
        let after = tokenizer.decode(&self.ids)?;
        let mut common = released
            .char_indices()
            .zip(after.chars())
            .find(|((_, a), b)| a != b)
            .map_or(released.len().min(after.len()), |((i, _), _)| i);
        while !released.is_char_boundary(common) {
            common -= 1;
        }
        self.emitted = common;
        Ok(released[common..].to_owned())
    }

    /// The text released so far.
    pub fn released(&self, tokenizer: &TextTokenizer) -> Result<String, ClientError> {
        let text = tokenizer.decode(&self.ids)?;
        Ok(text.get(..self.emitted).unwrap_or(&text).to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_tokenizer::tests::{id, spm};

    fn tokenizer() -> TextTokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tiny-llama-a/tokenizer.json"
        );
        TextTokenizer::from_file(Path::new(path)).unwrap()
    }

    /// Pieces streamed, some withdrawn, then others: what a consumer shows
    /// (released text minus what is taken back, plus what follows) is the
    /// kept tokens' text followed by the new ones', as if never withdrawn.
    #[test]
    fn withdrawn_text_is_taken_back_and_the_stream_goes_on_from_the_kept_text() {
        let t = tokenizer();
        let first = t
            .encode_chat("The cat sat on the mat, then éclairs arrived")
            .unwrap();
        let other = t.encode_chat(" a dog barked loudly").unwrap();
        for kept in [0, 1, first.len() / 2, first.len() - 1] {
            let mut stream = TextStream::default();
            let mut shown = String::new();
            for &id in &first {
                shown.push_str(&stream.push(&t, id).unwrap().unwrap_or_default());
            }
            let back = stream.truncate(&t, kept).unwrap();
            assert!(
                shown.ends_with(&back),
                "kept {kept}: {back:?} is not the end of {shown:?}"
            );
            shown.truncate(shown.len() - back.len());
            assert_eq!(shown, stream.released(&t).unwrap());
            for &id in &other {
                shown.push_str(&stream.push(&t, id).unwrap().unwrap_or_default());
            }
            let ids = [&first[..kept], &other[..]].concat();
            assert_eq!(shown, t.decode(&ids).unwrap(), "kept {kept}");
        }
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
}
