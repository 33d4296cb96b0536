//! The derived tables: [`RollupTable`], the ones the rollups write under `lake/rollups/` (their
//! names, directories and schemas), and the schemas of the small per-run tables they join
//! samples against. Types and nullability are fixed here, not inferred from a query, so every
//! file of a table has the same schema and `focus_costs` says exactly what FOCUS 1.2 says of
//! each column.

use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};

/// The directory under the lake root that holds every rollup table and the rollups' own state.
pub const DIR: &str = "rollups";

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

fn f(name: &str, data_type: DataType, nullable: bool) -> Field {
    Field::new(name, data_type, nullable)
}

fn measures(with_cost: bool) -> Vec<Field> {
    let mut fields = vec![
        f("allocated_gpu_hours", DataType::Float64, false),
        f("observed_gpu_hours", DataType::Float64, false),
        f("busy_gpu_hours", DataType::Float64, false),
        f("idle_gpu_hours", DataType::Float64, false),
        f("utilization_pct", DataType::Float64, true),
    ];
    if with_cost {
        fields.push(f("cost_usd", DataType::Float64, false));
        fields.push(f("idle_cost_usd", DataType::Float64, false));
    }
    fields.push(f("energy_kwh", DataType::Float64, false));
    fields
}

/// `gpu_hourly`: one row per GPU and hour with samples or sampled time.
fn gpu_hourly() -> SchemaRef {
    Arc::new(Schema::new(vec![
        f("hour", timestamp(), false),
        f("host", DataType::Utf8, false),
        f("gpu_uuid", DataType::Utf8, false),
        f("gpu_model", DataType::Utf8, false),
        f("samples", DataType::Int64, false),
        f("observed_gpu_hours", DataType::Float64, false),
        f("busy_gpu_hours", DataType::Float64, false),
        f("idle_gpu_hours", DataType::Float64, false),
        f("utilization_pct", DataType::Float64, true),
        f("energy_kwh", DataType::Float64, false),
        f("mem_used_max_bytes", DataType::Int64, false),
        f("final", DataType::Boolean, false),
    ]))
}

/// `lease_hourly`: one row per lease and hour with an allocation or attributed time, plus one
/// per GPU model for `(unallocated)` (null `lease_id`). `lease_usage` and `focus_costs` come
/// from it.
fn lease_hourly() -> SchemaRef {
    let mut fields = vec![
        f("hour", timestamp(), false),
        f("lease_id", DataType::Utf8, true),
        f("team", DataType::Utf8, false),
        f("gpu_model", DataType::Utf8, false),
    ];
    fields.extend(measures(true));
    fields.push(f("final", DataType::Boolean, false));
    Arc::new(Schema::new(fields))
}

/// `team_hourly`: one row per team, GPU model and hour with an allocation or attributed time
/// (docs/ARCHITECTURE.md#rollup-tables).
fn team_hourly() -> SchemaRef {
    let mut fields = vec![
        f("hour", timestamp(), false),
        f("team", DataType::Utf8, false),
        f("gpu_model", DataType::Utf8, false),
    ];
    fields.extend(measures(true));
    fields.push(f("final", DataType::Boolean, false));
    Arc::new(Schema::new(fields))
}

/// `leases`: one row per lease, its current state.
fn leases() -> SchemaRef {
    Arc::new(Schema::new(vec![
        f("lease_id", DataType::Utf8, false),
        f("state", DataType::Utf8, false),
        f("team", DataType::Utf8, false),
        f("user", DataType::Utf8, false),
        f("project", DataType::Utf8, false),
        f("workload", DataType::Utf8, false),
        f("substrate", DataType::Utf8, false),
        f("gpu_model", DataType::Utf8, false),
        f("gpu_count", DataType::Int64, false),
        f(
            "gpu_uuids",
            DataType::List(Arc::new(Field::new("item", DataType::Utf8, true))),
            false,
        ),
        f("labels", DataType::Utf8, true),
        f("granted_at", timestamp(), false),
        f("updated_at", timestamp(), false),
        f("released_at", timestamp(), true),
        f("release_reason", DataType::Utf8, true),
    ]))
}

/// FOCUS 1.2 cost and usage rows: one per lease and hour, and one per GPU model and hour for
/// `(unallocated)` capacity. Column names, types and nullability as the FOCUS specification
/// gives them; `x_` columns are gpuwarden's own.
fn focus_costs() -> SchemaRef {
    let text = DataType::Utf8;
    Arc::new(Schema::new(vec![
        f("BilledCost", DECIMAL, false),
        f("BillingAccountId", text.clone(), false),
        f("BillingAccountName", text.clone(), true),
        f("BillingCurrency", text.clone(), false),
        f("BillingPeriodEnd", timestamp(), false),
        f("BillingPeriodStart", timestamp(), false),
        f("ChargeCategory", text.clone(), false),
        f("ChargeClass", text.clone(), true),
        f("ChargeDescription", text.clone(), true),
        f("ChargeFrequency", text.clone(), true),
        f("ChargePeriodEnd", timestamp(), false),
        f("ChargePeriodStart", timestamp(), false),
        f("ConsumedQuantity", DECIMAL, true),
        f("ConsumedUnit", text.clone(), true),
        f("ContractedCost", DECIMAL, false),
        f("ContractedUnitPrice", DECIMAL, true),
        f("EffectiveCost", DECIMAL, false),
        f("InvoiceIssuerName", text.clone(), false),
        f("ListCost", DECIMAL, false),
        f("ListUnitPrice", DECIMAL, true),
        f("PricingQuantity", DECIMAL, true),
        f("PricingUnit", text.clone(), true),
        f("ProviderName", text.clone(), false),
        f("PublisherName", text.clone(), false),
        f("ResourceId", text.clone(), true),
        f("ResourceName", text.clone(), true),
        f("ResourceType", text.clone(), true),
        f("ServiceCategory", text.clone(), false),
        f("ServiceName", text.clone(), false),
        f("SkuId", text.clone(), true),
        f("SubAccountId", text.clone(), true),
        f("SubAccountName", text.clone(), true),
        f("Tags", text.clone(), true),
        f("x_GpuModel", text.clone(), false),
        f("x_ObservedGpuHours", DataType::Float64, false),
        f("x_BusyGpuHours", DataType::Float64, false),
        f("x_IdleGpuHours", DataType::Float64, false),
        f("x_UtilizationPct", DataType::Float64, true),
        f("x_IdleCost", DECIMAL, false),
        f("x_EnergyKwh", DataType::Float64, false),
        f("x_Final", DataType::Boolean, false),
    ]))
}

/// `known_leases`: every lease the lake knows, for joining samples to their lease (team and
/// model) and FOCUS rows to their tags.
pub fn known_leases() -> SchemaRef {
    Arc::new(Schema::new(vec![
        f("lease_id", DataType::Utf8, false),
        f("team", DataType::Utf8, false),
        f("gpu_model", DataType::Utf8, false),
        f("tags", DataType::Utf8, false),
    ]))
}

/// `hour_allocation`: GPU-hours each lease held within one hour.
pub fn allocation() -> SchemaRef {
    Arc::new(Schema::new(vec![
        f("lease_id", DataType::Utf8, false),
        f("allocated_gpu_hours", DataType::Float64, false),
    ]))
}
