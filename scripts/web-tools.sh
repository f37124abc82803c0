# Sourced by test.sh and demo.sh: installs what the web page and its tests
# need, each only when missing or at another version, so it is idempotent.
# Versions: wasm-bindgen-cli must equal the wasm-bindgen in Cargo.lock
# (pinned by libp2p-webrtc-websys); trunk >= 0.22 needs a newer rustc.
WASM_BINDGEN_VERSION=0.2.108
TRUNK_VERSION=0.21.14

web_tools() {
    local with_browser="${1:-}"
    rustup target list --installed | grep -qx wasm32-unknown-unknown \
        || rustup target add wasm32-unknown-unknown
    if ! wasm-bindgen --version 2>/dev/null | grep -q " $WASM_BINDGEN_VERSION\$"; then
        echo "installing wasm-bindgen-cli $WASM_BINDGEN_VERSION (about 8 minutes, once)"
        cargo install wasm-bindgen-cli --version "$WASM_BINDGEN_VERSION" --locked
    fi
    if ! trunk --version 2>/dev/null | grep -q " $TRUNK_VERSION\$"; then
        echo "installing trunk $TRUNK_VERSION (about 14 minutes, once)"
        cargo install trunk --version "$TRUNK_VERSION" --locked
    fi
    local packages=()
    command -v node >/dev/null || packages+=(nodejs npm)
    if [ -n "$with_browser" ]; then
        command -v chromium >/dev/null || packages+=(chromium)
        command -v chromedriver >/dev/null || packages+=(chromium-driver)
    fi
    if [ "${#packages[@]}" -gt 0 ]; then
        echo "installing ${packages[*]} from Debian"
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo=sudo
        $sudo apt-get update -q
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${packages[@]}"
    fi
    if [ ! -x web/node_modules/.bin/wasm-opt ]; then
        (cd web && npm ci --no-audit --no-fund)
    fi
    if [ -n "$with_browser" ] && [ ! -d tests/browser/node_modules/playwright-core ]; then
        (cd tests/browser && npm ci --no-audit --no-fund)
    fi
}

# Builds the page into dist/: corolla-wasm in release by trunk, then
# wasm-opt -Oz. trunk's own wasm-opt step is off: Debian's binaryen 108
# breaks wasm-bindgen 0.2.108's module (its externref table), and npm's
# binaryen 132 runs as WebAssembly under Node (~3 minutes), so its output is
# cached by the input's digest.
WASM_OPT_FEATURES=(--enable-reference-types --enable-bulk-memory --enable-nontrapping-float-to-int
    --enable-sign-ext --enable-mutable-globals --enable-simd --enable-multivalue)

build_web() {
    trunk build --offline --release
    local wasm=dist/corolla-wasm_bg.wasm
    local cache="$CARGO_TARGET_DIR/wasm-opt"
    local key
    key=$(sha256sum "$wasm" | cut -c1-64)
    mkdir -p "$cache"
    if [ ! -f "$cache/$key.wasm" ]; then
        echo "wasm-opt -Oz $(du -h "$wasm" | cut -f1) (about 3 minutes)"
        web/node_modules/.bin/wasm-opt -Oz "${WASM_OPT_FEATURES[@]}" "$wasm" -o "$cache/$key.wasm.partial"
        mv "$cache/$key.wasm.partial" "$cache/$key.wasm"
    fi
    cp "$cache/$key.wasm" "$wasm"
    echo "web page built: dist/ ($(du -h "$wasm" | cut -f1) of WebAssembly after wasm-opt)"
}
