//! Moving a lake's rollup tables from the layout before Delta into their Delta tables
//! (`gpuwarden lake migrate`, docs/src/contributors/lake.md#delta-tables).
//!
//! Before Delta, each hour of a rollup table was one Parquet file,
//! `rollups/<table>/date=YYYY-MM-DD/hour=HH/rollup.parquet` (in a bucket
//! `rollup.v<n:010>.parquet`, the highest `n` the hour's file), and the leases one file,
//! `rollups/leases/leases.parquet` (`leases.v<n:010>.parquet`). A migration replaces each such
//! hour of the Delta table with that file's rows (a commit each, as the rollups would), then
//! reads the tables back and compares, hour by hour, the rows and the sum of a measure with
//! the old files'; only when every hour agrees does it delete the old files. Each step can be
//! repeated: a migration stopped anywhere is finished by running it again, and the rollups
//! refuse to run while old files are left, so they never replace an hour the migration has
//! yet to compare.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow_array::{Array, Float64Array, RecordBatch, RecordBatchReader as _};
use bytes::Bytes;
use datafusion::arrow::compute::{cast, concat_batches, sum};
use datafusion::prelude::SessionContext;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::RollupTable;
use crate::delta::AsOf;
use crate::lake::{parse_hour_partition, Lake, LakeError, Role};
pub use crate::migrate::MigrateError;

/// An old rollup file: where it is, and the hour it holds (`None` for the leases).
#[derive(Debug, Clone)]
pub struct OldFile {
    /// Relative to the lake.
    pub path: PathBuf,
    /// The hour's start, Unix epoch milliseconds.
    pub hour: Option<i64>,
    /// Older versions of it in a bucket (`rollup.v<n>` below the highest), deleted with it.
    pub older: Vec<PathBuf>,
}

/// What a migration did to one table.
#[derive(Debug, Clone, Default)]
pub struct TableMigration {
    /// The table.
    pub table: &'static str,
    /// Old files (hours, or the leases file) moved into the Delta table.
    pub files: usize,
    /// Their rows.
    pub rows: u64,
    /// The sum of the table's measure over them ([`measure`]), equal in the Delta table.
    pub sum: f64,
    /// Old objects deleted once compared (the files and their older versions).
    pub deleted: usize,
}

/// The column a migration sums to compare a table with its old files.
pub fn measure(table: RollupTable) -> &'static str {
    match table {
        RollupTable::GpuHourly => "observed_gpu_hours",
        RollupTable::LeaseHourly | RollupTable::TeamHourly => "cost_usd",
        RollupTable::FocusCosts => "BilledCost",
        RollupTable::Leases => "gpu_count",
    }
}

/// The old files of `table` in `lake`, hour by hour.
pub fn old_files(lake: &Lake, table: RollupTable) -> Result<Vec<OldFile>, LakeError> {
    let dir = PathBuf::from(table.dir());
    let stem = if table == RollupTable::Leases {
        "leases"
    } else {
        "rollup"
    };
    // Every name the old layout used, relative to the table's directory.
    let names: Vec<PathBuf> = match lake.objects() {
        Some(objects) => objects.list(&dir)?,
        None => {
            let mut found = Vec::new();
            let mut dirs = vec![PathBuf::new()];
            while let Some(sub) = dirs.pop() {
                let entries = match std::fs::read_dir(lake.root().join(&dir).join(&sub)) {
                    Ok(entries) => entries,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(crate::lake::io("listing", &lake.root().join(&dir))(e));
                    }
                };
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let kind = entry
                        .file_type()
                        .map_err(crate::lake::io("listing", &entry.path()))?;
                    if kind.is_dir() && (name.starts_with("date=") || name.starts_with("hour=")) {
                        dirs.push(sub.join(&name));
                    } else if kind.is_file() {
                        found.push(sub.join(&name));
                    }
                }
            }
            found
        }
    };
    // (hour directory) → [(version, name)]; a directory's `<stem>.parquet` is version 0.
    let mut by_dir: BTreeMap<PathBuf, Vec<(u64, PathBuf)>> = BTreeMap::new();
    for name in names {
        let Some(file) = name.file_name().and_then(|f| f.to_str()) else {
            continue;
        };
        let version = if file == format!("{stem}.parquet") {
            0
        } else if let Some(n) = file
            .strip_prefix(&format!("{stem}.v"))
            .and_then(|rest| rest.strip_suffix(".parquet"))
            .filter(|n| n.len() == 10 && n.bytes().all(|b| b.is_ascii_digit()))
        {
            n.parse().unwrap_or(0)
        } else {
            continue;
        };
        let parent = name.parent().map(Path::to_path_buf).unwrap_or_default();
        by_dir
            .entry(parent)
            .or_default()
            .push((version, dir.join(&name)));
    }
    let mut files = Vec::new();
    for (parent, mut versions) in by_dir {
        let hour = if table == RollupTable::Leases {
            if !parent.as_os_str().is_empty() {
                continue;
            }
            None
        } else {
            let parts: Vec<&str> = parent.iter().filter_map(|p| p.to_str()).collect();
            match parts.as_slice() {
                [date, hour] => parse_hour_partition(date, hour),
                _ => None,
            }
        };
        if table != RollupTable::Leases && hour.is_none() {
            continue;
        }
        versions.sort();
        let (_, latest) = versions.pop().expect("a directory listed has a file");
        files.push(OldFile {
            path: latest,
            hour,
            older: versions.into_iter().map(|(_, p)| p).collect(),
        });
    }
    Ok(files)
}

/// Whether any rollup table still has old files: the rollups must not run until they are
/// migrated. Returns the tables that have.
pub fn tables_with_old_files(lake: &Lake) -> Result<Vec<&'static str>, LakeError> {
    let mut tables = Vec::new();
    for table in RollupTable::ALL {
        if !old_files(lake, table)?.is_empty() {
            tables.push(table.name());
        }
    }
    Ok(tables)
}

pub(crate) fn read(lake: &Lake, path: &Path) -> Result<Option<RecordBatch>, MigrateError> {
    let bytes = match lake.objects() {
        Some(objects) => match objects.get(path)? {
            Some(bytes) => bytes,
            None => return Ok(None),
        },
        None => match std::fs::read(lake.root().join(path)) {
            Ok(bytes) => Bytes::from(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(crate::lake::io("reading", &lake.root().join(path))(e).into()),
        },
    };
    let failed = |message: String| MigrateError::Read {
        path: path.to_path_buf(),
        message,
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
        .and_then(|b| b.build())
        .map_err(|e| failed(e.to_string()))?;
    let schema = reader.schema();
    let batches = reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| failed(e.to_string()))?;
    Ok(Some(
        concat_batches(&schema, &batches).map_err(|e| failed(e.to_string()))?,
    ))
}

/// Rows and the sum of `column`.
pub(crate) fn totals(batch: &RecordBatch, column: &str) -> Result<(u64, f64), MigrateError> {
    let Some(values) = batch.column_by_name(column) else {
        return Ok((batch.num_rows() as u64, 0.0));
    };
    let values = cast(values, &arrow_schema::DataType::Float64)
        .map_err(datafusion::error::DataFusionError::from)?;
    let values = values
        .as_any()
        .downcast_ref::<Float64Array>()
        .expect("cast to Float64");
    Ok((batch.num_rows() as u64, sum(values).unwrap_or(0.0)))
}

/// Whether two sums are the same to within the rounding of their addition order.
pub(crate) fn same(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Migrates every rollup table of `lake` (see the module's documentation). `stop_before_delete`
/// stops after the comparison, leaving the old files (the tests' crash point).
pub async fn migrate(
    lake: &Lake,
    stop_before_delete: bool,
) -> Result<Vec<TableMigration>, MigrateError> {
    let Some(lock) = lake.try_lock(Role::Rollups)? else {
        return Err(MigrateError::Busy(lake.location()));
    };
    let mut reports = Vec::new();
    let mut to_delete = Vec::new();
    for table in RollupTable::ALL {
        let files = old_files(lake, table)?;
        let mut report = TableMigration {
            table: table.name(),
            ..TableMigration::default()
        };
        let mut expected: BTreeMap<Option<i64>, (u64, f64)> = BTreeMap::new();
        for file in &files {
            lock.check("migrating the rollup tables")?;
            let Some(batch) = read(lake, &file.path)? else {
                continue;
            };
            let (rows, total) = totals(&batch, measure(table))?;
            lake.delta()
                .replace(
                    &table.dir(),
                    &table.schema(),
                    table.hour_column().zip(file.hour),
                    Some(&batch),
                )
                .await?;
            expected.insert(file.hour, (rows, total));
            report.files += 1;
            report.rows += rows;
            report.sum += total;
            tracing::debug!(table = table.name(), path = %file.path.display(), rows, "migrated");
        }
        // Read back through a session, as queries read the table.
        if !expected.is_empty() {
            let ctx = SessionContext::new();
            lake.delta()
                .register(&ctx, "t", &table.dir(), &table.schema(), AsOf::Latest)?;
            let hour = table
                .hour_column()
                .map_or("NULL".to_string(), |c| format!(r#"CAST("{c}" AS BIGINT)"#));
            let query = format!(
                r#"SELECT {hour} AS h, count(*) AS n, sum(CAST("{m}" AS DOUBLE)) AS s FROM t GROUP BY 1"#,
                m = measure(table)
            );
            let mut got: BTreeMap<Option<i64>, (u64, f64)> = BTreeMap::new();
            for batch in ctx.sql(&query).await?.collect().await? {
                let h = cast(batch.column(0), &arrow_schema::DataType::Int64)
                    .map_err(datafusion::error::DataFusionError::from)?;
                let h = h
                    .as_any()
                    .downcast_ref::<arrow_array::Int64Array>()
                    .expect("cast to Int64");
                let n = cast(batch.column(1), &arrow_schema::DataType::Int64)
                    .map_err(datafusion::error::DataFusionError::from)?;
                let n = n
                    .as_any()
                    .downcast_ref::<arrow_array::Int64Array>()
                    .expect("cast to Int64");
                let s = batch
                    .column(2)
                    .as_any()
                    .downcast_ref::<Float64Array>()
                    .expect("a sum of doubles");
                for i in 0..batch.num_rows() {
                    // Timestamps cast to BIGINT are in the table's unit: milliseconds.
                    let hour = (table.hour_column().is_some() && h.is_valid(i)).then(|| h.value(i));
                    let total = if s.is_valid(i) { s.value(i) } else { 0.0 };
                    got.insert(hour, (n.value(i) as u64, total));
                }
            }
            for (hour, (want_rows, want_sum)) in &expected {
                let (got_rows, got_sum) = got.get(hour).copied().unwrap_or((0, 0.0));
                if got_rows != *want_rows || !same(got_sum, *want_sum) {
                    return Err(MigrateError::Mismatch {
                        table: table.name(),
                        hour: hour.map_or("all rows".to_string(), crate::lake::hour_partition),
                        got_rows,
                        got_sum,
                        want_rows: *want_rows,
                        want_sum: *want_sum,
                    });
                }
            }
        }
        for file in files {
            to_delete.push(file.path);
            to_delete.extend(file.older);
        }
        reports.push(report);
    }
    if stop_before_delete {
        return Ok(reports);
    }
    // Every table compared: the old files go.
    for path in to_delete {
        let table = reports
            .iter_mut()
            .find(|r| path.starts_with(format!("{}/{}", super::tables::DIR, r.table)));
        let removed = match lake.objects() {
            Some(objects) => {
                objects.delete(&path)?;
                true
            }
            None => {
                let full = lake.root().join(&path);
                match std::fs::remove_file(&full) {
                    Ok(()) => {
                        // Empty hour and date directories go with their last file.
                        let mut dir = full.parent();
                        while let Some(d) = dir.filter(|d| {
                            d.file_name()
                                .and_then(|n| n.to_str())
                                .is_some_and(|n| n.starts_with("date=") || n.starts_with("hour="))
                        }) {
                            if std::fs::remove_dir(d).is_err() {
                                break;
                            }
                            dir = d.parent();
                        }
                        true
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                    Err(e) => return Err(crate::lake::io("removing", &full)(e).into()),
                }
            }
        };
        if let (true, Some(report)) = (removed, table) {
            report.deleted += 1;
        }
    }
    drop(lock);
    Ok(reports)
}

/// Carries the rollups' state (`rollups/_state.json`, `rollups/_hosts.json`) of `from` to `to`,
/// a lake whose tables a move has just copied from it (`relocate`), unless `to` has one
/// already (written by an earlier run of the move, or by its own rollups). The hours computed,
/// the watermark and the hosts' times stay; the versions read name `to`'s tables (their
/// versions now), so every hour whose rows changed in `from` after the versions its rollups
/// read is made pending: `to`'s first run computes it. Returns whether it wrote the state.
///
/// Both lakes' rollups role must be held: `from`'s state cannot change meanwhile.
pub(crate) async fn carry_state(from: &Lake, to: &Lake) -> Result<bool, MigrateError> {
    let state_path = Path::new(super::tables::DIR).join("_state.json");
    let hosts_path = Path::new(super::tables::DIR).join("_hosts.json");
    if to.read_state(&state_path)?.is_some() {
        return Ok(false);
    }
    let state_error = |e: super::RollupError| MigrateError::Read {
        path: state_path.clone(),
        message: e.to_string(),
    };
    let (mut state, _) = super::State::load(from, &state_path).map_err(state_error)?;
    let samples = crate::buffer::Table::Samples.name();
    let leases = crate::buffer::Table::LeaseEvents.name();
    let mut read = BTreeMap::new();
    for name in [samples, leases] {
        // The hours changed since `from`'s rollups read, up to its latest version: at or after
        // the version copied.
        let changed = from
            .delta()
            .changed_hours(name, state.read.get(name).copied())
            .await?;
        let Some((_, Some(hours))) = changed else {
            // Not read yet, or beyond the log: `to`'s rollups take every hour as changed.
            continue;
        };
        if name == samples {
            state
                .pending
                .extend(hours.iter().flat_map(|&h| [h - super::HOUR_MS, h]));
        } else if let Some(&first) = hours.first() {
            // A lease event changes attribution from its own time on.
            let later: Vec<i64> = state.hours.range(first..).map(|(h, _)| *h).collect();
            state.pending.extend(later);
        }
        if let Some(files) = to.delta().files(name, AsOf::Latest).await? {
            read.insert(name.to_string(), files.version);
        }
    }
    state.read = read;
    if let Some((hosts, _)) = from.read_state(&hosts_path)? {
        if to.read_state(&hosts_path)?.is_none() {
            to.write_state(&hosts_path, hosts, &mut Default::default(), Role::Rollups)?;
        }
    }
    let bytes = serde_json::to_vec(&state.written()).expect("the state serializes");
    to.write_state(&state_path, bytes, &mut Default::default(), Role::Rollups)?;
    Ok(true)
}
