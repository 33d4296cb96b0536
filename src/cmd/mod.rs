//! The subcommands. Adding one is a module here, a variant of [`Command`], and a line in [`run`].

mod broker;
mod check_config;
mod collect;
mod ingest;
mod kafka;
mod metrics_http;
mod pipeline;

use std::process::ExitCode;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Check a config file and report every error with its line, column and field.
    CheckConfig(check_config::Args),
    /// Sample GPUs (NVML or a simulated fleet) and publish them to Kafka.
    Collect(collect::Args),
    /// Consume Kafka into the Parquet lake.
    Pipeline(pipeline::Args),
    /// Load JSON-lines files into the lake.
    Ingest(ingest::Args),
    /// Run a Kafka-protocol broker in this process, for tests and trials.
    Broker(broker::Args),
}

pub(crate) fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::CheckConfig(args) => check_config::run(args),
        Command::Collect(args) => collect::run(args),
        Command::Pipeline(args) => pipeline::run(args),
        Command::Ingest(args) => ingest::run(args),
        Command::Broker(args) => broker::run(args),
    }
}
