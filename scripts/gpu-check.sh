#!/usr/bin/env bash
# The checks for a CUDA machine, in one run of under 8 minutes, from the
# repository root there (it needs no network):
#
#   build machine: bash scripts/cuda.sh --stage gpu-bin   # build, copy the binary into gpu-bin/
#   CUDA machine:  bash scripts/gpu-check.sh              # in a copy of the clone, gpu-bin/ included
#
# It reuses gpu-bin/corolla-gpu-check(.xz) (or $COROLLA_GPU_CHECK), or builds it
# when that machine has cargo and nvcc. The report (Markdown) goes to
# $OUT/gpu-check.md ($OUT: the current folder if unset) and stdout: golden
# tokens on --device cuda (f32), f16/bf16 logits against f32, batched decode,
# and a Llama-2-70B-shaped span's decode step against the memory floor. Never
# run by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${COROLLA_GPU_CHECK:-gpu-bin/corolla-gpu-check}"
if [ ! -x "$bin" ] && [ -f "$bin.xz" ]; then
    unpacked="${TMPDIR:-/tmp}/corolla-gpu-check"
    if command -v xz >/dev/null; then
        xz -dc "$bin.xz" >"$unpacked"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$bin.xz" "$unpacked"
    fi
    chmod +x "$unpacked"
    bin="$unpacked"
fi
if [ ! -x "$bin" ]; then
    if command -v cargo >/dev/null && command -v nvcc >/dev/null; then
        echo "[gpu-check] no binary at $bin: building it" >&2
        CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}" cargo build --release --locked -p corolla-tests \
            --features cuda --bin corolla-gpu-check
        bin="${CARGO_TARGET_DIR:-target}/release/corolla-gpu-check"
    else
        echo "[gpu-check] no binary at $bin and no cargo+nvcc to build one:" >&2
        echo "[gpu-check] run 'bash scripts/cuda.sh --stage gpu-bin' on the build machine and copy gpu-bin/ here" >&2
        exit 2
    fi
fi

# The driver brings libcuda.so.1; cuBLAS, cuRAND and the runtime (CUDA 13)
# come from wherever they are installed, e.g. the wheels of a PyTorch venv.
for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcurand.so.10; do
    if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then
        found=$(find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$lib" -print 2>/dev/null | head -n1 || true)
        if [ -n "$found" ]; then
            export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        else
            echo "[gpu-check] $lib is not installed on this machine" >&2
        fi
    fi
done
echo "[gpu-check] LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >&2
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv >&2 || true

out="${OUT:-.}/gpu-check.md"
RUST_LOG="${RUST_LOG:-warn}" timeout 480 "$bin" --fixtures tests/fixtures --out "$out"
