# Sourced by the project's scripts: one build cache outside the clone, so a
# fresh clone on this machine (CI) reuses what earlier builds compiled.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/corolla/target}"
# A CI run builds once from a fresh clone: incremental state would only fill
# the disk (tens of GB per clone path) without ever being reused.
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
fi
# Unset, candle re-derives the core count on every matmul; set it once.
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-$(nproc)}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# Lint while compiling: clippy-driver compiles the workspace's own crates
# (and lints them, warnings denied), so the test build is the lint and no
# separate `cargo clippy` pass re-checks all ~450 dependencies. Every script
# builds with the same settings (and `cargo test --workspace --no-run`, see
# `shared_build`), so they share one build instead of rebuilding.
if clippy_driver=$(rustup which clippy-driver 2>/dev/null) || clippy_driver=$(command -v clippy-driver); then
    export RUSTC_WORKSPACE_WRAPPER="$clippy_driver"
    export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
fi
unset clippy_driver

# Every change to a crate leaves a new hash-named test binary (hundreds of MB)
# in the shared cache, and cargo never removes the old ones: over many
# sessions they filled the disk and a link died of SIGBUS. Binaries not
# relinked for two days go (cargo relinks any it still needs).
prune_build_cache() {
    local deps="$CARGO_TARGET_DIR/debug/deps"
    [ -d "$deps" ] || return 0
    find "$deps" -maxdepth 1 -type f -executable ! -name '*.so' -mtime +2 -delete 2>/dev/null || true
}

# The one native build every script uses: all crates, binaries and tests.
shared_build() {
    prune_build_cache
    cargo test --workspace --no-run --locked "$@"
}
