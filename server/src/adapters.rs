//! The LoRA adapters a server offers (`--adapter NAME=PATH`): read once at
//! start-up, taken onto each span the server hosts (a moving server takes
//! them onto its next span), announced by name in its record, and chosen by
//! a session in its Open.

use std::collections::BTreeMap;
use std::path::PathBuf;

use corolla_model::{AdapterFile, BlockSpan, SpanAdapter};
use corolla_shared::adapter_name::{check_adapter_name, MAX_ADAPTERS};

use crate::error::ServerError;

/// `--adapter NAME=PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterArg {
    pub name: String,
    /// A PEFT folder (`adapter_config.json`) or a GGUF adapter file.
    pub path: PathBuf,
}

impl std::str::FromStr for AdapterArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((name, path)) = s.split_once('=') else {
            return Err(format!(
                "{s:?} is not NAME=PATH (a name clients ask for, and a PEFT folder or GGUF adapter)"
            ));
        };
        let name = check_adapter_name(name.trim()).map_err(|e| e.to_string())?;
        if path.trim().is_empty() {
            return Err(format!("adapter {name:?} names no path"));
        }
        Ok(AdapterArg {
            name: name.to_string(),
            path: PathBuf::from(path.trim()),
        })
    }
}

/// The adapter files, as read at start-up.
#[derive(Debug, Default)]
pub(crate) struct AdapterFiles {
    files: Vec<(String, AdapterFile)>,
}

impl AdapterFiles {
    pub fn read(args: &[AdapterArg]) -> Result<Self, ServerError> {
        if args.len() > MAX_ADAPTERS {
            return Err(ServerError::BadArgs(format!(
                "{} adapters given; a server offers at most {MAX_ADAPTERS}",
                args.len()
            )));
        }
        let mut files: Vec<(String, AdapterFile)> = Vec::with_capacity(args.len());
        for arg in args {
            if files.iter().any(|(name, _)| *name == arg.name) {
                return Err(ServerError::BadArgs(format!(
                    "adapter {:?} is given twice",
                    arg.name
                )));
            }
            let file = AdapterFile::open(&arg.path).map_err(|source| ServerError::Adapter {
                name: arg.name.clone(),
                source,
            })?;
            tracing::info!(
                adapter = %arg.name,
                path = %arg.path.display(),
                projections = file.pairs().len(),
                "adapter read"
            );
            files.push((arg.name.clone(), file));
        }
        Ok(AdapterFiles { files })
    }

    /// Every adapter's layers of `span`, checked against its shapes.
    pub fn for_span(&self, span: &BlockSpan) -> Result<ServedAdapters, ServerError> {
        let by_name = self
            .files
            .iter()
            .map(|(name, file)| {
                let adapter = span.adapter(file).map_err(|source| ServerError::Adapter {
                    name: name.clone(),
                    source,
                })?;
                Ok((name.clone(), adapter))
            })
            .collect::<Result<_, ServerError>>()?;
        Ok(ServedAdapters { by_name })
    }
}

/// The adapters one hosted span runs sessions with.
#[derive(Debug, Clone, Default)]
pub(crate) struct ServedAdapters {
    by_name: BTreeMap<String, SpanAdapter>,
}

impl ServedAdapters {
    /// Names, in order: what the record announces.
    pub fn names(&self) -> Vec<String> {
        self.by_name.keys().cloned().collect()
    }

    pub fn get(&self, name: &str) -> Option<&SpanAdapter> {
        self.by_name.get(name)
    }

    /// Bytes all adapters' matrices take on this span.
    pub fn bytes(&self) -> usize {
        self.by_name.values().map(SpanAdapter::bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_as_name_and_path() {
        let arg: AdapterArg = "user/sql-lora=/models/sql".parse().unwrap();
        assert_eq!(arg.name, "user/sql-lora");
        assert_eq!(arg.path, PathBuf::from("/models/sql"));
        for bad in ["no-path", "=x", "a:b=x", "name="] {
            assert!(bad.parse::<AdapterArg>().is_err(), "{bad}");
        }
    }
}
