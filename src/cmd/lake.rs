//! `gpuwarden lake`: the lake's tools for an operator. `lake migrate` moves the tables of a lake
//! written before they were Delta tables into their Delta tables; the migrations themselves are
//! [`gpuwarden_pipeline::migrate`]'s (raw tables) and [`gpuwarden_pipeline::rollup::migrate`]'s.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use gpuwarden_pipeline::rollup::migrate::{migrate, old_files, MigrateError};
use gpuwarden_pipeline::RollupTable;
use gpuwarden_schema::config;

/// Tools for the lake (storage.lake).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    Migrate(MigrateArgs),
}

/// Move the tables of a lake written by a gpuwarden before Delta tables into their Delta tables,
/// in place.
///
/// Raw tables (samples, lease_events, signals, actions, quarantine): before Delta, an hour was
/// <table>/date=YYYY-MM-DD/hour=HH/*.parquet, read by gpuwarden's own rules (its
/// _compaction.json's outputs, not the files they superseded). The files those rules show are
/// committed to the table's Delta log where they lie (nothing is copied); the files its latest
/// version names are read back and their rows and sum of ts_ms compared with the old files'.
/// Only then are the
/// files the old rules hid, the manifests and the old bookkeeping (_recompute, _versions,
/// _ingest, _compaction) deleted. A lake whose ingest did not stop cleanly (a flush journal in
/// _ingest) is refused: start the old version once and stop it cleanly first.
///
/// Rollup tables: each hour of team_hourly, lease_hourly, gpu_hourly and focus_costs was one
/// file, rollups/<table>/date=YYYY-MM-DD/hour=HH/rollup.parquet (in a bucket rollup.v<n>.parquet,
/// the highest n the hour's), and the leases rollups/leases/leases.parquet. Each is committed to
/// its table's Delta log as the rollups would write it; then every table is read back and each
/// hour's rows and the sum of its measure (observed_gpu_hours, cost_usd, BilledCost, gpu_count)
/// compared with the old file's. Only when all agree are the old files deleted.
///
/// Stopped anywhere (a crash, Ctrl-C, a store out of reach), it is finished by running it again;
/// nothing is lost or counted twice. The rollups refuse to run until it has. Run it once after
/// upgrading, with `gpuwarden pipeline` stopped (it takes the rollups' role, so a running rollup
/// makes it exit with 2).
///
/// With --to, the lake is moved instead: to a new location (a directory to a bucket, one bucket
/// to another), whichever layout it is in, and left as it was. Each table is copied as a reader
/// of the old lake sees it (a Delta table's latest version, and what the old layout shows),
/// committed at the new location in one commit with the Kafka offsets (and files ingested) the
/// old table held, so the new lake's ingest resumes where the old one's stopped; then read back
/// and compared, hour by hour, with the files it came from. The rollups' state goes with it.
/// The new location must hold no tables but those of an earlier run of the same move. Stop the
/// pipeline first, and start it on the new config once this reports success; then remove the
/// old lake.
///
/// Examples:
///   gpuwarden lake migrate -c /etc/gpuwarden/gpuwarden.toml
///   gpuwarden lake migrate -c /etc/gpuwarden/gpuwarden.toml --to /etc/gpuwarden/bucket.toml
#[derive(Debug, clap::Args)]
struct MigrateArgs {
    /// The config file (storage.lake or storage.data_dir, [storage.s3]).
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Compare, but keep the old files (and say what would be deleted).
    #[arg(long, conflicts_with = "to")]
    keep_old_files: bool,
    /// Move the lake to the location this config names (its storage.lake or storage.data_dir,
    /// [storage.s3]) instead of migrating it in place; the old lake is left as it was.
    #[arg(long, value_name = "CONFIG")]
    to: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Migrate(args) => run_migrate(args),
    }
}

fn run_migrate(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let lake = super::open_lake(&config, "lake migrate")?;
    let started = Instant::now();
    if let Some(to) = &args.to {
        let to_config = config::load(to)?;
        let target = super::open_lake(&to_config, "lake migrate --to")?;
        return move_lake(&lake, &target, started);
    }
    let raw = gpuwarden_pipeline::migrate::raw_tables_to_migrate(&lake)?;
    for table in &raw {
        eprintln!("{table}: files of the layout before Delta to migrate");
    }
    let mut found = raw.len();
    for table in RollupTable::ALL {
        let files = old_files(&lake, table)?.len();
        if files > 0 {
            eprintln!("{}: {files} old files to migrate", table.name());
        }
        found += files;
    }
    if found == 0 {
        println!(
            "the tables of {} are Delta tables already: nothing to migrate",
            lake.location()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let migrated = runtime.block_on(async {
        let raw = gpuwarden_pipeline::migrate::migrate_raw(&lake, args.keep_old_files).await?;
        let rollups = migrate(&lake, args.keep_old_files).await?;
        Ok::<_, MigrateError>((raw, rollups))
    });
    let (raw, reports) = match migrated {
        Ok(reports) => reports,
        Err(e @ MigrateError::Busy(_)) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    println!(
        "migrated the tables of {} in {:.1}s; rows and sums compared equal:",
        lake.location(),
        started.elapsed().as_secs_f64()
    );
    let kept = |deleted: usize| {
        if args.keep_old_files {
            "none (--keep-old-files)".to_string()
        } else {
            deleted.to_string()
        }
    };
    for r in &raw {
        println!(
            "  {:<13} raw table: {} hours, {} files moved into its log, {} rows; hidden old files deleted: {}",
            r.table,
            r.hours,
            r.files,
            r.rows,
            kept(r.deleted)
        );
    }
    for r in &reports {
        println!(
            "  {:<13} {:>6} files  {:>10} rows  sum {:.6}  old files deleted: {}",
            r.table,
            r.files,
            r.rows,
            r.sum,
            kept(r.deleted)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn move_lake(
    lake: &gpuwarden_pipeline::Lake,
    target: &gpuwarden_pipeline::Lake,
    started: Instant,
) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let moved = runtime.block_on(gpuwarden_pipeline::relocate::move_lake(lake, target));
    let moved = match moved {
        Ok(moved) => moved,
        Err(e @ MigrateError::Busy(_)) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    println!(
        "moved the tables of {} to {} in {:.1}s; rows and sums compared equal, hour by hour \
         (sources: the Kafka partitions and files ingested whose offsets went with the table):",
        lake.location(),
        target.location(),
        started.elapsed().as_secs_f64()
    );
    for t in &moved.tables {
        println!(
            "  {:<22} {:>6} files  {:>12} bytes  {:>10} rows  sum of {} {:.6}  sources {}{}",
            t.table,
            t.files,
            t.bytes,
            t.rows,
            t.measure,
            t.sum,
            t.txns,
            if t.earlier {
                "  (committed by an earlier run)"
            } else {
                ""
            }
        );
    }
    println!(
        "rollups' state: {}",
        if moved.state_carried {
            "carried"
        } else {
            "kept (the new location has its own)"
        }
    );
    println!(
        "the old lake is left as it was: start the pipeline on the new config, then remove it"
    );
    Ok(ExitCode::SUCCESS)
}
