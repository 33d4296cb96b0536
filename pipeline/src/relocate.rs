//! Moving a lake to a new location (`gpuwarden lake migrate --to`,
//! docs/src/contributors/lake.md#moving-a-lake): a directory to a bucket, one bucket to another, or a
//! lake of the layout before Delta into Delta tables elsewhere, leaving it as it was.
//!
//! Each table is copied as a reader of the old lake sees it: a Delta table's latest version
//! (its files, with their statistics, and the version each source holds: the Kafka offsets its
//! ingest committed), plus what the layout before Delta shows and the log does not name yet
//! (`crate::migrate`'s rules for the raw tables; an hour's rollup file, which replaces what the
//! log holds for that hour, as an in-place migration would). Files are copied as they are, under
//! their own names (a file of the old layout under a name that starts with its hour); an old
//! rollup file is written again as the Delta table stores its rows. Then one commit per table
//! adds them all, with those transactions and a transaction of its own ([`MOVED_FROM`]): the
//! new table holds all of them or none, and its ingest resumes after the offsets the old one
//! held, so nothing is read twice or skipped.
//!
//! Every table is then read back through its new log and compared, hour by hour, with the
//! files it came from: rows, and the sum of a measure (`ts_ms`'s place in its hour for a raw
//! table; `rollup::migrate::measure` for a rollup table). Last, the rollups' state goes with
//! them (`rollup::migrate::carry_state`), so the new lake's rollups go on where the old one's
//! stopped. Nothing is deleted from the old lake.
//!
//! Stopped anywhere, the move is finished by running it again: the files a run copied are
//! found by name and size and not copied again, a table committed is not committed again (its
//! [`MOVED_FROM`] transaction says so) but compared again with the version it copied, and a
//! destination that holds a table this move did not write is refused before anything is
//! written to it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use arrow_array::{Array, Float64Array, Int64Array};
use arrow_schema::{DataType, SchemaRef};
use datafusion::arrow::compute::cast;
use datafusion::prelude::SessionContext;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;

use crate::buffer::Table;
use crate::delta::{hour_of_file, moved_name, stored_schema, AsOf};
use crate::lake::{Lake, Role};
use crate::migrate::MigrateError;
use crate::rollup::migrate as rollups;
use crate::rollup::RollupTable;

/// The transaction app id a moved table's commit carries, with the version of the table it was
/// copied from (-1 when the old lake had no Delta table, only files of the layout before).
pub const MOVED_FROM: &str = "gpuwarden-lake-move";

const HOUR_MS: i64 = 3_600_000;

/// What a move did with one table.
#[derive(Debug, Clone, Default)]
pub struct MovedTable {
    /// The table, as its directory in the lake (`samples`, `rollups/team_hourly`).
    pub table: String,
    /// Files it holds at the new location.
    pub files: usize,
    /// Bytes of those files.
    pub bytes: u64,
    /// Its rows, equal in both lakes.
    pub rows: u64,
    /// What is summed to compare it: `ts_ms % 3600000` (its place in its hour) for a raw
    /// table, the rollup table's measure.
    pub measure: &'static str,
    /// The sum of its measure, equal in both lakes.
    pub sum: f64,
    /// Sources' transactions carried (Kafka partitions, files ingested).
    pub txns: usize,
    /// Committed by an earlier run of the move (this one compared it only).
    pub earlier: bool,
}

/// What a move did.
#[derive(Debug, Clone, Default)]
pub struct Moved {
    /// Each table.
    pub tables: Vec<MovedTable>,
    /// Whether the rollups' state was carried by this run (not: an earlier one did, or the
    /// new lake's rollups wrote their own, or the old lake had none).
    pub state_carried: bool,
}

/// One table of a move.
struct Spec {
    /// Its directory in the lake.
    relative: String,
    /// How its rows are read.
    schema: SchemaRef,
    /// A rollup table: its hour column (`None`: the leases, every row at once) and measure.
    rollup: Option<(Option<&'static str>, &'static str)>,
}

/// Rows and the sum of the measure, per hour (`None`: a table without hours).
type Totals = BTreeMap<Option<i64>, (u64, f64)>;

/// Whether two lakes are one place: one directory however its path is spelled (a symlink,
/// `..`), or one bucket and prefix.
fn same_location(a: &Lake, b: &Lake) -> bool {
    match (a.objects(), b.objects()) {
        (None, None) => {
            let canonical =
                |lake: &Lake| std::fs::canonicalize(lake.root()).unwrap_or(lake.root().into());
            canonical(a) == canonical(b)
        }
        _ => a.location() == b.location(),
    }
}

/// Moves every table of `from` to `to` (see the module's documentation), logging each table
/// as it starts and ends.
pub async fn move_lake(from: &Lake, to: &Lake) -> Result<Moved, MigrateError> {
    if same_location(from, to) {
        return Err(MigrateError::SameLocation(to.location()));
    }
    crate::migrate::check_no_journal(from)?;
    // Neither lake's rollups run meanwhile: the old state is what the tables copied account
    // for, and nothing writes the new one's.
    let Some(_from_role) = from.try_lock(Role::Rollups)? else {
        return Err(MigrateError::Busy(from.location()));
    };
    let Some(_to_role) = to.try_lock(Role::Rollups)? else {
        return Err(MigrateError::Busy(to.location()));
    };
    let mut specs: Vec<Spec> = Table::ALL
        .iter()
        .map(|t| Spec {
            relative: t.name().to_string(),
            schema: t.schema(),
            rollup: None,
        })
        .collect();
    specs.extend(RollupTable::ALL.iter().map(|t| Spec {
        relative: t.dir(),
        schema: t.schema(),
        rollup: Some((t.hour_column(), rollups::measure(*t))),
    }));
    // Refused before anything is written: a destination table this move did not write.
    for spec in &specs {
        let moved = to.delta().txn_version(&spec.relative, MOVED_FROM).await?;
        let held = to.delta().files(&spec.relative, AsOf::Latest).await?;
        if moved.is_none() && held.is_some_and(|f| !f.files.is_empty()) {
            return Err(MigrateError::Occupied {
                table: spec.relative.clone(),
                location: to.location(),
            });
        }
    }
    let mut moved = Moved::default();
    for (spec, raw) in specs
        .iter()
        .zip(Table::ALL.iter().map(Some).chain(std::iter::repeat(None)))
    {
        tracing::info!(table = %spec.relative, "moving a table");
        let started = Instant::now();
        let table = move_table(from, to, spec, raw.copied()).await?;
        tracing::info!(
            table = %spec.relative,
            files = table.files,
            rows = table.rows,
            elapsed_s = started.elapsed().as_secs_f64(),
            "table moved and compared"
        );
        moved.tables.push(table);
    }
    moved.state_carried = rollups::carry_state(from, to).await?;
    Ok(moved)
}

/// Copies, commits and compares one table.
async fn move_table(
    from: &Lake,
    to: &Lake,
    spec: &Spec,
    raw: Option<Table>,
) -> Result<MovedTable, MigrateError> {
    let relative = spec.relative.as_str();
    let stored = stored_schema(&spec.schema).map_err(|e| MigrateError::Read {
        path: PathBuf::from(relative),
        message: e.to_string(),
    })?;
    // A table an earlier run committed is compared with the version it copied (the old lake
    // may have moved on since).
    let moved = to.delta().txn_version(relative, MOVED_FROM).await?;
    let earlier = moved.is_some();
    let snapshot = match moved {
        None => from.delta().snapshot(relative, AsOf::Latest).await?,
        Some(-1) => None,
        Some(version) => {
            let version = u64::try_from(version).unwrap_or(0);
            from.delta()
                .snapshot(relative, AsOf::Version(version))
                .await?
        }
    };
    let mut report = MovedTable {
        table: spec.relative.clone(),
        measure: spec.rollup.map_or("ts_ms % 3600000", |(_, m)| m),
        earlier,
        ..MovedTable::default()
    };
    let mut want = Totals::new();
    let mut adds = Vec::new();
    // Old rollup files replace what the log holds for their hour (all of it, for the leases).
    let old_rollups = match RollupTable::ALL.iter().find(|t| t.dir() == spec.relative) {
        Some(table) => rollups::old_files(from, *table)?,
        None => Vec::new(),
    };
    let replaced: BTreeSet<Option<i64>> = old_rollups.iter().map(|f| f.hour).collect();
    let named: BTreeSet<String> = snapshot
        .iter()
        .flat_map(|s| s.adds.iter().map(|a| a.path.clone()))
        .collect();
    for mut add in snapshot.iter().flat_map(|s| s.adds.clone()) {
        let hour = hour_of_file(&add.path);
        if spec.rollup.is_some() && (replaced.contains(&hour) || replaced.contains(&None)) {
            continue;
        }
        // A file of the old layout adopted where it lay keeps its hour in its new name.
        let target = match add.path.contains('/') {
            true => moved_name(hour, &add.path),
            false => add.path.clone(),
        };
        let bytes = from.delta().read_file(relative, &add.path).await?;
        file_totals(&bytes, spec, hour, &add.path, &mut want)?;
        if !earlier {
            to.delta().put_missing(relative, &target, bytes).await?;
        }
        add.path = target;
        report.bytes += add.size as u64;
        adds.push(add);
    }
    // The raw files the old layout shows that the log does not name.
    if let Some(table) = raw {
        let prefix = format!("{relative}/");
        for hour in crate::migrate::old_hours(from, table)? {
            let within = hour
                .dir
                .strip_prefix(&prefix)
                .unwrap_or(&hour.dir)
                .to_string();
            let hour_ms = hour_of_file(&format!("{within}/x.parquet"));
            for (name, _) in &hour.shown {
                let path = format!("{within}/{name}");
                if named.contains(&path) {
                    continue;
                }
                let bytes = from.delta().read_file(relative, &path).await?;
                file_totals(&bytes, spec, hour_ms, &path, &mut want)?;
                let target = moved_name(hour_ms, &path);
                let add = crate::delta::add_of_file(target.clone(), &bytes, &spec.schema).map_err(
                    |message| MigrateError::Read {
                        path: PathBuf::from(&hour.dir).join(name),
                        message,
                    },
                )?;
                if !earlier {
                    to.delta().put_missing(relative, &target, bytes).await?;
                }
                report.bytes += add.size as u64;
                adds.push(add);
            }
        }
    }
    // The old rollup files, written as the table stores its rows.
    for file in &old_rollups {
        let Some(batch) = rollups::read(from, &file.path)? else {
            continue;
        };
        let measure = spec.rollup.map_or("", |(_, m)| m);
        let (rows, sum) = rollups::totals(&batch, measure)?;
        let entry = want.entry(file.hour).or_default();
        entry.0 += rows;
        entry.1 += sum;
        if !earlier {
            let name = moved_name(file.hour, &file.path.display().to_string());
            let hour = spec.rollup.and_then(|(c, _)| c).zip(file.hour);
            let add = to
                .delta()
                .put_rows(relative, &stored, name, &batch, hour)
                .await?;
            report.bytes += add.size as u64;
            adds.push(add);
        }
    }
    report.files = adds.len();
    crash_point(relative);
    // The sources' transactions the old table held at the version copied: those an earlier
    // run committed too.
    report.txns = snapshot.as_ref().map_or(0, |s| s.txns.len());
    if !earlier {
        let mut txns = snapshot
            .as_ref()
            .map(|s| s.txns.clone())
            .unwrap_or_default();
        txns.insert(
            MOVED_FROM.to_string(),
            snapshot.as_ref().map_or(-1, |s| s.version as i64),
        );
        to.delta()
            .commit_moved(relative, &spec.schema, adds, &txns)
            .await?;
    }
    // Read back through the new log, as queries read it: at the move's commit (the new lake's
    // pipeline may have committed since, when an earlier run finished).
    let at = match to.delta().version_with_txn(relative, MOVED_FROM).await? {
        Some(version) => AsOf::Version(version),
        None => AsOf::Latest,
    };
    let got = table_totals(to, spec, at).await?;
    let hours: BTreeSet<&Option<i64>> = want.keys().chain(got.keys()).collect();
    for hour in hours {
        let (want_rows, want_sum) = want.get(hour).copied().unwrap_or_default();
        let (got_rows, got_sum) = got.get(hour).copied().unwrap_or_default();
        if want_rows != got_rows || !rollups::same(want_sum, got_sum) {
            return Err(MigrateError::Mismatch {
                table: static_name(relative),
                hour: hour.map_or("all rows".to_string(), crate::lake::hour_partition),
                got_rows,
                got_sum,
                want_rows,
                want_sum,
            });
        }
        report.rows += want_rows;
        report.sum += want_sum;
    }
    if earlier {
        report.files = to
            .delta()
            .files(relative, at)
            .await?
            .map_or(0, |f| f.files.len());
    }
    Ok(report)
}

/// The table's name as [`MigrateError::Mismatch`] holds it.
fn static_name(relative: &str) -> &'static str {
    Table::ALL
        .iter()
        .map(|t| t.name())
        .chain(RollupTable::ALL.iter().map(|t| t.name()))
        .find(|n| relative.rsplit('/').next() == Some(*n))
        .unwrap_or("a table")
}

/// Adds the rows of the Parquet file `bytes` (`path`, for errors) to `totals`: a raw table's
/// by the hour of each row's `ts_ms`, summing its place in the hour; a rollup table's under
/// the file's `hour`, summing its measure.
fn file_totals(
    bytes: &bytes::Bytes,
    spec: &Spec,
    hour: Option<i64>,
    path: &str,
    totals: &mut Totals,
) -> Result<(), MigrateError> {
    let failed = |message: String| MigrateError::Read {
        path: Path::new(&spec.relative).join(path),
        message,
    };
    let column = spec.rollup.map_or("ts_ms", |(_, measure)| measure);
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
        .map_err(|e| failed(e.to_string()))?;
    let index = builder
        .parquet_schema()
        .root_schema()
        .get_fields()
        .iter()
        .position(|f| f.name() == column);
    let rows = builder.metadata().file_metadata().num_rows() as u64;
    let Some(index) = index else {
        // No measure in it: its rows count, summing nothing.
        totals.entry(hour).or_default().0 += rows;
        return Ok(());
    };
    let mask = ProjectionMask::roots(builder.parquet_schema(), [index]);
    let reader = builder
        .with_projection(mask)
        .build()
        .map_err(|e| failed(e.to_string()))?;
    for batch in reader {
        let batch = batch.map_err(|e| failed(e.to_string()))?;
        if spec.rollup.is_some() {
            let values =
                cast(batch.column(0), &DataType::Float64).map_err(|e| failed(e.to_string()))?;
            let values = values
                .as_any()
                .downcast_ref::<Float64Array>()
                .expect("cast to Float64");
            let entry = totals.entry(hour).or_default();
            entry.0 += values.len() as u64;
            entry.1 += values.iter().flatten().sum::<f64>();
        } else {
            let ts = cast(batch.column(0), &DataType::Int64).map_err(|e| failed(e.to_string()))?;
            let ts = ts
                .as_any()
                .downcast_ref::<Int64Array>()
                .expect("cast to Int64");
            for i in 0..ts.len() {
                let (key, place) = match ts.is_valid(i) {
                    true => {
                        let t = ts.value(i);
                        (Some(t - t.rem_euclid(HOUR_MS)), t.rem_euclid(HOUR_MS))
                    }
                    false => (None, 0),
                };
                let entry = totals.entry(key).or_default();
                entry.0 += 1;
                entry.1 += place as f64;
            }
        }
    }
    Ok(())
}

/// The same totals of the table in `lake` at `as_of`, through a session.
async fn table_totals(lake: &Lake, spec: &Spec, as_of: AsOf) -> Result<Totals, MigrateError> {
    let ctx = SessionContext::new();
    lake.register_object_store(&ctx);
    lake.delta()
        .register(&ctx, "t", &spec.relative, &spec.schema, as_of)?;
    let query = match spec.rollup {
        None => "SELECT ts_ms - ts_ms % 3600000, count(*), sum(CAST(ts_ms % 3600000 AS DOUBLE)) \
                 FROM t GROUP BY 1"
            .to_string(),
        Some((hour, measure)) => format!(
            r#"SELECT {h}, count(*), sum(CAST("{measure}" AS DOUBLE)) FROM t GROUP BY 1"#,
            h = hour.map_or("CAST(NULL AS BIGINT)".to_string(), |c| format!(
                r#"CAST("{c}" AS BIGINT)"#
            ))
        ),
    };
    let mut totals = Totals::new();
    for batch in ctx.sql(&query).await?.collect().await? {
        let column = |i: usize, to: &DataType| {
            cast(batch.column(i), to).map_err(datafusion::error::DataFusionError::from)
        };
        let hours = column(0, &DataType::Int64)?;
        let hours = hours
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("cast to Int64");
        let rows = column(1, &DataType::Int64)?;
        let rows = rows
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("cast to Int64");
        let sums = column(2, &DataType::Float64)?;
        let sums = sums
            .as_any()
            .downcast_ref::<Float64Array>()
            .expect("cast to Float64");
        for i in 0..batch.num_rows() {
            let hour = hours.is_valid(i).then(|| hours.value(i));
            let sum = if sums.is_valid(i) { sums.value(i) } else { 0.0 };
            totals.insert(hour, (rows.value(i) as u64, sum));
        }
    }
    Ok(totals)
}

/// `GPUWARDEN_MOVE_CRASH_AT=<table>` kills the process with SIGKILL once it has copied that
/// table's files, before its commit: for the tests that prove a move stopped anywhere is
/// finished by running it again.
fn crash_point(relative: &str) {
    if std::env::var("GPUWARDEN_MOVE_CRASH_AT").is_ok_and(|at| at == relative) {
        tracing::warn!(
            table = relative,
            "GPUWARDEN_MOVE_CRASH_AT: killing the process"
        );
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}
