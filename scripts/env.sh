# Sourced by the project's scripts: one build cache outside the clone, so a
# fresh clone on this machine (CI) reuses what earlier builds compiled.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/corolla/target}"
# Unset, candle re-derives the core count on every matmul; set it once.
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-$(nproc)}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
