//! Retention: the hours of the raw tables older than `[pipeline.retention]` allows, measured back
//! from the rollups' watermark, are deleted, logged and counted (docs/ARCHITECTURE.md#retention). The rollups, the lease events and the
//! actions are kept.

use std::fs;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::time::Duration;

use gpuwarden_schema::config::PipelineConfig;

use crate::buffer::Table;
use crate::lake::{hour_partition, io, Lake, LakeError};

const HOUR_MS: i64 = 3_600_000;

/// How long each table with a limit is kept after its hours end. Samples are kept at least an
/// hour longer than `pipeline.clock.max_age`, the oldest a sample from Kafka may be: a late
/// sample never lands in an hour already deleted, where the rollups would recompute the hour
/// from it alone.
pub fn limits(config: &PipelineConfig) -> Vec<(Table, Duration)> {
    let floor = config.clock.max_age.max(config.lateness) + Duration::from_secs(3600);
    let retention = &config.retention;
    [
        (
            Table::Samples,
            retention.samples.map(|kept| kept.max(floor)),
        ),
        (Table::Signals, retention.signals),
        (Table::Quarantine, retention.quarantine),
    ]
    .into_iter()
    .filter_map(|(table, kept)| Some((table, kept?)))
    .collect()
}

/// What one table's retention deleted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The table.
    pub table: &'static str,
    /// Hours deleted.
    pub hours: usize,
    /// Parquet files deleted.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Deletes the hours of `table` that ended more than `kept` before `watermark` (the event time
/// the fleet has reached). A file a running query listed stays readable by it for a while
/// ([`crate::versions`]).
pub fn expire(
    lake: &Lake,
    table: Table,
    kept: Duration,
    watermark: i64,
) -> Result<Expired, LakeError> {
    let kept_ms = gpuwarden_schema::clock::duration_ms(kept);
    let mut expired = Expired {
        table: table.name(),
        ..Expired::default()
    };
    for hour in lake.hours(table.name())? {
        if hour.saturating_add(HOUR_MS).saturating_add(kept_ms) > watermark {
            break;
        }
        let dir = lake.hour_dir(table.name(), hour);
        let relative = PathBuf::from(table.name()).join(hour_partition(hour));
        let (mut files, mut bytes) = (0, 0);
        if let Some(objects) = lake.objects() {
            // Retired like any replaced file: a query that listed one still reads it.
            for (name, size) in objects.list_dir(&relative)? {
                let parquet = name.ends_with(".parquet") && !name.starts_with('.');
                if objects.retire(&relative.join(&name))? && parquet {
                    files += 1;
                    bytes += size;
                }
            }
        } else {
            for entry in fs::read_dir(&dir).map_err(io("listing", &dir))? {
                let entry = entry.map_err(io("listing", &dir))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(".parquet") && !name.starts_with('.') {
                    let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
                    if lake.remove(&relative.join(&name))? {
                        files += 1;
                        bytes += size;
                    }
                } else {
                    match fs::remove_file(entry.path()) {
                        Err(e) if e.kind() != ErrorKind::NotFound => {
                            return Err(io("removing", &entry.path())(e));
                        }
                        _ => {}
                    }
                }
            }
            match fs::remove_dir(&dir) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(io("removing", &dir)(e)),
                _ => {}
            }
            if let Some(date) = dir.parent() {
                // Only an empty day goes; the next hour may be in it.
                let _ = fs::remove_dir(date);
            }
        }
        // The marks of an hour with no samples left would make the rollups recompute it
        // from nothing.
        lake.clear_mark(table.name(), hour)?;
        tracing::info!(
            table = table.name(),
            hour = %hour_partition(hour),
            files,
            bytes,
            kept_days = kept.as_secs_f64() / 86_400.0,
            "deleted an hour past its retention"
        );
        expired.hours += 1;
        expired.files += files;
        expired.bytes += bytes;
    }
    Ok(expired)
}
