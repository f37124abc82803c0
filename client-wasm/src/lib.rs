//! `corolla-wasm`: the JavaScript API over `corolla-client` for the web page.
//!
//! Not built yet; it arrives with the browser issue. `corolla-client`,
//! `corolla-model` and `corolla-shared` already build for wasm32.
