#!/usr/bin/env bash
# Benchmarks: generation through a 4-server swarm on loopback vs one process,
# the default model in `corolla demo`'s 3-server layout vs one process,
# Corolla against llama.cpp, batching, and the web chat in Chromium vs the
# native client on the same swarm, side by side in one run; then quantization
# and wire quality, experts, shared prefixes and 70B-class heads in the page.
# Writes every section of BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/web-tools.sh
# The browser section needs the page, Chromium and playwright-core.
web_tools with-browser
build_web
# The dev profile optimises every dependency (candle, libp2p), which is where
# the time goes; it shares the test build instead of compiling a release one.
shared_build
# The default model's section needs the model (fetched once, then cached).
"$CARGO_TARGET_DIR/debug/corolla" fetch-model >/dev/null
# llama.cpp for the compute section: node-llama-cpp's prebuilt CPU build
# from npm, installed once into the cache (its platform builds take ~700 MB).
export COROLLA_LLAMACPP_DIR="${COROLLA_LLAMACPP_DIR:-$HOME/.cache/corolla/llamacpp}"
mkdir -p "$COROLLA_LLAMACPP_DIR"
cp bench/llamacpp/package.json bench/llamacpp/package-lock.json bench/llamacpp/decode.mjs "$COROLLA_LLAMACPP_DIR/"
if ! cmp -s bench/llamacpp/package-lock.json "$COROLLA_LLAMACPP_DIR/node_modules/.package-lock.json.installed" 2>/dev/null; then
    (cd "$COROLLA_LLAMACPP_DIR" && npm ci --no-audit --no-fund --ignore-scripts)
    cp bench/llamacpp/package-lock.json "$COROLLA_LLAMACPP_DIR/node_modules/.package-lock.json.installed"
fi
"$CARGO_TARGET_DIR/debug/corolla-bench" --rounds "${ROUNDS:-5}" --new-tokens 128 --write BENCHMARKS.md
# How far kept-quantized answers are from the float model's (100 prompts).
"$CARGO_TARGET_DIR/debug/corolla-bench" --quantization-quality --write BENCHMARKS.md
# Sessions batched through a mixture-of-experts block and its dense twin.
"$CARGO_TARGET_DIR/debug/corolla-bench" --experts --rounds 3 --write BENCHMARKS.md
# A second client's prefill after the same system prompt, with and without shared prefixes.
"$CARGO_TARGET_DIR/debug/corolla-bench" --prefixes --rounds 3 --write BENCHMARKS.md
# How far the wire formats move answers (100 prompts).
"$CARGO_TARGET_DIR/debug/corolla-bench" --wire-quality --prompts 100 --new-tokens 8 --write BENCHMARKS.md
# Eleven servers in network namespaces behind delaying forwarders (root).
"$CARGO_TARGET_DIR/debug/corolla-bench" --wan --rounds 3 --new-tokens 64 --write BENCHMARKS.md
# 70B-class heads in the page: the Chromium tests measure, corolla-bench writes the section
# (an earlier run's figures are removed first, so a test that measured nothing shows as such).
rm -f tests/artifacts/page-*.json
COROLLA_REQUIRE_BROWSER=1 cargo test -p corolla-tests --test browser page_holds_a -- --test-threads 1
"$CARGO_TARGET_DIR/debug/corolla-bench" --page-figures tests/artifacts --write BENCHMARKS.md
