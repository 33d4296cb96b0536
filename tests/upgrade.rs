//! Upgrades: what the previous release wrote, opened by today's gpuwarden, and what a newer
//! release writes, refused by it (docs/src/contributors/upgrades.md).
//!
//! `tests/fixtures/upgrade/0.1.0/` holds a lake, a lease store and a config written by gpuwarden
//! 0.1.0 (its README says how, and the figures it answered). Each test copies one to a temp dir
//! and opens it with this build: the store opens and keeps every lease, an enforcer starts on it,
//! the rollups run on the lake and every row counts as it did, rows ingested since count on top
//! of them, and the config checks. Then each fixture is edited to claim a version after this
//! build's, and this build refuses it naming both versions and the gpuwarden that wrote it.
//! The lake of the layout before Delta tables is tests/lake_migrate.rs's.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuwarden_enforcer::store::{LeaseFilter, LeaseState, Store, StoreError};
use support::rollups::{gpuwarden, gpuwarden_with, ok, MINUTE, T0};
use support::Running;

/// This build's version, as every refusal names it.
const THIS: &str = env!("CARGO_PKG_VERSION");

/// The leases in the fixture store: id, GPUs, state.
const LEASES: [(&str, u32, LeaseState); 3] = [
    (
        "01a24ec3-57a8-75b6-ae11-a95d3127cba5",
        1,
        LeaseState::Released,
    ),
    (
        "01a24ec3-57dd-7397-8ae3-d56d7fe4e2e1",
        2,
        LeaseState::Active,
    ),
    (
        "01a24ec3-57fb-753c-a82f-de96f46d6064",
        3,
        LeaseState::Active,
    ),
];

fn fixture(part: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/upgrade/0.1.0")
        .join(part)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn failed(out: std::process::Output) -> String {
    assert!(
        !out.status.success(),
        "succeeded:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_previous_release_s_lease_store_opens_with_every_lease() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("enforcer.db");
    std::fs::copy(fixture("store/enforcer.db"), &db).unwrap();

    let store = Store::open(&db).unwrap();
    assert_eq!(store.schema_version().wait().unwrap(), 7);
    let mut leases: Vec<(String, u32, LeaseState)> = store
        .leases(&LeaseFilter::default())
        .wait()
        .unwrap()
        .into_iter()
        .map(|l| (l.id, l.gpu_count, l.state))
        .collect();
    leases.sort_by(|a, b| a.0.cmp(&b.0));
    let want: Vec<(String, u32, LeaseState)> = LEASES
        .iter()
        .map(|(id, gpus, state)| (id.to_string(), *gpus, *state))
        .collect();
    assert_eq!(leases, want);
    assert_eq!(store.open_leases().unwrap().len(), 2);
    drop(store);

    // A store of a newer schema: refused, naming both versions and this build.
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute("UPDATE schema_version SET version = 99", [])
        .unwrap();
    let err = Store::open(&db).map(|_| ()).unwrap_err();
    assert!(matches!(err, StoreError::TooNew { found: 99, .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "the lease store is at schema version 99; this gpuwarden ({THIS}) knows up to 7: \
             upgrade gpuwarden"
        )
    );
}

/// The enforcer itself on the previous release's data dir (store and simulated substrate) and
/// config: it starts and lists the fixture's leases.
#[test]
fn an_enforcer_starts_on_the_previous_release_s_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    copy_dir(&fixture("store/drivers"), &data.join("drivers"));
    std::fs::copy(fixture("store/enforcer.db"), data.join("enforcer.db")).unwrap();
    let config = dir.path().join("enforce.toml");
    let text = std::fs::read_to_string(fixture("store/enforce.toml"))
        .unwrap()
        .replace("STORE_DIR", data.to_str().unwrap())
        .replace("127.0.0.1:18645", "127.0.0.1:0");
    std::fs::write(&config, text).unwrap();

    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_string();
    let out = ok(gpuwarden_with(
        &["leases", "--format", "json"],
        &[
            ("GPUWARDEN_API", api),
            ("GPUWARDEN_TOKEN", "upgrade-fixture-token".into()),
            ("GPUWARDEN_USER", "ada".into()),
        ],
    ));
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut ids: Vec<&str> = listed
        .as_array()
        .or_else(|| listed["leases"].as_array())
        .expect("a list of leases")
        .iter()
        .map(|l| l["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, LEASES.map(|(id, _, _)| id));
    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}:\n{}", log.join("\n"));

    // A simulated substrate's state of a newer format: the enforcer does not start.
    let snapshot = data.join("drivers/sim/leases.json");
    std::fs::write(
        &snapshot,
        r#"{"version": 2, "written_by": "0.3.0", "leases": {}}"#,
    )
    .unwrap();
    let err = failed(gpuwarden(&[
        "enforce",
        "--config",
        config.to_str().unwrap(),
    ]));
    let want = format!(
        "the simulated leases {} has state version 2, written by gpuwarden 0.3.0; this \
         gpuwarden ({THIS}) reads up to state version 1: upgrade gpuwarden",
        snapshot.display()
    );
    assert!(err.contains(&want), "{err}");
}

/// The lake's figures, as gpuwarden 0.1.0 answered them on the fixture (README.md).
fn figures(config: &str) -> Vec<String> {
    let query = |sql: &str| {
        let out = ok(gpuwarden(&[
            "sql", "--config", config, "--format", "csv", sql,
        ]));
        out.lines().skip(1).map(str::to_owned).collect::<Vec<_>>()
    };
    let mut all = query(
        "SELECT (SELECT count(*) FROM samples) AS s, (SELECT count(*) FROM lease_events) AS e, \
         (SELECT count(*) FROM gpu_hourly) AS g, (SELECT count(*) FROM lease_hourly) AS l, \
         (SELECT count(*) FROM team_hourly) AS t, (SELECT count(*) FROM focus_costs) AS f, \
         (SELECT count(*) FROM leases) AS n, \
         (SELECT round(sum(observed_gpu_hours), 6) FROM gpu_hourly) AS o",
    );
    all.extend(query(
        "SELECT team, round(sum(cost_usd), 4) FROM team_hourly GROUP BY team ORDER BY team",
    ));
    all
}

/// The answer of `sql` on the lake of `config`, its rows as CSV lines (no header).
fn answer(config: &str, sql: &str) -> Vec<String> {
    let out = ok(gpuwarden(&[
        "sql", "--config", config, "--format", "csv", sql,
    ]));
    out.lines().skip(1).map(str::to_owned).collect()
}

/// Rows of `gpu_hourly` with and without the columns it gained after 0.1.0, by hour (from T0),
/// and the sums of two of them: what the previous release's rows and this build's say.
fn gained(config: &str) -> Vec<String> {
    answer(
        config,
        &format!(
            "SELECT (CAST(hour AS BIGINT) - {T0}) / 3600000 AS h, count(*) AS n, \
             count(idle_measure) AS judged, max(idle_measure) AS measure, \
             round(sum(sm_active_gpu_hours), 6) AS sm, \
             round(sum(gpm_observed_gpu_hours), 6) AS gpm \
             FROM gpu_hourly GROUP BY 1 ORDER BY 1"
        ),
    )
}

/// A copy of the 0.1.0 lake in `dir`, and a config naming it: the lake's path and the config's.
fn fixture_lake_in(dir: &Path) -> (PathBuf, PathBuf) {
    let (config, lake) = support::rollups::dir_config(dir);
    copy_dir(&fixture("lake"), &lake);
    (lake, config)
}

#[test]
fn the_previous_release_s_lake_rolls_up_with_every_row_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (lake, config) = fixture_lake_in(dir.path());
    let config = config.to_str().unwrap();
    assert!(!lake.join("_gpuwarden.json").exists(), "0.1.0 wrote none");

    // Read as it is, then rolled up again: the same figures.
    let before = [
        "1200,4,32,12,10,12,3,20.0",
        "(unallocated),21.8",
        "ml,14.8667",
        "vision,3.3333",
    ];
    assert_eq!(figures(config), before);
    // The columns samples and rollups gained since read as nulls in 0.1.0's files, before
    // anything of this build writes to its tables.
    assert_eq!(
        answer(
            config,
            "SELECT count(*), count(sm_active_pct), count(mig_profile) FROM samples"
        ),
        ["1200,0,0"]
    );
    assert_eq!(
        gained(config),
        ["-1,8,0,,,", "0,8,0,,,", "1,8,0,,,", "2,8,0,,,"],
        "0.1.0's rows of gpu_hourly, per hour"
    );
    ok(gpuwarden(&["rollup", "--config", config]));
    assert_eq!(figures(config), before);
    // The open hour (2) was computed again, by this build: its rows have the new columns; the
    // final hours keep 0.1.0's rows, with nulls there.
    assert_eq!(
        gained(config),
        ["-1,8,0,,,", "0,8,0,,,", "1,8,0,,,", "2,8,8,util,0.0,0.0"]
    );
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(lake.join("_gpuwarden.json")).unwrap()).unwrap();
    assert_eq!(marker, serde_json::json!({"layout": 2, "written_by": THIS}));
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(lake.join("rollups/_state.json")).unwrap()).unwrap();
    assert_eq!(state["version"], 1);
    assert_eq!(state["written_by"], THIS);

    // Half an hour more of the same 8 GPUs, ingested and rolled up by this build: every hour
    // the old state held stays, and the new rows count on top (8 × 30 samples, 4 GPU-hours;
    // an unleased GPU-hour costs the default $2).
    let samples = dir.path().join("more.jsonl");
    let lines: Vec<String> = (150..180)
        .flat_map(|m| {
            (0..8).map(move |g| {
                serde_json::json!({
                    "v": 1, "ts_ms": T0 + m * MINUTE, "interval_ms": 60_000,
                    "host": format!("node-{}", g / 4), "gpu_uuid": format!("GPU-{g:04}"),
                    "gpu_model": "NVIDIA A100-SXM4-80GB", "util_gpu_pct": (g * 13 % 100) as f64,
                    "mem_used_bytes": 1u64 << 30, "mem_total_bytes": 85899345920u64,
                    "sm_active_pct": 40.0
                })
                .to_string()
            })
        })
        .collect();
    std::fs::write(&samples, lines.join("\n")).unwrap();
    ok(gpuwarden(&[
        "ingest",
        "--config",
        config,
        "--samples",
        samples.to_str().unwrap(),
    ]));
    ok(gpuwarden(&["rollup", "--config", config]));
    let after = figures(config);
    assert_eq!(after[0], "1440,4,32,12,10,12,3,24.0", "{after:?}");
    // The samples table took the new columns (one ADD COLUMN commit) and kept 0.1.0's files:
    // both read, the old rows with nulls.
    assert_eq!(
        answer(
            config,
            "SELECT count(*), count(sm_active_pct), min(sm_active_pct) FROM samples"
        ),
        ["1440,240,40.0"]
    );
    let log: String = std::fs::read_dir(lake.join("samples/_delta_log"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    assert_eq!(log.matches("\"ADD COLUMN\"").count(), 1, "{log}");
    for old in std::fs::read_dir(fixture("lake/samples"))
        .unwrap()
        .flatten()
    {
        assert!(lake.join("samples").join(old.file_name()).exists());
    }
    // 8 GPUs × 30 minutes at 40 % SM activity in hour 2: 1.6 SM-active of 4 GPU-hours GPM saw.
    assert_eq!(
        gained(config),
        ["-1,8,0,,,", "0,8,0,,,", "1,8,0,,,", "2,8,8,util,1.6,4.0"]
    );
    let cost: f64 = after[1..]
        .iter()
        .map(|l| l.rsplit(',').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!((cost - 48.0).abs() < 1e-3, "{after:?}");
}

#[test]
fn a_lake_or_rollup_state_of_a_newer_release_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (lake, config) = fixture_lake_in(dir.path());
    let config = config.to_str().unwrap();

    // The rollups' state of a newer format: the rollups stop and say why; nothing is written.
    let state_path = lake.join("rollups/_state.json");
    let old_state = std::fs::read(&state_path).unwrap();
    std::fs::write(
        &state_path,
        r#"{"version": 2, "written_by": "0.3.0", "hours": "in a shape 0.1 cannot read"}"#,
    )
    .unwrap();
    let err = failed(gpuwarden(&["rollup", "--config", config]));
    let want = format!(
        "rollups/_state.json in {} has state version 2, written by gpuwarden 0.3.0; this \
         gpuwarden ({THIS}) reads up to state version 1: upgrade gpuwarden",
        lake.display()
    );
    assert!(err.contains(&want), "{err}");
    std::fs::write(&state_path, &old_state).unwrap();

    // A lake of a newer layout: every command that opens it refuses, readers too.
    std::fs::write(
        lake.join("_gpuwarden.json"),
        r#"{"layout": 3, "written_by": "0.3.0"}"#,
    )
    .unwrap();
    let want = format!(
        "the lake at {} has layout version 3, written by gpuwarden 0.3.0; this gpuwarden \
         ({THIS}) reads up to layout version 2: upgrade gpuwarden",
        lake.display()
    );
    for args in [
        vec!["rollup", "--config", config],
        vec!["sql", "--config", config, "SELECT count(*) FROM samples"],
    ] {
        let err = failed(gpuwarden(&args));
        assert!(err.contains(&want), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read(&state_path).unwrap(), old_state);
}

#[test]
fn the_previous_release_s_config_checks_and_a_newer_one_is_refused() {
    let env = [
        ("GPUWARDEN_SQL_PASSWORD", "secret".to_string()),
        (
            "GPUWARDEN_SIGNING_KEY",
            "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0".to_string(),
        ),
    ];
    let old = fixture("gpuwarden.toml");
    ok(gpuwarden_with(
        &["check-config", old.to_str().unwrap()],
        &env,
    ));

    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(&old).unwrap();
    for (version, good) in [(1, true), (2, false)] {
        let path = dir.path().join(format!("v{version}.toml"));
        std::fs::write(&path, format!("version = {version}\n{text}")).unwrap();
        let out = gpuwarden_with(&["check-config", path.to_str().unwrap()], &env);
        if good {
            ok(out);
            continue;
        }
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let all = format!("{stdout}{}", failed(out));
        let want = format!(
            "{}:1:11: error: version: the config {} has config version 2; this gpuwarden \
             ({THIS}) reads up to config version 1: upgrade gpuwarden",
            path.display(),
            path.display()
        );
        assert!(all.contains(&want), "{all}");
        assert!(all.contains("1 error in the configuration"), "{all}");
    }
}
