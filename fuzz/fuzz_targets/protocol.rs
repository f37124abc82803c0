//! Session requests and responses, and pushes between servers: any bytes, no panic.
#![no_main]

use corolla_shared::protocol::{PushStep, Request, Response};
use corolla_shared::Limits;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = Request::decode(data, &Limits::DEFAULT) {
        let _ = format!("{request:?}");
    }
    if let Ok(response) = Response::decode(data, &Limits::DEFAULT) {
        let _ = format!("{response:?}");
    }
    if let Ok(push) = PushStep::decode(data, &Limits::DEFAULT) {
        let _ = format!("{push:?}");
    }
});
