//! `gpuwarden broker`: hosts a Kafka-protocol broker (librdkafka's mock cluster) as its own process,
//! so that collector, pipeline and enforcer in separate processes meet over TCP as they would in
//! a real Kafka.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuwarden_schema::kafka::EmbeddedBroker;

use super::kafka::shutdown_signal;

/// Run a Kafka-protocol broker for tests and trials.
///
/// Starts librdkafka's mock cluster with gpuwarden's four topics, prints its bootstrap address
/// (host:port) on stdout, and serves until Ctrl-C or SIGTERM. Point `kafka.brokers` of the other
/// processes at that address. Data lives in memory only, at most 5 MB or 100,000 batches per
/// partition: it is for tests and trying gpuwarden out, not for production (use any Kafka >= 2.8).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Partitions of each topic.
    #[arg(long, default_value_t = 6, env = "GPUWARDEN_BROKER_PARTITIONS")]
    partitions: i32,
    /// Also write the bootstrap address to this file (written whole, once the broker is up).
    #[arg(long, value_name = "FILE", env = "GPUWARDEN_BROKER_BOOTSTRAP_FILE")]
    bootstrap_file: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.partitions >= 1, "--partitions must be at least 1");
    let broker = EmbeddedBroker::start(args.partitions)?;
    let bootstrap = broker.bootstrap_servers().to_string();
    if let Some(file) = &args.bootstrap_file {
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, format!("{bootstrap}\n"))
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, file).with_context(|| format!("writing {}", file.display()))?;
    }
    println!("{bootstrap}");
    tracing::info!(bootstrap = %bootstrap, partitions = args.partitions, "broker running; Ctrl-C to stop");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(shutdown_signal());
    drop(broker);
    Ok(ExitCode::SUCCESS)
}
