//! The client part's manifest as a page checks it: no panic.
#![no_main]

use corolla_shared::manifest::ClientManifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = ClientManifest::parse(data) {
        assert!(m.files.iter().all(|f| !f.name.contains('/') && !f.name.starts_with('.')));
    }
});
