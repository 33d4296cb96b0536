//! Lease events as the pipeline's ingest and signals loop and the simulated fleet read them from
//! `gpuwarden.leases` (`LeaseEvent::from_json`); see `gpuwarden_fuzz::check_record`.
#![no_main]

use gpuwarden_schema::LeaseEvent;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    gpuwarden_fuzz::check_record::<LeaseEvent>(bytes);
});
