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

# Every build from a new clone path, and every change to a crate, leaves new
# hash-named artifacts of the workspace's crates in the shared cache (test
# binaries of hundreds of MB, incremental state of up to a GB per crate),
# and cargo never removes the old ones. Over many sessions they filled the
# disk: a link died of SIGBUS, and with under ~3 GB free Chromium's Cache API
# refuses the page's model head, so the browser tests' warm loads download it
# again. Keep the two newest of each workspace artifact and the newest
# incremental state of each crate (cargo rebuilds anything else it needs).
prune_build_cache() {
    local debug="$CARGO_TARGET_DIR/debug"
    [ -d "$debug/deps" ] || return 0
    keep_newest 2 "$debug/deps" -maxdepth 1 -type f \( -executable ! -name '*.so' -o -name 'libcorolla*' -o -name 'corolla*' \)
    [ -d "$debug/incremental" ] && keep_newest 1 "$debug/incremental" -mindepth 1 -maxdepth 1 -type d
    return 0
}

# keep_newest N DIR FIND-ARGS...: of the entries named STEM-HASH[.EXT] that
# FIND-ARGS select, keep the N newest of each STEM[.EXT] and delete the rest.
keep_newest() {
    local keep="$1" dir="$2"
    shift 2
    find "$dir" "$@" -printf '%T@ %p\n' 2>/dev/null | sort -rn | awk -v keep="$keep" '{
        path = $2; name = path; sub(/.*\//, "", name)
        group = name; sub(/-[0-9a-z]+(\.[a-z]+)?$/, "", group)
        ext = ""; if (match(name, /\.[a-z]+$/)) ext = substr(name, RSTART)
        if (++seen[group ext] > keep) print path
    }' | xargs -r rm -rf
}

# The one native build every script uses: all crates, binaries and tests.
shared_build() {
    prune_build_cache
    cargo test --workspace --no-run --locked "$@"
}
