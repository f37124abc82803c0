#!/usr/bin/env bash
# Corolla's main job on its embedded default: a local swarm of three servers
# on loopback (blocks 0..1, 1..3 and 3..4 of the bundled tiny Llama), found
# through the DHT, and a generation chained through them. The tiny Llama's
# weights are random, so the text is gibberish; the tokens are exactly what
# Hugging Face transformers produces for this model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
prompt="${1:-The quick brown fox jumps over the lazy dog.}"
model=tests/fixtures/tiny-llama-a
cargo build --locked -p corolla-client --bin corolla -p corolla-server --bin corolla-server
bin="$CARGO_TARGET_DIR/debug"

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT INT TERM

start_server() { # name blocks [initial peer]
    local name=$1 blocks=$2 peer=${3:-}
    local join=(--new-swarm)
    [ -n "$peer" ] && join=(--initial-peers "$peer")
    "$bin/corolla-server" --model "$model" --block-indices "$blocks" --host 127.0.0.1 --port 0 \
        --update-period 5s --addr-file "$work/$name.json" "${join[@]}" >/dev/null 2>"$work/$name.log" &
    pids+=($!)
    for _ in $(seq 1 600); do
        [ -s "$work/$name.json" ] && return 0
        kill -0 "${pids[-1]}" 2>/dev/null || { cat "$work/$name.log" >&2; exit 1; }
        sleep 0.1
    done
    echo "server $name did not start" >&2; exit 1
}
tcp_addr() { grep -o '"/ip4/127.0.0.1/tcp/[0-9]*/p2p/[^"]*"' "$work/$1.json" | head -n1 | tr -d '"'; }

echo "starting three servers on loopback..." >&2
start_server a 0:1
bootstrap=$(tcp_addr a)
start_server b 1:3 "$bootstrap"
start_server c 3:4 "$bootstrap"
"$bin/corolla" swarm --initial-peers "$bootstrap" --model "$model"
echo >&2
"$bin/corolla" generate --model "$model" --initial-peers "$bootstrap" --prompt "$prompt" --max-new-tokens 32
