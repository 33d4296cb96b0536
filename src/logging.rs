//! One place that sets up logging for every subcommand: `tracing` to stderr, levels from
//! `RUST_LOG`, as text for people or JSON lines for log collectors. Text is coloured only on a
//! terminal, and never when `NO_COLOR` is set (<https://no-color.org>): stderr sent to a file, a
//! pipe or a log collector gets plain lines that `grep` and parsers read as they are.

use std::ffi::OsStr;
use std::io::IsTerminal as _;

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The levels without `RUST_LOG`: gpuwarden's INFO, and only warnings from the Delta Lake
/// engine, which logs every snapshot it loads and every scan it plans at INFO (several lines a
/// query), except its commits' conflict check, which warns of every commit that landed while
/// another was being made (ingest's partitions commit side by side: most of them); a conflict
/// that fails a commit reaches gpuwarden as an error, which it logs.
const DEFAULT_FILTER: &str = "info,buoyant_kernel=warn,buoyant_kernel_engine=warn,\
     deltalake_core=warn,deltalake_core::kernel::transaction=error";

pub(crate) fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let colour = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
}

/// Whether log lines get ANSI colours: only when stderr is a terminal, and not when `NO_COLOR`
/// is set to anything but the empty string (the no-color.org convention, which
/// tracing-subscriber follows too, but without looking at the terminal).
fn colour(stderr_is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(OsStr::is_empty)
}

#[cfg(test)]
mod tests {
    use super::colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_and_never_with_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None), "a file or a pipe gets plain text");
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(!colour(true, Some(OsStr::new("false"))), "any value counts");
        assert!(
            colour(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
        assert!(!colour(false, Some(OsStr::new(""))));
    }
}
