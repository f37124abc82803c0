//! Tensor names: Hugging Face's and GGUF's, both ways, and llama.cpp's
//! architecture names.

use crate::config::Family;

/// Hugging Face name suffixes inside a layer and their GGUF counterparts.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    // A mixture of experts: the router, and each projection of every
    // expert stacked in one `[experts, rows, columns]` tensor.
    ("mlp.gate", "ffn_gate_inp"),
    ("mlp.experts.gate_proj", "ffn_gate_exps"),
    ("mlp.experts.up_proj", "ffn_up_exps"),
    ("mlp.experts.down_proj", "ffn_down_exps"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Tensors outside the layers.
const TOP_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens", "token_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
];

fn split_param(name: &str) -> Option<(&str, &str)> {
    name.rsplit_once('.')
        .filter(|(_, p)| *p == "weight" || *p == "bias")
}

/// The GGUF name of a Hugging Face tensor name, if it has one.
pub fn gguf_name(hf: &str) -> Option<String> {
    let (module, param) = split_param(hf)?;
    if let Some((_, g)) = TOP_NAMES.iter().find(|(h, _)| *h == module) {
        return Some(format!("{g}.{param}"));
    }
    let rest = module.strip_prefix("model.layers.")?;
    let (layer, inner) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, g) = LAYER_NAMES.iter().find(|(h, _)| *h == inner)?;
    Some(format!("blk.{layer}.{g}.{param}"))
}

/// The Hugging Face name of a GGUF tensor name, if it is one Corolla uses.
pub fn hf_name(gguf: &str) -> Option<String> {
    let (module, param) = split_param(gguf)?;
    if let Some((h, _)) = TOP_NAMES.iter().find(|(_, g)| *g == module) {
        return Some(format!("{h}.{param}"));
    }
    let rest = module.strip_prefix("blk.")?;
    let (layer, inner) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (h, _) = LAYER_NAMES.iter().find(|(_, g)| *g == inner)?;
    Some(format!("model.layers.{layer}.{h}.{param}"))
}

/// llama.cpp's `general.architecture` for a family: Mistral and Mixtral
/// files are `llama` ones (with a window key, with expert tensors).
pub fn architecture_of(family: Family) -> &'static str {
    match family {
        Family::Llama | Family::Mistral | Family::Mixtral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Qwen3Moe => "qwen3moe",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for hf in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.29.mlp.down_proj.weight",
            "model.layers.3.self_attn.o_proj.bias",
            "model.layers.7.post_attention_layernorm.weight",
        ] {
            let g = gguf_name(hf).unwrap();
            assert_eq!(hf_name(&g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(
            gguf_name("model.layers.12.self_attn.k_proj.weight").as_deref(),
            Some("blk.12.attn_k.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(gguf_name("model.layers.1.unknown.weight"), None);
    }
}
