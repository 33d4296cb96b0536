//! Helpers shared by the records' Arrow conversions, so each record's conversion reads as a list
//! of its columns.
//!
//! Conventions of the lake: every integer is `Int64`, every real `Float64`, every name `Utf8`,
//! string maps (`labels`) are JSON text in a `Utf8` column (every SQL client can read them, and
//! DataFusion's JSON functions can open them), and lists of names are `List<Utf8>`.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::{Array, ArrayRef, Float64Array, Int64Array, ListArray, RecordBatch, StringArray};
use arrow_schema::{ArrowError, DataType, Field};

use crate::error::ArrowConvertError;

/// A non-null or nullable column of the given type.
pub(crate) fn field(name: &str, data_type: DataType, nullable: bool) -> Field {
    Field::new(name, data_type, nullable)
}

/// The type of a list-of-names column.
pub fn string_list_type() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)))
}

pub(crate) fn strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    Arc::new(values.collect::<StringArray>())
}

pub(crate) fn f64s(values: impl Iterator<Item = Option<f64>>) -> ArrayRef {
    Arc::new(values.collect::<Float64Array>())
}

pub(crate) fn i64s(values: impl Iterator<Item = Option<i64>>) -> ArrayRef {
    Arc::new(values.collect::<Int64Array>())
}

/// An unsigned value as `Int64`; values past `i64::MAX` cannot be stored and fail the batch.
pub(crate) fn u64_to_i64(column: &str, value: u64) -> Result<i64, ArrowError> {
    i64::try_from(value).map_err(|_| {
        ArrowError::InvalidArgumentError(format!(
            "column `{column}`: {value} does not fit a signed 64-bit integer"
        ))
    })
}

pub(crate) fn u64s(
    column: &str,
    values: impl Iterator<Item = Option<u64>>,
) -> Result<ArrayRef, ArrowError> {
    let values = values
        .map(|v| v.map(|v| u64_to_i64(column, v)).transpose())
        .collect::<Result<Int64Array, _>>()?;
    Ok(Arc::new(values))
}

/// A list-of-names column ([`string_list_type`]), one list per row.
pub fn string_lists<'a>(values: impl Iterator<Item = &'a [String]>) -> ArrayRef {
    let mut builder = ListBuilder::new(StringBuilder::new());
    for list in values {
        for item in list {
            builder.values().append_value(item);
        }
        builder.append(true);
    }
    Arc::new(builder.finish())
}

/// A string map as JSON text; `None` stays null.
pub(crate) fn labels_json(labels: Option<&BTreeMap<String, String>>) -> Option<String> {
    labels.map(|l| serde_json::to_string(l).expect("a string map always serializes"))
}

/// Typed, named access to the columns of a batch, with errors that name the column.
pub(crate) struct Columns<'a> {
    batch: &'a RecordBatch,
}

impl<'a> Columns<'a> {
    pub(crate) fn new(batch: &'a RecordBatch) -> Self {
        Self { batch }
    }

    fn column<T: Array + 'static>(
        &self,
        name: &str,
        type_name: &str,
    ) -> Result<&'a T, ArrowConvertError> {
        let column = self
            .batch
            .column_by_name(name)
            .ok_or_else(|| ArrowConvertError::new(name, "missing from the batch"))?;
        column.as_any().downcast_ref::<T>().ok_or_else(|| {
            ArrowConvertError::new(
                name,
                format!("is {}, expected {type_name}", column.data_type()),
            )
        })
    }

    pub(crate) fn str(
        &self,
        name: &'static str,
    ) -> Result<Col<&'a StringArray>, ArrowConvertError> {
        Ok(Col {
            name,
            array: self.column::<StringArray>(name, "Utf8")?,
        })
    }

    pub(crate) fn i64(&self, name: &'static str) -> Result<Col<&'a Int64Array>, ArrowConvertError> {
        Ok(Col {
            name,
            array: self.column::<Int64Array>(name, "Int64")?,
        })
    }

    pub(crate) fn f64(
        &self,
        name: &'static str,
    ) -> Result<Col<&'a Float64Array>, ArrowConvertError> {
        Ok(Col {
            name,
            array: self.column::<Float64Array>(name, "Float64")?,
        })
    }

    /// A column a record gained after its first version: `None` in a batch that predates it
    /// (an older lake file), an error only when it is there with another type.
    pub(crate) fn later<C>(
        &self,
        name: &'static str,
        get: impl FnOnce(&Self, &'static str) -> Result<C, ArrowConvertError>,
    ) -> Result<Option<C>, ArrowConvertError> {
        match self.batch.column_by_name(name) {
            None => Ok(None),
            Some(_) => get(self, name).map(Some),
        }
    }

    pub(crate) fn list(&self, name: &'static str) -> Result<Col<&'a ListArray>, ArrowConvertError> {
        Ok(Col {
            name,
            array: self.column::<ListArray>(name, "List<Utf8>")?,
        })
    }
}

/// One named column; reads values row by row.
pub(crate) struct Col<A> {
    name: &'static str,
    array: A,
}

impl<A> Col<A> {
    fn null_error(&self, row: usize) -> ArrowConvertError {
        ArrowConvertError::new(
            self.name,
            format!("row {row} is null but the field is required"),
        )
    }
}

impl Col<&StringArray> {
    pub(crate) fn opt(&self, row: usize) -> Option<String> {
        (!self.array.is_null(row)).then(|| self.array.value(row).to_string())
    }
    pub(crate) fn req(&self, row: usize) -> Result<String, ArrowConvertError> {
        self.opt(row).ok_or_else(|| self.null_error(row))
    }
    /// A JSON string map column.
    pub(crate) fn labels(
        &self,
        row: usize,
    ) -> Result<Option<BTreeMap<String, String>>, ArrowConvertError> {
        self.opt(row)
            .map(|text| {
                serde_json::from_str(&text).map_err(|e| {
                    ArrowConvertError::new(
                        self.name,
                        format!("row {row} is not a JSON string map: {e}"),
                    )
                })
            })
            .transpose()
    }
    /// A column holding the snake_case name of an enum variant.
    pub(crate) fn parse<T: serde::de::DeserializeOwned>(
        &self,
        row: usize,
    ) -> Result<T, ArrowConvertError> {
        let text = self.req(row)?;
        serde_json::from_value(serde_json::Value::String(text.clone())).map_err(|_| {
            ArrowConvertError::new(self.name, format!("row {row}: unknown value `{text}`"))
        })
    }
    pub(crate) fn parse_opt<T: serde::de::DeserializeOwned>(
        &self,
        row: usize,
    ) -> Result<Option<T>, ArrowConvertError> {
        if self.array.is_null(row) {
            return Ok(None);
        }
        self.parse(row).map(Some)
    }
}

impl Col<&Int64Array> {
    pub(crate) fn opt(&self, row: usize) -> Option<i64> {
        (!self.array.is_null(row)).then(|| self.array.value(row))
    }
    pub(crate) fn req(&self, row: usize) -> Result<i64, ArrowConvertError> {
        self.opt(row).ok_or_else(|| self.null_error(row))
    }
    /// An unsigned field stored as `Int64`.
    pub(crate) fn opt_as<T: TryFrom<i64>>(
        &self,
        row: usize,
    ) -> Result<Option<T>, ArrowConvertError> {
        self.opt(row)
            .map(|v| {
                T::try_from(v).map_err(|_| {
                    ArrowConvertError::new(
                        self.name,
                        format!("row {row}: {v} is out of range for the field"),
                    )
                })
            })
            .transpose()
    }
    pub(crate) fn req_as<T: TryFrom<i64>>(&self, row: usize) -> Result<T, ArrowConvertError> {
        self.opt_as(row)?.ok_or_else(|| self.null_error(row))
    }
}

impl Col<&Float64Array> {
    pub(crate) fn opt(&self, row: usize) -> Option<f64> {
        (!self.array.is_null(row)).then(|| self.array.value(row))
    }
    pub(crate) fn req(&self, row: usize) -> Result<f64, ArrowConvertError> {
        self.opt(row).ok_or_else(|| self.null_error(row))
    }
}

impl Col<&ListArray> {
    pub(crate) fn strings(&self, row: usize) -> Result<Vec<String>, ArrowConvertError> {
        if self.array.is_null(row) {
            return Err(self.null_error(row));
        }
        let values = self.array.value(row);
        let values = values
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| ArrowConvertError::new(self.name, "list items are not Utf8"))?;
        Ok(values
            .iter()
            .map(|v| v.unwrap_or_default().to_string())
            .collect())
    }
}
