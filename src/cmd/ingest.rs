//! `gpuwarden ingest`: loads JSON-lines files of any of the four topics' records into the lake
//! through the pipeline's own decoder, validator, quarantine and writer.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use gpuwarden_pipeline::bounds::Bounds;
use gpuwarden_pipeline::files::{self, IngestOptions};
use gpuwarden_pipeline::{Metrics, Table};
use gpuwarden_schema::config;

/// Load JSON-lines files into the lake (backfill, or trying gpuwarden on exported data).
///
/// Each line of --samples is one Sample record, of --lease-events one LeaseEvent, of --actions
/// one Action and of --signals one Signal: the JSON of the v1 record contracts
/// (docs/src/contributors/records.md), as they travel on gpuwarden.samples,
/// gpuwarden.leases, gpuwarden.actions and gpuwarden.signals ("-" reads standard input, for one
/// of them). Valid records are written as Parquet to the lake's samples, lease_events, actions
/// and signals tables; invalid ones to the quarantine table with the reason naming the field.
/// History of any age is accepted; a record dated more than pipeline.clock.max_skew (default 5m)
/// ahead of the time it is read comes from a wrong clock and is quarantined too.
/// Records in any time order give one file per table and hour (up to 4 Mi rows a file), kept
/// in place until compaction merges the hour with the pipeline's files. A file is named after
/// the input's base name ("stdin" for standard input), the lines it holds and a digest of those
/// lines: the same content under the same base name ingested again, or again after a crash,
/// rewrites the same files, so nothing is counted twice; other content never replaces a file,
/// even under the same name (two exports called late.jsonl add up), so a corrected export
/// ingested again adds its rows beside the first one's. Prints how many records were written
/// and quarantined; run `gpuwarden rollup` afterwards to roll new
/// samples and lease events up.
///
/// Example: gpuwarden ingest -c gw.toml --samples s.jsonl --lease-events l.jsonl --actions a.jsonl
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file (for storage.lake or storage.data_dir, and pipeline.clock).
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// JSON lines of Sample records ("-" for standard input).
    #[arg(long, value_name = "FILE")]
    samples: Option<String>,
    /// JSON lines of LeaseEvent records ("-" for standard input).
    #[arg(long, value_name = "FILE")]
    lease_events: Option<String>,
    /// JSON lines of Action records, the enforcer's audit trail ("-" for standard input).
    #[arg(long, value_name = "FILE")]
    actions: Option<String>,
    /// JSON lines of Signal records ("-" for standard input).
    #[arg(long, value_name = "FILE")]
    signals: Option<String>,
    /// Decoding threads (default: all cores).
    #[arg(long, env = "GPUWARDEN_INGEST_THREADS")]
    threads: Option<usize>,
    /// Memory for decoded rows waiting for their Parquet row group, over all hours, in MiB:
    /// past it the hour holding the most is written as a smaller row group.
    #[arg(long, value_name = "MIB", env = "GPUWARDEN_INGEST_BUFFER_MIB", default_value_t = IngestOptions::DEFAULT_BUFFER_BYTES >> 20)]
    buffer_mib: usize,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let inputs: Vec<(String, Table)> = [
        (args.lease_events, Table::LeaseEvents),
        (args.samples, Table::Samples),
        (args.actions, Table::Actions),
        (args.signals, Table::Signals),
    ]
    .into_iter()
    .filter_map(|(input, table)| Some((input?, table)))
    .collect();
    anyhow::ensure!(
        !inputs.is_empty(),
        "nothing to ingest: give --samples, --lease-events, --actions and/or --signals FILE"
    );
    anyhow::ensure!(
        inputs.iter().filter(|(input, _)| input == "-").count() <= 1,
        "only one input can be standard input"
    );
    let config = config::load(&args.config)?;
    let lake = super::open_lake(&config, "ingest")?;
    let metrics = Arc::new(Metrics::default());
    let bounds = Bounds::backfill(&config.pipeline.clock);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
        .max(1);
    let options = IngestOptions {
        buffer_bytes: args.buffer_mib.max(1) << 20,
        ..IngestOptions::new(threads)
    };
    let mut quarantined_any = false;
    for (input, table) in inputs {
        let started = std::time::Instant::now();
        let mut reader: Box<dyn BufRead> = if input == "-" {
            Box::new(std::io::BufReader::with_capacity(1 << 20, std::io::stdin()))
        } else {
            Box::new(std::io::BufReader::with_capacity(
                1 << 20,
                std::fs::File::open(&input).with_context(|| format!("opening {input}"))?,
            ))
        };
        let name = if input == "-" {
            "stdin".to_string()
        } else {
            input.clone()
        };
        let report = files::ingest(&mut reader, &name, table, &lake, options, &bounds, &metrics)?;
        quarantined_any |= report.quarantined > 0;
        let future = if report.future > 0 {
            format!(
                ", {} of them dated more than pipeline.clock.max_skew ({}) ahead of now",
                report.future,
                humantime::format_duration(config.pipeline.clock.max_skew)
            )
        } else {
            String::new()
        };
        println!(
            "{name}: {} {} records read, {} written, {} quarantined{future}; {} files ({:.1}s)",
            report.records,
            table.name(),
            report.written,
            report.quarantined,
            report.files,
            started.elapsed().as_secs_f64()
        );
    }
    if quarantined_any {
        println!("see why with: gpuwarden sql --config {} \"SELECT topic, \\\"offset\\\", reason FROM quarantine\"", args.config.display());
    }
    Ok(ExitCode::SUCCESS)
}
