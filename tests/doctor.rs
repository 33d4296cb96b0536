//! `gpuwarden doctor` against real services: a healthy installation (every check `ok`, exit 0),
//! and each thing a new installation gets wrong made on purpose, each failing with its own line
//! and advice and exit 1: brokers that do not answer, topics of another partition count, a lake
//! that cannot be written, a lease store newer than this build, substrates that refuse or hang,
//! certificates close to expiry or missing, no signing key, and a clock a record on Kafka
//! contradicts.
//!
//! The services: `gpuwarden broker` (librdkafka's mock cluster, 3 partitions per topic) and
//! tansu (for a topic deleted through the admin API, which the mock cluster does not answer);
//! the run's shared PostgreSQL server; the fake Kubernetes API server; certificates made with the
//! openssl command line; Slurm commands that never answer (scripts); system account `nobody`.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
use support::kube_api::{gpu_node, KubeApi};
use support::{pg, Broker, BrokerKind, Config, Substrate, Team};

const SIGNING_KEY: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";

/// `gpuwarden doctor --config FILE ARGS…`, with no setting from the environment.
fn doctor(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["doctor", "--config", config.to_str().unwrap()])
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("GPUWARDEN_CONFIG")
        .env_remove("GPUWARDEN_DOCTOR_TIMEOUT")
        .env_remove("GPUWARDEN_DOCTOR_SKIP")
        .env("RUST_LOG", "off")
        .output()
        .expect("runs the gpuwarden binary")
}

/// What doctor printed, and its exit code.
struct Report {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Report {
    fn of(out: Output) -> Self {
        Self {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn lines(&self) -> Vec<&str> {
        self.stdout.lines().collect()
    }

    fn failures(&self) -> Vec<&str> {
        self.lines()
            .into_iter()
            .filter(|l| l.starts_with("FAIL"))
            .collect()
    }

    /// Asserts exit 1 and that the failures are exactly `expected`.
    #[track_caller]
    fn assert_fails_with(&self, expected: &[&str]) {
        assert_eq!(self.code, Some(1), "{self}");
        assert_eq!(self.failures(), expected, "{self}");
        let summary = format!(" {} FAIL, ", expected.len());
        assert!(self.stdout.contains(&summary), "{self}");
    }

    /// The one failure whose check is `check`, which must begin with `start` and end with
    /// `end`: for a line whose middle quotes a library's words, which name a port or a
    /// duration that differ between runs.
    #[track_caller]
    fn assert_only_failure(&self, start: &str, contains: &str, end: &str) {
        assert_eq!(self.code, Some(1), "{self}");
        let failures = self.failures();
        assert_eq!(failures.len(), 1, "{self}");
        let line = failures[0];
        assert!(line.starts_with(start), "{line}\n\n{self}");
        assert!(line.contains(contains), "{line}\n\n{self}");
        assert!(line.ends_with(end), "{line}\n\n{self}");
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// A self-signed certificate for `name`, valid `days`, and its key: made with openssl as an
/// operator would.
fn certificate(dir: &Path, name: &str, days: u32) -> (PathBuf, PathBuf) {
    let (cert, key) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    let out = Command::new("openssl")
        .args(["req", "-x509", "-nodes", "-days", &days.to_string()])
        .args(["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"])
        .args(["-subj", &format!("/CN={name}")])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("the openssl command line is installed");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

/// Writes a record to `topic` stamped `ts_ms` (its producer's time, CreateTime), and waits
/// until the broker has it.
fn produce_at(bootstrap: &str, topic: &str, ts_ms: i64) {
    let producer: BaseProducer = support::kafka::client(bootstrap).create().unwrap();
    producer
        .send(
            BaseRecord::to(topic)
                .key("GPU-doctor-0")
                .payload("{}")
                .timestamp(ts_ms),
        )
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(30)).unwrap();
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// What every check's config has: `[kafka]` (brokers `bootstrap`, 3 partitions), `[storage]`
/// with the data dir under `dir`, and the signing key; a test adds what it checks, then writes it
/// with [`write`].
fn config(dir: &Path, bootstrap: &str) -> Config {
    unsigned(dir, bootstrap).signing(SIGNING_KEY)
}

/// [`config`] without the signing key.
fn unsigned(dir: &Path, bootstrap: &str) -> Config {
    Config::new().broker(bootstrap).data_dir(&dir.join("data"))
}

/// `[storage] lake`.
fn lake_section(lake: &Path) -> String {
    format!("[storage]\nlake = \"{}\"\n", lake.display())
}

/// Writes `config` as `dir`/gpuwarden.toml.
fn write(config: Config, dir: &Path) -> PathBuf {
    config.write(dir.join("gpuwarden.toml"))
}

/// A port of 127.0.0.1 nothing listens on (it was free a moment ago).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A PostgreSQL database whose lease store is at schema `version`, as a gpuwarden of that
/// schema left it.
fn store_at_schema(version: i64) -> String {
    let store = pg::server().database();
    pg::Postgres::client(&store)
        .batch_execute(&format!(
            "CREATE TABLE schema_version (version BIGINT NOT NULL); \
             INSERT INTO schema_version VALUES ({version});"
        ))
        .unwrap();
    store
}

#[test]
fn a_healthy_installation_passes_every_check() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let broker = Broker::start(dir);
    produce_at(&broker.bootstrap, "gpuwarden.samples", now_ms());
    // A store an older gpuwarden left: schema version 1, which the enforcer migrates.
    let store = store_at_schema(1);
    let kube = KubeApi::start(vec![gpu_node("gpu-0", "NVIDIA-H100-80GB-HBM3", 8, false)]);
    let kubeconfig = kube.kubeconfig(dir);
    let (api_cert, api_key) = certificate(dir, "api", 365);
    let (ca, _) = certificate(dir, "clients", 3650);
    let (hook_cert, hook_key) = certificate(dir, "webhook", 90);
    let lake = dir.join("lake");
    std::fs::create_dir_all(&lake).unwrap();
    let local = Substrate::new("box", "local").raw(&format!(
        r#"
gpu_model = "NVIDIA L4"
gpu_uuids = ["GPU-box-0", "GPU-box-1"]
accounts = {{ ada = "{}" }}
"#,
        support::accounts::lease_account()
    ));
    let config = config(dir, &broker.bootstrap)
        .raw(&lake_section(&lake))
        .store(&store)
        .raw(&format!(
            "[enforcer.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
            api_cert.display(),
            api_key.display(),
            ca.display()
        ))
        .team(Team::new("ml", 8, 1000.0).members(&["ada"]))
        .substrate(local)
        .substrate(Substrate::kubernetes(
            "k8s",
            &kubeconfig,
            &hook_cert,
            &hook_key,
        ));
    let config = write(config, dir);

    let report = Report::of(doctor(&config, &[]));
    assert_eq!(report.code, Some(0), "{report}");
    let lines = report.lines();
    let (summary, checks) = lines.split_last().unwrap();
    for line in checks {
        assert!(line.starts_with("ok      "), "{line}\n\n{report}");
    }
    let known = gpuwarden_enforcer::store::probe::postgres_version();
    for expected in [
        format!("ok      kafka: {0} answered: 1 broker (", broker.bootstrap),
        "ok      topic gpuwarden.samples: 3 partitions (kafka.partitions), replication 1, each with a leader".into(),
        "ok      topic gpuwarden.actions: 3 partitions (kafka.partitions), replication 1, each with a leader".into(),
        "ok      clock: within pipeline.clock.max_skew (5m) of its producer's clock (CreateTime): the newest record, gpuwarden.samples [".into(),
        format!("ok      lake: {} took a file, gave it back and let it be deleted", lake.display()),
        format!("ok      store: {store} answered: schema version 1, older than this build's {known}: will migrate on start"),
        "ok      substrate box: local: answered: 2 GPUs named (2 × NVIDIA L4); the account in `accounts` resolves".into(),
        "ok      substrate k8s: kubernetes: answered: pooled 8 × NVIDIA H100 80GB HBM3".into(),
        format!("ok      tls enforcer.tls.cert: {}: CN=api valid until ", api_cert.display()),
        format!("ok      tls enforcer.tls.key: {} is readable and holds a private key", api_key.display()),
        format!("ok      tls enforcer.tls.client_ca: {}: CN=clients valid until ", ca.display()),
        format!("ok      tls enforcer.tls: the key in {} is the certificate's in {}; the listener loads them", api_key.display(), api_cert.display()),
        "ok      tls substrates.k8s.kubernetes.webhook_tls: the key in ".into(),
        "ok      signing: signing.key is set (64 bytes)".into(),
    ] {
        assert!(
            checks.iter().any(|l| l.starts_with(&expected)),
            "no line starting {expected:?}\n\n{report}"
        );
    }
    assert_eq!(
        *summary,
        format!("doctor: {} ok, 0 warn, 0 FAIL, 0 skipped", checks.len())
    );
    // Nothing was left behind in the lake, and the store was not migrated.
    assert_eq!(std::fs::read_dir(&lake).unwrap().count(), 0);
    let version: i64 = pg::Postgres::client(&store)
        .query_one("SELECT version FROM schema_version", &[])
        .unwrap()
        .get(0);
    assert_eq!(version, 1);
}

#[test]
fn brokers_that_do_not_answer_fail_and_their_checks_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = format!("127.0.0.1:{}", closed_port());
    let config = write(config(dir.path(), &bootstrap), dir.path());
    let started = Instant::now();
    let report = Report::of(doctor(&config, &["--timeout", "3s"]));
    assert!(started.elapsed() < Duration::from_secs(15), "{report}");
    // librdkafka's last words: the refused connection, or the count of brokers down after it.
    let said = if report.stdout.contains("Connection refused") {
        "Connection refused"
    } else {
        "1 brokers are down"
    };
    report.assert_only_failure(
        &format!("FAIL    kafka: Kafka at {bootstrap}: "),
        said,
        "; fix: check kafka.brokers, that the brokers are up and reachable from this host, and \
         the security settings in [kafka.properties]",
    );
    let lines = report.lines();
    assert!(
        lines.contains(
            &"skipped topics: the brokers did not answer, so the topics were not looked at"
        ),
        "{report}"
    );
    assert!(
        lines
            .contains(&"skipped clock: the brokers did not answer, so no record dates their clock"),
        "{report}"
    );
}

#[test]
fn topics_of_another_partition_count_fail_each() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    // The config says 6; the broker's topics have 3.
    let six = config(dir.path(), &broker.bootstrap).raw("[kafka]\npartitions = 6\n");
    let config = write(six, dir.path());
    let report = Report::of(doctor(&config, &[]));
    let expected: Vec<String> = gpuwarden_schema::topics::ALL
        .iter()
        .map(|topic| {
            format!(
                "FAIL    topic {topic}: has 3 partitions; kafka.partitions says 6; fix: set \
                 kafka.partitions = 3 to match the cluster, or add partitions with \
                 kafka-topics.sh --alter --topic {topic} --partitions 6 (Kafka cannot take \
                 partitions away)"
            )
        })
        .collect();
    let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    report.assert_fails_with(&expected);
}

#[test]
fn a_missing_topic_is_a_warning_the_components_mend_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(BrokerKind::Tansu, dir.path());
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        support::kafka::client(&broker.bootstrap).create().unwrap();
    let deleted = futures::executor::block_on(admin.delete_topics(
        &["gpuwarden.actions"],
        &rdkafka::admin::AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
    ))
    .unwrap();
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
    let base = config(dir.path(), &broker.bootstrap);
    let config = write(base.clone(), dir.path());
    let report = Report::of(doctor(&config, &[]));
    assert_eq!(report.code, Some(0), "{report}");
    assert!(report.failures().is_empty(), "{report}");
    assert!(
        report.lines().contains(
            &"warn    topic gpuwarden.actions: does not exist yet: collect, pipeline and enforce \
              create it at their start, with 3 partitions and replication 1; fix: nothing, if \
              gpuwarden's Kafka user may create topics; otherwise create it: kafka-topics.sh \
              --create --topic gpuwarden.actions --partitions 3 --replication-factor 1"
        ),
        "{report}"
    );
    // Where the replication factor cannot be met, the components could not create it either.
    write(base.raw("[kafka]\nreplication_factor = 3\n"), dir.path());
    Report::of(doctor(&config, &[])).assert_fails_with(&[
        "FAIL    topic gpuwarden.actions: does not exist, and cannot be created with \
         kafka.replication_factor = 3 on 1 broker; fix: set kafka.replication_factor to at most \
         1, or create the topic: kafka-topics.sh --create --topic gpuwarden.actions \
         --partitions 3 --replication-factor N",
    ]);
}

#[test]
fn a_lake_under_a_regular_file_fails() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, "not a directory").unwrap();
    let lake = file.join("lake");
    let config = write(
        config(dir.path(), "embedded").raw(&lake_section(&lake)),
        dir.path(),
    );
    Report::of(doctor(&config, &[])).assert_fails_with(&[&format!(
        "FAIL    lake: {lake} cannot be made: {file} is a file, not a directory; fix: set \
         storage.lake to a directory, or move {file} out of the way",
        lake = lake.display(),
        file = file.display()
    )]);
}

#[test]
fn a_lake_in_a_bucket_that_refuses_the_credentials_fails() {
    let dir = tempfile::tempdir().unwrap();
    let server = support::s3::S3Server::start(&dir.path().join("s3"), "lake");
    let config = server.config_file(dir.path(), "doctor");
    // The same server and bucket, a wrong secret key.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        &format!("secret_access_key = \"{}\"", support::s3::SECRET_KEY),
        "secret_access_key = \"not-the-secret\"",
    );
    assert!(text.contains("not-the-secret"), "{text}");
    std::fs::write(&config, text).unwrap();
    let report = Report::of(doctor(&config, &[]));
    report.assert_only_failure(
        "FAIL    lake: writing doctor/_doctor-",
        "in s3://lake/doctor",
        "; fix: check storage.lake's bucket, [storage.s3] (endpoint, region, credentials) and \
         that the credentials may put, get and delete objects under the prefix",
    );
    // Nothing was written.
    assert!(
        server.keys("doctor").is_empty(),
        "{:?}",
        server.keys("doctor")
    );
}

#[test]
fn a_store_newer_than_this_build_fails_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_at_schema(999);
    let config = write(config(dir.path(), "embedded").store(&store), dir.path());
    let known = gpuwarden_enforcer::store::probe::postgres_version();
    Report::of(doctor(&config, &[])).assert_fails_with(&[&format!(
        "FAIL    store: {store} is at schema version 999, newer than this build's {known}: a \
         newer gpuwarden wrote it, and this one refuses to open it; fix: run the gpuwarden \
         release that wrote it, or a later one, here (this is {})",
        env!("CARGO_PKG_VERSION")
    )]);
}

#[test]
fn a_kubernetes_api_server_that_refuses_connections_fails_its_substrate() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = support::kube_api::kubeconfig_for(
        &format!("http://127.0.0.1:{}", closed_port()),
        dir.path(),
    );
    let (cert, key) = certificate(dir.path(), "webhook", 365);
    let k8s = Substrate::kubernetes("k8s", &kubeconfig, &cert, &key);
    let config = write(config(dir.path(), "embedded").substrate(k8s), dir.path());
    Report::of(doctor(&config, &[])).assert_only_failure(
        "FAIL    substrate k8s: substrate k8s: listing the nodes: ",
        "client error (Connect)",
        "; fix: check that the API server of the kubeconfig (or the in-cluster service) is \
         reachable from this host",
    );
}

#[test]
fn a_slurm_whose_commands_hang_fails_its_substrate_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("slurm-bin");
    std::fs::create_dir_all(&bin).unwrap();
    // A controller that never answers: every command waits, as one does on a dead slurmctld's
    // MessageTimeout and retries.
    // The driver runs them with PATH set to bin_dir alone.
    let sleep = format!("/bin/sleep 3600.{}", std::process::id());
    for tool in ["sbatch", "squeue", "sinfo", "scancel", "scontrol"] {
        let path = bin.join(tool);
        std::fs::write(&path, format!("#!/bin/sh\nexec {sleep}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let hpc = Substrate::new("hpc", "slurm").raw(&format!(
        "[slurm]\ncluster = \"hpc\"\nbin_dir = \"{}\"\n",
        bin.display()
    ));
    let config = write(config(dir.path(), "embedded").substrate(hpc), dir.path());
    let started = Instant::now();
    let report = Report::of(doctor(&config, &["--timeout", "2s"]));
    assert!(started.elapsed() < Duration::from_secs(10), "{report}");
    report.assert_fails_with(&[
        "FAIL    substrate hpc: substrate hpc (slurm) did not answer within 2s; fix: check that \
         slurmctld answers (scontrol ping) and munged runs on this host",
    ]);
    // The hung squeue was killed with the probe, not left behind.
    let left = Command::new("pgrep").args(["-f", &sleep]).output().unwrap();
    let left = String::from_utf8_lossy(&left.stdout).trim().to_string();
    for pid in left.split_whitespace() {
        let _ = Command::new("kill").arg(pid).status();
    }
    assert!(left.is_empty(), "left running: {left}");
}

#[test]
fn a_certificate_close_to_expiry_and_a_missing_ca_fail() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = certificate(dir.path(), "api", 3);
    let missing = dir.path().join("clients-ca.pem");
    let tls = format!(
        "[enforcer.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
        cert.display(),
        key.display(),
        missing.display()
    );
    let config = write(config(dir.path(), "embedded").raw(&tls), dir.path());
    let report = Report::of(doctor(&config, &[]));
    assert_eq!(report.code, Some(1), "{report}");
    let failures = report.failures();
    assert_eq!(failures.len(), 2, "{report}");
    let expiring = failures[0];
    let start = format!(
        "FAIL    tls enforcer.tls.cert: {}: CN=api expires on ",
        cert.display()
    );
    assert!(expiring.starts_with(&start), "{report}");
    assert!(
        expiring.ends_with(
            ", in 2d 23h; fix: renew it (the API, SQL and webhook listeners read a renewed file \
             without a restart)"
        ),
        "{report}"
    );
    assert_eq!(
        failures[1],
        format!(
            "FAIL    tls enforcer.tls.client_ca: cannot read {0}: No such file or directory (os \
             error 2); fix: put the file there, readable by the account gpuwarden runs as, or \
             correct enforcer.tls.client_ca",
            missing.display()
        )
    );
}

#[test]
fn no_signing_key_fails_where_records_are_signed() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = write(unsigned(dir.path(), &broker.bootstrap), dir.path());
    Report::of(doctor(&config, &[])).assert_fails_with(&[
        "FAIL    signing: signing.key is not set: the pipeline signs no signal and the enforcer \
         refuses every one, so budgets, idle reclaim and autoscaling never act, and lease events \
         and actions go unsigned; fix: set [signing] key = \"${GPUWARDEN_SIGNING_KEY}\" with the \
         variable holding `openssl rand -hex 32`, the same on the pipeline's and the enforcer's \
         hosts (a collector-only host: --skip signing)",
    ]);
}

#[test]
fn a_record_stamped_past_max_skew_fails_the_clock() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    // A producer whose clock runs an hour ahead of this machine's.
    produce_at(
        &broker.bootstrap,
        "gpuwarden.samples",
        now_ms() + 3_600_000 + 30_000,
    );
    let config = write(config(dir.path(), &broker.bootstrap), dir.path());
    report_clock(Report::of(doctor(&config, &[])));

    fn report_clock(report: Report) {
        report.assert_only_failure(
            "FAIL    clock: gpuwarden.samples [",
            "] offset 0 is stamped 1h ahead of this machine's clock by its producer's clock \
             (CreateTime), more than pipeline.clock.max_skew (5m): the pipeline quarantines \
             what the clock that is wrong dates",
            "; fix: set this machine's clock right (NTP: chronyc tracking, timedatectl \
             show-timesync), and the clock of the host that stamped it",
        );
    }
}

#[test]
fn a_config_that_does_not_load_fails_before_any_check() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gpuwarden.toml");
    std::fs::write(&config, "[kafka]\nbrokers = 42\n").unwrap();
    let report = Report::of(doctor(&config, &[]));
    report.assert_fails_with(&[&format!(
        "FAIL    config: {0} does not load: 1 problem (above); fix: correct them (`gpuwarden \
         check-config {0}` lists them too); no other check runs without a config",
        config.display()
    )]);
    assert!(report.stderr.contains("kafka.brokers"), "{report}");
}

#[test]
fn help_teaches_each_check_with_an_example() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["doctor", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for check in [
        "config",
        "kafka",
        "topic T",
        "clock",
        "lake",
        "store",
        "substrate S",
        "tls F",
        "signing",
        "Example:",
        "--timeout",
        "--skip",
    ] {
        assert!(help.contains(check), "no {check:?} in:\n{help}");
    }
}
