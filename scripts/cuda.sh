#!/usr/bin/env bash
# Builds `corolla-server --features cuda` on a machine without a GPU or a CUDA
# install: nvcc, headers and libraries come from NVIDIA's CUDA 13.0 wheels on
# PyPI (13.0 for NVIDIA driver 580, e.g. on an H200; cudarc 0.19 rejects nvcc
# above 13.4). Everything it makes lives outside the clone, under
# ~/.cache/corolla/cuda (override with COROLLA_CUDA_CACHE). Never run by CI.
#
#   scripts/cuda.sh              build (idempotent; a warm rebuild takes seconds)
#   scripts/cuda.sh --stage DIR  build, then put corolla-gpu-check (stripped,
#                                xz-compressed) into DIR, to copy to a CUDA machine
#   scripts/cuda.sh --env        print the environment a shell needs to run it
#
# The binaries land in $COROLLA_CUDA_CACHE/target/release: corolla-server and
# corolla-gpu-check (what scripts/gpu-check.sh runs on a CUDA machine).
set -euo pipefail

cache="${COROLLA_CUDA_CACHE:-$HOME/.cache/corolla/cuda}"
venv="$cache/venv"
compute_cap="${CUDA_COMPUTE_CAP:-90}"
repo="$(cd "$(dirname "$0")/.." && pwd)"

wheels=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.0.2.14
    nvidia-curand==10.4.0.35
)

say() { printf '[cuda] %s\n' "$*" >&2; }

cuda_home() {
    "$venv/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))'
}

install_toolkit() {
    mkdir -p "$cache"
    if [ ! -x "$venv/bin/python" ]; then
        say "creating $venv"
        python3 -m venv "$venv"
    fi
    if ! "$venv/bin/pip" freeze 2>/dev/null | grep -q '^nvidia-cuda-nvcc==13.0.88$'; then
        say "installing the CUDA 13.0 wheels (about 1 GB)"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}"
    fi
}

# The wheels ship only versioned files (libcublas.so.13); the linker asks for
# the unversioned names. No package ships the driver's libcuda: a stub with the
# driver-API symbols cudarc references satisfies the linker, and at run time the
# real driver's libcuda.so.1 is found instead (the stub lives in lib/stubs,
# which is on the link path only).
prepare_libraries() {
    local home="$1" lib
    for lib in "$home"/lib/lib*.so.*; do
        local base="${lib%%.so.*}.so"
        [ -e "$base" ] || ln -s "$(basename "$lib")" "$base"
    done
    mkdir -p "$home/lib/stubs"
    if [ ! -e "$home/lib/stubs/libcuda.so" ] || ! grep -q 'return 100' "$cache/libcuda_stub.c" 2>/dev/null; then
        local sys
        sys=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -path '*cudarc-0.19.*/src/driver/sys/mod.rs' | head -n1)
        [ -n "$sys" ] || { say "cudarc's sources are not in the cargo registry yet: run 'cargo fetch' first"; exit 1; }
        say "writing a stub libcuda.so from $sys"
        # Every entry point answers CUDA_ERROR_NO_DEVICE (100): run against
        # the stub (a smoke test without a GPU), the binary says so cleanly.
        grep -oE '^\s+fn cu[A-Za-z0-9_]+\(' "$sys" | sed -E 's/^\s+fn (cu[A-Za-z0-9_]+)\(/int \1(void) { return 100; }/' \
            | sort -u >"$cache/libcuda_stub.c"
        cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib/stubs/libcuda.so" "$cache/libcuda_stub.c"
        ln -sf libcuda.so "$home/lib/stubs/libcuda.so.1"
    fi
}

export_environment() {
    local home="$1"
    export CUDA_HOME="$home" CUDA_PATH="$home" CUDA_COMPUTE_CAP="$compute_cap"
    export PATH="$home/bin:$PATH"
    export CARGO_TARGET_DIR="$cache/target"
    export LD_LIBRARY_PATH="$home/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

install_toolkit
home="$(cuda_home)"
prepare_libraries "$home"
export_environment "$home"

if [ "${1:-}" = "--env" ]; then
    printf 'export CUDA_HOME=%q PATH=%q LD_LIBRARY_PATH=%q\n' "$CUDA_HOME" "$PATH" "$LD_LIBRARY_PATH"
    exit 0
fi

say "nvcc: $(nvcc --version | sed -n 4p)"
say "building corolla-server and corolla-gpu-check with CUDA for sm_${compute_cap} into $CARGO_TARGET_DIR (cold: ~15 min on 2 cores)"
started=$(date +%s)
(cd "$repo" && cargo build --release --locked -p corolla-server -p corolla-tests \
    --features corolla-server/cuda,corolla-tests/cuda --bin corolla-server --bin corolla-gpu-check)
for binary in corolla-server corolla-gpu-check; do
    say "built $CARGO_TARGET_DIR/release/$binary ($(du -h "$CARGO_TARGET_DIR/release/$binary" | cut -f1))"
done
say "in $(( $(date +%s) - started )) s"

if [ "${1:-}" = "--stage" ]; then
    stage="${2:?--stage needs a folder}"
    mkdir -p "$stage"
    # Stripped it is ~77 MB; compressed ~13 MB, a small copy to the CUDA
    # machine. gpu-check.sh unpacks it there.
    tmp="$(mktemp)"
    cp "$CARGO_TARGET_DIR/release/corolla-gpu-check" "$tmp"
    strip "$tmp"
    xz -T0 -6 -c "$tmp" >"$stage/corolla-gpu-check.xz"
    rm -f "$tmp" "$stage/corolla-gpu-check"
    say "staged $stage/corolla-gpu-check.xz ($(du -h "$stage/corolla-gpu-check.xz" | cut -f1))"
fi
