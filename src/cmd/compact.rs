//! `gpuwarden compact`: compacts the lake's final hours and deletes the hours past their
//! retention, once.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuwarden_pipeline::compact::{rollup_watermark, CompactError, SkipReason};
use gpuwarden_pipeline::{CompactOptions, Compactor};
use gpuwarden_schema::config;

/// Compact the final hours of the lake's raw tables (Delta OPTIMIZE), and delete the hours past
/// retention.
///
/// Every hour of samples, lease_events, signals, actions and quarantine that is final (the
/// rollups' watermark has passed its end plus pipeline.lateness) and holds files OPTIMIZE did
/// not write (new rows, late data) is rewritten into as few files as
/// pipeline.compaction.target_file_size allows, sorted for pruning (samples by gpu_uuid and
/// ts_ms), and swapped in by one commit of the table's Delta log: every reader (gpuwarden,
/// DuckDB, polars, Spark) sees the old files or the new ones, never both, and a crash at any
/// point loses nothing. An hour whose files another commit removed meanwhile (retention, a
/// second compactor) is left for the next run. Before that, the hours of samples, signals and
/// quarantine that ended longer than pipeline.retention before the watermark are deleted (one
/// Delta DELETE per table; the rollups, lease events and actions are kept), and after it each
/// table is vacuumed: files removed more than 30 days ago are deleted, so as-of reads reach
/// back 30 days.
/// `gpuwarden pipeline` does all of it after every rollup by itself; run this after a backfill.
/// Example: gpuwarden ingest -c gw.toml --samples s.jsonl && gpuwarden rollup -c gw.toml &&
/// gpuwarden compact -c gw.toml
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file (storage.lake or storage.data_dir, pipeline.compaction,
    /// pipeline.retention, pipeline.lateness).
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Take this event time (RFC 3339, e.g. 2026-12-01T00:00:00Z) as the watermark instead of
    /// the rollups': hours final and retention are measured from it.
    #[arg(long, value_name = "TIME")]
    watermark: Option<humantime::Timestamp>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let lake = super::open_lake(&config, "compact")?;
    let watermark = match args.watermark {
        Some(at) => Some(
            std::time::SystemTime::from(at)
                .duration_since(std::time::UNIX_EPOCH)
                .context("--watermark is before 1970")?
                .as_millis() as i64,
        ),
        None => rollup_watermark(&lake),
    };
    if watermark.is_none() {
        eprintln!(
            "no rollup has run on this lake, so no hour is known to be final: nothing is \
             compacted or deleted (run `gpuwarden rollup`, or give --watermark)"
        );
    }
    let compactor = Compactor::new(lake, CompactOptions::from_config(&config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started = std::time::Instant::now();
    let done = match runtime.block_on(compactor.run(watermark)) {
        Ok(done) => done,
        Err(e @ CompactError::Busy(_)) => {
            eprintln!("{e}; try again when it is done");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e).context("compacting"),
    };
    let c = &done.compacted;
    println!(
        "hours compacted: {}; files: {} -> {} ({} -> {} bytes, {} rows); files vacuumed: {}; took {:.1}s",
        c.hours,
        c.files_in,
        c.files_out,
        c.bytes_in,
        c.bytes_out,
        c.rows,
        c.vacuumed,
        started.elapsed().as_secs_f64()
    );
    for (reason, n) in SkipReason::ALL.into_iter().zip(c.skipped) {
        if n > 0 {
            println!(
                "hours left for the next run ({}): {n}; another commit changed their files meanwhile",
                reason.as_str()
            );
        }
    }
    for e in &done.expired {
        println!(
            "retention: {}: {} hours deleted ({} files, {} bytes)",
            e.table, e.hours, e.files, e.bytes
        );
    }
    Ok(ExitCode::SUCCESS)
}
