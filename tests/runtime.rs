//! Runtime enforcement end to end, in one `gpuwarden up` process per test: the embedded broker,
//! a simulated fleet that follows the leases, the pipeline computing signals over its hot
//! window, and the enforcer acting on them, all on one accelerated clock from 03:30 UTC. The
//! tests ask for leases over HTTP as a front-end would and find every step with psql in
//! `actions`.
//!
//! Policies: notebooks are reclaimed after 4 min idle (warned 1 min before), idle judged by SM
//! activity (the simulated H100s report GPM); training after 4 min idle, judged by utilization
//! (`pricing.idle_measure`'s default); inference autoscales between 1 and 4 GPUs toward 60 %;
//! the collector samples every 10 s; every GPU costs 40 $/h; team ops may spend 30 $ a month.
//!
//! Event-time reaction is wall-time latency times the speed, so the tests that time reactions
//! run at 60× (signals every minute over 3 min); the autoscale test, which needs hours of the
//! inference load's daily curve, runs at 600× (signals every 5 min over 15 min).

mod support;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{eventually, http, Config, Psql, Running, Substrate, Team, Workload, H100};

const TOKEN: &str = "tok-runtime-admin";
/// 2026-01-10T03:30:00Z: the inference load's trough is at 03:00 and it rises from there.
const START: &str = "2026-01-10T03:30:00Z";
const MIN: i64 = 60_000;
const IDLE_TIMEOUT: i64 = 4 * MIN;
const SAMPLE_EVERY: i64 = 10_000;

/// How fast and how often: the clock's speed, and the signals' period and window.
#[derive(Clone, Copy)]
struct Pace {
    speed: f64,
    every_min: i64,
    window_min: i64,
}

/// For timing reactions: a minute of event time is a second of wall time.
const REACT: Pace = Pace {
    speed: 60.0,
    every_min: 1,
    window_min: 3,
};
/// For hours of inference load.
const HOURS: Pace = Pace {
    speed: 600.0,
    every_min: 5,
    window_min: 15,
};

/// One `up` at a time: each wants both cores to keep up with its clock.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn write_config(dir: &Path, mode: &str, pace: Pace) -> PathBuf {
    Config::new()
        .kafka("embedded")
        .data_dir(&dir.join("data"))
        .up()
        .anonymous_sql()
        .signals(
            &format!("{}m", pace.every_min),
            &format!("{}m", pace.window_min),
        )
        .pricing(40.0)
        .team(Team::new("ml", 16, 1000000.0).members(&["ada"]))
        .team(Team::new("ops", 16, 30.0).members(&["bob"]))
        .workload(
            Workload::new("notebook")
                .max_gpus(2)
                .on_idle("reclaim", "4m")
                .raw("warn_before = \"1m\"\nidle_measure = \"sm_active\""),
        )
        .workload(
            Workload::new("training")
                .max_gpus(8)
                .on_idle("reclaim", "4m"),
        )
        .workload(
            Workload::new("inference")
                .max_gpus(4)
                .raw("min_gpus = 1\ntarget_util_pct = 60.0"),
        )
        // Offered, with no rule of its own: its lease only expires (a config that defines some
        // [workloads.*] offers only those).
        .workload(Workload::new("batch"))
        .raw(&format!("[enforcer]\nmode = \"{mode}\"\n"))
        .substrate(Substrate::simulated("sim").hosts("h", 2, 8, H100))
        .token("admin", TOKEN, "admin", &[])
        .write(dir.join("gpuwarden.toml"))
}

struct Up {
    process: Running,
    pace: Pace,
    api: String,
    sql_port: u16,
}

fn up(dir: &Path, mode: &str, pace: Pace) -> Up {
    let config = write_config(dir, mode, pace);
    let speed = pace.speed.to_string();
    let mut process = Running::start(
        &[
            "up",
            "--config",
            config.to_str().unwrap(),
            "--speed",
            &speed,
            "--start",
            START,
        ],
        &[],
    );
    let line = process.wait_for_log("gpuwarden up", Duration::from_secs(120));
    let api = line["api"]
        .as_str()
        .unwrap()
        .trim_start_matches("http://")
        .to_string();
    let sql_port = support::sql_port(&line);
    Up {
        process,
        pace,
        api,
        sql_port,
    }
}

impl Up {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string());
        let (status, answer) = http(&self.api, method, path, Some(TOKEN), body.as_deref());
        assert_eq!(status, 200, "{method} {path}: {answer}");
        serde_json::from_str(&answer).unwrap()
    }

    /// Asks for a lease; the decision.
    fn request(
        &self,
        team: &str,
        user: &str,
        workload: &str,
        gpus: u32,
        duration: &str,
        profile: Option<&str>,
    ) -> Value {
        let mut body = json!({"team": team, "user": user, "project": "e2e", "workload": workload,
            "gpus": gpus, "duration": duration});
        if let Some(profile) = profile {
            body["labels"] = json!({"sim_profile": profile});
        }
        self.call("POST", "/v1/admission", Some(body))
    }

    fn admit(
        &self,
        team: &str,
        user: &str,
        workload: &str,
        gpus: u32,
        duration: &str,
        profile: Option<&str>,
    ) -> Value {
        let answer = self.request(team, user, workload, gpus, duration, profile);
        assert_eq!(answer["decision"], "admitted", "{answer}");
        answer["lease"].clone()
    }

    fn lease(&self, id: &str) -> Value {
        self.call("GET", &format!("/v1/leases/{id}"), None)
    }

    /// The lease `id` once `done` holds for it (up to `wall`), and the wall time it first did.
    fn lease_when(
        &self,
        what: &str,
        wall: Duration,
        id: &str,
        done: impl Fn(&Value) -> bool,
    ) -> (Value, Instant) {
        eventually(what, wall, || {
            let lease = self.lease(id);
            if done(&lease) {
                Ok((lease, Instant::now()))
            } else {
                Err(lease)
            }
        })
    }

    /// Rows of `sql` against the SQL endpoint, as `a|b` lines.
    fn sql(&self, sql: &str) -> Vec<String> {
        Psql::new(self.sql_port, "gpuwarden", None).rows(sql)
    }

    /// Polls `actions` in the lake until `sql` returns `want` rows or more.
    fn sql_rows(&self, sql: &str, want: usize) -> Vec<String> {
        eventually(
            &format!("{want} rows of {sql}"),
            Duration::from_secs(60),
            || {
                let rows = self.sql(sql);
                if rows.len() >= want {
                    Ok(rows)
                } else {
                    Err(format!("{rows:?}"))
                }
            },
        )
    }
}

/// The lease's actions in the lake, in time order, as `action|reason|outcome`.
fn actions_sql(lease: &str) -> String {
    format!(
        "SELECT action, reason, outcome FROM actions WHERE lease_id = '{lease}' ORDER BY ts_ms, action"
    )
}

fn id(lease: &Value) -> String {
    lease["id"].as_str().unwrap().to_string()
}

#[test]
fn an_idle_notebook_is_reclaimed_an_expired_lease_ends_and_a_team_over_budget_is_blocked() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let up = up(dir.path(), "enforce", REACT);
    let speed = up.pace.speed;

    let notebook = id(&up.admit("ml", "ada", "notebook", 1, "8h", Some("idle")));
    let admitted_wall = Instant::now();
    let training = id(&up.admit("ml", "ada", "training", 2, "8h", None));
    let batch = id(&up.admit("ml", "ada", "batch", 1, "10m", None));
    // 280 $/h against 30 $: over budget within minutes.
    up.admit("ops", "bob", "training", 4, "10m", None);
    up.admit("ops", "bob", "training", 3, "10m", None);

    // The idle notebook: warned, then reclaimed within idle_timeout plus one signal period.
    let (lease, reclaimed_wall) = up.lease_when(
        "the idle notebook is reclaimed",
        Duration::from_secs(60),
        &notebook,
        |lease| lease["state"] == "released",
    );
    assert_eq!(lease["release_reason"], "idle", "{lease}");
    let granted = lease["granted_at"].as_i64().unwrap();
    let released = lease["released_at"].as_i64().unwrap();
    let late_event = released - (granted + IDLE_TIMEOUT);
    let deadline_wall =
        admitted_wall + Duration::from_secs_f64(IDLE_TIMEOUT as f64 / 1000.0 / speed);
    let late_wall = reclaimed_wall.saturating_duration_since(deadline_wall);
    assert!(late_event >= 0, "reclaimed before its deadline: {lease}");
    // The signal that triggered it: the first idle sample ends one interval after the grant, and
    // a boundary's signal is computed once a sample past it arrives, so the reclaim comes from
    // the signal at most one period and two sample intervals past the deadline.
    let detail = up.sql_rows(
        &format!("SELECT detail FROM actions WHERE lease_id = '{notebook}' AND action = 'reclaim'"),
        1,
    );
    let idle_for = detail[0]
        .rsplit_once("idle for ")
        .expect("the reclaim says how long")
        .1;
    let idle_for = humantime::parse_duration(idle_for).unwrap().as_millis() as i64;
    let every = up.pace.every_min * MIN;
    eprintln!(
        "idle reclaim: triggered by the signal {:.2} min of event time past the idle deadline; \
         released {:.2} min of event time and {} ms of wall time after it (at {speed}x, where \
         each ms of processing is {speed} ms of event time)",
        (idle_for - IDLE_TIMEOUT) as f64 / MIN as f64,
        late_event as f64 / MIN as f64,
        late_wall.as_millis()
    );
    assert!(
        (IDLE_TIMEOUT..=IDLE_TIMEOUT + every + 2 * SAMPLE_EVERY).contains(&idle_for),
        "reclaimed by a signal of {idle_for} ms idle (timeout {IDLE_TIMEOUT}, signals every {every}): {detail:?}"
    );
    assert_eq!(
        up.sql_rows(&actions_sql(&notebook), 3),
        [
            "admit|admitted|ok",
            "alert|idle_warning|ok",
            "reclaim|idle|ok"
        ]
    );

    // ops is blocked, and its next request is denied saying why.
    eventually("ops is blocked", Duration::from_secs(60), || {
        let team = up.call("GET", "/v1/teams/ops", None);
        if team["blocked"] == true {
            Ok(())
        } else {
            Err(team)
        }
    });
    let denied = up.request("ops", "bob", "training", 1, "10m", None);
    assert_eq!(denied["decision"], "denied", "{denied}");
    let codes: Vec<&str> = denied["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["code"].as_str().unwrap())
        .collect();
    assert!(codes.contains(&"team_blocked"), "{denied}");
    assert!(codes.contains(&"budget_exceeded"), "{denied}");
    let rows = up.sql_rows(
        "SELECT action, reason, outcome FROM actions WHERE team = 'ops' AND action IN ('block', 'unblock', 'deny') ORDER BY ts_ms",
        2,
    );
    // One decision, one block: a spend signal computed from lagging rollups does not unblock
    // ops for the next one to block it again.
    assert_eq!(rows[0], "block|budget_exceeded|ok", "{rows:?}");
    assert!(rows[1].starts_with("deny|"), "{rows:?}");

    // The 10-minute batch lease ends at its end.
    let (lease, _) = up.lease_when(
        "the batch lease expires",
        Duration::from_secs(60),
        &batch,
        |lease| lease["state"] == "released",
    );
    assert_eq!(lease["release_reason"], "expired", "{lease}");
    assert!(lease["released_at"].as_i64().unwrap() >= lease["expires_at"].as_i64().unwrap());
    assert_eq!(
        up.sql_rows(&actions_sql(&batch), 2),
        ["admit|admitted|ok", "reclaim|expired|ok"]
    );

    // The busy training lease was left alone.
    let lease = up.lease(&training);
    assert_eq!(lease["state"], "active", "{lease}");
    assert_eq!(lease["gpu_count"], 2);
    assert_eq!(up.sql(&actions_sql(&training)), ["admit|admitted|ok"]);
    let (status, log) = up.process.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}

#[test]
fn an_inference_lease_scales_down_when_its_load_drops_and_up_when_it_rises() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let up = up(dir.path(), "enforce", HOURS);
    // 4 GPUs for the night's low load shrink; as the morning load rises, the lease grows.
    let inference = id(&up.admit("ml", "ada", "inference", 4, "8h", None));
    let resizes = || -> Vec<(u32, u32)> {
        up.sql(&format!(
            "SELECT detail FROM actions WHERE lease_id = '{inference}' AND action = 'resize' \
             AND reason = 'autoscale' AND outcome = 'ok' ORDER BY ts_ms"
        ))
        .into_iter()
        .map(|detail| {
            // "4 → 1 GPUs of NVIDIA H100 80GB HBM3: utilization 13 % on 4 GPU(s), target 60 %"
            let (sizes, _) = detail.split_once(" GPUs of").unwrap();
            let (from, to) = sizes.split_once(" → ").unwrap();
            (from.trim().parse().unwrap(), to.trim().parse().unwrap())
        })
        .collect()
    };
    eventually(
        "inference scales down, then up",
        Duration::from_secs(90),
        || {
            let moves = resizes();
            let down_then_up = moves
                .iter()
                .position(|(from, to)| to < from)
                .is_some_and(|down| moves[down..].iter().any(|(from, to)| to > from));
            if down_then_up {
                Ok(())
            } else {
                Err(format!("{moves:?}"))
            }
        },
    );
    eprintln!("inference autoscale (from, to): {:?}", resizes());
    let (status, log) = up.process.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}

#[test]
fn dry_run_records_every_step_and_changes_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let up = up(dir.path(), "dry_run", REACT);
    let notebook = id(&up.admit("ml", "ada", "notebook", 1, "10m", Some("idle")));
    up.admit("ops", "bob", "training", 4, "10m", None);
    up.admit("ops", "bob", "training", 3, "10m", None);

    let rows = up.sql_rows(&actions_sql(&notebook), 4);
    assert_eq!(
        rows,
        [
            "admit|admitted|ok",
            "alert|idle_warning|dry_run",
            "reclaim|idle|dry_run",
            "reclaim|expired|dry_run"
        ]
    );
    let lease = up.lease(&notebook);
    assert_eq!(
        lease["state"], "active",
        "a dry run changes nothing: {lease}"
    );
    let rows = up.sql_rows(
        "SELECT action, reason, outcome FROM actions WHERE team = 'ops' AND action = 'block'",
        1,
    );
    assert_eq!(rows, ["block|budget_exceeded|dry_run"]);
    assert_eq!(up.call("GET", "/v1/teams/ops", None)["blocked"], false);
    let (status, log) = up.process.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}

/// A spinning GPU (`sim_profile = "spinning"`: utilization 100 %, SM activity 2 %) on an H100,
/// for a notebook, judged idle by SM activity, and for a training lease, judged by utilization;
/// both are reclaimed after 4 min idle. The notebook is warned and reclaimed as an idle one is;
/// the training lease reads busy to the last signal past the notebook's reclaim, and is left
/// alone. The signals in the lake say which measure judged each.
#[test]
fn a_spinning_gpu_is_reclaimed_when_sm_activity_judges_it_and_not_when_utilization_does() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let up = up(dir.path(), "enforce", REACT);
    let every = up.pace.every_min * MIN;

    let notebook = id(&up.admit("ml", "ada", "notebook", 1, "8h", Some("spinning")));
    let training = id(&up.admit("ml", "ada", "training", 1, "8h", Some("spinning")));

    let (lease, _) = up.lease_when(
        "the spinning notebook is reclaimed",
        Duration::from_secs(60),
        &notebook,
        |lease| lease["state"] == "released",
    );
    assert_eq!(lease["release_reason"], "idle", "{lease}");
    let released = lease["released_at"].as_i64().unwrap();
    assert_eq!(
        up.sql_rows(&actions_sql(&notebook), 3),
        [
            "admit|admitted|ok",
            "alert|idle_warning|ok",
            "reclaim|idle|ok"
        ]
    );
    let detail = up.sql_rows(
        &format!("SELECT detail FROM actions WHERE lease_id = '{notebook}' AND action = 'reclaim'"),
        1,
    );
    let idle_for = detail[0]
        .rsplit_once("idle for ")
        .expect("the reclaim says how long")
        .1;
    let idle_for = humantime::parse_duration(idle_for).unwrap().as_millis() as i64;
    assert!(
        (IDLE_TIMEOUT..=IDLE_TIMEOUT + every + 2 * SAMPLE_EVERY).contains(&idle_for),
        "reclaimed by a signal of {idle_for} ms idle: {detail:?}"
    );

    // What the signals said, as `idle_measure|busy by utilization|busy by SM activity|idle`.
    let judged = |lease: &str, since: i64| {
        format!(
            "SELECT idle_measure, \
                    CASE WHEN util_pct >= 95 THEN 'util busy' ELSE 'util idle' END, \
                    CASE WHEN sm_active_pct < 5 THEN 'sm idle' ELSE 'sm busy' END, \
                    CASE WHEN idle_ms > 0 THEN 'idle' ELSE 'busy' END \
             FROM signals WHERE kind = 'lease_utilization' AND lease_id = '{lease}' \
             AND ts_ms >= {since} ORDER BY ts_ms"
        )
    };
    let sql_ready = |sql: &str, want: usize| {
        eventually(
            &format!("{want} rows of {sql}"),
            Duration::from_secs(60),
            || {
                let out = Psql::new(up.sql_port, "gpuwarden", None).run(sql);
                let rows: Vec<String> = String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .map(str::to_string)
                    .collect();
                if out.status.success() && rows.len() >= want {
                    Ok(rows)
                } else {
                    Err(format!("{rows:?} {}", String::from_utf8_lossy(&out.stderr)))
                }
            },
        )
    };
    // The notebook's signal that triggered the reclaim: busy by utilization, idle by SM
    // activity, which judged it.
    let rows = sql_ready(&judged(&notebook, 0), 1);
    assert!(
        rows.iter().any(|r| r == "sm_active|util busy|sm idle|idle"),
        "{rows:?}"
    );
    // The training lease spun just as long, and a period longer: every signal of it says busy,
    // judged by utilization.
    let rows = sql_ready(&judged(&training, released + every), 1);
    for row in &rows {
        assert_eq!(row, "util|util busy|sm idle|busy", "{rows:?}");
    }
    let lease = up.lease(&training);
    assert_eq!(lease["state"], "active", "{lease}");
    assert_eq!(up.sql(&actions_sql(&training)), ["admit|admitted|ok"]);
    let (status, log) = up.process.terminate(Duration::from_secs(60));
    assert!(status.success(), "{}", log.join("\n"));
}
