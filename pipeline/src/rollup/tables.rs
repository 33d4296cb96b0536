//! The rollup tables ([`RollupTable`]), each declared once, column by column: its name, type
//! and nullability, and where its value comes from — an expression of the SQL that computes the
//! table's hour, a value the rollup fills in for the whole hour, or Rust (`leases`). Its Arrow
//! schema and its query are both derived from that one list. Also here: the schemas of the small
//! per-run tables the queries join samples against. Types and nullability are fixed here, not
//! inferred from a query, so every file of a table has the same schema and `focus_costs` says
//! exactly what FOCUS 1.2 says of each column. Columns a table gained after its first release
//! come last and are nullable: a lake's existing table takes them as they are (its schema
//! evolves, `delta::DeltaTables`), and its rows from before read null there.
//!
//! The queries run in order over the hour's tables: `partials` (the hour's samples attributed,
//! `attribute`), `hour_allocation` ([`allocation`]) and `known_leases`
//! ([`known_leases`]) make `gpu_hourly` and `lease_hourly`; `lease_hourly`'s rows, registered as
//! `lease_rows`, make `team_hourly` and `focus_costs`.

use std::fmt::Write as _;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use datafusion::common::ScalarValue;
use gpuwarden_schema::calendar::month_of;
use gpuwarden_schema::config::PricingConfig;

use super::HOUR_MS;

/// The directory under the lake root that holds every rollup table and the rollups' own state.
pub const DIR: &str = "rollups";

/// The team of capacity no lease holds.
pub const UNALLOCATED: &str = "(unallocated)";

/// A table the rollups write, each under `rollups/<name>/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RollupTable {
    /// `gpu_hourly`: one row per GPU and hour with samples or sampled time.
    GpuHourly,
    /// `lease_hourly`: one row per lease and hour, plus `(unallocated)` per GPU model.
    LeaseHourly,
    /// `team_hourly`: one row per team, GPU model and hour.
    TeamHourly,
    /// `focus_costs`: FOCUS 1.2 cost and usage rows.
    FocusCosts,
    /// `leases`: one row per lease, its current state.
    Leases,
}

impl RollupTable {
    /// The rollup tables, in a stable order.
    pub const ALL: [RollupTable; 5] = [
        Self::GpuHourly,
        Self::LeaseHourly,
        Self::TeamHourly,
        Self::FocusCosts,
        Self::Leases,
    ];

    /// The table's name in the lake and in SQL.
    pub fn name(self) -> &'static str {
        match self {
            Self::GpuHourly => "gpu_hourly",
            Self::LeaseHourly => "lease_hourly",
            Self::TeamHourly => "team_hourly",
            Self::FocusCosts => "focus_costs",
            Self::Leases => "leases",
        }
    }

    /// The table's directory, relative to the lake root: `rollups/<name>`.
    pub fn dir(self) -> String {
        format!("{DIR}/{}", self.name())
    }

    /// The column that holds a row's hour (its start), for the tables with one row set per
    /// hour; `None` for `leases`.
    pub fn hour_column(self) -> Option<&'static str> {
        match self {
            Self::GpuHourly | Self::LeaseHourly | Self::TeamHourly => Some("hour"),
            Self::FocusCosts => Some("ChargePeriodStart"),
            Self::Leases => None,
        }
    }

    /// The table's Arrow schema.
    pub fn schema(self) -> SchemaRef {
        Arc::new(Schema::new(
            self.columns()
                .into_iter()
                .map(|c| Field::new(c.name, c.data_type, c.nullable))
                .collect::<Vec<_>>(),
        ))
    }

    /// The query that computes the table's rows of an hour, but for the columns the rollup
    /// fills in ([`RollupTable::filled`]), with the prices and emission factor of `pricing`;
    /// `None` for `leases`, which is written from Rust.
    pub(crate) fn query(self, pricing: &PricingConfig) -> Option<String> {
        let query = match self {
            Self::GpuHourly => &GPU_HOURLY,
            Self::LeaseHourly => &LEASE_HOURLY,
            Self::TeamHourly => &TEAM_HOURLY,
            Self::FocusCosts => &FOCUS_COSTS,
            Self::Leases => return None,
        };
        let price = query
            .model
            .map(|column| price_sql(pricing, column))
            .unwrap_or_default();
        let energy_price = format!("CAST({:?} AS DOUBLE)", pricing.energy_usd_per_kwh);
        // Kilograms per kWh; no factor, no emissions figure.
        let co2e_per_kwh = match pricing.co2e_g_per_kwh {
            Some(grams) => format!("CAST({:?} AS DOUBLE)", grams / 1000.0),
            None => "CAST(NULL AS DOUBLE)".to_string(),
        };
        let select: Vec<String> = self
            .columns()
            .iter()
            .filter_map(|c| match c.value {
                Value::Sql(expression) => Some(format!(
                    "{} AS \"{}\"",
                    expression
                        .replace("{price}", &price)
                        .replace("{energy_price}", &energy_price)
                        .replace("{co2e_per_kwh}", &co2e_per_kwh),
                    c.name
                )),
                Value::Filled(_) | Value::Rust => None,
            })
            .collect();
        Some(format!(
            "{}SELECT {}\n{}",
            query.with.replace("{unallocated}", UNALLOCATED),
            select.join(",\n       "),
            query.from
        ))
    }

    /// The values of the columns the rollup fills in for a whole hour (starting at `hour`,
    /// `is_final` or not): the same on every row of it.
    pub(crate) fn filled(
        self,
        hour: i64,
        is_final: bool,
        pricing: &PricingConfig,
    ) -> Vec<(&'static str, ScalarValue)> {
        let of = Hour {
            start: hour,
            is_final,
            pricing,
        };
        self.columns()
            .into_iter()
            .filter_map(|c| match c.value {
                Value::Filled(value) => Some((c.name, value(&of))),
                Value::Sql(_) | Value::Rust => None,
            })
            .collect()
    }

    /// The table's columns, in its schema's order.
    fn columns(self) -> Vec<Column> {
        match self {
            Self::GpuHourly => gpu_hourly(),
            Self::LeaseHourly => lease_hourly(),
            Self::TeamHourly => team_hourly(),
            Self::FocusCosts => focus_costs(),
            Self::Leases => leases(),
        }
    }
}

/// Timestamps of derived tables: milliseconds, UTC (Postgres `timestamptz`).
pub fn timestamp() -> DataType {
    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
}

/// FOCUS's Decimal columns.
pub const DECIMAL: DataType = DataType::Decimal128(38, 10);

/// SQL for the price of a GPU-hour of the model in `column` (docs/src/finops/definitions.md#price): the
/// first matching `[[pricing.gpu]]` entry, else the default, as
/// [`PricingConfig::usd_per_gpu_hour`] computes it in Rust.
pub fn price_sql(pricing: &PricingConfig, column: &str) -> String {
    if pricing.gpu.is_empty() {
        return format!("CAST({:?} AS DOUBLE)", pricing.default_usd_per_gpu_hour);
    }
    let mut sql = String::from("CASE");
    for entry in &pricing.gpu {
        let needle = entry.model_match.to_lowercase().replace('\'', "''");
        write!(
            sql,
            " WHEN strpos(lower({column}), '{needle}') > 0 THEN CAST({:?} AS DOUBLE)",
            entry.usd_per_gpu_hour
        )
        .expect("writing to a String");
    }
    write!(
        sql,
        " ELSE CAST({:?} AS DOUBLE) END",
        pricing.default_usd_per_gpu_hour
    )
    .expect("writing to a String");
    sql
}

/// One column of a rollup table.
struct Column {
    name: &'static str,
    data_type: DataType,
    nullable: bool,
    value: Value,
}

/// Where a column's values come from.
#[derive(Clone, Copy)]
enum Value {
    /// This expression of the table's query; `{price}` stands for the price of a GPU-hour of
    /// the row's model ([`price_sql`]), `{energy_price}` for `pricing.energy_usd_per_kwh` and
    /// `{co2e_per_kwh}` for `pricing.co2e_g_per_kwh` in kilograms (NULL when unset).
    Sql(&'static str),
    /// The rollup, the same for every row of an hour.
    Filled(fn(&Hour) -> ScalarValue),
    /// Rust code, row by row (`leases`, `Leases::to_batch`).
    Rust,
}

/// The hour whose rows the rollup fills in ([`Value::Filled`]).
struct Hour<'a> {
    start: i64,
    is_final: bool,
    pricing: &'a PricingConfig,
}

/// What a table's query reads, around the SELECT list its columns make.
struct Query {
    /// What comes before the SELECT (a WITH clause, or nothing); `{unallocated}` stands for
    /// [`UNALLOCATED`].
    with: &'static str,
    /// What comes after it: FROM, GROUP BY, ORDER BY.
    from: &'static str,
    /// The column that names a row's GPU model, for `{price}`.
    model: Option<&'static str>,
}

fn sql(
    name: &'static str,
    data_type: DataType,
    nullable: bool,
    expression: &'static str,
) -> Column {
    Column {
        name,
        data_type,
        nullable,
        value: Value::Sql(expression),
    }
}

fn filled(
    name: &'static str,
    data_type: DataType,
    nullable: bool,
    value: fn(&Hour) -> ScalarValue,
) -> Column {
    Column {
        name,
        data_type,
        nullable,
        value: Value::Filled(value),
    }
}

fn rust(name: &'static str, data_type: DataType, nullable: bool) -> Column {
    Column {
        name,
        data_type,
        nullable,
        value: Value::Rust,
    }
}

fn time(ms: i64) -> ScalarValue {
    ScalarValue::TimestampMillisecond(Some(ms), Some("UTC".into()))
}

fn text(s: &str) -> ScalarValue {
    ScalarValue::Utf8(Some(s.to_owned()))
}

/// Every hourly table's first column: the hour's start.
fn hour() -> Column {
    filled("hour", timestamp(), false, |h| time(h.start))
}

/// Every hourly table's last column: whether the hour is final.
fn is_final() -> Column {
    filled("final", DataType::Boolean, false, |h| {
        ScalarValue::Boolean(Some(h.is_final))
    })
}

/// `gpu_hourly`: one row per GPU and hour with samples or sampled time.
fn gpu_hourly() -> Vec<Column> {
    use DataType::{Float64, Int64, Utf8};
    vec![
        hour(),
        sql("host", Utf8, false, "host"),
        sql("gpu_uuid", Utf8, false, "gpu_uuid"),
        sql("gpu_model", Utf8, false, "gpu_model"),
        sql("samples", Int64, false, "sum(samples)"),
        sql(
            "observed_gpu_hours",
            Float64,
            false,
            "sum(observed_ms) / 3600000.0",
        ),
        sql(
            "busy_gpu_hours",
            Float64,
            false,
            "sum(busy_ms_pct) / 360000000.0",
        ),
        sql("idle_gpu_hours", Float64, false, "sum(idle_ms) / 3600000.0"),
        sql(
            "utilization_pct",
            Float64,
            true,
            "CASE WHEN sum(observed_ms) > 0 \
             THEN sum(busy_ms_pct) / CAST(sum(observed_ms) AS DOUBLE) END",
        ),
        sql(
            "energy_kwh",
            Float64,
            false,
            "sum(energy_w_ms) / 3600000000.0",
        ),
        sql(
            "mem_used_max_bytes",
            Int64,
            false,
            "max(mem_used_max_bytes)",
        ),
        is_final(),
        sql(
            "sm_active_gpu_hours",
            Float64,
            true,
            "sum(sm_active_ms_pct) / 360000000.0",
        ),
        sql(
            "gpm_observed_gpu_hours",
            Float64,
            true,
            "sum(gpm_ms) / 3600000.0",
        ),
        sql(
            "idle_measure",
            Utf8,
            true,
            "CASE WHEN sum(util_judged_ms) > 0 AND sum(sm_judged_ms) > 0 THEN 'mixed' \
             WHEN sum(sm_judged_ms) > 0 THEN 'sm_active' \
             WHEN sum(util_judged_ms) > 0 THEN 'util' END",
        ),
    ]
}

const GPU_HOURLY: Query = Query {
    with: "",
    from: "FROM partials
GROUP BY host, gpu_uuid, gpu_model
ORDER BY gpu_uuid, host",
    model: None,
};

/// `lease_hourly`: one row per lease and hour with an allocation or attributed time, plus one
/// per GPU model for `(unallocated)` (null `lease_id`). `lease_usage` and `focus_costs` come
/// from it.
fn lease_hourly() -> Vec<Column> {
    use DataType::{Float64, Utf8};
    vec![
        hour(),
        sql("lease_id", Utf8, true, "lease_id"),
        sql("team", Utf8, false, "team"),
        sql("gpu_model", Utf8, false, "gpu_model"),
        sql("allocated_gpu_hours", Float64, false, "allocated_gpu_hours"),
        sql("observed_gpu_hours", Float64, false, "observed_gpu_hours"),
        sql("busy_gpu_hours", Float64, false, "busy_gpu_hours"),
        sql("idle_gpu_hours", Float64, false, "idle_gpu_hours"),
        sql("utilization_pct", Float64, true, "utilization_pct"),
        sql(
            "cost_usd",
            Float64,
            false,
            "allocated_gpu_hours * ({price})",
        ),
        sql(
            "idle_cost_usd",
            Float64,
            false,
            "idle_gpu_hours * ({price})",
        ),
        sql("energy_kwh", Float64, false, "energy_kwh"),
        is_final(),
        sql("sm_active_gpu_hours", Float64, true, "sm_active_gpu_hours"),
        sql(
            "gpm_observed_gpu_hours",
            Float64,
            true,
            "gpm_observed_gpu_hours",
        ),
        sql("idle_measure", Utf8, true, "idle_measure"),
        sql(
            "energy_cost_usd",
            Float64,
            true,
            "energy_kwh * ({energy_price})",
        ),
        sql("co2e_kg", Float64, true, "energy_kwh * ({co2e_per_kwh})"),
    ]
}

/// Per lease (and per model for unallocated samples): allocation joined to what was observed.
const LEASE_HOURLY: Query = Query {
    with: "WITH used AS (
    SELECT lease_id, CASE WHEN lease_id IS NULL THEN gpu_model END AS own_model,
           sum(observed_ms) AS observed_ms, sum(busy_ms_pct) AS busy_ms_pct,
           sum(idle_ms) AS idle_ms, sum(energy_w_ms) AS energy_w_ms,
           sum(sm_active_ms_pct) AS sm_active_ms_pct, sum(gpm_ms) AS gpm_ms,
           sum(util_judged_ms) AS util_judged_ms, sum(sm_judged_ms) AS sm_judged_ms
    FROM partials
    GROUP BY 1, 2
    HAVING sum(observed_ms) > 0
), joined AS (
    SELECT COALESCE(u.lease_id, a.lease_id) AS lease_id, u.own_model,
           a.allocated_gpu_hours,
           COALESCE(u.observed_ms, 0.0) AS observed_ms,
           COALESCE(u.busy_ms_pct, 0.0) AS busy_ms_pct,
           COALESCE(u.idle_ms, 0.0) AS idle_ms,
           COALESCE(u.energy_w_ms, 0.0) AS energy_w_ms,
           COALESCE(u.sm_active_ms_pct, 0.0) AS sm_active_ms_pct,
           COALESCE(u.gpm_ms, 0.0) AS gpm_ms,
           COALESCE(u.util_judged_ms, 0) AS util_judged_ms,
           COALESCE(u.sm_judged_ms, 0) AS sm_judged_ms
    FROM used u FULL OUTER JOIN hour_allocation a ON u.lease_id = a.lease_id
), measured AS (
    SELECT j.lease_id,
           COALESCE(k.team, '{unallocated}') AS team,
           COALESCE(k.gpu_model, j.own_model) AS gpu_model,
           CASE WHEN j.lease_id IS NULL THEN j.observed_ms / 3600000.0
                ELSE COALESCE(j.allocated_gpu_hours, 0.0) END AS allocated_gpu_hours,
           j.observed_ms / 3600000.0 AS observed_gpu_hours,
           j.busy_ms_pct / 360000000.0 AS busy_gpu_hours,
           j.idle_ms / 3600000.0 AS idle_gpu_hours,
           CASE WHEN j.observed_ms > 0
                THEN j.busy_ms_pct / CAST(j.observed_ms AS DOUBLE) END AS utilization_pct,
           j.energy_w_ms / 3600000000.0 AS energy_kwh,
           j.sm_active_ms_pct / 360000000.0 AS sm_active_gpu_hours,
           j.gpm_ms / 3600000.0 AS gpm_observed_gpu_hours,
           CASE WHEN j.util_judged_ms > 0 AND j.sm_judged_ms > 0 THEN 'mixed'
                WHEN j.sm_judged_ms > 0 THEN 'sm_active'
                WHEN j.util_judged_ms > 0 THEN 'util' END AS idle_measure
    FROM joined j LEFT JOIN known_leases k ON j.lease_id = k.lease_id
)
",
    from: "FROM measured
ORDER BY team, gpu_model, lease_id",
    model: Some("gpu_model"),
};

/// `team_hourly`: one row per team, GPU model and hour with an allocation or attributed time
/// (docs/src/contributors/lake.md#rollup-tables), from `lease_rows`.
fn team_hourly() -> Vec<Column> {
    use DataType::{Float64, Utf8};
    vec![
        hour(),
        sql("team", Utf8, false, "team"),
        sql("gpu_model", Utf8, false, "gpu_model"),
        sql(
            "allocated_gpu_hours",
            Float64,
            false,
            "sum(allocated_gpu_hours)",
        ),
        sql(
            "observed_gpu_hours",
            Float64,
            false,
            "sum(observed_gpu_hours)",
        ),
        sql("busy_gpu_hours", Float64, false, "sum(busy_gpu_hours)"),
        sql("idle_gpu_hours", Float64, false, "sum(idle_gpu_hours)"),
        sql(
            "utilization_pct",
            Float64,
            true,
            "CASE WHEN sum(observed_gpu_hours) > 0 \
             THEN 100.0 * sum(busy_gpu_hours) / sum(observed_gpu_hours) END",
        ),
        sql(
            "cost_usd",
            Float64,
            false,
            "sum(allocated_gpu_hours) * ({price})",
        ),
        sql(
            "idle_cost_usd",
            Float64,
            false,
            "sum(idle_gpu_hours) * ({price})",
        ),
        sql("energy_kwh", Float64, false, "sum(energy_kwh)"),
        is_final(),
        sql(
            "sm_active_gpu_hours",
            Float64,
            true,
            "sum(sm_active_gpu_hours)",
        ),
        sql(
            "gpm_observed_gpu_hours",
            Float64,
            true,
            "sum(gpm_observed_gpu_hours)",
        ),
        sql("idle_measure", Utf8, true, COMBINED_IDLE_MEASURE),
        sql(
            "energy_cost_usd",
            Float64,
            true,
            "sum(energy_kwh) * ({energy_price})",
        ),
        sql(
            "co2e_kg",
            Float64,
            true,
            "sum(energy_kwh) * ({co2e_per_kwh})",
        ),
    ]
}

/// The `idle_measure` of rows that add up rows of `idle_measure` (null where none has one):
/// theirs when they all agree, else `mixed` (the names sort `mixed` < `sm_active` < `util`).
pub const COMBINED_IDLE_MEASURE: &str = "CASE WHEN min(idle_measure) = 'mixed' \
     OR min(idle_measure) <> max(idle_measure) THEN 'mixed' ELSE max(idle_measure) END";

const TEAM_HOURLY: Query = Query {
    with: "",
    from: "FROM lease_rows
GROUP BY team, gpu_model
ORDER BY team, gpu_model",
    model: Some("gpu_model"),
};

/// `leases`: one row per lease, its current state.
fn leases() -> Vec<Column> {
    use DataType::{Int64, Utf8};
    vec![
        rust("lease_id", Utf8, false),
        rust("state", Utf8, false),
        rust("team", Utf8, false),
        rust("user", Utf8, false),
        rust("project", Utf8, false),
        rust("workload", Utf8, false),
        rust("substrate", Utf8, false),
        rust("gpu_model", Utf8, false),
        rust("gpu_count", Int64, false),
        rust(
            "gpu_uuids",
            DataType::List(Arc::new(Field::new("item", Utf8, true))),
            false,
        ),
        rust("labels", Utf8, true),
        rust("granted_at", timestamp(), false),
        rust("updated_at", timestamp(), false),
        rust("released_at", timestamp(), true),
        rust("release_reason", Utf8, true),
    ]
}

/// FOCUS 1.2 cost and usage rows: one per lease and hour, and one per GPU model and hour for
/// `(unallocated)` capacity, from `lease_rows`. Column names, types and nullability as the FOCUS
/// specification gives them; `x_` columns are gpuwarden's own.
fn focus_costs() -> Vec<Column> {
    use DataType::{Boolean, Float64, Utf8};
    vec![
        sql("BilledCost", DECIMAL, false, "l.cost_usd"),
        filled("BillingAccountId", Utf8, false, |h| {
            text(&h.pricing.billing_account)
        }),
        filled("BillingAccountName", Utf8, true, |h| {
            text(&h.pricing.billing_account)
        }),
        filled("BillingCurrency", Utf8, false, |h| {
            text(&h.pricing.currency)
        }),
        filled("BillingPeriodEnd", timestamp(), false, |h| {
            time(month_of(h.start).1)
        }),
        filled("BillingPeriodStart", timestamp(), false, |h| {
            time(month_of(h.start).0)
        }),
        filled("ChargeCategory", Utf8, false, |_| text("Usage")),
        filled("ChargeClass", Utf8, true, |_| ScalarValue::Utf8(None)),
        sql(
            "ChargeDescription",
            Utf8,
            true,
            "CASE WHEN l.lease_id IS NULL \
             THEN 'Unallocated ' || l.gpu_model || ' capacity' \
             ELSE l.gpu_model || ' GPUs held by lease ' || l.lease_id END",
        ),
        filled("ChargeFrequency", Utf8, true, |_| text("Usage-Based")),
        filled("ChargePeriodEnd", timestamp(), false, |h| {
            time(h.start + HOUR_MS)
        }),
        filled("ChargePeriodStart", timestamp(), false, |h| time(h.start)),
        sql("ConsumedQuantity", DECIMAL, true, "l.allocated_gpu_hours"),
        filled("ConsumedUnit", Utf8, true, |_| text("GPU-Hours")),
        sql("ContractedCost", DECIMAL, false, "l.cost_usd"),
        sql("ContractedUnitPrice", DECIMAL, true, "{price}"),
        sql("EffectiveCost", DECIMAL, false, "l.cost_usd"),
        filled("InvoiceIssuerName", Utf8, false, |h| {
            text(&h.pricing.provider)
        }),
        sql("ListCost", DECIMAL, false, "l.cost_usd"),
        sql("ListUnitPrice", DECIMAL, true, "{price}"),
        sql("PricingQuantity", DECIMAL, true, "l.allocated_gpu_hours"),
        filled("PricingUnit", Utf8, true, |_| text("GPU-Hours")),
        filled("ProviderName", Utf8, false, |h| text(&h.pricing.provider)),
        filled("PublisherName", Utf8, false, |h| text(&h.pricing.provider)),
        sql("ResourceId", Utf8, true, "l.lease_id"),
        sql("ResourceName", Utf8, true, "l.lease_id"),
        sql(
            "ResourceType",
            Utf8,
            true,
            "CASE WHEN l.lease_id IS NULL THEN 'Unallocated GPU capacity' \
             ELSE 'GPU lease' END",
        ),
        filled("ServiceCategory", Utf8, false, |_| text("Compute")),
        filled("ServiceName", Utf8, false, |_| text("GPU Compute")),
        sql("SkuId", Utf8, true, "l.gpu_model"),
        sql("SubAccountId", Utf8, true, "l.team"),
        sql("SubAccountName", Utf8, true, "l.team"),
        sql("Tags", Utf8, true, "COALESCE(k.tags, '{}')"),
        sql("x_GpuModel", Utf8, false, "l.gpu_model"),
        sql("x_ObservedGpuHours", Float64, false, "l.observed_gpu_hours"),
        sql("x_BusyGpuHours", Float64, false, "l.busy_gpu_hours"),
        sql("x_IdleGpuHours", Float64, false, "l.idle_gpu_hours"),
        sql("x_UtilizationPct", Float64, true, "l.utilization_pct"),
        sql("x_IdleCost", DECIMAL, false, "l.idle_cost_usd"),
        sql("x_EnergyKwh", Float64, false, "l.energy_kwh"),
        filled("x_Final", Boolean, false, |h| {
            ScalarValue::Boolean(Some(h.is_final))
        }),
        sql("x_SmActiveGpuHours", Float64, true, "l.sm_active_gpu_hours"),
        sql("x_EnergyCost", DECIMAL, true, "l.energy_cost_usd"),
        sql("x_Co2eKg", Float64, true, "l.co2e_kg"),
    ]
}

/// FOCUS 1.2 rows from `lease_rows`, with each lease's tags. `{price}` reads `l.gpu_model`.
const FOCUS_COSTS: Query = Query {
    with: "",
    from: "FROM lease_rows l
LEFT JOIN known_leases k ON l.lease_id = k.lease_id
ORDER BY l.team, l.gpu_model, l.lease_id",
    model: Some("l.gpu_model"),
};

/// `known_leases`: every lease the lake knows, for joining samples to their lease (team and
/// model) and FOCUS rows to their tags.
pub fn known_leases() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("lease_id", DataType::Utf8, false),
        Field::new("team", DataType::Utf8, false),
        Field::new("gpu_model", DataType::Utf8, false),
        Field::new("tags", DataType::Utf8, false),
    ]))
}

/// `hour_allocation`: GPU-hours each lease held within one hour.
pub fn allocation() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("lease_id", DataType::Utf8, false),
        Field::new("allocated_gpu_hours", DataType::Float64, false),
    ]))
}
