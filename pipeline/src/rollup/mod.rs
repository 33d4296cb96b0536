//! Rollups: DataFusion turns the lake's raw `samples` and `lease_events` into utilization, waste
//! and cost per GPU, lease and team, hour by hour, exactly as
//! docs/src/finops/definitions.md defines them, and commits them to the lake's Delta
//! tables under `rollups/<table>/` ([`crate::delta`]), an hour of a table per commit.
//!
//! One run ([`Rollup::run`]):
//! 1. rebuilds every lease from its events ([`leases`]) and takes the watermark: the fleet's
//!    ([`crate::bounds::FleetWatermark`] over each host's latest sample and when a run first
//!    saw it, kept in `rollups/_hosts.json` and updated from the hours new samples landed in;
//!    hosts dated past the clock's now + `max_skew` and hosts a day behind the rest left out),
//!    or the latest lease event if that is later, and never earlier than the last run's;
//! 2. picks the hours to compute: every hour with samples or an allocation that is not yet
//!    final, every hour the lake marked because new or late samples landed in it, and every
//!    hour from the earliest marked lease event on (a lease event changes attribution and
//!    allocation from its own time onward, never before);
//! 3. computes each hour from that hour's sample files and the next hour's (whose first
//!    samples' intervals began in it): the samples become per-GPU-and-lease partials in Rust
//!    (`attribute`), each table's query ([`tables`], where its columns are declared) turns them
//!    into its rows, and each table's hour is replaced in one commit. An hour of more than
//!    `part_rows` samples is attributed in parts split by GPU (`parts`), so memory follows a
//!    part, not the hour, and never the lake. A run keeps each open hour's partials over its
//!    settled samples for the next run of the same [`Rollup`], which reads only the samples
//!    after them. An hour is `final` once the watermark has passed its end plus
//!    `pipeline.lateness`; until then every run refreshes it.
//!
//! Rules the SQL alone does not show, decided here once:
//! - Duplicate samples (same `gpu_uuid`, `ts_ms`) count once; where they disagree each column
//!   takes its largest value, so a copy naming a lease wins over one that names none.
//! - A sample naming a lease the lake has no event for is attributed as if it named none: the
//!   lake cannot say whose it is. When that lease's events arrive, they mark the hours again.
//! - A sample attributed to a lease is priced and grouped by the lease's `gpu_model`; an
//!   unallocated one by its own.
//! - A sample's time is its interval `[ts_ms - interval_ms, ts_ms)`, cut at hour edges and where
//!   a lease starts or stops holding its GPU: each piece counts in the hour it lies in, for the
//!   lease that held the GPU then. So a lease's observed time in an hour never exceeds its
//!   allocation there (once the watermark has passed it), except where a segment lists no GPU
//!   ids and more GPUs name it than it holds.
//! - A running lease's segment has no end for attribution, and ends at the watermark for
//!   allocation.
//! - Each piece weighs its length times its sample's share of a GPU (a MIG slice's part of its
//!   GPU, 1 for a whole one), and is judged idle by the measure of the lease it goes to; a
//!   lease is allocated its listed devices' shares, each learnt from the device's samples and
//!   kept in `_state.json` (`mig`), since an hour may have none of its samples.
//!
//! Progress (and a run's hours, rows and time) is logged; state that must survive a crash —
//! which hours are final, which are being recomputed — is in `rollups/_state.json`, and marks
//! are cleared only after the hours they name are recorded as pending there.

// In layer order, one group each, so that rustfmt keeps the order: `tables` declares the
// tables; `leases` rebuilds leases from their events; `attribute` attributes an hour's samples to
// them; `parts` splits an hour too large to attribute at once; `migrate` moves rollup tables of
// the layout before Delta.
pub mod tables;

pub mod leases;

mod attribute;

mod parts;

pub mod migrate;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, SchemaRef};
use datafusion::arrow::compute::{cast, concat_batches};
use datafusion::common::ScalarValue;
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use futures::StreamExt as _;
use gpuwarden_schema::config::{Config, IdleMeasure, PricingConfig};
use gpuwarden_schema::{ArrowConvertError, Clock, LeaseEvent, Record as _, SystemClock, Workload};
use serde::{Deserialize, Serialize};

use crate::bounds::FleetWatermark;
use crate::buffer::Table;
use crate::delta::{AsOf, Changes, DataFile, Span};
use crate::lake::{hour_partition, Lake, LakeError, LakeLock, Role, StateVersion};
use attribute::{Attributor, Partials};
use gpuwarden_schema::clock::duration_ms;
use leases::Leases;
pub use tables::{price_sql, RollupTable, UNALLOCATED};

const HOUR_MS: i64 = 3_600_000;

/// Where an hour computed in parts keeps them, relative to the rollups' directory.
const TMP: &str = "_tmp";

/// What the rollups need from the config.
#[derive(Debug, Clone)]
pub struct RollupOptions {
    /// Prices, the idle measure and thresholds, MIG shares, the emission factor and the FOCUS
    /// billing names.
    pub pricing: PricingConfig,
    /// The workloads whose leases are judged idle by a measure of their own
    /// (`[workloads.<kind>] idle_measure`); the others by `pricing.idle_measure`.
    pub idle_measures: BTreeMap<Workload, IdleMeasure>,
    /// How long after an hour ends (in event time) it may still receive data.
    pub lateness_ms: i64,
    /// A host this far behind the median host, or with no new sample for this long (in the
    /// clock's time), stops holding the watermark back.
    pub idle_ms: i64,
    /// A host whose latest sample is more than this ahead of the clock's now is not the fleet's
    /// time (`pipeline.clock.max_skew`).
    pub max_skew_ms: i64,
    /// The clock the fleet's records are dated with.
    pub clock: Arc<dyn Clock>,
    /// An hour with more sample rows than this is computed a part at a time (see
    /// [`Rollup::run`]'s step 3): [`DEFAULT_PART_ROWS`] unless a test wants many parts.
    pub part_rows: usize,
    /// Samples this far behind the watermark are taken as settled: a run keeps their partials
    /// for the next, which reads again only the samples after them (see [`Rollup`]). A sample
    /// that lands later than that behind them makes its hour computed whole again.
    pub settle_ms: i64,
}

/// The sample rows of one part of an hour computed at a time: about 18 parts in a
/// 100,000-GPU hour (72 M samples). The attribution (`attribute`) holds 64 bytes a row besides
/// the strings it interns, and reads a part's spilled batches one at a time. Measured: a whole
/// computation of 24.1 M samples of 100,000 GPUs (`bench/up-fleet.sh`'s lake, 6 parts, and the
/// hour before it) took 19.5 s with a peak RSS of 1.9 GB for the process.
pub const DEFAULT_PART_ROWS: usize = 1 << 22;

impl RollupOptions {
    /// The options of a config file.
    pub fn from_config(config: &Config) -> Self {
        Self {
            pricing: config.pricing.clone(),
            idle_measures: config
                .workloads
                .iter()
                .filter_map(|(workload, policy)| Some((*workload, policy.idle_measure?)))
                .collect(),
            lateness_ms: duration_ms(config.pipeline.lateness),
            idle_ms: duration_ms(config.pipeline.clock.idle_timeout),
            max_skew_ms: duration_ms(config.pipeline.clock.max_skew),
            clock: Arc::new(SystemClock),
            part_rows: DEFAULT_PART_ROWS,
            settle_ms: (2 * duration_ms(config.pipeline.flush_age)).max(60_000),
        }
    }

    /// The measure that judges a lease of `workload` idle (`Config::idle_measure`).
    pub fn idle_measure(&self, workload: Workload) -> IdleMeasure {
        self.idle_measures
            .get(&workload)
            .copied()
            .unwrap_or(self.pricing.idle_measure)
    }

    /// These options on `clock` (the fleet's, when it is accelerated).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
}

/// A rollup that failed.
#[derive(Debug, thiserror::Error)]
pub enum RollupError {
    /// A query over the lake failed.
    #[error("rollup query failed: {0}")]
    Query(DataFusionError),
    /// Reading or writing the lake failed.
    #[error(transparent)]
    Lake(#[from] LakeError),
    /// Building a batch failed (a bug: the schemas are fixed in code).
    #[error("building a rollup batch: {0}")]
    Arrow(ArrowError),
    /// A lease event in the lake does not convert back to a record.
    #[error("reading lease events from the lake: {0}")]
    LeaseEvents(ArrowConvertError),
    /// The state file could not be read or written.
    #[error("rollup state {path}: {message}")]
    State {
        /// The state file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Another process is rolling up the same lake.
    #[error("another rollup holds {0}; only one process may roll up a lake at a time")]
    Busy(PathBuf),
    /// A commit to a rollup table failed.
    #[error(transparent)]
    Delta(#[from] crate::delta::DeltaError),
    /// Rollup tables still hold files of the layout before Delta.
    #[error(
        "the rollup tables {tables} of {lake} are in the layout before Delta tables: run \
         `gpuwarden lake migrate` once (with this config) before rolling up"
    )]
    NotMigrated {
        /// The tables with old files.
        tables: String,
        /// The lake.
        lake: String,
    },
}

// The wrapped errors are shown in the message rather than as a source, so that an error
// chain printed with `{:#}` does not repeat them.
impl From<DataFusionError> for RollupError {
    fn from(e: DataFusionError) -> Self {
        Self::Query(e)
    }
}

impl From<ArrowError> for RollupError {
    fn from(e: ArrowError) -> Self {
        Self::Arrow(e)
    }
}

impl From<ArrowConvertError> for RollupError {
    fn from(e: ArrowConvertError) -> Self {
        Self::LeaseEvents(e)
    }
}

/// What one run did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// The event time the lake's data has reached (see [`Rollup::run`]), if it has any data.
    pub watermark: Option<i64>,
    /// Hosts whose latest sample time the watermark was taken over.
    pub hosts: usize,
    /// Hours computed in this run.
    pub hours: usize,
    /// Of those, hours now final.
    pub final_hours: usize,
    /// Of those, hours computed from the partials the last run kept, reading only the samples
    /// after them.
    pub incremental_hours: usize,
    /// Leases known.
    pub leases: usize,
    /// `team_hourly` rows written.
    pub team_rows: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

/// The fleet's watermark over the hosts' latest samples, and the hosts worth keeping.
struct Fleet {
    watermark: Option<i64>,
    /// Every host is dated past the ceiling: the lake's data comes from an accelerated clock
    /// ahead of this one (a demo's), not from wrong clocks, and is taken as it is.
    ahead: bool,
    /// The hosts to remember: neither ahead of the ceiling nor a day behind the latest.
    kept: BTreeMap<String, (i64, i64)>,
}

/// Applies [`FleetWatermark`] to `hosts` (latest sample, first seen), leaving out hosts dated
/// past `ceiling` (a wrong clock, in a lake rolled up before the bounds or from a backfill)
/// unless all are, and hosts a day behind the latest of the rest (gone: decommissioned, or most
/// of the fleet shut down), so that they stop counting in the median.
/// A host counts as silent after `silence_ms` of the rollup's clock without a new sample.
fn fleet_watermark(
    hosts: &BTreeMap<String, (i64, i64)>,
    ceiling: i64,
    idle_ms: i64,
    silence_ms: i64,
) -> Fleet {
    let ahead = !hosts.is_empty() && hosts.values().all(|(ts, _)| *ts > ceiling);
    let honest = |ts: i64| ahead || ts <= ceiling;
    let latest = hosts
        .values()
        .map(|(ts, _)| *ts)
        .filter(|ts| honest(*ts))
        .max();
    let kept: BTreeMap<String, (i64, i64)> = hosts
        .iter()
        .filter(|(_, (ts, _))| {
            honest(*ts) && latest.is_some_and(|l| *ts >= l.saturating_sub(FORGET_HOSTS_MS))
        })
        .map(|(host, times)| (host.clone(), *times))
        .collect();
    let mut fleet = FleetWatermark::new(idle_ms).with_silence(silence_ms);
    for (host, (ts, seen)) in &kept {
        fleet.observe(host, *ts, Some(*seen));
    }
    Fleet {
        watermark: fleet.watermark(),
        ahead,
        kept,
    }
}

/// Hosts whose latest sample is this far behind the latest host's are forgotten.
const FORGET_HOSTS_MS: i64 = 24 * HOUR_MS;

/// A seen time later than `now` was stamped by another clock (a demo's, ahead of this one):
/// it is taken as now, so that it does not make every other host look silent.
fn clamp_seen(hosts: &mut BTreeMap<String, (i64, i64)>, now: i64) {
    for (_, seen) in hosts.values_mut() {
        *seen = (*seen).min(now);
    }
}

/// Each host's latest sample time and when a rollup first saw it (on its clock).
type Hosts = BTreeMap<String, (i64, i64)>;

/// `_hosts.json`: each host's latest sample time and when a rollup first saw it; `None` when
/// there is no file yet, or one that does not read (then every sample is read again). With the
/// version read, for the write that replaces it.
fn load_hosts(lake: &Lake, path: &Path) -> Result<(Option<Hosts>, StateVersion), RollupError> {
    let (bytes, version) = match lake.read_state(path) {
        Ok(Some(read)) => read,
        Ok(None) => return Ok((None, StateVersion::default())),
        Err(e @ LakeError::ObjectStore { .. }) => return Err(e.into()),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the hosts' latest times; reading every sample again");
            return Ok((None, StateVersion::default()));
        }
    };
    match serde_json::from_slice(&bytes) {
        Ok(hosts) => Ok((Some(hosts), version)),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "the hosts' latest times do not read; reading every sample again");
            Ok((None, version))
        }
    }
}

fn save_hosts(
    lake: &Lake,
    path: &Path,
    hosts: &BTreeMap<String, (i64, i64)>,
    version: &mut StateVersion,
) -> Result<(), RollupError> {
    let bytes = serde_json::to_vec(hosts).expect("host times serialize");
    lake.write_state(path, bytes, version, Role::Rollups)
        .map_err(|e| state_error(path, e))
}

/// A failed write of a state file: a lost role stays [`LakeError::Deposed`], for the caller to
/// tell from a broken lake.
fn state_error(path: &Path, e: LakeError) -> RollupError {
    match e {
        e @ LakeError::Deposed { .. } => RollupError::Lake(e),
        e => RollupError::State {
            path: path.to_owned(),
            message: e.to_string(),
        },
    }
}

/// The version of `_state.json`'s format this build reads and writes; a file without one is
/// version 1, as every file before the field was.
pub const STATE_VERSION: u64 = 1;

/// `_state.json`, less its `version` and `written_by` fields: [`State::load`] checks them before
/// decoding the rest, and [`State::written`] sets them to this build's.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// Hours computed, and whether they were final then.
    hours: BTreeMap<i64, bool>,
    /// The watermark of the last run: the next is never earlier.
    #[serde(default)]
    watermark: Option<i64>,
    /// When the last run read the hosts' samples, on the rollup's clock.
    #[serde(default)]
    last_run: Option<i64>,
    /// Hours chosen by a run that has not finished them.
    pending: BTreeSet<i64>,
    /// The version of each raw table (`samples`, `lease_events`) whose new rows the hours
    /// chosen account for: the next run takes the hours of the commits after it.
    #[serde(default)]
    read: BTreeMap<String, u64>,
    /// Each MIG device's shapes in the samples read so far, by UUID: what a lease that lists
    /// it holds of a GPU ([`MigShapes::share`]). `None` in a state written before there were
    /// any: the next run reads every sample for them, once.
    #[serde(default)]
    mig: Option<MigShapes>,
}

/// The shapes of MIG devices seen in samples, by the device's UUID (usually one each).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
struct MigShapes(BTreeMap<String, BTreeSet<MigShape>>);

/// A MIG device as one sample described it (`mig_profile`, `mig_slices`, `mig_parent_slices`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
struct MigShape {
    profile: String,
    #[serde(default)]
    slices: Option<u32>,
    #[serde(default)]
    parent_slices: Option<u32>,
}

impl MigShapes {
    /// The GPU-equivalents a lease holds in the device `uuid`: its share of its GPU
    /// ([`PricingConfig::gpu_share`]; the largest, should its samples disagree), or 1 for a
    /// device no sample described as a MIG device (a whole GPU).
    fn share(&self, pricing: &PricingConfig, uuid: &str) -> f64 {
        self.0
            .get(uuid)
            .into_iter()
            .flatten()
            .map(|s| pricing.gpu_share(Some(&s.profile), s.slices, s.parent_slices))
            .reduce(f64::max)
            .unwrap_or(1.0)
    }

    fn extend(&mut self, other: MigShapes) {
        for (uuid, shapes) in other.0 {
            self.0.entry(uuid).or_default().extend(shapes);
        }
    }
}

impl State {
    /// The state, and the version read for the write that replaces it. A state of a newer
    /// format is refused before it is decoded: its hours may mean what this build cannot tell.
    fn load(lake: &Lake, path: &Path) -> Result<(Self, StateVersion), RollupError> {
        match lake.read_state(path) {
            Ok(Some((bytes, version))) => {
                gpuwarden_schema::format::check_json(
                    &bytes,
                    || format!("{} in {}", path.display(), lake.location()),
                    "state",
                    STATE_VERSION,
                )
                .map_err(LakeError::from)?;
                serde_json::from_slice(&bytes)
                    .map(|state| (state, version))
                    .map_err(|e| RollupError::State {
                        path: path.to_owned(),
                        message: format!("unreadable ({e}); delete it to recompute every hour"),
                    })
            }
            Ok(None) => Ok((Self::default(), StateVersion::default())),
            Err(e) => Err(state_error(path, e)),
        }
    }

    /// Saves the state, if `lock` still holds the role: a process that lost it stops here,
    /// and its write (conditional on the version it read, in a bucket) is refused besides.
    fn save(
        &self,
        lake: &Lake,
        path: &Path,
        version: &mut StateVersion,
        lock: &LakeLock,
    ) -> Result<(), RollupError> {
        lock.check("saving the rollups' state")?;
        let bytes = serde_json::to_vec(&self.written()).expect("the state serializes");
        lake.write_state(path, bytes, version, Role::Rollups)
            .map_err(|e| state_error(path, e))
    }

    /// The state as this build writes it: its format's version, and this gpuwarden's.
    pub(crate) fn written(&self) -> WrittenState<'_> {
        WrittenState {
            version: STATE_VERSION,
            written_by: gpuwarden_schema::format::GPUWARDEN_VERSION,
            state: self,
        }
    }
}

/// [`State`] as written: the version fields set to this build's, whatever the state read said.
#[derive(Serialize)]
pub(crate) struct WrittenState<'a> {
    version: u64,
    written_by: &'static str,
    #[serde(flatten)]
    state: &'a State,
}

/// Rolls up one lake.
///
/// A run keeps, for the next run of the same `Rollup`, the partials of each hour that is not
/// final over the samples before a cut (the watermark less `settle_ms`): the next run reads
/// only the samples from that cut on, the new ones among them, and adds. The kept partials are
/// dropped, and the hour computed whole again, when a commit since brings samples before the
/// cut (late data, a duplicate) or lease events before it (they change attribution from their
/// own time on); a process that starts computes every hour it needs whole, once.
#[derive(Debug, Clone)]
pub struct Rollup {
    lake: Lake,
    options: RollupOptions,
    /// Set once a run found no rollup file of the layout before Delta: the check lists every
    /// file of the tables, which a long-lived pipeline need not do every `rollup_every`.
    migrated: Arc<std::sync::atomic::AtomicBool>,
    /// What the last run kept for this one; taken by a run, put back when it ends well.
    kept: Arc<std::sync::Mutex<Option<Kept>>>,
}

/// What a run keeps for the next: each hour's partials of the samples before its cut, valid
/// for the raw tables' versions the run read.
#[derive(Debug, Default)]
struct Kept {
    /// The versions of `samples` and `lease_events` the run read (`_state.json`'s `read`).
    read: BTreeMap<String, u64>,
    hours: BTreeMap<i64, Settled>,
}

/// An hour's partials over the samples with `ts_ms` before `cut` (in the files of the hour and
/// the next).
#[derive(Debug)]
struct Settled {
    cut: i64,
    partials: Partials,
}

impl Kept {
    /// Drops the hours that the commits since no longer let it keep: `samples` and `leases`
    /// are the changes [`crate::delta::DeltaTables::changes`] found since the versions kept
    /// (`None`: the log does not say).
    fn invalidate(&mut self, samples: Option<&Changes>, leases: Option<&Changes>) {
        let (Some(samples), Some(leases)) = (samples, leases) else {
            self.hours.clear();
            return;
        };
        // A lease event changes the attribution of the samples after it.
        let lease_from = match leases.removed.is_empty() {
            true => leases.added.values().map(|s| s.min_ts).min(),
            false => Some(i64::MIN),
        };
        let lease_from = lease_from.unwrap_or(i64::MAX);
        self.hours.retain(|&hour, settled| {
            let hours = [hour, hour + HOUR_MS];
            let sample_from = hours
                .iter()
                .filter_map(|h| samples.added.get(h))
                .map(|s| s.min_ts)
                .min()
                .unwrap_or(i64::MAX);
            settled.cut <= lease_from
                && settled.cut <= sample_from
                && !hours.iter().any(|h| samples.removed.contains(h))
        });
    }
}

impl Rollup {
    /// A rollup of `lake`.
    pub fn new(lake: Lake, options: RollupOptions) -> Self {
        Self {
            lake,
            options,
            migrated: Arc::default(),
            kept: Arc::default(),
        }
    }

    fn dir(&self) -> PathBuf {
        self.lake.root().join(tables::DIR)
    }

    /// Computes every hour that needs it (see the module documentation). Idempotent: a second
    /// run with no new data computes only the hours that are not final yet.
    pub async fn run(&self) -> Result<Report, RollupError> {
        let started = Instant::now();
        std::fs::create_dir_all(self.dir()).map_err(|source| LakeError::Io {
            action: "creating",
            path: self.dir(),
            source,
        })?;
        let Some(lock) = self.lake.try_lock(Role::Rollups)? else {
            return Err(RollupError::Busy(self.lake.lock_location(Role::Rollups)));
        };
        // An hour replaced here before the migration compared it would be compared against
        // the wrong rows, and its old file would then be kept forever.
        if !self.migrated.load(std::sync::atomic::Ordering::Relaxed) {
            let mut unmigrated =
                crate::migrate::raw_tables_to_migrate(&self.lake).map_err(|e| LakeError::Io {
                    action: "looking for files of the layout before Delta in",
                    path: PathBuf::from(self.lake.location()),
                    source: std::io::Error::other(e.to_string()),
                })?;
            unmigrated.extend(migrate::tables_with_old_files(&self.lake)?);
            if !unmigrated.is_empty() {
                return Err(RollupError::NotMigrated {
                    tables: unmigrated.join(", "),
                    lake: self.lake.location(),
                });
            }
            // Every table is of this build's layout now: a lake without its marker gets it.
            self.lake.mark_layout()?;
            self.migrated
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }

        let ctx = SessionContext::new();
        self.lake.register_object_store(&ctx);
        let state_path = Path::new(tables::DIR).join("_state.json");
        let (mut state, mut version) = State::load(&self.lake, &state_path)?;
        // The hours with new rows since the last run, from the commits after the versions it
        // read (all of them the first time, or when the log no longer reaches back).
        let delta = self.lake.delta();
        let samples_name = Table::Samples.name();
        let leases_name = Table::LeaseEvents.name();
        let changed_samples = delta
            .changes(samples_name, state.read.get(samples_name).copied())
            .await?;
        let changed_leases = delta
            .changes(leases_name, state.read.get(leases_name).copied())
            .await?;
        // What the last run of this process kept, if it read up to the versions these changes
        // start from.
        let mut kept = self
            .kept
            .lock()
            .expect("the kept partials' lock")
            .take()
            .filter(|kept| kept.read == state.read)
            .unwrap_or_default();
        // A table not created yet has no changes; one whose log does not say has any.
        fn said<'a>(
            changes: &'a Option<(u64, Option<Changes>)>,
            none: &'a Changes,
        ) -> Option<&'a Changes> {
            match changes {
                None => Some(none),
                Some((_, changes)) => changes.as_ref(),
            }
        }
        let none = Changes::default();
        kept.invalidate(said(&changed_samples, &none), said(&changed_leases, &none));
        let samples = delta.pinned(samples_name, &Table::Samples.schema()).await?;
        // Each hour's files, from one version: an hour is read from its files alone, as their
        // names say, without planning over every file of the table.
        let mut hour_files: BTreeMap<i64, Vec<DataFile>> = BTreeMap::new();
        if let Some(files) = delta.files(samples_name, AsOf::Latest).await? {
            for file in files.files {
                if let Some(hour) = file.hour_ms {
                    hour_files.entry(hour).or_default().push(file);
                }
            }
        }
        let sample_hours: BTreeSet<i64> = hour_files.keys().copied().collect();
        // Every hour with samples, when the log does not say which changed.
        let marked_samples: BTreeMap<i64, Span> = match &changed_samples {
            Some((_, Some(changes))) => changes.added.clone(),
            Some((_, None)) => sample_hours.iter().map(|&h| (h, Span::UNKNOWN)).collect(),
            None => BTreeMap::new(),
        };
        match samples {
            Some((_, table)) => {
                ctx.register_table("samples", table)?;
            }
            None => {
                ctx.register_table(
                    "samples",
                    Arc::new(MemTable::try_new(Table::Samples.schema(), vec![vec![]])?),
                )?;
            }
        }
        let leases = Leases::from_events(self.lease_events(&ctx).await?);
        // A lease event changes attribution from its own time on: the earliest hour with new
        // ones, every hour when the log does not say.
        let marked_leases: Vec<i64> = match &changed_leases {
            Some((_, Some(changes))) => changes.added.keys().copied().take(1).collect(),
            Some((_, None)) => vec![i64::MIN],
            None => Vec::new(),
        };
        let hosts_path = Path::new(tables::DIR).join("_hosts.json");
        let (hosts, now, mut hosts_version, mig) = self
            .hosts(
                &ctx,
                &hosts_path,
                &marked_samples,
                &hour_files,
                state.mig.is_none(),
            )
            .await?;
        state.mig.get_or_insert_default().extend(mig);
        let ceiling = now.saturating_add(self.options.max_skew_ms);
        // A host is seen only when a run reads its new samples: one run apart is not silence.
        let since_last_run = state
            .last_run
            .map_or(0, |last| now.saturating_sub(last).max(0));
        let silence = self.options.idle_ms.max(since_last_run.saturating_mul(2));
        let fleet = fleet_watermark(&hosts, ceiling, self.options.idle_ms, silence);
        state.last_run = Some(now);
        // Never back: a host that joins behind the rest does not undo hours already charged.
        // A lease event from a wrong clock is no more the fleet's time than a sample.
        let lease_max = leases.max_ts().filter(|ts| *ts <= ceiling || fleet.ahead);
        let previous = state.watermark.filter(|ts| *ts <= ceiling || fleet.ahead);
        let watermark = fleet.watermark.max(lease_max).max(previous);
        lock.check("writing the leases")?;
        self.write_leases(&leases).await?;
        let Some(watermark) = watermark else {
            return Ok(Report {
                elapsed: started.elapsed(),
                ..Report::default()
            });
        };
        state.watermark = Some(watermark);

        // A sample's interval may begin in the hour before its own: that hour holds part of
        // its time, and is computed again when the sample lands.
        let mut candidates: BTreeSet<i64> = sample_hours
            .iter()
            .flat_map(|&h| [h - HOUR_MS, h])
            .collect();
        candidates.extend(leases.allocated_hours(watermark));
        let mut todo = state.pending.clone();
        todo.extend(
            candidates
                .iter()
                .filter(|h| state.hours.get(h) != Some(&true)),
        );
        // The hour before a sample's own holds the part of its interval that reaches back.
        todo.extend(marked_samples.iter().flat_map(|(&h, span)| {
            [(span.min_start < h).then_some(h - HOUR_MS), Some(h)]
                .into_iter()
                .flatten()
        }));
        if let Some(&from) = marked_leases.first() {
            todo.extend(candidates.range(from..));
            todo.extend(state.hours.range(from..).map(|(h, _)| *h));
        }
        // An hour recorded final that the watermark has not passed was finalized by a wrong
        // one (a lake rolled up before the clock's bounds): computed again, it is corrected,
        // or removed when nothing is left in it.
        todo.extend(state.hours.iter().filter_map(|(&hour, &is_final)| {
            (is_final && watermark < hour + HOUR_MS + self.options.lateness_ms).then_some(hour)
        }));
        state.pending.clone_from(&todo);
        // The hosts' times are saved before the versions they were read up to.
        save_hosts(&self.lake, &hosts_path, &fleet.kept, &mut hosts_version)?;
        for (name, changed) in [
            (samples_name, &changed_samples),
            (leases_name, &changed_leases),
        ] {
            if let Some((read, _)) = changed {
                state.read.insert(name.to_string(), *read);
            }
        }
        state.save(&self.lake, &state_path, &mut version, &lock)?;

        let known = MemTable::try_new(tables::known_leases(), vec![vec![leases.known_batch()?]])?;
        ctx.register_table("known_leases", Arc::new(known))?;
        // Samples up to here are taken as settled: the hours keep their partials.
        let cut = watermark.saturating_sub(self.options.settle_ms);
        let mut keep = Kept::default();
        let mut report = Report {
            watermark: Some(watermark),
            hosts: fleet.kept.len(),
            leases: leases.len(),
            ..Report::default()
        };
        let (mut last_save, mut last_log) = (Instant::now(), Instant::now());
        for (done, &hour) in todo.iter().enumerate() {
            let is_final = watermark >= hour + HOUR_MS + self.options.lateness_ms;
            lock.check("rolling up an hour")?;
            let settled = kept.hours.remove(&hour);
            report.incremental_hours += usize::from(settled.is_some());
            let mig = state.mig.as_ref().expect("set above");
            let (team_rows, settled) = self
                .hour(
                    &ctx,
                    &leases,
                    &hour_files,
                    mig,
                    hour,
                    watermark,
                    settled,
                    cut,
                )
                .await?;
            report.team_rows += team_rows;
            if !is_final {
                keep.hours.insert(hour, settled);
            }
            report.hours += 1;
            report.final_hours += usize::from(is_final);
            if candidates.contains(&hour) {
                state.hours.insert(hour, is_final);
            } else {
                // No samples, no allocation: the hour holds nothing and needs no record.
                state.hours.remove(&hour);
            }
            state.pending.remove(&hour);
            if last_save.elapsed() > Duration::from_secs(5) {
                state.save(&self.lake, &state_path, &mut version, &lock)?;
                last_save = Instant::now();
            }
            if last_log.elapsed() > Duration::from_secs(5) {
                tracing::info!(
                    done = done + 1,
                    total = todo.len(),
                    hour = %hour_partition(hour),
                    "rolling up"
                );
                last_log = Instant::now();
            }
        }
        state.save(&self.lake, &state_path, &mut version, &lock)?;
        keep.read.clone_from(&state.read);
        *self.kept.lock().expect("the kept partials' lock") = Some(keep);
        // The files the tables' commits removed are kept for as-of reads, and deleted once
        // older than the tables keep them.
        for table in RollupTable::ALL {
            // Migrated (checked above): every file of the table's directory is the log's.
            match self.lake.delta().vacuum(&table.dir(), true).await {
                Ok(0) => {}
                Ok(deleted) => {
                    tracing::info!(table = table.name(), deleted, "vacuumed a rollup table")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not vacuum a rollup table; the next run tries again")
                }
            }
        }
        report.elapsed = started.elapsed();
        drop(lock);
        Ok(report)
    }

    /// Every lease event of the table's latest version.
    async fn lease_events(&self, ctx: &SessionContext) -> Result<Vec<LeaseEvent>, RollupError> {
        let name = Table::LeaseEvents.name();
        let Some((_, table)) = self
            .lake
            .delta()
            .pinned(name, &Table::LeaseEvents.schema())
            .await?
        else {
            return Ok(Vec::new());
        };
        ctx.register_table(name, table)?;
        let batches = ctx.table(name).await?.collect().await?;
        ctx.deregister_table(name)?;
        let mut events = Vec::new();
        for batch in &batches {
            events.extend(LeaseEvent::from_record_batch(batch)?);
        }
        Ok(events)
    }

    /// Each host's latest sample time and when this rollup first saw it (on its clock): the
    /// last run's (`_hosts.json`), updated from the hours marked since; read from every sample
    /// when there is no file yet, or when `every` sample is asked for. With the shapes of the
    /// MIG devices in the samples read.
    async fn hosts(
        &self,
        ctx: &SessionContext,
        path: &Path,
        marked: &BTreeMap<i64, Span>,
        hour_files: &BTreeMap<i64, Vec<DataFile>>,
        every: bool,
    ) -> Result<(Hosts, i64, StateVersion, MigShapes), RollupError> {
        let (known, version) = load_hosts(&self.lake, path)?;
        // The new samples: the files of the hours with new rows (every sample, the first time).
        let table = match &known {
            Some(_) if !every => {
                // The files of the hours with new rows that can hold them.
                let files: Vec<&str> = marked
                    .iter()
                    .filter_map(|(h, span)| Some((hour_files.get(h)?, span.min_ts)))
                    .flat_map(|(files, from)| files.iter().filter(move |f| reaches(f, from)))
                    .map(|f| f.path.as_str())
                    .collect();
                self.lake.delta().register_files(
                    ctx,
                    "host_samples",
                    Table::Samples.name(),
                    &files,
                    Table::Samples.schema(),
                )?;
                "host_samples"
            }
            _ => "samples",
        };
        let mut hosts = known.unwrap_or_default();
        let batches = ctx
            .sql(&format!(
                "SELECT CAST(host AS VARCHAR), max(ts_ms) FROM {table} GROUP BY host"
            ))
            .await?
            .collect()
            .await?;
        let mig = mig_shapes(ctx, table).await?;
        if table == "host_samples" {
            ctx.deregister_table(table)?;
        }
        // Read after the scan: files that landed during it are not from the future.
        let now = self.options.clock.now_ms();
        clamp_seen(&mut hosts, now);
        for batch in &batches {
            let names = cast(batch.column(0), &arrow_schema::DataType::Utf8)?;
            let names = names
                .as_any()
                .downcast_ref::<arrow_array::StringArray>()
                .ok_or_else(|| DataFusionError::Internal("host is not text".into()))?;
            let latest = batch
                .column(1)
                .as_any()
                .downcast_ref::<arrow_array::Int64Array>()
                .ok_or_else(|| DataFusionError::Internal("max(ts_ms) is not Int64".into()))?;
            for i in 0..batch.num_rows() {
                if !(arrow_array::Array::is_valid(names, i)
                    && arrow_array::Array::is_valid(latest, i))
                {
                    continue;
                }
                let ts = latest.value(i);
                match hosts.get_mut(names.value(i)) {
                    Some((known, seen)) if ts > *known => (*known, *seen) = (ts, now),
                    Some(_) => {}
                    None => {
                        hosts.insert(names.value(i).to_string(), (ts, now));
                    }
                }
            }
        }
        Ok((hosts, now, version, mig))
    }

    /// Replaces every row of `leases` in one commit.
    async fn write_leases(&self, leases: &Leases) -> Result<(), RollupError> {
        let table = RollupTable::Leases;
        let batch = if leases.is_empty() {
            None
        } else {
            Some(leases.to_batch()?)
        };
        self.lake
            .delta()
            .replace(&table.dir(), &table.schema(), None, batch.as_ref())
            .await?;
        Ok(())
    }

    /// Computes one hour and rewrites its files; returns its `team_hourly` rows and its
    /// partials over the samples before `cut` (or before the cut `settled` was kept at, if
    /// that is later), for the next run. With `settled`, only the samples from its cut on are
    /// read.
    #[allow(clippy::too_many_arguments)]
    async fn hour(
        &self,
        ctx: &SessionContext,
        leases: &Leases,
        hour_files: &BTreeMap<i64, Vec<DataFile>>,
        mig: &MigShapes,
        hour: i64,
        watermark: i64,
        settled: Option<Settled>,
        cut: i64,
    ) -> Result<(usize, Settled), RollupError> {
        let is_final = watermark >= hour + HOUR_MS + self.options.lateness_ms;
        let Settled {
            cut: from,
            partials: mut before,
        } = settled.unwrap_or(Settled {
            cut: hour,
            partials: Partials::default(),
        });
        let cut = cut.max(from);
        // A sample's interval may begin in the hour before its own (never earlier: intervals
        // are at most an hour), so the hour's time is in its own files and the next hour's.
        replace(ctx, "hour_samples", None)?;
        let files: Vec<&DataFile> = [hour, hour + HOUR_MS]
            .iter()
            .filter_map(|h| hour_files.get(h))
            .flatten()
            .filter(|f| reaches(f, from))
            .collect();
        // The rows the files' statistics count: what decides whether the hour is computed in
        // parts, without a scan.
        let rows: Option<usize> = files.iter().map(|f| f.rows.map(|r| r as usize)).sum();
        let files: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
        self.lake.delta().register_files(
            ctx,
            "hour_samples",
            Table::Samples.name(),
            &files,
            Table::Samples.schema(),
        )?;
        replace(
            ctx,
            "hour_allocation",
            Some(memtable(leases.allocation_batch(
                hour,
                watermark,
                &|uuid| mig.share(&self.options.pricing, uuid),
            )?)?),
        )?;

        let (settling, after) = self.partials(ctx, leases, hour, from, cut, rows).await?;
        before.merge(&settling);
        let mut partials = before.clone();
        partials.merge(&after);
        replace(ctx, "partials", Some(memtable(partials.to_batch()?)?))?;
        // In this order: `team_hourly` and `focus_costs` read `lease_hourly`'s rows.
        let pricing = &self.options.pricing;
        let query = |table: RollupTable| table.query(pricing).expect("an hourly table's query");
        let gpu = run(ctx, &query(RollupTable::GpuHourly)).await?;
        let lease_rows = run(ctx, &query(RollupTable::LeaseHourly)).await?;
        replace(ctx, "lease_rows", Some(lease_rows.table()?))?;
        let team = run(ctx, &query(RollupTable::TeamHourly)).await?;
        let focus = run(ctx, &query(RollupTable::FocusCosts)).await?;

        let write = |table: RollupTable, rows: Rows| async move {
            let filled = table.filled(hour, is_final, pricing);
            self.write_hour(table, hour, &rows.batches, &filled).await
        };
        write(RollupTable::GpuHourly, gpu).await?;
        write(RollupTable::LeaseHourly, lease_rows).await?;
        let team_rows = write(RollupTable::TeamHourly, team).await?;
        write(RollupTable::FocusCosts, focus).await?;
        Ok((
            team_rows,
            Settled {
                cut,
                partials: before,
            },
        ))
    }

    /// The partials ([`attribute`]) of the samples in `hour_samples` with `ts_ms` from `from`
    /// on: of those before `cut`, and of the others. At once when there are at most
    /// `part_rows` sample rows, else a part at a time: attribution is per sample and
    /// deduplication per GPU, so the samples are split by GPU into parts of about `part_rows`
    /// rows (spilled to `rollups/_tmp/`), each part attributed alone, and the parts' partials
    /// added: memory follows a part, not the hour.
    async fn partials(
        &self,
        ctx: &SessionContext,
        leases: &Leases,
        hour: i64,
        from: i64,
        cut: i64,
        rows: Option<usize>,
    ) -> Result<(Partials, Partials), RollupError> {
        let (pricing, options) = (&self.options.pricing, &self.options);
        let measure = |lease: &leases::Lease| options.idle_measure(lease.identity.workload);
        let rows = match rows {
            Some(rows) => rows,
            None => count(ctx, "hour_samples").await?,
        };
        let parts = rows.div_ceil(self.options.part_rows.max(1));
        // Intervals are at most an hour: no sample after the next hour reaches into this one.
        let query = format!(
            "SELECT {} FROM hour_samples WHERE ts_ms >= {from} AND ts_ms < {}",
            attribute::COLUMNS,
            hour + 2 * HOUR_MS
        );
        if parts <= 1 {
            let mut attributor = Attributor::new(hour, pricing, measure, cut, leases);
            let mut stream = ctx.sql(&query).await?.execute_stream().await?;
            while let Some(batch) = stream.next().await {
                attributor.add(&batch?)?;
            }
            return Ok(attributor.finish());
        }
        let started = Instant::now();
        let dir = self.dir().join(TMP);
        let spill = parts::split(ctx, &query, parts, &dir).await?;
        let (mut before, mut after) = (Partials::default(), Partials::default());
        for part in 0..parts {
            let mut attributor = Attributor::new(hour, pricing, measure, cut, leases);
            for batch in spill.read(part)? {
                attributor.add(&batch?)?;
            }
            let (b, a) = attributor.finish();
            before.merge(&b);
            after.merge(&a);
        }
        drop(spill);
        tracing::debug!(
            hour = %hour_partition(hour),
            rows,
            parts,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "rolled up an hour in parts"
        );
        Ok((before, after))
    }

    /// Replaces one hour of `table` with `batches` (removes it when they have no rows), in
    /// one commit; returns the rows.
    async fn write_hour(
        &self,
        table: RollupTable,
        hour: i64,
        batches: &[RecordBatch],
        constants: &[(&str, ScalarValue)],
    ) -> Result<usize, RollupError> {
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        let batch = if rows == 0 {
            None
        } else {
            let batch = concat_batches(&batches[0].schema(), batches)?;
            Some(crate::delta::conform(&table.schema(), &batch, constants)?)
        };
        self.lake
            .delta()
            .replace(
                &table.dir(),
                &table.schema(),
                table.hour_column().map(|column| (column, hour)),
                batch.as_ref(),
            )
            .await?;
        Ok(rows)
    }
}

/// The shapes of the MIG devices (samples with a `mig_profile`) in `table`.
async fn mig_shapes(ctx: &SessionContext, table: &str) -> Result<MigShapes, RollupError> {
    let batches = ctx
        .sql(&format!(
            "SELECT DISTINCT CAST(gpu_uuid AS VARCHAR), CAST(mig_profile AS VARCHAR), \
             mig_slices, mig_parent_slices FROM {table} WHERE mig_profile IS NOT NULL"
        ))
        .await?
        .collect()
        .await?;
    let mut shapes = MigShapes::default();
    for batch in &batches {
        use arrow_array::cast::AsArray as _;
        let text = |i: usize| cast(batch.column(i), &arrow_schema::DataType::Utf8);
        let int = |i: usize| cast(batch.column(i), &arrow_schema::DataType::Int64);
        let (uuids, profiles, slices, parents) = (text(0)?, text(1)?, int(2)?, int(3)?);
        let (uuids, profiles) = (uuids.as_string::<i32>(), profiles.as_string::<i32>());
        let slices = slices.as_primitive::<arrow_array::types::Int64Type>();
        let parents = parents.as_primitive::<arrow_array::types::Int64Type>();
        let count = |c: &arrow_array::Int64Array, i: usize| {
            arrow_array::Array::is_valid(c, i)
                .then(|| u32::try_from(c.value(i)).ok())
                .flatten()
        };
        for i in 0..batch.num_rows() {
            if arrow_array::Array::is_null(uuids, i) || arrow_array::Array::is_null(profiles, i) {
                continue;
            }
            shapes
                .0
                .entry(uuids.value(i).to_string())
                .or_default()
                .insert(MigShape {
                    profile: profiles.value(i).to_string(),
                    slices: count(slices, i),
                    parent_slices: count(parents, i),
                });
        }
    }
    Ok(shapes)
}

fn replace(
    ctx: &SessionContext,
    name: &str,
    table: Option<MemTable>,
) -> Result<(), DataFusionError> {
    ctx.deregister_table(name)?;
    if let Some(table) = table {
        ctx.register_table(name, Arc::new(table))?;
    }
    Ok(())
}

/// A query's result: its schema (which an empty result has too) and its rows.
struct Rows {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
}

impl Rows {
    fn table(&self) -> Result<MemTable, DataFusionError> {
        MemTable::try_new(Arc::clone(&self.schema), vec![self.batches.clone()])
    }
}

/// The rows of `table`, from the Parquet footers where it is files.
async fn count(ctx: &SessionContext, table: &str) -> Result<usize, RollupError> {
    let batches = ctx
        .sql(&format!("SELECT count(*) FROM {table}"))
        .await?
        .collect()
        .await?;
    let count = batches
        .first()
        .filter(|batch| batch.num_rows() == 1)
        .and_then(|batch| {
            batch
                .column(0)
                .as_any()
                .downcast_ref::<arrow_array::Int64Array>()
        })
        .map(|counts| counts.value(0))
        .ok_or_else(|| DataFusionError::Internal(format!("count(*) of {table} has no row")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

async fn run(ctx: &SessionContext, sql: &str) -> Result<Rows, DataFusionError> {
    let frame = ctx.sql(sql).await?;
    let planned = Arc::new(frame.schema().as_arrow().clone());
    let batches = frame.collect().await?;
    // The plan's nullability can be stricter than the batches' (greatest, least): the batches
    // say what the rows are.
    let schema = batches.first().map_or(planned, RecordBatch::schema);
    Ok(Rows { schema, batches })
}

fn memtable(batch: RecordBatch) -> Result<MemTable, DataFusionError> {
    MemTable::try_new(batch.schema(), vec![vec![batch]])
}

/// Whether `file` can hold samples with `ts_ms` from `from` on (a file without statistics can).
fn reaches(file: &DataFile, from: i64) -> bool {
    file.ts_range.is_none_or(|(_, max)| max >= from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_schema::config::GpuPrice;

    /// Each hourly table's query plans over the hour's tables, gives its rows in the columns its
    /// declaration computes in SQL, under their names, and with those the rollup fills in makes
    /// every column of the table once, each value of the column's type or one cast to it.
    #[tokio::test]
    async fn each_hourly_query_computes_the_columns_its_table_declares() {
        let ctx = SessionContext::new();
        let empty = |schema: SchemaRef| Arc::new(MemTable::try_new(schema, vec![vec![]]).unwrap());
        ctx.register_table("partials", empty(attribute::schema()))
            .unwrap();
        ctx.register_table("hour_allocation", empty(tables::allocation()))
            .unwrap();
        ctx.register_table("known_leases", empty(tables::known_leases()))
            .unwrap();
        let pricing = PricingConfig {
            gpu: vec![GpuPrice {
                model_match: "H100".into(),
                usd_per_gpu_hour: 4.0,
            }],
            ..PricingConfig::default()
        };
        let names = |fields: &arrow_schema::Fields| -> BTreeSet<String> {
            fields.iter().map(|f| f.name().clone()).collect()
        };
        for table in [
            RollupTable::GpuHourly,
            RollupTable::LeaseHourly,
            RollupTable::TeamHourly,
            RollupTable::FocusCosts,
        ] {
            let query = table.query(&pricing).unwrap();
            let planned = ctx
                .sql(&query)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}\n{query}", table.name()));
            let computed = names(planned.schema().as_arrow().fields());
            if table == RollupTable::LeaseHourly {
                let rows = Arc::new(planned.schema().as_arrow().clone());
                ctx.register_table("lease_rows", empty(rows)).unwrap();
            }
            let schema = table.schema();
            let filled = table.filled(0, false, &pricing);
            for (name, value) in &filled {
                let field = schema.field_with_name(name).unwrap();
                assert!(
                    arrow_schema::DataType::eq(&value.data_type(), field.data_type())
                        || datafusion::arrow::compute::can_cast_types(
                            &value.data_type(),
                            field.data_type()
                        ),
                    "{}.{name}",
                    table.name()
                );
            }
            let filled: BTreeSet<String> = filled.iter().map(|(n, _)| n.to_string()).collect();
            assert!(computed.is_disjoint(&filled), "{}", table.name());
            let both: BTreeSet<String> = computed.union(&filled).cloned().collect();
            assert_eq!(both, names(schema.fields()), "{}", table.name());
        }
        assert_eq!(RollupTable::Leases.query(&pricing), None);
        assert!(RollupTable::Leases.filled(0, false, &pricing).is_empty());
    }
}
