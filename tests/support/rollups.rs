//! A small fleet's samples and leases loaded into a lake with `gpuwarden ingest` and rolled up
//! with `gpuwarden rollup`, for the tests of what the rollup tables hold and who reads them.

use std::path::Path;
use std::process::Command;

// The lake suites (lake_migrate, lake_readers, lake_s3) take it from here.
pub use super::process::ok;

/// 2026-01-01T00:00:00Z.
pub const T0: i64 = 1_767_225_600_000;
pub const MINUTE: i64 = 60_000;

fn sample(gpu: usize, ts_ms: i64) -> String {
    serde_json::json!({
        "v": 1, "ts_ms": ts_ms, "interval_ms": 60_000, "host": format!("node-{}", gpu / 4),
        "gpu_uuid": format!("GPU-{gpu:04}"), "gpu_model": "NVIDIA A100-SXM4-80GB",
        "util_gpu_pct": (gpu * 13 % 100) as f64, "mem_used_bytes": 1u64 << 30,
        "mem_total_bytes": 85899345920u64
    })
    .to_string()
}

fn lease_event(ts_ms: i64, event: &str, lease: &str, team: &str, gpus: &[usize]) -> String {
    let uuids: Vec<String> = gpus.iter().map(|g| format!("GPU-{g:04}")).collect();
    let mut e = serde_json::json!({"v": 1, "ts_ms": ts_ms, "event": event, "lease_id": lease,
        "team": team, "user": "u", "project": "p", "workload": "training", "substrate": "sim",
        "gpu_model": "NVIDIA A100-SXM4-80GB", "gpu_count": gpus.len(), "gpu_uuids": uuids});
    if event == "released" {
        e["reason"] = serde_json::json!("user");
    }
    e.to_string()
}

/// Ingests `minutes` of samples of `gpus` from `from`, and three leases of two teams, and rolls
/// up.
pub fn load(
    config: &str,
    dir: &Path,
    name: &str,
    gpus: std::ops::Range<usize>,
    from: i64,
    minutes: i64,
) {
    let samples = dir.join(format!("{name}-samples.jsonl"));
    let lines: Vec<String> = (0..minutes)
        .flat_map(|m| gpus.clone().map(move |g| sample(g, from + m * MINUTE)))
        .collect();
    std::fs::write(&samples, lines.join("\n")).unwrap();
    let events = dir.join(format!("{name}-leases.jsonl"));
    std::fs::write(
        &events,
        [
            lease_event(T0 + 5 * MINUTE, "granted", "lease-a", "ml", &[0, 1]),
            lease_event(T0 + 30 * MINUTE, "granted", "lease-b", "vision", &[4]),
            lease_event(T0 + 130 * MINUTE, "released", "lease-b", "vision", &[4]),
            lease_event(T0 + 70 * MINUTE, "granted", "lease-c", "ml", &[6, 7]),
        ]
        .join("\n"),
    )
    .unwrap();
    ok(gpuwarden(&[
        "ingest",
        "--config",
        config,
        "--samples",
        samples.to_str().unwrap(),
        "--lease-events",
        events.to_str().unwrap(),
    ]));
    ok(gpuwarden(&["rollup", "--config", config]));
}

/// `gpuwarden` with `args`, without the AWS environment of the test's own process.
pub fn gpuwarden(args: &[&str]) -> std::process::Output {
    gpuwarden_with(args, &[])
}

/// [`gpuwarden`] with `env` set.
pub fn gpuwarden_with(args: &[&str], env: &[(&'static str, String)]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpuwarden"));
    command.args(args);
    for (name, _) in std::env::vars() {
        if name.starts_with("AWS_") {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().map(|(k, v)| (k, v)));
    command.output().unwrap()
}

/// A config whose lake is the directory `<dir>/lake`: its path, and the lake's.
pub fn dir_config(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let lake = dir.join("lake");
    let config = dir.join("c.toml");
    std::fs::write(
        &config,
        format!(
            "[storage]\ndata_dir = \"{}\"\nlake = \"{}\"\n",
            dir.join("data").display(),
            lake.display()
        ),
    )
    .unwrap();
    (config, lake)
}

/// `gpuwarden sql`'s answer as `key,value` lines, the form the readers print.
pub fn sql(config: &str, extra: &[&str], query: &str) -> Vec<String> {
    let mut args = vec!["sql", "--config", config, "--format", "csv"];
    args.extend_from_slice(extra);
    args.push(query);
    ok(gpuwarden(&args))
        .lines()
        .skip(1)
        .map(str::to_owned)
        .collect()
}

/// The three answers: cost per team from `team_hourly`; cost and leases per team from the
/// leases and their hours (`lease_usage`); billed cost per sub-account from `focus_costs`.
pub fn gpuwarden_answers(config: &str, extra: &[&str]) -> [Vec<String>; 3] {
    [
        sql(
            config,
            extra,
            "SELECT team, round(sum(cost_usd), 2) FROM team_hourly GROUP BY team ORDER BY team",
        ),
        sql(
            config,
            extra,
            "SELECT team, concat(CAST(round(sum(cost_usd), 2) AS VARCHAR), ',', \
             CAST(count(*) AS VARCHAR)) FROM lease_usage GROUP BY team ORDER BY team",
        ),
        sql(
            config,
            extra,
            r#"SELECT "SubAccountName", round(CAST(sum("BilledCost") AS DOUBLE), 2) FROM focus_costs
               GROUP BY "SubAccountName" ORDER BY "SubAccountName""#,
        ),
    ]
}

/// gpuwarden's CSV with its quoting removed, and numbers as Python prints them.
pub fn unquoted(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .map(|l| {
            l.replace('"', "")
                .split(',')
                .map(|v| match v.parse::<f64>() {
                    Ok(x) if v.contains('.') || v.contains('e') => format!("{x:?}"),
                    _ => v.to_string(),
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect()
}
