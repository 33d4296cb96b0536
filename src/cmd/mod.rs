//! The subcommands. Adding one is a module here, a variant of [`Command`], and a line in [`run`].
//!
//! Each module parses its command's arguments and wires the library crates together; the work
//! itself lives in those crates (the enforcer's outbox publisher and signals consumer, for one,
//! in `gpuwarden_enforcer::kafka`). The modules that are not commands are wiring that several
//! commands share: the connection to Kafka ([`kafka`]), the `/metrics` endpoint
//! ([`metrics_http`]), the SQL endpoint ([`sql_endpoint`]) and the self-service commands' API
//! client ([`api_client`]).
//!
//! Modules are declared lowest layer first; a module uses only modules above it in this list
//! (`tests/workspace.rs` checks it): the shared wiring, then the commands. A command that runs
//! another's parts comes after it: `enforce` serves the portal through [`assess`]'s lake
//! reader, `up` runs [`collect`], [`pipeline`] and [`enforce`] in one process, and `demo` runs
//! `up`'s stack with demo teams.

// The wiring several commands share.
mod api_client;
mod kafka;
mod metrics_http;
mod sql_endpoint;

// The commands.
mod assess;
mod broker;
mod check_config;
mod collect;
mod compact;
mod doctor;
mod enforce;
mod ingest;
mod lake;
mod leases;
mod pipeline;
mod release;
mod request;
mod rollup;
mod sql;
mod store;
mod up;
mod demo;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Subcommand;

// Each command's help (its first line in `gpuwarden --help`, the rest in `gpuwarden CMD --help`)
// is the doc comment of its `Args`, next to the code it describes.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    Demo(demo::Args),
    CheckConfig(check_config::Args),
    Doctor(doctor::Args),
    Collect(collect::Args),
    Pipeline(pipeline::Args),
    Ingest(ingest::Args),
    Rollup(rollup::Args),
    Compact(compact::Args),
    Sql(sql::Args),
    Broker(broker::Args),
    Enforce(enforce::Args),
    Request(request::Args),
    Leases(leases::Args),
    Release(release::Args),
    Up(up::Args),
    Assess(assess::Args),
    Store(store::Args),
    Lake(lake::Args),
}

/// A fresh `[signing]` key (32 random bytes from the kernel, in hex) for a system that runs in one
/// process (`up`, `demo`), where nothing outside needs to share it.
pub(crate) fn fresh_signing_key() -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for a signing key")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Where the lake `config` names is, for `gpuwarden <command>`: a directory or a prefix of a
/// bucket (docs/src/contributors/object-storage.md), or an error naming storage.lake.
pub(crate) fn lake_location(
    config: &gpuwarden_schema::config::Config,
    command: &str,
) -> anyhow::Result<gpuwarden_schema::config::LakeLocation> {
    config
        .lake()
        .map_err(|message| anyhow::anyhow!("gpuwarden {command}: storage.lake: {message}"))
}

/// The lake `config` names, opened for `gpuwarden <command>` ([`lake_location`]).
pub(crate) fn open_lake(
    config: &gpuwarden_schema::config::Config,
    command: &str,
) -> anyhow::Result<gpuwarden_pipeline::Lake> {
    let location = lake_location(config, command)?;
    gpuwarden_pipeline::Lake::from_config(config)
        .with_context(|| format!("opening the lake {location}"))
}

pub(crate) fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo(args) => demo::run(args),
        Command::CheckConfig(args) => check_config::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Collect(args) => collect::run(args),
        Command::Pipeline(args) => pipeline::run(args),
        Command::Ingest(args) => ingest::run(args),
        Command::Rollup(args) => rollup::run(args),
        Command::Compact(args) => compact::run(args),
        Command::Sql(args) => sql::run(args),
        Command::Broker(args) => broker::run(args),
        Command::Enforce(args) => enforce::run(args),
        Command::Request(args) => request::run(args),
        Command::Leases(args) => leases::run(args),
        Command::Release(args) => release::run(args),
        Command::Up(args) => up::run(args),
        Command::Assess(args) => assess::run(args),
        Command::Store(args) => store::run(args),
        Command::Lake(args) => lake::run(args),
    }
}
