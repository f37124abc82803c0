// Ground truth for the default model kept quantized, run once by hand:
// llama.cpp's greedy tokens for the prompts of tests/fixtures/smollm2/reference.json.
//
// llama.cpp computes a GGUF's quantized blocks as Corolla's kept-quantized
// path does (weights in their stored blocks, activations rounded to 8 bits
// for each product), so its tokens are what `--quantized keep` (and `auto`)
// must give. Same stop rule as smollm2_reference.py: at most 24 new tokens,
// ending at the GGUF's eos token, which is kept.
//
// With the llama.cpp that `bash scripts/bench.sh` installs (bench/llamacpp:
// node-llama-cpp 3.21.1) in ~/.cache/corolla/llamacpp:
//   NODE_PATH=~/.cache/corolla/llamacpp/node_modules \
//     node tests/reference/smollm2_llamacpp.mjs MODEL.gguf > tests/fixtures/smollm2/llamacpp.json
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const require = createRequire(path.join(process.env.NODE_PATH ?? ".", "x.js"));
const { getLlama } = await import(require.resolve("node-llama-cpp"));

const modelPath = process.argv[2];
if (!modelPath) {
    console.error("usage: node smollm2_llamacpp.mjs MODEL.gguf");
    process.exit(2);
}
const here = path.dirname(fileURLToPath(import.meta.url));
const reference = JSON.parse(
    readFileSync(path.join(here, "..", "fixtures", "smollm2", "reference.json"), "utf8"),
);
const GENERATED_TOKENS = 24;

const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const eos = model.tokens.eos;
const runs = [];
for (const run of reference.runs) {
    const context = await model.createContext({
        contextSize: run.input_ids.length + GENERATED_TOKENS + 16,
        threads: 2,
    });
    const sequence = context.getSequence();
    const generated = [];
    for await (const token of sequence.evaluate(run.input_ids, { temperature: 0, yieldEogToken: true })) {
        generated.push(token);
        if (token === eos || generated.length >= GENERATED_TOKENS) break;
    }
    runs.push({ prompt: run.prompt, chat: run.chat, input_ids: run.input_ids, generated_ids: generated });
    await context.dispose();
}
const entry = require.resolve("node-llama-cpp");
const packageJson = path.join(entry.slice(0, entry.lastIndexOf("node-llama-cpp")), "node-llama-cpp", "package.json");
const version = JSON.parse(readFileSync(packageJson, "utf8")).version;
console.log(JSON.stringify({
    source: path.basename(modelPath),
    made_by: `tests/reference/smollm2_llamacpp.mjs, node-llama-cpp ${version} (its prebuilt CPU llama.cpp), 2 threads, greedy`,
    runs,
}, null, 1));
await model.dispose();
