#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ (nightly only, from rustup) and runs
# each one, then prints one line per target: executions, seconds, outcome.
#
#   scripts/fuzz.sh                 each target for 30 s (what the tests run)
#   scripts/fuzz.sh --runs 10000000 each target for that many executions
#   scripts/fuzz.sh --targets a,b   only these targets
#   scripts/fuzz.sh --record        ... and writes the figures to RELIABILITY.md
#
# A crash stops the script with libFuzzer's report; the input lands in
# fuzz/artifacts/TARGET/ and becomes a regression test.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/web-tools.sh

seconds=30
runs=-1
record=""
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) seconds="$2"; shift 2 ;;
        --runs) runs="$2"; seconds=0; shift 2 ;;
        --record) record=yes; shift ;;
        --targets) IFS=, read -r -a chosen <<<"$2"; shift 2 ;;
        *) echo "usage: $0 [--seconds N | --runs N] [--targets a,b] [--record]" >&2; exit 2 ;;
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
    results+=("| \`$t\` | ${execs:-?} | ${elapsed} s | no crash |")
    echo "$t: ${execs:-?} executions in ${elapsed} s, no crash"
    rm -f "$log"
done

if [ -n "$record" ]; then
    cmd="scripts/fuzz.sh $( [ "$runs" = -1 ] && echo "--seconds $seconds" || echo "--runs $runs" ) --record"
    python3 - "$cmd" "$(date -u +%F)" "${results[@]}" <<'PY'
import sys, re
cmd, day, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
section = ["## Fuzzing", "", f"Command: `{cmd}` (cargo-fuzz, libFuzzer, nightly), {day}.", "",
           "| target | executions | time | outcome |", "|---|---|---|---|", *rows, ""]
text = open("RELIABILITY.md").read()
new = "\n".join(section) + "\n"
if "## Fuzzing" in text:
    text = re.sub(r"## Fuzzing\n.*?(?=\n## |\Z)", new.rstrip("\n") + "\n", text, flags=re.S)
else:
    text = text.replace("## Not measured yet", new + "## Not measured yet")
open("RELIABILITY.md", "w").write(text)
PY
fi
