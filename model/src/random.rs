//! Random Llama checkpoints of any shape, for benchmarks and tests that need
//! a model bigger than the fixtures without downloading one.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::error::{ModelError, Result};

#[derive(Debug, Clone)]
pub struct RandomSpec {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_positions: usize,
    pub seed: u64,
}

/// Writes `config.json` and `model.safetensors` (f32) into `dir`.
pub fn write_random_checkpoint(dir: &Path, spec: &RandomSpec) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let device = Device::Cpu;
    let (h, i, v) = (spec.hidden_size, spec.intermediate_size, spec.vocab_size);
    let head_dim = h / spec.num_heads;
    let kv = spec.num_kv_heads * head_dim;
    // candle's CPU device cannot be seeded; a small generator of our own keeps
    // checkpoints reproducible.
    let mut rng = SplitMix64(spec.seed);
    let mut normal = |shape: &[usize], std: f64| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
        Ok(Tensor::from_vec(values, shape, &device)?)
    };
    let norm = |n: &mut dyn FnMut(&[usize], f64) -> Result<Tensor>| -> Result<Tensor> {
        Ok((n(&[h], 0.1)? + 1.0)?)
    };
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("model.embed_tokens.weight".into(), normal(&[v, h], 1.0)?);
    tensors.insert("lm_head.weight".into(), normal(&[v, h], 0.02)?);
    tensors.insert("model.norm.weight".into(), norm(&mut normal)?);
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        let scale = 1.0 / (h as f64).sqrt();
        for (name, shape) in [
            ("self_attn.q_proj", [h, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, h]),
            ("mlp.gate_proj", [i, h]),
            ("mlp.up_proj", [i, h]),
            ("mlp.down_proj", [h, i]),
        ] {
            tensors.insert(format!("{p}.{name}.weight"), normal(&shape, scale)?);
        }
        tensors.insert(format!("{p}.input_layernorm.weight"), norm(&mut normal)?);
        tensors.insert(
            format!("{p}.post_attention_layernorm.weight"),
            norm(&mut normal)?,
        );
    }
    let tensors: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path)?;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": v,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32"
    });
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
    )
    .map_err(|e| ModelError::io(&path, e))
}

/// A small seeded generator (candle's CPU device cannot be seeded).
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Box-Muller.
    pub(crate) fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}
