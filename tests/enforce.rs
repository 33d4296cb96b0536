//! `gpuwarden enforce` and the self-service commands, driven as a user would: a broker process,
//! the enforcer on port 0 over a temp data dir, `gpuwarden request / leases / release` over
//! HTTP, and the lease events read back from Kafka with rdkafka.
//!
//! The restart tests kill the enforcer with SIGKILL while Kafka is unreachable and start it
//! again on the same data dir: leases, quota and the local lease's process must survive, and the
//! events written while Kafka was away must arrive once it is there.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use gpuwarden_schema::signing::{self, SigningKeys};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::ClientConfig;
use serde_json::Value;
use support::{
    eventually, http, log_line, Broker, BrokerKind, Config, Running, Substrate, Team, Webhook,
    Workload, H100,
};

const TOKEN: &str = "ada-secret-token";

/// `[signing]`: the key signals are signed with, and the one a rotation is moving away from.
const SIGNING_KEY: &str = "enforce-test-signing-key-0123456789abcdef";
const PREVIOUS_SIGNING_KEY: &str = "enforce-test-previous-key-0123456789abcdef";

/// Team `ml` (quota 4, member ada), a simulated substrate `sim` of 8 H100s for training, and a
/// local substrate `box` of two L4s for batch work, whose leases run as ada's test account.
fn write_config(dir: &Path, bootstrap: &str) -> PathBuf {
    config(dir, bootstrap).write(dir.join("gpuwarden.toml"))
}

/// The config [`write_config`] writes.
fn config(dir: &Path, bootstrap: &str) -> Config {
    let account = support::accounts::lease_account();
    config_with(dir, bootstrap, &["ada"], &[("ada", &account)])
}

/// [`config`] with `members` in team `ml`, and `box` running the leases of each user of
/// `accounts` as the account paired with it.
fn config_with(dir: &Path, bootstrap: &str, members: &[&str], accounts: &[(&str, &str)]) -> Config {
    let accounts: Vec<String> = accounts
        .iter()
        .map(|(user, account)| format!("{user} = \"{account}\""))
        .collect();
    let local = Substrate::new("box", "local").raw(&format!(
        r#"gpu_model = "NVIDIA L4"
gpu_uuids = ["GPU-box-0", "GPU-box-1"]
grace_period = "1s"
accounts = {{ {accounts} }}
run_as_enforcer = {as_self}
"#,
        accounts = accounts.join(", "),
        as_self = !support::accounts::running_as_root(),
    ));
    Config::new()
        .broker(bootstrap)
        .data_dir(&dir.join("data"))
        .team(Team::new("ml", 4, 100000.0).members(members))
        .workload(
            Workload::new("training")
                .max_gpus(8)
                .max_duration("24h")
                .substrates(&["sim"]),
        )
        .workload(
            Workload::new("batch")
                .max_gpus(2)
                .max_duration("24h")
                .substrates(&["box"]),
        )
        .enforcer()
        .substrate(Substrate::simulated("sim").hosts("h", 1, 8, H100))
        .substrate(local)
        .token("ada", TOKEN, "member", &["ml"])
        .signing(SIGNING_KEY)
        .raw(&format!(
            "[signing]\nprevious_key = \"{PREVIOUS_SIGNING_KEY}\"\n"
        ))
}

/// Starts the enforcer and returns it with its API's base URL.
fn start_enforcer(config: &Path) -> (Running, String) {
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_string();
    (enforcer, api)
}

/// Runs a self-service command against `api`.
fn cli(api: &str, args: &[&str]) -> Output {
    support::self_service(api, TOKEN, args)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn show(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        stdout(output),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Asks for a lease and returns its id (from the `--env` exports).
fn request_ok(api: &str, args: &[&str]) -> String {
    let mut all = vec!["request", "--team", "ml", "--env"];
    all.extend_from_slice(args);
    let out = cli(api, &all);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let text = stdout(&out);
    text.lines()
        .find_map(|l| l.strip_prefix("export GPUWARDEN_LEASE_ID="))
        .unwrap_or_else(|| panic!("no lease id in\n{}", show(&out)))
        .to_string()
}

fn leases_json(api: &str) -> Vec<Value> {
    let out = cli(api, &["leases", "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let value: Value = serde_json::from_str(&stdout(&out)).unwrap();
    value.as_array().cloned().unwrap_or_else(|| {
        value["leases"]
            .as_array()
            .cloned()
            .expect("a list of leases")
    })
}

fn lease_state(api: &str, id: &str) -> String {
    leases_json(api)
        .iter()
        .find(|l| l["id"] == id)
        .unwrap_or_else(|| panic!("lease {id} is not listed"))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Reads gpuwarden.leases from the start until `done` holds for what was read.
fn lease_events(bootstrap: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set(
            "group.id",
            format!(
                "enforce-test-{}",
                std::process::id() as u128 * 1000 + nanos()
            ),
        )
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&["gpuwarden.leases"]).unwrap();
    let mut events = Vec::new();
    eventually("the expected lease events", Duration::from_secs(60), || {
        while let Some(message) = consumer.poll(Duration::ZERO) {
            let message = message.unwrap();
            let payload = message.payload().expect("a payload");
            events.push(serde_json::from_slice(payload).unwrap());
        }
        if done(&events) {
            Ok(())
        } else {
            Err(format!("{events:#?}"))
        }
    });
    events
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u128
}

fn has(events: &[Value], id: &str, event: &str) -> bool {
    events
        .iter()
        .any(|e| e["lease_id"] == id && e["event"] == event)
}

#[test]
fn a_lease_is_requested_listed_and_released_with_its_events_in_kafka() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = write_config(dir.path(), &broker.bootstrap);
    let (enforcer, api) = start_enforcer(&config);

    let id = request_ok(
        &api,
        &[
            "--gpus",
            "2",
            "--workload",
            "training",
            "--duration",
            "2h",
            "--label",
            "run=e2e",
            "--wait",
        ],
    );
    let events = lease_events(&broker.bootstrap, |e| has(e, &id, "granted"));
    let granted = events
        .iter()
        .find(|e| e["lease_id"] == id.as_str())
        .unwrap();
    assert_eq!(granted["team"], "ml");
    assert_eq!(granted["user"], "ada");
    assert_eq!(granted["gpu_count"], 2);
    assert_eq!(granted["gpu_model"], "NVIDIA H100 80GB HBM3");
    assert_eq!(granted["labels"]["run"], "e2e");

    assert_eq!(lease_state(&api, &id), "active");
    let table = cli(&api, &["leases", "--team", "ml"]);
    let table_text = stdout(&table);
    assert!(table_text.starts_with("ID "), "{}", show(&table));
    let row = table_text
        .lines()
        .find(|l| l.starts_with(id.as_str()))
        .unwrap_or_else(|| panic!("{}", show(&table)));
    for cell in ["ml", "ada", "training", "sim", "active"] {
        assert!(row.split_whitespace().any(|c| c == cell), "{cell} in {row}");
    }

    // Quota 4, 2 held: asking for 3 more is denied, with the reason and exit code 3.
    let denied = cli(
        &api,
        &[
            "request",
            "--team",
            "ml",
            "--gpus",
            "3",
            "--workload",
            "training",
        ],
    );
    assert_eq!(denied.status.code(), Some(3), "{}", show(&denied));
    let text = stdout(&denied);
    assert!(text.starts_with("denied\n"), "{}", show(&denied));
    assert!(text.contains("quota_exceeded: "), "{}", show(&denied));

    let released = cli(&api, &["release", &id]);
    assert_eq!(released.status.code(), Some(0), "{}", show(&released));
    assert_eq!(stdout(&released), format!("released {id} (user)\n"));
    let events = lease_events(&broker.bootstrap, |e| has(e, &id, "released"));
    let event = events
        .iter()
        .find(|e| e["lease_id"] == id.as_str() && e["event"] == "released")
        .unwrap();
    assert_eq!(event["reason"], "user");
    assert_eq!(lease_state(&api, &id), "released");

    let (status, log) = enforcer.terminate(Duration::from_secs(20));
    assert!(status.success(), "{}", log.join("\n"));
    assert!(
        log.iter().any(|l| l.contains("outbox flushed")),
        "{}",
        log.join("\n")
    );
}

/// The issue's attack, through the API with a member's token: the lease's command prints its
/// identity and tries /etc/shadow. It runs as the account ada maps to (made by the test), never
/// as the enforcer's root; a user with no account, and one mapped to root, are denied with their
/// reason codes before anything runs. Needs root (to make the account); CI runs as root.
#[test]
fn a_member_s_lease_command_runs_as_their_account_and_unmapped_or_root_users_are_denied() {
    if !support::accounts::running_as_root() {
        eprintln!("skipped: making a test account needs root");
        return;
    }
    let account = support::accounts::TestAccount::create("api");
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    const ADMIN: &str = "admin-secret-token";
    let config = config_with(
        dir.path(),
        &broker.bootstrap,
        &["ada", "bob", "rooted"],
        &[("ada", &account.name), ("rooted", "root")],
    )
    .token("root-admin", ADMIN, "admin", &[])
    .write(dir.path().join("gpuwarden.toml"));
    let (enforcer, api) = start_enforcer(&config);
    let address = api.trim_start_matches("http://");
    let admit = |token: &str, user: &str| {
        let body = format!(
            r#"{{"team":"ml","user":"{user}","project":"p","workload":"batch","gpus":1,
                "command":["sh","-c","id; head -2 /etc/shadow"]}}"#
        );
        let (status, body) = http(address, "POST", "/v1/admission", Some(token), Some(&body));
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()
    };

    let answer = admit(TOKEN, "ada");
    assert_eq!(answer["decision"], "admitted", "{answer}");
    let id = answer["lease"]["id"]
        .as_str()
        .expect("a lease id")
        .to_owned();
    let log_path = dir
        .path()
        .join("data/drivers/box")
        .join(format!("{id}.log"));
    let log = eventually("the lease's output", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if log.contains("uid=") && log.contains("shadow") {
            Ok(log)
        } else {
            Err(log)
        }
    });
    let uid = account.uid();
    assert!(
        log.starts_with(&format!("uid={uid}({})", account.name)),
        "{log}"
    );
    assert!(!log.contains("uid=0"), "{log}");
    assert!(!log.contains("root:"), "the shadow file was read: {log}");
    assert!(log.contains("Permission denied"), "{log}");

    for (user, code) in [
        ("bob", "account_unmapped"),
        ("rooted", "account_privileged"),
    ] {
        let answer = admit(ADMIN, user);
        assert_eq!(answer["decision"], "denied", "{answer}");
        let codes: Vec<&str> = answer["reasons"]
            .as_array()
            .expect("reasons")
            .iter()
            .map(|r| r["code"].as_str().unwrap())
            .collect();
        assert_eq!(codes, [code], "{answer}");
    }
    let (status, log) = enforcer.terminate(Duration::from_secs(20));
    assert!(status.success(), "{}", log.join("\n"));
}

/// The pid the local driver recorded for a lease's process.
fn local_pid(dir: &Path, id: &str) -> i32 {
    let path = dir.join("data/drivers/box").join(format!("{id}.json"));
    let record: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    record["process"]["pid"].as_i64().expect("a pid") as i32
}

fn alive(pid: i32) -> bool {
    // A zombie (exited, not yet reaped by whoever inherited it) is not alive.
    support::process_state(pid as u32).is_some_and(|state| state != 'Z')
}

/// Waits (up to 10 s) until `pid` is alive no more.
fn gone(pid: i32, what: &str) {
    eventually(what, Duration::from_secs(10), || {
        if alive(pid) {
            Err(format!("{pid} is alive"))
        } else {
            Ok(())
        }
    });
}

fn kill(pid: i32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn restart_scenario(kill_the_local_process: bool, kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    // First run: Kafka is unreachable, so every event waits in the outbox.
    let config = write_config(dir.path(), &format!("127.0.0.1:{}", closed_port()));
    let (enforcer, api) = start_enforcer(&config);
    let sim = request_ok(&api, &["--gpus", "3", "--workload", "training"]);
    let local = request_ok(
        &api,
        &[
            "--gpus",
            "1",
            "--workload",
            "batch",
            "--substrate",
            "box",
            "--wait",
            "--",
            "sleep",
            "300",
        ],
    );
    let pid = local_pid(dir.path(), &local);
    assert!(alive(pid), "the local lease's process runs");
    kill(enforcer.pid() as i32, "-KILL");
    drop(enforcer);
    assert!(
        alive(pid),
        "the local lease's process outlives the enforcer"
    );
    if kill_the_local_process {
        kill(pid, "-KILL");
        gone(pid, "sleep dies of SIGKILL");
    }

    // Second run, same data dir, Kafka now there.
    let broker = Broker::of(kind, dir.path());
    let config = write_config(dir.path(), &broker.bootstrap);
    let (enforcer, api) = start_enforcer(&config);
    let readopted: Value = enforcer
        .log
        .iter()
        .find(|l| l.contains("re-adopted open leases"))
        .map(|l| serde_json::from_str(l).unwrap())
        .expect("a re-adoption report before the API serves");
    let failed = usize::from(kill_the_local_process);
    assert_eq!(readopted["running"], 2 - failed);
    assert_eq!(readopted["failed"], failed);

    assert_eq!(lease_state(&api, &sim), "active");
    let events = if kill_the_local_process {
        assert_eq!(lease_state(&api, &local), "failed");
        let events = lease_events(&broker.bootstrap, |e| {
            has(e, &sim, "granted") && has(e, &local, "granted") && has(e, &local, "released")
        });
        let released = events
            .iter()
            .find(|e| e["lease_id"] == local.as_str() && e["event"] == "released")
            .unwrap();
        assert_eq!(released["reason"], "failed");
        // The failed lease's GPU is free again: 3 held of 4.
        let again = cli(
            &api,
            &[
                "request",
                "--team",
                "ml",
                "--gpus",
                "1",
                "--workload",
                "training",
                "--dry-run",
            ],
        );
        assert_eq!(again.status.code(), Some(0), "{}", show(&again));
        events
    } else {
        assert_eq!(lease_state(&api, &local), "active");
        assert!(alive(pid), "the re-adopted process still runs");
        // 3 + 1 of 4 GPUs are held: the quota survived the restart.
        let denied = cli(
            &api,
            &[
                "request",
                "--team",
                "ml",
                "--gpus",
                "1",
                "--workload",
                "training",
            ],
        );
        assert_eq!(denied.status.code(), Some(3), "{}", show(&denied));
        assert!(
            stdout(&denied).contains("quota_exceeded"),
            "{}",
            show(&denied)
        );
        let events = lease_events(&broker.bootstrap, |e| {
            has(e, &sim, "granted") && has(e, &local, "granted")
        });
        // The re-adopted lease is released by pid, through the driver that did not start it.
        let released = cli(&api, &["release", &local]);
        assert_eq!(released.status.code(), Some(0), "{}", show(&released));
        gone(pid, "release stops the process");
        events
    };
    // Each event written while Kafka was away arrives, once.
    let granted = events
        .iter()
        .filter(|e| e["event"] == "granted" && (e["lease_id"] == sim.as_str()))
        .count();
    assert_eq!(granted, 1, "{events:#?}");
    if alive(pid) {
        kill(pid, "-KILL");
    }
}

support::on_both_brokers!(
    a_restarted_enforcer_keeps_leases_and_quota_readopts_the_local_process_and_publishes_its_outbox,
    restart_keeping_the_process
);
fn restart_keeping_the_process(kind: BrokerKind) {
    restart_scenario(false, kind);
}

support::on_both_brokers!(
    a_restarted_enforcer_marks_a_lease_whose_process_died_failed,
    restart_after_the_process_died
);
fn restart_after_the_process_died(kind: BrokerKind) {
    restart_scenario(true, kind);
}

/// Writes one message to gpuwarden.signals with a Kafka client of the test's own (as an
/// intruder would), keyed `key`, with `header` when given.
fn write_signal(bootstrap: &str, key: &str, payload: &str, header: Option<&str>) {
    let headers: Vec<(&str, &str)> = header.map(|h| (signing::HEADER, h)).into_iter().collect();
    support::kafka::produce(bootstrap, "gpuwarden.signals", key, payload, &headers);
}

/// The signature the pipeline would put on `payload` with `key`.
fn signature(key: &str, payload: &str) -> String {
    SigningKeys::new(Some(key.as_bytes()), None)
        .sign("gpuwarden.signals", b"ml", payload.as_bytes())
        .unwrap()
}

support::on_both_brokers!(
    forged_signals_block_nobody_and_raise_an_alert_and_the_previous_key_is_accepted,
    forged_signals
);
/// A forged `team_spend` written by a Kafka client of the test's own, unsigned or signed with a
/// wrong key, blocks nobody: it is refused, counted, and alerted on. One signed with the
/// previous key while keys rotate is acted on: ml's spend counts at admission and its request
/// is denied `budget_exceeded`.
fn forged_signals(kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(kind, dir.path());
    let webhook = Webhook::start();
    let config = config(dir.path(), &broker.bootstrap)
        .raw(&format!(
            "[enforcer]\nalert_webhooks = [\"{}\"]\n",
            webhook.url
        ))
        .write(dir.path().join("gpuwarden.toml"));
    let (enforcer, api) = start_enforcer(&config);
    let address = api.trim_start_matches("http://").to_owned();
    let request = || {
        cli(
            &api,
            &[
                "request",
                "--team",
                "ml",
                "--gpus",
                "1",
                "--workload",
                "training",
                "--duration",
                "1h",
                "--dry-run",
            ],
        )
    };
    let before = request();
    assert_eq!(before.status.code(), Some(0), "{}", show(&before));

    // ml has spent all but $1 of its $100,000; an hour of one GPU costs $2.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let spend = serde_json::json!({"v": 1, "ts_ms": now_ms, "window_ms": 900_000,
        "kind": "team_spend", "team": "ml", "month_to_date_usd": 99_999.0,
        "burn_usd_per_hour": 10.0})
    .to_string();
    let signals = |signature: &str| {
        support::metric(
            &address,
            &format!("gpuwarden_enforcer_signals_total{{signature=\"{signature}\"}}"),
        )
        .unwrap_or(-1.0)
    };

    // The forgeries: unsigned, and signed with a key that is not the enforcer's.
    write_signal(&broker.bootstrap, "ml", &spend, None);
    let wrong = signature("a-key-the-intruder-made-up-0123456789abcdef", &spend);
    write_signal(&broker.bootstrap, "ml", &spend, Some(&wrong));
    eventually(
        "both forgeries are refused",
        Duration::from_secs(60),
        || {
            let (unsigned, invalid) = (signals("unsigned"), signals("invalid"));
            if unsigned == 1.0 && invalid == 1.0 {
                Ok(())
            } else {
                Err(format!("unsigned {unsigned}, invalid {invalid}"))
            }
        },
    );
    let alert = eventually(
        "an alert on the refused signal",
        Duration::from_secs(30),
        || {
            let alerts = webhook.alerts("signal_refused");
            alerts.first().cloned().ok_or(alerts.len())
        },
    );
    let text = alert["text"].as_str().unwrap();
    assert!(
        text.contains("unsigned") || text.contains("badly signed"),
        "{text}"
    );
    let still = request();
    assert_eq!(
        still.status.code(),
        Some(0),
        "a forged team_spend changed admission: {}",
        show(&still)
    );
    assert_eq!(signals("current") + signals("previous"), 0.0);

    // A signed signal whose payload is not a signal is skipped, not fatal; then the spend,
    // signed with the previous key during a rotation, is acted on.
    let garbage = "not json";
    write_signal(
        &broker.bootstrap,
        "ml",
        garbage,
        Some(&signature(SIGNING_KEY, garbage)),
    );
    write_signal(
        &broker.bootstrap,
        "ml",
        &spend,
        Some(&signature(PREVIOUS_SIGNING_KEY, &spend)),
    );
    let after = eventually(
        "the spend signed with the previous key reaches admission",
        Duration::from_secs(60),
        || {
            let after = request();
            if after.status.code() == Some(3) {
                Ok(after)
            } else {
                Err(show(&after))
            }
        },
    );
    assert!(
        stdout(&after).contains("budget_exceeded"),
        "{}",
        show(&after)
    );
    assert_eq!(signals("previous"), 1.0);
    assert_eq!(signals("current"), 1.0, "the signed garbage was read");
    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    assert!(
        log.iter()
            .any(|l| l.contains("refusing a signal") && l.contains("unsigned")),
        "{}",
        log.join("\n")
    );
}

/// `gpuwarden enforce` alone, with `brokers = "embedded"`: the broker it starts lives as long as
/// the enforcer, so a lease's records reach it, and a shutdown flushes the outbox.
#[test]
fn an_enforcer_with_its_embedded_broker_publishes_and_flushes_its_outbox() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "embedded");
    let (enforcer, api) = start_enforcer(&config);
    let id = request_ok(&api, &["--gpus", "1", "--workload", "training"]);
    let out = cli(&api, &["release", &id]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));

    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}:\n{}", log.join("\n"));
    log_line(&log, "outbox flushed");
    let refused: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("Connection refused"))
        .collect();
    assert!(
        refused.is_empty(),
        "the embedded broker went away while the enforcer ran:\n{}",
        log.join("\n")
    );
}
