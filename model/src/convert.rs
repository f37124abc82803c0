//! `corolla convert`: split a checkpoint into per-span block files plus a
//! client part, so that a server fetches only its blocks and a browser only
//! the client part.
//!
//! Tensors are copied byte for byte (same names, dtypes and shapes), so a
//! converted folder computes exactly what its source computes. A GGUF source
//! becomes GGUF parts that keep their quantization, each with the source's
//! metadata (tokenizer and chat template included), plus a `config.json`.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use safetensors::tensor::TensorView as StView;
use sha2::{Digest, Sha256};

use crate::checkpoint::{
    Checkpoint, CorollaIndex, RawDType, SpanFile, CONFIG_FILE, COROLLA_INDEX, TOKENIZER_FILE,
};
use crate::embeddings::RowFormat;
use crate::error::{ModelError, Result};
use crate::gguf::gguf_name;
use crate::tensor_names::{EMBED_TOKENS, FINAL_NORM, LM_HEAD};

/// Files copied unchanged when present beside the weights.
const SIDE_FILES: &[&str] = &[
    CONFIG_FILE,
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
];

pub const CLIENT_FILE: &str = "client.safetensors";
pub const CLIENT_GGUF_FILE: &str = "client.gguf";

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

fn gguf_span_file_name(start: usize, end: usize) -> String {
    format!("blocks-{start:05}-{end:05}.gguf")
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
    ensure_empty_dir(out)?;

    let gguf = source.is_gguf();
    let client_file = if gguf { CLIENT_GGUF_FILE } else { CLIENT_FILE };
    let num_layers = source.config().num_hidden_layers;
    let spans: Vec<SpanFile> = (0..num_layers)
        .step_by(blocks_per_file)
        .map(|start| {
            let end = (start + blocks_per_file).min(num_layers);
            SpanFile {
                start,
                end,
                file: if gguf {
                    gguf_span_file_name(start, end)
                } else {
                    span_file_name(start, end)
                },
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
            client_file.to_string()
        } else {
            tracing::warn!(
                tensor = name,
                "skipping a tensor that is neither a block's nor the client's"
            );
            continue;
        };
        groups.entry(file).or_default().push(name.to_string());
    }
    if !groups.contains_key(client_file) {
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
    let gguf_metadata = if gguf {
        source.gguf_metadata_of(EMBED_TOKENS)?
    } else {
        None
    };
    for (file, names) in &groups {
        write_part(source, names, gguf_metadata.as_ref(), &out.join(file))?;
        for n in names {
            weight_map.insert(n.clone(), file.clone());
        }
        report.files_done += 1;
        for n in names {
            report.bytes_done += source.raw_tensor(n)?.data().len() as u64;
        }
        report.last_file = file.clone();
        progress(&report);
    }
    write_side_files(source, out)?;

    let index = CorollaIndex {
        format: CorollaIndex::FORMAT.into(),
        version: CorollaIndex::VERSION,
        num_layers,
        client: client_file.into(),
        spans,
        weight_map,
        fingerprint: Some(crate::fingerprint::fingerprint(source)?),
        block_hashes: Some(crate::fingerprint::weight_hashes(source, 0, num_layers)?),
        model_name: Some(crate::fingerprint::default_model_name(source)),
    };
    let path = out.join(COROLLA_INDEX);
    let json =
        serde_json::to_string_pretty(&index).map_err(|e| ModelError::invalid_file(&path, e))?;
    std::fs::write(&path, json).map_err(|e| ModelError::io(&path, e))?;
    Ok(index)
}

/// Writes `names` into the file `path` (through a hidden partial file), as
/// GGUF with `gguf_metadata` when given, else as safetensors.
fn write_part(
    source: &Checkpoint,
    names: &[String],
    gguf_metadata: Option<&std::collections::HashMap<String, Value>>,
    path: &Path,
) -> Result<()> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = path.with_file_name(format!(".{file_name}.partial"));
    match gguf_metadata {
        Some(metadata) => write_gguf_part(source, names, metadata, &partial)?,
        None => {
            let raws = names
                .iter()
                .map(|n| source.raw_tensor(n))
                .collect::<Result<Vec<_>>>()?;
            let views = names
                .iter()
                .zip(&raws)
                .map(|(n, r)| {
                    let RawDType::Safetensors(dtype) = r.dtype else {
                        return Err(ModelError::invalid_file(
                            source.dir(),
                            format!("{n}: a GGUF tensor in a safetensors model"),
                        ));
                    };
                    let view = StView::new(dtype, r.shape.clone(), r.data())
                        .map_err(|e| ModelError::invalid_file(source.dir(), format!("{n}: {e}")))?;
                    Ok((n.clone(), view))
                })
                .collect::<Result<Vec<_>>>()?;
            safetensors::serialize_to_file(views, None, &partial)
                .map_err(|e| ModelError::invalid_file(&partial, e))?;
        }
    }
    std::fs::rename(&partial, path).map_err(|e| ModelError::io(path, e))
}

/// The config (and tokenizer files) a part folder needs beside its weights.
fn write_side_files(source: &Checkpoint, out: &Path) -> Result<()> {
    if source.is_gguf() {
        // A GGUF file's config lives in its metadata; the folder needs one of its own.
        let path = out.join(CONFIG_FILE);
        let json = serde_json::to_string_pretty(&source.config().to_hf_json())
            .map_err(|e| ModelError::invalid_file(&path, e))?;
        std::fs::write(&path, json).map_err(|e| ModelError::io(&path, e))?;
    } else {
        for side in SIDE_FILES {
            let from = source.dir().join(side);
            if from.is_file() {
                let to = out.join(side);
                std::fs::copy(&from, &to).map_err(|e| ModelError::io(&to, e))?;
            }
        }
    }
    Ok(())
}

fn ensure_empty_dir(out: &Path) -> Result<()> {
    if out.exists() {
        let mut entries = std::fs::read_dir(out).map_err(|e| ModelError::io(out, e))?;
        if entries.next().is_some() {
            return Err(ModelError::invalid_file(
                out,
                "output folder is not empty; refusing to overwrite anything",
            ));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))
}

/// Writes only the client part of `source` into `out` (empty or absent):
/// embeddings, final norm and LM head, with the config and tokenizer, which
/// is what a browser fetches. Returns the names of the files written.
pub fn write_client_part(source: &Checkpoint, out: &Path) -> Result<Vec<String>> {
    ensure_empty_dir(out)?;
    let names: Vec<String> = [EMBED_TOKENS, FINAL_NORM, LM_HEAD]
        .into_iter()
        .filter(|n| source.contains(n))
        .map(String::from)
        .collect();
    if !names.iter().any(|n| n == EMBED_TOKENS) {
        return Err(ModelError::MissingTensor {
            name: EMBED_TOKENS.into(),
        });
    }
    let gguf_metadata = if source.is_gguf() {
        source.gguf_metadata_of(EMBED_TOKENS)?
    } else {
        None
    };
    let client_file = if gguf_metadata.is_some() {
        CLIENT_GGUF_FILE
    } else {
        CLIENT_FILE
    };
    write_part(
        source,
        &names,
        gguf_metadata.as_ref(),
        &out.join(client_file),
    )?;
    write_side_files(source, out)?;
    let mut files: Vec<String> = std::fs::read_dir(out)
        .map_err(|e| ModelError::io(out, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    Ok(files)
}

/// The client part as a page fetches it: files downloaded whole, plus,
/// for an untied model stored quantized, the LM head and the embedding
/// table as raw tensors of their stored type.
#[derive(Debug, Clone)]
pub struct PagePart {
    /// Every file a page downloads whole (the LM head and row digests included).
    pub files: Vec<String>,
    /// Split out of the client file when the model is untied and its
    /// embeddings are quantized.
    pub split: Option<SplitTensors>,
}

/// Where a page finds the two large tensors of an untied quantized model.
#[derive(Debug, Clone)]
pub struct SplitTensors {
    /// The LM head's stored bytes (`[vocab, hidden]`), downloaded whole
    /// straight into its quantized storage.
    pub lm_head: String,
    pub lm_head_dtype: GgmlDType,
    /// The embedding table's stored bytes, row after row, fetched a row at
    /// a time with HTTP range requests.
    pub rows: String,
    pub rows_format: RowFormat,
    /// 32 bytes per row: the SHA-256 of each row.
    pub row_digests: String,
}

pub const PAGE_LM_HEAD_FILE: &str = "lm_head.bin";
pub const PAGE_ROWS_FILE: &str = "embeddings.bin";
pub const PAGE_ROW_DIGESTS_FILE: &str = "embeddings.sha256";

/// Writes the client part a page fetches into `out` (empty or absent). A
/// tied model's, or one stored as floats, is [`write_client_part`]'s; an
/// untied quantized one (every 70B-class GGUF) keeps its embedding table
/// and LM head out of the client file: a page then downloads the final
/// norm, tokenizer and LM head, and only the embedding rows it uses.
pub fn write_page_part(source: &Checkpoint, out: &Path) -> Result<PagePart> {
    let raw_rows = source.raw_tensor(EMBED_TOKENS)?;
    let stored = match raw_rows.dtype {
        RawDType::Ggml(dtype) if source.contains(LM_HEAD) && raw_rows.dtype.is_quantized() => dtype,
        _ => {
            return Ok(PagePart {
                files: write_client_part(source, out)?,
                split: None,
            })
        }
    };
    let raw_head = source.raw_tensor(LM_HEAD)?;
    let RawDType::Ggml(lm_head_dtype) = raw_head.dtype else {
        return Err(ModelError::invalid_file(
            source.dir(),
            "a safetensors LM head beside GGUF embeddings",
        ));
    };
    let cfg = source.config();
    let rows_format = RowFormat {
        dtype: stored,
        rows: cfg.vocab_size,
        hidden: cfg.hidden_size,
    };
    let row_bytes = rows_format.row_bytes().ok_or_else(|| {
        ModelError::invalid_file(source.dir(), "embedding rows are not whole blocks")
    })?;
    if raw_rows.data().len() != row_bytes * rows_format.rows {
        return Err(ModelError::invalid_file(
            source.dir(),
            format!(
                "{EMBED_TOKENS}: not {} rows of {row_bytes} bytes",
                rows_format.rows
            ),
        ));
    }
    ensure_empty_dir(out)?;
    let metadata = source.gguf_metadata_of(EMBED_TOKENS)?;
    write_part(
        source,
        &[FINAL_NORM.to_string()],
        metadata.as_ref(),
        &out.join(CLIENT_GGUF_FILE),
    )?;
    write_side_files(source, out)?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out.join(name);
        std::fs::write(&path, bytes).map_err(|e| ModelError::io(&path, e))
    };
    write(PAGE_LM_HEAD_FILE, raw_head.data())?;
    write(PAGE_ROWS_FILE, raw_rows.data())?;
    let digests: Vec<u8> = raw_rows
        .data()
        .chunks_exact(row_bytes)
        .flat_map(|row| <[u8; 32]>::from(Sha256::digest(row)))
        .collect();
    write(PAGE_ROW_DIGESTS_FILE, &digests)?;
    let mut files: Vec<String> = std::fs::read_dir(out)
        .map_err(|e| ModelError::io(out, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != PAGE_ROWS_FILE)
        .collect();
    files.sort();
    Ok(PagePart {
        files,
        split: Some(SplitTensors {
            lm_head: PAGE_LM_HEAD_FILE.into(),
            lm_head_dtype,
            rows: PAGE_ROWS_FILE.into(),
            rows_format,
            row_digests: PAGE_ROW_DIGESTS_FILE.into(),
        }),
    })
}

/// Writes one GGUF part: `names` (Hugging Face names) in their stored
/// quantization under their GGUF names, with the source's metadata.
fn write_gguf_part(
    source: &Checkpoint,
    names: &[String],
    metadata: &std::collections::HashMap<String, Value>,
    path: &Path,
) -> Result<()> {
    let device = candle_core::Device::Cpu;
    let tensors = names
        .iter()
        .map(|n| {
            let g = gguf_name(n).ok_or_else(|| ModelError::MissingTensor { name: n.clone() })?;
            Ok((g, source.stored_qtensor(n, &device)?))
        })
        .collect::<Result<Vec<_>>>()?;
    // The writer aligns tensor data its own way; a copied alignment would lie.
    let mut keys: Vec<&String> = metadata
        .keys()
        .filter(|k| k.as_str() != "general.alignment")
        .collect();
    keys.sort_unstable();
    let metadata: Vec<(&str, &Value)> = keys.iter().map(|k| (k.as_str(), &metadata[*k])).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let file = std::fs::File::create(path).map_err(|e| ModelError::io(path, e))?;
    let mut writer = std::io::BufWriter::new(file);
    gguf_file::write(&mut writer, &metadata, &tensors)
        .map_err(|e| ModelError::invalid_file(path, e))?;
    use std::io::Write;
    writer.flush().map_err(|e| ModelError::io(path, e))
}
