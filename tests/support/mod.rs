//! What the end-to-end tests share, to drive the `gpuwarden` binary as an operator would: start a
//! process, read its JSON logs as they come, stop it with a signal; ask its SQL endpoint with
//! psql and its APIs over plain HTTP; wait for what it is expected to do. `grafana` and
//! `prometheus` hold what tests/dashboards.rs needs to run the dashboards as Grafana does; `pki`
//! makes the CAs and certificates of the TLS tests; `slurm` starts a private Slurm cluster; `s3`
//! starts an S3-compatible server; `tansu` starts tansu, the independent Kafka-protocol broker
//! the Kafka-facing suites also run on ([`on_both_brokers!`]), and `kafka` is the tests' own
//! Kafka client.
//!
//! Every test binary includes this module and uses a part of it, hence the `allow` below.

#![allow(dead_code, unreachable_pub)]

pub mod accounts;
pub mod grafana;
pub mod kafka;
pub mod kube_api;
#[cfg(feature = "libvirt")]
pub mod libvirtd;
#[path = "postgres.rs"]
pub mod pg;
pub mod pki;
pub mod prometheus;
pub mod rollups;
pub mod s3;
pub mod slurm;
pub mod tansu;

use std::fmt::Display;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Tries `check` until it gives `Ok`, and returns what it gave. After `timeout` it panics with
/// `what` and the last `Err`, which says what the check saw instead.
///
/// Between tries it waits nine times as long as the try took, from 5 ms to 1 s, so that the
/// checks take a tenth of the time at most, of this process and of the one they ask: a check
/// that reads a file sees the change within milliseconds, and one that runs psql or calls an
/// API leaves the CPU to the processes it is waiting for.
#[track_caller]
pub fn eventually<T, E: Display>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, E>,
) -> T {
    let started = Instant::now();
    loop {
        let tried = Instant::now();
        let seen = match check() {
            Ok(value) => return value,
            Err(seen) => seen,
        };
        if started.elapsed() >= timeout {
            panic!("{what}: not within {timeout:?}; the last try saw:\n{seen}");
        }
        let pause = (tried.elapsed() * 9).clamp(Duration::from_millis(5), Duration::from_secs(1));
        std::thread::sleep(pause.min(timeout.saturating_sub(started.elapsed())));
    }
}

/// What a `[[tokens]]` entry's `sha256` holds for a bearer token, computed here independently of
/// the enforcer: SHA-256 in hex, as `printf %s TOKEN | sha256sum` prints it.
pub fn sha256_hex(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A running `gpuwarden` process whose stderr log lines are collected as they arrive.
pub struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    out: mpsc::Receiver<String>,
    pub log: Vec<String>,
}

/// Sends each line `from` gives to a channel, from a thread of its own.
fn forward_lines(from: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Running {
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args(["--log-format", "json"])
            .args(args)
            .envs(envs.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts gpuwarden");
        let lines = forward_lines(child.stderr.take().unwrap());
        let out = forward_lines(child.stdout.take().unwrap());
        Self {
            child,
            lines,
            out,
            log: Vec::new(),
        }
    }

    /// Waits for a log line containing `needle`; returns it as JSON.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> serde_json::Value {
        let until = Instant::now() + timeout;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return serde_json::from_str(&line)
                            .unwrap_or(serde_json::Value::String(line));
                    }
                }
                Err(_) => panic!(
                    "no log line with {needle:?} within {timeout:?}; log so far:\n{}",
                    self.log.join("\n")
                ),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Every log line so far, those that arrived since the last look included.
    pub fn log_so_far(&mut self) -> String {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push(line);
        }
        self.log.join("\n")
    }

    /// Sends SIGTERM and waits for the exit, collecting the rest of the log.
    pub fn terminate(mut self, timeout: Duration) -> (ExitStatus, Vec<String>) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        // On a timeout the panic drops `self`, which kills the process.
        let status = eventually("the exit on SIGTERM", timeout, || {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Ok(status);
            }
            while let Ok(line) = self.lines.try_recv() {
                self.log.push(line);
            }
            Err(format!("still running; log:\n{}", self.log.join("\n")))
        });
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.log.push(line);
        }
        (status, std::mem::take(&mut self.log))
    }

    /// The next line of standard output, trimmed; panics after `timeout` or at its end.
    pub fn stdout_line(&mut self, timeout: Duration) -> String {
        match self.out.recv_timeout(timeout) {
            Ok(line) => line.trim().to_string(),
            Err(e) => panic!(
                "no line on stdout within {timeout:?} ({e}); log so far:\n{}",
                self.log.join("\n")
            ),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The JSON line of `log` (a process's stderr in `--log-format json`) whose message is
/// `message`; panics, showing the log, when there is none.
pub fn log_line(log: &[String], message: &str) -> serde_json::Value {
    log.iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"] == message || l["message"] == message)
        .unwrap_or_else(|| panic!("no {message:?} line:\n{}", log.join("\n")))
}

/// Starts `gpuwarden pipeline` with `/metrics` on a free port of 127.0.0.1; returns it and its
/// "pipeline running" log line.
pub fn start_pipeline(config: &Path) -> (Running, Value) {
    let mut pipeline = Running::start(
        &[
            "pipeline",
            "--config",
            config.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let running = pipeline.wait_for_log("pipeline running", Duration::from_secs(30));
    (pipeline, running)
}

/// The `host:port` of the `/metrics` a "pipeline running" log line names.
pub fn metrics_address(running: &Value) -> String {
    running["metrics"]
        .as_str()
        .expect("the metrics field")
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string()
}

/// Starts `gpuwarden pipeline` with `/metrics` and the SQL endpoint on free ports of 127.0.0.1;
/// returns it and the endpoint's port.
pub fn start_pipeline_with_sql(config: &Path) -> (Running, u16) {
    let mut pipeline = Running::start(
        &[
            "pipeline",
            "--config",
            config.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
            "--sql-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let running = pipeline.wait_for_log("pipeline running", Duration::from_secs(60));
    let address = running["sql"].as_str().expect("the sql field");
    let (host, port) = address.rsplit_once(':').unwrap();
    assert_eq!(host, "127.0.0.1");
    (pipeline, port.parse().unwrap())
}

/// Starts `gpuwarden collect` on the fake libnvidia-ml.so playing `script`, `/metrics` on a
/// free port; returns it and its "collector running" log line.
pub fn start_fake_nvml_collector(config: &Path, script: &Path) -> (Running, serde_json::Value) {
    let library = fake_nvml_library();
    let mut collector = Running::start(
        &[
            "collect",
            "--config",
            config.to_str().unwrap(),
            "--nvml-library",
            library.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[("GPUWARDEN_FAKE_NVML_SCRIPT", script.to_str().unwrap())],
    );
    let running = collector.wait_for_log("collector running", Duration::from_secs(30));
    (collector, running)
}

/// `gpuwarden demo` on free ports, and the addresses its banner gives.
pub struct Demo {
    pub process: Running,
    /// Everything it printed before "Ctrl-C stops it.", that line included.
    pub banner: String,
    /// The SQL endpoint's port (the psql URL's).
    pub sql_port: u16,
    /// The admission API, `host:port`.
    pub api: String,
    /// The scrape job of dashboards/prometheus.yml and the address of each of the three
    /// `/metrics`: `gpuwarden-collector`, `gpuwarden-pipeline`, `gpuwarden-enforcer`.
    pub metrics: Vec<(&'static str, String)>,
}

impl Demo {
    /// Starts the demo with its data under `dir` and reads its banner.
    pub fn start(dir: &Path) -> Self {
        let mut process = Running::start(
            &[
                "demo",
                "--data-dir",
                dir.to_str().unwrap(),
                "--api-listen",
                "127.0.0.1:0",
                "--sql-listen",
                "127.0.0.1:0",
                "--pipeline-metrics-listen",
                "127.0.0.1:0",
                "--collector-metrics-listen",
                "127.0.0.1:0",
            ],
            &[],
        );
        let mut lines = Vec::new();
        loop {
            let line = process.stdout_line(Duration::from_secs(60));
            let done = line.starts_with("Ctrl-C");
            lines.push(line);
            assert!(lines.len() < 40, "no end to the banner: {lines:#?}");
            if done {
                break;
            }
        }
        let banner = lines.join("\n");
        let words: Vec<&str> = banner.split_whitespace().collect();
        let url = words
            .iter()
            .find(|w| w.starts_with("\"postgres://"))
            .unwrap_or_else(|| panic!("no psql URL in\n{banner}"))
            .trim_matches('"');
        let sql_port = url
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {url}"));
        let api = words
            .windows(2)
            .find(|w| w[0] == "API:")
            .and_then(|w| w[1].strip_prefix("http://"))
            .unwrap_or_else(|| panic!("no \"Admission API: http://…\" in\n{banner}"))
            .to_string();
        let mut metrics = Vec::new();
        for (i, word) in words.iter().enumerate() {
            let Some(address) = word
                .strip_prefix("http://")
                .and_then(|w| w.strip_suffix("/metrics"))
            else {
                continue;
            };
            let job = match words.get(i + 1).copied() {
                Some("(GPUs,") => "gpuwarden-collector",
                Some("(pipeline)") => "gpuwarden-pipeline",
                Some("(enforcer)") => "gpuwarden-enforcer",
                other => panic!("/metrics of what ({other:?})? banner:\n{banner}"),
            };
            metrics.push((job, address.to_string()));
        }
        assert_eq!(metrics.len(), 3, "three /metrics in the banner:\n{banner}");
        Self {
            process,
            banner,
            sql_port,
            api,
            metrics,
        }
    }
}

/// Which Kafka-protocol broker a test runs against: the suites that talk to Kafka run on both
/// ([`on_both_brokers!`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// librdkafka's mock cluster in a `gpuwarden broker` process.
    Mock,
    /// tansu, an independent implementation of the protocol, in memory ([`tansu`]).
    Tansu,
}

/// A broker in a process of its own, three partitions per topic, and its bootstrap address;
/// stopped when dropped.
pub struct Broker {
    pub bootstrap: String,
    pub kind: BrokerKind,
    _mock: Option<Running>,
    _tansu: Option<tansu::Tansu>,
}

impl Broker {
    /// A `gpuwarden broker` process (librdkafka's mock cluster).
    pub fn start(dir: &Path) -> Self {
        Self::of(BrokerKind::Mock, dir)
    }

    /// A broker of `kind`, its files (tansu's log) under `dir`.
    pub fn of(kind: BrokerKind, dir: &Path) -> Self {
        match kind {
            BrokerKind::Mock => {
                let file = dir.join("bootstrap.txt");
                let process = Running::start(
                    &[
                        "broker",
                        "--partitions",
                        "3",
                        "--bootstrap-file",
                        file.to_str().unwrap(),
                    ],
                    &[],
                );
                let bootstrap = eventually(
                    "the broker's bootstrap file",
                    Duration::from_secs(20),
                    || {
                        std::fs::read_to_string(&file)
                            .map_err(|e| format!("{}: {e}", file.display()))
                    },
                );
                Self {
                    bootstrap: bootstrap.trim().to_string(),
                    kind,
                    _mock: Some(process),
                    _tansu: None,
                }
            }
            BrokerKind::Tansu => {
                let broker = tansu::Tansu::start(dir, tansu::Storage::Memory, 3);
                Self {
                    bootstrap: broker.bootstrap.clone(),
                    kind,
                    _mock: None,
                    _tansu: Some(broker),
                }
            }
        }
    }
}

/// Makes `scenario` (a `fn(BrokerKind)`) two tests, `name::mock` and `name::tansu`, one on each
/// broker of [`BrokerKind`].
#[macro_export]
macro_rules! on_both_brokers {
    ($name:ident, $scenario:ident) => {
        mod $name {
            #[test]
            fn mock() {
                super::$scenario($crate::support::BrokerKind::Mock)
            }
            #[test]
            fn tansu() {
                super::$scenario($crate::support::BrokerKind::Tansu)
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_both_brokers;

/// One plain HTTP/1.1 GET on 127.0.0.1, returning (status, body).
pub fn http_get(address: &str, path: &str) -> (u16, String) {
    http(address, "GET", path, None, None)
}

/// One plain HTTP/1.1 request on 127.0.0.1, with a bearer token and a JSON body when given;
/// returns (status, body).
pub fn http(
    address: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(address).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = body.unwrap_or_default();
    if !body.is_empty() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    write!(stream, "{head}\r\n{body}").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    status_and_body(&response)
}

/// The status code (0 when there is none) and the body of a whole HTTP response read as text.
pub fn status_and_body(response: &str) -> (u16, String) {
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// psql, the real PostgreSQL client, against the SQL endpoint on 127.0.0.1:`port` as `user`:
/// database `gpuwarden`, no ~/.psqlrc, no `PG*` variable of the environment, never a prompt.
pub struct Psql {
    port: u16,
    user: String,
    password: Option<String>,
}

/// A query's answer with its column names; `None` for SQL NULL.
pub struct Answer {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl Psql {
    pub fn new(port: u16, user: &str, password: Option<&str>) -> Self {
        Self {
            port,
            user: user.into(),
            password: password.map(String::from),
        }
    }

    /// The connection alone; the caller adds how to print and what to run.
    pub fn command(&self) -> Command {
        let mut command = Command::new("psql");
        for (name, _) in std::env::vars() {
            if name.starts_with("PG") {
                command.env_remove(name);
            }
        }
        command
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U"])
            .arg(&self.user)
            // -X: no ~/.psqlrc; -w: never prompt.
            .args(["-d", "gpuwarden", "-X", "-w"])
            .env("PGCONNECT_TIMEOUT", "10")
            .env("PGSSLMODE", "disable")
            .env("PGPASSFILE", "/dev/null")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(password) = &self.password {
            command.env("PGPASSWORD", password);
        }
        command
    }

    /// Starts `sql` in the background; rows come back bare, and errors in their verbose form,
    /// with their SQLSTATE.
    pub fn spawn(&self, sql: &str) -> Child {
        self.command()
            .args(["-A", "-t", "-v", "VERBOSITY=verbose", "-c", sql])
            .spawn()
            .expect("psql (postgresql-client) is installed")
    }

    /// Runs `sql` with `-c`, stopping at the first error; rows come back bare, `|` between
    /// columns.
    pub fn run(&self, sql: &str) -> Output {
        self.command()
            .args(["-A", "-t", "-F", "|", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .expect("psql (postgresql-client) is installed")
    }

    /// Feeds `script` to psql's standard input, as one connection that goes on after an error;
    /// rows come back bare, `|` between columns.
    pub fn script(&self, script: &str) -> Output {
        let mut child = self
            .command()
            .args(["-A", "-t", "-F", "|"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("psql (postgresql-client) is installed");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// The rows of a query that must succeed, as `a|b` lines.
    #[track_caller]
    pub fn rows(&self, sql: &str) -> Vec<String> {
        let out = self.run(sql);
        assert!(
            out.status.success(),
            "{sql}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The one row of a query that must succeed and return exactly one.
    #[track_caller]
    pub fn one(&self, sql: &str) -> String {
        let rows = self.rows(sql);
        assert_eq!(rows.len(), 1, "{sql}: {rows:?}");
        rows[0].clone()
    }

    /// Runs `sql` with the column names (which a time series needs for its `time` column) and
    /// NULL told apart from text; psql's error message when it fails.
    pub fn answer(&self, sql: &str) -> Result<Answer, String> {
        const NULL: &str = "\u{1}NULL";
        let out = self
            .command()
            .args(["-A", "-F", "\u{1f}", "-P", "footer=off"])
            .args([
                "-P",
                &format!("null={NULL}"),
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .output()
            .expect("psql (postgresql-client) is installed");
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut lines = stdout.lines();
        let columns: Vec<String> = lines
            .next()
            .ok_or("psql printed no header")?
            .split('\u{1f}')
            .map(str::to_string)
            .collect();
        let mut rows = Vec::new();
        for line in lines {
            let row: Vec<Option<String>> = line
                .split('\u{1f}')
                .map(|v| (v != NULL).then(|| v.to_string()))
                .collect();
            if row.len() != columns.len() {
                return Err(format!(
                    "a row psql printed does not split into {columns:?}: {line:?}"
                ));
            }
            rows.push(row);
        }
        Ok(Answer { columns, rows })
    }
}

/// Writes `lines` (JSON samples) to `file` and loads them into the lake of `config` with
/// `gpuwarden ingest`.
pub fn ingest_samples(config: &Path, file: &Path, lines: &str) {
    std::fs::write(file, lines).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["ingest", "--config", config.to_str().unwrap(), "--samples"])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The state of process `pid` as /proc/<pid>/stat gives it (`R` running, `S` sleeping, `T`
/// stopped, `Z` a zombie, …); `None` once it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (2nd field) is in parentheses and may hold anything; the state follows it.
    stat.rsplit_once(") ")?.1.chars().next()
}

/// CPU time, in clock ticks, the SQL query threads (`gpuwarden-sql`) of process `pid` have used
/// so far.
pub fn sql_threads_cpu(pid: u32) -> u64 {
    let mut ticks = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let Ok(name) = std::fs::read_to_string(task.join("comm")) else {
            continue;
        };
        if name.trim() != "gpuwarden-sql" {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.join("stat")) else {
            continue;
        };
        // utime and stime, the 14th and 15th fields; the name (2nd) is in parentheses.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    ticks
}

/// How many clock ticks (1/100 s) the SQL query threads of `pid` use over `over`.
pub fn sql_threads_busy(pid: u32, over: Duration) -> u64 {
    let before = sql_threads_cpu(pid);
    std::thread::sleep(over);
    sql_threads_cpu(pid) - before
}

/// Waits until a query keeps the SQL threads of `pid` busy: a fifth of a CPU or more, which
/// they get even when every CPU is busy with other work, at their lower priority.
pub fn until_sql_threads_busy(pid: u32) {
    eventually(
        "a query keeping the SQL threads busy",
        Duration::from_secs(60),
        || {
            let ticks = sql_threads_busy(pid, Duration::from_millis(500));
            if ticks >= 10 {
                Ok(())
            } else {
                Err(format!("{ticks} ticks in 500 ms"))
            }
        },
    );
}

/// The value of the unlabelled series `name` on the `/metrics` at `address`, when it has one.
pub fn metric(address: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(address, "/metrics");
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

pub fn fake_nvml_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().to_path_buf();
    [
        dir.join("libgpuwarden_fake_nvml.so"),
        dir.join("../libgpuwarden_fake_nvml.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .expect(
        "the fake libnvidia-ml.so is built beside the tests (dev-dependency gpuwarden-fake-nvml)",
    )
}

/// Runs `query` with DataFusion over the raw tables of a lake; returns the first column of the
/// first row as i64.
pub fn lake_i64(lake: &Path, query: &str) -> i64 {
    try_lake_i64(lake, query).unwrap_or_else(|e| panic!("{query}: {e}"))
}

/// [`lake_i64`], or the error (e.g. a table whose files are being replaced right now).
pub fn try_lake_i64(lake: &Path, query: &str) -> Result<i64, String> {
    let lake = gpuwarden_pipeline::Lake::open(lake).map_err(|e| e.to_string())?;
    query_i64(&lake, query)
}

/// [`lake_i64`] over the lake that the config file `config` names (a directory or a bucket).
pub fn config_lake_i64(config: &Path, query: &str) -> i64 {
    try_config_lake_i64(config, query).unwrap_or_else(|e| panic!("{query}: {e}"))
}

/// [`config_lake_i64`], or the error.
pub fn try_config_lake_i64(config: &Path, query: &str) -> Result<i64, String> {
    let config = gpuwarden_schema::config::load(config).unwrap_or_else(|e| panic!("{e}"));
    let lake = gpuwarden_pipeline::Lake::from_config(&config).map_err(|e| e.to_string())?;
    query_i64(&lake, query)
}

fn query_i64(lake: &gpuwarden_pipeline::Lake, query: &str) -> Result<i64, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_, batches) = runtime
        .block_on(gpuwarden_pipeline::sql::query(lake, query))
        .map_err(|e| e.to_string())?;
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Err("no rows".into());
    };
    let column = datafusion::arrow::compute::cast(
        batch.column(0),
        &datafusion::arrow::datatypes::DataType::Int64,
    )
    .map_err(|e| e.to_string())?;
    Ok(
        datafusion::arrow::array::AsArray::as_primitive::<datafusion::arrow::datatypes::Int64Type>(
            &column,
        )
        .value(0),
    )
}

/// The files under a directory, at any depth (none when it does not exist).
pub fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Counts the Parquet files under a directory, recursively.
pub fn parquet_files(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                parquet_files(&p)
            } else {
                usize::from(p.extension().is_some_and(|x| x == "parquet"))
            }
        })
        .sum()
}

/// How to get the tests' Python venv, for a failure message.
pub const VENV_SETUP: &str = "run `bash .ci/run`, or create the environment by hand:\n  \
     python3 -m venv /var/tmp/gpuwarden-venv && \
     /var/tmp/gpuwarden-venv/bin/pip install -r tests/requirements.txt\n  \
     export GPUWARDEN_PYTHON=/var/tmp/gpuwarden-venv/bin/python";

/// The tests' Python (tests/requirements.txt installed): GPUWARDEN_PYTHON, set by .ci/run, after
/// checking that `check` runs in it. Missing, it fails the test that needs it for `purpose`: a
/// cross-check that silently skips checks nothing.
pub fn venv_python(purpose: &str, check: &str) -> String {
    let python = std::env::var("GPUWARDEN_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| {
            panic!("GPUWARDEN_PYTHON is not set; this test needs {purpose}: {VENV_SETUP}")
        });
    let out = Command::new(&python)
        .args(["-c", check])
        .output()
        .unwrap_or_else(|e| panic!("GPUWARDEN_PYTHON={python} does not run ({e}): {VENV_SETUP}"));
    assert!(
        out.status.success(),
        "GPUWARDEN_PYTHON={python} lacks {purpose}: {}\n{VENV_SETUP}",
        String::from_utf8_lossy(&out.stderr)
    );
    python
}

/// An alert webhook: records the body of every POST and answers 200.
pub struct Webhook {
    /// Where to POST.
    pub url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl Webhook {
    /// Listens on 127.0.0.1, port 0.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&bodies);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream);
                    loop {
                        let mut length = 0;
                        let mut line = String::new();
                        loop {
                            line.clear();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            let lower = line.to_ascii_lowercase();
                            if let Some(n) = lower.strip_prefix("content-length:") {
                                length = n.trim().parse().unwrap();
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let mut body = vec![0; length];
                        reader.read_exact(&mut body).unwrap();
                        seen.lock()
                            .unwrap()
                            .push(serde_json::from_slice(&body).unwrap());
                        let _ = reader
                            .get_mut()
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
                    }
                });
            }
        });
        Self { url, bodies }
    }

    /// The alerts received with `gpuwarden.reason` = `reason`.
    pub fn alerts(&self, reason: &str) -> Vec<Value> {
        self.bodies
            .lock()
            .unwrap()
            .iter()
            .filter(|b| b["gpuwarden"]["reason"] == reason)
            .cloned()
            .collect()
    }
}

/// Sends each `(key, payload)` of `records` to `topic` on the broker at `bootstrap`, waiting
/// while the producer's queue is full, then waits until every one is delivered.
pub fn produce(bootstrap: &str, topic: &str, records: impl IntoIterator<Item = (String, String)>) {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
    let producer: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .create()
        .expect("a producer for the test broker");
    for (key, payload) in records {
        while producer
            .send(BaseRecord::to(topic).key(&key).payload(&payload))
            .is_err()
        {
            producer.poll(Duration::from_millis(5));
        }
        producer.poll(Duration::ZERO);
    }
    producer
        .flush(Duration::from_secs(30))
        .expect("the test broker takes every record");
}
