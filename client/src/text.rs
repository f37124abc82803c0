//! Text in and out: the model's tokenizer and incremental detokenization.

use std::path::Path;

use tokenizers::Tokenizer;

use crate::error::ClientError;

/// The model's `tokenizer.json`, encoding as transformers does (special
/// tokens such as `<s>` added by the tokenizer's own post-processor).
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl TextTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, ClientError> {
        let inner = Tokenizer::from_file(path)
            .map_err(|e| ClientError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(TextTokenizer { inner })
    }

    pub fn from_bytes(json: &[u8]) -> Result<Self, ClientError> {
        let inner =
            Tokenizer::from_bytes(json).map_err(|e| ClientError::Tokenizer(e.to_string()))?;
        Ok(TextTokenizer { inner })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ClientError> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| ClientError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
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
}
