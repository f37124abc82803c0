#!/usr/bin/env python3
"""Ground truth for LoRA adapters, run once by hand.

Makes random LoRA adapters with PEFT over two of the tiny family checkpoints
(tests/fixtures/families/, made by families_reference.py) and records what
transformers + PEFT compute with them:

  * llama3-alpha: r 4, alpha 8, on all seven projections of every layer;
  * llama3-beta:  r 8, rsLoRA (alpha / sqrt(r)), alpha 4 but 16 on down_proj
                  (`alpha_pattern`), on q, v and down of layers 0 and 2 only
                  (`layers_to_transform`): layer 1 runs the base weights;
  * qwen3-alpha:  r 4, alpha 8, on all seven projections (Qwen3's head norms
                  come after the adapted q and k).

PEFT initialises B to zero (an adapter that changes nothing); here A and B
are both random, N(0, 0.3^2), so every adapted projection moves.

Writes tests/fixtures/adapters/<name>/ (PEFT's adapter_config.json and
adapter_model.safetensors, as save_pretrained writes them), <name>.gguf for
llama3-alpha and qwen3-alpha (the adapter as llama.cpp's
convert_lora_to_gguf.py writes it: `general.type` adapter, `adapter.type`
lora, `adapter.lora.alpha`, tensors `blk.N.<proj>.weight.lora_a` [r, in] and
`.lora_b` [out, r] in f32, B of q and k permuted for the `llama`
architecture as the base's rows are), and golden.json: per adapter and
prompt (the prompts of families/golden.json), 24 greedy tokens from
generate() and the last position's logits of a plain forward, with the
adapter reloaded from disk.

    ~/.cache/corolla/ref-venv/bin/pip install peft
    ~/.cache/corolla/ref-venv/bin/python tests/reference/adapters_reference.py
"""

import json
import os

import gguf
import numpy as np
import peft
import safetensors.numpy
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = os.path.join(ROOT, "fixtures", "families")
OUT = os.path.join(ROOT, "fixtures", "adapters")
NEW_TOKENS = 24
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

ADAPTERS = {
    "llama3-alpha": ("llama3", dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)),
    "llama3-beta": (
        "llama3",
        dict(
            r=8,
            lora_alpha=4,
            use_rslora=True,
            alpha_pattern={"down_proj": 16},
            target_modules=["q_proj", "v_proj", "down_proj"],
            layers_to_transform=[0, 2],
        ),
    ),
    "qwen3-alpha": ("qwen3", dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)),
}
GGUF_ADAPTERS = ["llama3-alpha", "qwen3-alpha"]

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(w, heads):
    """llama.cpp's converter: each head's rows reordered so rotary pairs are adjacent."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(name, family, base_config, folder, path):
    with open(os.path.join(folder, "adapter_config.json")) as f:
        lora = json.load(f)
    arch = {"qwen3": "qwen3"}.get(family, "llama")
    w = gguf.GGUFWriter(path, arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(lora["lora_alpha"]))
    tensors = safetensors.numpy.load_file(os.path.join(folder, "adapter_model.safetensors"))
    heads, kv_heads = base_config.num_attention_heads, base_config.num_key_value_heads
    for key in sorted(tensors):
        # base_model.model.model.layers.N.<module>.lora_A.weight
        rest = key.removeprefix("base_model.model.model.layers.")
        layer, rest = rest.split(".", 1)
        module, part = rest.rsplit(".lora_", 1)
        t = tensors[key].astype(np.float32)
        side = part.split(".")[0]
        if arch == "llama" and side == "B" and module == "self_attn.q_proj":
            t = permute(t, heads)
        if arch == "llama" and side == "B" and module == "self_attn.k_proj":
            t = permute(t, kv_heads)
        w.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{side.lower()}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tidy(folder, family):
    """No machine's path in the fixture, and no generated model card."""
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = f"tests/fixtures/families/{family}"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    card = os.path.join(folder, "README.md")
    if os.path.exists(card):
        os.remove(card)


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(FAMILIES, "golden.json")) as f:
        families = json.load(f)["families"]
    golden = {
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "peft": peft.__version__,
        },
        "adapters": {},
    }
    for seed, (name, (family, settings)) in enumerate(ADAPTERS.items()):
        base_dir = os.path.join(FAMILIES, family)
        base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
        model = get_peft_model(base, LoraConfig(lora_dropout=0.0, bias="none", **settings))
        g = torch.Generator().manual_seed(200 + seed)
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "lora_" in param_name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        folder = os.path.join(OUT, name)
        model.save_pretrained(folder, safe_serialization=True)
        tidy(folder, family)
        if name in GGUF_ADAPTERS:
            write_gguf(name, family, base.config, folder, os.path.join(OUT, f"{name}.gguf"))
        # What the fixture holds: a fresh base with the adapter read back.
        base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
        model = PeftModel.from_pretrained(base, folder).eval()
        runs = []
        for reference in families[family]:
            prompt = reference["prompt_ids"]
            ids = torch.tensor([prompt])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].tolist()
                out = model.generate(
                    input_ids=ids,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            generated = out[0, len(prompt):].tolist()
            runs.append({"prompt_ids": prompt, "generated_ids": generated, "last_logits": logits})
            same = sum(a == b for a, b in zip(generated, reference["generated_ids"]))
            print(f"{name}: {same}/{NEW_TOKENS} tokens as the base model's")
        golden["adapters"][name] = {"family": family, "runs": runs}
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
