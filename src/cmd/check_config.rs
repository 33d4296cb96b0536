//! `gpuwarden check-config`: validates a config file the way every component will read it, and
//! prints every problem with its place in the file.

use std::path::PathBuf;
use std::process::ExitCode;

use gpuwarden_schema::config::{self, Config};

/// Check a config file, reporting every error with its line, column and field.
///
/// Reads the file as `collect`, `pipeline` and `enforce` would: TOML syntax, `${ENV}`
/// substitution, unknown keys, types, durations ("30s", "5m", "1h30m"), the rules across
/// sections (team and substrate names that must exist, ranges, driver settings), and whether
/// this build has every substrate's driver (libvirt needs a build with `--features libvirt`).
/// Prints every error as FILE:LINE:COLUMN with the field path, and exits 1 if there is any.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file to check.
    #[arg(value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    file: PathBuf,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    tracing::debug!(file = %args.file.display(), "checking configuration");
    // What this binary can run, not only what the file says: `enforce` refuses a substrate
    // whose driver was compiled out, so the check does too.
    match config::load_for_build(&args.file, gpuwarden_enforcer::drivers::missing_driver) {
        Ok(config) => {
            println!("{}: ok ({})", args.file.display(), summary(&config));
            Ok(ExitCode::SUCCESS)
        }
        Err(errors) => {
            tracing::debug!(file = %args.file.display(), errors = errors.errors.len(), "configuration rejected");
            eprint!("{errors}");
            Ok(ExitCode::FAILURE)
        }
    }
}

fn summary(config: &Config) -> String {
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let gpus: u64 = config.teams.iter().map(|t| u64::from(t.gpu_quota)).sum();
    [
        format!("kafka {}", config.kafka.brokers),
        plural(config.teams.len(), "team"),
        format!("{gpus} GPUs of quota"),
        plural(config.workloads.len(), "workload policy").replace("policys", "policies"),
        plural(config.substrates.len(), "substrate"),
        plural(config.tokens.len(), "token"),
    ]
    .join(", ")
}
