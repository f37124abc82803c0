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

    /// The most bytes all adapters add to one block in `dtype_bytes` per
    /// value: what `--num-blocks auto` adds to a block's weights.
    pub fn bytes_per_block(&self, dtype_bytes: usize) -> u64 {
        let mut per_layer: BTreeMap<usize, u64> = BTreeMap::new();
        for (_, file) in &self.files {
            for ((layer, _), pair) in file.pairs() {
                let values = (pair.a.elem_count() + pair.b.elem_count()) as u64;
                *per_layer.entry(*layer).or_default() += values * dtype_bytes as u64;
            }
        }
        per_layer.into_values().max().unwrap_or(0)
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

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/adapters")
            .join(name)
    }

    fn arg(name: &str, file: &str) -> AdapterArg {
        AdapterArg {
            name: name.into(),
            path: fixture(file),
        }
    }

    #[test]
    fn files_are_read_once_named_once_and_sized_per_block() {
        let files = AdapterFiles::read(&[arg("alpha", "llama3-alpha"), arg("beta", "llama3-beta")])
            .unwrap();
        // Layer 0 holds both: alpha's r 4 on all seven projections of a
        // 64-wide model with FFN 176 and 2 KV heads of 16 (4672 values),
        // beta's r 8 on q, v and down (3712); f32.
        assert_eq!(files.bytes_per_block(4), (4672 + 3712) * 4);
        let twice =
            AdapterFiles::read(&[arg("alpha", "llama3-alpha"), arg("alpha", "llama3-beta")]);
        assert!(matches!(twice, Err(ServerError::BadArgs(m)) if m.contains("twice")));
        let missing = AdapterFiles::read(&[arg("gone", "no-such-adapter")]).unwrap_err();
        assert_eq!(missing.kind(), "adapter");
        assert!(
            missing.to_string().starts_with("adapter \"gone\""),
            "{missing}"
        );
    }

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
