//! `gpuwarden store`: the lease store's tools for an operator, run while the enforcer is stopped.
//! `store copy` moves a store between databases; the copy itself is
//! [`gpuwarden_enforcer::store::copy`]'s, and this module only reads the two locations the way
//! `[enforcer.store] url` is read and prints what was copied.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpuwarden_enforcer::store::copy::{copy, CopyError};
use gpuwarden_enforcer::store::StoreError;
use gpuwarden_schema::config::{Config, StoreConfig, StoreLocation};

/// Tools for the enforcer's lease store (stop the enforcer first).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    Copy(CopyArgs),
}

/// Copy the whole lease store into an empty one: SQLite to PostgreSQL, or back.
///
/// Copies every lease (open ones of every state, holds, leases named by their substrate, ended
/// ones), the outbox (the audit trail of Actions and LeaseEvents, published or still waiting for
/// Kafka, ids included), blocked teams, team spend, exemptions, rule marks and the utilization
/// signal times, exactly as they are. Both stores' schemas are brought up to date first. The rows
/// are read in one snapshot and written in one transaction: the target gets all of them or none.
///
/// Stop every enforcer first. One still running on an SQLite source makes the copy fail ("in
/// use"), and neither SQLite file can be opened by an enforcer until the copy is done. On a
/// PostgreSQL source the copy holds the store's lock while it reads, so replicas still running
/// fail their changes meanwhile.
///
/// The target must be empty: a new PostgreSQL database (create it, e.g. createdb gpuwarden; the
/// tables are made by the copy) or a new SQLite file. A target holding any row is refused and left
/// as it was.
///
/// A location is a postgres:// (or postgresql://) URL as libpq reads it, sqlite:PATH, or a plain
/// path to an SQLite file, as [enforcer.store] url takes them.
///
/// Example, moving an enforcer from its SQLite file to PostgreSQL: stop it; run gpuwarden store copy
/// --from /var/lib/gpuwarden/enforcer.db --to postgres://gpuwarden@db.internal:5432/gpuwarden
/// --to-password-file /run/secrets/pg-password; set [enforcer.store] url and password_file in the
/// config to the same; start the enforcers.
#[derive(Debug, clap::Args)]
struct CopyArgs {
    /// The store to copy: postgres://…, sqlite:PATH or PATH (an SQLite file that must exist).
    #[arg(long, value_name = "LOCATION", env = "GPUWARDEN_STORE_COPY_FROM")]
    from: String,
    /// The empty store to copy into: postgres://…, sqlite:PATH or PATH (created if missing).
    #[arg(long, value_name = "LOCATION", env = "GPUWARDEN_STORE_COPY_TO")]
    to: String,
    /// A file whose first line is the password of --from's PostgreSQL user.
    #[arg(
        long,
        value_name = "FILE",
        env = "GPUWARDEN_STORE_COPY_FROM_PASSWORD_FILE"
    )]
    from_password_file: Option<PathBuf>,
    /// A file whose first line is the password of --to's PostgreSQL user.
    #[arg(
        long,
        value_name = "FILE",
        env = "GPUWARDEN_STORE_COPY_TO_PASSWORD_FILE"
    )]
    to_password_file: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Copy(args) => run_copy(args),
    }
}

fn run_copy(args: CopyArgs) -> anyhow::Result<ExitCode> {
    let from = location("--from", &args.from, args.from_password_file)?;
    let to = location("--to", &args.to, args.to_password_file)?;
    let started = Instant::now();
    // A line per table on stderr, and one a second while a large one is copied.
    let mut said = (String::new(), Instant::now());
    let mut stderr = std::io::stderr();
    let report = copy(&from, &to, |table, rows| {
        if said.0 != table || said.1.elapsed() >= Duration::from_secs(1) {
            let _ = writeln!(stderr, "{table}: {rows} rows copied");
            said = (table.to_owned(), Instant::now());
        }
    })
    .map_err(|e| match &e {
        CopyError::Source {
            error: StoreError::InUse(_),
            ..
        }
        | CopyError::Target {
            error: StoreError::InUse(_),
            ..
        } => anyhow::anyhow!("{e}; stop that enforcer, then copy again"),
        _ => anyhow::Error::new(e),
    })?;
    println!(
        "copied the lease store {} to {} in {:.1}s:",
        report.from,
        report.to,
        started.elapsed().as_secs_f64()
    );
    let width = report.rows.iter().map(|(t, _)| t.len()).max().unwrap_or(0);
    for (table, rows) in &report.rows {
        println!("  {table:<width$}  {rows:>12} rows");
    }
    println!(
        "point [enforcer.store] url at {} before starting the enforcer",
        report.to
    );
    Ok(ExitCode::SUCCESS)
}

/// Where `text` (the value of `flag`) puts a store, read as `[enforcer.store] url` is.
fn location(
    flag: &str,
    text: &str,
    password_file: Option<PathBuf>,
) -> anyhow::Result<StoreLocation> {
    let postgres = StoreConfig::POSTGRES_SCHEMES
        .iter()
        .any(|s| text.starts_with(s));
    if !postgres && text.contains("://") && !text.starts_with("sqlite://") {
        anyhow::bail!("{flag} \"{text}\" is neither a postgres:// (or postgresql://) URL nor sqlite:PATH or a path");
    }
    if !postgres && password_file.is_some() {
        anyhow::bail!(
            "{flag}-password-file is for a PostgreSQL store, and {flag} names an SQLite file"
        );
    }
    let mut config = Config::default();
    config.enforcer.store = StoreConfig {
        url: Some(text.to_owned()),
        password_file,
    };
    let location = config.enforcer_store();
    if matches!(&location, StoreLocation::Sqlite(path) if path.as_os_str().is_empty()) {
        anyhow::bail!(
            "{flag} needs the SQLite file's path, e.g. sqlite:/var/lib/gpuwarden/enforcer.db"
        );
    }
    Ok(location)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_read_as_the_config_reads_them() {
        let pg = location("--to", "postgres://gw@db:5432/gw", Some("pw".into())).unwrap();
        assert_eq!(
            pg,
            StoreLocation::Postgres {
                url: "postgres://gw@db:5432/gw".into(),
                password_file: Some("pw".into()),
            }
        );
        for text in ["sqlite:/var/e.db", "sqlite:///var/e.db", "/var/e.db"] {
            assert_eq!(
                location("--from", text, None).unwrap(),
                StoreLocation::Sqlite("/var/e.db".into()),
                "{text}"
            );
        }
        let err = location("--from", "mysql://db/gw", None).unwrap_err();
        assert!(
            err.to_string()
                .contains("--from \"mysql://db/gw\" is neither"),
            "{err}"
        );
        let err = location("--from", "/var/e.db", Some("pw".into())).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--from-password-file is for a PostgreSQL"),
            "{err}"
        );
        let err = location("--to", "sqlite:", None).unwrap_err();
        assert!(
            err.to_string().contains("needs the SQLite file's path"),
            "{err}"
        );
    }
}
