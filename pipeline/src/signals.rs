//! Signals: what the enforcer acts on, measured over the hot window (docs/src/contributors/records.md#signal).
//!
//! [`SignalEngine::signals`] takes the window's samples ([`SampleWindow`]: deduplicated as they
//! arrive and kept per GPU in one-minute buckets, [`window`]), the leases (rebuilt from their
//! events, [`Leases`]), each team's month-to-date cost from the rollups, and the time the signals
//! are for, and returns one signal per open lease (`lease_utilization`), per busy GPU no lease
//! holds (`gpu_unattributed`) and per team (`team_spend`). It is one pass of plain Rust over the
//! GPUs' buckets: a bucket wholly inside the window whose samples all name the same lease (or
//! none), and in whose minute no lease segment of its GPU or named lease starts or ends (a
//! holder's grant or resize, a released lease's last segment or the end of its grace), is read
//! from its summary; any other bucket is read sample by sample. Both give the same figures, so
//! where a segment starts or ends inside a minute, or samples and lease events arrive in any
//! order, the figures are those of the raw samples. [`SignalEngine::compute`] does the same over
//! Arrow batches in the `samples` schema.
//!
//! What the numbers mean, exactly (docs/src/finops/definitions.md#signal-figures summarizes them):
//! - Samples are deduplicated on `(gpu_uuid, ts_ms)` (each column's maximum, as the rollups do)
//!   and counted when `ts - window < ts_ms <= ts`.
//! - A sample belongs to the open lease it names; one that names no open lease belongs to the
//!   open lease whose current GPUs include its GPU, from that lease's latest grant or resize on
//!   (the most recently granted when several do). Samples of closed leases and before a lease's
//!   current segment count for no lease.
//! - A GPU is whatever `gpu_uuid` a sample names: a MIG slice (`MIG-…`) is a GPU of its own, so
//!   a lease holding one slice is measured on that slice's samples alone, whatever its
//!   neighbours do. The sample of a MIG GPU's unsliced rest (its parent's UUID, no lease, util 0)
//!   is an idle GPU no lease holds, so it never reads as unattributed work.
//! - `util_pct` is interval-weighted, as `utilization_pct` is in the rollups; `sm_active_pct`
//!   likewise, over the samples that have it (GPUs with GPM), absent when none does.
//! - Whether a GPU is idle in a sample is `pricing.judge_idle(measure, util_gpu_pct,
//!   sm_active_pct)`, as for `idle_gpu_hours`: with `measure` = `sm_active`, SM activity below
//!   `pricing.idle_sm_active_pct` where the sample has it, else (and with `util`) utilization
//!   below `pricing.idle_util_pct`. A lease's `measure` is its workload's (`Config::idle_measure`,
//!   given as [`IdleMeasures`]), so a GPU spinning at 100 % utilization with 2 % SM activity is
//!   idle for a lease judged by `sm_active` and busy for one judged by `util`. `idle_measure`
//!   says which judged the lease's samples in the window: `util` when the measure is `util` or
//!   no sample had SM activity, `sm_active` when every sample had it, `mixed` otherwise.
//!   `gpus_active` counts the lease's GPUs with at least one busy sample in the window.
//! - `idle_ms`: for each of the lease's GPUs, the idle run starts at its first idle sample after
//!   its last busy one; a run that began before the window is remembered from the previous
//!   computation (so `idle_timeout` may be longer than the window). The lease's `idle_ms` is
//!   `ts` minus the latest of its GPUs' run starts: 0 if any GPU's latest sample is busy, and 0
//!   while any of its GPUs has no sample in the window (no evidence, no reclaim). A lease on a
//!   substrate that names no GPUs is measured on the GPUs its samples name.
//! - `gpu_unattributed`: a GPU no open lease holds whose samples in the window that belong to no
//!   lease are busy taken together: `pricing.judge_idle(pricing.idle_measure, mean utilization,
//!   mean SM activity)` with interval-weighted means (SM activity's over the samples that have
//!   it, none without). A released lease still
//!   owns the samples of its last GPUs (or naming it) from that segment's start until
//!   `release_grace_ms` after its release, which covers the fleet's lag in following it.
//! - `team_spend`: `month_to_date_usd` is what the caller read from `team_hourly` for the month
//!   (the open hour included, as the rollup last refreshed it); `burn_usd_per_hour` is the price
//!   of the GPUs the team's open leases hold now. Every team given and every team with an open
//!   lease gets one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use arrow_array::{Array, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::DataType;
use datafusion::error::DataFusionError;
use gpuwarden_schema::config::{Config, IdleMeasure, PricingConfig};
use gpuwarden_schema::signal::JudgedBy;
use gpuwarden_schema::{Signal, SignalBody, Workload, V1};

use crate::rollup::leases::Leases;

pub mod window;

use window::{Bucket, Piece, SampleFields, SampleWindow, Tag, BUCKET_MS};

/// The measure that judges each workload's leases idle (`Config::idle_measure`); a workload
/// missing from it is judged by `pricing.idle_measure`.
pub type IdleMeasures = BTreeMap<Workload, IdleMeasure>;

/// Every workload's idle measure in `config`: its own `idle_measure`, else
/// `pricing.idle_measure`.
pub fn idle_measures(config: &Config) -> IdleMeasures {
    Workload::ALL
        .into_iter()
        .map(|w| (w, config.idle_measure(Some(w))))
        .collect()
}

/// Computes signals, remembering idle runs from one computation to the next.
#[derive(Debug, Default)]
pub struct SignalEngine {
    /// (lease, GPU) → when its current idle run started.
    idle_since: HashMap<(String, String), i64>,
}

/// What one computation over Arrow batches reads ([`SignalEngine::compute`]).
#[derive(Debug)]
pub struct Inputs<'a> {
    /// The signals' time: the end of the window.
    pub ts_ms: i64,
    /// The window's length.
    pub window_ms: i64,
    /// Samples (the `samples` schema); those outside the window are ignored.
    pub samples: &'a [RecordBatch],
    /// Every lease the pipeline knows.
    pub leases: &'a Leases,
    /// Month-to-date cost per team from the rollups.
    pub month_to_date_usd: &'a BTreeMap<String, f64>,
    /// Prices, the idle thresholds, and the measure of unattributed GPUs.
    pub pricing: &'a PricingConfig,
    /// The measure each workload's leases are judged idle by ([`idle_measures`]).
    pub idle_measures: &'a IdleMeasures,
    /// How long after a lease's release its GPUs' samples still count as its own (the fleet's
    /// lag in following the release), not as unattributed.
    pub release_grace_ms: i64,
}

/// What one computation reads besides the samples ([`SignalEngine::signals`]).
#[derive(Debug, Clone, Copy)]
pub struct Period<'a> {
    /// The signals' time: the end of the window.
    pub ts_ms: i64,
    /// The window's length.
    pub window_ms: i64,
    /// Every lease the pipeline knows.
    pub leases: &'a Leases,
    /// Month-to-date cost per team from the rollups.
    pub month_to_date_usd: &'a BTreeMap<String, f64>,
    /// Prices, the idle thresholds, and the measure of unattributed GPUs.
    pub pricing: &'a PricingConfig,
    /// The measure each workload's leases are judged idle by ([`idle_measures`]).
    pub idle_measures: &'a IdleMeasures,
    /// How long after a lease's release its GPUs' samples still count as its own (the fleet's
    /// lag in following the release), not as unattributed.
    pub release_grace_ms: i64,
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
    /// The measure its workload is judged idle by.
    measure: IdleMeasure,
}

/// Where one sample's time goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// To the open lease at this index.
    Owner(usize),
    /// To no lease: counts towards `gpu_unattributed`.
    Unowned,
    /// To no lease, and not unattributed either: its GPU is held now, or it falls in a released
    /// lease's last segment or grace.
    Excluded,
}

/// Who owns the samples of the window: the open leases, each GPU's holders, and the released
/// leases' last segments with their grace.
struct Attribution<'a> {
    open: Vec<Open<'a>>,
    open_ids: HashMap<&'a str, usize>,
    /// GPU → the open leases whose current GPUs include it (`""` for a pooled lease).
    holders: HashMap<&'a str, Vec<usize>>,
    /// Released lease → `[since, until)`: its last segment's start to the end of its grace.
    ended_lease: HashMap<&'a str, Vec<(i64, i64)>>,
    /// GPU → the same spans, for the GPUs of those segments.
    ended_gpu: HashMap<&'a str, Vec<(i64, i64)>>,
}

/// One GPU's share of the attribution tables.
struct Gpu<'a> {
    holders: Option<&'a Vec<usize>>,
    ended: Option<&'a Vec<(i64, i64)>>,
}

impl<'a> Attribution<'a> {
    fn new(period: &Period<'a>) -> Self {
        let (leases, ts_ms, grace_ms) = (period.leases, period.ts_ms, period.release_grace_ms);
        let window_start = ts_ms - period.window_ms;
        let open = open_leases(leases, ts_ms, |workload| {
            period
                .idle_measures
                .get(&workload)
                .copied()
                .unwrap_or(period.pricing.idle_measure)
        });
        let open_ids = open
            .iter()
            .enumerate()
            .map(|(i, l)| (l.lease_id, i))
            .collect();
        let mut holders: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, lease) in open.iter().enumerate() {
            // A pooled lease holds no named GPU, but its id must still be known: it holds "".
            if lease.gpu_uuids.is_empty() {
                holders.entry("").or_default().push(i);
            }
            for gpu in lease.gpu_uuids {
                holders.entry(gpu.as_str()).or_default().push(i);
            }
        }
        // For each lease released by `ts_ms` whose last segment reaches into the window: samples
        // it owned then, or that trail its release by the fleet's lag, are not unattributed.
        let mut ended_lease: HashMap<&str, Vec<(i64, i64)>> = HashMap::new();
        let mut ended_gpu: HashMap<&str, Vec<(i64, i64)>> = HashMap::new();
        for lease in leases.iter() {
            let Some((released, _)) = lease.released else {
                continue;
            };
            let until = released.saturating_add(grace_ms.max(0));
            if released > ts_ms || until <= window_start {
                continue;
            }
            let since = lease.segments.last().map_or(lease.granted_at, |s| s.start);
            ended_lease
                .entry(lease.lease_id.as_str())
                .or_default()
                .push((since, until));
            let named = lease
                .segments
                .last()
                .map(|s| s.gpu_uuids.as_slice())
                .unwrap_or_default();
            for gpu in named {
                ended_gpu
                    .entry(gpu.as_str())
                    .or_default()
                    .push((since, until));
            }
        }
        Self {
            open,
            open_ids,
            holders,
            ended_lease,
            ended_gpu,
        }
    }

    fn gpu(&self, gpu_uuid: &str) -> Gpu<'_> {
        Gpu {
            holders: self.holders.get(gpu_uuid),
            ended: self.ended_gpu.get(gpu_uuid),
        }
    }

    /// Where a sample of `gpu` at `t` naming `lease` goes (the module documentation's rules).
    fn class(&self, gpu: &Gpu<'_>, lease: Option<&str>, t: i64) -> Class {
        if let Some(&i) = lease.and_then(|l| self.open_ids.get(l)) {
            return Class::Owner(i);
        }
        if let Some(holders) = gpu.holders {
            // Held now: the most recently granted holder whose segment had started, or nobody
            // (and then not unattributed either).
            let owner = holders
                .iter()
                .copied()
                .filter(|&i| self.open[i].since_ms <= t)
                .max_by_key(|&i| (self.open[i].granted_at, self.open[i].lease_id));
            return owner.map_or(Class::Excluded, Class::Owner);
        }
        let within = |spans: Option<&Vec<(i64, i64)>>| {
            spans.is_some_and(|s| s.iter().any(|&(since, until)| since <= t && t < until))
        };
        if within(lease.and_then(|l| self.ended_lease.get(l))) || within(gpu.ended) {
            return Class::Excluded;
        }
        Class::Unowned
    }

    /// Whether every sample of `gpu` naming `lease` in `[from, to]` goes the same way: no
    /// holder's segment starts, and no released lease's span starts or ends, after `from` and
    /// at or before `to`.
    fn uniform(&self, gpu: &Gpu<'_>, lease: Option<&str>, from: i64, to: i64) -> bool {
        if lease.is_some_and(|l| self.open_ids.contains_key(l)) {
            return true;
        }
        let cuts = |t: i64| from < t && t <= to;
        if let Some(holders) = gpu.holders {
            return !holders.iter().any(|&i| cuts(self.open[i].since_ms));
        }
        let mut spans = lease
            .and_then(|l| self.ended_lease.get(l))
            .into_iter()
            .chain(gpu.ended)
            .flatten();
        !spans.any(|&(since, until)| cuts(since) || cuts(until))
    }
}

/// The samples of a GPU that belong to no lease: Σ interval × util, Σ interval, the same over
/// the samples with SM activity, largest host.
#[derive(Debug, Default)]
struct Unowned<'a> {
    weighted: f64,
    observed: i64,
    sm_weighted: f64,
    sm_observed: i64,
    host: &'a str,
}

/// Where the window's samples went: each (open lease, GPU)'s samples in time order, and each
/// GPU's samples that belong to no lease.
#[derive(Default)]
struct Tally<'w> {
    owned: BTreeMap<(usize, &'w str), Piece>,
    unowned: BTreeMap<&'w str, Unowned<'w>>,
}

impl<'w> Tally<'w> {
    fn take(&mut self, class: Class, gpu: &'w str, piece: &Piece, host: &'w str) {
        match class {
            Class::Owner(i) => {
                self.owned
                    .entry((i, gpu))
                    .and_modify(|p| p.then(piece))
                    .or_insert(*piece);
            }
            Class::Unowned => {
                let u = self.unowned.entry(gpu).or_default();
                u.weighted += piece.weighted;
                u.observed += piece.observed;
                u.sm_weighted += piece.sm_weighted;
                u.sm_observed += piece.sm_observed;
                u.host = u.host.max(host);
            }
            Class::Excluded => {}
        }
    }
}

/// A bucket's summary when all its points share one tag.
fn single_tag(bucket: &Bucket) -> Option<(&Tag, &Piece)> {
    let summary = bucket.summary()?;
    let tag = bucket.tags.get(usize::from(summary.tag?))?;
    Some((tag, &summary.piece))
}

impl SignalEngine {
    /// A new engine with no idle runs remembered.
    pub fn new() -> Self {
        Self::default()
    }

    /// The signals for `inputs.ts_ms` over samples given as Arrow batches: they are put in a
    /// [`SampleWindow`] first, then as [`SignalEngine::signals`].
    pub async fn compute(&mut self, inputs: &Inputs<'_>) -> Result<Vec<Signal>, DataFusionError> {
        let mut window = SampleWindow::new(BUCKET_MS);
        for batch in inputs.samples {
            add_batch(&mut window, batch)?;
        }
        Ok(self.signals(
            &mut window,
            &Period {
                ts_ms: inputs.ts_ms,
                window_ms: inputs.window_ms,
                leases: inputs.leases,
                month_to_date_usd: inputs.month_to_date_usd,
                pricing: inputs.pricing,
                idle_measures: inputs.idle_measures,
                release_grace_ms: inputs.release_grace_ms,
            },
        ))
    }

    /// The signals for `period.ts_ms` over the samples of `window` in `(ts − window, ts]`, in a
    /// stable order: leases by id, then GPUs by UUID, then teams by name. `window` is taken
    /// mutably only to bring its buckets' summaries up to date.
    pub fn signals(&mut self, window: &mut SampleWindow, period: &Period<'_>) -> Vec<Signal> {
        let pricing = period.pricing;
        let ts = period.ts_ms;
        let start = ts - period.window_ms;
        window.summarize(pricing);
        let window = &*window;
        let bucket_ms = window.bucket_ms();
        let attribution = Attribution::new(period);

        let mut tally = Tally::default();
        for (gpu_uuid, buckets) in window.gpus() {
            let gpu = attribution.gpu(gpu_uuid);
            for bucket in buckets {
                let (from, to) = (bucket.start, bucket.start + bucket_ms - 1);
                if to <= start || from > ts {
                    continue;
                }
                // The common case: a whole bucket inside the window, one lease named, and no
                // segment edge in it: its summary stands for its samples.
                let whole = from > start && to <= ts;
                if let Some((tag, piece)) = whole.then(|| single_tag(bucket)).flatten() {
                    let lease = tag.lease.as_deref();
                    if attribution.uniform(&gpu, lease, from, to) {
                        let class = attribution.class(&gpu, lease, from);
                        tally.take(class, gpu_uuid, piece, &tag.host);
                        continue;
                    }
                }
                for p in &bucket.points {
                    let t = bucket.ts(p);
                    if t <= start || t > ts {
                        continue;
                    }
                    let tag = &bucket.tags[usize::from(p.tag)];
                    let class = attribution.class(&gpu, tag.lease.as_deref(), t);
                    tally.take(class, gpu_uuid, &Piece::of(t, p, pricing), &tag.host);
                }
            }
        }
        let stats = tally.owned;

        let header = |body| Signal {
            v: V1,
            ts_ms: ts,
            window_ms: period.window_ms,
            body,
        };
        let mut out = Vec::new();
        let mut remembered = HashMap::new();
        for (index, lease) in attribution.open.iter().enumerate() {
            // The GPUs measured: the lease's own, or (pooled) those its samples named.
            let gpus: BTreeSet<&str> = if lease.gpu_uuids.is_empty() {
                stats
                    .range((index, "")..)
                    .take_while(|((owner, _), _)| *owner == index)
                    .map(|((_, gpu), _)| *gpu)
                    .collect()
            } else {
                lease.gpu_uuids.iter().map(String::as_str).collect()
            };
            let (mut busy, mut observed, mut mem_max, mut active) = (0.0, 0i64, 0i64, 0u32);
            let (mut sm_weighted, mut sm_observed) = (0.0, 0i64);
            let (mut samples, mut sm_samples) = (0u64, 0u64);
            // The latest idle-run start over the GPUs; None once one GPU is busy or unseen.
            let mut run_start: Option<i64> = (!gpus.is_empty()).then_some(i64::MIN);
            for gpu in &gpus {
                let key = (lease.lease_id.to_owned(), (*gpu).to_owned());
                let Some(s) = stats.get(&(index, *gpu)) else {
                    run_start = None;
                    continue;
                };
                busy += s.weighted;
                observed += s.observed;
                sm_weighted += s.sm_weighted;
                sm_observed += s.sm_observed;
                samples += u64::from(s.samples);
                sm_samples += u64::from(s.sm_samples);
                mem_max = mem_max.max(s.mem_max);
                let run = s.run(lease.measure);
                if run.last_busy.is_some() {
                    active += 1;
                }
                let since = match (run.last_busy, run.idle_from) {
                    // The latest sample is busy.
                    (Some(b), _) if b == s.last => None,
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
            let util_pct = if observed > 0 {
                busy / observed as f64
            } else {
                0.0
            };
            let idle_measure = match (lease.measure, samples, sm_samples) {
                (_, 0, _) => None,
                (IdleMeasure::Util, _, _) | (IdleMeasure::SmActive, _, 0) => Some(JudgedBy::Util),
                (IdleMeasure::SmActive, n, sm) if n == sm => Some(JudgedBy::SmActive),
                (IdleMeasure::SmActive, _, _) => Some(JudgedBy::Mixed),
            };
            out.push(header(SignalBody::LeaseUtilization {
                lease_id: lease.lease_id.to_owned(),
                team: lease.team.to_owned(),
                util_pct,
                idle_ms: run_start.map_or(0, |r| (ts - r).max(0)),
                gpus_active: active,
                gpus_total: u32::try_from(lease.gpu_count).unwrap_or(u32::MAX),
                mem_used_max_bytes: u64::try_from(mem_max).unwrap_or(0),
                sm_active_pct: (sm_observed > 0).then(|| sm_weighted / sm_observed as f64),
                idle_measure,
            }));
        }
        // Runs of leases that closed, or GPUs that turned busy, are forgotten.
        self.idle_since = remembered;

        for (gpu, u) in tally.unowned {
            let util_pct = u.weighted / u.observed as f64;
            let sm_active = (u.sm_observed > 0).then(|| u.sm_weighted / u.sm_observed as f64);
            let (idle, _) = pricing.judge_idle(pricing.idle_measure, util_pct, sm_active);
            if !idle {
                out.push(header(SignalBody::GpuUnattributed {
                    gpu_uuid: gpu.to_owned(),
                    host: u.host.to_owned(),
                    util_pct,
                }));
            }
        }

        let mut teams: BTreeMap<&str, f64> = period
            .month_to_date_usd
            .keys()
            .map(|t| (t.as_str(), 0.0))
            .collect();
        for lease in &attribution.open {
            *teams.entry(lease.team).or_default() +=
                lease.gpu_count as f64 * pricing.usd_per_gpu_hour(lease.gpu_model);
        }
        for (team, burn) in teams {
            out.push(header(SignalBody::TeamSpend {
                team: team.to_owned(),
                month_to_date_usd: period.month_to_date_usd.get(team).copied().unwrap_or(0.0),
                burn_usd_per_hour: burn,
            }));
        }
        out
    }
}

/// Leases granted by `ts_ms` and not released by then, by id, each with the measure
/// `measure_of` gives its workload.
fn open_leases(
    leases: &Leases,
    ts_ms: i64,
    measure_of: impl Fn(Workload) -> IdleMeasure,
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

/// Adds the rows of `batch` (the `samples` schema) to `window`.
fn add_batch(window: &mut SampleWindow, batch: &RecordBatch) -> Result<(), DataFusionError> {
    let gpu = strings(batch, "gpu_uuid")?;
    let ts = ints(batch, "ts_ms")?;
    let interval = ints(batch, "interval_ms")?;
    let host = strings(batch, "host")?;
    let util = floats(batch, "util_gpu_pct")?;
    // Samples gained SM activity after the first v1: batches read from older files lack it.
    let sm_active = match batch.column_by_name("sm_active_pct") {
        Some(_) => Some(floats(batch, "sm_active_pct")?),
        None => None,
    };
    let mem = ints(batch, "mem_used_bytes")?;
    let lease = strings(batch, "lease_id")?;
    for i in 0..batch.num_rows() {
        window.add(&SampleFields {
            gpu_uuid: gpu.value(i),
            ts_ms: ts.value(i),
            interval_ms: interval.value(i),
            host: host.value(i),
            util_gpu_pct: util.value(i),
            sm_active_pct: sm_active
                .as_ref()
                .and_then(|c| c.is_valid(i).then(|| c.value(i))),
            mem_used_bytes: mem.value(i),
            lease_id: lease.is_valid(i).then(|| lease.value(i)),
        });
    }
    Ok(())
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
