//! What the four records have in common: a topic, a key, JSON decoding with validation, and an
//! Arrow form. The pipeline and the tests treat records generically through [`Record`].

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, Schema};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{ArrowConvertError, DecodeError, ValidationError};

/// One of the v1 contract records.
pub trait Record: Serialize + DeserializeOwned + Sized {
    /// The record's name in schemas and messages (`sample`, `lease_event`, `signal`, `action`).
    const NAME: &'static str;
    /// The Kafka topic the record travels on.
    const TOPIC: &'static str;

    /// Checks every rule of the contract that the types alone do not enforce.
    fn validate(&self) -> Result<(), ValidationError>;

    /// The Kafka message key (a GPU UUID, lease id or team), which keeps related records in order.
    fn key(&self) -> &str;

    /// The Arrow schema of the record's lake table.
    fn arrow_schema() -> Arc<Schema>;

    /// Converts records to one Arrow batch of [`Record::arrow_schema`].
    fn to_record_batch(records: &[Self]) -> Result<RecordBatch, ArrowError>;

    /// Reads records back from a batch of [`Record::arrow_schema`] (columns matched by name).
    fn from_record_batch(batch: &RecordBatch) -> Result<Vec<Self>, ArrowConvertError>;

    /// Decodes and validates one JSON record. Never panics, whatever the bytes.
    fn from_json(bytes: &[u8]) -> Result<Self, DecodeError> {
        let record = decode_json::<Self>(bytes)?;
        record.validate()?;
        Ok(record)
    }

    /// The record's JSON form, as written to Kafka.
    fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("records serialize to JSON: all map keys are strings")
    }
}

/// Decodes JSON into `T`, turning serde's errors into ones that name the field.
pub(crate) fn decode_json<T: Record>(bytes: &[u8]) -> Result<T, DecodeError> {
    decode_named(bytes, T::NAME)
}

/// Decodes JSON into any `T` (borrowing from `bytes` where `T` does), with errors that name the
/// field; `record` names the record type in errors about the document as a whole.
pub(crate) fn decode_named<'de, T: serde::Deserialize<'de>>(
    bytes: &'de [u8],
    record: &'static str,
) -> Result<T, DecodeError> {
    // serde would read a struct from a JSON array, by position; a record is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(DecodeError::Shape {
            record,
            message: "found a JSON array; expected a JSON object".into(),
        });
    }
    // The fast path: most records are valid, and tracking the path of every field costs time.
    // Only a record that fails is decoded again to find which field is at fault.
    if let Ok(value) = serde_json::from_slice::<T>(bytes) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize::<_, T>(&mut de).map_err(|err| {
        let path = err.path().to_string();
        classify(record, &path, err.inner())
    })?;
    de.end().map_err(|err| classify(record, "", &err))?;
    Ok(value)
}

fn classify(record: &'static str, path: &str, err: &serde_json::Error) -> DecodeError {
    use serde_json::error::Category;
    let message = strip_position(&err.to_string());
    match err.classify() {
        Category::Syntax | Category::Eof | Category::Io => DecodeError::Json {
            line: err.line(),
            column: err.column(),
            message,
        },
        Category::Data => {
            // Errors raised by a record's own conversion name their field as `field `x`: …`.
            if let Some((field, reason)) = message
                .strip_prefix("field `")
                .and_then(|rest| rest.split_once("`: "))
            {
                return ValidationError::new(field, reason).into();
            }
            if path.is_empty() || path == "." {
                // serde names a missing field in its message but not in the path.
                if let Some(field) = message
                    .strip_prefix("missing field `")
                    .and_then(|rest| rest.split('`').next())
                {
                    return ValidationError::new(field, "required field is missing").into();
                }
                if message.starts_with("invalid type") {
                    return DecodeError::Shape {
                        record,
                        message: format!("{message}; expected a JSON object"),
                    };
                }
                return DecodeError::Shape { record, message };
            }
            let field = path.trim_start_matches('.');
            if let Some(missing) = message
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
            {
                return ValidationError::new(
                    format!("{field}.{missing}"),
                    "required field is missing",
                )
                .into();
            }
            ValidationError::new(field, message).into()
        }
    }
}

/// serde_json appends " at line L column C" to data errors; the field already locates them.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}
