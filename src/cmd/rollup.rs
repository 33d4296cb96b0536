//! `gpuwarden rollup`: computes the rollups of every hour in the lake that needs it, once.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuwarden_pipeline::{Rollup, RollupOptions};
use gpuwarden_schema::config;

/// Compute the rollups (gpu_hourly, lease_hourly, team_hourly, focus_costs, leases) once.
///
/// Reads the lake's samples and lease events and replaces, for every hour with samples or
/// leases that is not final yet or has received data since it was last computed, its rows in
/// the Delta tables <lake>/rollups/<table>/ (one commit per hour and table), where <lake> is
/// storage.lake (a directory or an S3 prefix) or, unset, <storage.data_dir>/lake. The watermark is the time the fleet
/// as a whole has reached: the earliest latest sample among hosts no more than
/// pipeline.clock.idle_timeout behind the median host (one host's wrong clock does not move it);
/// an hour is final once the watermark passes its end plus pipeline.lateness. Running it again computes only what changed, so it is safe to run from
/// cron after `gpuwarden ingest`; `gpuwarden pipeline` does the same every
/// pipeline.rollup_every by itself. Progress goes to stderr; a summary to stdout.
/// Example:
///   gpuwarden ingest -c gw.toml --samples samples.jsonl && gpuwarden rollup -c gw.toml
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file (storage.lake or storage.data_dir, pricing, pipeline.lateness).
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let lake = super::open_lake(&config, "rollup")?;
    let rollup = Rollup::new(lake, RollupOptions::from_config(&config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(rollup.run()).context("rolling up")?;
    match report.watermark {
        None => println!("the lake has no samples or lease events yet; nothing to roll up"),
        Some(watermark) => println!(
            "hours rolled up: {} ({} final); leases: {}; watermark: {}; team_hourly rows written: {}; took {:.1}s",
            report.hours,
            report.final_hours,
            report.leases,
            if (0..=gpuwarden_schema::LATEST_MS).contains(&watermark) {
                humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(watermark.unsigned_abs()),
                )
                .to_string()
            } else {
                format!("{watermark} ms since 1970")
            },
            report.team_rows,
            report.elapsed.as_secs_f64(),
        ),
    }
    Ok(ExitCode::SUCCESS)
}
