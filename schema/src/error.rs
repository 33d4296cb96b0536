//! Errors of decoding, validating and converting records. Each names the field at fault, because
//! the pipeline stores the reason beside a quarantined record and an operator reads it there.

use thiserror::Error;

/// A record that breaks one of the rules of its contract.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("field `{field}`: {reason}")]
pub struct ValidationError {
    /// The field at fault, as named in the JSON record (dotted for nested fields).
    pub field: String,
    /// What is wrong with it, as a sentence fragment for a person.
    pub reason: String,
}

impl ValidationError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Why bytes from a topic or a file did not become a record.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// The bytes are not one complete JSON document (not JSON, truncated, or trailing bytes).
    #[error("malformed JSON at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line of the first bad byte.
        line: usize,
        /// 1-based column of the first bad byte.
        column: usize,
        /// What the JSON parser expected there.
        message: String,
    },
    /// The document is JSON but not an object of the record's shape (an array, a string, …).
    #[error("not a {record} record: {message}")]
    Shape {
        /// The record type that was expected.
        record: &'static str,
        /// What was found instead.
        message: String,
    },
    /// A field is missing, of the wrong type, or breaks a rule of the contract.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
}

impl DecodeError {
    /// The field at fault, when the error is about one field.
    pub fn field(&self) -> Option<&str> {
        match self {
            DecodeError::Invalid(e) => Some(&e.field),
            DecodeError::Json { .. } | DecodeError::Shape { .. } => None,
        }
    }
}

/// An Arrow batch that does not hold records of the expected type.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("column `{column}`: {reason}")]
pub struct ArrowConvertError {
    /// The column at fault.
    pub column: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ArrowConvertError {
    pub(crate) fn new(column: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            column: column.into(),
            reason: reason.into(),
        }
    }
}
