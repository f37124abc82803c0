// llama.cpp's decode speed on a GGUF, for corolla-bench's compute section.
// Usage: node decode.mjs MODEL.gguf THREADS NEW_TOKENS PROMPT_IDS(comma-separated)
// Prints one JSON line: the prompt's prefill time, decode tokens/s (after the
// first new token), the greedy tokens, and which of ggml's CPU builds the
// machine got (it loads the best its vector extensions allow).
import { readFileSync } from "node:fs";
import { getLlama } from "node-llama-cpp";

const [modelPath, threadsArg, newTokensArg, promptArg] = process.argv.slice(2);
if (!modelPath || !promptArg) {
    console.error("usage: node decode.mjs MODEL.gguf THREADS NEW_TOKENS PROMPT_IDS");
    process.exit(2);
}
const threads = Number(threadsArg);
const newTokens = Number(newTokensArg);
const prompt = promptArg.split(",").map(Number);

const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const context = await model.createContext({
    contextSize: prompt.length + newTokens + 16,
    threads,
    batchSize: 512,
});
const sequence = context.getSequence();
const cpuVariant = loadedCpuVariant();
const start = performance.now();
let firstAt = 0;
const tokens = [];
for await (const token of sequence.evaluate(prompt, { temperature: 0 })) {
    tokens.push(token);
    if (tokens.length === 1) firstAt = performance.now();
    if (tokens.length >= newTokens) break;
}
const end = performance.now();
console.log(JSON.stringify({
    prefill_ms: firstAt - start,
    decode_tokens_per_s: (tokens.length - 1) / ((end - firstAt) / 1000),
    tokens,
    cpu_variant: cpuVariant,
}));
await context.dispose();
await model.dispose();

// "zen4" for libggml-cpu-zen4.so, from the process's own mappings (Linux).
function loadedCpuVariant() {
    try {
        const maps = readFileSync("/proc/self/maps", "utf8");
        const found = maps.match(/libggml-cpu-([\w.-]+?)\.so/);
        return found ? found[1] : null;
    } catch {
        return null;
    }
}
