#!/usr/bin/env python3
"""Ground truth for the model families beyond Llama 2, run once by hand.

Makes a tiny random checkpoint per family with Hugging Face transformers
(the classes the families' real checkpoints load into) and records what
transformers computes with it:

  * llama3:  LlamaForCausalLM with llama3 rope scaling (theta 5e5; the tiny
             head_dim puts frequencies in all three of its regimes) and an
             eos list;
  * qwen2:   Qwen2ForCausalLM (biases on Q, K and V, none on O; rope theta
             1e6; tied embeddings, as the small Qwens);
  * mistral: MistralForCausalLM with a sliding window of 8, shorter than the
             prompts, so the window changes the numbers;
  * qwen3:   Qwen3ForCausalLM (each head's query and key RMS-normalised
             before the rotation, no biases, head_dim 32 on a hidden size
             of 64; tied embeddings);
  * mixtral: MixtralForCausalLM, four experts of which two per token;
  * qwen3_moe: Qwen3MoeForCausalLM, eight narrow experts, two per token,
             renormalised, Qwen3's head norms.

With family names as arguments, only those are made again and golden.json
keeps the others' recorded outputs.

Writes tests/fixtures/families/<family>/ (config.json, model.safetensors,
tokenizer.json copied from tiny-llama-a), the same weights as GGUF the way
llama.cpp's converter writes them (tests/fixtures/families/<family>.gguf:
architecture `llama` for Llama 3 and Mistral, with Q/K rows permuted for the
interleaved rotary layout and llama3 scaling as a `rope_freqs` tensor;
`qwen2` and `qwen3` as they are), and tests/fixtures/families/golden.json: per family and
prompt, the prompt ids, 24 greedy tokens from generate() with the KV cache,
and the last position's logits of a plain forward over the prompt; the first
prompt is text, tokenized by transformers from tokenizer.json.

    python3 -m venv ~/.cache/corolla/ref-venv
    ~/.cache/corolla/ref-venv/bin/pip install torch transformers safetensors gguf numpy
    ~/.cache/corolla/ref-venv/bin/python tests/reference/families_reference.py
"""

import json
import os
import shutil
import sys

import gguf
import numpy as np
import safetensors.numpy
import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fixtures", "families")
TOKENIZER = os.path.join(ROOT, "fixtures", "tiny-llama-a", "tokenizer.json")
NEW_TOKENS = 24

COMMON = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    max_position_embeddings=256,
    hidden_act="silu",
)

FAMILIES = {
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            bos_token_id=1,
            eos_token_id=[2, 3],
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=2),
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=8,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Per-head RMSNorm of Q and K before the rotation, no biases, and a head
    # size other than hidden / heads (as Qwen3's: 128 with hidden 1024 and 16
    # heads in the 0.6B model).
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            eos_token_id=2,
        ),
    ),
    # Four experts, two per token, weights renormalised (always, in Mixtral).
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            sliding_window=None,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Eight narrow experts (moe_intermediate_size), two per token,
    # renormalised as the released Qwen3-MoE models are; Qwen3's head norms.
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            eos_token_id=2,
        ),
    ),
}

TEXT_PROMPT = "The mountains of the moon are high and far away."

PROMPTS = [
    [1, 17, 200, 33, 901, 45, 7, 512, 64, 300, 12, 5, 88, 1000, 2, 77],
    [1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417,
     418, 419, 420, 421, 422, 423],
    [1, 99, 98],
]


def randomize(model, seed):
    """Spreads like a trained model's, norms away from 1 so that skipping them fails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def permute(w, heads):
    """llama.cpp's converter: each head's rows reordered so rotary pairs are adjacent."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_divisors(config):
    """What llama.cpp writes as rope_freqs for llama3 scaling (convert_hf_to_gguf.py)."""
    scaling = config.rope_parameters
    base, dim = scaling["rope_theta"], config.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model, family, folder, path):
    config = model.config
    # llama.cpp permutes Q and K rows only for its `llama` architecture
    # (Mistral's and Mixtral's too).
    arch = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}.get(family, "llama")
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None) and family == "mistral":
        w.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if family == "qwen3_moe":
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
    eos = config.eos_token_id
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if isinstance(eos, list) and len(eos) > 1:
        w.add_eot_token_id(eos[1])
    # The tensors as saved (transformers 5 fuses experts in memory, and
    # saves them one per expert as released checkpoints hold them).
    sd = {k: v.astype(np.float32) for k, v in safetensors.numpy.load_file(
        os.path.join(folder, "model.safetensors")).items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if family == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_divisors(config))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not config.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for layer in range(config.num_hidden_layers):
        for hf, g in names.items():
            t = sd.get(f"model.layers.{layer}.{hf}")
            if t is None:
                continue
            if arch == "llama" and hf.startswith("self_attn.q_proj"):
                t = permute(t, heads)
            if arch == "llama" and hf.startswith("self_attn.k_proj"):
                t = permute(t, kv_heads)
            w.add_tensor(f"blk.{layer}.{g}", t)
        if experts:
            # The router, and each projection of every expert stacked into
            # one [experts, rows, columns] tensor, as llama.cpp's converter does.
            block, (gate, up, down) = (
                ("block_sparse_moe", ("w1", "w3", "w2"))
                if family == "mixtral"
                else ("mlp", ("gate_proj", "up_proj", "down_proj"))
            )
            prefix = f"model.layers.{layer}.{block}"
            w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", sd[f"{prefix}.gate.weight"])
            for name, g in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps"), (down, "ffn_down_exps")):
                stack = np.stack([sd[f"{prefix}.experts.{e}.{name}.weight"] for e in range(experts)])
                w.add_tensor(f"blk.{layer}.{g}.weight", stack)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    # Families named on the command line are made again; the others' outputs
    # stay as recorded (a newer transformers must not rewrite them unseen).
    only = set(sys.argv[1:])
    golden_path = os.path.join(OUT, "golden.json")
    golden = {"families": {}}
    if only and os.path.exists(golden_path):
        with open(golden_path) as f:
            golden = json.load(f)
    golden.setdefault("versions", {})
    for seed, (family, (config_class, model_class, extra)) in enumerate(FAMILIES.items()):
        if only and family not in only:
            continue
        golden["versions"][family] = {"transformers": transformers.__version__, "torch": torch.__version__}
        config = config_class(**{**COMMON, **extra})
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = model_class(config).eval()
        randomize(model, 100 + seed)
        folder = os.path.join(OUT, family)
        os.makedirs(folder, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        shutil.copy(TOKENIZER, os.path.join(folder, "tokenizer.json"))
        # A reload must compute the same (what the fixture really holds).
        model = model_class.from_pretrained(folder, attn_implementation="eager").eval()
        write_gguf(model, family, folder, os.path.join(OUT, f"{family}.gguf"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
        text_ids = [1] + tokenizer(TEXT_PROMPT, add_special_tokens=False)["input_ids"]
        runs = []
        for prompt in [text_ids] + PROMPTS:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                logits = model(ids).logits[0, -1].tolist()
                out = model.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            runs.append(
                {
                    "prompt": TEXT_PROMPT if prompt is text_ids else None,
                    "prompt_ids": prompt,
                    "generated_ids": out[0, len(prompt):].tolist(),
                    "last_logits": logits,
                }
            )
        golden["families"][family] = runs
    with open(golden_path, "w") as f:
        json.dump(golden, f)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
