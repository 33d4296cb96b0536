//! The whole path as a user meets it, in separate processes that meet only in a broker process:
//! GPUs sampled by the collector land in the lake through the pipeline, and psql reads the
//! numbers as docs/src/finops/definitions.md defines them; an admission over HTTP
//! becomes a lease event, the simulated fleet runs it, and its cost appears in `team_hourly`
//! under its team.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{
    eventually, http, log_line, metric, metrics_address, start_fake_nvml_collector,
    start_pipeline_with_sql, Broker, BrokerKind, Config, Psql, Running, Substrate, Team, Workload,
    H100,
};

const TOKEN: &str = "e2e-portal-token";

fn num(text: &str) -> f64 {
    text.parse()
        .unwrap_or_else(|_| panic!("not a number: {text:?}"))
}

fn stop(process: Running, what: &str) {
    let (status, log) = process.terminate(Duration::from_secs(60));
    assert!(
        status.success(),
        "{what} stops cleanly on SIGTERM\n{}",
        log.join("\n")
    );
}

/// Two L40S GPUs through the fake libnvidia-ml.so, one at 80 % and one at 20 %, both at 200 W.
fn write_nvml_script(dir: &Path) -> PathBuf {
    let devices: Vec<serde_json::Value> = [(0, 80), (1, 20)]
        .iter()
        .map(|(i, util)| {
            serde_json::json!({
                "uuid": format!("GPU-e2e-{i}"),
                "name": "NVIDIA L40S",
                "index": i,
                "pci_bus_id": format!("00000000:{:02X}:00.0", 0x17 + i * 0x10),
                "memory_total_bytes": 48305799168u64,
                "memory_used_bytes": [4294967296u64],
                "util_gpu_pct": [util],
                "util_mem_pct": [10],
                "power_mw": [200000],
                "power_limit_mw": 350000,
                "energy_mj": [1000],
                "temp_c": [50],
                "sm_clock_mhz": [2520],
                "processes": [[]]
            })
        })
        .collect();
    let path = dir.join("nvml.json");
    std::fs::write(&path, serde_json::json!({ "devices": devices }).to_string()).unwrap();
    path
}

/// The broker at `bootstrap`, the data dir under `dir`, and a pipeline that flushes at 300 ms,
/// rolls up every second and lets psql in as anyone.
fn config(dir: &Path, bootstrap: &str) -> Config {
    Config::new()
        .broker(bootstrap)
        .data_dir(&dir.join("data"))
        .raw("[pipeline]\nflush_age = \"300ms\"\nrollup_every = \"1s\"\n")
        .anonymous_sql()
}

support::on_both_brokers!(
    collector_broker_pipeline_and_psql_agree_on_the_numbers,
    collector_to_psql
);
fn collector_to_psql(kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(kind, dir.path());
    let config = config(dir.path(), &broker.bootstrap)
        .raw(
            r#"
[collector]
source = "nvml"
interval = "1s"
host = "e2e-host"
"#,
        )
        .pricing(1.0)
        .gpu_price("l40s", 1.8)
        .write(dir.path().join("gpuwarden.toml"));

    // GPU-e2e-0 is leased to team research from a minute before the collector starts.
    let granted_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - 60_000;
    let grant = serde_json::json!({
        "v": 1, "ts_ms": granted_ms, "event": "granted", "lease_id": "l-e2e-0", "team": "research",
        "user": "alice", "project": "llm", "workload": "training", "substrate": "box",
        "gpu_model": "NVIDIA L40S", "gpu_count": 1, "gpu_uuids": ["GPU-e2e-0"]
    });
    support::kafka::produce(
        &broker.bootstrap,
        "gpuwarden.leases",
        "l-e2e-0",
        &grant.to_string(),
        &[],
    );

    let (pipeline, port) = start_pipeline_with_sql(&config);
    let psql = Psql::new(port, "anyone", None);
    let script = write_nvml_script(dir.path());
    let (collector, running) = start_fake_nvml_collector(&config, &script);
    let metrics = metrics_address(&running);
    // 2 GPUs sampled every second: 8 samples published within seconds.
    eventually(
        "8 samples published",
        Duration::from_secs(30),
        || match metric(&metrics, "gpuwarden_collector_samples_published_total") {
            Some(n) if n >= 8.0 => Ok(()),
            n => Err(format!("{n:?}")),
        },
    );
    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    let stopped = log_line(&log, "collector stopped");
    let published = stopped["published"]
        .as_u64()
        .or(stopped["fields"]["published"].as_u64())
        .expect("the count published");
    assert!(
        published >= 8,
        "at least the 8 /metrics showed before the stop: {published}"
    );

    // Everything the collector published is in the lake, once.
    eventually(
        "every published sample in the lake",
        Duration::from_secs(60),
        || {
            let n = num(&psql.one("SELECT count(*) FROM samples")) as u64;
            if n == published {
                Ok(())
            } else {
                Err(format!("{n} of {published}"))
            }
        },
    );
    // The observed and allocated hours the rollup must show, worked out from the raw samples:
    // per GPU Σ interval_ms, and the watermark (the last sample's time) for the running lease.
    let truth = psql.one(
        "SELECT sum(CASE WHEN gpu_uuid = 'GPU-e2e-0' THEN interval_ms ELSE 0 END), \
                sum(CASE WHEN gpu_uuid = 'GPU-e2e-1' THEN interval_ms ELSE 0 END), max(ts_ms) \
         FROM samples",
    );
    let truth: Vec<f64> = truth.split('|').map(num).collect();
    let (leased_ms, free_ms, watermark) = (truth[0], truth[1], truth[2]);
    let allocated_ms = watermark - granted_ms as f64;
    let team_hourly = "SELECT team, sum(allocated_gpu_hours), sum(observed_gpu_hours), \
                              sum(busy_gpu_hours), sum(idle_gpu_hours), sum(cost_usd), sum(energy_kwh) \
                       FROM team_hourly GROUP BY team ORDER BY team";
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    let teams = eventually(
        "team_hourly at the watermark",
        Duration::from_secs(60),
        || {
            let teams = psql.rows(team_hourly);
            let research = teams.iter().find(|r| r.starts_with("research|"));
            match research.map(|r| num(r.split('|').nth(1).unwrap())) {
                Some(allocated) if close(allocated * 3_600_000.0, allocated_ms) => Ok(teams),
                _ => Err(format!("{teams:?}")),
            }
        },
    );
    let hours = |ms: f64| ms / 3_600_000.0;
    // In team order: "(unallocated)" sorts first.
    let expected = [
        // GPU-e2e-1 (20 %) is no one's: allocated = observed.
        (
            "(unallocated)",
            [
                hours(free_ms),
                hours(free_ms),
                hours(free_ms) * 0.2,
                0.0,
                hours(free_ms) * 1.8,
                0.2 * hours(free_ms),
            ],
        ),
        // research holds GPU-e2e-0 (80 %) from the grant to the watermark, priced as an L40S.
        (
            "research",
            [
                hours(allocated_ms),
                hours(leased_ms),
                hours(leased_ms) * 0.8,
                0.0,
                hours(allocated_ms) * 1.8,
                0.2 * hours(leased_ms),
            ],
        ),
    ];
    assert_eq!(teams.len(), 2, "{teams:?}");
    for (row, (team, measures)) in teams.iter().zip(expected) {
        let fields: Vec<&str> = row.split('|').collect();
        assert_eq!(fields[0], team, "{teams:?}");
        for (i, (got, want)) in fields[1..].iter().map(|f| num(f)).zip(measures).enumerate() {
            assert!(
                close(got, want),
                "{team}, measure {i} of allocated/observed/busy/idle/cost/energy: {got} != {want}"
            );
        }
    }
    let per_gpu = psql.rows(
        "SELECT gpu_uuid, min(utilization_pct), max(utilization_pct) FROM gpu_hourly \
         GROUP BY gpu_uuid ORDER BY gpu_uuid",
    );
    assert_eq!(per_gpu, ["GPU-e2e-0|80.0|80.0", "GPU-e2e-1|20.0|20.0"]);
    stop(pipeline, "the pipeline");
}

support::on_both_brokers!(
    an_admission_over_http_is_priced_in_team_hourly_for_its_team,
    admission_to_team_hourly
);
fn admission_to_team_hourly(kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(kind, dir.path());
    let config = config(dir.path(), &broker.bootstrap)
        .raw("[collector]\nsource = \"simulated\"\ninterval = \"1s\"\n")
        .pricing(1.0)
        .gpu_price("h100", 4.0)
        .team(Team::new("research", 8, 10000.0).members(&["alice"]))
        .workload(Workload::new("training").max_gpus(8).max_duration("24h"))
        .enforcer()
        .substrate(Substrate::simulated("sim").hosts("h", 1, 4, H100))
        .token("portal", TOKEN, "service", &["research"])
        .write(dir.path().join("gpuwarden.toml"));

    let (pipeline, port) = start_pipeline_with_sql(&config);
    let psql = Psql::new(port, "anyone", None);
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let running = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = running["api"]
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
    collector.wait_for_log("collector running", Duration::from_secs(30));

    // A provisioning front-end asks for two GPUs for alice.
    let (status, body) = http(
        &api,
        "POST",
        "/v1/admission",
        Some(TOKEN),
        Some(
            r#"{"team":"research","user":"alice","project":"llm","workload":"training","gpus":2,"duration":"1h"}"#,
        ),
    );
    assert_eq!(status, 200, "{body}");
    let decision: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(decision["decision"], "admitted", "{body}");
    let lease = decision["lease"]["id"]
        .as_str()
        .expect("a lease id")
        .to_string();
    assert_eq!(decision["estimate"]["usd_per_hour"], 8.0, "{body}");

    // The grant reaches the lake, the fleet runs the lease and its samples name it.
    let attributed = format!("SELECT count(*) FROM samples WHERE lease_id = '{lease}'");
    eventually(
        "4 samples naming the lease",
        Duration::from_secs(60),
        || {
            let n = num(&psql.one(&attributed));
            if n >= 4.0 {
                Ok(())
            } else {
                Err(n)
            }
        },
    );
    // The lease runs on a while before its release: its whole lifetime is what is priced below.
    std::thread::sleep(Duration::from_secs(2));
    let (status, body) = http(
        &api,
        "POST",
        &format!("/v1/leases/{lease}/release"),
        Some(TOKEN),
        Some("{}"),
    );
    assert_eq!(status, 200, "{body}");

    // Once the release is in the lake, the lease's cost is 2 GPUs × its lifetime × $4, all of it
    // research's, in team_hourly as in lease_usage.
    let events = format!(
        "SELECT min(ts_ms), max(ts_ms), count(*) FROM lease_events WHERE lease_id = '{lease}'"
    );
    let (granted, released) =
        eventually("the release in the lake", Duration::from_secs(60), || {
            let row = psql.one(&events);
            let f: Vec<f64> = row.split('|').map(num).collect();
            if f[2] == 2.0 {
                Ok((f[0], f[1]))
            } else {
                Err(row)
            }
        });
    let want_hours = 2.0 * (released - granted) / 3_600_000.0;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    let usage = format!(
        "SELECT team, release_reason, allocated_gpu_hours, cost_usd FROM lease_usage \
         WHERE lease_id = '{lease}'"
    );
    let research = "SELECT sum(allocated_gpu_hours), sum(cost_usd) FROM team_hourly \
                    WHERE team = 'research'";
    eventually(
        "the lease's cost in team_hourly",
        Duration::from_secs(60),
        || {
            let row = psql.one(&usage);
            let usage: Vec<&str> = row.split('|').collect();
            let team = psql.one(research);
            let hours: Vec<f64> = team.split('|').map(num).collect();
            if usage[0] == "research"
                && usage[1] == "user"
                && close(num(usage[2]), want_hours)
                && close(num(usage[3]), want_hours * 4.0)
                && close(hours[0], want_hours)
                && close(hours[1], want_hours * 4.0)
            {
                Ok(())
            } else {
                Err(format!(
                    "lease_usage {row}, research {team}, want {want_hours} GPU-hours"
                ))
            }
        },
    );
    assert_eq!(
        psql.one(&format!(
            "SELECT state FROM leases WHERE lease_id = '{lease}'"
        )),
        "released"
    );
    stop(collector, "the collector");
    stop(enforcer, "the enforcer");
    stop(pipeline, "the pipeline");
}
