//! Models named by a Hugging Face repo id (`owner/name`): downloaded through
//! hf-hub into its cache, with a progress bar, fetching only the files this
//! server needs: the config and weight index first, then only the weight
//! files holding its blocks. `HF_ENDPOINT` and `HF_HOME` are honoured.

use std::path::{Path, PathBuf};

use corolla_model::checkpoint::{CONFIG_FILE, COROLLA_INDEX, SHARDED_INDEX, SINGLE_FILE};
use corolla_model::Checkpoint;
use hf_hub::api::sync::{ApiBuilder, ApiRepo};

use crate::error::ServerError;

/// Where `--model` points.
pub enum ModelSource {
    /// A local folder or GGUF file.
    Folder(PathBuf),
    Hub {
        id: String,
        repo: Box<ApiRepo>,
        snapshot: PathBuf,
    },
}

fn looks_like_repo_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

fn hub_error(what: &str, e: impl std::fmt::Display) -> ServerError {
    ServerError::Download {
        what: what.to_string(),
        message: e.to_string(),
    }
}

impl ModelSource {
    /// A local folder or GGUF file as is; otherwise a repo id, whose config
    /// and weight index are downloaded now.
    pub fn resolve(model: &Path) -> Result<Self, ServerError> {
        if model.is_dir() || model.is_file() {
            return Ok(ModelSource::Folder(model.to_path_buf()));
        }
        let id = model.to_string_lossy();
        if model.exists() || !looks_like_repo_id(&id) {
            return Err(ServerError::NoSuchModel(model.to_path_buf()));
        }
        let api = ApiBuilder::from_env()
            .with_progress(true)
            .build()
            .map_err(|e| hub_error(&id, e))?;
        let repo = api.model(id.to_string());
        let config = repo
            .get(CONFIG_FILE)
            .map_err(|e| hub_error(CONFIG_FILE, e))?;
        let snapshot = config
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| hub_error(CONFIG_FILE, "the hub cache path has no parent"))?;
        // The first index the repo has decides the layout; absent ones are
        // expected and not errors.
        let found_index = [COROLLA_INDEX, SHARDED_INDEX]
            .into_iter()
            .any(|f| repo.get(f).is_ok());
        if !found_index {
            repo.get(SINGLE_FILE)
                .map_err(|e| hub_error(SINGLE_FILE, e))?;
        }
        Ok(ModelSource::Hub {
            id: id.to_string(),
            repo: Box::new(repo),
            snapshot,
        })
    }

    /// The DHT name a hub model gets by default: the repo's own name (what a
    /// local copy's folder is usually called), unless its index names one.
    pub fn default_name(&self, checkpoint: &Checkpoint) -> Option<String> {
        match self {
            ModelSource::Hub { id, .. }
                if checkpoint
                    .corolla_index()
                    .and_then(|i| i.model_name.as_ref())
                    .is_none() =>
            {
                id.rsplit('/').next().map(str::to_owned)
            }
            _ => None,
        }
    }

    pub fn dir(&self) -> &Path {
        match self {
            ModelSource::Folder(dir) => dir,
            ModelSource::Hub { snapshot, .. } => snapshot,
        }
    }

    /// Makes sure `files` are present, downloading what is missing.
    pub fn fetch(&self, files: impl IntoIterator<Item = String>) -> Result<(), ServerError> {
        if let ModelSource::Hub { repo, .. } = self {
            for file in files {
                repo.get(&file).map_err(|e| hub_error(&file, e))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::looks_like_repo_id;

    #[test]
    fn repo_ids_are_told_from_paths() {
        assert!(looks_like_repo_id("meta-llama/Llama-2-70b-hf"));
        assert!(looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct"));
        assert!(!looks_like_repo_id("/abs/path"));
        assert!(!looks_like_repo_id("models/a/b"));
        assert!(!looks_like_repo_id("../x"));
        assert!(!looks_like_repo_id("plain"));
    }
}
