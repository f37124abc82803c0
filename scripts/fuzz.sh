#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ (nightly only, from rustup) and runs
# each one, then prints one line per target: executions, seconds, outcome.
#
#   scripts/fuzz.sh                 each target for 30 s (the tests run 20)
#   scripts/fuzz.sh --runs 10000000 each target for that many executions
#   scripts/fuzz.sh --targets a,b   only these targets
#
# Each target's figures go to tests/artifacts/reliability/fuzz.TARGET.json,
# from which scripts/reliability.sh writes RELIABILITY.md's table.
#
# A crash stops the script with libFuzzer's report; the input lands in
# fuzz/artifacts/TARGET/ (cargo +nightly fuzz run TARGET FILE replays it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/web-tools.sh

seconds=30
runs=-1
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) seconds="$2"; shift 2 ;;
        --runs) runs="$2"; seconds=0; shift 2 ;;
        --targets) IFS=, read -r -a chosen <<<"$2"; shift 2 ;;
        *) echo "usage: $0 [--seconds N | --runs N] [--targets a,b]" >&2; exit 2 ;;
    esac
done

if ! rustup toolchain list | grep -q '^nightly'; then
    echo "no nightly toolchain (rustup toolchain install nightly): fuzzing skipped"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz (once)"
    install_tool cargo-fuzz
fi

targets=(tensor_payload protocol flow_receiver gguf manifest server_record)
if [ -n "${chosen+x}" ]; then targets=("${chosen[@]}"); fi
fuzz_dir="$CARGO_TARGET_DIR/fuzz"
corpus_root="$(dirname "$CARGO_TARGET_DIR")/fuzz-corpus"
# No clippy-driver for nightly builds.
export RUSTC_WORKSPACE_WRAPPER=
cargo +nightly fuzz build --target-dir "$fuzz_dir" -O

results=()
for t in "${targets[@]}"; do
    mkdir -p "$corpus_root/$t"
    log="$(mktemp)"
    started=$(date +%s)
    if ! cargo +nightly fuzz run --target-dir "$fuzz_dir" -O "$t" "$corpus_root/$t" -- \
        -max_total_time="$seconds" -runs="$runs" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz target $t crashed" >&2
        exit 1
    fi
    elapsed=$(( $(date +%s) - started ))
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    results+=("$t|${execs:-?}|${elapsed}")
    echo "$t: ${execs:-?} executions in ${elapsed} s, no crash"
    rm -f "$log"
done

# Figures for RELIABILITY.md (scripts/reliability.sh renders them).
figures="tests/artifacts/reliability"
mkdir -p "$figures"
cmd="scripts/fuzz.sh $( [ "$runs" = -1 ] && echo "--seconds $seconds" || echo "--runs $runs" )"
if [ -n "${chosen+x}" ]; then cmd="$cmd --targets $(IFS=,; echo "${chosen[*]}")"; fi
version="$(cargo +nightly fuzz --version)"
for r in "${results[@]}"; do
    IFS='|' read -r t execs elapsed <<<"$r"
    printf '{"test":"fuzz::%s","figures":{"executions":"%s","seconds":"%s","command":"%s","tool":"%s"}}\n' \
        "$t" "$execs" "$elapsed" "$cmd" "$version" \
        >"$figures/fuzz.$t.json"
done
