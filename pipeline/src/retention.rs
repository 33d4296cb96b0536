//! Retention: the hours of the raw tables older than `[pipeline.retention]` allows, measured back
//! from the rollups' watermark, are deleted, logged and counted
//! (docs/src/contributors/lake.md#retention). The rollups, the lease events and the actions are kept.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuwarden_schema::config::PipelineConfig;

use crate::buffer::Table;
use crate::delta::{AsOf, DataFile};
use crate::lake::{hour_partition, Lake, LakeError};

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
    /// Parquet files removed from the table.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Deletes the hours of `table` that ended more than `kept` before `watermark` (the event time
/// the fleet has reached), in one commit (Delta's DELETE of their files). Their bytes go when
/// VACUUM deletes the files, [`crate::delta::KEEP_REMOVED`] later: until then `--as-of` a
/// version before the deletion still reads them.
pub async fn expire(
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
    let Some(files) = lake.delta().files(table.name(), AsOf::Latest).await? else {
        return Ok(expired);
    };
    let mut hours: BTreeMap<i64, Vec<DataFile>> = BTreeMap::new();
    for file in files.files {
        let Some(hour) = file.hour_ms else { continue };
        if hour.saturating_add(HOUR_MS).saturating_add(kept_ms) <= watermark {
            hours.entry(hour).or_default().push(file);
        }
    }
    let Some(last) = hours.keys().next_back().copied() else {
        return Ok(expired);
    };
    let removed: Vec<DataFile> = hours.values().flatten().cloned().collect();
    let version = lake
        .delta()
        .remove_files(
            table.name(),
            files.version,
            &removed,
            &format!("ts_ms < {}", last + HOUR_MS),
        )
        .await?;
    for (hour, files) in &hours {
        let bytes: u64 = files.iter().map(|f| f.size.max(0) as u64).sum();
        tracing::info!(
            table = table.name(),
            hour = %hour_partition(*hour),
            files = files.len(),
            bytes,
            kept_days = kept.as_secs_f64() / 86_400.0,
            version,
            "deleted an hour past its retention"
        );
        expired.hours += 1;
        expired.files += files.len() as u64;
        expired.bytes += bytes;
    }
    Ok(expired)
}
