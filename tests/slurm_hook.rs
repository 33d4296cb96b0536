//! gpuwarden's Slurm hook (deploy/slurm/job_submit.lua) in a real, private Slurm cluster, against
//! a small HTTP listener standing in for the enforcer: which jobs it asks about, what it sends
//! (the protocol's fields, from real sbatch options), what each answer does to the job, what a
//! missing, silent or failing enforcer means, and which failures send it on to the next of
//! several enforcers. The enforcer's own side of the protocol is tested with the enforcer
//! (tests/slurm.rs); one test here runs two real enforcers sharing a PostgreSQL lease store
//! (`support::pg`) and kills one between two submissions.
//!
//! Needs root (the cluster's daemons, fake GPU devices, test accounts) and the Debian packages
//! of `support::slurm::SLURM_PACKAGES`, and for the replicas' test PostgreSQL's server; CI runs
//! as root with them installed.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::accounts::TestAccount;
use support::slurm::{can_run_slurm, SlurmCluster, SlurmOptions};
use support::{eventually, http, Config, Running, Substrate, Team, Workload};

const HOOK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/slurm/job_submit.lua");
const TOKEN: &str = "slurm-hook-test-token";
const SUBSTRATE: &str = "hpc";

/// One request the hook made.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    authorization: Option<String>,
    content_type: Option<String>,
    body: Value,
}

/// An HTTP listener on 127.0.0.1 in place of the enforcer: records every request and answers
/// with the current answer (a status, 200 unless set, and a body), or holds the connection
/// without answering while the answer is `None`.
struct FakeEnforcer {
    url: String,
    answer: Arc<Mutex<Option<(u16, String)>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl FakeEnforcer {
    fn start(answer: Option<&str>) -> Self {
        Self::start_with(answer.map(|a| (200, a)))
    }

    fn start_with(answer: Option<(u16, &str)>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let answer = Arc::new(Mutex::new(answer.map(|(s, a)| (s, a.to_string()))));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (answers, records) = (Arc::clone(&answer), Arc::clone(&seen));
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let Some((status, answer)) = answers.lock().unwrap().clone() else {
                    // Accept, never answer: the hook's timeout must end the call.
                    held.push(stream);
                    continue;
                };
                if let Some(request) = serve(stream, status, &answer) {
                    records.lock().unwrap().push(request);
                }
            }
        });
        Self { url, answer, seen }
    }

    fn answer(&self, text: &str) {
        self.answer_with(200, text);
    }

    fn answer_with(&self, status: u16, text: &str) {
        *self.answer.lock().unwrap() = Some((status, text.to_string()));
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Reads one request from `stream` and answers it with `status` and `answer`.
fn serve(stream: TcpStream, status: u16, answer: &str) -> Option<Seen> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let (mut length, mut authorization, mut content_type) = (0, None, None);
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        let (name, value) = line.split_once(':')?;
        let value = value.trim().to_string();
        match name.to_ascii_lowercase().as_str() {
            "content-length" => length = value.parse().ok()?,
            "authorization" => authorization = Some(value),
            "content-type" => content_type = Some(value),
            _ => {}
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    let body = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("the hook sent invalid JSON ({e}): {body:?}"));
    let _ = write!(
        reader.get_mut(),
        "HTTP/1.1 {status} Whatever\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    );
    Some(Seen {
        path,
        authorization,
        content_type,
        body,
    })
}

/// Writes the hook's gpuwarden.conf (and its token file) under `dir`; `extra` is appended.
fn hook_conf(dir: &Path, url: &str, extra: &str) -> PathBuf {
    let token = dir.join("gpuwarden.token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let conf = dir.join("gpuwarden.conf");
    std::fs::write(
        &conf,
        format!(
            "# written by tests/slurm_hook.rs\nurl = {url}\nsubstrate = {SUBSTRATE}\n\
             token_file = {}\n{extra}\n",
            token.display()
        ),
    )
    .unwrap();
    conf
}

/// A cluster with the hook installed, reading `conf`.
fn cluster_with_hook(dir: &Path, conf: &Path) -> SlurmCluster {
    SlurmCluster::start(
        &dir.join("slurm"),
        &SlurmOptions {
            cluster_name: "hooked",
            hook: Some((Path::new(HOOK), conf)),
            ..SlurmOptions::default()
        },
    )
}

/// A URL on 127.0.0.1 where connections are refused, for as long as the value lives: its port is
/// bound to a socket that never listens, so no listener the test starts later (a fake enforcer
/// bound to port 0) can be given the same port and answer there. A port merely found free and
/// let go was, once, handed to the next fake enforcer, and "refused" became "silent".
struct ClosedPort {
    url: String,
    _bound: rustix::fd::OwnedFd,
}

impl ClosedPort {
    fn new() -> ClosedPort {
        use rustix::net::{AddressFamily, SocketType};
        let socket = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
        rustix::net::bind(&socket, &SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).unwrap();
        let bound = SocketAddrV4::try_from(rustix::net::getsockname(&socket).unwrap()).unwrap();
        ClosedPort {
            url: format!("http://{bound}"),
            _bound: socket,
        }
    }
}

impl std::fmt::Display for ClosedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

macro_rules! needs_root {
    () => {
        if !can_run_slurm() {
            eprintln!("skipped: a Slurm cluster and test accounts need root");
            return;
        }
    };
}

#[test]
fn a_gpu_job_sees_the_gpus_slurm_gave_it() {
    needs_root!();
    let user = TestAccount::create("env");
    let dir = tempfile::tempdir().unwrap();
    let cluster = SlurmCluster::start(
        &dir.path().join("slurm"),
        &SlurmOptions {
            cluster_name: "plain",
            ..SlurmOptions::default()
        },
    );
    let job = cluster
        .sbatch_as(
            &user.name,
            &[
                "--gres=gpu:h100:2",
                "-o",
                "env-%j.out",
                "--wrap",
                "env; echo uid=$(id -u)",
            ],
        )
        .unwrap();
    assert!(job >= cluster.first_job_id, "job {job}");
    cluster.wait_state(job, &["COMPLETED"], Duration::from_secs(60));
    let out = std::fs::read_to_string(cluster.jobs_dir.join(format!("env-{job}.out"))).unwrap();
    let vars: Vec<&str> = out.lines().collect();
    for expected in [
        "CUDA_VISIBLE_DEVICES=0,1".to_string(),
        "SLURM_JOB_GPUS=0,1".to_string(),
        "SLURM_CLUSTER_NAME=plain".to_string(),
        format!("SLURM_JOB_ID={job}"),
        format!("uid={}", user.uid()),
    ] {
        assert!(
            vars.contains(&expected.as_str()),
            "no {expected} in:\n{out}"
        );
    }
}

#[test]
fn with_the_enforcer_unreachable_gpu_jobs_are_rejected_and_cpu_jobs_pass() {
    needs_root!();
    let user = TestAccount::create("unr");
    let dir = tempfile::tempdir().unwrap();
    let closed = ClosedPort::new();
    let url = &closed.url;
    let conf = hook_conf(dir.path(), url, "");
    let cluster = cluster_with_hook(dir.path(), &conf);

    let error = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "--hold", "--wrap", "true"],
        )
        .expect_err("a GPU job without an answer is rejected");
    // What happened, where, and what to do; then Slurm's own line with an error code that says
    // something (not "Unspecified error").
    assert_eq!(
        error.lines().collect::<Vec<_>>(),
        [
            format!(
                "sbatch: error: gpuwarden: this GPU job was not submitted: gpuwarden's admission \
                 service is unreachable at {url} (connection refused). Try again in a few \
                 minutes; if it keeps failing, contact your cluster administrator."
            )
            .as_str(),
            "sbatch: error: Batch job submission failed: Requested operation is presently disabled",
        ],
        "{error}"
    );
    cluster
        .sbatch_as(&user.name, &["-n", "1", "--hold", "--wrap", "true"])
        .expect("a CPU-only job needs no answer");
    let log = cluster.hook_log();
    assert_eq!(log.len(), 2, "the load and one decision: {log:#?}");
    assert!(
        log[1].contains("submit decision=reject reason=unavailable")
            && log[1].contains(&format!("user={} uid={}", user.name, user.uid()))
            && log[1].contains("latency_ms=")
            && log[1].contains("error=connection refused"),
        "{}",
        log[1]
    );
}

#[test]
fn on_unavailable_admit_lets_gpu_jobs_in_while_the_enforcer_is_unreachable() {
    needs_root!();
    let user = TestAccount::create("adm");
    let dir = tempfile::tempdir().unwrap();
    let closed = ClosedPort::new();
    let conf = hook_conf(dir.path(), &closed.url, "on_unavailable = admit");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let job = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "--hold", "--wrap", "true"],
        )
        .expect("admitted without an answer");
    assert_eq!(cluster.job_state(job).unwrap(), "PENDING");
    let log = cluster.hook_log();
    assert!(
        log.iter()
            .any(|l| l.contains("submit decision=admit reason=unavailable")),
        "{log:#?}"
    );
}

#[test]
fn an_enforcer_that_never_answers_fails_the_call_at_the_timeout() {
    needs_root!();
    let user = TestAccount::create("sil");
    let dir = tempfile::tempdir().unwrap();
    let enforcer = FakeEnforcer::start(None);
    let conf = hook_conf(dir.path(), &enforcer.url, "timeout = 1");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let started = Instant::now();
    let error = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "--hold", "--wrap", "true"],
        )
        .expect_err("no answer is a failure, and failure rejects");
    let took = started.elapsed();
    eprintln!("sbatch against a silent enforcer (timeout = 1 s) took {took:?}");
    assert!(
        error.contains(&format!(
            "gpuwarden: this GPU job was not submitted: gpuwarden's admission service at {} \
             did not answer in time (timeout)",
            enforcer.url
        )),
        "{error}"
    );
    assert!(error.contains("presently disabled"), "{error}");
    assert!(took < Duration::from_secs(10), "sbatch took {took:?}");
    let log = cluster.hook_log();
    assert!(
        log.iter()
            .any(|l| l.contains("reason=unavailable") && l.contains("error=timeout")),
        "{log:#?}"
    );
}

#[test]
fn the_hook_sends_the_protocol_s_fields_and_the_user_sees_a_denial() {
    needs_root!();
    let user = TestAccount::create("req");
    let dir = tempfile::tempdir().unwrap();
    let denial = "team physics holds 8 of its 8 GPUs; wait or ask for more (\"quota\")";
    let enforcer = FakeEnforcer::start(Some(&format!("deny\nmessage={denial}\n")));
    let conf = hook_conf(dir.path(), &enforcer.url, "");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let uid = user.uid();

    let base = json!({
        "user": user.name, "uid": uid, "account": null, "partition": null, "qos": null,
        "comment": null, "wckey": null, "job_name": "wrap", "tres_per_node": null,
        "tres_per_job": null, "tres_per_task": null, "tres_per_socket": null,
        "min_nodes": null, "max_nodes": null, "num_tasks": null, "ntasks_per_node": null,
        "sockets_per_node": null, "array_inx": null, "time_limit": null,
        "lease_id": null,
    });
    let with = |fields: Value| {
        let mut body = base.clone();
        for (k, v) in fields.as_object().unwrap() {
            assert!(body.get(k).is_some(), "{k} is not a protocol field");
            body[k] = v.clone();
        }
        body
    };
    // sbatch's options, its environment, the body the hook must send.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, Value);
    let cases: Vec<Case> = vec![
        (
            vec!["--gres=gpu:h100:2"],
            vec![],
            with(json!({"tres_per_node": "gres:gpu:h100:2"})),
        ),
        (
            vec!["--gpus=3", "-a", "0-9%2"],
            vec![],
            with(json!({"tres_per_job": "gres:gpu:3", "array_inx": "0-9%2"})),
        ),
        (
            vec!["--gpus-per-task=1", "-n", "2"],
            vec![],
            with(json!({"tres_per_task": "gres:gpu:1", "num_tasks": 2})),
        ),
        (
            vec![
                "--gres=gpu:1",
                "-N",
                "1",
                "-A",
                "physics",
                "-p",
                "gpu",
                "-t",
                "90",
                "--wckey=training:p1",
                "-J",
                "we\"ird\\name",
                "--comment=tab\there, ünïcode",
            ],
            vec![("GPUWARDEN_LEASE_ID", "local-7f3a")],
            with(json!({
                "tres_per_node": "gres:gpu:1", "min_nodes": 1, "max_nodes": 1, "account": "physics",
                "partition": "gpu", "time_limit": 90, "wckey": "training:p1",
                "job_name": "we\"ird\\name", "comment": "tab\there, ünïcode",
                "lease_id": "local-7f3a",
            })),
        ),
    ];
    for (i, (options, env, expected)) in cases.iter().enumerate() {
        let out = cluster
            .command_as(&user.name, "sbatch")
            .args(options)
            .args(["--hold", "--wrap", "true"])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{options:?} was admitted");
        assert!(
            stderr.contains(&format!("sbatch: error: {denial}")),
            "{options:?}: {stderr}"
        );
        let seen = enforcer.seen();
        assert_eq!(seen.len(), i + 1, "one call per GPU job: {seen:#?}");
        let request = &seen[i];
        assert_eq!(request.path, format!("/v1/slurm/{SUBSTRATE}/submit"));
        assert_eq!(
            request.authorization.as_deref(),
            Some(format!("Bearer {TOKEN}").as_str())
        );
        assert_eq!(request.content_type.as_deref(), Some("application/json"));
        assert_eq!(&request.body, expected, "{options:?}");
    }

    // No GPU, no call.
    cluster
        .sbatch_as(&user.name, &["-n", "2", "--hold", "--wrap", "true"])
        .expect("a CPU-only job passes");
    assert_eq!(enforcer.seen().len(), cases.len());
    assert!(
        cluster
            .hook_log()
            .iter()
            .any(|l| l.contains("submit decision=deny reason=answer") && l.contains(denial)),
        "{:#?}",
        cluster.hook_log()
    );
}

#[test]
fn an_admitted_job_carries_the_answer_s_admin_comment_and_time_limit() {
    needs_root!();
    let user = TestAccount::create("ok");
    let dir = tempfile::tempdir().unwrap();
    let enforcer = FakeEnforcer::start(Some(
        "admit\nadmin_comment=gpuwarden:team=physics\ntime_limit=45\nfuture_key=ignored\n\
         message=admitted for team physics, 45 minutes at most\n",
    ));
    let conf = hook_conf(dir.path(), &enforcer.url, "");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let out = cluster
        .command_as(&user.name, "sbatch")
        .args(["--parsable", "--gres=gpu:h100:2", "-t", "600", "--hold"])
        .args(["--wrap", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("admitted for team physics, 45 minutes at most"),
        "{stderr}"
    );
    let job: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let entry = cluster.job_json(job).expect("the job in squeue --json");
    assert_eq!(entry["admin_comment"], "gpuwarden:team=physics");
    assert_eq!(entry["time_limit"], 45);
    assert_eq!(entry["tres_per_node"], "gres:gpu:h100:2");
    assert_eq!(enforcer.seen()[0].body["time_limit"], 600);
}

#[test]
fn changing_a_pending_job_s_gpus_asks_the_enforcer_again() {
    needs_root!();
    let user = TestAccount::create("mod");
    let dir = tempfile::tempdir().unwrap();
    let enforcer = FakeEnforcer::start(Some("admit\nadmin_comment=gpuwarden:lease=L1\n"));
    let conf = hook_conf(dir.path(), &enforcer.url, "");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let job = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "--hold", "--wrap", "true"],
        )
        .unwrap();
    let update = |spec: &str| {
        cluster
            .command_as(&user.name, "scontrol")
            .args(["update", &format!("JobId={job}"), spec])
            .output()
            .unwrap()
    };

    // A time limit is not the enforcer's business here: no call.
    assert!(update("TimeLimit=30").status.success());
    assert_eq!(enforcer.seen().len(), 1);

    let denial = "3 GPUs exceed the lease's 1";
    enforcer.answer(&format!("deny\nmessage={denial}\n"));
    let out = update("Gres=gpu:h100:3");
    assert!(!out.status.success(), "the change was made");
    // scontrol update (22.05) shows only the error code; the message is in slurmctld's log.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Access/permission denied"), "{stderr}");
    let seen = enforcer.seen();
    assert_eq!(seen.len(), 2, "{seen:#?}");
    assert_eq!(seen[1].path, format!("/v1/slurm/{SUBSTRATE}/modify"));
    let body = &seen[1].body;
    assert_eq!(body["job_id"], job);
    assert_eq!(body["uid"], user.uid());
    assert_eq!(body["admin_comment"], "gpuwarden:lease=L1");
    assert_eq!(body["tres_per_node"], "gres:gpu:h100:3");
    for field in ["tres_per_job", "tres_per_task", "tres_per_socket"] {
        assert_eq!(body[field], Value::Null, "{field}");
    }
    assert_eq!(
        cluster.job_json(job).unwrap()["tres_per_node"],
        "gres:gpu:h100:1"
    );
    assert!(
        cluster
            .hook_log()
            .iter()
            .any(|l| l.contains("modify decision=deny") && l.contains(denial)),
        "{:#?}",
        cluster.hook_log()
    );

    enforcer.answer("admit\n");
    let out = update("Gres=gpu:h100:2");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(enforcer.seen().len(), 3);
    assert_eq!(
        cluster.job_json(job).unwrap()["tres_per_node"],
        "gres:gpu:h100:2"
    );
}

#[test]
fn an_answer_the_hook_cannot_read_is_a_failure() {
    needs_root!();
    let user = TestAccount::create("bad");
    let dir = tempfile::tempdir().unwrap();
    let enforcer = FakeEnforcer::start(Some("maybe\nmessage=this is not the protocol\n"));
    let conf = hook_conf(dir.path(), &enforcer.url, "");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let error = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "--hold", "--wrap", "true"],
        )
        .expect_err("an unreadable answer rejects");
    assert!(
        error.contains(&format!(
            "sbatch: error: gpuwarden: this GPU job was not submitted: gpuwarden's admission \
             service at {} could not decide on it (the answer's first line is neither admit nor \
             deny). Try again in a few minutes",
            enforcer.url
        )),
        "{error}"
    );
    assert!(!error.contains("not the protocol"), "{error}");
    enforcer.answer("admit\ntime_limit=soon\n");
    let error = cluster
        .sbatch_as(
            &user.name,
            &["--gres=gpu:h100:1", "--hold", "--wrap", "true"],
        )
        .expect_err("a time_limit that is not a number rejects");
    assert!(
        error.contains("could not decide on it (time_limit is not a number)"),
        "{error}"
    );
    assert_eq!(enforcer.seen().len(), 2);
    let log = cluster.hook_log();
    assert!(
        log.iter()
            .any(|l| l.contains("reason=unavailable") && l.contains("neither admit nor deny")),
        "{log:#?}"
    );
}

/// The enforcer's answer when its lease store's database is away (`ApiError::StoreUnavailable`).
const STORE_UNAVAILABLE: &str = r#"{"error":{"code":"store_unavailable","message":"the lease store's database cannot be reached; nothing was decided, try again"}}"#;

#[test]
fn with_several_enforcers_the_hook_moves_on_only_from_one_that_decided_nothing() {
    needs_root!();
    let user = TestAccount::create("many");
    let dir = tempfile::tempdir().unwrap();
    let refused = ClosedPort::new();
    let store_away = FakeEnforcer::start_with(Some((503, STORE_UNAVAILABLE)));
    let admitting = FakeEnforcer::start(Some("admit\nadmin_comment=gpuwarden:hold=h1\n"));
    let conf = hook_conf(
        dir.path(),
        &format!("{refused}, {}, {}/", store_away.url, admitting.url),
        "",
    );
    let cluster = cluster_with_hook(dir.path(), &conf);
    let gpu_job = ["--gres=gpu:h100:1", "--hold", "--wrap", "true"];

    // Refused, then a 503 store_unavailable: neither decided anything, the third admits.
    let job = cluster
        .sbatch_as(&user.name, &gpu_job)
        .expect("the third enforcer admits");
    assert_eq!(
        cluster.job_json(job).unwrap()["admin_comment"],
        "gpuwarden:hold=h1"
    );
    assert_eq!(store_away.seen().len(), 1);
    assert_eq!(admitting.seen().len(), 1);
    let log = cluster.hook_log();
    for (from, why, to) in [
        (&refused.url, "connection refused", &store_away.url),
        (
            &store_away.url,
            "HTTP status 503: store_unavailable",
            &admitting.url,
        ),
    ] {
        let line = format!("gpuwarden: enforcer {from} decided nothing ({why}); asking {to}");
        assert!(log.iter().any(|l| l.contains(&line)), "{line}\n{log:#?}");
    }
    assert!(
        log.iter().any(|l| l.contains("submit decision=admit")
            && l.ends_with(&format!("url={}", admitting.url))),
        "the decision names the enforcer that answered: {log:#?}"
    );

    // The next call goes to the enforcer that answered last, without asking the others again.
    cluster.sbatch_as(&user.name, &gpu_job).unwrap();
    assert_eq!(store_away.seen().len(), 1);
    assert_eq!(admitting.seen().len(), 2);

    // An enforcer that was reached and fell silent may have acted on the job: the call fails
    // there (on_unavailable), and the next enforcer is not asked.
    let silent = FakeEnforcer::start(None);
    hook_conf(
        dir.path(),
        &format!("{}, {}", silent.url, admitting.url),
        "timeout = 1",
    );
    cluster.reload_hook();
    let error = cluster
        .sbatch_as(&user.name, &gpu_job)
        .expect_err("a silent enforcer fails the call");
    assert!(
        error.contains(&format!(
            "gpuwarden's admission service at {} did not answer in time (timeout)",
            silent.url
        )),
        "{error}"
    );
    assert_eq!(
        admitting.seen().len(),
        2,
        "the second enforcer was not asked"
    );

    // When none decides, the user is told what each one did.
    store_away.answer_with(
        503,
        r#"{"error":{"code":"substrate_unavailable","message":"not read yet"}}"#,
    );
    hook_conf(dir.path(), &format!("{refused},{}", store_away.url), "");
    cluster.reload_hook();
    let error = cluster
        .sbatch_as(&user.name, &gpu_job)
        .expect_err("no enforcer decided");
    assert!(
        error.contains(&format!(
            "gpuwarden: this GPU job was not submitted: gpuwarden's admission service is \
             unreachable at {refused} (connection refused), and at {} could not decide on it \
             (HTTP status 503: substrate_unavailable). Try again in a few minutes",
            store_away.url
        )),
        "{error}"
    );
    assert!(error.contains("presently disabled"), "{error}");
    assert_eq!(store_away.seen().len(), 2);
}

const ADMIN_TOKEN: &str = "slurm-hook-test-admin-token";

/// An enforcer's config for the cluster `cluster`, its data under `dir`, its lease store in the
/// PostgreSQL database `store`: team `gpu` (quota 8, member `user`) gets jobs without an
/// account; the hook's token is a service token, [`ADMIN_TOKEN`] an admin's.
fn replica_config(dir: &Path, cluster: &SlurmCluster, user: &str, store: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    Config::new()
        .kafka("embedded")
        .data_dir(&dir.join("data"))
        .signing("slurm-hook-test-signing-key-0123456789abcdef")
        .pricing(1.0)
        .team(Team::new("gpu", 8, 10000.0).members(&[user]))
        .workload(Workload::new("batch").max_gpus(8).max_duration("2h"))
        .enforcer()
        .store(store)
        .substrate(
            Substrate::new(SUBSTRATE, "slurm")
                .raw(&cluster.substrate_settings())
                .raw("[slurm]\nhold_timeout = \"60s\""),
        )
        .token("admin", ADMIN_TOKEN, "admin", &[])
        .token("slurm-hook", TOKEN, "service", &["gpu"])
        .write(dir.join("gpuwarden.toml"))
}

/// `gpuwarden enforce` on `config`, and its API's `host:port`.
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

#[test]
fn a_slurm_submission_keeps_working_while_one_of_two_enforcers_is_killed() {
    needs_root!();
    let user = TestAccount::create("ha");
    let dir = tempfile::tempdir().unwrap();
    // The cluster first: the enforcers' configs name its slurm.conf. Until they run, the hook
    // points nowhere.
    let closed = ClosedPort::new();
    let conf = hook_conf(dir.path(), &closed.url, "");
    let cluster = cluster_with_hook(dir.path(), &conf);
    let store = support::pg::server().database();
    let (first, first_api) = start_enforcer(&replica_config(
        &dir.path().join("first"),
        &cluster,
        &user.name,
        &store,
    ));
    let (second, second_api) = start_enforcer(&replica_config(
        &dir.path().join("second"),
        &cluster,
        &user.name,
        &store,
    ));
    // A generous timeout: a slow first answer must not pass for a dead enforcer here.
    hook_conf(
        dir.path(),
        &format!("http://{first_api}, http://{second_api}"),
        "timeout = 5",
    );
    cluster.reload_hook();
    let gpu_job = ["--gres=gpu:h100:1", "--hold", "--wrap", "true"];

    let before = cluster.sbatch_as(&user.name, &gpu_job).unwrap_or_else(|e| {
        panic!(
            "admitted by the first enforcer: {e}\n{:#?}",
            cluster.hook_log()
        )
    });
    // Dropping a Running kills it with SIGKILL: no shutdown, its connections cut by the kernel.
    drop(first);
    let after = cluster.sbatch_as(&user.name, &gpu_job).unwrap_or_else(|e| {
        panic!(
            "admitted by the second enforcer: {e}\n{:#?}",
            cluster.hook_log()
        )
    });

    let decisions: Vec<String> = cluster
        .hook_log()
        .into_iter()
        .filter(|l| l.contains("submit decision="))
        .collect();
    assert_eq!(decisions.len(), 2, "{decisions:#?}");
    assert!(
        decisions[0].contains("decision=admit")
            && decisions[0].ends_with(&format!("url=http://{first_api}")),
        "{decisions:#?}"
    );
    assert!(
        decisions[1].contains("decision=admit")
            && decisions[1].ends_with(&format!("url=http://{second_api}")),
        "{decisions:#?}"
    );
    assert!(
        cluster.hook_log().iter().any(|l| l.contains(&format!(
            "gpuwarden: enforcer http://{first_api} decided nothing (connection refused); \
             asking http://{second_api}"
        ))),
        "{:#?}",
        cluster.hook_log()
    );

    // Both jobs are leases in the shared store, seen through the enforcer that is left.
    for job in [before, after] {
        let id = format!("slurm-{}-{job}", cluster.name);
        let lease = eventually(
            &format!("lease {id} through the surviving enforcer"),
            Duration::from_secs(60),
            || {
                let (status, body) = http(
                    &second_api,
                    "GET",
                    &format!("/v1/leases/{id}"),
                    Some(ADMIN_TOKEN),
                    None,
                );
                if status == 200 {
                    Ok(serde_json::from_str::<Value>(&body).unwrap())
                } else {
                    Err(format!("{status} {body}"))
                }
            },
        );
        assert_eq!(lease["team"], "gpu", "{lease}");
        assert_eq!(lease["user"], user.name.as_str(), "{lease}");
        assert_eq!(lease["gpu_count"], 1, "{lease}");
        assert_eq!(lease["state"], "granted", "a held job is pending: {lease}");
    }
    drop(second);
}
