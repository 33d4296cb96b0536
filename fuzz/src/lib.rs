//! What the fuzz targets share: the invariants every v1 record's decoder must keep, whatever the
//! bytes. A target that finds them broken panics, which libFuzzer reports as a crash with the
//! input that caused it.
//!
//! The decoders are the ones production calls (`Record::from_json`, as the pipeline's ingest, its
//! signals loop, the enforcer's signals consumer and the simulated fleet do), never copies.

use std::fmt::Debug;

use gpuwarden_schema::{DecodeError, Record};

/// Decodes `bytes` as a `T` the way every consumer does and checks what must hold of the answer:
///
/// - a refusal is a sentence for a person, and one that names a field names a non-empty one;
/// - an accepted record passes its own validation, has a key, and survives the trips it makes in
///   production unchanged: to JSON and back (a record re-published, or read back from the
///   quarantine), and to an Arrow batch and back (the lake).
///
/// Returns the record, for targets that check more.
pub fn check_record<T: Record + Clone + PartialEq + Debug>(bytes: &[u8]) -> Option<T> {
    let record = match T::from_json(bytes) {
        Ok(record) => record,
        Err(err) => {
            check_refusal(&err);
            return None;
        }
    };
    record
        .validate()
        .unwrap_or_else(|e| panic!("a decoded {} fails validation: {e}", T::NAME));
    let _ = record.key();

    let json = record.to_json();
    let again = T::from_json(&json).unwrap_or_else(|e| {
        panic!(
            "a {} re-encoded as {} does not decode: {e}",
            T::NAME,
            String::from_utf8_lossy(&json)
        )
    });
    assert_eq!(again, record, "the JSON round trip changed the {}", T::NAME);

    let batch = T::to_record_batch(std::slice::from_ref(&record))
        .unwrap_or_else(|e| panic!("a valid {} has no Arrow form: {e}", T::NAME));
    assert_eq!(batch.schema(), T::arrow_schema());
    let back = T::from_record_batch(&batch)
        .unwrap_or_else(|e| panic!("a {}'s Arrow batch does not read back: {e}", T::NAME));
    assert_eq!(
        back,
        vec![record.clone()],
        "the Arrow round trip changed the {}",
        T::NAME
    );
    Some(record)
}

/// A refusal is written for a person: a sentence, and a field name when it names one.
pub fn check_refusal(err: &DecodeError) {
    let text = err.to_string();
    assert!(!text.trim().is_empty(), "an empty refusal: {err:?}");
    if let Some(field) = err.field() {
        assert!(!field.is_empty(), "a refusal names an empty field: {err:?}");
    }
}
