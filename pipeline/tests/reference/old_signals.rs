//! The signals engine as it was before the bucketed window: DataFusion SQL over the window's raw
//! samples. Kept as the reference the bucketed engine is checked against (and measured against
//! in `benches/signal_window.rs`); its SQL is the definition the module documentation of
//! `gpuwarden_pipeline::signals` states in words. It has since learnt what the bucketed engine
//! did: SM activity, and idle judged by each lease's measure (`busy` below).
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use arrow_array::{Array, BooleanArray, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use gpuwarden_schema::config::IdleMeasure;
use gpuwarden_schema::signal::JudgedBy;
use gpuwarden_schema::{Record, Sample, Signal, SignalBody, V1};

use gpuwarden_pipeline::rollup::leases::Leases;
use gpuwarden_pipeline::signals::Inputs;

/// Computes signals, remembering idle runs from one computation to the next.
#[derive(Debug, Default)]
pub struct OldEngine {
    /// (lease, GPU) → when its current idle run started.
    idle_since: HashMap<(String, String), i64>,
}

/// One of an open lease's GPUs as the window saw it.
#[derive(Debug, Default, Clone)]
struct GpuStats {
    busy: f64,
    observed: f64,
    sm_busy: f64,
    sm_observed: f64,
    samples: i64,
    by_sm: i64,
    mem_max: i64,
    last_busy: Option<i64>,
    last_ts: i64,
    idle_from: Option<i64>,
}

/// An open lease: the holdings rows and the identity the signal carries.
struct Open<'a> {
    lease_id: &'a str,
    team: &'a str,
    gpu_model: &'a str,
    gpu_count: i64,
    gpu_uuids: &'a [String],
    since_ms: i64,
    granted_at: i64,
    measure: IdleMeasure,
}

impl OldEngine {
    /// A new engine with no idle runs remembered.
    pub fn new() -> Self {
        Self::default()
    }

    /// The signals for `inputs.ts_ms`, in a stable order: leases by id, then GPUs by UUID, then
    /// teams by name.
    pub async fn compute(&mut self, inputs: &Inputs<'_>) -> Result<Vec<Signal>, DataFusionError> {
        let pricing = inputs.pricing;
        let (util_threshold, sm_threshold) = (pricing.idle_util_pct, pricing.idle_sm_active_pct);
        let measure_of = |w| {
            inputs
                .idle_measures
                .get(&w)
                .copied()
                .unwrap_or(pricing.idle_measure)
        };
        let open: Vec<Open<'_>> = open_leases(inputs.leases, inputs.ts_ms, measure_of);
        let ctx = SessionContext::new();
        let schema = Sample::arrow_schema();
        let samples = MemTable::try_new(schema.clone(), vec![inputs.samples.to_vec()])?;
        ctx.register_table("window_samples", Arc::new(samples))?;
        ctx.register_table("holdings", Arc::new(holdings(&open)?))?;
        let start_ms = inputs.ts_ms - inputs.window_ms;
        ctx.register_table(
            "ended",
            Arc::new(ended(
                inputs.leases,
                start_ms,
                inputs.ts_ms,
                inputs.release_grace_ms,
            )?),
        )?;
        let start = inputs.ts_ms - inputs.window_ms;
        let ts = inputs.ts_ms;
        let attributed = format!(
            "WITH s AS (
                SELECT gpu_uuid, ts_ms, max(host) AS host, max(interval_ms) AS interval_ms,
                       max(util_gpu_pct) AS util, max(sm_active_pct) AS sm,
                       max(mem_used_bytes) AS mem, max(lease_id) AS lease_id
                FROM window_samples WHERE ts_ms > {start} AND ts_ms <= {ts}
                GROUP BY gpu_uuid, ts_ms),
            open_ids AS (SELECT DISTINCT lease_id, by_sm_active FROM holdings),
            named AS (
                SELECT s.gpu_uuid, s.ts_ms, s.host, s.interval_ms, s.util, s.sm, s.mem,
                       s.lease_id AS owner, o.by_sm_active
                FROM s JOIN open_ids o ON s.lease_id = o.lease_id),
            matched AS (
                SELECT s.gpu_uuid, s.ts_ms, s.host, s.interval_ms, s.util, s.sm, s.mem,
                       h.lease_id AS owner, h.by_sm_active,
                       row_number() OVER (PARTITION BY s.gpu_uuid, s.ts_ms
                                          ORDER BY h.granted_at DESC, h.lease_id DESC) AS rn
                FROM s JOIN holdings h ON s.gpu_uuid = h.gpu_uuid AND s.ts_ms >= h.since_ms
                WHERE s.lease_id IS NULL OR s.lease_id NOT IN (SELECT lease_id FROM open_ids)),
            attributed AS (
                SELECT gpu_uuid, ts_ms, host, interval_ms, util, sm, mem, owner, by_sm_active
                FROM named
                UNION ALL
                SELECT gpu_uuid, ts_ms, host, interval_ms, util, sm, mem, owner, by_sm_active
                FROM matched WHERE rn = 1)"
        );
        // A sample is judged by SM activity where its owner's measure is `sm_active` and it has
        // SM activity, by utilization otherwise.
        let per_gpu = format!(
            "{attributed},
            judged AS (
                SELECT *, (by_sm_active AND sm IS NOT NULL) AS by_sm,
                       CASE WHEN by_sm_active AND sm IS NOT NULL THEN sm >= {sm_threshold}
                            ELSE util >= {util_threshold} END AS busy
                FROM attributed),
            marked AS (
                SELECT *, max(CASE WHEN busy THEN ts_ms END)
                          OVER (PARTITION BY owner, gpu_uuid) AS last_busy
                FROM judged)
            SELECT owner, gpu_uuid,
                   CAST(sum(CAST(interval_ms AS DOUBLE) * util) AS DOUBLE) AS busy,
                   CAST(sum(interval_ms) AS DOUBLE) AS observed,
                   CAST(coalesce(sum(CAST(interval_ms AS DOUBLE) * sm), 0) AS DOUBLE) AS sm_busy,
                   CAST(coalesce(sum(CASE WHEN sm IS NOT NULL THEN interval_ms END), 0) AS DOUBLE)
                       AS sm_observed,
                   CAST(count(*) AS BIGINT) AS samples,
                   CAST(sum(CASE WHEN by_sm THEN 1 ELSE 0 END) AS BIGINT) AS by_sm,
                   max(mem) AS mem_max,
                   max(last_busy) AS last_busy,
                   max(ts_ms) AS last_ts,
                   min(CASE WHEN last_busy IS NULL OR ts_ms > last_busy THEN ts_ms END) AS idle_from
            FROM marked GROUP BY owner, gpu_uuid"
        );
        // Unattributed work is judged on the means, by `pricing.idle_measure`.
        let unattributed_sm = pricing.idle_measure == IdleMeasure::SmActive;
        let unattributed = format!(
            "{attributed},
            means AS (
            SELECT s.gpu_uuid, max(s.host) AS host,
                   CAST(sum(CAST(s.interval_ms AS DOUBLE) * s.util) / sum(s.interval_ms) AS DOUBLE) AS util,
                   CAST(sum(CAST(s.interval_ms AS DOUBLE) * s.sm)
                        / sum(CASE WHEN s.sm IS NOT NULL THEN s.interval_ms END) AS DOUBLE) AS sm
            FROM s LEFT ANTI JOIN attributed a ON s.gpu_uuid = a.gpu_uuid AND s.ts_ms = a.ts_ms
                   LEFT ANTI JOIN ended e ON s.lease_id = e.lease_id
                                         AND s.ts_ms >= e.since_ms AND s.ts_ms < e.until_ms
                   LEFT ANTI JOIN ended g ON s.gpu_uuid = g.gpu_uuid
                                         AND s.ts_ms >= g.since_ms AND s.ts_ms < g.until_ms
            WHERE s.gpu_uuid NOT IN (SELECT gpu_uuid FROM holdings)
            GROUP BY s.gpu_uuid)
            SELECT gpu_uuid, host, util FROM means
            WHERE CASE WHEN {unattributed_sm} AND sm IS NOT NULL THEN sm >= {sm_threshold}
                       ELSE util >= {util_threshold} END
            ORDER BY gpu_uuid"
        );

        let mut stats: BTreeMap<(String, String), GpuStats> = BTreeMap::new();
        for batch in ctx.sql(&per_gpu).await?.collect().await? {
            let owner = strings(&batch, "owner")?;
            let gpu = strings(&batch, "gpu_uuid")?;
            let busy = floats(&batch, "busy")?;
            let observed = floats(&batch, "observed")?;
            let sm_busy = floats(&batch, "sm_busy")?;
            let sm_observed = floats(&batch, "sm_observed")?;
            let samples = ints(&batch, "samples")?;
            let by_sm = ints(&batch, "by_sm")?;
            let mem = ints(&batch, "mem_max")?;
            let last_busy = ints(&batch, "last_busy")?;
            let last_ts = ints(&batch, "last_ts")?;
            let idle_from = ints(&batch, "idle_from")?;
            for i in 0..batch.num_rows() {
                stats.insert(
                    (owner.value(i).to_owned(), gpu.value(i).to_owned()),
                    GpuStats {
                        busy: busy.value(i),
                        observed: observed.value(i),
                        sm_busy: sm_busy.value(i),
                        sm_observed: sm_observed.value(i),
                        samples: samples.value(i),
                        by_sm: by_sm.value(i),
                        mem_max: mem.value(i),
                        last_busy: last_busy.is_valid(i).then(|| last_busy.value(i)),
                        last_ts: last_ts.value(i),
                        idle_from: idle_from.is_valid(i).then(|| idle_from.value(i)),
                    },
                );
            }
        }

        let header = |body| Signal {
            v: V1,
            ts_ms: ts,
            window_ms: inputs.window_ms,
            body,
        };
        let mut out = Vec::new();
        let mut remembered = HashMap::new();
        for lease in &open {
            // The GPUs measured: the lease's own, or (pooled) those its samples named.
            let gpus: BTreeSet<&str> = if lease.gpu_uuids.is_empty() {
                stats
                    .range((lease.lease_id.to_owned(), String::new())..)
                    .take_while(|((owner, _), _)| owner == lease.lease_id)
                    .map(|((_, gpu), _)| gpu.as_str())
                    .collect()
            } else {
                lease.gpu_uuids.iter().map(String::as_str).collect()
            };
            let (mut busy, mut observed, mut mem_max, mut active) = (0.0, 0.0, 0i64, 0u32);
            let (mut sm_busy, mut sm_observed, mut samples, mut by_sm) = (0.0, 0.0, 0, 0);
            // The latest idle-run start over the GPUs; None once one GPU is busy or unseen.
            let mut run_start: Option<i64> = (!gpus.is_empty()).then_some(i64::MIN);
            for gpu in &gpus {
                let key = (lease.lease_id.to_owned(), (*gpu).to_owned());
                let Some(s) = stats.get(&key) else {
                    run_start = None;
                    continue;
                };
                busy += s.busy;
                observed += s.observed;
                sm_busy += s.sm_busy;
                sm_observed += s.sm_observed;
                samples += s.samples;
                by_sm += s.by_sm;
                mem_max = mem_max.max(s.mem_max);
                if s.last_busy.is_some() {
                    active += 1;
                }
                let since = match (s.last_busy, s.idle_from) {
                    // The latest sample is busy.
                    (Some(b), _) if b == s.last_ts => None,
                    // Busy earlier in the window, idle since.
                    (Some(_), Some(from)) => Some(from),
                    // Idle through the whole window: since the run remembered, or since the
                    // first sample seen.
                    (None, Some(from)) => Some(
                        self.idle_since
                            .get(&key)
                            .copied()
                            .map_or(from, |was| was.min(from)),
                    ),
                    _ => None,
                };
                match since {
                    Some(since) => {
                        remembered.insert(key, since);
                        run_start = run_start.map(|r| r.max(since));
                    }
                    None => run_start = None,
                }
            }
            let util_pct = if observed > 0.0 { busy / observed } else { 0.0 };
            out.push(header(SignalBody::LeaseUtilization {
                lease_id: lease.lease_id.to_owned(),
                team: lease.team.to_owned(),
                util_pct,
                idle_ms: run_start.map_or(0, |r| (ts - r).max(0)),
                gpus_active: active,
                gpus_total: u32::try_from(lease.gpu_count).unwrap_or(u32::MAX),
                mem_used_max_bytes: u64::try_from(mem_max).unwrap_or(0),
                sm_active_pct: (sm_observed > 0.0).then(|| sm_busy / sm_observed),
                idle_measure: match (samples, by_sm) {
                    (0, _) => None,
                    (_, 0) => Some(JudgedBy::Util),
                    (n, m) if n == m => Some(JudgedBy::SmActive),
                    _ => Some(JudgedBy::Mixed),
                },
            }));
        }
        // Runs of leases that closed, or GPUs that turned busy, are forgotten.
        self.idle_since = remembered;

        for batch in ctx.sql(&unattributed).await?.collect().await? {
            let gpu = strings(&batch, "gpu_uuid")?;
            let host = strings(&batch, "host")?;
            let util = floats(&batch, "util")?;
            for i in 0..batch.num_rows() {
                out.push(header(SignalBody::GpuUnattributed {
                    gpu_uuid: gpu.value(i).to_owned(),
                    host: host.value(i).to_owned(),
                    util_pct: util.value(i),
                }));
            }
        }

        let mut teams: BTreeMap<&str, f64> = inputs
            .month_to_date_usd
            .keys()
            .map(|t| (t.as_str(), 0.0))
            .collect();
        for lease in &open {
            *teams.entry(lease.team).or_default() +=
                lease.gpu_count as f64 * pricing.usd_per_gpu_hour(lease.gpu_model);
        }
        for (team, burn) in teams {
            out.push(header(SignalBody::TeamSpend {
                team: team.to_owned(),
                month_to_date_usd: inputs.month_to_date_usd.get(team).copied().unwrap_or(0.0),
                burn_usd_per_hour: burn,
            }));
        }
        Ok(out)
    }
}

/// Leases granted by `ts_ms` and not released by then, by id.
fn open_leases(
    leases: &Leases,
    ts_ms: i64,
    measure_of: impl Fn(gpuwarden_schema::Workload) -> IdleMeasure,
) -> Vec<Open<'_>> {
    leases
        .iter()
        .filter(|l| l.granted_at <= ts_ms && l.released.as_ref().is_none_or(|(at, _)| *at > ts_ms))
        .filter_map(|l| {
            let segment = l.segments.iter().rev().find(|s| s.start <= ts_ms)?;
            Some(Open {
                lease_id: &l.lease_id,
                team: &l.identity.team,
                gpu_model: &l.identity.gpu_model,
                gpu_count: segment.gpu_count,
                gpu_uuids: &segment.gpu_uuids,
                since_ms: segment.start,
                granted_at: l.granted_at,
                measure: measure_of(l.identity.workload),
            })
        })
        .collect()
}

/// `ended`: for each lease released by `ts_ms` whose last segment reaches into the window, one
/// row per GPU of that segment (and one with no GPU, for samples that name the lease), from the
/// segment's start to `grace_ms` after the release: samples it owned then, or that trail its
/// release by the fleet's lag, are not unattributed work.
fn ended(
    leases: &Leases,
    window_start: i64,
    ts_ms: i64,
    grace_ms: i64,
) -> Result<MemTable, DataFusionError> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("lease_id", DataType::Utf8, false),
        Field::new("gpu_uuid", DataType::Utf8, true),
        Field::new("since_ms", DataType::Int64, false),
        Field::new("until_ms", DataType::Int64, false),
    ]));
    let (mut ids, mut gpus, mut since, mut until) = (vec![], vec![], vec![], vec![]);
    for lease in leases.iter() {
        let Some((released, _)) = lease.released else {
            continue;
        };
        let end = released.saturating_add(grace_ms.max(0));
        if released > ts_ms || end <= window_start {
            continue;
        }
        let start = lease.segments.last().map_or(lease.granted_at, |s| s.start);
        let named = lease
            .segments
            .last()
            .map(|s| s.gpu_uuids.as_slice())
            .unwrap_or_default();
        for gpu in std::iter::once(None).chain(named.iter().map(|g| Some(g.as_str()))) {
            ids.push(lease.lease_id.as_str());
            gpus.push(gpu);
            since.push(start);
            until.push(end);
        }
    }
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(StringArray::from(ids)),
            Arc::new(StringArray::from(gpus)),
            Arc::new(Int64Array::from(since)),
            Arc::new(Int64Array::from(until)),
        ],
    )?;
    MemTable::try_new(schema, vec![vec![batch]])
}

/// `holdings`: one row per (open lease, GPU it holds now).
fn holdings(open: &[Open<'_>]) -> Result<MemTable, DataFusionError> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("lease_id", DataType::Utf8, false),
        Field::new("gpu_uuid", DataType::Utf8, false),
        Field::new("since_ms", DataType::Int64, false),
        Field::new("granted_at", DataType::Int64, false),
        Field::new("by_sm_active", DataType::Boolean, false),
    ]));
    let (mut ids, mut gpus, mut since, mut granted) = (vec![], vec![], vec![], vec![]);
    let mut by_sm = vec![];
    for lease in open {
        let sm = lease.measure == IdleMeasure::SmActive;
        // A pooled lease holds no named GPU, but its id must still be known for named samples.
        if lease.gpu_uuids.is_empty() {
            ids.push(lease.lease_id);
            gpus.push("");
            since.push(lease.since_ms);
            granted.push(lease.granted_at);
            by_sm.push(sm);
        }
        for gpu in lease.gpu_uuids {
            ids.push(lease.lease_id);
            gpus.push(gpu.as_str());
            since.push(lease.since_ms);
            granted.push(lease.granted_at);
            by_sm.push(sm);
        }
    }
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(StringArray::from(ids)),
            Arc::new(StringArray::from(gpus)),
            Arc::new(Int64Array::from(since)),
            Arc::new(Int64Array::from(granted)),
            Arc::new(BooleanArray::from(by_sm)),
        ],
    )?;
    MemTable::try_new(schema, vec![vec![batch]])
}

/// Column `name` of `batch` as `T`, cast to `to` first (string columns may come back as views).
fn column<T: Array + Clone + 'static>(
    batch: &RecordBatch,
    name: &str,
    to: &DataType,
) -> Result<T, DataFusionError> {
    let array = batch
        .column_by_name(name)
        .ok_or_else(|| DataFusionError::Internal(format!("signals: no column {name}")))?;
    let cast = datafusion::arrow::compute::cast(array, to)?;
    cast.as_any()
        .downcast_ref::<T>()
        .cloned()
        .ok_or_else(|| DataFusionError::Internal(format!("signals: column {name} is not {to}")))
}

fn strings(batch: &RecordBatch, name: &str) -> Result<StringArray, DataFusionError> {
    column(batch, name, &DataType::Utf8)
}

fn floats(batch: &RecordBatch, name: &str) -> Result<Float64Array, DataFusionError> {
    column(batch, name, &DataType::Float64)
}

fn ints(batch: &RecordBatch, name: &str) -> Result<Int64Array, DataFusionError> {
    column(batch, name, &DataType::Int64)
}
