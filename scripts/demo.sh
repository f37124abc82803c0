#!/usr/bin/env bash
# Corolla's main job on its embedded default: for now a local generation with
# the bundled tiny Llama (random weights, so the text is gibberish; the
# tokens are exactly what Hugging Face transformers produces).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
prompt="${1:-The quick brown fox jumps over the lazy dog.}"
cargo build --locked -p corolla-client --bin corolla
exec "$CARGO_TARGET_DIR/debug/corolla" generate --local \
    --model tests/fixtures/tiny-llama-a --prompt "$prompt" --max-new-tokens 32
