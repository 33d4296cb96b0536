//! One host with a wrong clock, as an operator meets it (docs/src/contributors/delivery.md#event-time).
//!
//! - With `gpuwarden ingest` and `gpuwarden rollup`: a few hours of an ordinary fleet (about
//!   20,000 samples, 6 leases, one still open, and one host whose clock runs 2 minutes ahead),
//!   plus one sample dated 400 days ahead. The rollups are exactly those of the fleet without
//!   it, the sample is the one quarantined row with its reason, the watermark is the fleet's,
//!   and the rollup computes the same hours (it took 187 s instead of about a second before).
//! - Through Kafka in `gpuwarden up`: the same sample, naming a running lease, blocks no team,
//!   builds no signal, moves neither watermark, shows on `/metrics`, and raises one alert at the
//!   webhook and one row in the `clock_skew` table.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use support::{eventually, http, http_get, Config, Psql, Running, Substrate, Team, Webhook, H100};

const S: i64 = 1_000;
const MIN: i64 = 60 * S;
const HOUR: i64 = 60 * MIN;
const DAY: i64 = 24 * HOUR;

fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn rfc3339(ms: i64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms as u64)).to_string()
}

fn gpuwarden(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpuwarden {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The fleet: 4 hosts of 8 H100s sampled every 25 s for 4 h 20 min up to `end`, one more host of
/// 2 GPUs whose clock runs 2 minutes ahead, and 6 leases of 2 GPUs on node-0 and node-1: five
/// of an hour, released, and one granted 4 hours before `end` and still running.
fn fleet(end: i64) -> (String, String) {
    let start = end - 4 * HOUR - 20 * MIN;
    let leases: Vec<(String, usize, i64, Option<i64>)> = (0..6)
        .map(|i| {
            let id = format!("l-{i}");
            // GPUs 2i and 2i+1 of node-0/node-1 (16 GPUs), the running one on the last two.
            let first_gpu = 2 * i;
            if i == 5 {
                (id, first_gpu, end - 4 * HOUR, None)
            } else {
                let granted = start + 10 * MIN + i as i64 * 35 * MIN;
                (id, first_gpu, granted, Some(granted + HOUR))
            }
        })
        .collect();
    let gpu_uuid = |host: &str, gpu: usize| format!("GPU-{host}-{gpu}");
    let mut samples = String::new();
    let mut ts = start;
    while ts <= end {
        for host in 0..4 {
            for gpu in 0..8 {
                let n = host * 8 + gpu;
                let lease = leases.iter().find(|(_, first, granted, released)| {
                    (n == *first || n == first + 1)
                        && ts >= *granted
                        && released.is_none_or(|r| ts < r)
                });
                let util = if lease.is_some() {
                    40.0 + ((ts / 25_000 + n as i64) % 50) as f64
                } else {
                    ((ts / 25_000 + n as i64) % 7) as f64
                };
                samples.push_str(
                    &json!({"v": 1, "ts_ms": ts, "interval_ms": 25_000,
                        "host": format!("node-{host}"), "gpu_uuid": gpu_uuid(&format!("node-{host}"), gpu),
                        "gpu_model": H100, "util_gpu_pct": util,
                        "mem_used_bytes": 1u64 << 34, "mem_total_bytes": 85_899_345_920u64,
                        "power_w": 300.0,
                        "lease_id": lease.map(|(id, ..)| id.clone())})
                    .to_string(),
                );
                samples.push('\n');
            }
        }
        for gpu in 0..2 {
            samples.push_str(
                &json!({"v": 1, "ts_ms": ts + 2 * MIN, "interval_ms": 25_000,
                    "host": "node-fast", "gpu_uuid": gpu_uuid("node-fast", gpu),
                    "gpu_model": H100, "util_gpu_pct": 3.0,
                    "mem_used_bytes": 0, "mem_total_bytes": 85_899_345_920u64})
                .to_string(),
            );
            samples.push('\n');
        }
        ts += 25 * S;
    }
    let mut events = String::new();
    for (id, first, granted, released) in &leases {
        let uuids: Vec<String> = (*first..first + 2)
            .map(|n| gpu_uuid(&format!("node-{}", n / 8), n % 8))
            .collect();
        let mut event = json!({"v": 1, "ts_ms": granted, "event": "granted", "lease_id": id,
            "team": if id == "l-5" { "ml" } else { "research" }, "user": "ada", "project": "p",
            "workload": "training", "substrate": "sim", "gpu_model": H100, "gpu_count": 2,
            "gpu_uuids": uuids});
        events.push_str(&event.to_string());
        events.push('\n');
        if let Some(released) = released {
            event["event"] = json!("released");
            event["ts_ms"] = json!(released);
            event["reason"] = json!("user");
            events.push_str(&event.to_string());
            events.push('\n');
        }
    }
    (samples, events)
}

/// A lake of its own under `dir`, loaded with `samples` and `events`; the output of ingest and
/// of rollup, and the rollup's wall time.
fn lake(dir: &Path, samples: &str, events: &str) -> (PathBuf, String, String, Duration) {
    std::fs::create_dir_all(dir).unwrap();
    let config = Config::new()
        .data_dir(&dir.join("data"))
        .pricing(1.79)
        .write(dir.join("gpuwarden.toml"));
    let (samples_file, events_file) = (dir.join("samples.jsonl"), dir.join("leases.jsonl"));
    std::fs::write(&samples_file, samples).unwrap();
    std::fs::write(&events_file, events).unwrap();
    let ingested = gpuwarden(&[
        "ingest",
        "--config",
        config.to_str().unwrap(),
        "--samples",
        samples_file.to_str().unwrap(),
        "--lease-events",
        events_file.to_str().unwrap(),
    ]);
    let started = Instant::now();
    let rolled = gpuwarden(&["rollup", "--config", config.to_str().unwrap()]);
    (config, ingested, rolled, started.elapsed())
}

fn csv(config: &Path, query: &str) -> String {
    gpuwarden(&[
        "sql",
        "--config",
        config.to_str().unwrap(),
        "--format",
        "csv",
        query,
    ])
}

/// `hours rolled up: N (M final)…; watermark: W; …`: N, M and W.
fn rollup_summary(output: &str) -> (u64, u64, String) {
    let line = output
        .lines()
        .find(|l| l.starts_with("hours rolled up:"))
        .unwrap_or_else(|| panic!("no summary in {output}"));
    let number = |after: &str| -> u64 {
        line.split(after)
            .nth(1)
            .unwrap()
            .trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let watermark = line
        .split("watermark: ")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    (number("hours rolled up:"), number("("), watermark)
}

#[test]
fn a_sample_400_days_ahead_is_quarantined_and_changes_no_rollup() {
    let dir = tempfile::tempdir().unwrap();
    // The fleet's last samples were taken just now: node-fast's are 2 minutes ahead of the
    // time they are read.
    let end = wall_ms() / 25_000 * 25_000;
    let (samples, events) = fleet(end);
    let lines = samples.lines().count();
    assert!((19_000..22_000).contains(&lines), "{lines} samples");
    let wrong = json!({"v": 1, "ts_ms": end + 400 * DAY, "interval_ms": 25_000,
        "host": "node-wrong", "gpu_uuid": "GPU-node-1-2", "gpu_model": H100,
        "util_gpu_pct": 100.0, "mem_used_bytes": 1u64 << 34, "mem_total_bytes": 85_899_345_920u64,
        "lease_id": "l-5"});
    let with_wrong = format!("{samples}{wrong}\n");

    let (clean, clean_ingest, clean_rollup, clean_took) =
        lake(&dir.path().join("clean"), &samples, &events);
    let (dirty, dirty_ingest, dirty_rollup, dirty_took) =
        lake(&dir.path().join("dirty"), &with_wrong, &events);
    eprintln!(
        "rollup of the fleet: {clean_took:?}; with the sample 400 days ahead: {dirty_took:?} \
         (ratio {:.2})\n{clean_rollup}{dirty_rollup}",
        dirty_took.as_secs_f64() / clean_took.as_secs_f64()
    );
    assert!(
        clean_ingest.contains(&format!(
            "{lines} samples records read, {lines} written, 0 quarantined"
        )),
        "{clean_ingest}"
    );
    assert!(
        dirty_ingest.contains(&format!(
            "{} samples records read, {lines} written, 1 quarantined, 1 of them dated more than \
             pipeline.clock.max_skew (5m) ahead of now",
            lines + 1
        )),
        "{dirty_ingest}"
    );

    // The same hours, the same watermark: the fleet's latest time, not node-fast's, and not
    // the wrong clock's.
    let (clean_hours, clean_final, clean_watermark) = rollup_summary(&clean_rollup);
    let (dirty_hours, dirty_final, dirty_watermark) = rollup_summary(&dirty_rollup);
    assert_eq!((dirty_hours, dirty_final), (clean_hours, clean_final));
    // 4 h 20 min of samples touch at most 6 hours, and the first samples' intervals may begin
    // in the hour before them.
    assert!(clean_hours <= 7, "{clean_rollup}");
    assert_eq!(clean_watermark, rfc3339(end).replace("Z", ".000Z"));
    assert_eq!(dirty_watermark, clean_watermark);

    // Exactly the fleet's rollups, table by table.
    for table in [
        "gpu_hourly",
        "lease_hourly",
        "team_hourly",
        "focus_costs",
        "leases",
    ] {
        // As a table (CSV cannot write `leases`' lists), its lines sorted: rows in no
        // particular order compare equal.
        let sorted = |config: &Path| {
            let text = gpuwarden(&[
                "sql",
                "--config",
                config.to_str().unwrap(),
                &format!("SELECT * FROM {table}"),
            ]);
            let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
            lines.sort();
            lines.join("\n")
        };
        let (a, b) = (sorted(&clean), sorted(&dirty));
        assert!(a.lines().count() > 5, "{table} is empty:\n{a}");
        assert_eq!(a, b, "{table} differs");
    }
    // lease_usage sums its hours in no set order: equal to the last digits that order changes.
    let usage = "SELECT lease_id, team, allocated_gpu_hours, round(observed_gpu_hours, 9), \
                 round(busy_gpu_hours, 9), round(idle_gpu_hours, 9), round(cost_usd, 9), \
                 round(energy_kwh, 9) FROM lease_usage ORDER BY lease_id";
    assert_eq!(csv(&clean, usage), csv(&dirty, usage));
    // The running lease is charged its four hours, not 9,600.
    let usage = csv(
        &clean,
        "SELECT round(allocated_gpu_hours, 2), round(cost_usd, 2) FROM lease_usage WHERE lease_id = 'l-5'",
    );
    assert_eq!(usage.lines().nth(1), Some("8.0,14.32"), "{usage}");
    // node-fast, 2 minutes ahead, was accepted whole.
    let fast = csv(
        &dirty,
        "SELECT count(*) FROM samples WHERE host = 'node-fast'",
    );
    assert_eq!(
        fast.lines().nth(1).unwrap().parse::<usize>().unwrap(),
        lines / 34 * 2
    );

    // One quarantined row, saying which field, how far, and which setting.
    let quarantine = csv(&dirty, "SELECT field, reason, \"offset\" FROM quarantine");
    let rows: Vec<&str> = quarantine.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "{quarantine}");
    // 400 days ahead of the sample's time is 399 days and some hours ahead of its reading.
    let expected = format!(
        "ts_ms,\"ts_ms: {} is 399d 23h ahead of the record's arrival at ",
        rfc3339(end + 400 * DAY)
    );
    assert!(rows[0].starts_with(&expected), "{}", rows[0]);
    assert!(
        rows[0].contains(
            "more than pipeline.clock.max_skew (5m) allows: the clock that dated it is wrong"
        ),
        "{}",
        rows[0]
    );
    assert!(
        rows[0].ends_with(&format!(",{}", lines + 1)),
        "the line number: {}",
        rows[0]
    );
}

const TOKEN: &str = "tok-clock-admin";

#[test]
fn through_kafka_a_wrong_clock_blocks_no_team_builds_no_signal_and_raises_one_alert() {
    let dir = tempfile::tempdir().unwrap();
    let webhook = Webhook::start();
    let config = Config::new()
        .kafka("embedded")
        .data_dir(&dir.path().join("data"))
        .up()
        .anonymous_sql()
        .signals("1m", "3m")
        .pricing(40.0)
        .team(Team::new("ml", 16, 1000.0).members(&["ada"]))
        .raw(&format!(
            "[enforcer]\nalert_webhooks = [\"{}\"]\n",
            webhook.url
        ))
        .substrate(Substrate::simulated("sim").hosts("h", 2, 8, H100))
        .token("admin", TOKEN, "admin", &[])
        .write(dir.path().join("gpuwarden.toml"));
    // Event time at 60× from 01:00 UTC today: the test's hours stay in one UTC day (one alert
    // a day is the rule), and a year ahead of anything is still a year ahead.
    let start = wall_ms() / DAY * DAY + HOUR;
    let mut up = Running::start(
        &[
            "up",
            "--config",
            config.to_str().unwrap(),
            "--speed",
            "60",
            "--start",
            &rfc3339(start),
        ],
        &[],
    );
    let line = up.wait_for_log("gpuwarden up", Duration::from_secs(120));
    let field = |name: &str| line[name].as_str().unwrap().to_string();
    let api = field("api").trim_start_matches("http://").to_string();
    let sql_port = support::sql_port(&line);
    let metrics = field("pipeline_metrics")
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string();
    let bootstrap = field("kafka");
    let psql = Psql::new(sql_port, "gpuwarden", None);

    // A running lease of ml, 2 H100s at 40 $/h each: 80 $ an event hour, a wall minute.
    let (status, answer) = http(
        &api,
        "POST",
        "/v1/admission",
        Some(TOKEN),
        Some(
            &json!({"team": "ml", "user": "ada", "project": "p", "workload": "training",
                "gpus": 2, "duration": "10h"})
            .to_string(),
        ),
    );
    assert_eq!(status, 200, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["decision"], "admitted", "{answer}");
    let lease = answer["lease"]["id"].as_str().unwrap().to_string();
    let gpu = eventually("the lease's GPUs", Duration::from_secs(30), || {
        let (_, body) = http(
            &api,
            "GET",
            &format!("/v1/leases/{lease}"),
            Some(TOKEN),
            None,
        );
        let lease: Value = serde_json::from_str(&body).unwrap();
        lease["gpu_uuids"][0]
            .as_str()
            .map(str::to_string)
            .ok_or(lease.to_string())
    });
    eventually("team_spend for ml", Duration::from_secs(60), || {
        let rows =
            psql.rows("SELECT count(*) FROM signals WHERE kind = 'team_spend' AND team = 'ml'");
        if rows.first().is_some_and(|n| n != "0") {
            Ok(())
        } else {
            Err(format!("{rows:?}"))
        }
    });

    // A host whose clock is 400 days ahead sends samples of the lease's GPU, at full load, for
    // about five seconds (five event minutes): five times the signals' period.
    let ahead = wall_ms() + 400 * DAY;
    let mut kcat = Command::new("kcat")
        .args([
            "-P",
            "-b",
            &bootstrap,
            "-t",
            "gpuwarden.samples",
            "-K",
            "\t",
        ])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = kcat.stdin.take().unwrap();
        for i in 0..5 {
            let sample = json!({"v": 1, "ts_ms": ahead + i * 10 * S, "interval_ms": 10_000,
                "host": "node-wrong-clock", "gpu_uuid": gpu, "gpu_model": H100,
                "util_gpu_pct": 100.0, "mem_used_bytes": 1u64 << 34,
                "mem_total_bytes": 85_899_345_920u64, "lease_id": lease});
            writeln!(stdin, "{gpu}\t{sample}").unwrap();
            stdin.flush().unwrap();
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    assert!(kcat.wait().unwrap().success());

    // Quarantined, each with its reason; counted; the host's skew on /metrics.
    let reasons = eventually("5 quarantined samples", Duration::from_secs(60), || {
        let rows = psql.rows("SELECT field || ' ' || reason FROM quarantine ORDER BY \"offset\"");
        if rows.len() >= 5 {
            Ok(rows)
        } else {
            Err(format!("{rows:?}"))
        }
    });
    assert_eq!(reasons.len(), 5, "{reasons:#?}");
    for reason in &reasons {
        assert!(reason.starts_with("ts_ms ts_ms: "), "{reason}");
        assert!(reason.contains("pipeline.clock.max_skew (5m)"), "{reason}");
    }
    // The gauges are refreshed every 5 s.
    let (text, skew) = eventually(
        "node-wrong-clock's skew on /metrics",
        Duration::from_secs(30),
        || {
            let (_, text) = http_get(&metrics, "/metrics");
            let skew: Option<f64> = text
                .lines()
                .find_map(|l| {
                    l.strip_prefix(
                        "gpuwarden_pipeline_host_clock_skew_seconds{host=\"node-wrong-clock\"} ",
                    )
                })
                .map(|v| v.parse().unwrap());
            match skew {
                Some(skew) => Ok((text, skew)),
                None => Err(text),
            }
        },
    );
    assert!(
        text.contains(
            "gpuwarden_pipeline_records_out_of_bounds_total{topic=\"gpuwarden.samples\",bound=\"ahead\"} 5"
        ),
        "{text}"
    );
    // 400 days ahead of wall time, which the event clock (from 01:00 today) trails.
    assert!(skew > 399.0 * 86_400.0, "skew {skew} s");
    let h0: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("gpuwarden_pipeline_host_clock_skew_seconds{host=\"h-0\"} "))
        .unwrap_or_else(|| panic!("no skew for h-0:\n{text}"))
        .parse()
        .unwrap();
    // Its delay in sending, in event time: 5 minutes are 5 s of wall time at 60×.
    assert!(h0.abs() < 300.0, "the simulated host's skew is {h0} s");

    // One alert at the webhook, one row in clock_skew, however many times it was reported.
    let alert = eventually("the clock_skew alert", Duration::from_secs(60), || {
        let alerts = webhook.alerts("clock_skew");
        alerts.first().cloned().ok_or(alerts.len())
    });
    // About 400 days: the event clock, from 01:00 today, may be ahead of the wall by hours.
    let text = alert["text"].as_str().unwrap();
    assert!(
        text.contains("the clock of host node-wrong-clock runs 399d ")
            || text.contains("the clock of host node-wrong-clock runs 400d "),
        "{text}"
    );
    assert!(text.contains("ahead of gpuwarden's"), "{text}");
    let rows = eventually("clock_skew reported", Duration::from_secs(30), || {
        let rows = psql.rows("SELECT host, reports, skew_s > 34000000 FROM clock_skew");
        if rows.len() == 1 {
            Ok(rows)
        } else {
            Err(format!("{rows:?}"))
        }
    });
    assert!(rows[0].starts_with("node-wrong-clock|"), "{rows:?}");
    assert!(rows[0].ends_with("|t"), "{rows:?}");

    // Several signal periods later: nothing was built from the samples, no team was blocked.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(webhook.alerts("clock_skew").len(), 1);
    let year_ahead = wall_ms() + 300 * DAY;
    assert_eq!(
        psql.one(&format!(
            "SELECT count(*) FROM signals WHERE ts_ms > {year_ahead}"
        )),
        "0"
    );
    let watermark = support::metric(&metrics, "gpuwarden_pipeline_signals_watermark_seconds")
        .expect("the signals' watermark");
    assert!(
        (watermark * 1000.0) < (wall_ms() + DAY) as f64,
        "the signals' watermark is {watermark}"
    );
    let spend = psql.one(
        "SELECT max(month_to_date_usd) < 1000 AND max(burn_usd_per_hour) <= 80 FROM signals \
         WHERE kind = 'team_spend' AND team = 'ml'",
    );
    assert_eq!(spend, "t");
    let (_, team) = http(&api, "GET", "/v1/teams/ml", Some(TOKEN), None);
    let team: Value = serde_json::from_str(&team).unwrap();
    assert_eq!(team["blocked"], false, "{team}");
    assert_eq!(
        psql.one("SELECT count(*) FROM actions WHERE action = 'block'"),
        "0"
    );
    assert_eq!(
        psql.one(&format!(
            "SELECT count(*) FROM team_hourly WHERE hour > arrow_cast({year_ahead}, 'Timestamp(ms, \"UTC\")')"
        )),
        "0"
    );
    let (status, log) = up.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}
