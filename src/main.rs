//! The `gpuwarden` binary: the command line and nothing else. Each subcommand is a module under
//! `cmd/` with its own clap `Args`; the work itself lives in the library crates.

mod cmd;
mod logging;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc rather than glibc's allocator: the enforcer's request path, the pipeline's Arrow
/// buffers and the collector's records allocate constantly, and it spends less CPU on that
/// (`bench/admission.sh` runs with it too, so its figures are this binary's).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Measure every GPU, price every GPU-hour to the team that held it, and act on what is measured.
///
/// gpuwarden's collector streams per-GPU samples into Kafka, its pipeline turns them into
/// utilization, waste and cost per team in a Parquet lake you can query with SQL, and its enforcer
/// admits, resizes and reclaims GPU leases. All of them read one TOML config file; start from
/// `examples/gpuwarden.toml` and check yours with `gpuwarden check-config FILE`.
#[derive(Debug, Parser)]
#[command(
    name = "gpuwarden",
    version,
    propagate_version = true,
    max_term_width = 100
)]
struct Cli {
    /// Log line format on stderr. Levels come from RUST_LOG (default `info`), e.g.
    /// `RUST_LOG=gpuwarden_pipeline=debug`.
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text, env = "GPUWARDEN_LOG_FORMAT")]
    log_format: logging::LogFormat,

    #[command(subcommand)]
    command: cmd::Command,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    match cmd::run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            // `{:#}` prints the whole chain: "reading config: opening file: No such file…".
            eprintln!("error: {err:#}");
            tracing::debug!(error = ?err, "command failed");
            ExitCode::FAILURE
        }
    }
}
