//! Server records, plain (the info protocol) and signed (the DHT): no panic.
#![no_main]

use corolla_shared::ServerRecord;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ServerRecord::from_bytes(data);
    let _ = ServerRecord::from_signed_bytes(data, None);
});
