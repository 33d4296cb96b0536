//! The subcommands. Adding one is a module here, a variant of [`Command`], and a line in [`run`].

mod check_config;

use std::process::ExitCode;

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Check a config file and report every error with its line, column and field.
    CheckConfig(check_config::Args),
}

pub(crate) fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::CheckConfig(args) => check_config::run(args),
    }
}
