//! `gpuwarden doctor`: checks an installation against what its config says, and prints one line
//! per check with what to do about each failure.
//!
//! Each check is a probe of one outside thing (the brokers, the lake, the lease store, a
//! substrate, the TLS files) through the code the components themselves use to reach it: the
//! Kafka setup helpers of `gpuwarden_schema::kafka`, the lake's own state writes, the store's
//! read-only schema probe (`gpuwarden_enforcer::store::probe`), each driver's inventory. The
//! checks run at once, each on a thread of its own with a deadline ([`Args::timeout`]), so that
//! nothing outside can make doctor hang: a check that does not answer in time is a failure
//! naming what did not answer. Doctor changes nothing it checks: the lake's probe object is
//! removed again, the store is read without migrating, a driver keeps its state in a scratch
//! directory, nothing is produced to Kafka.

mod kafka;
mod storage;
mod substrates;
mod tls;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gpuwarden_schema::config::{self, Config};

/// Check an installation against its config: brokers, topics, clock, lake, store, substrates, TLS.
///
/// Each part is checked as the config names it: the Kafka brokers and topics, this machine's
/// clock, the lake, the lease store, the substrates, the TLS files and the signing key.
///
/// Every check prints one line: `ok`, `warn` (works, but look), `FAIL` (will not work; what to do
/// follows `fix:`) or `skipped` (the config does not use that part, or `--skip` named it).
/// Doctor exits 0 when nothing failed (warnings included), 1 when a check failed or the config
/// does not load, 2 on a usage error. It changes nothing it checks: the lake's probe object is
/// removed again, the lease store is read without migrating, nothing is written to Kafka.
///
/// Each check has its own deadline (--timeout, 5s): one that does not answer in time fails,
/// naming what did not answer. The Kafka checks get it twice (the brokers, then the clock).
///
/// The checks:
///
///   config      the file loads as every component reads it (as `gpuwarden check-config`).
///
///   kafka       the brokers of kafka.brokers answer a metadata request (login and TLS
///               included); skipped for brokers = "embedded".
///
///   topic T     each of gpuwarden.samples, .leases, .signals, .actions exists with
///               kafka.partitions partitions, each with a leader. A missing topic is a warning
///               (the components create it at start) unless kafka.replication_factor exceeds
///               the brokers, which is a failure.
///
///   clock       this machine's clock against the time stamped on the newest records of the
///               topics (the broker's own time on topics with
///               message.timestamp.type=LogAppendTime, else the producing host's), within
///               pipeline.clock.max_skew: beyond it, the pipeline quarantines the records dated
///               by the clock that is wrong. Records that arrive while doctor waits measure the
///               difference both ways; older ones only show a clock that runs behind.
///
///   lake        storage.lake (a directory, or s3://bucket/prefix) takes a write, reads it
///               back and deletes it; a directory not made yet must be creatable.
///
///   store       the lease store ([enforcer.store] url, or the SQLite file of
///               enforcer.database or <data_dir>/enforcer.db) answers, and its schema version:
///               older than this build's is migrated when the enforcer starts, newer fails.
///               Skipped when neither is set and no <data_dir>/enforcer.db exists.
///
///   substrate S each [[substrates]] entry's driver is built and asked for its inventory: Slurm
///               runs squeue, sinfo and scontrol; Kubernetes lists the nodes; libvirt lists the
///               host's node devices; a webhook's URL must accept a connection; local and slurm
///               resolve the system account of every user in `accounts`.
///
///   tls F       every certificate, key and CA file the config names ([enforcer.tls],
///               [pipeline.sql_tls], webhook_tls, the store URL's sslrootcert, Kafka's
///               ssl.*.location) is readable, a listener's key matches its certificate, and no
///               certificate expires within 14 days.
///
///   signing     [signing] key is set (the pipeline signs signals and the enforcer lease events
///               and actions with it); skipped for brokers = "embedded".
///
/// Example:
///
///   $ gpuwarden doctor --config /etc/gpuwarden/gpuwarden.toml
///   ok      config: /etc/gpuwarden/gpuwarden.toml loads (kafka k1:9092, 1 team, 1 substrate)
///   ok      kafka: k1:9092 answered: 1 broker (1 at k1:9092)
///   ok      topic gpuwarden.samples: 3 partitions (kafka.partitions), replication 1, each
///           with a leader
///   …
///   ok      clock: within pipeline.clock.max_skew (5m) of its producer's clock (CreateTime):
///           the newest record, gpuwarden.samples [1] offset 0, is stamped 70ms behind this
///           machine's clock
///   ok      lake: /srv/lake took a file, gave it back and let it be deleted
///   ok      store: /var/lib/gpuwarden/enforcer.db does not exist yet; the enforcer creates it
///           at schema version 7 at its start (/var/lib/gpuwarden takes files)
///   ok      substrate box: local: answered: 2 GPUs named (2 × NVIDIA L4); the account in
///           `accounts` resolves
///   FAIL    tls pipeline.sql_tls.cert: /etc/gpuwarden/sql.pem: CN=sql.example.com expires on
///           2026-12-10T05:08:12Z, in 2d 23h; fix: renew it (the API, SQL and webhook listeners
///           read a renewed file without a restart)
///   …
///   doctor: 16 ok, 0 warn, 1 FAIL, 0 skipped
///
/// On a host that runs only some components, --skip leaves the others' parts out (a GPU node's
/// collector signs nothing and writes no lake: --skip signing,lake,store).
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub(crate) struct Args {
    /// The config file of the installation.
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// How long each check may take before it fails ("5s", "500ms").
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = config::parse_duration, env = "GPUWARDEN_DOCTOR_TIMEOUT")]
    timeout: Duration,
    /// Checks to leave out, comma-separated: kafka (with topics and clock), clock, lake, store,
    /// substrates, tls, signing.
    #[arg(long, value_name = "CHECKS", value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(SKIPPABLE), env = "GPUWARDEN_DOCTOR_SKIP")]
    skip: Vec<String>,
}

/// What `--skip` accepts.
const SKIPPABLE: [&str; 7] = [
    "kafka",
    "clock",
    "lake",
    "store",
    "substrates",
    "tls",
    "signing",
];

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok,
    Warn,
    Fail,
    Skipped,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "FAIL",
            Self::Skipped => "skipped",
        }
    }
}

/// One printed line: a check's outcome, what was checked or found, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Line {
    status: Status,
    /// The check's name: `kafka`, `topic gpuwarden.samples`, `tls enforcer.tls.cert`, …
    check: String,
    /// What was checked, or what went wrong.
    text: String,
    /// What to do (warnings and failures).
    fix: Option<String>,
}

impl Line {
    fn ok(check: impl Into<String>, text: impl Into<String>) -> Self {
        Self::new(Status::Ok, check, text, None)
    }

    fn skipped(check: impl Into<String>, text: impl Into<String>) -> Self {
        Self::new(Status::Skipped, check, text, None)
    }

    fn warn(check: impl Into<String>, text: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(Status::Warn, check, text, Some(fix.into()))
    }

    fn fail(check: impl Into<String>, text: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(Status::Fail, check, text, Some(fix.into()))
    }

    fn new(
        status: Status,
        check: impl Into<String>,
        text: impl Into<String>,
        fix: Option<String>,
    ) -> Self {
        Self {
            status,
            check: check.into(),
            text: text.into(),
            fix,
        }
    }
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // One line, whatever a library's error message holds.
        let flat = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        write!(
            f,
            "{:<8}{}: {}",
            self.status.word(),
            self.check,
            flat(&self.text)
        )?;
        if let Some(fix) = &self.fix {
            write!(f, "; fix: {}", flat(fix))?;
        }
        Ok(())
    }
}

/// A check running on its own thread: its lines arrive on `lines` before `deadline`, or the
/// check failed for not answering.
struct Running {
    /// What a timeout's line names.
    check: String,
    /// What did not answer, and what to look at, for a timeout's line.
    timed_out: (String, String),
    budget: Duration,
    deadline: Instant,
    lines: mpsc::Receiver<Vec<Line>>,
}

/// How long past its budget a check is waited for: the checks that keep their own deadline (a
/// substrate's, which kills the command it ran) answer at it, and this one is only the backstop.
const GRACE: Duration = Duration::from_secs(1);

/// Starts `check` on a thread of its own, to answer within `budget`. A check that outlives its
/// deadline (and [`GRACE`]) is left to finish on its own: doctor exits without waiting for it.
fn spawn(
    check: &str,
    budget: Duration,
    timed_out: (String, String),
    run: impl FnOnce() -> Vec<Line> + Send + 'static,
) -> Running {
    let (tx, lines) = mpsc::channel();
    let failed = tx.clone();
    let started = std::thread::Builder::new()
        .name(format!("doctor-{}", check.replace(' ', "-")))
        .spawn(move || {
            let _ = tx.send(run());
        });
    if let Err(e) = started {
        let _ = failed.send(vec![Line::fail(
            check,
            format!("could not start the check: {e}"),
            "look at the machine's limits on threads and memory",
        )]);
    }
    Running {
        check: check.to_string(),
        timed_out,
        budget,
        deadline: Instant::now() + budget + GRACE,
        lines,
    }
}

impl Running {
    /// The check's lines, or its failure for not answering in time.
    fn wait(self) -> Vec<Line> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left) {
            Ok(lines) => lines,
            Err(mpsc::RecvTimeoutError::Disconnected) => vec![Line::fail(
                self.check,
                "the check ended without an answer: a bug in gpuwarden, whose message is on stderr",
                "report it, with doctor's output",
            )],
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let (what, fix) = self.timed_out;
                vec![Line::fail(
                    self.check,
                    format!(
                        "{what} did not answer within {}",
                        humantime::format_duration(self.budget)
                    ),
                    fix,
                )]
            }
        }
    }
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let skip = |name: &str| args.skip.iter().any(|s| s == name);
    let config =
        match config::load_for_build(&args.config, gpuwarden_enforcer::drivers::missing_driver) {
            Ok(config) => std::sync::Arc::new(config),
            Err(errors) => {
                eprint!("{errors}");
                let n = errors.errors.len();
                let line = Line::fail(
                    "config",
                    format!(
                        "{} does not load: {n} problem{} (above)",
                        args.config.display(),
                        if n == 1 { "" } else { "s" }
                    ),
                    format!(
                        "correct them (`gpuwarden check-config {}` lists them too); no other \
                         check runs without a config",
                        args.config.display()
                    ),
                );
                println!("{line}");
                println!("doctor: 0 ok, 0 warn, 1 FAIL, 0 skipped");
                return Ok(ExitCode::FAILURE);
            }
        };
    let budget = args.timeout;
    let scratch = Scratch::new()?;

    // Each check's place in the output: its lines already, or a check still running.
    let mut slots = vec![Slot::Ready(vec![Line::ok(
        "config",
        format!("{} loads ({})", args.config.display(), summary(&config)),
    )])];

    // Kafka: the brokers and topics, then the clock against the records, each step with a
    // budget of its own.
    slots.push(if config.kafka.is_embedded() {
        Slot::skipped(
            "kafka",
            "kafka.brokers = \"embedded\": each command starts a broker of its own in its process",
        )
    } else if skip("kafka") {
        Slot::skipped("kafka", "--skip kafka (its topics and the clock too)")
    } else {
        let (c, clock) = (config.clone(), !skip("clock"));
        Slot::Running(spawn(
            "kafka",
            budget * 2,
            (
                format!("the brokers at {}", config.kafka.brokers),
                "check that kafka.brokers is right, the brokers are up, and this host may reach them"
                    .to_string(),
            ),
            move || kafka::check(&c, budget, clock),
        ))
    });

    slots.push(if skip("lake") {
        Slot::skipped("lake", "--skip lake")
    } else {
        let c = config.clone();
        Slot::Running(spawn(
            "lake",
            budget,
            (
                format!("the lake {}", lake_shown(&config)),
                "check storage.lake and, for a bucket, [storage.s3] endpoint and that this host \
                 reaches it"
                    .to_string(),
            ),
            move || vec![storage::lake(&c)],
        ))
    });

    slots.push(if skip("store") {
        Slot::skipped("store", "--skip store")
    } else if let Some(reason) = storage::store_unconfigured(&config) {
        Slot::skipped("store", reason)
    } else {
        let c = config.clone();
        Slot::Running(spawn(
            "store",
            budget,
            (
                "the lease store".to_string(),
                "check [enforcer.store] url (host, port, database) and that PostgreSQL accepts \
                 connections from this host"
                    .to_string(),
            ),
            move || vec![storage::store(&c)],
        ))
    });

    if skip("substrates") {
        slots.push(Slot::skipped("substrates", "--skip substrates"));
    } else if config.substrates.is_empty() {
        slots.push(Slot::skipped(
            "substrates",
            "the config has no [[substrates]] (only the enforcer uses them)",
        ));
    }
    for substrate in config.substrates.iter().filter(|_| !skip("substrates")) {
        let (c, dir) = (substrate.clone(), scratch.path().join(&substrate.name));
        let what = format!(
            "substrate {} ({})",
            substrate.name,
            substrate.driver.as_str()
        );
        slots.push(Slot::Running(spawn(
            &format!("substrate {}", substrate.name),
            budget,
            (what, substrates::timeout_fix(substrate)),
            move || vec![substrates::check(&c, &dir, budget)],
        )));
    }

    // The TLS files are read here, but a file on a hung network mount must not hang doctor.
    slots.push(if skip("tls") {
        Slot::skipped("tls", "--skip tls")
    } else {
        let c = config.clone();
        Slot::Running(spawn(
            "tls",
            budget,
            (
                "reading the TLS files".to_string(),
                "check the file systems the TLS files are on".to_string(),
            ),
            move || tls::check(&c),
        ))
    });

    slots.push(Slot::Ready(vec![if skip("signing") {
        Line::skipped("signing", "--skip signing")
    } else {
        signing(&config)
    }]));

    let mut failed = 0;
    let mut counts = [0usize; 4];
    for slot in slots {
        let lines = match slot {
            Slot::Ready(lines) => lines,
            Slot::Running(check) => check.wait(),
        };
        for line in lines {
            println!("{line}");
            counts[line.status as usize] += 1;
            failed += usize::from(line.status == Status::Fail);
        }
    }
    let [ok, warn, _, skipped] = counts;
    println!("doctor: {ok} ok, {warn} warn, {failed} FAIL, {skipped} skipped");
    drop(scratch);
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// A check's place in the output.
enum Slot {
    /// Its lines, known without asking anything outside.
    Ready(Vec<Line>),
    /// A check running on its own thread.
    Running(Running),
}

impl Slot {
    fn skipped(check: &str, why: impl Into<String>) -> Self {
        Self::Ready(vec![Line::skipped(check, why)])
    }
}

/// What the config holds, for the `config` line.
fn summary(config: &Config) -> String {
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    [
        format!("kafka {}", config.kafka.brokers),
        plural(config.teams.len(), "team"),
        plural(config.substrates.len(), "substrate"),
    ]
    .join(", ")
}

fn lake_shown(config: &Config) -> String {
    config
        .lake()
        .map_or_else(|e| e, |location| location.to_string())
}

/// `[signing] key`: what signs the records the pipeline and the enforcer send each other.
fn signing(config: &Config) -> Line {
    if config.kafka.is_embedded() {
        return Line::skipped(
            "signing",
            "kafka.brokers = \"embedded\": `up` and `demo` make a key for their run when the config has none",
        );
    }
    match &config.signing.key {
        Some(key) => Line::ok(
            "signing",
            format!(
                "signing.key is set ({} bytes){}: the pipeline signs signals, the enforcer lease events and actions",
                key.len(),
                if config.signing.previous_key.is_some() {
                    ", and signing.previous_key (a rotation is under way)"
                } else {
                    ""
                }
            ),
        ),
        None => Line::fail(
            "signing",
            "signing.key is not set: the pipeline signs no signal and the enforcer refuses every one, \
             so budgets, idle reclaim and autoscaling never act, and lease events and actions go unsigned",
            "set [signing] key = \"${GPUWARDEN_SIGNING_KEY}\" with the variable holding `openssl rand -hex 32`, \
             the same on the pipeline's and the enforcer's hosts (a collector-only host: --skip signing)",
        ),
    }
}

/// A directory of doctor's own for what the drivers keep while they are probed, removed when
/// doctor ends: the probes leave the installation's state directories as they are.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("gpuwarden-doctor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| {
            anyhow::anyhow!(
                "gpuwarden doctor: cannot make its scratch directory {}: {e}",
                dir.display()
            )
        })?;
        Ok(Self(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `url` with the password (`user:password@`), if any, written `***`.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((user, host)) => match user.split_once(':') {
            Some((u, _)) => format!("{scheme}://{u}:***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// A duration for a person, in its two largest units (`3d 4h`, `2m 10s`).
fn span(d: Duration) -> String {
    gpuwarden_schema::clock::span(gpuwarden_schema::clock::duration_ms(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_one_line_with_its_fix() {
        let line = Line::fail("lake", "cannot write\n  /x: denied", "make it\nwritable");
        assert_eq!(
            line.to_string(),
            "FAIL    lake: cannot write /x: denied; fix: make it writable"
        );
        assert_eq!(Line::ok("store", "fine").to_string(), "ok      store: fine");
        assert_eq!(
            Line::skipped("store", "not set").to_string(),
            "skipped store: not set"
        );
    }

    #[test]
    fn a_check_that_does_not_answer_fails_at_its_deadline() {
        let started = Instant::now();
        let check = spawn(
            "substrate s",
            Duration::from_millis(100),
            ("substrate s (slurm)".into(), "look at slurmctld".into()),
            || {
                std::thread::sleep(Duration::from_secs(5));
                Vec::new()
            },
        );
        let lines = check.wait();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(
            lines,
            vec![Line::fail(
                "substrate s",
                "substrate s (slurm) did not answer within 100ms",
                "look at slurmctld"
            )]
        );
    }

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            without_password("postgres://gw:secret@db:5432/gw"),
            "postgres://gw:***@db:5432/gw"
        );
        assert_eq!(
            without_password("postgres://gw@db/gw"),
            "postgres://gw@db/gw"
        );
    }
}
