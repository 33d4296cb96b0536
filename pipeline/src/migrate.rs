//! Moving a lake's raw tables from the layout before Delta into their Delta tables, in place
//! (`gpuwarden lake migrate`, docs/src/contributors/lake.md#moving-a-lake-to-delta).
//!
//! Before Delta, a raw table was `<table>/date=YYYY-MM-DD/hour=HH/*.parquet`, read by
//! gpuwarden's own rules: an hour's `_compaction.json` names its current compacted outputs
//! (`compact-g*` files) and the ingest files they `superseded`; every other Parquet file that is
//! not a temporary counts. A migration commits, hour by hour, the files those rules show to the
//! table's Delta log where they lie (an add each, with statistics from its footer; nothing is
//! copied), reads back the files its latest version names and compares their rows and the sum of
//! `ts_ms` with the old files', and only then deletes what the old rules hid (superseded and
//! uncommitted files, manifests, temporaries) and the old layout's bookkeeping (`_recompute/`,
//! `_versions/`, `_ingest/`, `_compaction/`). Each step can be repeated: files the log names
//! already are not added again, so a migration stopped anywhere is finished by running it again.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Array, Int64Array};
use datafusion::prelude::SessionContext;
use object_store::ObjectStoreExt as _;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use serde::Deserialize;

use crate::buffer::Table;
use crate::delta::AsOf;
use crate::lake::{parse_hour_partition, Lake, LakeError};

/// A migration (of the raw tables, or of the rollup tables: `rollup::migrate`) that
/// could not finish. What it committed stays: running it again goes on.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Reading or removing the old files failed.
    #[error(transparent)]
    Lake(#[from] LakeError),
    /// A commit to a Delta table failed.
    #[error(transparent)]
    Delta(#[from] crate::delta::DeltaError),
    /// An old file could not be decoded.
    #[error("reading {path}: {message}")]
    Read {
        /// The file, relative to the lake.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The tables read back differ from the old files: nothing was deleted.
    #[error(
        "{table}: {hour} holds {got_rows} rows summing {got_sum} in the Delta table, the old \
         file {want_rows} rows summing {want_sum}; the old files are kept"
    )]
    Mismatch {
        /// The table.
        table: &'static str,
        /// The hour (`date=…/hour=…`), or `all rows` for `leases`.
        hour: String,
        /// Rows and measure in the Delta table.
        got_rows: u64,
        got_sum: f64,
        /// Rows and measure in the old file.
        want_rows: u64,
        want_sum: f64,
    },
    /// A move (`gpuwarden lake migrate --to`) to the lake's own location.
    #[error("the new location {0} is the lake itself: to migrate in place, leave out --to")]
    SameLocation(String),
    /// A move's new location holds a table that no move wrote: another lake.
    #[error(
        "{location} already holds {table}, a table not written by a move of this lake: move to \
         an empty location"
    )]
    Occupied {
        /// The table's directory.
        table: String,
        /// The new location.
        location: String,
    },
    /// Another process holds the rollups role.
    #[error("another process is rolling up {0}; stop it (or wait for its run) and migrate again")]
    Busy(String),
    /// Reading the tables back failed.
    #[error("reading the Delta tables back: {0}")]
    Query(#[from] datafusion::error::DataFusionError),
}

/// The old layout's bookkeeping at the lake's root, deleted once every table is migrated.
const OLD_STATE: [&str; 4] = ["_recompute", "_versions", "_ingest", "_compaction"];

/// What a migration did to one raw table.
#[derive(Debug, Clone, Default)]
pub struct RawMigration {
    /// The table.
    pub table: &'static str,
    /// Hours with old files.
    pub hours: usize,
    /// Files of the old layout the table's log names now (committed by this run or an earlier
    /// one that stopped).
    pub files: usize,
    /// Rows the old rules show, equal to what the Delta table reads.
    pub rows: u64,
    /// Old objects deleted once compared (hidden files, manifests, temporaries).
    pub deleted: usize,
}

/// An hour's `_compaction.json`, as far as a reader needed it.
#[derive(Debug, Default, Deserialize)]
struct Manifest {
    #[serde(default)]
    outputs: Vec<String>,
    #[serde(default)]
    superseded: BTreeSet<String>,
}

/// One old hour directory: its files, and which of them the old rules show.
pub(crate) struct OldHour {
    /// `<table>/date=…/hour=…`, relative to the lake.
    pub(crate) dir: String,
    /// Every object in it, by name, with its size.
    entries: Vec<(String, u64)>,
    /// The Parquet files a reader counted.
    pub(crate) shown: Vec<(String, u64)>,
}

/// The old hour directories of `table`, ascending.
pub(crate) fn old_hours(lake: &Lake, table: Table) -> Result<Vec<OldHour>, MigrateError> {
    let mut dirs: Vec<(i64, String)> = Vec::new();
    let name = table.name();
    match lake.objects() {
        Some(objects) => {
            for date in objects.subdirs(Path::new(name))? {
                for hour in objects.subdirs(&Path::new(name).join(&date))? {
                    if let Some(h) = parse_hour_partition(&date, &hour) {
                        dirs.push((h, format!("{name}/{date}/{hour}")));
                    }
                }
            }
        }
        None => {
            for date in std::fs::read_dir(lake.root().join(name))
                .into_iter()
                .flatten()
                .flatten()
            {
                let date_name = date.file_name().to_string_lossy().into_owned();
                for hour in std::fs::read_dir(date.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let hour_name = hour.file_name().to_string_lossy().into_owned();
                    if let Some(h) = parse_hour_partition(&date_name, &hour_name) {
                        dirs.push((h, format!("{name}/{date_name}/{hour_name}")));
                    }
                }
            }
        }
    }
    dirs.sort();
    let mut hours = Vec::with_capacity(dirs.len());
    for (_, dir) in dirs {
        let entries: Vec<(String, u64)> = match lake.objects() {
            Some(objects) => objects.list_dir(Path::new(&dir))?,
            None => std::fs::read_dir(lake.root().join(&dir))
                .map_err(crate::lake::io("listing", &lake.root().join(&dir)))?
                .flatten()
                .map(|e| {
                    let size = e.metadata().map_or(0, |m| m.len());
                    (e.file_name().to_string_lossy().into_owned(), size)
                })
                .collect(),
        };
        let manifest: Manifest = match entries.iter().any(|(n, _)| n == "_compaction.json") {
            false => Manifest::default(),
            true => {
                let path = PathBuf::from(&dir).join("_compaction.json");
                let bytes = match lake.objects() {
                    Some(objects) => objects.get(&path)?.map(|b| b.to_vec()).unwrap_or_default(),
                    None => std::fs::read(lake.root().join(&path))
                        .map_err(crate::lake::io("reading", &lake.root().join(&path)))?,
                };
                serde_json::from_slice(&bytes).map_err(|e| MigrateError::Read {
                    path,
                    message: format!(
                        "unreadable ({e}): restore it from a backup, or remove it if the hour \
                         holds no compact-g files"
                    ),
                })?
            }
        };
        let shown = entries
            .iter()
            .filter(|(n, _)| n.ends_with(".parquet") && !n.starts_with('.'))
            .filter(|(n, _)| {
                if n.starts_with("compact-g") {
                    manifest.outputs.iter().any(|o| o == n)
                } else {
                    !manifest.superseded.contains(n)
                }
            })
            .cloned()
            .collect();
        hours.push(OldHour {
            dir,
            entries,
            shown,
        });
    }
    Ok(hours)
}

/// The raw tables whose old layout holds files their Delta log does not name yet: what
/// `gpuwarden lake migrate` has still to move.
pub fn raw_tables_to_migrate(lake: &Lake) -> Result<Vec<&'static str>, MigrateError> {
    let mut tables = Vec::new();
    for table in Table::ALL {
        let hours = old_hours(lake, table)?;
        if hours.iter().all(|h| h.shown.is_empty()) {
            continue;
        }
        let named: BTreeSet<String> =
            match crate::delta::block_on(lake.delta().files(table.name(), AsOf::Latest))? {
                Some(files) => files.files.into_iter().map(|f| f.path).collect(),
                None => BTreeSet::new(),
            };
        let prefix = format!("{}/", table.name());
        if hours.iter().any(|h| {
            h.shown.iter().any(|(n, _)| {
                !named.contains(&format!(
                    "{}/{n}",
                    h.dir.strip_prefix(&prefix).unwrap_or(&h.dir)
                ))
            })
        }) {
            tables.push(table.name());
        }
    }
    Ok(tables)
}

/// Refuses a lake whose ingest stopped without clearing its flush journal: those files' offsets
/// may be uncommitted, and the consumer would read them again.
pub(crate) fn check_no_journal(lake: &Lake) -> Result<(), MigrateError> {
    let journals: Vec<PathBuf> = match lake.objects() {
        Some(objects) => objects.list(Path::new("_ingest"))?,
        None => std::fs::read_dir(lake.root().join("_ingest"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| PathBuf::from(e.file_name()))
            .collect(),
    };
    let journals: Vec<String> = journals
        .iter()
        .map(|p| p.display().to_string())
        .filter(|n| n.ends_with(".intent.json"))
        .collect();
    if journals.is_empty() {
        return Ok(());
    }
    Err(MigrateError::Read {
        path: PathBuf::from("_ingest"),
        message: format!(
            "flush journals of an ingest that did not stop cleanly: {}; their files' Kafka \
             offsets may be uncommitted. Start the gpuwarden that wrote the lake once and stop \
             it cleanly (its ingest removes or keeps those files), then migrate",
            journals.join(", ")
        ),
    })
}

/// The Parquet footer of the object `path` (`size` bytes), read with ranged GETs of its end, not
/// the whole file. (Bounded ranges, not suffix ranges: s3s-fs answers 500 to a suffix longer
/// than the object.)
async fn footer(
    store: &dyn object_store::ObjectStore,
    path: &str,
    size: u64,
) -> Result<ParquetMetaData, String> {
    let location = object_store::path::Path::from(path);
    let mut want = size.min(64 * 1024);
    loop {
        let tail = store
            .get_range(&location, size - want..size)
            .await
            .map_err(|e| e.to_string())?;
        let mut reader = ParquetMetaDataReader::new();
        match reader.try_parse_sized(&tail, size) {
            Ok(()) => return reader.finish().map_err(|e| e.to_string()),
            Err(parquet::errors::ParquetError::NeedMoreData(n))
                if (n as u64) > want && (n as u64) <= size =>
            {
                want = n as u64;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Rows and the sum of `ts_ms` of the files at `urls`, read as Parquet files.
async fn totals(
    lake: &Lake,
    ctx: &SessionContext,
    name: &str,
    paths: &[&str],
    table: Table,
) -> Result<(u64, i64), MigrateError> {
    if paths.is_empty() {
        return Ok((0, 0));
    }
    lake.delta()
        .register_files(ctx, name, table.name(), paths, table.schema())?;
    let result = query_totals(ctx, name).await;
    ctx.deregister_table(name)?;
    result
}

async fn query_totals(ctx: &SessionContext, name: &str) -> Result<(u64, i64), MigrateError> {
    let batches = ctx
        .sql(&format!(
            "SELECT count(*), CAST(sum(ts_ms) AS BIGINT) FROM {name}"
        ))
        .await?
        .collect()
        .await?;
    let value = |i: usize| {
        batches
            .first()
            .and_then(|b| b.column(i).as_any().downcast_ref::<Int64Array>().cloned())
            .filter(|a| a.is_valid(0))
            .map_or(0, |a| a.value(0))
    };
    Ok((value(0) as u64, value(1)))
}

/// Migrates every raw table of `lake` in place; `keep_old_files` compares but deletes nothing.
pub async fn migrate_raw(
    lake: &Lake,
    keep_old_files: bool,
) -> Result<Vec<RawMigration>, MigrateError> {
    check_no_journal(lake)?;
    // The rollups read the raw tables: none runs meanwhile.
    let Some(_role) = lake.try_lock(crate::lake::Role::Rollups)? else {
        return Err(MigrateError::Busy(lake.location()));
    };
    let ctx = SessionContext::new();
    lake.register_object_store(&ctx);
    let mut reports = Vec::new();
    for table in Table::ALL {
        let hours = tokio::task::block_in_place(|| old_hours(lake, table))?;
        let mut report = RawMigration {
            table: table.name(),
            hours: hours.iter().filter(|h| !h.shown.is_empty()).count(),
            ..RawMigration::default()
        };
        if hours.is_empty() {
            reports.push(report);
            continue;
        }
        let prefix = format!("{}/", table.name());
        let relative = |h: &OldHour, name: &str| {
            format!("{}/{name}", h.dir.strip_prefix(&prefix).unwrap_or(&h.dir))
        };
        for hour in &hours {
            let named: BTreeSet<String> =
                match lake.delta().files(table.name(), AsOf::Latest).await? {
                    Some(files) => files.files.into_iter().map(|f| f.path).collect(),
                    None => BTreeSet::new(),
                };
            let store = lake.delta().log_store(table.name())?.object_store(None);
            let mut adopted = Vec::new();
            for (name, size) in &hour.shown {
                let path = relative(hour, name);
                if named.contains(&path) {
                    continue;
                }
                let metadata = footer(store.as_ref(), &path, *size)
                    .await
                    .map_err(|message| MigrateError::Read {
                        path: PathBuf::from(&hour.dir).join(name),
                        message,
                    })?;
                adopted.push((path, *size as i64, Arc::new(metadata)));
            }
            if !adopted.is_empty() {
                lake.delta()
                    .adopt(table.name(), &table.schema(), adopted)
                    .await?;
            }
        }
        // Compare: what the old rules showed, read as plain Parquet files, against the table
        // read through its Delta log.
        let old: BTreeSet<String> = hours
            .iter()
            .flat_map(|h| {
                h.shown
                    .iter()
                    .map(|(n, _)| relative(h, n))
                    .collect::<Vec<_>>()
            })
            .collect();
        let old_paths: Vec<&str> = old.iter().map(String::as_str).collect();
        let want = totals(lake, &ctx, "old_files", &old_paths, table).await?;
        let files = lake.delta().files(table.name(), AsOf::Latest).await?;
        let adopted: Vec<&str> = files
            .iter()
            .flat_map(|f| f.files.iter())
            .filter(|f| old.contains(&f.path))
            .map(|f| f.path.as_str())
            .collect();
        let missing = old.len() - adopted.len();
        let got = totals(lake, &ctx, "adopted", &adopted, table).await?;
        if missing > 0 || got != want {
            return Err(MigrateError::Mismatch {
                table: table.name(),
                hour: format!("{} old hours ({missing} files not in the log)", hours.len()),
                got_rows: got.0,
                got_sum: got.1 as f64,
                want_rows: want.0,
                want_sum: want.1 as f64,
            });
        }
        report.rows = want.0;
        report.files = old.len();
        if !keep_old_files {
            for hour in &hours {
                let shown: BTreeSet<&str> = hour.shown.iter().map(|(n, _)| n.as_str()).collect();
                for (name, _) in &hour.entries {
                    if shown.contains(name.as_str()) {
                        continue;
                    }
                    let path = PathBuf::from(&hour.dir).join(name);
                    match lake.objects() {
                        Some(objects) => objects.delete(&path)?,
                        None => {
                            let full = lake.root().join(&path);
                            if full.is_dir() {
                                continue;
                            }
                            std::fs::remove_file(&full)
                                .map_err(crate::lake::io("removing", &full))?;
                        }
                    }
                    report.deleted += 1;
                }
            }
        }
        reports.push(report);
    }
    if !keep_old_files {
        for dir in OLD_STATE {
            match lake.objects() {
                Some(objects) => {
                    for key in objects.list(Path::new(dir))? {
                        objects.delete(&Path::new(dir).join(key))?;
                    }
                }
                None => {
                    let full = lake.root().join(dir);
                    match std::fs::remove_dir_all(&full) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(crate::lake::io("removing", &full)(e).into())
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(reports)
}
