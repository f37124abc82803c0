# Sourced by test.sh and demo.sh: installs what the web page and its tests
# need, each only when missing or at another version, so it is idempotent.
# Versions: wasm-bindgen-cli must equal the wasm-bindgen in Cargo.lock
# (pinned by libp2p-webrtc-websys); trunk >= 0.22 needs a newer rustc.
WASM_BINDGEN_VERSION=0.2.108
TRUNK_VERSION=0.21.14

# Build tools need not be fast: their own release profiles (trunk's is fat
# LTO with one codegen unit) cost most of their install time on 2 cores.
# Their builds share the project's target dir only for its cache, in a
# folder of their own.
install_tool() {
    CARGO_PROFILE_RELEASE_LTO=false \
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    CARGO_PROFILE_RELEASE_OPT_LEVEL=1 \
    CARGO_PROFILE_RELEASE_DEBUG=false \
    RUSTC_WORKSPACE_WRAPPER= \
    CARGO_TARGET_DIR="$CARGO_TARGET_DIR/tools" \
        cargo install --locked "$@"
}

# Debian packages, as root (or through sudo).
apt_install() {
    echo "installing $* from Debian"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$@"
}

web_tools() {
    local with_browser="${1:-}"
    rustup target list --installed | grep -qx wasm32-unknown-unknown \
        || rustup target add wasm32-unknown-unknown
    if ! wasm-bindgen --version 2>/dev/null | grep -q " $WASM_BINDGEN_VERSION\$"; then
        echo "installing wasm-bindgen-cli $WASM_BINDGEN_VERSION (a few minutes, once)"
        install_tool wasm-bindgen-cli --version "$WASM_BINDGEN_VERSION"
    fi
    if ! trunk --version 2>/dev/null | grep -q " $TRUNK_VERSION\$"; then
        echo "installing trunk $TRUNK_VERSION (a few minutes, once)"
        # No update check and no TLS: the page is built offline.
        install_tool trunk --version "$TRUNK_VERSION" --no-default-features
    fi
    local packages=()
    command -v node >/dev/null || packages+=(nodejs npm)
    if [ -n "$with_browser" ]; then
        command -v chromium >/dev/null || packages+=(chromium)
        command -v chromedriver >/dev/null || packages+=(chromium-driver)
        # The NAT test world's routers (tests/src/nat.rs).
        command -v iptables >/dev/null || packages+=(iptables)
    fi
    if [ "${#packages[@]}" -gt 0 ]; then
        apt_install "${packages[@]}"
    fi
    if [ ! -x web/node_modules/.bin/wasm-opt ]; then
        (cd web && npm ci --no-audit --no-fund)
    fi
    if [ -n "$with_browser" ] && [ ! -d tests/browser/node_modules/playwright-core ]; then
        (cd tests/browser && npm ci --no-audit --no-fund)
    fi
}

# Builds the page into dist/: corolla-wasm by trunk (Cargo.toml's `web` profile), then
# wasm-opt -Oz. trunk's own wasm-opt step is off: Debian's binaryen 108
# breaks wasm-bindgen 0.2.108's module (its externref table), and npm's
# binaryen 132 runs as WebAssembly under Node (~3 minutes), so its output is
# cached by the input's and the flags' digest.
#
# A function with one caller is inlined only up to 1000 bytes: by default
# wasm-opt inlines any such function, which made the worker's message loop
# one 230 KB function. V8's optimizing tier recompiles a hot function whole,
# and a function that size took 50-100 MB of the renderer for a second
# (BENCHMARKS.md, "The page's memory").
WASM_OPT_FLAGS=(-Oz --one-caller-inline-max-function-size 1000
    --enable-reference-types --enable-bulk-memory --enable-nontrapping-float-to-int
    --enable-sign-ext --enable-mutable-globals --enable-simd --enable-multivalue)

build_web() {
    trunk build --offline --release || return 1
    local wasm=dist/corolla-wasm_bg.wasm
    [ -f "$wasm" ] || { echo "trunk built no $wasm" >&2; return 1; }
    local cache="$CARGO_TARGET_DIR/wasm-opt"
    local key
    key=$( (sha256sum "$wasm" | cut -c1-64; echo "${WASM_OPT_FLAGS[*]}") | sha256sum | cut -c1-64)
    mkdir -p "$cache"
    if [ ! -f "$cache/$key.wasm" ]; then
        echo "wasm-opt -Oz $(du -h "$wasm" | cut -f1) (about 3 minutes)"
        web/node_modules/.bin/wasm-opt "${WASM_OPT_FLAGS[@]}" "$wasm" -o "$cache/$key.wasm.partial" || return 1
        mv "$cache/$key.wasm.partial" "$cache/$key.wasm" || return 1
    fi
    cp "$cache/$key.wasm" "$wasm" || return 1
    echo "web page built: dist/ ($(du -h "$wasm" | cut -f1) of WebAssembly after wasm-opt)"
}

# The official `openai` Python package in a venv of the cache, for the API
# tests (tests/tests/api.rs finds it there or at $COROLLA_OPENAI_PYTHON).
OPENAI_VERSION=3.57.0
openai_venv() {
    local venv="${COROLLA_CACHE:-$HOME/.cache/corolla}/openai-venv"
    if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
        echo "installing openai $OPENAI_VERSION into $venv"
        command -v python3 >/dev/null || apt_install python3 python3-venv
        python3 -m venv "$venv" || { apt_install python3-venv && python3 -m venv "$venv"; }
        "$venv/bin/pip" install -q "openai==$OPENAI_VERSION"
    fi
    command -v curl >/dev/null || apt_install curl
}
