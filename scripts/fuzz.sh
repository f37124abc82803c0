#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ (nightly only, from rustup) and runs
# each one, then prints one line per target: executions, seconds, outcome.
#
#   scripts/fuzz.sh                 each target for 30 s (the tests run 20)
#   scripts/fuzz.sh --runs 10000000 each target for that many executions
#   scripts/fuzz.sh --targets a,b   only these targets
#   scripts/fuzz.sh --record        ... and writes the figures to RELIABILITY.md
#
# A crash stops the script with libFuzzer's report; the input lands in
# fuzz/artifacts/TARGET/ (cargo +nightly fuzz run TARGET FILE replays it).
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
    results+=("$t|${execs:-?}|${elapsed} s")
    echo "$t: ${execs:-?} executions in ${elapsed} s, no crash"
    rm -f "$log"
done

if [ -n "$record" ]; then
    # Rows of the targets run now replace theirs; the other targets keep
    # the figures (and the command) of the run that measured them.
    cmd="scripts/fuzz.sh $( [ "$runs" = -1 ] && echo "--seconds $seconds" || echo "--runs $runs" )"
    if [ -n "${chosen+x}" ]; then cmd="$cmd --targets $(IFS=,; echo "${chosen[*]}")"; fi
    python3 - "$cmd --record" "$(date -u +%F)" "$(cargo +nightly fuzz --version)" "${results[@]}" <<'PY'
import sys, re
cmd, day, version, rows = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
decodes = {
    "tensor_payload": "the tensor payload (and its re-encoding)",
    "protocol": "session requests and responses, pushes between servers",
    "flow_receiver": "frames read under flow control",
    "gguf": "GGUF header, metadata, tensor index, config, tokenizer",
    "manifest": "the client part's manifest",
    "server_record": "plain and signed server records",
}
text = open("RELIABILITY.md").read()
old = re.search(r"## Fuzzing\n.*?(?=\n## |\Z)", text, flags=re.S)
kept = {}
for line in (old.group(0) if old else "").splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[0].startswith("`"):
        kept[cells[0].strip("`")] = cells
for row in rows:
    target, execs, seconds = [c.strip() for c in row.split("|")]
    execs = f"{int(execs):,}" if execs.isdigit() else execs
    kept[target] = [f"`{target}`", decodes.get(target, "?"), execs, seconds,
                    f"`{cmd}`, {day}", "no crash"]
order = list(decodes) + sorted(set(kept) - set(decodes))
section = ["## Fuzzing", "",
           f"{version}, libFuzzer, nightly from rustup, one core per target, corpora kept in",
           "`~/.cache/corolla/fuzz-corpus/`. Each row names the command and day that measured it",
           "(`scripts/fuzz.sh ... --record` rewrites the rows of the targets it ran).", "",
           "| target | what it decodes | executions | time | command | outcome |",
           "|---|---|---|---|---|---|",
           *["| " + " | ".join(kept[t]) + " |" for t in order if t in kept], "",
           "`.ci/run` (through `scripts/test.sh`) runs every target for 20 s when a",
           "nightly toolchain is present.", ""]
new = "\n".join(section)
if old:
    text = text[:old.start()] + new + text[old.end():]
else:
    text = text.rstrip("\n") + "\n\n" + new
open("RELIABILITY.md", "w").write(text)
PY
fi
