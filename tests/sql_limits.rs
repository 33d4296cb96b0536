//! What one SQL query may do to the rest of `gpuwarden up`, with the real psql: a runaway cross
//! join runs on threads of its own while ingest, rollups, signals, `/metrics` and other users go
//! on; psql's Ctrl-C cancels it (57014) and frees the CPU; a client that disconnects has its
//! query stopped; SIGTERM during a query ends the process within its deadline. The limits that
//! give their own SQLSTATE (timeout, memory, concurrency) are in tests/sql_endpoint.rs.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::{
    eventually, http_get, metric, sql_threads_busy, until_sql_threads_busy, Config, Psql, Running,
    Substrate, Team, H100,
};

const T0: i64 = 1_796_032_800_000;
/// The query of the report that found the problem: 1,500³ rows to order, longer than any test.
const RUNAWAY: &str = "SELECT a.host, b.host, c.host FROM samples a, samples b, samples c \
                       ORDER BY a.ts_ms, b.ts_ms LIMIT 5";
/// Wall time between rollups: pipeline.rollup_every.
const ROLLUP_EVERY: Duration = Duration::from_secs(2);
/// Wall time between signal computations: pipeline.signals.every (1 min of event time) at 60×.
const SIGNALS_EVERY: Duration = Duration::from_secs(1);

fn write_config(dir: &Path) -> PathBuf {
    Config::new()
        .kafka("embedded")
        .data_dir(&dir.join("data"))
        .up()
        .raw(
            r#"
[pipeline]
shutdown_deadline = "20s"

[[pipeline.sql_users]]
name = "analyst"
password = "analyst-pw"

[[pipeline.sql_users]]
name = "finops"
password = "finops-pw"
"#,
        )
        .signals("1m", "3m")
        .team(Team::new("ml", 16, 1000000.0).members(&["ada"]))
        .substrate(Substrate::simulated("sim").hosts("h", 1, 8, H100))
        .write(dir.join("gpuwarden.toml"))
}

/// 1,500 samples in the lake before the start, so that the cross join is a runaway at once.
fn ingest_old_samples(config: &Path, dir: &Path) {
    let mut lines = String::new();
    for i in 0..1_500_i64 {
        lines.push_str(
            &serde_json::json!({
                "v": 1, "ts_ms": T0 + (i / 8) * 60_000, "interval_ms": 60_000,
                "host": "old-node", "gpu_uuid": format!("GPU-old-{}", i % 8),
                "gpu_model": "NVIDIA H100 80GB HBM3", "util_gpu_pct": 50.0,
                "mem_used_bytes": 1u64 << 30, "mem_total_bytes": 85_899_345_920u64
            })
            .to_string(),
        );
        lines.push('\n');
    }
    support::ingest_samples(config, &dir.join("samples.jsonl"), &lines);
}

/// The longest wall time between two increases of the counter `name`, watched on `/metrics`
/// for `watch`; every scrape must answer within a second.
fn longest_gap(metrics: &str, names: &[&str], watch: Duration) -> Vec<Duration> {
    let started = Instant::now();
    let mut last: Vec<(f64, Instant)> = names
        .iter()
        .map(|n| (metric(metrics, n).unwrap_or(0.0), started))
        .collect();
    let mut longest = vec![Duration::ZERO; names.len()];
    while started.elapsed() < watch {
        let scrape = Instant::now();
        let (status, body) = http_get(metrics, "/metrics");
        let took = scrape.elapsed();
        assert_eq!(status, 200, "{body}");
        assert!(took < Duration::from_secs(1), "/metrics took {took:?}");
        for (i, name) in names.iter().enumerate() {
            let value: f64 = body
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(0.0);
            if value > last[i].0 {
                longest[i] = longest[i].max(last[i].1.elapsed());
                last[i] = (value, Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for (i, (_, at)) in last.iter().enumerate() {
        longest[i] = longest[i].max(at.elapsed());
    }
    longest
}

#[test]
fn a_runaway_query_holds_back_neither_the_pipeline_nor_other_users_and_stops_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path());
    ingest_old_samples(&config, dir.path());
    let mut up = Running::start(
        &["up", "--config", config.to_str().unwrap(), "--speed", "60"],
        &[],
    );
    let line = up.wait_for_log("gpuwarden up", Duration::from_secs(120));
    let port = support::sql_port(&line);
    let metrics = line["pipeline_metrics"]
        .as_str()
        .unwrap()
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string();
    let pid = up.pid();
    let finops = Psql::new(port, "finops", Some("finops-pw"));
    let counters = [
        "gpuwarden_pipeline_rollups_total",
        "gpuwarden_pipeline_signal_computations_total",
    ];
    eventually(
        "rollups and signals",
        Duration::from_secs(60),
        || match counters.map(|c| metric(&metrics, c).unwrap_or(0.0)) {
            [r, s] if r >= 2.0 && s >= 2.0 => Ok(()),
            seen => Err(format!("{seen:?}")),
        },
    );
    let quiet = longest_gap(&metrics, &counters, Duration::from_secs(6));
    eprintln!(
        "longest gaps without a query: rollups {:?}, signals {:?}",
        quiet[0], quiet[1]
    );

    // The runaway, and meanwhile the pipeline and another user.
    let analyst = Psql::new(port, "analyst", Some("analyst-pw"));
    let mut runaway = analyst.spawn(RUNAWAY);
    until_sql_threads_busy(pid);
    let started = Instant::now();
    let rows = finops.rows("SELECT count(*) FROM teams");
    let small = started.elapsed();
    assert_eq!(rows, ["1"]);
    assert!(
        small < Duration::from_secs(1),
        "the small query took {small:?}"
    );
    let busy = longest_gap(&metrics, &counters, Duration::from_secs(10));
    eprintln!(
        "during the runaway: small query {small:?}; longest gaps: rollups {:?}, signals {:?}",
        busy[0], busy[1]
    );
    assert!(
        busy[0] <= 2 * ROLLUP_EVERY,
        "rollups stalled for {:?}",
        busy[0]
    );
    assert!(
        busy[1] <= 2 * SIGNALS_EVERY,
        "signals stalled for {:?}",
        busy[1]
    );
    assert!(
        runaway.try_wait().unwrap().is_none(),
        "the runaway query ended by itself"
    );

    // psql's Ctrl-C: a cancel request.
    let _ = Command::new("kill")
        .args(["-INT", &runaway.id().to_string()])
        .status();
    eventually(
        "psql to end after Ctrl-C",
        Duration::from_secs(10),
        || match runaway.try_wait().unwrap() {
            Some(_) => Ok(()),
            None => Err("psql still waits"),
        },
    );
    let mut stderr = String::new();
    std::io::Read::read_to_string(runaway.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(
        stderr.contains("57014") && stderr.contains("canceling statement due to user request"),
        "{stderr}"
    );
    let after = sql_threads_busy(pid, Duration::from_secs(1));
    assert!(
        after <= 2,
        "the SQL threads used {after} ticks in the second after the cancel"
    );

    // A client that goes away without a word.
    let mut gone = analyst.spawn(RUNAWAY);
    until_sql_threads_busy(pid);
    gone.kill().unwrap();
    gone.wait().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let after = sql_threads_busy(pid, Duration::from_secs(1));
    assert!(
        after <= 2,
        "the SQL threads used {after} ticks in the second after the client left"
    );

    // SIGTERM during a query: the client is told, and the process ends well within its deadline.
    let last = analyst.spawn(RUNAWAY);
    until_sql_threads_busy(pid);
    let stopping = Instant::now();
    let (status, log) = up.terminate(Duration::from_secs(20));
    let took = stopping.elapsed();
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
    assert!(took < Duration::from_secs(15), "stopping took {took:?}");
    let out = last.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("57P01"), "{stderr}");
    eprintln!("SIGTERM during a query: exited 0 in {took:?}");
}
