//! Actions as the pipeline's ingest reads them from `gpuwarden.actions` (`Action::from_json`);
//! see `gpuwarden_fuzz::check_record`.
#![no_main]

use gpuwarden_schema::Action;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    gpuwarden_fuzz::check_record::<Action>(bytes);
});
