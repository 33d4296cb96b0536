//! Signals as the enforcer's signals consumer and the pipeline's ingest read them from
//! `gpuwarden.signals` (`Signal::from_json`); see `gpuwarden_fuzz::check_record`. The signal's
//! `kind` must also agree with the body it decoded to.
#![no_main]

use gpuwarden_schema::{Record, Signal};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Some(signal) = gpuwarden_fuzz::check_record::<Signal>(bytes) {
        let wire: serde_json::Value = serde_json::from_slice(&signal.to_json()).expect("JSON");
        assert_eq!(wire["kind"], signal.body.kind(), "{signal:?}");
    }
});
