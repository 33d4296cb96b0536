//! Compaction: Delta's OPTIMIZE of the raw tables' final hours, and retention, the deletion of
//! hours past `[pipeline.retention]` (docs/src/contributors/lake.md#compaction).
//!
//! Ingest commits about one file per partition, table and hour at every flush (hundreds per
//! hour); queries over a month of them spend their time opening files. Once an hour is final,
//! its files are read, sorted by the table's sort columns ([`sort_columns`]) and written as files
//! of about [`CompactOptions::target_file_bytes`], named `<YYYY-MM-DD>T<HH>-optimized-<uuid>`;
//! one commit (operation `OPTIMIZE`, `dataChange` false) removes the inputs and adds the outputs.
//! Every reader sees the hour before or after that commit, never both or neither. Outputs put
//! before a commit that did not land (a crash, a conflict) are named by no commit: no reader
//! reads them, and they are deleted when the commit fails (after a crash, by nothing: see
//! docs/src/contributors/lake.md#compaction).
//!
//! Concurrency is the log's: an OPTIMIZE conflicts only with a commit that removed one of its
//! inputs since it read the table (another OPTIMIZE of the hour, retention); it is then skipped
//! ([`SkipReason::Conflict`]) and done again at the next run. Appends of new rows to the hour
//! (late data) do not conflict: their files stay beside the outputs until the next run.
//!
//! This is gpuwarden's own OPTIMIZE rather than delta-rs's `OptimizeBuilder`, which selects
//! files by partition only: the raw tables are not partitioned (files are named and described
//! by their hour), and the builder would pack hours together and rewrite the open hour too.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::error::DataFusionError;
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt as _;
use gpuwarden_schema::config::Config;
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::SortingColumn;
use serde::Deserialize;

use crate::buffer::Table;
use crate::delta::{AsOf, DataFile, DeltaError};
use crate::lake::{hour_partition, io, Lake, LakeError, LakeLock, Role};

const HOUR_MS: i64 = 3_600_000;

/// What OPTIMIZE's output files are tagged with in their names.
pub const OPTIMIZED: &str = "optimized";

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
    /// Another compaction holds the lake's compaction role.
    #[error("another compaction is running on this lake (it holds {0})")]
    Busy(PathBuf),
    /// A lake operation failed.
    #[error(transparent)]
    Lake(#[from] LakeError),
    /// Reading or sorting the hour failed.
    #[error("compacting {hour} of {table}: {source}")]
    Query {
        /// The table.
        table: &'static str,
        /// The hour.
        hour: String,
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
    /// The rows written are not the rows the inputs hold; nothing was committed.
    #[error(
        "compacting {hour} of {table}: the inputs hold {read} rows but {wrote} were written; \
         nothing was committed"
    )]
    RowsDiffer {
        /// The table.
        table: &'static str,
        /// The hour.
        hour: String,
        /// Rows in the inputs, as the log's statistics count them.
        read: u64,
        /// Rows written.
        wrote: u64,
    },
}

impl From<DeltaError> for CompactError {
    fn from(e: DeltaError) -> Self {
        Self::Lake(LakeError::Delta(e))
    }
}

/// Why compaction left an hour alone this time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SkipReason {
    /// A commit since the table was read removed one of its files (retention, another
    /// OPTIMIZE): the next run reads it again.
    Conflict,
}

impl SkipReason {
    /// Every reason, in the order of [`CompactReport::skipped`].
    pub const ALL: [SkipReason; 1] = [Self::Conflict];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Conflict => "conflict",
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
    /// Files the tables' commits removed long enough ago, deleted (VACUUM).
    pub vacuumed: usize,
    /// Hours left alone, by [`SkipReason`] (in the order of [`SkipReason::ALL`]).
    pub skipped: [usize; 1],
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
    /// Set once a run found no raw file of the layout before Delta: the check lists every
    /// table, which a long-lived pipeline need not do every run (nothing writes that layout
    /// again).
    migrated: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The columns each table's compacted files are sorted by: what its queries filter on first.
pub fn sort_columns(table: Table) -> &'static [&'static str] {
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
/// there (a holder paused past its bucket lock: the test resumes it with SIGCONT).
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

/// Whether an hour's files need OPTIMIZE: any of them not written by it (new rows, late data),
/// or more of its outputs than the hour's bytes need.
fn needs_optimize(files: &[&DataFile], target: u64) -> bool {
    let bytes: u64 = files.iter().map(|f| f.size.max(0) as u64).sum();
    let outputs = bytes.div_ceil(target.max(1)).max(1) as usize;
    files.iter().any(|f| !is_output(&f.path)) || files.len() > outputs
}

/// Whether a file is an OPTIMIZE output.
fn is_output(path: &str) -> bool {
    path.get(14..)
        .is_some_and(|rest| rest.starts_with(OPTIMIZED) && rest[OPTIMIZED.len()..].starts_with('-'))
}

impl Compactor {
    /// A compactor of `lake`.
    pub fn new(lake: Lake, options: CompactOptions) -> Self {
        Self {
            lake,
            options,
            migrated: Default::default(),
        }
    }

    /// The lake it works on.
    pub fn lake(&self) -> &Lake {
        &self.lake
    }

    /// Deletes the hours past their retention at `watermark`, then compacts every hour of every
    /// raw table that is final at it (it ended at least `lateness` before it) and holds files
    /// OPTIMIZE did not write, then VACUUMs each table (at most hourly). The watermark is the
    /// rollups' (the event time the fleet has reached, [`rollup_watermark`]), never the wall
    /// clock: a lake of history, or a machine whose clock jumps ahead, loses nothing. Without
    /// one (no rollup has run) nothing is done.
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
            maintenance
                .expired
                .push(crate::retention::expire(&self.lake, *table, *kept, watermark).await?);
        }
        if self.options.enabled {
            maintenance.compacted = self.compact(watermark, &lock).await?;
        }
        // Files no commit names are deleted once every table is migrated: before, the old
        // layout's files are such files too.
        let migrated = self.migrated.load(std::sync::atomic::Ordering::Relaxed)
            || crate::migrate::raw_tables_to_migrate(&self.lake).is_ok_and(|left| left.is_empty());
        self.migrated
            .store(migrated, std::sync::atomic::Ordering::Relaxed);
        for table in Table::ALL {
            match self.lake.delta().vacuum(table.name(), migrated).await {
                Ok(deleted) => maintenance.compacted.vacuumed += deleted,
                Err(e) => {
                    tracing::warn!(error = %e, "could not vacuum a raw table; the next run tries again")
                }
            }
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
            let Some(files) = self.lake.delta().files(table.name(), AsOf::Latest).await? else {
                continue;
            };
            let mut hours: BTreeMap<i64, Vec<&DataFile>> = BTreeMap::new();
            for file in &files.files {
                if let Some(hour) = file.hour_ms {
                    hours.entry(hour).or_default().push(file);
                }
            }
            let due: Vec<i64> = hours
                .iter()
                .filter(|(hour, inputs)| {
                    **hour + HOUR_MS + self.options.lateness_ms <= watermark
                        && needs_optimize(inputs, self.options.target_file_bytes)
                })
                .map(|(hour, _)| *hour)
                .collect();
            for hour in due {
                lock.check("compacting an hour")?;
                // The hour as the latest version has it: each commit here is made from the
                // version it read, the one before included.
                let Some(now) = self.lake.delta().files(table.name(), AsOf::Latest).await? else {
                    break;
                };
                let inputs: Vec<&DataFile> = now
                    .files
                    .iter()
                    .filter(|f| f.hour_ms == Some(hour))
                    .collect();
                if !needs_optimize(&inputs, self.options.target_file_bytes) {
                    continue;
                }
                match self.optimize(table, hour, now.version, &inputs, lock).await {
                    Ok(done) => {
                        report.hours += 1;
                        report.files_in += inputs.len();
                        report.bytes_in += inputs.iter().map(|f| f.size.max(0) as u64).sum::<u64>();
                        report.files_out += done.0;
                        report.bytes_out += done.1;
                        report.rows += done.2;
                    }
                    Err(CompactError::Lake(LakeError::Delta(e))) if e.is_conflict() => {
                        tracing::info!(table = table.name(), hour = %hour_partition(hour), error = %e, "an hour's files changed while it was compacted; it is compacted at the next run");
                        report.skipped[0] += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(report)
    }

    /// Rewrites one hour's `inputs` (as version `read` names them) sorted, and commits the
    /// swap. Returns the files, bytes and rows written.
    async fn optimize(
        &self,
        table: Table,
        hour: i64,
        read: u64,
        inputs: &[&DataFile],
        lock: &LakeLock,
    ) -> Result<(usize, u64, u64), CompactError> {
        let shown = hour_partition(hour);
        let query = |source| CompactError::Query {
            table: table.name(),
            hour: shown.clone(),
            source,
        };
        let staging = self.lake.staging_dir(table.name());
        let spill = staging.join("spill");
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
        self.lake.register_object_store(&ctx);
        let schema = table.schema();
        let paths: Vec<&str> = inputs.iter().map(|file| file.path.as_str()).collect();
        self.lake
            .delta()
            .register_files(&ctx, "hour", table.name(), &paths, schema.clone())
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
            .build();
        let mut written: Vec<(PathBuf, u64)> = Vec::new();
        let mut current: Option<(PathBuf, ArrowWriter<fs::File>, u64)> = None;
        let result: Result<(), CompactError> = async {
            while let Some(batch) = stream.next().await {
                let batch = batch.map_err(query)?;
                if batch.num_rows() == 0 {
                    continue;
                }
                if current.is_none() {
                    let tmp = staging.join(format!(".optimize-{}.tmp", uuid::Uuid::new_v4()));
                    let file = fs::File::create(&tmp).map_err(io("creating", &tmp))?;
                    let writer = ArrowWriter::try_new(file, schema.clone(), Some(props.clone()))
                        .map_err(|source| CompactError::Parquet {
                            path: tmp.clone(),
                            source,
                        })?;
                    current = Some((tmp, writer, 0));
                }
                let (tmp, writer, rows) = current.as_mut().expect("opened above");
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
                    let (tmp, writer, rows) = current.take().expect("opened above");
                    written.push((close(tmp.clone(), writer)?, rows));
                }
            }
            if let Some((tmp, writer, rows)) = current.take() {
                written.push((close(tmp, writer)?, rows));
            }
            Ok(())
        }
        .await;
        let cleanup = |written: &[(PathBuf, u64)]| {
            for (path, _) in written {
                let _ = fs::remove_file(path);
            }
        };
        if let Err(e) = result {
            cleanup(&written);
            return Err(e);
        }
        let read_rows: u64 = inputs.iter().map(|f| f.rows.unwrap_or(0)).sum();
        let wrote: u64 = written.iter().map(|(_, rows)| rows).sum();
        if inputs.iter().all(|f| f.rows.is_some()) && read_rows != wrote {
            cleanup(&written);
            return Err(CompactError::RowsDiffer {
                table: table.name(),
                hour: shown,
                read: read_rows,
                wrote,
            });
        }
        let mut adds = Vec::with_capacity(written.len());
        let mut bytes = 0;
        for (path, _) in &written {
            let add = self
                .lake
                .delta()
                .put_local_file(table.name(), &schema, path, hour, OPTIMIZED, false)
                .await;
            match add {
                Ok(add) => {
                    bytes += add.size.max(0) as u64;
                    adds.push(add);
                }
                Err(e) => {
                    cleanup(&written);
                    for add in &adds {
                        let _ = self.lake.delta().delete_file(table.name(), &add.path).await;
                    }
                    return Err(e.into());
                }
            }
        }
        fault_point("outputs-written");
        lock.check("committing a compaction")?;
        fault_point("before-commit");
        let removed: Vec<DataFile> = inputs.iter().map(|f| (*f).clone()).collect();
        let files = adds.len();
        let version = self
            .lake
            .delta()
            .rewrite(
                table.name(),
                read,
                &removed,
                adds,
                i64::try_from(self.options.target_file_bytes).unwrap_or(i64::MAX),
            )
            .await?;
        fault_point("after-commit");
        tracing::info!(table = table.name(), hour = %shown, inputs = inputs.len(), outputs = files, rows = wrote, version, "compacted an hour");
        Ok((files, bytes, wrote))
    }
}

/// Finishes a compacted file in the staging directory; returns its path.
fn close(tmp: PathBuf, writer: ArrowWriter<fs::File>) -> Result<PathBuf, CompactError> {
    let file = writer
        .into_inner()
        .map_err(|source| CompactError::Parquet {
            path: tmp.clone(),
            source,
        })?;
    file.sync_all().map_err(io("syncing", &tmp))?;
    Ok(tmp)
}

/// The watermark of the rollups' last run (`<lake>/rollups/_state.json`): the event time
/// compaction and the pipeline agree an hour is final at. None from a state of a newer format
/// than this build's, whose watermark may mean something else: nothing is final then (the
/// rollups refuse that state, naming both versions).
pub fn rollup_watermark(lake: &Lake) -> Option<i64> {
    #[derive(Deserialize)]
    struct State {
        watermark: Option<i64>,
    }
    let path = Path::new(crate::rollup::tables::DIR).join("_state.json");
    let (bytes, _) = lake.read_state(&path).ok()??;
    let newer = gpuwarden_schema::format::check_json(
        &bytes,
        || path.display().to_string(),
        "state",
        crate::rollup::STATE_VERSION,
    );
    if newer.is_err() {
        return None;
    }
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

    /// Commits `rows` (of the hour starting at `hour`) as source `source` would.
    fn write_at(lake: &Lake, hour: i64, source: &str, rows: &[Sample]) {
        let batch = Sample::to_record_batch(rows).unwrap();
        crate::delta::block_on(lake.delta().append(
            "samples",
            &Table::Samples.schema(),
            source,
            &[crate::delta::NewFile {
                hour_ms: hour,
                batch: &batch,
                offsets: None,
            }],
            None,
        ))
        .unwrap();
    }

    fn write(lake: &Lake, source: &str, rows: &[Sample]) {
        write_at(lake, T0, source, rows);
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

    /// The files of the hour at `hour` the latest version names.
    fn files_of(lake: &Lake, hour: i64) -> Vec<DataFile> {
        crate::delta::block_on(lake.delta().files("samples", AsOf::Latest))
            .unwrap()
            .unwrap()
            .files
            .into_iter()
            .filter(|f| f.hour_ms == Some(hour))
            .collect()
    }

    #[test]
    fn outputs_are_told_by_their_names() {
        assert!(is_output("2026-01-01T00-optimized-0b1c.parquet"));
        assert!(!is_output(
            "2026-01-01T00-gpuwarden.samples-p0-0b1c.parquet"
        ));
        assert!(!is_output("2026-01-01T00-optimizedx-0b1c.parquet"));
        assert!(!is_output(
            "date=2026-01-01/hour=00/compact-g1-0000.parquet"
        ));
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
        let files = files_of(&lake, T0);
        assert_eq!(files.len(), 1);
        assert!(is_output(&files[0].path), "{}", files[0].path);
        assert_eq!(files[0].rows, Some(7_200));
        assert_eq!(query(&lake, FIGURES), before);

        // Sorted by GPU, then time, and saying so in its metadata.
        let file = fs::File::open(dir.path().join("samples").join(&files[0].path)).unwrap();
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
        assert_eq!(files_of(&lake, T0).len(), done.compacted.files_out);
    }

    #[test]
    fn late_data_reopens_a_compacted_hour_and_the_open_hour_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        write(&lake, "t-p0", &samples(0..10, T0, 60));
        write(&lake, "t-p1", &samples(10..20, T0, 60));
        // An hour the watermark has not passed (with the lateness) is not final.
        write_at(
            &lake,
            T0 + 9 * HOUR_MS + HOUR_MS / 2,
            "t-p0",
            &samples(0..2, T0 + 9 * HOUR_MS + HOUR_MS / 2, 6),
        );
        compact(&lake, CompactOptions::default());
        assert_eq!(files_of(&lake, T0).len(), 1);

        // Late rows are visible at once, before any compaction.
        write(&lake, "t-p2", &samples(20..30, T0, 60));
        assert_eq!(files_of(&lake, T0).len(), 2);
        let with_late = query(&lake, FIGURES);
        assert_eq!(with_late, (1_800 + 12) * 1_000_001);
        let done = compact(&lake, CompactOptions::default());
        assert_eq!(done.compacted.files_in, 2, "the outputs and the late file");
        assert_eq!(files_of(&lake, T0).len(), 1);
        assert_eq!(query(&lake, FIGURES), with_late);
    }

    #[test]
    fn two_compactions_from_one_version_commit_once() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        for part in 0..3 {
            write(
                &lake,
                &format!("t-p{part}"),
                &samples(part * 5..part * 5 + 5, T0, 30),
            );
        }
        let before = query(&lake, FIGURES);
        let read = crate::delta::block_on(lake.delta().files("samples", AsOf::Latest))
            .unwrap()
            .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // Both made from the same version: as two compactors would, one paused past its bucket lock.
        let outcomes: Vec<_> = (0..2)
            .map(|_| {
                let inputs: Vec<&DataFile> = read.files.iter().collect();
                let lock = lake.try_lock(Role::Compaction).unwrap();
                let compactor = Compactor::new(lake.clone(), CompactOptions::default());
                let lock = lock.expect("the role is free between the two");
                runtime.block_on(compactor.optimize(
                    Table::Samples,
                    T0,
                    read.version,
                    &inputs,
                    &lock,
                ))
            })
            .collect();
        assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
        assert!(
            matches!(&outcomes[1], Err(CompactError::Lake(LakeError::Delta(e))) if e.is_conflict()),
            "{:?}",
            outcomes[1]
        );
        assert_eq!(query(&lake, FIGURES), before, "the hour's rows once");
        assert_eq!(files_of(&lake, T0).len(), 1);
    }

    #[test]
    fn retention_deletes_only_hours_past_it_and_counts_them() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        for hour in 0..3 {
            write_at(
                &lake,
                T0 + hour * HOUR_MS,
                "t-p0",
                &samples(0..4, T0 + hour * HOUR_MS, 10),
            );
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
        let left: Vec<i64> = crate::delta::block_on(lake.delta().files("samples", AsOf::Latest))
            .unwrap()
            .unwrap()
            .files
            .iter()
            .filter_map(|f| f.hour_ms)
            .collect();
        assert_eq!(left, [T0 + 2 * HOUR_MS]);
        // A deletion adds no rows: the rollups compute no hour again for it.
        let (_, changed) = crate::delta::block_on(lake.delta().changed_hours("samples", Some(3)))
            .unwrap()
            .unwrap();
        assert!(changed.unwrap().is_empty());
        assert_eq!(query(&lake, "SELECT count(*) FROM samples"), 40);
    }
}
