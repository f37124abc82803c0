//! The GGUF reader over any bytes: header, metadata, tensor index, the
//! config and tokenizer built from them. No panic, no unbounded allocation.
#![no_main]

use std::path::Path;

use corolla_model::gguf::GgufFile;
use corolla_model::file_bytes::FileBytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(Path::new("fuzz.gguf"), FileBytes::Owned(data.to_vec())) else {
        return;
    };
    let _ = file.config();
    let _ = file.tokenizer();
    let _ = file.chat_template();
    for info in file.tensors().values() {
        let _ = file.bytes(info).len();
    }
});
