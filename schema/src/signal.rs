//! [`Signal`]: a measurement the pipeline computes over its hot window and publishes on
//! `gpuwarden.signals`; the enforcer decides what it means.
//!
//! On the wire and in the lake a signal is flat: the common fields, `kind`, and the fields of that
//! kind. In Rust it is typed, so a consumer matches on [`SignalBody`] instead of unwrapping.

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, DataType, Schema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::arrow::{self as ax, field, Columns};
use crate::error::{ArrowConvertError, ValidationError};
use crate::record::Record;
use crate::version::V1;

/// A measurement computed by the pipeline.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(
    title = "Signal",
    description = "A measurement computed by the pipeline over its hot window; the enforcer decides what it means."
)]
pub struct Signal {
    /// Contract version.
    pub v: V1,
    /// When the measurement was taken (the end of its window), Unix epoch milliseconds (UTC).
    pub ts_ms: i64,
    /// Length of the window measured, milliseconds.
    pub window_ms: i64,
    /// The kind of signal and its fields.
    #[serde(flatten)]
    pub body: SignalBody,
}

/// The kinds of signal, each with its own fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SignalBody {
    /// How an open lease uses its GPUs.
    LeaseUtilization {
        /// The lease.
        lease_id: String,
        /// The lease's team.
        team: String,
        /// Mean GPU utilization over the window, percent.
        util_pct: f64,
        /// How long all of the lease's GPUs have been idle without a break, up to `ts_ms`.
        idle_ms: i64,
        /// GPUs of the lease that were busy in the window.
        gpus_active: u32,
        /// GPUs the lease holds.
        gpus_total: u32,
        /// Peak memory used on any of the lease's GPUs in the window, bytes.
        mem_used_max_bytes: u64,
        /// Mean SM activity over the window's samples that report it (GPUs with GPM), percent;
        /// absent when none does.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(range(min = 0.0, max = 100.0))]
        sm_active_pct: Option<f64>,
        /// Which measure judged the window's samples idle or busy: `sm_active` where the lease's
        /// measure is SM activity and every sample had it, `util` where utilization judged them
        /// all (the measure is `util`, or no sample had SM activity), `mixed` otherwise; absent
        /// without samples.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idle_measure: Option<JudgedBy>,
    },
    /// A busy GPU that no lease holds.
    GpuUnattributed {
        /// The GPU.
        gpu_uuid: String,
        /// Its host.
        host: String,
        /// Mean GPU utilization over the window, percent.
        util_pct: f64,
    },
    /// A team's spending.
    TeamSpend {
        /// The team.
        team: String,
        /// Spend since the start of the month (UTC), in the configured currency.
        month_to_date_usd: f64,
        /// Current rate of spend, per hour.
        burn_usd_per_hour: f64,
    },
    /// A host whose clock is wrong: its samples' time strays further from their arrival than
    /// `pipeline.clock` allows, so they are quarantined (`ts_ms` is when the last one arrived).
    ClockSkew {
        /// The host.
        host: String,
        /// Its last refused sample's `ts_ms` minus that sample's arrival: positive when the
        /// host's clock runs ahead.
        skew_ms: i64,
    },
}

/// Which measure judged a window's samples idle or busy (`lease_utilization.idle_measure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JudgedBy {
    /// GPU utilization judged every sample.
    Util,
    /// SM activity judged every sample.
    SmActive,
    /// SM activity judged the samples that had it, utilization the others (GPUs without GPM).
    Mixed,
}

impl JudgedBy {
    /// The name on the wire and in the lake.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Util => "util",
            Self::SmActive => "sm_active",
            Self::Mixed => "mixed",
        }
    }
}

impl SignalBody {
    /// The `kind` name of this signal.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::LeaseUtilization { .. } => "lease_utilization",
            Self::GpuUnattributed { .. } => "gpu_unattributed",
            Self::TeamSpend { .. } => "team_spend",
            Self::ClockSkew { .. } => "clock_skew",
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum SignalKind {
    LeaseUtilization,
    GpuUnattributed,
    TeamSpend,
    ClockSkew,
}

/// The flat wire form; every kind-specific field optional, checked per kind on conversion so
/// that a missing field is reported by name.
#[derive(Debug, Clone, Deserialize)]
struct SignalWire {
    v: V1,
    ts_ms: i64,
    kind: SignalKind,
    window_ms: i64,
    lease_id: Option<String>,
    team: Option<String>,
    util_pct: Option<f64>,
    idle_ms: Option<i64>,
    gpus_active: Option<u32>,
    gpus_total: Option<u32>,
    mem_used_max_bytes: Option<u64>,
    sm_active_pct: Option<f64>,
    idle_measure: Option<JudgedBy>,
    gpu_uuid: Option<String>,
    host: Option<String>,
    month_to_date_usd: Option<f64>,
    burn_usd_per_hour: Option<f64>,
    skew_ms: Option<i64>,
}

fn need<T>(value: Option<T>, field: &str, kind: &str) -> Result<T, ValidationError> {
    value.ok_or_else(|| ValidationError::new(field, format!("required for kind {kind}")))
}

impl<'de> Deserialize<'de> for Signal {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = SignalWire::deserialize(deserializer)?;
        Signal::try_from(wire).map_err(serde::de::Error::custom)
    }
}

impl TryFrom<SignalWire> for Signal {
    type Error = ValidationError;

    fn try_from(w: SignalWire) -> Result<Self, ValidationError> {
        let body = match w.kind {
            SignalKind::LeaseUtilization => {
                let k = "lease_utilization";
                SignalBody::LeaseUtilization {
                    lease_id: need(w.lease_id, "lease_id", k)?,
                    team: need(w.team, "team", k)?,
                    util_pct: need(w.util_pct, "util_pct", k)?,
                    idle_ms: need(w.idle_ms, "idle_ms", k)?,
                    gpus_active: need(w.gpus_active, "gpus_active", k)?,
                    gpus_total: need(w.gpus_total, "gpus_total", k)?,
                    mem_used_max_bytes: need(w.mem_used_max_bytes, "mem_used_max_bytes", k)?,
                    sm_active_pct: w.sm_active_pct,
                    idle_measure: w.idle_measure,
                }
            }
            SignalKind::GpuUnattributed => {
                let k = "gpu_unattributed";
                SignalBody::GpuUnattributed {
                    gpu_uuid: need(w.gpu_uuid, "gpu_uuid", k)?,
                    host: need(w.host, "host", k)?,
                    util_pct: need(w.util_pct, "util_pct", k)?,
                }
            }
            SignalKind::TeamSpend => {
                let k = "team_spend";
                SignalBody::TeamSpend {
                    team: need(w.team, "team", k)?,
                    month_to_date_usd: need(w.month_to_date_usd, "month_to_date_usd", k)?,
                    burn_usd_per_hour: need(w.burn_usd_per_hour, "burn_usd_per_hour", k)?,
                }
            }
            SignalKind::ClockSkew => {
                let k = "clock_skew";
                SignalBody::ClockSkew {
                    host: need(w.host, "host", k)?,
                    skew_ms: need(w.skew_ms, "skew_ms", k)?,
                }
            }
        };
        Ok(Signal {
            v: w.v,
            ts_ms: w.ts_ms,
            window_ms: w.window_ms,
            body,
        })
    }
}

/// Every column of the flat form, read from one typed signal.
#[derive(Default)]
struct Flat<'a> {
    lease_id: Option<&'a str>,
    team: Option<&'a str>,
    util_pct: Option<f64>,
    idle_ms: Option<i64>,
    gpus_active: Option<u32>,
    gpus_total: Option<u32>,
    mem_used_max_bytes: Option<u64>,
    sm_active_pct: Option<f64>,
    idle_measure: Option<JudgedBy>,
    gpu_uuid: Option<&'a str>,
    host: Option<&'a str>,
    month_to_date_usd: Option<f64>,
    burn_usd_per_hour: Option<f64>,
    skew_ms: Option<i64>,
}

impl<'a> From<&'a SignalBody> for Flat<'a> {
    fn from(body: &'a SignalBody) -> Self {
        match body {
            SignalBody::LeaseUtilization {
                lease_id,
                team,
                util_pct,
                idle_ms,
                gpus_active,
                gpus_total,
                mem_used_max_bytes,
                sm_active_pct,
                idle_measure,
            } => Flat {
                lease_id: Some(lease_id),
                team: Some(team),
                util_pct: Some(*util_pct),
                idle_ms: Some(*idle_ms),
                gpus_active: Some(*gpus_active),
                gpus_total: Some(*gpus_total),
                mem_used_max_bytes: Some(*mem_used_max_bytes),
                sm_active_pct: *sm_active_pct,
                idle_measure: *idle_measure,
                ..Flat::default()
            },
            SignalBody::GpuUnattributed {
                gpu_uuid,
                host,
                util_pct,
            } => Flat {
                gpu_uuid: Some(gpu_uuid),
                host: Some(host),
                util_pct: Some(*util_pct),
                ..Flat::default()
            },
            SignalBody::TeamSpend {
                team,
                month_to_date_usd,
                burn_usd_per_hour,
            } => Flat {
                team: Some(team),
                month_to_date_usd: Some(*month_to_date_usd),
                burn_usd_per_hour: Some(*burn_usd_per_hour),
                ..Flat::default()
            },
            SignalBody::ClockSkew { host, skew_ms } => Flat {
                host: Some(host),
                skew_ms: Some(*skew_ms),
                ..Flat::default()
            },
        }
    }
}

impl Record for Signal {
    const NAME: &'static str = "signal";
    const TOPIC: &'static str = crate::topics::SIGNALS;

    fn validate(&self) -> Result<(), ValidationError> {
        if self.window_ms < 0 {
            return Err(ValidationError::new("window_ms", "must not be negative"));
        }
        match &self.body {
            SignalBody::LeaseUtilization {
                util_pct,
                idle_ms,
                gpus_active,
                gpus_total,
                mem_used_max_bytes,
                sm_active_pct,
                ..
            } => {
                check_pct("util_pct", *util_pct)?;
                if let Some(sm) = sm_active_pct {
                    check_pct("sm_active_pct", *sm)?;
                }
                if *idle_ms < 0 {
                    return Err(ValidationError::new("idle_ms", "must not be negative"));
                }
                if gpus_active > gpus_total {
                    return Err(ValidationError::new(
                        "gpus_active",
                        format!("{gpus_active} is more than gpus_total ({gpus_total})"),
                    ));
                }
                if i64::try_from(*mem_used_max_bytes).is_err() {
                    return Err(ValidationError::new(
                        "mem_used_max_bytes",
                        "is larger than 2^63-1",
                    ));
                }
            }
            SignalBody::GpuUnattributed { util_pct, .. } => check_pct("util_pct", *util_pct)?,
            SignalBody::TeamSpend {
                month_to_date_usd,
                burn_usd_per_hour,
                ..
            } => {
                for (name, value) in [
                    ("month_to_date_usd", month_to_date_usd),
                    ("burn_usd_per_hour", burn_usd_per_hour),
                ] {
                    if !value.is_finite() || *value < 0.0 {
                        return Err(ValidationError::new(
                            name,
                            format!("{value} is not a non-negative amount"),
                        ));
                    }
                }
            }
            SignalBody::ClockSkew { host, .. } => {
                if host.is_empty() {
                    return Err(ValidationError::new("host", "must not be empty"));
                }
            }
        }
        Ok(())
    }

    fn key(&self) -> &str {
        match &self.body {
            SignalBody::LeaseUtilization { lease_id, .. } => lease_id,
            SignalBody::GpuUnattributed { gpu_uuid, .. } => gpu_uuid,
            SignalBody::TeamSpend { team, .. } => team,
            SignalBody::ClockSkew { host, .. } => host,
        }
    }

    fn arrow_schema() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            field("v", DataType::Int64, false),
            field("ts_ms", DataType::Int64, false),
            field("kind", DataType::Utf8, false),
            field("window_ms", DataType::Int64, false),
            field("lease_id", DataType::Utf8, true),
            field("team", DataType::Utf8, true),
            field("util_pct", DataType::Float64, true),
            field("idle_ms", DataType::Int64, true),
            field("gpus_active", DataType::Int64, true),
            field("gpus_total", DataType::Int64, true),
            field("mem_used_max_bytes", DataType::Int64, true),
            field("gpu_uuid", DataType::Utf8, true),
            field("host", DataType::Utf8, true),
            field("month_to_date_usd", DataType::Float64, true),
            field("burn_usd_per_hour", DataType::Float64, true),
            field("skew_ms", DataType::Int64, true),
            // Columns added after the first v1 (older lake files lack them).
            field("sm_active_pct", DataType::Float64, true),
            field("idle_measure", DataType::Utf8, true),
        ]))
    }

    fn to_record_batch(records: &[Self]) -> Result<RecordBatch, ArrowError> {
        let r = records;
        let flat: Vec<Flat<'_>> = r.iter().map(|s| Flat::from(&s.body)).collect();
        RecordBatch::try_new(
            Self::arrow_schema(),
            vec![
                ax::i64s(r.iter().map(|_| Some(i64::from(V1::NUMBER)))),
                ax::i64s(r.iter().map(|s| Some(s.ts_ms))),
                ax::strings(r.iter().map(|s| Some(s.body.kind()))),
                ax::i64s(r.iter().map(|s| Some(s.window_ms))),
                ax::strings(flat.iter().map(|f| f.lease_id)),
                ax::strings(flat.iter().map(|f| f.team)),
                ax::f64s(flat.iter().map(|f| f.util_pct)),
                ax::i64s(flat.iter().map(|f| f.idle_ms)),
                ax::i64s(flat.iter().map(|f| f.gpus_active.map(i64::from))),
                ax::i64s(flat.iter().map(|f| f.gpus_total.map(i64::from))),
                ax::u64s(
                    "mem_used_max_bytes",
                    flat.iter().map(|f| f.mem_used_max_bytes),
                )?,
                ax::strings(flat.iter().map(|f| f.gpu_uuid)),
                ax::strings(flat.iter().map(|f| f.host)),
                ax::f64s(flat.iter().map(|f| f.month_to_date_usd)),
                ax::f64s(flat.iter().map(|f| f.burn_usd_per_hour)),
                ax::i64s(flat.iter().map(|f| f.skew_ms)),
                ax::f64s(flat.iter().map(|f| f.sm_active_pct)),
                ax::strings(flat.iter().map(|f| f.idle_measure.map(JudgedBy::as_str))),
            ],
        )
    }

    fn from_record_batch(batch: &RecordBatch) -> Result<Vec<Self>, ArrowConvertError> {
        let c = Columns::new(batch);
        let (ts_ms, kind, window_ms) = (c.i64("ts_ms")?, c.str("kind")?, c.i64("window_ms")?);
        let (lease_id, team, util_pct, idle_ms) = (
            c.str("lease_id")?,
            c.str("team")?,
            c.f64("util_pct")?,
            c.i64("idle_ms")?,
        );
        let (gpus_active, gpus_total, mem_max) = (
            c.i64("gpus_active")?,
            c.i64("gpus_total")?,
            c.i64("mem_used_max_bytes")?,
        );
        let (gpu_uuid, host) = (c.str("gpu_uuid")?, c.str("host")?);
        let (mtd, burn) = (c.f64("month_to_date_usd")?, c.f64("burn_usd_per_hour")?);
        let skew = c.i64("skew_ms")?;
        // Columns a signal gained after the first v1: a batch of an older lake file lacks them.
        let sm_active = c.later("sm_active_pct", Columns::f64)?;
        let idle_measure = c.later("idle_measure", Columns::str)?;
        (0..batch.num_rows())
            .map(|i| {
                let wire = SignalWire {
                    v: V1,
                    ts_ms: ts_ms.req(i)?,
                    kind: kind.parse(i)?,
                    window_ms: window_ms.req(i)?,
                    lease_id: lease_id.opt(i),
                    team: team.opt(i),
                    util_pct: util_pct.opt(i),
                    idle_ms: idle_ms.opt(i),
                    gpus_active: gpus_active.opt_as(i)?,
                    gpus_total: gpus_total.opt_as(i)?,
                    mem_used_max_bytes: mem_max.opt_as(i)?,
                    sm_active_pct: sm_active.as_ref().and_then(|c| c.opt(i)),
                    idle_measure: idle_measure.as_ref().map_or(Ok(None), |c| c.parse_opt(i))?,
                    gpu_uuid: gpu_uuid.opt(i),
                    host: host.opt(i),
                    month_to_date_usd: mtd.opt(i),
                    burn_usd_per_hour: burn.opt(i),
                    skew_ms: skew.opt(i),
                };
                Signal::try_from(wire)
                    .map_err(|e| ArrowConvertError::new(e.field, format!("row {i}: {}", e.reason)))
            })
            .collect()
    }
}

fn check_pct(field: &str, pct: f64) -> Result<(), ValidationError> {
    if (0.0..=100.0).contains(&pct) {
        Ok(())
    } else {
        Err(ValidationError::new(
            field,
            format!("{pct} is outside 0..=100"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utilization(extra: serde_json::Value) -> Result<Signal, crate::DecodeError> {
        let mut json = serde_json::json!({"v": 1, "ts_ms": 10, "kind": "lease_utilization",
            "window_ms": 900000, "lease_id": "l-1", "team": "t", "util_pct": 100.0,
            "idle_ms": 60000, "gpus_active": 0, "gpus_total": 1, "mem_used_max_bytes": 5});
        for (k, v) in extra.as_object().unwrap() {
            json[k] = v.clone();
        }
        Signal::from_json(json.to_string().as_bytes())
    }

    #[test]
    fn sm_activity_and_the_measure_that_judged_are_optional_and_checked() {
        // A signal of the first v1 has neither.
        let old = utilization(serde_json::json!({})).unwrap();
        let SignalBody::LeaseUtilization {
            sm_active_pct,
            idle_measure,
            ..
        } = &old.body
        else {
            unreachable!()
        };
        assert_eq!((*sm_active_pct, *idle_measure), (None, None));
        let text = String::from_utf8(old.to_json()).unwrap();
        assert!(!text.contains("sm_active_pct") && !text.contains("idle_measure"));

        let spinning =
            utilization(serde_json::json!({"sm_active_pct": 2.0, "idle_measure": "sm_active"}))
                .unwrap();
        let SignalBody::LeaseUtilization {
            sm_active_pct,
            idle_measure,
            ..
        } = &spinning.body
        else {
            unreachable!()
        };
        assert_eq!(
            (*sm_active_pct, *idle_measure),
            (Some(2.0), Some(JudgedBy::SmActive))
        );
        assert_eq!(Signal::from_json(&spinning.to_json()).unwrap(), spinning);

        let err = utilization(serde_json::json!({"sm_active_pct": 100.5})).unwrap_err();
        assert_eq!(err.field(), Some("sm_active_pct"), "{err}");
        let err = utilization(serde_json::json!({"idle_measure": "sm"})).unwrap_err();
        assert!(err.to_string().contains("sm_active"), "{err}");
    }

    #[test]
    fn a_lake_batch_from_before_the_later_columns_reads_them_as_absent() {
        let spinning =
            utilization(serde_json::json!({"sm_active_pct": 2.0, "idle_measure": "mixed"}))
                .unwrap();
        let batch = Signal::to_record_batch(std::slice::from_ref(&spinning)).unwrap();
        assert_eq!(Signal::from_record_batch(&batch).unwrap(), [spinning]);
        let old = batch
            .project(&(0..batch.num_columns() - 2).collect::<Vec<_>>())
            .unwrap();
        let read = Signal::from_record_batch(&old).unwrap();
        let SignalBody::LeaseUtilization {
            sm_active_pct,
            idle_measure,
            ..
        } = &read[0].body
        else {
            unreachable!()
        };
        assert_eq!((*sm_active_pct, *idle_measure), (None, None));

        let mut wrong = batch.columns().to_vec();
        let last = wrong.len() - 1;
        wrong[last] = ax::strings(std::iter::once(Some("vibes")));
        let wrong = RecordBatch::try_new(Signal::arrow_schema(), wrong).unwrap();
        let err = Signal::from_record_batch(&wrong).unwrap_err();
        assert_eq!(err.column, "idle_measure", "{err}");
    }
}
