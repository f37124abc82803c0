//! The tensor payload decoder: any bytes, no panic; what decodes re-encodes
//! to bytes that decode to the same tensor.
#![no_main]

use corolla_shared::{Limits, TensorView};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(view) = TensorView::decode(data, &Limits::DEFAULT) {
        let owned = view.to_owned();
        let bytes = owned.encode();
        let again = TensorView::decode(&bytes, &Limits::DEFAULT).expect("re-encoded payloads decode");
        assert_eq!(again.to_owned(), owned);
        let _ = owned.first_non_finite();
    }
});
