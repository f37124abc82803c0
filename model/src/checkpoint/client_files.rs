//! What a checkpoint holds for the client part besides tensors: the
//! tokenizer and chat template (`tokenizer.json` and friends beside the
//! weights, or a GGUF file's metadata).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{ModelError, Result};
use crate::gguf::GgufTokenizer;
use crate::weight_file::WeightFile;

use super::{Checkpoint, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};

/// Where a model's tokenizer comes from.
#[derive(Debug, Clone)]
pub enum TokenizerSource {
    /// A Hugging Face `tokenizer.json`.
    Json(PathBuf),
    /// A `tokenizer.json` held in memory.
    JsonBytes(Vec<u8>),
    /// The metadata of a GGUF file.
    Gguf(Box<GgufTokenizer>),
}

impl Checkpoint {
    /// A side file's bytes: from memory, or read from the folder.
    fn side_file(&self, name: &str) -> Result<Option<Vec<u8>>> {
        if let Some(files) = &self.side_files {
            return Ok(files.get(name).cloned());
        }
        if self.single_file.is_some() {
            return Ok(None);
        }
        let path = self.dir.join(name);
        if !path.is_file() {
            return Ok(None);
        }
        std::fs::read(&path)
            .map(Some)
            .map_err(|e| ModelError::io(&path, e))
    }

    /// The GGUF file holding the client part, whose metadata carries the
    /// tokenizer and chat template.
    /// A page's client part has no embedding table: then the file of the
    /// final norm.
    fn client_gguf(&self) -> Result<Option<Arc<WeightFile>>> {
        let file = [
            crate::tensor_names::EMBED_TOKENS,
            crate::tensor_names::FINAL_NORM,
        ]
        .iter()
        .find_map(|t| self.weight_map.get(*t));
        match file {
            Some(file) if file.ends_with(".gguf") => Ok(Some(self.mapped(file)?)),
            _ => Ok(None),
        }
    }

    /// The model's tokenizer: `tokenizer.json` beside the weights, else the
    /// GGUF metadata.
    pub fn tokenizer_source(&self) -> Result<TokenizerSource> {
        if let Some(files) = &self.side_files {
            if let Some(json) = files.get(TOKENIZER_FILE) {
                return Ok(TokenizerSource::JsonBytes(json.clone()));
            }
        } else {
            let json = self.tokenizer_path();
            if self.single_file.is_none() && json.is_file() {
                return Ok(TokenizerSource::Json(json));
            }
        }
        if let Some(file) = self.client_gguf()? {
            if let WeightFile::Gguf(g) = file.as_ref() {
                if let Some(t) = g.tokenizer()? {
                    return Ok(TokenizerSource::Gguf(Box::new(t)));
                }
            }
        }
        Err(ModelError::invalid_file(
            &self.dir,
            "no tokenizer: expected tokenizer.json or GGUF tokenizer metadata",
        ))
    }

    /// The model's own Jinja chat template, if it ships one (GGUF metadata
    /// or `tokenizer_config.json`).
    pub fn chat_template(&self) -> Result<Option<String>> {
        if let Some(file) = self.client_gguf()? {
            if let WeightFile::Gguf(g) = file.as_ref() {
                return Ok(g.chat_template());
            }
        }
        let Some(bytes) = self.side_file(TOKENIZER_CONFIG_FILE)? else {
            return Ok(None);
        };
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| ModelError::invalid_file(self.dir.join(TOKENIZER_CONFIG_FILE), e))?;
        Ok(match value.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            // A list of named templates: take the default one.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        })
    }

    /// The GGUF metadata of the file holding `tensor`, for `corolla convert`.
    pub fn gguf_metadata_of(
        &self,
        tensor: &str,
    ) -> Result<Option<HashMap<String, candle_core::quantized::gguf_file::Value>>> {
        let Some(file) = self.weight_map.get(tensor) else {
            return Ok(None);
        };
        Ok(match self.mapped(file)?.as_ref() {
            WeightFile::Gguf(g) => Some(g.metadata().clone()),
            WeightFile::Safetensors(_) => None,
        })
    }

    pub fn tokenizer_path(&self) -> PathBuf {
        self.dir.join(TOKENIZER_FILE)
    }
}
