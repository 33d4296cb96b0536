//! Broker faults, on tansu (an independent Kafka-protocol broker, tests/support/tansu.rs) in a
//! process of its own with its records in the tests' S3 server, so that they outlive the
//! broker: the broker killed for 30 s while collector, pipeline and enforcer run, then started
//! again. The collector buffers within its bound and says so, the enforcer's outbox holds what
//! it decides meanwhile, and once the broker is back every sample is in the lake exactly once,
//! the lag returns to zero and the outbox drains.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::s3::S3Server;
use support::tansu::{Storage, Tansu, TlsFront};
use support::{
    eventually, http, metric, metrics_address, start_pipeline, Config, Running, Substrate, Team,
    Workload, H100,
};

const TOKEN: &str = "faults-portal-token";

fn write_config(dir: &Path, bootstrap: &str) -> std::path::PathBuf {
    config(dir, bootstrap).write(dir.join("gpuwarden.toml"))
}

/// Team `research` (quota 8, member alice) on a simulated fleet of 8 H100s, the collector
/// sampling every second, and a service token for it.
fn config(dir: &Path, bootstrap: &str) -> Config {
    Config::new()
        .broker(bootstrap)
        .data_dir(&dir.join("data"))
        .raw(
            r#"
[collector]
source = "simulated"
interval = "1s"

[pipeline]
flush_age = "300ms"
"#,
        )
        .pricing(2.0)
        .team(Team::new("research", 8, 100000.0).members(&["alice"]))
        .workload(Workload::new("training").max_gpus(8).max_duration("24h"))
        .enforcer()
        .substrate(Substrate::simulated("sim").hosts("h", 2, 4, H100))
        .token("portal", TOKEN, "service", &["research"])
}

/// Admits one GPU for research and returns the lease id.
fn admit(api: &str) -> String {
    let (status, body) = http(
        api,
        "POST",
        "/v1/admission",
        Some(TOKEN),
        Some(
            r#"{"team":"research","user":"alice","project":"p","workload":"training","gpus":1,"duration":"1h"}"#,
        ),
    );
    assert_eq!(status, 200, "{body}");
    let decision: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(decision["decision"], "admitted", "{body}");
    decision["lease"]["id"].as_str().unwrap().to_string()
}

#[test]
fn a_broker_down_for_30_s_loses_and_doubles_nothing_and_everything_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "tansu");
    let mut broker = Tansu::start(&dir.path().join("tansu"), Storage::S3(&server), 3);
    let config = write_config(dir.path(), &broker.bootstrap);
    let lake = dir.path().join("data/lake");
    let grants = |id: &str| {
        support::try_lake_i64(
            &lake,
            &format!(
                "SELECT count(*) FROM lease_events WHERE lease_id = '{id}' AND event = 'granted'"
            ),
        )
        .unwrap_or(0)
    };

    let (pipeline, running) = start_pipeline(&config);
    let pipeline_metrics = metrics_address(&running);
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let api = enforcer.wait_for_log("enforcer running", Duration::from_secs(60))["api"]
        .as_str()
        .expect("the api field")
        .trim_start_matches("http://")
        .to_string();
    let mut collector = Running::start(
        &[
            "collect",
            "--config",
            config.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let collector_metrics =
        metrics_address(&collector.wait_for_log("collector running", Duration::from_secs(30)));
    let collector_metric = |name: &str| metric(&collector_metrics, name).unwrap_or(-1.0);
    // Samples not yet acknowledged: in the collector's buffer, or handed to its producer.
    let waiting = || {
        collector_metric("gpuwarden_collector_buffer_samples")
            + collector_metric("gpuwarden_collector_in_flight_samples")
    };

    // Everything flows before the fault: a lease's grant and the fleet's samples in the lake.
    let before = admit(&api);
    eventually(
        "the first grant in the lake",
        Duration::from_secs(60),
        || match grants(&before) {
            1 => Ok(()),
            n => Err(n),
        },
    );
    eventually(
        "samples in the lake",
        Duration::from_secs(60),
        || match support::try_lake_i64(&lake, "SELECT count(*) FROM samples") {
            Ok(n) if n >= 16 => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );

    // The broker dies. For 30 s the collector buffers and the enforcer admits into its outbox.
    broker.kill();
    let down = Instant::now();
    let during = admit(&api);
    eventually(
        "the collector buffering",
        Duration::from_secs(20),
        || match waiting() {
            n if n > 0.0 => Ok(()),
            n => Err(n),
        },
    );
    collector.wait_for_log("Kafka unreachable", Duration::from_secs(30));
    // Counted by error for /metrics, and logged once per ten seconds, not at every retry.
    assert!(
        collector_metric("gpuwarden_kafka_errors_total{error=\"AllBrokersDown\"}") >= 1.0,
        "{}",
        support::http_get(&collector_metrics, "/metrics").1
    );
    std::thread::sleep(Duration::from_secs(30).saturating_sub(down.elapsed()));
    let buffered = waiting();
    assert!(
        buffered >= 8.0 * 20.0,
        "8 GPUs sampled every second for 30 s wait in the buffer: {buffered}"
    );
    assert_eq!(
        collector_metric("gpuwarden_collector_samples_dropped_total{reason=\"buffer_full\"}"),
        0.0,
        "the buffer's bound is far above 30 s of 8 GPUs"
    );
    assert_eq!(grants(&during), 0, "admitted while the broker was down");
    println!("broker down for {:.1} s", down.elapsed().as_secs_f64());

    // Back: the buffer and the outbox drain, the lag returns to zero.
    broker.start_again();
    let up = Instant::now();
    eventually(
        "the collector's buffer drained",
        Duration::from_secs(120),
        || match waiting() {
            0.0 => Ok(()),
            n => Err(n),
        },
    );
    collector.wait_for_log("Kafka reachable again", Duration::from_secs(30));
    eventually(
        "the outbox's grant in the lake",
        Duration::from_secs(120),
        || match grants(&during) {
            1 => Ok(()),
            n => Err(format!(
                "{n} grants; the enforcer's log:\n{}",
                enforcer.log_so_far()
            )),
        },
    );
    let after = admit(&api);
    eventually(
        "a grant after the outage in the lake",
        Duration::from_secs(60),
        || match grants(&after) {
            1 => Ok(()),
            n => Err(n),
        },
    );
    eventually(
        "the pipeline's lag back to zero",
        Duration::from_secs(60),
        || match metric(
            &pipeline_metrics,
            "gpuwarden_pipeline_consumer_lag_messages",
        ) {
            Some(0.0) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    println!(
        "caught up {:.1} s after the broker came back",
        up.elapsed().as_secs_f64()
    );

    // Stopped in order, every sample the collector had acknowledged is in the lake once.
    let (status, log) = collector.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
    let error_lines = log
        .iter()
        .filter(|l| l.contains("Kafka broker error"))
        .count();
    assert!(
        (1..=12).contains(&error_lines),
        "one line per error kind and 10 s at most, over about 35 s: {error_lines}\n{}",
        log.join("\n")
    );
    let stopped = support::log_line(&log, "collector stopped");
    let field = |name: &str| {
        stopped[name]
            .as_u64()
            .or(stopped["fields"][name].as_u64())
            .unwrap_or_else(|| panic!("{name} in {stopped}"))
    };
    let (published, dropped) = (field("published"), field("dropped"));
    assert_eq!(dropped, 0, "{}", log.join("\n"));
    eventually(
        "every published sample in the lake",
        Duration::from_secs(60),
        || {
            let rows = support::try_lake_i64(&lake, "SELECT count(*) FROM samples").unwrap_or(0);
            if rows == published as i64 {
                Ok(())
            } else {
                Err(format!("{rows} rows of {published} published"))
            }
        },
    );
    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    let (status, log) = pipeline.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
    assert_eq!(
        support::lake_i64(
            &lake,
            "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples"
        ),
        published as i64,
        "nothing lost, nothing doubled"
    );
    assert_eq!(
        support::lake_i64(&lake, "SELECT count(*) FROM lease_events"),
        3,
        "three grants, each once"
    );
}

/// A broker that refuses gpuwarden's login (SASL/SCRAM, the wrong password) stops each command
/// at its start with the broker's reason and the settings to check, instead of retrying
/// unseen: the collector and the pipeline, which reach Kafka before they run, and the enforcer,
/// which otherwise starts while Kafka is down and waits for it.
#[test]
fn a_refused_login_stops_each_command_at_start_naming_the_settings() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Tansu::start_refusing_logins(&dir.path().join("tansu"));
    let config = config(dir.path(), &broker.bootstrap)
        .raw(
            r#"
[kafka.properties]
"security.protocol" = "SASL_PLAINTEXT"
"sasl.mechanism" = "SCRAM-SHA-256"
"sasl.username" = "gpuwarden"
"sasl.password" = "not-the-password"
"#,
        )
        .write(dir.path().join("gpuwarden.toml"));
    for command in ["collect", "pipeline", "enforce"] {
        let started = Instant::now();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args([command, "--config", config.to_str().unwrap()])
            .output()
            .unwrap();
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains("SASL") && stderr.contains("sasl.password"),
            "{command}: the broker's reason and the settings to check:\n{stderr}"
        );
        println!("{command}: stopped after {:.1} s", took.as_secs_f64());
    }
}

/// `[kafka.properties]` of a client of the brokers over TLS (`security.protocol`), trusting
/// `ca`, with SASL/SCRAM when `password` is given.
fn with_tls(config: &Path, ca: &Path, password: Option<&str>) {
    let mut properties = format!("\"ssl.ca.location\" = \"{}\"\n", ca.display());
    match password {
        Some(password) => properties.push_str(&format!(
            "\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\
             \"sasl.username\" = \"gpuwarden\"\n\"sasl.password\" = \"{password}\"\n"
        )),
        None => properties.push_str("\"security.protocol\" = \"SSL\"\n"),
    }
    let text = std::fs::read_to_string(config).unwrap().replace(
        "partitions = 3\n",
        &format!("partitions = 3\n[kafka.properties]\n{properties}"),
    );
    std::fs::write(config, text).unwrap();
}

/// Runs `gpuwarden <command>` to its end and returns its exit code and stderr.
fn run_to_end(command: &str, config: &Path) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args([command, "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// TLS to the brokers. tansu's build here serves no TLS (docs/src/operators/kafka-brokers.md), so stunnel
/// terminates it in front of the broker, which advertises the TLS port: gpuwarden's clients make
/// a real TLS handshake and verify the certificate against `ssl.ca.location`. With the CA that
/// signed it, samples go collector → broker → pipeline into the lake; with another CA, and with
/// SASL/SCRAM over TLS to a broker that refuses the password, each command stops at its start
/// with librdkafka's reason and the settings to check.
#[test]
fn tls_to_the_brokers_carries_samples_and_a_wrong_ca_or_password_stops_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ca = support::pki::Ca::new(dir.path(), "kafka-ca");
    let other = support::pki::Ca::new(dir.path(), "other-ca");
    let leaf = ca.server("broker");
    let port = TlsFront::port();
    let broker = Tansu::start_advertising(&dir.path().join("tansu"), port, &[]);
    let _front = TlsFront::start(dir.path(), port, &leaf.cert, &leaf.key, broker.port());
    let bootstrap = format!("127.0.0.1:{port}");

    let config = write_config(dir.path(), &bootstrap);
    with_tls(&config, &ca.cert, None);
    let lake = dir.path().join("data/lake");
    let (pipeline, _) = start_pipeline(&config);
    let mut collector = Running::start(&["collect", "--config", config.to_str().unwrap()], &[]);
    collector.wait_for_log("collector running", Duration::from_secs(30));
    eventually(
        "samples in the lake over TLS",
        Duration::from_secs(60),
        || match support::try_lake_i64(&lake, "SELECT count(*) FROM samples") {
            Ok(n) if n >= 16 => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    let (status, log) = pipeline.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));

    // A CA that did not sign the broker's certificate.
    let wrong_ca = dir.path().join("wrong-ca");
    std::fs::create_dir_all(&wrong_ca).unwrap();
    let config = write_config(&wrong_ca, &bootstrap);
    with_tls(&config, &other.cert, None);
    for command in ["collect", "pipeline", "enforce"] {
        let (code, stderr) = run_to_end(command, &config);
        assert_eq!(code, Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains("certificate verify failed") && stderr.contains("ssl.* settings"),
            "{command}: the handshake's failure and the settings to check:\n{stderr}"
        );
    }

    // SASL/SCRAM over TLS, to a broker that refuses the password.
    let refusing_dir = dir.path().join("refusing");
    let refusing_port = TlsFront::port();
    let refusing = Tansu::start_advertising(
        &refusing_dir.join("tansu"),
        refusing_port,
        &["--authentication"],
    );
    let _refusing_front = TlsFront::start(
        &refusing_dir,
        refusing_port,
        &leaf.cert,
        &leaf.key,
        refusing.port(),
    );
    let config = write_config(&refusing_dir, &format!("127.0.0.1:{refusing_port}"));
    with_tls(&config, &ca.cert, Some("not-the-password"));
    for command in ["collect", "pipeline", "enforce"] {
        let (code, stderr) = run_to_end(command, &config);
        assert_eq!(code, Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains("sasl_ssl://") && stderr.contains("sasl.password"),
            "{command}: SASL over TLS refused, and the settings to check:\n{stderr}"
        );
    }
}
