//! What Postgres clients read to discover the lake, shaped as Postgres's own ([`prepare`]): the
//! endpoint's `information_schema`, datafusion-postgres's `pg_catalog` and functions, and the
//! catalog functions their discovery queries call that neither DataFusion nor datafusion-postgres
//! provides (`format`, `col_description`, `obj_description`).
//!
//! DataFusion's `information_schema` has the tables and the columns but not their Postgres shape:
//! its `columns` names Arrow types (`Int64`, `Utf8`), counts positions from 0 and has no
//! `udt_name` or `is_identity`, and it has no `table_constraints` or `key_column_usage`.
//! Grafana's query builder picks a column's kind from `data_type` (`bigint`, `timestamp with time
//! zone`), and Metabase's sync reads `udt_name`, `is_identity` and the primary keys. So the
//! endpoint serves this schema in its place: DataFusion's for every table but `columns`, a
//! Postgres-shaped `columns`, and the two constraint tables, empty (the lake has no keys). The
//! types named are those the wire protocol announces for each column (datafusion-postgres's
//! `arrow_pg`), so that a column reads as the type it was described as.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{
    new_null_array, Array, ArrayRef, AsArray, Int32Builder, RecordBatch, StringArray, StringBuilder,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::catalog::information_schema::{InformationSchemaProvider, INFORMATION_SCHEMA};
use datafusion::catalog::streaming::StreamingTable;
use datafusion::catalog::{CatalogProviderList, MemTable, SchemaProvider, TableProvider};
use datafusion::common::ScalarValue;
use datafusion::error::DataFusionError;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::{
    ColumnarValue, Expr, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, TypeSignature,
    Volatility,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::prelude::SessionContext;
use datafusion_postgres::arrow_pg::datatypes::into_pg_type;
use datafusion_postgres::datafusion_pg_catalog::pg_catalog::context::EmptyContextProvider;
use datafusion_postgres::datafusion_pg_catalog::pg_catalog::setup_pg_catalog;
use datafusion_postgres::pgwire::api::Type;

use super::settings::CurrentSetting;
use super::EndpointError;

/// Gives the session what Postgres clients query besides the lake's tables: this
/// `information_schema`, `pg_catalog`, datafusion-postgres's Postgres functions, and
/// `current_setting`.
pub(super) fn prepare(ctx: &SessionContext) -> Result<(), EndpointError> {
    register(ctx).map_err(EndpointError::Session)?;
    let catalog = ctx
        .state()
        .config()
        .options()
        .catalog
        .default_catalog
        .clone();
    setup_pg_catalog(ctx, &catalog, EmptyContextProvider)
        .map_err(|e| EndpointError::Session(*e))?;
    datafusion_postgres::datafusion_pg_functions::register_all(&mut *ctx.state_ref().write());
    ctx.register_udf(ScalarUDF::new_from_impl(CurrentSetting::new()));
    Ok(())
}

/// Replaces DataFusion's `information_schema` in `ctx`'s default catalog with the Postgres-shaped
/// one, and registers the catalog functions.
fn register(ctx: &SessionContext) -> Result<(), DataFusionError> {
    let catalog_name = {
        let state = ctx.state_ref();
        let mut state = state.write();
        // While this is on, DataFusion answers for `information_schema` itself and never asks
        // the catalog; off, the schema registered below answers, SHOW TABLES and SHOW COLUMNS
        // included (DataFusion plans them as queries of whatever `information_schema` resolves).
        state.config_mut().options_mut().catalog.information_schema = false;
        state.config().options().catalog.default_catalog.clone()
    };
    let catalog = ctx.catalog(&catalog_name).ok_or_else(|| {
        DataFusionError::Internal(format!("the session has no catalog {catalog_name}"))
    })?;
    let catalogs = Arc::clone(ctx.state().catalog_list());
    catalog.register_schema(
        INFORMATION_SCHEMA,
        Arc::new(PostgresInformationSchema::new(catalogs)),
    )?;
    ctx.register_udf(ScalarUDF::new_from_impl(Format::new()));
    ctx.register_udf(ScalarUDF::new_from_impl(NoDescription::new(
        "col_description",
        2,
    )));
    ctx.register_udf(ScalarUDF::new_from_impl(NoDescription::new(
        "obj_description",
        1,
    )));
    Ok(())
}

/// `information_schema` as Postgres clients read it (see the module's documentation).
#[derive(Debug)]
struct PostgresInformationSchema {
    datafusion: InformationSchemaProvider,
    catalogs: Arc<dyn CatalogProviderList>,
}

const COLUMNS: &str = "columns";
const TABLE_CONSTRAINTS: &str = "table_constraints";
const KEY_COLUMN_USAGE: &str = "key_column_usage";

impl PostgresInformationSchema {
    fn new(catalogs: Arc<dyn CatalogProviderList>) -> Self {
        Self {
            datafusion: InformationSchemaProvider::new(Arc::clone(&catalogs)),
            catalogs,
        }
    }
}

#[async_trait]
impl SchemaProvider for PostgresInformationSchema {
    fn table_names(&self) -> Vec<String> {
        let mut names = self.datafusion.table_names();
        names.extend([TABLE_CONSTRAINTS.to_string(), KEY_COLUMN_USAGE.to_string()]);
        names
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>, DataFusionError> {
        match name.to_ascii_lowercase().as_str() {
            COLUMNS => {
                let columns = Arc::new(Columns {
                    schema: columns_schema(),
                    catalogs: Arc::clone(&self.catalogs),
                });
                Ok(Some(Arc::new(StreamingTable::try_new(
                    Arc::clone(&columns.schema),
                    vec![columns],
                )?)))
            }
            TABLE_CONSTRAINTS => empty(&[
                "constraint_catalog",
                "constraint_schema",
                "constraint_name",
                "table_catalog",
                "table_schema",
                "table_name",
                "constraint_type",
                "is_deferrable",
                "initially_deferred",
                "enforced",
                "nulls_distinct",
            ]),
            KEY_COLUMN_USAGE => empty(&[
                "constraint_catalog",
                "constraint_schema",
                "constraint_name",
                "table_catalog",
                "table_schema",
                "table_name",
                "column_name",
                "ordinal_position",
                "position_in_unique_constraint",
            ]),
            _ => self.datafusion.table(name).await,
        }
    }

    fn table_exist(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        name == TABLE_CONSTRAINTS || name == KEY_COLUMN_USAGE || self.datafusion.table_exist(&name)
    }
}

/// A table with these columns and no rows (`ordinal_position` and `position_in_…` are
/// integers, as in Postgres; the rest text).
fn empty(columns: &[&str]) -> Result<Option<Arc<dyn TableProvider>>, DataFusionError> {
    let fields: Vec<Field> = columns
        .iter()
        .map(|name| {
            let kind = if name.contains("position") {
                DataType::Int32
            } else {
                DataType::Utf8
            };
            Field::new(*name, kind, true)
        })
        .collect();
    let table = MemTable::try_new(Arc::new(Schema::new(fields)), vec![vec![]])?;
    Ok(Some(Arc::new(table)))
}

/// The columns of Postgres's `information_schema.columns` that clients read.
fn columns_schema() -> SchemaRef {
    let text = |name: &str, nullable: bool| Field::new(name, DataType::Utf8, nullable);
    let int = |name: &str, nullable: bool| Field::new(name, DataType::Int32, nullable);
    Arc::new(Schema::new(vec![
        text("table_catalog", false),
        text("table_schema", false),
        text("table_name", false),
        text("column_name", false),
        int("ordinal_position", false),
        text("column_default", true),
        text("is_nullable", false),
        text("data_type", false),
        int("character_maximum_length", true),
        int("character_octet_length", true),
        int("numeric_precision", true),
        int("numeric_precision_radix", true),
        int("numeric_scale", true),
        int("datetime_precision", true),
        text("interval_type", true),
        text("udt_catalog", false),
        text("udt_schema", false),
        text("udt_name", false),
        text("is_identity", false),
        text("identity_generation", true),
        text("is_generated", false),
        text("generation_expression", true),
        text("is_updatable", false),
    ]))
}

/// `information_schema.columns`, listed from the catalogs when it is read, so that tables
/// registered later are in it.
#[derive(Debug)]
struct Columns {
    schema: SchemaRef,
    catalogs: Arc<dyn CatalogProviderList>,
}

impl PartitionStream for Columns {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let schema = Arc::clone(&self.schema);
        let catalogs = Arc::clone(&self.catalogs);
        Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            futures::stream::once(async move { list_columns(schema, catalogs.as_ref()).await }),
        ))
    }
}

async fn list_columns(
    schema: SchemaRef,
    catalogs: &dyn CatalogProviderList,
) -> Result<RecordBatch, DataFusionError> {
    let mut rows = ColumnRows::default();
    for catalog_name in catalogs.catalog_names() {
        let Some(catalog) = catalogs.catalog(&catalog_name) else {
            continue;
        };
        for schema_name in catalog.schema_names() {
            // Its own columns are not listed, as DataFusion's does not list them.
            if schema_name == INFORMATION_SCHEMA {
                continue;
            }
            let Some(tables) = catalog.schema(&schema_name) else {
                continue;
            };
            for table_name in tables.table_names() {
                if let Some(table) = tables.table(&table_name).await? {
                    for (i, field) in table.schema().fields().iter().enumerate() {
                        rows.push(&catalog_name, &schema_name, &table_name, i + 1, field);
                    }
                }
            }
        }
    }
    rows.finish(schema)
}

/// The rows of `information_schema.columns`, column by column.
#[derive(Default)]
struct ColumnRows {
    table_catalog: StringBuilder,
    table_schema: StringBuilder,
    table_name: StringBuilder,
    column_name: StringBuilder,
    ordinal_position: Int32Builder,
    is_nullable: StringBuilder,
    data_type: StringBuilder,
    character_octet_length: Int32Builder,
    numeric_precision: Int32Builder,
    numeric_precision_radix: Int32Builder,
    numeric_scale: Int32Builder,
    datetime_precision: Int32Builder,
    udt_name: StringBuilder,
    count: usize,
}

impl ColumnRows {
    fn push(&mut self, catalog: &str, schema: &str, table: &str, position: usize, field: &Field) {
        let kind = PostgresType::of(field.data_type());
        self.table_catalog.append_value(catalog);
        self.table_schema.append_value(schema);
        self.table_name.append_value(table);
        self.column_name.append_value(field.name());
        self.ordinal_position
            .append_value(i32::try_from(position).unwrap_or(i32::MAX));
        self.is_nullable
            .append_value(if field.is_nullable() { "YES" } else { "NO" });
        self.data_type.append_value(kind.data_type);
        self.character_octet_length.append_option(kind.octet_length);
        self.numeric_precision.append_option(kind.precision);
        self.numeric_precision_radix.append_option(kind.radix);
        self.numeric_scale.append_option(kind.scale);
        self.datetime_precision
            .append_option(kind.datetime_precision);
        self.udt_name.append_value(&kind.udt_name);
        self.count += 1;
    }

    fn finish(mut self, schema: SchemaRef) -> Result<RecordBatch, DataFusionError> {
        let n = self.count;
        let constant = |value: &str| -> ArrayRef {
            Arc::new(StringArray::from_iter_values(std::iter::repeat_n(value, n)))
        };
        let nulls = |kind: &DataType| new_null_array(kind, n);
        // Postgres's udt_catalog is the database's name, as table_catalog is.
        let table_catalog: ArrayRef = Arc::new(self.table_catalog.finish());
        let columns: Vec<ArrayRef> = vec![
            Arc::clone(&table_catalog),
            Arc::new(self.table_schema.finish()),
            Arc::new(self.table_name.finish()),
            Arc::new(self.column_name.finish()),
            Arc::new(self.ordinal_position.finish()),
            nulls(&DataType::Utf8),
            Arc::new(self.is_nullable.finish()),
            Arc::new(self.data_type.finish()),
            nulls(&DataType::Int32),
            Arc::new(self.character_octet_length.finish()),
            Arc::new(self.numeric_precision.finish()),
            Arc::new(self.numeric_precision_radix.finish()),
            Arc::new(self.numeric_scale.finish()),
            Arc::new(self.datetime_precision.finish()),
            nulls(&DataType::Utf8),
            table_catalog,
            constant("pg_catalog"),
            Arc::new(self.udt_name.finish()),
            constant("NO"),
            nulls(&DataType::Utf8),
            constant("NEVER"),
            nulls(&DataType::Utf8),
            // Nothing is, through the endpoint.
            constant("NO"),
        ];
        Ok(RecordBatch::try_new(schema, columns)?)
    }
}

/// A column's type as `information_schema.columns` describes it in Postgres.
#[derive(Debug, PartialEq)]
struct PostgresType {
    /// The SQL name (`bigint`, `timestamp with time zone`, `ARRAY`).
    data_type: &'static str,
    /// The internal name (`int8`, `timestamptz`, `_text`).
    udt_name: String,
    octet_length: Option<i32>,
    precision: Option<i32>,
    radix: Option<i32>,
    scale: Option<i32>,
    datetime_precision: Option<i32>,
}

impl PostgresType {
    /// The type the wire protocol announces for an Arrow column of `kind`; text for those it
    /// has no Postgres type for (maps and structs, which it sends as text).
    fn of(kind: &DataType) -> Self {
        let wire = into_pg_type(kind).unwrap_or(Type::TEXT);
        let named = |data_type| Self {
            data_type,
            udt_name: wire.name().to_string(),
            octet_length: None,
            precision: None,
            radix: None,
            scale: None,
            datetime_precision: None,
        };
        let number = |data_type, precision, radix, scale| Self {
            precision: Some(precision),
            radix: Some(radix),
            scale,
            ..named(data_type)
        };
        let time = |data_type| Self {
            // As declared: timestamp(3) for milliseconds.
            datetime_precision: Some(match kind {
                DataType::Timestamp(TimeUnit::Second, _) | DataType::Date32 | DataType::Date64 => 0,
                DataType::Timestamp(TimeUnit::Millisecond, _) => 3,
                _ => 6,
            }),
            ..named(data_type)
        };
        match wire {
            Type::BOOL => named("boolean"),
            Type::INT2 => number("smallint", 16, 2, Some(0)),
            Type::INT4 => number("integer", 32, 2, Some(0)),
            Type::INT8 => number("bigint", 64, 2, Some(0)),
            Type::FLOAT4 => number("real", 24, 2, None),
            Type::FLOAT8 => number("double precision", 53, 2, None),
            Type::NUMERIC => match kind {
                DataType::Decimal128(p, s) => {
                    number("numeric", i32::from(*p), 10, Some(i32::from(*s)))
                }
                _ => named("numeric"),
            },
            Type::DATE => time("date"),
            Type::TIME => time("time without time zone"),
            Type::TIMESTAMP => time("timestamp without time zone"),
            Type::TIMESTAMPTZ => time("timestamp with time zone"),
            Type::INTERVAL => time("interval"),
            Type::BYTEA => named("bytea"),
            // Postgres names every array type's elements in udt_name (`_text`).
            _ if wire.name().starts_with('_') => named("ARRAY"),
            // Postgres's answer for text, whose length has no limit but the field's 1 GB.
            _ => Self {
                octet_length: Some(1_073_741_824),
                ..named("text")
            },
        }
    }
}

/// `format(formatstr, args…)`, Postgres's: `%s` an argument as text (NULL as nothing), `%I` as
/// an identifier (quoted when it must be), `%L` as a literal (NULL unquoted), `%%` a percent
/// sign. Metabase names a table with `format('%I.%I', schema, table)`.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Format {
    signature: Signature,
}

impl Format {
    fn new() -> Self {
        Self {
            signature: Signature::variadic_any(Volatility::Immutable),
        }
    }
}

impl ScalarUDFImpl for Format {
    fn name(&self) -> &str {
        "format"
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
        let rows = args.number_rows;
        let texts = args
            .args
            .iter()
            .map(|arg| {
                let array = arg.to_array(rows)?;
                Ok(cast(&array, &DataType::Utf8)?)
            })
            .collect::<datafusion::error::Result<Vec<ArrayRef>>>()?;
        let Some((template, values)) = texts.split_first() else {
            return Err(DataFusionError::Plan(
                "format() needs at least its format string".to_string(),
            ));
        };
        let template = template.as_string::<i32>();
        let values: Vec<&StringArray> = values.iter().map(|v| v.as_string::<i32>()).collect();
        let mut out = StringBuilder::with_capacity(rows, 32 * rows);
        for row in 0..rows {
            if template.is_null(row) {
                out.append_null();
                continue;
            }
            let value = |i: usize| values.get(i).map(|v| v.is_valid(row).then(|| v.value(row)));
            out.append_value(format_one(template.value(row), value)?);
        }
        Ok(ColumnarValue::Array(Arc::new(out.finish())))
    }
}

/// One `format()`: `value(i)` is the i-th argument (`None` past the last, `Some(None)` NULL).
fn format_one<'a>(
    template: &str,
    value: impl Fn(usize) -> Option<Option<&'a str>>,
) -> datafusion::error::Result<String> {
    let mut out = String::with_capacity(template.len());
    let mut next = 0;
    let mut chars = template.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next();
        if spec == Some('%') {
            out.push('%');
            continue;
        }
        let argument = value(next).ok_or_else(|| {
            DataFusionError::Execution("too few arguments for format()".to_string())
        })?;
        next += 1;
        match (spec, argument) {
            (Some('s'), text) => out.push_str(text.unwrap_or_default()),
            (Some('I'), Some(name)) => out.push_str(&quote_identifier(name)),
            (Some('I'), None) => {
                return Err(DataFusionError::Execution(
                    "null values cannot be formatted as an SQL identifier".to_string(),
                ))
            }
            (Some('L'), Some(text)) => {
                out.push('\'');
                out.push_str(&text.replace('\'', "''"));
                out.push('\'');
            }
            (Some('L'), None) => out.push_str("NULL"),
            (other, _) => {
                return Err(DataFusionError::Execution(format!(
                    "unrecognized format() type specifier \"{}\" (this server supports %s, %I, %L and %%)",
                    other.map(String::from).unwrap_or_default()
                )))
            }
        }
    }
    Ok(out)
}

/// `name` as Postgres's `quote_ident` writes it: as it is when it is a lower-case identifier,
/// double-quoted otherwise.
fn quote_identifier(name: &str) -> String {
    let plain = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '$');
    if plain {
        name.to_string()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

/// `col_description(table, column)` and `obj_description(object [, catalog])`: the comments of
/// Postgres's `COMMENT ON`, which nothing here has: always NULL.
#[derive(Debug, PartialEq, Eq, Hash)]
struct NoDescription {
    name: &'static str,
    signature: Signature,
}

impl NoDescription {
    fn new(name: &'static str, min_args: usize) -> Self {
        Self {
            name,
            signature: Signature::one_of(
                (min_args..=2).map(TypeSignature::Any).collect(),
                Volatility::Stable,
            ),
        }
    }
}

impl ScalarUDFImpl for NoDescription {
    fn name(&self) -> &str {
        self.name
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> datafusion::error::Result<DataType> {
        Ok(DataType::Utf8)
    }

    // NULL whatever the arguments, which are then never computed: Metabase's
    // `col_description(format('%I.%I', …)::regclass::oid, …)` casts a name that only a literal
    // can be cast from here.
    fn simplify(
        &self,
        _args: Vec<Expr>,
        _info: &SimplifyContext,
    ) -> datafusion::error::Result<ExprSimplifyResult> {
        Ok(ExprSimplifyResult::Simplified(Expr::Literal(
            ScalarValue::Utf8(None),
            None,
        )))
    }

    fn invoke_with_args(
        &self,
        args: ScalarFunctionArgs,
    ) -> datafusion::error::Result<ColumnarValue> {
        Ok(ColumnarValue::Array(new_null_array(
            &DataType::Utf8,
            args.number_rows,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_named_as_the_wire_protocol_types_them() {
        let of = |kind: DataType| {
            let t = PostgresType::of(&kind);
            (t.data_type, t.udt_name)
        };
        assert_eq!(of(DataType::Int64), ("bigint", "int8".to_string()));
        assert_eq!(
            of(DataType::Float64),
            ("double precision", "float8".to_string())
        );
        assert_eq!(of(DataType::Utf8), ("text", "text".to_string()));
        assert_eq!(of(DataType::Boolean), ("boolean", "bool".to_string()));
        assert_eq!(
            of(DataType::Timestamp(
                TimeUnit::Millisecond,
                Some("UTC".into())
            )),
            ("timestamp with time zone", "timestamptz".to_string())
        );
        assert_eq!(
            of(DataType::List(Arc::new(Field::new_list_field(
                DataType::Utf8,
                true
            )))),
            ("ARRAY", "_text".to_string())
        );
        let map = DataType::Map(
            Arc::new(Field::new(
                "entries",
                DataType::Struct(
                    vec![
                        Field::new("key", DataType::Utf8, false),
                        Field::new("value", DataType::Utf8, true),
                    ]
                    .into(),
                ),
                false,
            )),
            false,
        );
        assert_eq!(of(map), ("text", "text".to_string()));
        let ms = PostgresType::of(&DataType::Timestamp(TimeUnit::Millisecond, None));
        assert_eq!(ms.datetime_precision, Some(3));
        assert_eq!(PostgresType::of(&DataType::Int32).precision, Some(32));
    }

    #[test]
    fn format_writes_text_identifiers_and_literals_as_postgres_does() {
        let args = [Some("public"), Some("BilledCost"), None, None, Some("it's")];
        let value = |i: usize| args.get(i).copied();
        assert_eq!(
            format_one("%I.%I, %s|%L %L%%", value).unwrap(),
            "public.\"BilledCost\", |NULL 'it''s'%"
        );
        let err = format_one("%s %s %s %s %s %s", value).unwrap_err();
        assert!(err.to_string().contains("too few arguments"), "{err}");
        let err = format_one("%s %I", |i| [Some("a"), None].get(i).copied()).unwrap_err();
        assert!(
            err.to_string().contains("null values cannot be formatted"),
            "{err}"
        );
        assert!(format_one("%5s", value).is_err());
        assert_eq!(quote_identifier("samples"), "samples");
        assert_eq!(quote_identifier("team hourly"), "\"team hourly\"");
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
    }

    #[tokio::test]
    async fn current_setting_answers_what_the_server_announces() {
        let ctx = SessionContext::new();
        prepare(&ctx).unwrap();
        let one = |sql: &'static str| {
            let ctx = ctx.clone();
            async move {
                let batches = ctx.sql(sql).await?.collect().await?;
                Ok::<_, DataFusionError>(
                    datafusion::arrow::util::pretty::pretty_format_columns(
                        "v",
                        &[Arc::clone(batches[0].column(0))],
                    )?
                    .to_string(),
                )
            }
        };
        assert!(
            one("SELECT current_setting('server_version_num')::int / 100")
                .await
                .unwrap()
                .contains("1600")
        );
        assert!(one("SELECT current_setting('nope', true)")
            .await
            .unwrap()
            .contains("|   |"));
        let err = one("SELECT current_setting('nope')").await.unwrap_err();
        assert!(
            err.to_string()
                .contains("unrecognized configuration parameter \"nope\""),
            "{err}"
        );
    }
}
