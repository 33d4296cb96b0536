//! `gpuwarden compact`: compacts the lake's final hours and deletes the hours past their
//! retention, once.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuwarden_pipeline::compact::{rollup_watermark, CompactError, SkipReason};
use gpuwarden_pipeline::{CompactOptions, Compactor};
use gpuwarden_schema::config;

/// Compact the final hours of the lake's raw tables, and delete the hours past retention.
///
/// Every hour of samples, lease_events, signals, actions and quarantine that is final (the
/// rollups' watermark has passed its end plus pipeline.lateness) and holds more files than its
/// last compaction wrote is rewritten into as few files as pipeline.compaction.target_file_size
/// allows, sorted for pruning (samples by gpu_uuid and ts_ms). Readers see the old files or the
/// new ones, never both, and a crash at any point loses nothing: the next run finishes or
/// discards what it left, and rebuilds a lost _compaction.json from the compacted files. An
/// hour it must leave to an operator (a damaged _compaction.json) is logged and skipped, and
/// the command exits with 1 once the other hours are done. Before that, the hours of samples, signals and quarantine that ended
/// longer than pipeline.retention before the watermark are deleted (the rollups, lease events
/// and actions are kept).
/// `gpuwarden pipeline` does both after every rollup by itself; run this after a backfill.
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
        "hours compacted: {}; files: {} -> {} ({} -> {} bytes, {} rows); leftovers of earlier runs removed: {}; took {:.1}s",
        c.hours,
        c.files_in,
        c.files_out,
        c.bytes_in,
        c.bytes_out,
        c.rows,
        c.leftovers_removed,
        started.elapsed().as_secs_f64()
    );
    if c.manifests_rebuilt > 0 {
        println!(
            "lost manifests rebuilt from their compacted files: {}",
            c.manifests_rebuilt
        );
    }
    let mut skipped = false;
    for (reason, n) in SkipReason::ALL.into_iter().zip(c.skipped) {
        if n > 0 {
            skipped = true;
            println!(
                "hours skipped ({}): {n}; the log names each file and what to do",
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
    // Every other hour was done; one left for an operator still fails the command.
    Ok(if skipped {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
