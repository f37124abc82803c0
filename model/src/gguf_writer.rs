//! Writing GGUF files tensor by tensor: the header (metadata and tensor
//! table) first, then each tensor's bytes as a caller produces them, so a
//! multi-gigabyte file never has to be held in memory (candle's writer
//! takes every tensor at once).

use std::io::{Seek, Write};
use std::path::Path;

use candle_core::quantized::GgmlDType;

use crate::error::{ModelError, Result};

/// Tensor data starts, and every tensor begins, at a multiple of this
/// (GGUF's default `general.alignment`).
const ALIGNMENT: u64 = 32;
const VERSION: u32 = 3;

/// A metadata value of the kinds Corolla writes.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strings(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

impl MetaValue {
    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U32(_) => 4,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Strings(_) | MetaValue::F32s(_) | MetaValue::I32s(_) => 9,
        }
    }

    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        match self {
            MetaValue::U32(v) => w.write_all(&v.to_le_bytes()),
            MetaValue::F32(v) => w.write_all(&v.to_le_bytes()),
            MetaValue::Bool(v) => w.write_all(&[u8::from(*v)]),
            MetaValue::Str(s) => write_string(w, s),
            MetaValue::Strings(items) => {
                w.write_all(&8u32.to_le_bytes())?;
                w.write_all(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|s| write_string(w, s))
            }
            MetaValue::F32s(items) => {
                w.write_all(&6u32.to_le_bytes())?;
                w.write_all(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|v| w.write_all(&v.to_le_bytes()))
            }
            MetaValue::I32s(items) => {
                w.write_all(&5u32.to_le_bytes())?;
                w.write_all(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|v| w.write_all(&v.to_le_bytes()))
            }
        }
    }
}

fn write_string(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// One tensor of the file: its GGUF name, its shape in row-major order
/// (`[rows, columns]`, as candle and Hugging Face write it) and its type.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: GgmlDType,
}

impl TensorEntry {
    /// Bytes of the tensor's data; an error when its rows are not whole blocks.
    pub fn byte_len(&self) -> Result<u64> {
        let row = *self.shape.last().unwrap_or(&1);
        let block = self.dtype.block_size();
        if !row.is_multiple_of(block) {
            return Err(ModelError::InvalidConfig(format!(
                "{}: rows of {row} values are not whole {:?} blocks of {block}",
                self.name, self.dtype
            )));
        }
        let elems: usize = self.shape.iter().product();
        Ok((elems / block * self.dtype.type_size()) as u64)
    }
}

/// llama.cpp's numbering of the tensor types.
fn type_id(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

fn padding(offset: u64) -> u64 {
    (ALIGNMENT - offset % ALIGNMENT) % ALIGNMENT
}

/// Writes a GGUF file at `path`: `metadata`, then `tensors`, whose bytes
/// `fill(i, buf)` appends to `buf` for tensor `i` (exactly
/// [`TensorEntry::byte_len`] of them). `progress(written, total)` follows
/// the tensor data.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorEntry],
    mut fill: impl FnMut(usize, &mut Vec<u8>) -> Result<()>,
    mut progress: impl FnMut(u64, u64),
) -> Result<()> {
    let io = |e: std::io::Error| ModelError::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(b"GGUF").map_err(io)?;
    w.write_all(&VERSION.to_le_bytes()).map_err(io)?;
    w.write_all(&(tensors.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&(metadata.len() as u64).to_le_bytes())
        .map_err(io)?;
    for (key, value) in metadata {
        write_string(&mut w, key).map_err(io)?;
        w.write_all(&value.type_id().to_le_bytes()).map_err(io)?;
        value.write(&mut w).map_err(io)?;
    }
    let sizes = tensors
        .iter()
        .map(TensorEntry::byte_len)
        .collect::<Result<Vec<_>>>()?;
    let mut offset = 0u64;
    for (tensor, size) in tensors.iter().zip(&sizes) {
        write_string(&mut w, &tensor.name).map_err(io)?;
        w.write_all(&(tensor.shape.len() as u32).to_le_bytes())
            .map_err(io)?;
        // GGUF lists dimensions innermost first.
        for &dim in tensor.shape.iter().rev() {
            w.write_all(&(dim as u64).to_le_bytes()).map_err(io)?;
        }
        w.write_all(&type_id(tensor.dtype).to_le_bytes())
            .map_err(io)?;
        w.write_all(&offset.to_le_bytes()).map_err(io)?;
        offset += size + padding(*size);
    }
    let total = offset;
    let header = w.stream_position().map_err(io)?;
    w.write_all(&vec![0u8; padding(header) as usize])
        .map_err(io)?;
    let mut buf = Vec::new();
    let mut written = 0u64;
    for (i, (tensor, &size)) in tensors.iter().zip(&sizes).enumerate() {
        buf.clear();
        fill(i, &mut buf)?;
        if buf.len() as u64 != size {
            return Err(ModelError::invalid_file(
                path,
                format!(
                    "{}: {} bytes produced, {size} expected",
                    tensor.name,
                    buf.len()
                ),
            ));
        }
        w.write_all(&buf).map_err(io)?;
        w.write_all(&vec![0u8; padding(size) as usize])
            .map_err(io)?;
        written += size + padding(size);
        progress(written, total);
    }
    w.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{Content, Value};

    #[test]
    fn candle_reads_what_we_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let metadata = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("llama".into()),
            ),
            ("a.count".into(), MetaValue::U32(7)),
            ("a.eps".into(), MetaValue::F32(1e-5)),
            ("a.flag".into(), MetaValue::Bool(true)),
            (
                "a.words".into(),
                MetaValue::Strings(vec!["x".into(), "yz".into()]),
            ),
            ("a.types".into(), MetaValue::I32s(vec![1, 3])),
        ];
        let tensors = vec![
            TensorEntry {
                name: "w".into(),
                shape: vec![3, 32],
                dtype: GgmlDType::Q8_0,
            },
            TensorEntry {
                name: "n".into(),
                shape: vec![5],
                dtype: GgmlDType::F32,
            },
        ];
        write_gguf(
            &path,
            &metadata,
            &tensors,
            |i, buf| {
                let len = tensors[i].byte_len()? as usize;
                buf.extend((0..len).map(|b| (b % 7) as u8));
                Ok(())
            },
            |_, _| {},
        )
        .unwrap();
        let mut file = std::fs::File::open(&path).unwrap();
        let content = Content::read(&mut file).unwrap();
        assert_eq!(content.metadata["a.count"].to_u32().unwrap(), 7);
        assert!(content.metadata["a.flag"].to_bool().unwrap());
        match &content.metadata["a.words"] {
            Value::Array(v) => assert_eq!(v.len(), 2),
            other => panic!("{other:?}"),
        }
        let w = &content.tensor_infos["w"];
        assert_eq!(w.shape.dims(), &[3, 32]);
        assert_eq!(w.ggml_dtype, GgmlDType::Q8_0);
        let n = &content.tensor_infos["n"];
        assert_eq!(n.offset % ALIGNMENT, 0);
        let q = content
            .tensor(&mut file, "n", &candle_core::Device::Cpu)
            .unwrap();
        assert_eq!(q.shape().dims(), &[5]);
        // A tensor whose rows are not whole blocks is refused before writing.
        let bad = TensorEntry {
            name: "b".into(),
            shape: vec![2, 40],
            dtype: GgmlDType::Q8_0,
        };
        assert!(bad.byte_len().is_err());
    }
}
