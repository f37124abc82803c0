//! The "70B-class heads in the page" section of BENCHMARKS.md, made from the
//! figures the Chromium tests (`tests/tests/browser/big_heads.rs`, `page_holds_a*`)
//! write to `tests/artifacts/page-<shape>.json`.

use std::path::Path;

use serde_json::Value;

pub const PAGE_HEADING: &str = "## 70B-class heads in the page (Chromium)";

/// The shapes measured, with their LM head's size in Q4_K and the issue's
/// targets (download, wasm memory; MB).
const SHAPES: [(&str, &str, &str); 3] = [
    ("llama-2-70b", "32000", "147 MB"),
    ("llama-3-70b", "128256", "591 MB"),
    ("qwen2.5-72b", "152064", "701 MB"),
];

fn figure(page: &Value, key: &str) -> anyhow::Result<f64> {
    page[key]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no {key} in the page figures: {page}"))
}

/// The section, from the figures in `dir`; a shape whose file is missing
/// is reported as not measured.
pub fn page_section(dir: &Path) -> anyhow::Result<String> {
    let mut rows = String::new();
    let mut rows_fetched = Vec::new();
    for (shape, vocab, head) in SHAPES {
        let path = dir.join(format!("page-{shape}.json"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            rows.push_str(&format!(
                "| {shape} (vocab {vocab}) | {head} | not measured ({} missing) ||||||||\n",
                path.display()
            ));
            continue;
        };
        let p: Value = serde_json::from_str(&text)?;
        let f = |key| figure(&p, key);
        let tasks = |phase: &str| -> anyhow::Result<String> {
            let n = figure(
                &p,
                &format!("{phase}_page_tasks_over_50_ms_loading_and_answering"),
            )?;
            let longest = figure(
                &p,
                &format!("{phase}_longest_page_task_loading_and_answering_ms"),
            )?;
            Ok(if n == 0.0 {
                "0".into()
            } else {
                format!("{n} ({longest:.0} ms)")
            })
        };
        rows.push_str(&format!(
            "| {shape} (vocab {vocab}) | {head} | {:.0} MB | {:.0} MB ({:.0} + {:.0}; worker's heap {:.0}, at most {:.0}) | {:.0} / {:.0} MB ({:.0} MB of it Chromium's binary) | {:.0} / {:.0} MB; {:.0} / {:.0} MB | {:.1} / {:.1} s | {:.2} s ({:.2} s) | {} / {} |\n",
            f("downloaded_before_first_token_mb")?,
            f("wasm_memory_mb")?,
            f("worker_wasm_memory_mb")?,
            f("page_wasm_memory_mb")?,
            f("worker_heap_mb")?,
            f("worker_heap_peak_mb")?,
            f("cold_renderer_rss_mb")?,
            f("renderer_peak_rss_mb")?,
            f("renderer_file_backed_mb")?,
            f("cold_renderer_private_mb")?,
            f("cold_renderer_private_peak_mb")?,
            f("warm_renderer_private_mb")?,
            f("warm_renderer_private_peak_mb")?,
            f("cold_ready_ms")? / 1000.0,
            f("warm_ready_ms")? / 1000.0,
            f("warm_first_token_ms")? / 1000.0,
            f("server_prefill_ms")? / 1000.0,
            tasks("cold")?,
            tasks("warm")?,
        ));
        rows_fetched.push(format!("{:.0}", f("rows_downloaded")?));
    }
    Ok(format!(
        "{PAGE_HEADING}\n\n\
Command: `bash scripts/bench.sh` (its page step: `COROLLA_REQUIRE_BROWSER=1 cargo test -p corolla-tests --test \
browser page_holds_a`, whose figures in `tests/artifacts/page-<shape>.json` `corolla-bench --page-figures \
tests/artifacts --write BENCHMARKS.md` turns into this section).\n\n\
One server (in a network namespace, https + wss so the page has its Cache API) holds the one layer of a model from \
`corolla random-model --shape SHAPE --layers 1 --quant q4_k`; headless Chromium at 390 × 844 loads the page, asks one \
chat question for 16 greedy tokens (identical to `corolla generate` against the same server, cold and warm), then \
reloads and asks again on a warm cache. Wasm memory is the head worker's plus the page's (the page's own instance \
holds the libp2p node and the generate loop). Targets: llama-2-70b <= 200 MB downloaded before the first \
token and <= 300 MB of page memory, llama-3-70b <= 700 MB, first token <= 2 s after Send on a warm cache beyond the \
server's compute, no task over 50 ms on the page's thread while loading or answering.\n\n\
| shape | LM head (Q4_K) | downloaded before the 1st token | wasm memory (worker + page) | renderer RSS at rest / peak | renderer private memory: cold at rest / peak; warm (reloaded) at rest / peak | ready cold / warm | 1st token warm (server's prefill) | page tasks > 50 ms loading + answering, cold / warm |\n\
|---|---|---|---|---|---|---|---|---|\n\
{rows}\n\
- The embedding table is never downloaded: {} rows were fetched by range request for prompt and answer; on the \
warm run nothing was downloaded (files and rows from the Cache API).\n\
- The page's thread holds the libp2p node and the generate loop (WebRTC exists only on pages); the worker holds \
tokenizer, chat template, embeddings, LM head and sampler, and gets one hidden state per step. The long-task \
observer measures wall time: on these 2 cores the worker, the server and Chromium's network process contend with \
the page, so a cold download of hundreds of MB can show a task just over 50 ms (the table); the document's own start-up, before the \
widget has its module (parsing, instantiating the 7 MB module), is not counted.\n\
- Page memory. A renderer's RSS counts ~120 MB of Chromium's own binary (file-backed pages, the same in \
every Chromium process; Chrome's task manager leaves them out of a tab's footprint), so the table also gives the \
renderer's private memory (anonymous and shared-memory pages, sampled every 100 ms by the test). Of llama-2-70b's \
~260 MB, ~180 MB are the two wasm memories (the worker's: the 147 MB head, the tokenizer, and what building the \
tokenizer took for a moment, as wasm memory never shrinks: 8 MB now that a BPE vocabulary and its merges are read \
straight into the model, 30 MB through the `tokenizers` JSON reader, which holds them three times) and ~80 MB the \
two V8 isolates, the compiled module (compiled once: the page posts it to the worker) and Blink. The cold peaks were \
330-350 MB until the web build changed: V8's optimizing compiler recompiles a hot wasm function whole, on a \
background thread and with memory in proportion. The worker's message loop was one 230 KB function, as wasm-opt \
had inlined every function with one caller into it; inlining those only up to 1000 bytes brought the cold peak \
to 295-301 MB. `--js-flags=--trace-wasm-compilation-times` then showed 48 MB of compiler memory for candle's \
argmax (73 KB, every dtype's loop in one function) and 26 MB for the worker's call dispatch (52 KB). Greedy \
sampling now takes a plain loop and each worker call is a function of its own. Its largest recompiles still took \
17-25 MB each (the libp2p swarm's stream poll, 38 KB, and Kademlia's, 29 KB, the generate loop, 29 KB: LLVM at \
opt-level 3 inlines whole call trees into async functions), and CI runs still saw cold peaks of 333-341 MB now \
and then, where several of them overlapped. The page is now built in Cargo.toml's `web` profile: opt-level 3 for \
the head's math (corolla-model, candle-core, half) and for sha2 (every downloaded part is hashed as it \
arrives), `s` for the rest. Measured with the trace flag: the largest recompile takes 15 MB (the worker's call \
dispatch, 28 KB), the module is 6.5 MB instead of 7.7, the resting memory ~4 MB less, and ready and first-token \
times are the same as at opt-level 3 (alternating runs). The warm run is a reload in the same renderer: its peak also holds what is left of the \
previous document until its isolate's memory is released (265-313 MB over several runs for llama-2-70b), and its \
resting memory is the cold one's. llama-3-70b misses its 700 MB: 591 MB of it is the Q4_K head itself, ~20 MB the \
128k-token tokenizer, ~40 MB the worker's wasm memory above its heap's live bytes (what building that tokenizer \
took for a moment, 11-21 MB, and the allocator's free holes), and ~110 MB the page's wasm, V8 and Blink. Building \
the tokenizer before the head is allocated does not win the 40 MB back: the Rust allocator in wasm (dlmalloc) grows \
the memory by the whole of a request that no free chunk holds, so the head's 591 MB come on top of whatever was \
free (measured: the heap's peak fell by 10 MB, the wasm memory stayed at 649 MB).\n",
        rows_fetched.join(", ")
    ))
}
