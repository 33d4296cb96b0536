//! The `gpuwarden` commands the tests start the same way: the pipeline and the collector on free
//! ports (the latter on the fake libnvidia-ml.so beside the tests), the demo, whose banner gives
//! its addresses, and the self-service commands a user runs against the API.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

use super::Running;

/// Starts `gpuwarden pipeline` with `/metrics` on a free port of 127.0.0.1; returns it and its
/// "pipeline running" log line.
pub fn start_pipeline(config: &Path) -> (Running, Value) {
    pipeline(config, &[], Duration::from_secs(30))
}

/// Starts `gpuwarden pipeline` with `/metrics` and the SQL endpoint on free ports of 127.0.0.1;
/// returns it and its "pipeline running" log line, which names both.
pub fn start_pipeline_serving_sql(config: &Path) -> (Running, Value) {
    pipeline(
        config,
        &["--sql-listen", "127.0.0.1:0"],
        Duration::from_secs(60),
    )
}

/// [`start_pipeline_serving_sql`], and the SQL endpoint's port.
pub fn start_pipeline_with_sql(config: &Path) -> (Running, u16) {
    let (pipeline, running) = start_pipeline_serving_sql(config);
    let address = running["sql"].as_str().expect("the sql field");
    assert!(address.starts_with("127.0.0.1:"), "{address}");
    (pipeline, sql_port(&running))
}

fn pipeline(config: &Path, args: &[&str], timeout: Duration) -> (Running, Value) {
    let config = config.to_str().unwrap();
    let mut all = vec![
        "pipeline",
        "--config",
        config,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let mut pipeline = Running::start(&all, &[]);
    let running = pipeline.wait_for_log("pipeline running", timeout);
    (pipeline, running)
}

/// The `host:port` of the `/metrics` a "… running" log line names.
pub fn metrics_address(running: &Value) -> String {
    running["metrics"]
        .as_str()
        .expect("the metrics field")
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string()
}

/// The port of the SQL endpoint a "pipeline running" (or "gpuwarden up") log line names.
pub fn sql_port(running: &Value) -> u16 {
    let address = running["sql"].as_str().expect("the sql field");
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// Runs a self-service command (`request`, `leases`, `release`, …) against the API at `api` as
/// user ada, with the bearer token `token`.
pub fn self_service(api: &str, token: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(args)
        .env("GPUWARDEN_API", api)
        .env("GPUWARDEN_TOKEN", token)
        .env("GPUWARDEN_USER", "ada")
        .output()
        .expect("runs gpuwarden")
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
