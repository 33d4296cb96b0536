//! What every part of the lake shares, below all of them: its errors, how its Parquet files are
//! encoded, and how an hour is named. It knows no other module of the pipeline.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use arrow_schema::DataType;
use deltalake_core::DeltaTableError;
use gpuwarden_schema::calendar::{civil_from_days, days_from_civil};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

const HOUR_MS: i64 = 3_600_000;

/// Rows per Parquet row group: large enough to compress well, small enough to prune by.
pub const ROW_GROUP_ROWS: usize = 128 * 1024;

/// A lake operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum LakeError {
    /// A file system call failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path concerned.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Parquet encoding failed.
    #[error("writing Parquet {path}: {source}")]
    Parquet {
        /// The file being written.
        path: PathBuf,
        /// The encoder's error.
        source: parquet::errors::ParquetError,
    },
    /// The object store refused or failed a request, after its client's own retries (an
    /// external system: retried again later where the caller retries, e.g. ingest's writers).
    #[error("{action} {key} in {lake}: {source}")]
    ObjectStore {
        /// What was being done.
        action: &'static str,
        /// The object's key (empty for the store as a whole).
        key: String,
        /// The lake, `s3://bucket/prefix`.
        lake: String,
        /// The store's error (boxed: it is large, and every lake result carries the size).
        source: Box<object_store::Error>,
    },
    /// A Delta table's operation failed (its log could not be read or written, a commit
    /// conflicted with another past its retries).
    #[error(transparent)]
    Delta(#[from] DeltaError),
    /// This process no longer holds the role it was working under: its lock on the lake in a
    /// bucket expired without a renewal, or another process took the role over, or a conditional
    /// write found an object written by another holder since this one read it. Its work stops
    /// there, uncommitted; the holder now does it.
    #[error("{what} in {lake}: this process no longer holds the {role} role (its lock lapsed or another process took it over)")]
    Deposed {
        /// The role ("rollups").
        role: &'static str,
        /// What was being done.
        what: String,
        /// The lake, `s3://bucket/prefix`.
        lake: String,
    },
    /// The lake, or one of its state objects, was written by a newer gpuwarden in a format this
    /// build does not read (`_gpuwarden.json`'s layout, a state object's `version`).
    #[error(transparent)]
    TooNew(#[from] gpuwarden_schema::format::TooNew),
}

/// A Delta operation of the lake that failed, naming the table.
#[derive(Debug, thiserror::Error)]
#[error("Delta table {table} in {lake}: {source}")]
pub struct DeltaError {
    /// The table's directory, relative to the lake.
    pub table: String,
    /// The lake: its directory or `s3://bucket/prefix`.
    pub lake: String,
    /// What went wrong.
    #[source]
    pub source: Box<DeltaTableError>,
}

impl DeltaError {
    /// Whether a commit failed because another one conflicted with it.
    pub fn is_conflict(&self) -> bool {
        is_conflict(&self.source)
    }
}

/// Whether a commit failed because another one conflicted with it.
pub(crate) fn is_conflict(error: &DeltaTableError) -> bool {
    matches!(
        error,
        DeltaTableError::Transaction {
            source: deltalake_core::kernel::transaction::TransactionError::CommitConflict(_)
        }
    )
}

/// Wraps an OS error with what was being done to which path.
pub(crate) fn io<'p>(
    action: &'static str,
    path: &'p Path,
) -> impl FnOnce(std::io::Error) -> LakeError + 'p {
    move |source| LakeError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// `date=YYYY-MM-DD/hour=HH` of the hour starting at `hour_ms`.
pub fn hour_partition(hour_ms: i64) -> String {
    let days = hour_ms.div_euclid(86_400_000);
    let hour = hour_ms.rem_euclid(86_400_000) / HOUR_MS;
    let (y, m, d) = civil_from_days(days);
    format!("date={y:04}-{m:02}-{d:02}/hour={hour:02}")
}

/// The hour starting at `hour_ms` read back from its `date=YYYY-MM-DD` and `hour=HH` directory
/// names; `None` for anything else.
pub fn parse_hour_partition(date: &str, hour: &str) -> Option<i64> {
    let date = date.strip_prefix("date=")?;
    let hour: i64 = hour.strip_prefix("hour=")?.parse().ok()?;
    let mut parts = date.splitn(3, '-');
    let (y, m, d) = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || !(0..24).contains(&hour) {
        return None;
    }
    Some(days_from_civil(y, m, d) * 86_400_000 + hour * HOUR_MS)
}

/// `batch` as the bytes of a Parquet file of the lake (`relative` names it in errors).
pub(crate) fn encode(batch: &RecordBatch, relative: &Path) -> Result<Vec<u8>, LakeError> {
    let parquet = |source| LakeError::Parquet {
        path: relative.to_path_buf(),
        source,
    };
    let props = writer_properties(&batch.schema(), ROW_GROUP_ROWS).build();
    let mut writer =
        ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).map_err(parquet)?;
    writer.write(batch).map_err(parquet)?;
    writer.into_inner().map_err(parquet)
}

/// How every Parquet file of the lake is encoded: zstd, page statistics, dictionaries for text.
pub(crate) fn writer_properties(
    schema: &arrow_schema::Schema,
    row_group_rows: usize,
) -> parquet::file::properties::WriterPropertiesBuilder {
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(3).expect("level 3 is valid"),
        ))
        .set_max_row_group_row_count(Some(row_group_rows))
        .set_statistics_enabled(EnabledStatistics::Page)
        // Dictionaries pay off for names (hosts, GPUs, models, leases), which repeat, and
        // cost time for measurements, which rarely do.
        .set_dictionary_enabled(false);
    for field in schema.fields() {
        if matches!(field.data_type(), DataType::Utf8 | DataType::LargeUtf8) {
            props =
                props.set_column_dictionary_enabled(ColumnPath::from(field.name().as_str()), true);
        }
    }
    props
}

/// Writes `bytes` to `tmp`, syncs it and renames it over `path`, then syncs the directory: a
/// reader finds the old contents or the new, and a crash leaves at most `tmp` behind.
pub(crate) fn replace_durably(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<(), LakeError> {
    let mut file = File::create(tmp).map_err(io("creating", tmp))?;
    file.write_all(bytes).map_err(io("writing", tmp))?;
    file.sync_all().map_err(io("syncing", tmp))?;
    fs::rename(tmp, path).map_err(io("renaming into", path))?;
    sync_dir(path.parent().expect("a file lives in a directory"))
}

/// Syncs a directory, so that the renames and removals in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), LakeError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hour_partitions_read_back() {
        for hour in [
            0,
            1_764_547_200_000,
            1_709_164_800_000 + 23 * HOUR_MS,
            -HOUR_MS,
        ] {
            let partition = hour_partition(hour);
            let (date, h) = partition.split_once('/').unwrap();
            assert_eq!(parse_hour_partition(date, h), Some(hour), "{partition}");
        }
        assert_eq!(parse_hour_partition("date=2026-13-01", "hour=00"), None);
    }
}
