//! Signals as the enforcer's signals consumer and the pipeline's ingest read them from
//! `gpuwarden.signals`: the signature check first (`SigningKeys::verify` on the header), then
//! `Signal::from_json`; see `gpuwarden_fuzz::check_record`. The signal's `kind` must also agree
//! with the body it decoded to.
//!
//! The input's first bytes stand for the header and the rest for the payload: a made-up header
//! never checks out (forging HMAC-SHA256 by chance is out of reach), while the payload signed
//! with either key always does, and with the previous key is named so.
#![no_main]

use gpuwarden_schema::signing::{SigningKeys, Verdict};
use gpuwarden_schema::{topics, Record, Signal};
use libfuzzer_sys::fuzz_target;

const KEY: &[u8] = b"fuzz-signing-key-of-at-least-32-bytes!!";
const PREVIOUS: &[u8] = b"fuzz-previous-key-of-at-least-32-bytes!";

fuzz_target!(|bytes: &[u8]| {
    let keys = SigningKeys::new(Some(KEY), Some(PREVIOUS));
    let (header, payload) = bytes.split_at(bytes.len().min(67));
    let verdict = keys.verify(topics::SIGNALS, b"k", payload, Some(header));
    assert!(
        !verdict.trusted(),
        "a made-up signature checked out: {header:?}"
    );
    let signed = keys
        .sign(topics::SIGNALS, b"k", payload)
        .expect("a key signs");
    assert_eq!(
        keys.verify(topics::SIGNALS, b"k", payload, Some(signed.as_bytes())),
        Verdict::Current
    );
    let old = SigningKeys::new(Some(PREVIOUS), None)
        .sign(topics::SIGNALS, b"k", payload)
        .expect("a key signs");
    assert_eq!(
        keys.verify(topics::SIGNALS, b"k", payload, Some(old.as_bytes())),
        Verdict::Previous
    );
    if let Some(signal) = gpuwarden_fuzz::check_record::<Signal>(bytes) {
        let wire: serde_json::Value = serde_json::from_slice(&signal.to_json()).expect("JSON");
        assert_eq!(wire["kind"], signal.body.kind(), "{signal:?}");
    }
});
