//! `corolla convert`: split a checkpoint into per-span block files plus a
//! client part, so that a server fetches only its blocks and a browser only
//! the client part.
//!
//! Tensors are copied byte for byte (same names, dtypes and shapes), so a
//! converted folder computes exactly what its source computes.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView as StView;

use crate::checkpoint::{
    Checkpoint, CorollaIndex, SpanFile, CONFIG_FILE, COROLLA_INDEX, TOKENIZER_FILE,
};
use crate::error::{ModelError, Result};
use crate::head::{EMBED_TOKENS, FINAL_NORM, LM_HEAD};

/// Files copied unchanged when present beside the weights.
const SIDE_FILES: &[&str] = &[
    CONFIG_FILE,
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
];

pub const CLIENT_FILE: &str = "client.safetensors";

/// Progress of a conversion, reported after each file.
#[derive(Debug, Clone)]
pub struct ConvertProgress {
    pub files_done: usize,
    pub files_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub last_file: String,
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

pub fn span_file_name(start: usize, end: usize) -> String {
    format!("blocks-{start:05}-{end:05}.safetensors")
}

/// Writes the converted layout of `source` into `out`, which must be empty
/// or absent. Returns the index it wrote.
pub fn convert(
    source: &Checkpoint,
    out: &Path,
    blocks_per_file: usize,
    mut progress: impl FnMut(&ConvertProgress),
) -> Result<CorollaIndex> {
    if blocks_per_file == 0 {
        return Err(ModelError::InvalidConfig(
            "--blocks-per-file must be at least 1".into(),
        ));
    }
    if out.exists() {
        let mut entries = std::fs::read_dir(out).map_err(|e| ModelError::io(out, e))?;
        if entries.next().is_some() {
            return Err(ModelError::invalid_file(
                out,
                "output folder is not empty; refusing to overwrite anything",
            ));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;

    let num_layers = source.config().num_hidden_layers;
    let spans: Vec<SpanFile> = (0..num_layers)
        .step_by(blocks_per_file)
        .map(|start| {
            let end = (start + blocks_per_file).min(num_layers);
            SpanFile {
                start,
                end,
                file: span_file_name(start, end),
            }
        })
        .collect();

    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut names: Vec<&str> = source.tensor_names().collect();
    names.sort_unstable();
    for name in names {
        let file = if let Some(layer) = layer_of(name) {
            let span = spans.get(layer / blocks_per_file).ok_or_else(|| {
                ModelError::InvalidConfig(format!(
                    "tensor {name} belongs to layer {layer}, but the model has {num_layers} layers"
                ))
            })?;
            span.file.clone()
        } else if [EMBED_TOKENS, FINAL_NORM, LM_HEAD].contains(&name) {
            CLIENT_FILE.to_string()
        } else {
            tracing::warn!(
                tensor = name,
                "skipping a tensor that is neither a block's nor the client's"
            );
            continue;
        };
        groups.entry(file).or_default().push(name.to_string());
    }
    if !groups.contains_key(CLIENT_FILE) {
        return Err(ModelError::MissingTensor {
            name: EMBED_TOKENS.into(),
        });
    }
    for span in &spans {
        if !groups.contains_key(&span.file) {
            return Err(ModelError::MissingTensor {
                name: format!("model.layers.{}.*", span.start),
            });
        }
    }

    let mut weight_map = BTreeMap::new();
    let mut bytes_total = 0u64;
    for names in groups.values() {
        for name in names {
            bytes_total += source.raw_tensor(name)?.data().len() as u64;
        }
    }
    let mut report = ConvertProgress {
        files_done: 0,
        files_total: groups.len(),
        bytes_done: 0,
        bytes_total,
        last_file: String::new(),
    };
    for (file, names) in &groups {
        let raws = names
            .iter()
            .map(|n| source.raw_tensor(n))
            .collect::<Result<Vec<_>>>()?;
        let views = names
            .iter()
            .zip(&raws)
            .map(|(n, r)| {
                let view = StView::new(r.dtype, r.shape.clone(), r.data())
                    .map_err(|e| ModelError::invalid_file(source.dir(), format!("{n}: {e}")))?;
                Ok((n.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let partial = out.join(format!(".{file}.partial"));
        safetensors::serialize_to_file(views, None, &partial)
            .map_err(|e| ModelError::invalid_file(&partial, e))?;
        let path = out.join(file);
        std::fs::rename(&partial, &path).map_err(|e| ModelError::io(&path, e))?;
        for n in names {
            weight_map.insert(n.clone(), file.clone());
        }
        report.files_done += 1;
        report.bytes_done += raws.iter().map(|r| r.data().len() as u64).sum::<u64>();
        report.last_file = file.clone();
        progress(&report);
    }

    for side in SIDE_FILES {
        let from = source.dir().join(side);
        if from.is_file() {
            let to = out.join(side);
            std::fs::copy(&from, &to).map_err(|e| ModelError::io(&to, e))?;
        }
    }

    let index = CorollaIndex {
        format: CorollaIndex::FORMAT.into(),
        version: CorollaIndex::VERSION,
        num_layers,
        client: CLIENT_FILE.into(),
        spans,
        weight_map,
        fingerprint: Some(crate::fingerprint::fingerprint(source)?),
        block_hashes: Some(crate::fingerprint::block_hashes(source, 0, num_layers)?),
        model_name: Some(crate::fingerprint::default_model_name(source)),
    };
    let path = out.join(COROLLA_INDEX);
    let json =
        serde_json::to_string_pretty(&index).map_err(|e| ModelError::invalid_file(&path, e))?;
    std::fs::write(&path, json).map_err(|e| ModelError::io(&path, e))?;
    Ok(index)
}
