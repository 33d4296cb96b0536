//! Compaction: once an hour is final, the files of each raw table's hour are rewritten into as
//! few files as [`CompactOptions::target_file_bytes`] allows, sorted for pruning
//! (docs/ARCHITECTURE.md#compaction).
//!
//! Ingest writes one file per partition, table and hour at every flush (hundreds per hour);
//! queries over a month of them spend their time opening files. Compaction replaces an hour's
//! files by `compact-g<generation>-<n>.parquet` files and records the swap in the hour's
//! manifest, `_compaction.json`:
//!
//! - `outputs`: the files of the current generation;
//! - `superseded`: the names of the ingest files whose rows the outputs hold;
//! - `fenced_by` (in a bucket, when set): the lease generation of the compactor that last fenced
//!   the hour against an older holder's late commit (`Compactor::fence`).
//!
//! A reader ([`Manifest::shows`], applied by [`crate::versions::VersionedFs`] to every listing)
//! reads an hour as its manifest says: the current outputs, and every other file that is not a
//! `compact-g` file and not superseded. A compaction writes its outputs (hidden: not in the
//! manifest yet), then renames the new manifest into place (the one atomic step: before it the
//! hour reads as the old files, after it as the new ones), then deletes what it replaced. So a
//! crash at any point leaves every row exactly once, and the next compaction removes what the
//! crashed one left. A reader lists the hour before it reads the manifest; if the manifest names
//! an output the listing missed (a compaction committed while it listed), it lists again.
//!
//! Each output also records its compaction in its Parquet metadata (`Origin`): outputs no
//! manifest names are either a crashed run's (every file it read is still there) or a committed
//! run's whose manifest was lost since (some are gone), and in the second case the manifest is
//! rebuilt from them rather than the rows deleted (`Compactor::account_for_outputs`). An hour
//! whose manifest is damaged, or whose outputs cannot be placed, is logged, counted and skipped;
//! the other hours are compacted.
//!
//! A superseded name stays in the manifest: a file written again under that name (a replay of
//! the same Kafka offsets, or `gpuwarden ingest` of the same input) holds rows the outputs
//! already have, and stays hidden until the next compaction deletes it. Late data arrives in
//! new files, which are visible at once, and the next compaction of the hour merges them with
//! its outputs. Files of a flush whose offsets are not committed yet (named in a flush journal,
//! [`Lake::pending_files`]) are left for a later compaction: a restart may delete them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::DataFusionError;
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt as _;
use gpuwarden_schema::config::Config;
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::{KeyValue, SortingColumn};
use serde::{Deserialize, Serialize};

use crate::buffer::Table;
use crate::lake::{io, replace_durably, sync_dir, Lake, LakeError, LakeLock, Role, StateVersion};

/// The manifest of a compacted hour, in its directory.
pub const MANIFEST: &str = "_compaction.json";

/// Compacted files are named `compact-g<generation>-<n>.parquet`, and in a bucket
/// `compact-g<generation>-<n>-l<lease>.parquet`, where `<lease>` is the generation of the
/// compaction role's lease that wrote it: a holder that lost the role while uploading can then
/// never overwrite the next holder's outputs of the same hour, and what it left is a leftover.
const OUTPUT_PREFIX: &str = "compact-g";

const HOUR_MS: i64 = 3_600_000;

/// Where the sort spills and where the lock lives, under the lake root.
const WORK_DIR: &str = "_compaction";

/// What an hour's reader needs to know of its compactions ([module docs](self)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The current generation; 0 before the first compaction.
    pub generation: u64,
    /// The current generation's files.
    pub outputs: Vec<String>,
    /// Ingest files whose rows the outputs hold.
    pub superseded: BTreeSet<String>,
    /// In a bucket: the generation of the compaction role's lease whose holder last fenced the
    /// hour, before removing outputs another holder wrote and never committed
    /// (`Compactor::fence`). Readers ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced_by: Option<u64>,
}

impl Manifest {
    /// The manifest of the hour directory `dir`; the empty one when it has none.
    pub fn read(dir: &Path) -> std::io::Result<Self> {
        match fs::read(dir.join(MANIFEST)) {
            Ok(bytes) => Self::parse(&bytes, &dir.join(MANIFEST).display().to_string()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e),
        }
    }

    /// A manifest from its bytes; `at` names where they were read, for the error.
    pub fn parse(bytes: &[u8], at: &str) -> std::io::Result<Self> {
        serde_json::from_slice(bytes).map_err(|e| {
            std::io::Error::new(ErrorKind::InvalidData, format!("{at}: unreadable ({e})"))
        })
    }

    /// Whether the Parquet file `name` of the hour is part of its table.
    pub fn shows(&self, name: &str) -> bool {
        if name.starts_with(OUTPUT_PREFIX) {
            self.outputs.iter().any(|output| output == name)
        } else {
            !self.superseded.contains(name)
        }
    }

    /// A current output that `listed` (the names a listing of the hour found) lacks, if any: a
    /// compaction committed while the hour was listed, and it must be listed again (or the file
    /// is gone, and the hour damaged).
    pub fn missing_in<'a>(
        &self,
        listed: impl IntoIterator<Item = &'a str> + Clone,
    ) -> Option<&str> {
        self.outputs
            .iter()
            .find(|output| !listed.clone().into_iter().any(|name| name == *output))
            .map(String::as_str)
    }

    /// Whether a directory entry named `name` concerns compaction (a manifest or an output):
    /// a listing with none of them reads every file as it is.
    pub fn concerns(name: &str) -> bool {
        name == MANIFEST || name.starts_with(OUTPUT_PREFIX)
    }

    /// Writes the manifest into `dir` atomically: the commit point of a compaction.
    fn write(&self, dir: &Path) -> Result<(), LakeError> {
        replace_durably(
            &dir.join(format!(".{MANIFEST}.tmp")),
            &dir.join(MANIFEST),
            &serde_json::to_vec(self).expect("a manifest serializes"),
        )
    }
}

/// The Parquet key-value metadata key under which each compacted file records its [`Origin`].
const ORIGIN_KEY: &str = "gpuwarden.compaction";

/// What each compacted file records of the compaction that wrote it, so that a lost manifest
/// can be told from a crashed compaction's leftovers and rebuilt
/// ([`Compactor::account_for_outputs`]).
/// Each name is kept once (an hour may supersede hundreds of ingest files): the inputs are
/// `compacted` and `ingested`, the manifest's `superseded` after the commit is
/// `superseded_before` and `ingested`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Origin {
    /// The generation it belongs to.
    generation: u64,
    /// Rows of the whole generation (its inputs', and so its outputs' together).
    rows: u64,
    /// The previous generation's outputs it read.
    compacted: Vec<String>,
    /// The ingest files it read.
    ingested: Vec<String>,
    /// The manifest's `superseded` before it.
    superseded_before: BTreeSet<String>,
}

impl Origin {
    /// The compaction of `inputs` into `generation`, after a manifest superseding `before`.
    fn new(generation: u64, rows: u64, inputs: &[String], before: &BTreeSet<String>) -> Self {
        let (compacted, ingested) = inputs
            .iter()
            .cloned()
            .partition(|name| name.starts_with(OUTPUT_PREFIX));
        Self {
            generation,
            rows,
            compacted,
            ingested,
            superseded_before: before.clone(),
        }
    }

    /// Every file it read.
    fn inputs(&self) -> impl Iterator<Item = &String> {
        self.compacted.iter().chain(&self.ingested)
    }

    /// The manifest's `superseded` once it is committed.
    fn superseded(&self) -> BTreeSet<String> {
        let mut superseded = self.superseded_before.clone();
        superseded.extend(self.ingested.iter().cloned());
        superseded
    }
}

/// How compaction writes, and how long retention keeps each table.
#[derive(Debug, Clone)]
pub struct CompactOptions {
    /// Compact final hours (retention runs either way).
    pub enabled: bool,
    /// The tables with a retention limit, and the limit ([`crate::retention::limits`]).
    pub retention: Vec<(Table, std::time::Duration)>,
    /// A file is closed once it holds about this many bytes.
    pub target_file_bytes: u64,
    /// Rows per row group.
    pub row_group_rows: usize,
    /// Memory the sort may hold before it spills.
    pub sort_memory: u64,
    /// How long after an hour ends data may still arrive before it is final.
    pub lateness_ms: i64,
}

impl CompactOptions {
    /// From `[pipeline.compaction]` and `pipeline.lateness`.
    pub fn from_config(config: &Config) -> Self {
        let c = &config.pipeline.compaction;
        Self {
            enabled: c.enabled,
            retention: crate::retention::limits(&config.pipeline),
            target_file_bytes: c.target_file_size,
            row_group_rows: c.row_group_rows,
            sort_memory: c.sort_memory,
            lateness_ms: gpuwarden_schema::clock::duration_ms(config.pipeline.lateness),
        }
    }
}

impl Default for CompactOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            retention: Vec::new(),
            target_file_bytes: 256 << 20,
            row_group_rows: crate::lake::ROW_GROUP_ROWS,
            sort_memory: 256 << 20,
            lateness_ms: 10 * 60 * 1000,
        }
    }
}

/// A compaction that failed.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// Another compaction holds the lake's compaction lock.
    #[error("another compaction is running on this lake (it holds {0})")]
    Busy(PathBuf),
    /// A file operation failed.
    #[error(transparent)]
    Lake(#[from] LakeError),
    /// Reading or sorting the hour failed.
    #[error("compacting {dir}: {source}")]
    Query {
        /// The hour directory.
        dir: PathBuf,
        /// DataFusion's error.
        source: DataFusionError,
    },
    /// Writing a compacted file failed.
    #[error("writing {path}: {source}")]
    Parquet {
        /// The file being written.
        path: PathBuf,
        /// The encoder's error.
        source: parquet::errors::ParquetError,
    },
    /// The rows written are not the rows the inputs' footers hold; nothing was committed.
    #[error(
        "compacting {dir}: the inputs hold {read} rows but {wrote} were written; nothing was \
         committed (the next compaction removes the outputs)"
    )]
    RowsDiffer {
        /// The hour directory.
        dir: PathBuf,
        /// Rows in the inputs' footers.
        read: u64,
        /// Rows written.
        wrote: u64,
    },
    /// The hour's manifest is not readable: the hour is skipped (the others go on).
    #[error(
        "{reason}: queries over its table fail and the hour is not compacted until it is \
         fixed; restore {path} from a backup, or remove it and the next compaction rebuilds it \
         from the hour's compacted files"
    )]
    ManifestDamaged {
        /// The manifest.
        path: PathBuf,
        /// What is wrong with it, naming it.
        reason: String,
    },
    /// The hour holds compacted files no manifest names and that cannot be placed (see
    /// `Compactor::account_for_outputs`): the hour is skipped, and nothing in it deleted.
    #[error("{dir}: {detail}; the hour is left as it is until an operator decides")]
    Unaccounted {
        /// The hour directory.
        dir: PathBuf,
        /// What was found, and what to do.
        detail: String,
    },
}

impl CompactError {
    /// The label of an hour skipped for this error (`skipped_partitions_total{reason}`), if it is
    /// one that concerns its hour alone; other errors stop the run.
    fn skips_hour(&self) -> Option<SkipReason> {
        match self {
            Self::ManifestDamaged { .. } => Some(SkipReason::ManifestDamaged),
            Self::Unaccounted { .. } => Some(SkipReason::OutputsUnaccounted),
            _ => None,
        }
    }
}

/// Why compaction left an hour alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SkipReason {
    /// Its `_compaction.json` is not readable.
    ManifestDamaged,
    /// It holds compacted files neither its manifest nor their own metadata account for.
    OutputsUnaccounted,
}

impl SkipReason {
    /// Every reason, in the order of [`CompactReport::skipped`].
    pub const ALL: [SkipReason; 2] = [Self::ManifestDamaged, Self::OutputsUnaccounted];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ManifestDamaged => "manifest_damaged",
            Self::OutputsUnaccounted => "outputs_unaccounted",
        }
    }
}

/// What one compaction run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CompactReport {
    /// Hours compacted.
    pub hours: usize,
    /// Files replaced.
    pub files_in: usize,
    /// Files written.
    pub files_out: usize,
    /// Bytes of the files replaced.
    pub bytes_in: u64,
    /// Bytes written.
    pub bytes_out: u64,
    /// Rows rewritten.
    pub rows: u64,
    /// Files left by earlier compactions (replaced, or written by one that crashed) removed.
    pub leftovers_removed: usize,
    /// Lost manifests rebuilt from their outputs' metadata.
    pub manifests_rebuilt: usize,
    /// Hours left alone, by [`SkipReason`] (in the order of [`SkipReason::ALL`]).
    pub skipped: [usize; 2],
}

impl CompactReport {
    fn add(&mut self, other: &CompactReport) {
        self.hours += other.hours;
        self.files_in += other.files_in;
        self.files_out += other.files_out;
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.rows += other.rows;
        self.leftovers_removed += other.leftovers_removed;
        self.manifests_rebuilt += other.manifests_rebuilt;
        for (mine, theirs) in self.skipped.iter_mut().zip(other.skipped) {
            *mine += theirs;
        }
    }
}

/// What one [`Compactor::run`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Maintenance {
    /// Compaction.
    pub compacted: CompactReport,
    /// Retention, per table with a limit.
    pub expired: Vec<crate::retention::Expired>,
}

/// Compacts the final hours of a lake, and deletes the hours past their retention.
#[derive(Debug, Clone)]
pub struct Compactor {
    lake: Lake,
    options: CompactOptions,
}

/// The columns each table's compacted files are sorted by: what its queries filter on first.
fn sort_columns(table: Table) -> &'static [&'static str] {
    match table {
        Table::Samples => &["gpu_uuid", "ts_ms"],
        Table::LeaseEvents => &["lease_id", "ts_ms"],
        Table::Signals => &["kind", "ts_ms"],
        Table::Actions => &["ts_ms"],
        Table::Quarantine => &["topic", "partition", "offset"],
    }
}

/// A fault injected at a named step, for the tests that prove a crash or a pause anywhere loses
/// nothing: `GPUWARDEN_COMPACT_CRASH_AT=<step>` kills the process with SIGKILL when it gets
/// there; `GPUWARDEN_COMPACT_STOP_AT=<step>` stops it with SIGSTOP the first time it gets
/// there (a holder paused past its lease: the test resumes it with SIGCONT).
fn fault_point(step: &str) {
    use rustix::process::{getpid, kill_process, Signal};
    use std::sync::atomic::{AtomicBool, Ordering};
    static STOPPED: AtomicBool = AtomicBool::new(false);
    if std::env::var("GPUWARDEN_COMPACT_CRASH_AT").is_ok_and(|at| at == step) {
        tracing::warn!(step, "GPUWARDEN_COMPACT_CRASH_AT: killing the process");
        let _ = kill_process(getpid(), Signal::KILL);
    }
    if std::env::var("GPUWARDEN_COMPACT_STOP_AT").is_ok_and(|at| at == step)
        && !STOPPED.swap(true, Ordering::SeqCst)
    {
        tracing::warn!(step, "GPUWARDEN_COMPACT_STOP_AT: stopping the process");
        let _ = kill_process(getpid(), Signal::STOP);
    }
}

impl Compactor {
    /// A compactor of `lake`.
    pub fn new(lake: Lake, options: CompactOptions) -> Self {
        Self { lake, options }
    }

    /// The lake it works on.
    pub fn lake(&self) -> &Lake {
        &self.lake
    }

    /// Deletes the hours past their retention at `watermark`, then compacts every hour of every
    /// raw table that is final at it (it ended at least `lateness` before it) and has files its
    /// manifest's outputs do not account for: new ingest files, late data, or the leftovers of
    /// a compaction that crashed. The watermark is the rollups' (the event time the fleet has
    /// reached, [`rollup_watermark`]), never the wall clock: a lake of history, or a machine
    /// whose clock jumps ahead, loses nothing. Without one (no rollup has run) nothing is done.
    pub async fn run(&self, watermark: Option<i64>) -> Result<Maintenance, CompactError> {
        let Some(lock) = self.lake.try_lock(Role::Compaction)? else {
            return Err(CompactError::Busy(
                self.lake.lock_location(Role::Compaction),
            ));
        };
        let mut maintenance = Maintenance::default();
        let Some(watermark) = watermark else {
            return Ok(maintenance);
        };
        for (table, kept) in &self.options.retention {
            lock.check("deleting hours past their retention")?;
            maintenance.expired.push(crate::retention::expire(
                &self.lake, *table, *kept, watermark,
            )?);
        }
        if self.options.enabled {
            maintenance.compacted = self.compact(watermark, &lock).await?;
        }
        Ok(maintenance)
    }

    async fn compact(
        &self,
        watermark: i64,
        lock: &LakeLock,
    ) -> Result<CompactReport, CompactError> {
        let mut report = CompactReport::default();
        for table in Table::ALL {
            for hour in self.lake.hours(table.name())? {
                if hour + HOUR_MS + self.options.lateness_ms > watermark {
                    break;
                }
                lock.check("compacting an hour")?;
                match self.hour(table, hour, lock).await {
                    Ok(hour_report) => report.add(&hour_report),
                    // An hour that needs an operator does not hold the others back.
                    Err(e) => match e.skips_hour() {
                        Some(reason) => {
                            tracing::error!(
                                table = table.name(),
                                hour = %crate::lake::hour_partition(hour),
                                reason = reason.as_str(),
                                error = %e,
                                "compaction skips an hour"
                            );
                            report.skipped[reason as usize] += 1;
                        }
                        None => return Err(e),
                    },
                }
            }
        }
        Ok(report)
    }

    /// Compacts one hour of `table` if it needs it. The caller holds the compaction role.
    async fn hour(
        &self,
        table: Table,
        hour: i64,
        lock: &LakeLock,
    ) -> Result<CompactReport, CompactError> {
        // Where the outputs are written: the hour itself in a directory, its staging directory
        // (uploaded from there) in a bucket.
        let dir = self.lake.hour_dir(table.name(), hour);
        let relative_dir = PathBuf::from(table.name()).join(crate::lake::hour_partition(hour));
        let (manifest, mut version) = self.read_manifest(&relative_dir)?;
        let mut report = CompactReport::default();

        // List first, then read the flush journals: a flush's journal is written before its
        // files, so a file listed here that is not in a journal read after is committed.
        let files = self.files(&relative_dir)?;
        let names: Vec<String> = files.iter().map(|(name, _)| name.clone()).collect();
        // What the listing found is acted on only while the role is still this process's.
        lock.check("placing an hour's compacted files")?;
        let manifest = self.account_for_outputs(
            table,
            hour,
            (manifest, &mut version),
            &names,
            lock.generation(),
            &mut report,
        )?;
        let mut shown = Vec::new();
        lock.check("removing what earlier compactions left")?;
        for name in &names {
            if Manifest::concerns(name) && !manifest.outputs.contains(name) {
                // An output of a compaction that crashed before its commit, or of a generation
                // since replaced.
                report.leftovers_removed +=
                    usize::from(self.lake.remove(&relative_dir.join(name))?);
            } else if !manifest.shows(name) {
                // Superseded: its rows are in the outputs.
                report.leftovers_removed +=
                    usize::from(self.lake.remove(&relative_dir.join(name))?);
            } else {
                shown.push(name.clone());
            }
        }
        remove_temporaries(&dir)?;
        let is_new = |name: &String| !manifest.outputs.contains(name);
        if !shown.iter().any(is_new) {
            return Ok(report);
        }
        let pending = self.lake.pending_files()?;
        let inputs: Vec<String> = shown
            .into_iter()
            .filter(|name| !pending.contains(&relative_dir.join(name)))
            .collect();
        if !inputs.iter().any(is_new) {
            return Ok(report);
        }

        let started = Instant::now();
        let generation = manifest.generation + 1;
        let mut rows = 0;
        for name in &inputs {
            rows += self.footer(&relative_dir.join(name))?.0;
        }
        let origin = Origin::new(generation, rows, &inputs, &manifest.superseded);
        let written = self
            .rewrite(table, &dir, &relative_dir, &origin, lock.generation())
            .await?;
        let wrote = written.iter().map(|(_, _, rows)| rows).sum();
        if wrote != rows {
            return Err(CompactError::RowsDiffer {
                dir,
                read: rows,
                wrote,
            });
        }
        fault_point("outputs-written");

        let next = Manifest {
            generation,
            outputs: written.iter().map(|(name, _, _)| name.clone()).collect(),
            superseded: origin.superseded(),
            fenced_by: None,
        };
        let bytes_in: u64 = files
            .iter()
            .filter(|(name, _)| inputs.contains(name))
            .map(|(_, size)| size)
            .sum();
        lock.check("committing a compaction")?;
        fault_point("before-commit");
        self.write_manifest(&relative_dir, &next, &mut version)?;
        fault_point("manifest-written");

        for (i, name) in inputs.iter().enumerate() {
            self.lake.remove(&relative_dir.join(name))?;
            if i == 0 {
                fault_point("inputs-removing");
            }
        }
        report.hours = 1;
        report.files_in = inputs.len();
        report.files_out = written.len();
        report.bytes_in = bytes_in;
        report.bytes_out = written.iter().map(|(_, bytes, _)| bytes).sum();
        report.rows = written.iter().map(|(_, _, rows)| rows).sum();
        tracing::info!(
            table = table.name(),
            hour = %crate::lake::hour_partition(hour),
            generation,
            files_in = report.files_in,
            files_out = report.files_out,
            rows = report.rows,
            bytes_in,
            bytes_out = report.bytes_out,
            took_ms = started.elapsed().as_millis() as u64,
            "compacted an hour"
        );
        Ok(report)
    }

    /// Places the compacted files of `dir` that `manifest` does not name and that are newer than
    /// its generation, before anything is deleted. Such files are either what a compaction left
    /// when it crashed before its commit, or the outputs of a commit whose manifest was lost
    /// since (deleted, or restored from a backup older than the hour). Each output records its
    /// compaction ([`Origin`]), so the two are told apart: a crashed run deleted nothing, so
    /// all of its inputs are still there and hold every row (its outputs are removed); a
    /// committed one removed its inputs, so some are gone and the outputs hold the rows (the
    /// manifest is rebuilt from them, and the hour marked for the rollups, which may have read
    /// it without them). Newest generation first: a crashed run may follow a lost commit.
    /// Outputs that fit neither (no record, as written before the record existed; or fewer
    /// rows than recorded while inputs are gone) are [`CompactError::Unaccounted`]: rows may
    /// exist nowhere else, so nothing is deleted. In a bucket, a crashed run's outputs are
    /// removed only once the hour is fenced against its holder ([`Compactor::fence`]; `lease`
    /// is this holder's lease generation). Returns the manifest to go on with.
    fn account_for_outputs(
        &self,
        table: Table,
        hour: i64,
        (mut manifest, version): (Manifest, &mut StateVersion),
        names: &[String],
        lease: Option<u64>,
        report: &mut CompactReport,
    ) -> Result<Manifest, CompactError> {
        let relative_dir = PathBuf::from(table.name()).join(crate::lake::hour_partition(hour));
        let dir = &self.shown_dir(&relative_dir);
        if let Some(missing) = manifest.outputs.iter().find(|o| !names.contains(o)) {
            // Under the compaction lock nothing else commits: the manifest is not this hour's
            // (restored from a backup newer than the files), and the files it does not name
            // may be the only copy of their rows.
            return Err(CompactError::Unaccounted {
                dir: dir.to_owned(),
                detail: format!(
                    "{MANIFEST} names {missing}, which is not in the hour; restore the hour's \
                     files and its {MANIFEST} from the same backup"
                ),
            });
        }
        let mut unnamed: BTreeMap<u64, Vec<&String>> = BTreeMap::new();
        for name in names {
            if !name.starts_with(OUTPUT_PREFIX) || manifest.outputs.contains(name) {
                continue;
            }
            let Some(generation) = generation_of(name) else {
                return Err(CompactError::Unaccounted {
                    dir: dir.to_owned(),
                    detail: format!(
                        "{name} is named like a compacted file but not as compaction names them; \
                         move it out of the lake"
                    ),
                });
            };
            if generation > manifest.generation {
                unnamed.entry(generation).or_default().push(name);
            }
        }
        let present: BTreeSet<&str> = names.iter().map(String::as_str).collect();
        for (generation, outputs) in unnamed.into_iter().rev() {
            let mut origin: Option<Origin> = None;
            let mut rows = 0;
            for name in &outputs {
                let (file_rows, recorded) = self.footer(&relative_dir.join(name))?;
                rows += file_rows;
                let Some(recorded) = recorded.filter(|o| o.generation == generation) else {
                    return Err(CompactError::Unaccounted {
                        dir: dir.to_owned(),
                        detail: format!(
                            "{name} is not in {MANIFEST} and does not record which compaction \
                             wrote it (written by an older gpuwarden), so a crashed compaction's \
                             leftover cannot be told from a lost manifest's output; restore \
                             {MANIFEST} from a backup, or remove the file if every file it \
                             replaced is still in the hour"
                        ),
                    });
                };
                if origin.as_ref().is_some_and(|o| *o != recorded) {
                    return Err(CompactError::Unaccounted {
                        dir: dir.to_owned(),
                        detail: format!(
                            "the compacted files of generation {generation} record different \
                             compactions ({name} differs); restore {MANIFEST} from a backup"
                        ),
                    });
                }
                origin = Some(recorded);
            }
            let origin = origin.expect("a generation listed has outputs");
            if origin.inputs().all(|i| present.contains(i.as_str())) {
                // A compaction that crashed before its commit (or whose holder lost the role
                // before it): its inputs hold every row.
                if let Some(lease) = lease {
                    manifest = self.fence(&relative_dir, manifest, version, lease)?;
                }
                for name in outputs {
                    report.leftovers_removed +=
                        usize::from(self.lake.remove(&relative_dir.join(name))?);
                }
                continue;
            }
            if rows != origin.rows {
                return Err(CompactError::Unaccounted {
                    dir: dir.to_owned(),
                    detail: format!(
                        "{MANIFEST} is missing, some files generation {generation} replaced are \
                         gone, and its compacted files hold {rows} of its {} rows; restore \
                         {MANIFEST} and the missing compact-g{generation}-* files from a backup",
                        origin.rows
                    ),
                });
            }
            let rebuilt = Manifest {
                generation,
                outputs: outputs.into_iter().cloned().collect(),
                superseded: origin.superseded(),
                fenced_by: None,
            };
            self.write_manifest(&relative_dir, &rebuilt, version)?;
            if matches!(table, Table::Samples | Table::LeaseEvents) {
                self.lake.mark_for_recompute(table.name(), hour)?;
            }
            tracing::warn!(
                table = table.name(),
                hour = %crate::lake::hour_partition(hour),
                generation,
                outputs = rebuilt.outputs.len(),
                rows,
                lost = manifest.generation,
                "rebuilt a lost compaction manifest from its compacted files' metadata \
                 (until then queries read the hour without them)"
            );
            report.manifests_rebuilt += 1;
            return Ok(rebuilt);
        }
        Ok(manifest)
    }

    /// Reads the inputs of `origin` in `dir`, sorted by the table's sort columns, into hidden
    /// output files of `origin.generation`, each recording `origin` in its metadata; returns
    /// each file's name, bytes and rows.
    async fn rewrite(
        &self,
        table: Table,
        dir: &Path,
        relative_dir: &Path,
        origin: &Origin,
        lease: Option<u64>,
    ) -> Result<Vec<(String, u64, u64)>, CompactError> {
        let (inputs, generation): (Vec<&String>, u64) =
            (origin.inputs().collect(), origin.generation);
        let query = |source| CompactError::Query {
            dir: dir.to_owned(),
            source,
        };
        let spill = self.lake.root().join(WORK_DIR).join("tmp");
        fs::create_dir_all(&spill).map_err(io("creating", &spill))?;
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(FairSpillPool::new(
                usize::try_from(self.options.sort_memory).unwrap_or(usize::MAX),
            )))
            .with_temp_file_path(&spill)
            .build_arc()
            .map_err(query)?;
        let ctx = SessionContext::new_with_config_rt(
            SessionConfig::new().with_target_partitions(2),
            runtime,
        );
        self.lake.register_reader(&ctx);
        let urls = inputs
            .iter()
            .map(|name| {
                ListingTableUrl::parse(match self.lake.objects() {
                    Some(objects) => format!("{}{name}", objects.dir_url(relative_dir)),
                    None => dir.join(name).display().to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(query)?;
        fs::create_dir_all(dir).map_err(io("creating", dir))?;
        let schema = table.schema();
        let config = ListingTableConfig::new_with_multi_paths(urls)
            .with_listing_options(
                ListingOptions::new(Arc::new(ParquetFormat::default()))
                    .with_file_extension(".parquet"),
            )
            .with_schema(schema.clone());
        ctx.register_table(
            "hour",
            Arc::new(ListingTable::try_new(config).map_err(query)?),
        )
        .map_err(query)?;
        let order = sort_columns(table)
            .iter()
            .map(|c| format!("\"{c}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut stream = ctx
            .sql(&format!("SELECT * FROM hour ORDER BY {order}"))
            .await
            .map_err(query)?
            .execute_stream()
            .await
            .map_err(query)?;

        let sorting: Vec<SortingColumn> = sort_columns(table)
            .iter()
            .filter_map(|c| schema.index_of(c).ok())
            .map(|i| SortingColumn {
                column_idx: i32::try_from(i).expect("a schema has few columns"),
                descending: false,
                nulls_first: false,
            })
            .collect();
        let props = crate::lake::writer_properties(&schema, self.options.row_group_rows)
            .set_sorting_columns(Some(sorting))
            .set_key_value_metadata(Some(vec![KeyValue::new(
                ORIGIN_KEY.to_owned(),
                serde_json::to_string(origin).expect("an origin serializes"),
            )]))
            .build();
        let mut written = Vec::new();
        let mut current: Option<(String, PathBuf, ArrowWriter<fs::File>, u64)> = None;
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(query)?;
            if batch.num_rows() == 0 {
                continue;
            }
            if current.is_none() {
                let lease = lease.map(|l| format!("-l{l}")).unwrap_or_default();
                let name = format!(
                    "{OUTPUT_PREFIX}{generation}-{:04}{lease}.parquet",
                    written.len()
                );
                let tmp = dir.join(format!(".{name}.tmp"));
                let file = fs::File::create(&tmp).map_err(io("creating", &tmp))?;
                let writer = ArrowWriter::try_new(file, schema.clone(), Some(props.clone()))
                    .map_err(|source| CompactError::Parquet {
                        path: tmp.clone(),
                        source,
                    })?;
                current = Some((name, tmp, writer, 0));
            }
            let (_, tmp, writer, rows) = current.as_mut().expect("opened above");
            writer
                .write(&batch)
                .map_err(|source| CompactError::Parquet {
                    path: tmp.clone(),
                    source,
                })?;
            *rows += batch.num_rows() as u64;
            if (writer.bytes_written() + writer.in_progress_size()) as u64
                >= self.options.target_file_bytes
            {
                let (name, tmp, writer, rows) = current.take().expect("opened above");
                written.push(self.finish(dir, relative_dir, name, tmp, writer, rows)?);
            }
        }
        if let Some((name, tmp, writer, rows)) = current.take() {
            written.push(self.finish(dir, relative_dir, name, tmp, writer, rows)?);
        }
        if self.lake.objects().is_none() {
            sync_dir(dir)?;
        }
        Ok(written)
    }

    /// Closes a compacted file and puts it in the hour, hidden until the manifest names it:
    /// renamed into its directory, or uploaded to the bucket (and the local file removed).
    fn finish(
        &self,
        dir: &Path,
        relative_dir: &Path,
        name: String,
        tmp: PathBuf,
        writer: ArrowWriter<fs::File>,
        rows: u64,
    ) -> Result<(String, u64, u64), CompactError> {
        let file = writer
            .into_inner()
            .map_err(|source| CompactError::Parquet {
                path: tmp.clone(),
                source,
            })?;
        file.sync_all().map_err(io("syncing", &tmp))?;
        let bytes = file.metadata().map_err(io("reading", &tmp))?.len();
        drop(file);
        if let Some(objects) = self.lake.objects() {
            objects.put_file(&relative_dir.join(&name), &tmp)?;
            fs::remove_file(&tmp).map_err(io("removing", &tmp))?;
        } else {
            let path = dir.join(&name);
            fs::rename(&tmp, &path).map_err(io("renaming into", &path))?;
        }
        Ok((name, bytes, rows))
    }

    /// Where the hour `relative_dir` is, for messages: its directory, or its URL in the bucket.
    fn shown_dir(&self, relative_dir: &Path) -> PathBuf {
        match self.lake.objects() {
            Some(objects) => PathBuf::from(objects.dir_url(relative_dir)),
            None => self.lake.root().join(relative_dir),
        }
    }

    /// The hour's manifest (the empty one when it has none) and the version read.
    fn read_manifest(&self, relative_dir: &Path) -> Result<(Manifest, StateVersion), CompactError> {
        let relative = relative_dir.join(MANIFEST);
        let path = self.shown_dir(relative_dir).join(MANIFEST);
        let damaged = |e: std::io::Error| CompactError::ManifestDamaged {
            path: path.clone(),
            reason: e.to_string(),
        };
        match self.lake.read_state(&relative)? {
            None => Ok((Manifest::default(), StateVersion::default())),
            Some((bytes, version)) => Manifest::parse(&bytes, &path.display().to_string())
                .map(|manifest| (manifest, version))
                .map_err(damaged),
        }
    }

    /// Writes the hour's manifest: the commit of a compaction. In a directory, renamed into
    /// place; in a bucket, a conditional PUT on the version read, refused (as
    /// [`LakeError::Deposed`]) when another process wrote it since.
    fn write_manifest(
        &self,
        relative_dir: &Path,
        manifest: &Manifest,
        version: &mut StateVersion,
    ) -> Result<(), CompactError> {
        if self.lake.objects().is_none() {
            return Ok(manifest.write(&self.lake.root().join(relative_dir))?);
        }
        let bytes = serde_json::to_vec(manifest).expect("a manifest serializes");
        self.lake.write_state(
            &relative_dir.join(MANIFEST),
            bytes,
            version,
            Role::Compaction,
        )?;
        Ok(())
    }

    /// Fences the hour in a bucket against a holder of the compaction role that lost it while
    /// compacting the hour and has not noticed yet (paused, say, between its last check of the
    /// lease and its commit): rewrites `manifest` as read, marked with this holder's `lease`
    /// generation, conditional on `version`. That holder's commit is a write conditional on the
    /// version it read, the same or an older one, so once this lands its commit is refused, and
    /// its outputs may be removed without leaving a manifest that names files no longer there.
    /// If its commit landed first, this write is refused ([`LakeError::Deposed`]): nothing is
    /// removed, and the next run reads the hour as that commit left it.
    fn fence(
        &self,
        relative_dir: &Path,
        manifest: Manifest,
        version: &mut StateVersion,
        lease: u64,
    ) -> Result<Manifest, CompactError> {
        if manifest.fenced_by == Some(lease) {
            // Fenced by this holder already: a body written again would keep its ETag.
            return Ok(manifest);
        }
        let fenced = Manifest {
            fenced_by: Some(lease),
            ..manifest
        };
        self.write_manifest(relative_dir, &fenced, version)?;
        Ok(fenced)
    }

    /// The hour's Parquet files (not temporaries): names, sorted, and sizes.
    fn files(&self, relative_dir: &Path) -> Result<Vec<(String, u64)>, LakeError> {
        let mut files = match self.lake.objects() {
            Some(objects) => objects
                .list_dir(relative_dir)?
                .into_iter()
                .filter(|(name, _)| name.ends_with(".parquet") && !name.starts_with('.'))
                .collect(),
            None => {
                let dir = self.lake.root().join(relative_dir);
                let mut files = Vec::new();
                for name in parquet_names(&dir)? {
                    let size = fs::metadata(dir.join(&name)).map_or(0, |m| m.len());
                    files.push((name, size));
                }
                files
            }
        };
        files.sort_unstable();
        Ok(files)
    }

    /// A Parquet file's rows, and the compaction it records, if it is a compacted file.
    fn footer(&self, relative: &Path) -> Result<(u64, Option<Origin>), CompactError> {
        match self.lake.objects() {
            Some(objects) => Ok(origin_of(
                objects.parquet_metadata(relative)?.file_metadata(),
            )),
            None => footer(&self.lake.root().join(relative)),
        }
    }
}

/// The generation in a compacted file's name (`compact-g<generation>-<n>.parquet`, or in a
/// bucket `compact-g<generation>-<n>-l<lease>.parquet`).
fn generation_of(name: &str) -> Option<u64> {
    let rest = name.strip_prefix(OUTPUT_PREFIX)?.strip_suffix(".parquet")?;
    let (generation, n) = rest.split_once('-')?;
    let n = match n.split_once("-l") {
        Some((n, lease)) => {
            lease.parse::<u64>().ok()?;
            n
        }
        None => n,
    };
    n.parse::<u32>().ok()?;
    generation.parse().ok()
}

/// A Parquet file's rows, and the compaction it records, if it is a compacted file.
fn footer(path: &Path) -> Result<(u64, Option<Origin>), CompactError> {
    use parquet::file::reader::{FileReader as _, SerializedFileReader};
    let parquet = |source| CompactError::Parquet {
        path: path.to_owned(),
        source,
    };
    let file = fs::File::open(path).map_err(io("opening", path))?;
    let reader = SerializedFileReader::new(file).map_err(parquet)?;
    Ok(origin_of(reader.metadata().file_metadata()))
}

/// The rows a Parquet file's metadata declares, and the compaction it records.
fn origin_of(meta: &parquet::file::metadata::FileMetaData) -> (u64, Option<Origin>) {
    let origin = meta
        .key_value_metadata()
        .into_iter()
        .flatten()
        .find(|kv| kv.key == ORIGIN_KEY)
        .and_then(|kv| serde_json::from_str(kv.value.as_deref()?).ok());
    (u64::try_from(meta.num_rows()).unwrap_or(0), origin)
}

/// The Parquet files of an hour directory, by name.
fn parquet_names(dir: &Path) -> Result<Vec<String>, LakeError> {
    let mut names = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(names),
        Err(e) => return Err(io("listing", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io("listing", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".parquet") && !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort_unstable();
    Ok(names)
}

/// Removes the temporary files a crashed compaction left in `dir` (never an ingest flush's).
fn remove_temporaries(dir: &Path) -> Result<(), LakeError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        // A bucket's hour with nothing staged.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("listing", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io("listing", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if (name.starts_with(&format!(".{OUTPUT_PREFIX}")) || name == format!(".{MANIFEST}.tmp"))
            && name.ends_with(".tmp")
        {
            match fs::remove_file(entry.path()) {
                Err(e) if e.kind() != ErrorKind::NotFound => {
                    return Err(io("removing", &entry.path())(e));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// The watermark of the rollups' last run (`<lake>/rollups/_state.json`): the event time
/// compaction and the pipeline agree an hour is final at.
pub fn rollup_watermark(lake: &Lake) -> Option<i64> {
    #[derive(Deserialize)]
    struct State {
        watermark: Option<i64>,
    }
    let path = Path::new(crate::rollup::tables::DIR).join("_state.json");
    let (bytes, _) = lake.read_state(&path).ok()??;
    serde_json::from_slice::<State>(&bytes).ok()?.watermark
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_schema::{Record as _, Sample};

    const T0: i64 = 1_767_225_600_000;

    fn samples(gpus: std::ops::Range<usize>, from: i64, count: i64) -> Vec<Sample> {
        let mut out = Vec::new();
        for i in 0..count {
            for gpu in gpus.clone() {
                out.push(
                    serde_json::from_value(serde_json::json!({
                        "v": 1, "ts_ms": from + i * 5_000, "interval_ms": 5000,
                        "host": format!("node-{}", gpu / 8), "gpu_uuid": format!("GPU-{gpu:04}"),
                        "gpu_model": "NVIDIA A100-SXM4-80GB", "util_gpu_pct": (gpu * 7 % 100) as f64,
                        "mem_used_bytes": 1u64 << 30, "mem_total_bytes": 85899345920u64
                    }))
                    .unwrap(),
                );
            }
        }
        // Arrival order, not sorted.
        out.reverse();
        out
    }

    fn write(lake: &Lake, name: &str, rows: &[Sample]) -> PathBuf {
        let relative = Lake::file_name(
            "samples",
            T0,
            name,
            0,
            rows.len() as i64,
            crate::buffer::ContentDigest(0),
        );
        lake.write(
            &relative,
            &Sample::to_record_batch(rows).unwrap(),
            "samples",
            T0,
        )
        .unwrap();
        relative
    }

    fn query(lake: &Lake, sql: &str) -> i64 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (_, batches) = runtime.block_on(crate::sql::query(lake, sql)).unwrap();
        let column =
            datafusion::arrow::compute::cast(batches[0].column(0), &arrow_schema::DataType::Int64)
                .unwrap();
        column
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap()
            .value(0)
    }

    const FIGURES: &str = "SELECT count(*) * 1000000 + count(DISTINCT gpu_uuid || ':' || \
                           CAST(ts_ms AS VARCHAR)) FROM samples";

    fn compact(lake: &Lake, options: CompactOptions) -> Maintenance {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime
            .block_on(Compactor::new(lake.clone(), options).run(Some(T0 + 10 * HOUR_MS)))
            .unwrap()
    }

    fn names(dir: &Path) -> Vec<String> {
        parquet_names(dir).unwrap()
    }

    #[test]
    fn output_names_give_their_generation_with_or_without_the_lease() {
        assert_eq!(generation_of("compact-g3-0000.parquet"), Some(3));
        assert_eq!(generation_of("compact-g12-0007-l4.parquet"), Some(12));
        assert_eq!(generation_of("compact-g12-0007-lx.parquet"), None);
        assert_eq!(generation_of("compact-g12.parquet"), None);
        assert_eq!(generation_of("samples-p0-o1-2.parquet"), None);
    }

    #[test]
    fn an_hour_is_rewritten_sorted_into_few_files_and_reads_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        for part in 0..6 {
            write(
                &lake,
                &format!("t-p{part}"),
                &samples(part * 10..part * 10 + 10, T0, 120),
            );
        }
        let before = query(&lake, FIGURES);
        assert_eq!(before, 7_200 * 1_000_000 + 7_200);

        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.hours, 1);
        assert_eq!(done.compacted.files_in, 6);
        assert_eq!(done.compacted.files_out, 1);
        assert_eq!(done.compacted.rows, 7_200);
        let hour = lake.hour_dir("samples", T0);
        assert_eq!(names(&hour), ["compact-g1-0000.parquet"]);
        assert_eq!(query(&lake, FIGURES), before);

        // Sorted by GPU, then time, and saying so in its metadata.
        let file = fs::File::open(hour.join("compact-g1-0000.parquet")).unwrap();
        let reader =
            parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
        let sorting = reader.metadata().row_group(0).sorting_columns().cloned();
        assert_eq!(sorting.map(|s| s.len()), Some(2));
        let mut previous: Option<(String, i64)> = None;
        for batch in reader.build().unwrap() {
            for sample in Sample::from_record_batch(&batch.unwrap()).unwrap() {
                let key = (sample.gpu_uuid.clone(), sample.ts_ms);
                assert!(
                    previous.as_ref().is_none_or(|p| *p < key),
                    "{key:?} after {previous:?}"
                );
                previous = Some(key);
            }
        }

        // Nothing new: nothing to do.
        let again = compact(&lake, CompactOptions::default());
        assert_eq!(again.compacted, CompactReport::default());
    }

    #[test]
    fn a_small_target_size_makes_several_files() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        for part in 0..4 {
            write(
                &lake,
                &format!("t-p{part}"),
                &samples(part * 50..part * 50 + 50, T0, 700),
            );
        }
        let before = query(&lake, FIGURES);
        let done = compact(
            &lake,
            CompactOptions {
                target_file_bytes: 32 << 10,
                row_group_rows: 4_096,
                ..CompactOptions::default()
            },
        );
        assert!(done.compacted.files_out > 1, "{done:?}");
        assert_eq!(query(&lake, FIGURES), before);
        let hour = lake.hour_dir("samples", T0);
        assert_eq!(names(&hour).len(), done.compacted.files_out);
        assert_eq!(
            Manifest::read(&hour).unwrap().outputs.len(),
            done.compacted.files_out
        );
    }

    #[test]
    fn late_data_reopens_a_compacted_hour_and_a_rewritten_input_stays_hidden() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let first = samples(0..10, T0, 60);
        let replayed = write(&lake, "t-p0", &first);
        write(&lake, "t-p1", &samples(10..20, T0, 60));
        compact(&lake, CompactOptions::default());
        let hour = lake.hour_dir("samples", T0);

        // Late rows are visible at once, before any compaction.
        write(&lake, "t-p2", &samples(20..30, T0, 60));
        assert_eq!(query(&lake, FIGURES), 1_800 * 1_000_001);
        // The same offsets written again (a replay) hold rows the outputs have: hidden.
        lake.write(
            &replayed,
            &Sample::to_record_batch(&first).unwrap(),
            "samples",
            T0,
        )
        .unwrap();
        assert_eq!(query(&lake, FIGURES), 1_800 * 1_000_001);

        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.files_in, 2, "the outputs and the late file");
        assert_eq!(done.compacted.leftovers_removed, 1, "the replayed file");
        assert_eq!(names(&hour), ["compact-g2-0000.parquet"]);
        assert_eq!(query(&lake, FIGURES), 1_800 * 1_000_001);
        let manifest = Manifest::read(&hour).unwrap();
        assert_eq!(manifest.generation, 2);
        assert_eq!(manifest.superseded.len(), 3);
    }

    #[test]
    fn the_files_of_an_uncommitted_flush_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        write(&lake, "t-p0", &samples(0..10, T0, 60));
        write(&lake, "t-p1", &samples(10..20, T0, 60));
        let pending = write(&lake, "t-p2", &samples(20..30, T0, 60));
        lake.write_intent(&crate::lake::Intent {
            source: "t-p2".into(),
            first: 0,
            last: 600,
            files: vec![pending.clone()],
        })
        .unwrap();
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.files_in, 2);
        let hour = lake.hour_dir("samples", T0);
        assert!(hour.join(pending.file_name().unwrap()).exists());
        assert_eq!(query(&lake, FIGURES), 1_800 * 1_000_001);

        // Committed: the next compaction takes it.
        lake.clear_intent("t-p2").unwrap();
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.files_in, 2);
        assert_eq!(names(&hour), ["compact-g2-0000.parquet"]);
        assert_eq!(query(&lake, FIGURES), 1_800 * 1_000_001);
    }

    #[test]
    fn readers_see_an_hour_as_its_manifest_says_whatever_a_crash_left() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let a = write(&lake, "t-p0", &samples(0..10, T0, 60));
        let b = write(&lake, "t-p1", &samples(10..20, T0, 60));
        let hour = lake.hour_dir("samples", T0);
        let expected = 1_200 * 1_000_001;

        // Outputs written, no manifest yet (a crash before the commit): hidden.
        fs::copy(lake.root().join(&a), hour.join("compact-g1-0000.parquet")).unwrap();
        assert_eq!(query(&lake, FIGURES), expected);

        // The commit names the outputs; inputs not deleted yet (a crash after it): hidden.
        fs::copy(lake.root().join(&b), hour.join("compact-g1-0001.parquet")).unwrap();
        Manifest {
            generation: 1,
            outputs: vec![
                "compact-g1-0000.parquet".into(),
                "compact-g1-0001.parquet".into(),
            ],
            superseded: [a.file_name(), b.file_name()]
                .map(|n| n.unwrap().to_string_lossy().into_owned())
                .into(),
            fenced_by: None,
        }
        .write(&hour)
        .unwrap();
        assert_eq!(query(&lake, FIGURES), expected);

        // A manifest whose output a listing did not see is read again, not half-read.
        assert_eq!(
            Manifest::read(&hour)
                .unwrap()
                .missing_in(["compact-g1-0000.parquet"]),
            Some("compact-g1-0001.parquet")
        );

        // The next compaction finishes the job: the inputs go, the rows stay.
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.leftovers_removed, 2);
        assert_eq!(query(&lake, FIGURES), expected);
        assert_eq!(
            names(&hour),
            ["compact-g1-0000.parquet", "compact-g1-0001.parquet"]
        );
    }

    fn write_at(lake: &Lake, hour: i64, name: &str, rows: &[Sample]) -> PathBuf {
        let relative = Lake::file_name(
            "samples",
            hour,
            name,
            0,
            rows.len() as i64,
            crate::buffer::ContentDigest(0),
        );
        lake.write(
            &relative,
            &Sample::to_record_batch(rows).unwrap(),
            "samples",
            hour,
        )
        .unwrap();
        relative
    }

    #[test]
    fn a_lost_manifest_is_rebuilt_from_the_outputs_and_every_row_stays_once() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let first = samples(0..20, T0, 500);
        let replayed = write(&lake, "t-p0", &first);
        write(&lake, "t-p1", &samples(20..40, T0, 500));
        write(&lake, "t-p2", &samples(40..60, T0, 500));
        let small = CompactOptions {
            target_file_bytes: 8 << 10,
            row_group_rows: 1_024,
            ..CompactOptions::default()
        };
        let done = compact(&lake, small.clone());
        assert!(done.compacted.files_out > 1, "{done:?}");
        let hour = lake.hour_dir("samples", T0);
        let committed = Manifest::read(&hour).unwrap();
        let expected = 30_000 * 1_000_001;
        assert_eq!(query(&lake, FIGURES), expected);

        // The manifest is lost: the outputs are hidden, and a replay of a superseded input (its
        // name no longer known to be superseded) shows again.
        fs::remove_file(hour.join(MANIFEST)).unwrap();
        lake.write(
            &replayed,
            &Sample::to_record_batch(&first).unwrap(),
            "samples",
            T0,
        )
        .unwrap();
        assert_eq!(query(&lake, FIGURES), 10_000 * 1_000_001);
        lake.clear_mark("samples", T0).unwrap();

        // Compaction puts it back as it was, instead of deleting the outputs as leftovers.
        let done = compact(&lake, small.clone());
        assert_eq!(done.compacted.manifests_rebuilt, 1);
        assert_eq!(done.compacted.hours, 0, "nothing new to compact");
        assert_eq!(done.compacted.leftovers_removed, 1, "the replayed input");
        assert_eq!(Manifest::read(&hour).unwrap(), committed);
        assert_eq!(query(&lake, FIGURES), expected);
        let mut outputs = committed.outputs.clone();
        outputs.sort();
        assert_eq!(names(&hour), outputs);
        // The rollups may have read the hour without its outputs: they read it again.
        assert_eq!(lake.marked_hours("samples").unwrap(), [T0]);

        // Lost again, with late data meanwhile: rebuilt, then compacted with the late rows.
        fs::remove_file(hour.join(MANIFEST)).unwrap();
        write(&lake, "t-p3", &samples(60..70, T0, 60));
        let done = compact(&lake, small.clone());
        assert_eq!(done.compacted.manifests_rebuilt, 1);
        assert_eq!(done.compacted.hours, 1);
        assert_eq!(query(&lake, FIGURES), 30_600 * 1_000_001);
        let manifest = Manifest::read(&hour).unwrap();
        assert_eq!(manifest.generation, 2);
        assert_eq!(manifest.superseded.len(), 4);
        assert!(names(&hour).iter().all(|n| n.starts_with("compact-g2-")));
    }

    #[test]
    fn a_crashed_compaction_is_still_told_from_a_lost_manifest_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        write(&lake, "t-p0", &samples(0..10, T0, 60));
        write(&lake, "t-p1", &samples(10..20, T0, 60));
        compact(&lake, CompactOptions::default());
        let hour = lake.hour_dir("samples", T0);
        let g1 = Manifest::read(&hour).unwrap();
        write(&lake, "t-p2", &samples(20..30, T0, 60));
        let expected = 1_800 * 1_000_001;

        // Generation 2 written and not committed (a crash before the manifest), every input
        // still there: its outputs go, whatever manifest the hour has (here: the last one).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let compactor = Compactor::new(lake.clone(), CompactOptions::default());
        let mut inputs = names(&hour);
        inputs.sort();
        let crashed = |compactor: &Compactor, generation| {
            let origin = Origin::new(generation, 1_800, &inputs, &BTreeSet::new());
            runtime
                .block_on(compactor.rewrite(
                    Table::Samples,
                    &hour,
                    hour.strip_prefix(lake.root()).unwrap(),
                    &origin,
                    None,
                ))
                .unwrap()
        };
        crashed(&compactor, 2);
        assert_eq!(query(&lake, FIGURES), expected);
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.leftovers_removed, 1, "{done:?}");
        assert_eq!(done.compacted.manifests_rebuilt, 0);
        assert_eq!(done.compacted.hours, 1);
        assert_eq!(query(&lake, FIGURES), expected);
        assert_eq!(names(&hour), ["compact-g2-0000.parquet"]);

        // The same crash with the manifest also lost: the crashed generation goes, and the one
        // before it (whose inputs are gone) is what the manifest is rebuilt from.
        let g2 = Manifest::read(&hour).unwrap();
        assert_ne!(g1, g2);
        write(&lake, "t-p3", &samples(30..40, T0, 60));
        let mut inputs_now = names(&hour);
        inputs_now.sort();
        let origin = Origin::new(3, 2_400, &inputs_now, &g2.superseded);
        runtime
            .block_on(compactor.rewrite(
                Table::Samples,
                &hour,
                hour.strip_prefix(lake.root()).unwrap(),
                &origin,
                None,
            ))
            .unwrap();
        fs::remove_file(hour.join(MANIFEST)).unwrap();
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.manifests_rebuilt, 1, "{done:?}");
        assert_eq!(done.compacted.hours, 1, "the late file, with generation 2");
        assert_eq!(query(&lake, FIGURES), 2_400 * 1_000_001);
        assert_eq!(names(&hour), ["compact-g3-0000.parquet"]);
    }

    #[test]
    fn outputs_that_cannot_be_placed_are_kept_and_their_hour_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let small = CompactOptions {
            target_file_bytes: 8 << 10,
            row_group_rows: 1_024,
            ..CompactOptions::default()
        };
        write(&lake, "t-p0", &samples(0..20, T0, 500));
        write(&lake, "t-p1", &samples(20..40, T0, 500));
        let done = compact(&lake, small.clone());
        assert!(done.compacted.files_out > 1, "{done:?}");
        let hour = lake.hour_dir("samples", T0);

        // The manifest and one output lost: the rest cannot be all the rows, and the inputs
        // are gone, so nothing is deleted and the hour waits for an operator.
        fs::remove_file(hour.join(MANIFEST)).unwrap();
        fs::remove_file(hour.join("compact-g1-0000.parquet")).unwrap();
        let before = names(&hour);
        let done = compact(&lake, small.clone());
        assert_eq!(done.compacted.skipped, [0, 1]);
        assert_eq!(done.compacted.leftovers_removed, 0);
        assert_eq!(names(&hour), before);
        assert!(!hour.join(MANIFEST).exists());

        // A manifest naming a file the hour lacks is not this hour's (a backup restored over
        // older files): the files it does not name are kept.
        write(&lake, "t-p2", &samples(40..50, T0, 60));
        Manifest {
            generation: 1,
            outputs: vec!["compact-g1-0000.parquet".into()],
            superseded: BTreeSet::new(),
            fenced_by: None,
        }
        .write(&hour)
        .unwrap();
        let before = names(&hour);
        let done = compact(&lake, small.clone());
        assert_eq!(done.compacted.skipped, [0, 1]);
        assert_eq!(names(&hour), before);
        // A query says which file the manifest names and the hour lacks, not only to try again.
        let error = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(crate::sql::query(&lake, "SELECT count(*) FROM samples"))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(&format!(
                "/{MANIFEST} names compact-g1-0000.parquet, which 5 listings in a row did not find"
            )) && error.contains("`gpuwarden compact` says what to restore"),
            "{error}"
        );

        // A compacted file that records nothing (written before the record existed) is kept.
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let a = write(&lake, "t-p0", &samples(0..10, T0, 60));
        let hour = lake.hour_dir("samples", T0);
        fs::copy(lake.root().join(&a), hour.join("compact-g1-0000.parquet")).unwrap();
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.skipped, [0, 1]);
        assert!(hour.join("compact-g1-0000.parquet").exists());
        assert!(lake.root().join(&a).exists());
    }

    #[test]
    fn a_damaged_manifest_skips_its_hour_and_the_others_are_compacted() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        for h in 0..3 {
            write_at(
                &lake,
                T0 + h * HOUR_MS,
                "t-p0",
                &samples(0..10, T0 + h * HOUR_MS, 60),
            );
        }
        compact(&lake, CompactOptions::default());
        let damaged = lake.hour_dir("samples", T0).join(MANIFEST);
        fs::write(&damaged, b"{\"generation\": 1, \"outp").unwrap();
        for h in 0..3 {
            write_at(
                &lake,
                T0 + h * HOUR_MS,
                "t-p1",
                &samples(10..20, T0 + h * HOUR_MS, 60),
            );
        }
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.skipped, [1, 0]);
        assert_eq!(done.compacted.hours, 2, "the hours after the damaged one");
        for h in 1..3 {
            assert_eq!(
                names(&lake.hour_dir("samples", T0 + h * HOUR_MS)),
                ["compact-g2-0000.parquet"]
            );
        }
        assert_eq!(names(&lake.hour_dir("samples", T0)).len(), 2);
        assert_eq!(fs::read(&damaged).unwrap(), b"{\"generation\": 1, \"outp");

        // The fix the log gives: remove it, and the hour is rebuilt and compacted.
        fs::remove_file(&damaged).unwrap();
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.skipped, [0, 0]);
        assert_eq!(done.compacted.manifests_rebuilt, 1);
        assert_eq!(done.compacted.hours, 1);
        assert_eq!(query(&lake, FIGURES), 3_600 * 1_000_001);
    }

    #[test]
    fn retention_deletes_only_hours_past_it_and_counts_them() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        for hour in 0..3 {
            let rows = samples(0..4, T0 + hour * HOUR_MS, 10);
            let relative = Lake::file_name(
                "samples",
                T0 + hour * HOUR_MS,
                "t-p0",
                hour * 100,
                hour * 100 + 9,
                crate::buffer::ContentDigest(0),
            );
            lake.write(
                &relative,
                &Sample::to_record_batch(&rows).unwrap(),
                "samples",
                T0 + hour * HOUR_MS,
            )
            .unwrap();
        }
        let options = CompactOptions {
            enabled: false,
            retention: vec![(Table::Samples, std::time::Duration::from_secs(24 * 3600))],
            ..CompactOptions::default()
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // The fleet is a day past the end of the second hour: the first two go.
        let watermark = T0 + 2 * HOUR_MS + 24 * HOUR_MS;
        let done = runtime
            .block_on(Compactor::new(lake.clone(), options).run(Some(watermark)))
            .unwrap();
        assert_eq!(done.expired.len(), 1);
        assert_eq!(done.expired[0].hours, 2);
        assert_eq!(done.expired[0].files, 2);
        assert!(done.expired[0].bytes > 0);
        assert_eq!(lake.hours("samples").unwrap(), [T0 + 2 * HOUR_MS]);
        assert_eq!(lake.marked_hours("samples").unwrap(), [T0 + 2 * HOUR_MS]);
        assert_eq!(query(&lake, "SELECT count(*) FROM samples"), 40);
    }
}
