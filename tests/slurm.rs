//! Slurm as a substrate, end to end, on a real single-node cluster from Debian's packages
//! (slurmctld, slurmd, munged; `tests/support/slurm.rs`) with fake GPUs, gpuwarden's submit hook
//! (`deploy/slurm/job_submit.lua`) installed, and real gpuwarden processes: the enforcer, and
//! where the test needs the lake, a broker, the pipeline and a collector on the fake NVML.
//! Users submit with `sbatch` as accounts the tests make (uid >= 1000), as on a real cluster.
//!
//! Needs root (slurmd, mknod, accounts); CI runs as root. Without it the tests say so and pass.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use support::accounts::TestAccount;
use support::slurm::{can_run_slurm, SlurmCluster, SlurmOptions};
use support::{
    eventually, http, start_fake_nvml_collector, Broker, Config, Psql, Running, Substrate, Team,
    Workload,
};

const TOKEN: &str = "slurm-e2e-admin-token";
const HOOK_TOKEN: &str = "slurm-e2e-hook-token";
const SIGNING_KEY: &str = "slurm-e2e-signing-key-0123456789abcdef";
const H100: &str = "NVIDIA H100 80GB HBM3";
/// The workload policy of batch jobs: idle for 12 s is reclaimed, warned 4 s before.
const IDLE_TIMEOUT_MS: i64 = 12_000;
const SIGNALS_EVERY_MS: i64 = 2_000;
const SAMPLE_EVERY_MS: i64 = 1_000;

fn skip() -> bool {
    if can_run_slurm() {
        return false;
    }
    eprintln!("skipped: a Slurm cluster needs root (CI runs as root)");
    true
}

/// The gpuwarden config: teams `gpu` (quota 4), `lean` (a $1 budget), `a100s` (A100 only) and
/// `tiny` (a budget of half a cent), every one with `user` as a member; jobs without an account
/// belong to `gpu`.
fn write_config(dir: &Path, cluster: &SlurmCluster, user: &str, kafka: &str) -> PathBuf {
    let team =
        |name: &str, quota: u32, budget: f64| Team::new(name, quota, budget).members(&[user]);
    Config::new()
        .broker(kafka)
        .data_dir(&dir.join("data"))
        .raw(&format!(
            r#"
[collector]
source = "nvml"
interval = "1s"
metrics_listen = "127.0.0.1:0"
slurm_cluster = "{cluster}"

[pipeline]
flush_age = "300ms"
rollup_every = "1s"
metrics_listen = "127.0.0.1:0"
sql_listen = "127.0.0.1:0"
"#,
            cluster = cluster.name,
        ))
        .anonymous_sql()
        .signals(&format!("{SIGNALS_EVERY_MS}ms"), "10s")
        .pricing(1.0)
        .gpu_price("h100", 4.0)
        .team(team("gpu", 4, 10000.0))
        .team(team("lean", 8, 1.0))
        .team(team("a100s", 8, 10000.0).allowed_models(&["A100"]))
        .team(team("tiny", 8, 0.005))
        .workload(
            Workload::new("batch")
                .max_gpus(8)
                .max_duration("2h")
                .on_idle("reclaim", &format!("{IDLE_TIMEOUT_MS}ms"))
                .raw("warn_before = \"4s\""),
        )
        .signing(SIGNING_KEY)
        .enforcer()
        .substrate(
            Substrate::new("hpc", "slurm")
                .raw(&cluster.substrate_settings())
                .raw("[slurm]\nhold_timeout = \"15s\""),
        )
        .token("admin", TOKEN, "admin", &[])
        .token(
            "slurm-hook",
            HOOK_TOKEN,
            "service",
            &["gpu", "lean", "a100s", "tiny"],
        )
        .write(dir.join("gpuwarden.toml"))
}

/// The hook's gpuwarden.conf, pointing at `url`.
fn write_hook_conf(dir: &Path, url: &str) {
    let token = dir.join("hook.token");
    std::fs::write(&token, HOOK_TOKEN).unwrap();
    std::fs::write(
        dir.join("gpuwarden.conf"),
        format!(
            "url = {url}\nsubstrate = hpc\ntoken_file = {}\ntimeout = 0.5\n",
            token.display()
        ),
    )
    .unwrap();
}

fn hook_lua() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/slurm/job_submit.lua")
}

/// A cluster named `name` with gpuwarden's hook, whose conf (under `dir`) is written later.
fn cluster(dir: &Path, name: &str) -> SlurmCluster {
    let conf = dir.join("gpuwarden.conf");
    write_hook_conf(dir, "http://127.0.0.1:9");
    let lua = hook_lua();
    SlurmCluster::start(
        &dir.join("slurm"),
        &SlurmOptions {
            cluster_name: name,
            hook: Some((&lua, &conf)),
            ..SlurmOptions::default()
        },
    )
}

/// What a test runs: an account to submit as, a cluster with gpuwarden's hook, the enforcer the
/// hook asks, and with the lake a broker and the pipeline (with its SQL endpoint).
struct Site {
    user: TestAccount,
    cluster: SlurmCluster,
    config: PathBuf,
    /// The pipeline and psql on its SQL endpoint, when the test needs the lake.
    lake: Option<(Running, Psql)>,
    enforcer: Running,
    /// The API, `host:port`.
    api: String,
    _broker: Option<Broker>,
}

impl Site {
    /// Account `gwt<pid><tag>`, cluster `name`, and the processes, all under `dir`; Kafka is the
    /// enforcer's embedded broker without the lake.
    fn start(dir: &Path, tag: &str, name: &str, with_lake: bool) -> Self {
        let user = TestAccount::create(tag);
        let cluster = cluster(dir, name);
        let broker = with_lake.then(|| Broker::start(dir));
        let kafka = broker.as_ref().map_or("embedded", |b| b.bootstrap.as_str());
        let config = write_config(dir, &cluster, &user.name, kafka);
        let lake = with_lake.then(|| {
            let (pipeline, sql_port) = support::start_pipeline_with_sql(&config);
            (pipeline, Psql::new(sql_port, "anyone", None))
        });
        let (enforcer, api) = start_enforcer(&config);
        write_hook_conf(dir, &format!("http://{api}"));
        cluster.reload_hook();
        Self {
            user,
            cluster,
            config,
            lake,
            enforcer,
            api,
            _broker: broker,
        }
    }
}

/// The enforcer on `config`, and its API address (`host:port`).
fn start_enforcer(config: &Path) -> (Running, String) {
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let running = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = running["api"]
        .as_str()
        .expect("the api field")
        .trim_start_matches("http://")
        .to_string();
    (enforcer, api)
}

fn get(api: &str, path: &str) -> Value {
    let (status, body) = http(api, "GET", path, Some(TOKEN), None);
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn lease(api: &str, id: &str) -> Option<Value> {
    let (status, body) = http(api, "GET", &format!("/v1/leases/{id}"), Some(TOKEN), None);
    (status == 200).then(|| serde_json::from_str(&body).unwrap())
}

/// Waits until lease `id` satisfies `ok`; returns it.
fn lease_when(api: &str, id: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    eventually(what, Duration::from_secs(60), || match lease(api, id) {
        Some(l) if ok(&l) => Ok(l),
        other => Err(format!("{other:?}")),
    })
}

/// `gpuwarden leases` as an admin.
fn cli_leases(api: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["leases", "--format", "json"])
        .env("GPUWARDEN_API", format!("http://{api}"))
        .env("GPUWARDEN_TOKEN", TOKEN)
        .output()
        .expect("runs gpuwarden")
}

fn denied(result: Result<u32, String>, code: &str) -> String {
    match result {
        Ok(job) => panic!("job {job} was submitted; {code} was expected"),
        Err(stderr) => {
            assert!(
                stderr.contains("gpuwarden: denied") && stderr.contains(code),
                "sbatch's message names {code}: {stderr}"
            );
            stderr
        }
    }
}

/// How many decisions the hook has logged.
fn hook_calls(cluster: &SlurmCluster) -> usize {
    cluster
        .hook_log()
        .iter()
        .filter(|l| l.contains("decision="))
        .count()
}

#[test]
fn a_gpu_job_is_admitted_at_sbatch_runs_as_a_lease_and_is_priced_in_team_hourly() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Every part bound: an unbound one would be dropped, and stopped, here.
    let Site {
        user,
        cluster,
        config: _,
        lake,
        enforcer,
        api,
        _broker,
    } = Site::start(dir.path(), "sl1", "gwe2e", true);
    let (pipeline, psql) = lake.unwrap();

    // A team within quota asks for two H100s with sbatch.
    let job = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:2", "-t", "5", "--wrap", "sleep 8"],
        )
        .unwrap_or_else(|e| panic!("admitted at sbatch: {e}\n{}", cluster.log()));
    let id = format!("slurm-{}-{job}", cluster.name);
    let active = lease_when(&api, &id, "the job's lease is active", |l| {
        l["state"] == "active"
    });
    assert_eq!(active["team"], "gpu", "{active}");
    assert_eq!(active["user"], user.name.as_str(), "{active}");
    assert_eq!(active["gpu_count"], 2, "{active}");
    assert_eq!(active["gpu_model"], H100, "{active}");
    assert_eq!(active["substrate"], "hpc", "{active}");
    let listed = cli_leases(&api);
    assert!(listed.status.success(), "{listed:?}");
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains(&id),
        "gpuwarden leases shows {id}: {}",
        String::from_utf8_lossy(&listed.stdout)
    );
    // Slurm cannot change a running job's GPUs, and a resize says so in its decision.
    let (status, body) = http(
        &api,
        "POST",
        &format!("/v1/leases/{id}/resize"),
        Some(TOKEN),
        Some(r#"{"gpus": 1}"#),
    );
    assert_eq!(status, 200, "{body}");
    let resize: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(resize["decision"], "denied", "{body}");
    assert_eq!(resize["reasons"][0]["code"], "resize_unsupported", "{body}");
    // The hook set the job's admin comment (its hold) and kept the asked-for time limit.
    let queued = cluster.job_json(job).expect("the job is queued");
    assert!(
        queued["admin_comment"]
            .as_str()
            .unwrap_or("")
            .starts_with("gpuwarden:hold=hold-"),
        "{queued}"
    );
    assert_eq!(queued["time_limit"], 5, "{queued}");

    // It ends by itself: the lease is released, and the lake has its grant and release.
    cluster.wait_state(job, &["COMPLETED"], Duration::from_secs(60));
    let released = lease_when(&api, &id, "the lease is released", |l| {
        l["state"] == "released"
    });
    assert_eq!(released["release_reason"], "user", "{released}");
    let events = format!(
        "SELECT string_agg(event, ',' ORDER BY ts_ms), min(ts_ms), max(ts_ms) FROM lease_events \
         WHERE lease_id = '{id}'"
    );
    let (granted, ended) = eventually(
        "the lease's events in the lake",
        Duration::from_secs(60),
        || {
            let row = psql.one(&events);
            let f: Vec<&str> = row.split('|').collect();
            if f[0] == "granted,released" {
                Ok((f[1].parse::<f64>().unwrap(), f[2].parse::<f64>().unwrap()))
            } else {
                Err(row)
            }
        },
    );
    // 2 GPUs for its lifetime at $4 an hour, all of team gpu's.
    let want_hours = 2.0 * (ended - granted) / 3_600_000.0;
    assert!(want_hours > 0.0);
    let team = "SELECT sum(allocated_gpu_hours), sum(cost_usd) FROM team_hourly WHERE team = 'gpu'";
    eventually(
        "the job's cost in team_hourly",
        Duration::from_secs(60),
        || {
            let row = psql.one(team);
            let f: Vec<f64> = row.split('|').filter_map(|v| v.parse().ok()).collect();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-9);
            if f.len() == 2 && close(f[0], want_hours) && close(f[1], want_hours * 4.0) {
                Ok(())
            } else {
                Err(format!("{row}, want {want_hours} GPU-hours"))
            }
        },
    );

    // A job that fails fails its lease.
    let failing = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "-t", "1", "--wrap", "exit 3"],
        )
        .expect("admitted");
    let failed = lease_when(
        &api,
        &format!("slurm-{}-{failing}", cluster.name),
        "the failed job's lease fails",
        |l| l["state"] == "failed",
    );
    assert_eq!(failed["release_reason"], "failed", "{failed}");

    // An array is decided once for all its tasks: 4 tasks of 1 GPU, 2 at once, hold 2 GPUs as
    // one lease named after the array's job id, released when its last task ends.
    let before = hook_calls(&cluster);
    let array = cluster
        .sbatch_as(
            &user.name,
            &["--gpus=1", "-a", "0-3%2", "-t", "2", "--wrap", "sleep 2"],
        )
        .expect("the array is admitted");
    assert_eq!(
        hook_calls(&cluster),
        before + 1,
        "{:#?}",
        cluster.hook_log()
    );
    let array_id = format!("slurm-{}-{array}", cluster.name);
    let held = lease_when(&api, &array_id, "the array's lease", |l| {
        l["state"] == "active" || l["state"] == "released"
    });
    assert_eq!(held["gpu_count"], 2, "{held}");
    lease_when(&api, &array_id, "the array's lease is released", |l| {
        l["state"] == "released"
    });
    for (name, process) in [("enforcer", enforcer), ("pipeline", pipeline)] {
        let (status, log) = process.terminate(Duration::from_secs(60));
        assert!(status.success(), "{name}: {status:?}\n{}", log.join("\n"));
    }
}

#[test]
fn jobs_over_quota_budget_model_or_for_a_blocked_team_are_rejected_at_sbatch_with_reasons() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Site {
        user,
        cluster,
        enforcer,
        api,
        ..
    } = Site::start(dir.path(), "sl2", "gwdeny", false);
    let sbatch = |args: &[&str]| cluster.sbatch_as(&user.name, args);

    denied(
        sbatch(&["--gres=gpu:h100:5", "--wrap", "true"]),
        "quota_exceeded",
    );
    // $4/h for 60 min against a $1 budget.
    denied(
        sbatch(&[
            "--account=lean",
            "--gres=gpu:h100:1",
            "-t",
            "60",
            "--wrap",
            "true",
        ]),
        "budget_exceeded",
    );
    let stderr = denied(
        sbatch(&["--account=a100s", "--gres=gpu:h100:1", "--wrap", "true"]),
        "model_not_allowed",
    );
    assert!(stderr.contains("estimate $4.00/h"), "{stderr}");
    // An array is decided once, for the tasks that may run at once: 10 x 1 GPU is over quota.
    let before = hook_calls(&cluster);
    denied(
        sbatch(&["--gpus=1", "-a", "0-9", "--wrap", "true"]),
        "quota_exceeded",
    );
    assert_eq!(hook_calls(&cluster), before + 1);

    // A pending job's GPUs changed with scontrol update are decided again: within quota the
    // lease follows, past it the change is refused and the lease keeps its GPUs.
    let held = sbatch(&["--hold", "--gres=gpu:h100:1", "--wrap", "true"]).expect("admitted");
    let held_id = format!("slurm-{}-{held}", cluster.name);
    lease_when(&api, &held_id, "the held job's lease", |l| {
        l["state"] == "granted"
    });
    let update = |gres: &str| {
        cluster
            .command("scontrol")
            .args(["update", &format!("JobId={held}"), &format!("Gres={gres}")])
            .output()
            .unwrap()
    };
    let grown = update("gpu:h100:3");
    assert!(grown.status.success(), "{grown:?}");
    lease_when(&api, &held_id, "the lease holds 3 GPUs", |l| {
        l["gpu_count"] == 3
    });
    let refused = update("gpu:h100:6");
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        cluster.log().contains("quota_exceeded"),
        "the denial is in slurmctld's log"
    );
    assert_eq!(lease(&api, &held_id).unwrap()["gpu_count"], 3);
    cluster
        .command("scancel")
        .arg(held.to_string())
        .status()
        .unwrap();
    lease_when(&api, &held_id, "the cancelled job's lease ends", |l| {
        l["state"] == "released"
    });
    // An array's throttle raised with scontrol is not put to the hook by Slurm 22.05: the lease
    // follows what the array's running tasks hold.
    let array = sbatch(&["--gpus=1", "-a", "0-3%1", "--wrap", "sleep 60"]).expect("admitted");
    let array_id = format!("slurm-{}-{array}", cluster.name);
    lease_when(&api, &array_id, "the array runs one task", |l| {
        l["state"] == "active" && l["gpu_count"] == 1
    });
    cluster
        .command("scontrol")
        .args(["update", &format!("JobId={array}"), "ArrayTaskThrottle=2"])
        .status()
        .unwrap();
    lease_when(
        &api,
        &array_id,
        "the lease holds the two running tasks' GPUs",
        |l| l["gpu_count"] == 2,
    );
    cluster
        .command("scancel")
        .arg(array.to_string())
        .status()
        .unwrap();
    lease_when(&api, &array_id, "the array's lease ends", |l| {
        l["state"] == "released"
    });

    // Root's job bypasses the hook: the watcher adopts it for the team its account maps to, and
    // its cost takes team tiny past its half-cent budget, which blocks the team's new jobs.
    let root_job = cluster
        .sbatch_as(
            "root",
            &["--account=tiny", "--gres=gpu:h100:2", "--wrap", "sleep 120"],
        )
        .expect("root's job is not asked about");
    let adopted = format!("slurm-{}-{root_job}", cluster.name);
    let root_lease = lease_when(&api, &adopted, "root's job is adopted", |l| {
        l["state"] == "active"
    });
    assert_eq!(root_lease["team"], "tiny", "{root_lease}");
    assert_eq!(
        root_lease["labels"]["slurm_adopted"], "true",
        "{root_lease}"
    );
    eventually("team tiny is blocked", Duration::from_secs(60), || {
        let team = get(&api, "/v1/teams/tiny");
        if team["blocked"] == true {
            Ok(())
        } else {
            Err(team)
        }
    });
    denied(
        sbatch(&[
            "--account=tiny",
            "--gres=gpu:h100:1",
            "-t",
            "1",
            "--wrap",
            "true",
        ]),
        "team_blocked",
    );
    // A root job whose account maps to no team is reported, not adopted.
    let stray = cluster
        .sbatch_as(
            "root",
            &[
                "--account=nobodys",
                "--gres=gpu:h100:1",
                "--wrap",
                "sleep 120",
            ],
        )
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(lease(&api, &format!("slurm-{}-{stray}", cluster.name)).is_none());
    cluster
        .command("scancel")
        .args([root_job.to_string(), stray.to_string()])
        .status()
        .unwrap();
    lease_when(
        &api,
        &adopted,
        "the adopted job's lease ends with it",
        |l| l["state"] == "released",
    );

    // With the enforcer down, the hook fails closed: GPU jobs are rejected, CPU jobs pass.
    let (status, log) = enforcer.terminate(Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
    assert!(
        log.iter().any(|l| l.contains("reported as unattributed")),
        "{}",
        log.join("\n")
    );
    let stderr = sbatch(&["--gres=gpu:h100:1", "--wrap", "true"]).unwrap_err();
    assert!(
        stderr.contains(
            "gpuwarden: this GPU job was not submitted: gpuwarden's admission service is \
             unreachable at"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("Batch job submission failed: Requested operation is presently disabled"),
        "{stderr}"
    );
    sbatch(&["--wrap", "true"]).expect("a CPU job needs no admission");
}

#[test]
fn an_idle_slurm_job_is_warned_then_cancelled_with_scancel() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Site {
        user,
        cluster,
        config,
        lake,
        enforcer,
        api,
        _broker,
    } = Site::start(dir.path(), "sl3", "gwidle", true);
    let (pipeline, psql) = lake.unwrap();

    // The job's process writes its pid and sleeps: its GPU does nothing.
    let pid_file = cluster.jobs_dir.join("idle.pid");
    let job = cluster
        .sbatch_as(
            &user.name,
            &[
                "--gres=gpu:h100:1",
                "--wrap",
                &format!("echo $$ > {}; exec sleep 300", pid_file.display()),
            ],
        )
        .expect("admitted");
    let id = format!("slurm-{}-{job}", cluster.name);
    let pid: u32 = eventually("the job's pid", Duration::from_secs(60), || {
        std::fs::read_to_string(&pid_file)
            .map_err(|e| e.to_string())
            .and_then(|t| {
                t.trim()
                    .parse()
                    .map_err(|e: std::num::ParseIntError| e.to_string())
            })
    });
    // The node's collector sees that process on a GPU at 0 %: its lease is found from the
    // process's Slurm job, with no GPUWARDEN_LEASE_ID anywhere.
    let script = dir.path().join("nvml.json");
    std::fs::write(
        &script,
        serde_json::json!({"devices": [{
            "uuid": "GPU-51a7e2e0-1111-2222-3333-444444444444",
            "name": H100,
            "index": 0,
            "memory_total_bytes": 85899345920u64,
            "memory_used_bytes": [1073741824u64],
            "util_gpu_pct": [0],
            "util_mem_pct": [0],
            "power_mw": [70000],
            "power_limit_mw": 700000,
            "energy_mj": [1000],
            "temp_c": [35],
            "sm_clock_mhz": [345],
            "processes": [[{"pid": pid, "used_memory_bytes": 1073741824u64}]]
        }]})
        .to_string(),
    )
    .unwrap();
    let (collector, _) = start_fake_nvml_collector(&config, &script);

    let released = eventually(
        "the idle job's lease is reclaimed",
        Duration::from_secs(90),
        || match lease(&api, &id) {
            Some(l) if l["state"] == "released" => Ok(l),
            other => Err(format!("{other:?}")),
        },
    );
    assert_eq!(released["release_reason"], "idle", "{released}");
    // Slurm cancelled it, and says why in its comment.
    let state = cluster.wait_state(job, &["CANCELLED"], Duration::from_secs(30));
    assert_eq!(state, "CANCELLED");
    let running = cluster
        .command("squeue")
        .args(["-h", "-t", "RUNNING,PENDING", "-j", &job.to_string()])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&running.stdout).trim().is_empty(),
        "squeue still shows it: {}",
        String::from_utf8_lossy(&running.stdout)
    );
    let shown = cluster.job_json(job).expect("still known for MinJobAge");
    assert_eq!(shown["comment"], "gpuwarden: reclaimed (idle)", "{shown}");
    // The lake's actions: warned, then reclaimed by a signal within the idle timeout plus one
    // signal period (and two sample intervals: the first idle sample, and the one past the
    // boundary that closes it).
    let actions = format!(
        "SELECT action, reason FROM actions WHERE lease_id = '{id}' ORDER BY ts_ms, action"
    );
    eventually(
        "the warning and the reclaim in actions",
        Duration::from_secs(60),
        || {
            let rows = psql.rows(&actions);
            let want = ["admit|admitted", "alert|idle_warning", "reclaim|idle"];
            if want.iter().all(|w| rows.iter().any(|r| r == w)) {
                Ok(())
            } else {
                Err(rows.join(", "))
            }
        },
    );
    let detail = psql.one(&format!(
        "SELECT detail FROM actions WHERE lease_id = '{id}' AND action = 'reclaim'"
    ));
    let idle_for = detail
        .rsplit_once("idle for ")
        .expect("the reclaim says how long")
        .1;
    let idle_for = humantime::parse_duration(idle_for).unwrap().as_millis() as i64;
    eprintln!("idle reclaim of a Slurm job: triggered by a signal of {idle_for} ms idle (timeout {IDLE_TIMEOUT_MS} ms)");
    assert!(
        (IDLE_TIMEOUT_MS..=IDLE_TIMEOUT_MS + SIGNALS_EVERY_MS + 2 * SAMPLE_EVERY_MS)
            .contains(&idle_for),
        "reclaimed by a signal of {idle_for} ms idle: {detail}"
    );
    for (name, process) in [
        ("collector", collector),
        ("enforcer", enforcer),
        ("pipeline", pipeline),
    ] {
        let (status, log) = process.terminate(Duration::from_secs(60));
        assert!(status.success(), "{name}: {status:?}\n{}", log.join("\n"));
    }
}
