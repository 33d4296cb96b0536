//! The settings a SQL client reads and sets: `current_setting` answers what the server
//! announces; `SET gpuwarden.as_of` picks the version the rollup tables are read at; a client's
//! `statement_timeout` goes to its governed session; the time zone is always UTC; and DataFusion's
//! own settings belong to the session every connection shares, so no client may set them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, StringBuilder};
use datafusion::arrow::datatypes::DataType;
use datafusion::error::DataFusionError;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDFImpl, Signature, TypeSignature, Volatility,
};
use datafusion::sql::sqlparser::ast::{ObjectName, Set, Statement};
use datafusion_postgres::pgwire::api::results::{Response, Tag};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError, PgWireResult};

use crate::governor::Session;

/// DataFusion's own settings (and `timezone`, which it maps to one of them) belong to the session
/// that every connection shares: one client must not change them under the others.
pub(super) fn shared_setting(set: &Set) -> Option<String> {
    let names: Vec<&ObjectName> = match set {
        Set::SingleAssignment { variable, .. } => vec![variable],
        Set::ParenthesizedAssignments { variables, .. } => variables.iter().collect(),
        Set::MultipleAssignments { assignments } => assignments.iter().map(|a| &a.name).collect(),
        _ => Vec::new(),
    };
    names
        .into_iter()
        .map(|n| n.to_string().to_lowercase().replace('"', ""))
        .find(|n| n.starts_with("datafusion."))
}

/// The value of `SET gpuwarden.as_of = …` (`TO`, quoted or not), if `statement` is one.
pub(super) fn as_of_setting(statement: &Statement) -> Option<String> {
    let Statement::Set(Set::SingleAssignment {
        variable, values, ..
    }) = statement
    else {
        return None;
    };
    let name = variable.to_string().to_lowercase().replace('"', "");
    if name != AS_OF_SETTING {
        return None;
    }
    let value = values.first().map(ToString::to_string).unwrap_or_default();
    Some(value.trim_matches('\'').trim_matches('"').to_string())
}

/// The setting that reads the rollup tables as they stood: `SET gpuwarden.as_of = '2026-12-03
/// 00:00:00Z'` (a time), `= 412` (a version of their Delta logs), `= latest`.
pub const AS_OF_SETTING: &str = "gpuwarden.as_of";

/// Answers `SET gpuwarden.as_of = value`: the connection reads the rollup tables at it from its
/// next query on.
pub(super) fn set_as_of(value: &str) -> PgWireResult<Response> {
    match crate::delta::AsOf::parse(value) {
        Ok(as_of) => {
            crate::delta::set_session_as_of(as_of);
            Ok(Response::Execution(Tag::new("SET")))
        }
        Err(message) => Err(PgWireError::UserError(Box::new(ErrorInfo::new(
            "ERROR".to_string(),
            // invalid_parameter_value
            "22023".to_string(),
            format!("invalid value for {AS_OF_SETTING}: {message}"),
        )))),
    }
}

/// Whether `set` sets the time zone, which a client may ask for and which stays UTC: answered
/// `SET` and nothing done.
pub(super) fn session_time_zone(set: &Set) -> bool {
    match set {
        Set::SingleAssignment { variable, .. } => {
            let name = variable.to_string().to_lowercase().replace('"', "");
            name == "timezone" || name == "time.zone"
        }
        _ => false,
    }
}

/// Hands the client's `SET statement_timeout` (which datafusion-postgres keeps in the
/// connection's metadata) to its session, for the governor: it may shorten the user's limit,
/// never lengthen it.
pub(super) fn note_settings(metadata: &HashMap<String, String>) {
    if let Some(session) = Session::current() {
        let timeout = metadata
            .get("statement_timeout_ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis);
        session.set_statement_timeout(timeout);
    }
}

/// `current_setting(name [, missing_ok])`: the server settings clients ask for (Grafana asks
/// for `server_version_num` to pick its SQL dialect), with the values this server announces
/// when a client connects.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct CurrentSetting {
    signature: Signature,
}

impl CurrentSetting {
    pub(super) fn new() -> Self {
        Self {
            signature: Signature::one_of(
                vec![
                    TypeSignature::Exact(vec![DataType::Utf8]),
                    TypeSignature::Exact(vec![DataType::Utf8, DataType::Boolean]),
                ],
                Volatility::Stable,
            ),
        }
    }
}

/// The value the server announces for the setting `name`, if it announces one.
fn setting(name: &str) -> Option<&'static str> {
    Some(match name.to_lowercase().as_str() {
        // pgwire announces server_version 16.6 at startup.
        "server_version" => "16.6",
        "server_version_num" => "160006",
        "search_path" => "public",
        "timezone" => "UTC",
        "server_encoding" | "client_encoding" => "UTF8",
        "standard_conforming_strings" | "integer_datetimes" => "on",
        "transaction_read_only" | "default_transaction_read_only" => "on",
        "is_superuser" => "off",
        "max_identifier_length" => "63",
        _ => return None,
    })
}

impl ScalarUDFImpl for CurrentSetting {
    fn name(&self) -> &str {
        "current_setting"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> datafusion::error::Result<DataType> {
        Ok(DataType::Utf8)
    }

    fn invoke_with_args(
        &self,
        args: ScalarFunctionArgs,
    ) -> datafusion::error::Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let names = arrays[0].as_string::<i32>();
        let missing_ok = arrays.get(1).map(|a| a.as_boolean());
        let mut out = StringBuilder::with_capacity(names.len(), 8 * names.len());
        for i in 0..names.len() {
            if names.is_null(i) {
                out.append_null();
                continue;
            }
            let name = names.value(i);
            match setting(name) {
                Some(value) => out.append_value(value),
                None if missing_ok.is_some_and(|m| m.is_valid(i) && m.value(i)) => {
                    out.append_null()
                }
                None => {
                    return Err(DataFusionError::Execution(format!(
                        "unrecognized configuration parameter \"{name}\""
                    )))
                }
            }
        }
        let array: ArrayRef = Arc::new(out.finish());
        Ok(ColumnarValue::Array(array))
    }
}
