//! The `gpuwarden` binary: the command line and nothing else. Each subcommand is a module under
//! `cmd/` with its own clap `Args`; the work itself lives in the library crates.
//!
//! Modules are declared lowest layer first; a module uses only modules above it in this list
//! (`tests/workspace.rs` checks it, here and among `cmd`'s modules): [`logging`] sets up
//! logging, and [`cmd`] holds the subcommands.

mod logging;
// The doc comments of the subcommands' clap `Args` are their `--help` text, written for a
// terminal: `<lake>/rollups/<table>/` and `[[teams]]` are what an operator reads there, not
// HTML tags or intra-doc links.
#[allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]
mod cmd;

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
    gpuwarden_schema::tls::install_default_provider();
    match cmd::run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", chain_text(&err));
            tracing::debug!(error = ?err, "command failed");
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined with ": ", as anyhow's `{:#}` joins them ("reading config:
/// opening file: No such file…"), leaving out a cause whose text the error it caused already
/// holds: object_store's errors, and the lake's around them, write their source into their own
/// message, and the whole chain printed as it is said the same failed request three times over.
fn chain_text(err: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut parent = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if parent.is_empty() || !parent.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        parent = text;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chain_text;

    /// An error that writes its source into its own message, as object_store's do.
    #[derive(Debug)]
    struct Repeats(std::io::Error);

    impl std::fmt::Display for Repeats {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "request failed: {}", self.0)
        }
    }

    impl std::error::Error for Repeats {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn leaf(text: &str) -> std::io::Error {
        std::io::Error::other(text.to_string())
    }

    #[test]
    fn a_cause_already_said_by_its_parent_is_said_once() {
        let err =
            anyhow::Error::new(Repeats(leaf("connection refused"))).context("reading the lake");
        assert_eq!(
            chain_text(&err),
            "reading the lake: request failed: connection refused"
        );
        let err = anyhow::Error::new(leaf("no such file")).context("opening the config");
        assert_eq!(chain_text(&err), "opening the config: no such file");
    }
}
