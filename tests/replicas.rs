//! Several `gpuwarden enforce` replicas on one PostgreSQL lease store (a real server that
//! tests/support/postgres.rs starts), as a highly available installation runs them: every
//! replica admits; one leads (re-adoption, expiry, publishing). Their substrate is a `webhook`
//! provisioner served by the test itself, so that every replica sees the same substrate (as a
//! real cluster is seen by each) and the test counts what each was asked.
//!
//! - The leader is SIGKILLed while a client admits at a steady rate, moving to another replica
//!   when one refuses the connection or answers 503: no admission answered "admitted" is lost,
//!   none is admitted twice, and a new leader takes over the expiries, each lease reclaimed
//!   once. The time to a new leader is printed.
//! - The leader is SIGSTOPped past its lease and SIGCONTed: the other replica has taken over
//!   and expired what came due meanwhile; the woken one changes nothing.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::pg::Postgres;
use support::{eventually, Broker, Config, Running, Substrate, Team, Workload};

const TOKEN: &str = "ada-secret-token";

/// The substrate: a provisioner every replica's webhook driver calls. It keeps each lease's
/// state and counts the calls per action and lease.
#[derive(Clone, Default)]
struct Provisioner {
    state: Arc<Mutex<ProvisionerState>>,
}

#[derive(Default)]
struct ProvisionerState {
    running: BTreeSet<String>,
    calls: BTreeMap<(String, String), usize>,
}

impl Provisioner {
    /// Serves on a free loopback port; its URL.
    fn start(&self) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/gpuwarden", listener.local_addr().unwrap());
        let me = self.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let me = me.clone();
                std::thread::spawn(move || me.answer(stream));
            }
        });
        url
    }

    fn answer(&self, mut stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut length = 0;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let call: Value = serde_json::from_slice(&body).unwrap_or_default();
        let action = call["action"].as_str().unwrap_or("").to_owned();
        let lease = call["lease"]["lease_id"].as_str().unwrap_or("").to_owned();
        let answer = {
            let mut state = self.state.lock().unwrap();
            *state
                .calls
                .entry((action.clone(), lease.clone()))
                .or_default() += 1;
            match action.as_str() {
                "provision" | "resize" => {
                    state.running.insert(lease);
                    json!({})
                }
                "reclaim" => {
                    state.running.remove(&lease);
                    json!({})
                }
                _ => {
                    json!({"state": if state.running.contains(&lease) { "running" } else { "gone" }})
                }
            }
        };
        let text = answer.to_string();
        let _ = write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        );
    }

    /// How many times lease `lease` was asked `action`.
    fn calls(&self, action: &str, lease: &str) -> usize {
        let state = self.state.lock().unwrap();
        state
            .calls
            .get(&(action.to_owned(), lease.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

/// Replica `name`'s config: its own data dir and API port, the shared store, a leader lease of
/// `lease`, one team (quota 1000) and the provisioner's 1000 GPUs.
fn write_config(
    dir: &Path,
    name: &str,
    store: &str,
    bootstrap: &str,
    provisioner: &str,
) -> PathBuf {
    Config::new()
        .broker(bootstrap)
        .data_dir(&dir.join(name))
        .team(Team::new("ml", 1000, 100000000.0).members(&["ada"]))
        .workload(
            Workload::new("training")
                .max_gpus(8)
                .max_duration("24h")
                .substrates(&["portal"]),
        )
        .enforcer()
        .store(store)
        .leader("2s", name)
        .substrate(Substrate::new("portal", "webhook").raw(&format!(
            r#"
url = "{provisioner}"
gpu_model = "NVIDIA A100-SXM4-80GB"
capacity = 1000
timeout = "2s"
retries = 1
"#
        )))
        .token("ada", TOKEN, "member", &["ml"])
        .write(dir.join(format!("{name}.toml")))
}

/// A replica: its process and its API's address (host:port).
struct Replica {
    name: String,
    process: Option<Running>,
    address: String,
}

fn start_replica(config: &Path, name: &str) -> Replica {
    let mut process = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = process.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["fields"]["api"]
        .as_str()
        .or(line["api"].as_str())
        .expect("the api field")
        .to_owned();
    Replica {
        name: name.to_owned(),
        process: Some(process),
        address: api.trim_start_matches("http://").to_owned(),
    }
}

/// One HTTP request; [`Sent`] says why there is no answer when the connection failed or broke
/// (the outcome is unknown past the connect).
fn request(
    address: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String), Sent> {
    request_keyed(address, method, path, body, None)
}

/// [`request`] with an `Idempotency-Key`.
fn request_keyed(
    address: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> Result<(u16, String), Sent> {
    let mut stream = TcpStream::connect(address).map_err(|_| Sent::NotConnected)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = body.unwrap_or_default();
    let key = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n{key}Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream
        .write_all(format!("{head}{body}").as_bytes())
        .map_err(|_| Sent::Unknown)?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|_| Sent::Unknown)?;
    match support::status_and_body(&response) {
        (0, _) => Err(Sent::Unknown),
        answer => Ok(answer),
    }
}

/// Why a request has no answer.
#[derive(Debug, PartialEq)]
enum Sent {
    /// Nothing reached a replica: safe to ask another.
    NotConnected,
    /// The request may have been decided: asked again only with an Idempotency-Key.
    Unknown,
}

/// The replica `/healthz` names as leader, asked of any that answers.
fn leader(replicas: &[Replica]) -> Option<String> {
    let named: Vec<(String, String)> = replicas
        .iter()
        .map(|r| (r.name.clone(), r.address.clone()))
        .collect();
    leader_of(&named)
}

/// [`leader`], of replicas given as (name, address).
fn leader_of(replicas: &[(String, String)]) -> Option<String> {
    replicas.iter().find_map(|(name, address)| {
        let (status, body) = request(address, "GET", "/healthz", None).ok()?;
        (status == 200 && body.contains("\nrole: leader\n")).then(|| name.clone())
    })
}

fn wait_for_leader(replicas: &[Replica], other_than: Option<&str>, within: Duration) -> String {
    eventually("a leader", within, || match leader(replicas) {
        Some(name) if Some(name.as_str()) != other_than => Ok(name),
        other => Err(format!("{other:?}")),
    })
}

/// Admits one GPU for `duration` on the first replica, from `first`, that takes the request,
/// with the Idempotency-Key `request-<label>`: moves on, and asks again, when a replica refuses
/// the connection, answers 503 (nothing was decided) or breaks the connection before answering
/// (the lease may have been admitted: the key makes the next replica answer with it). The
/// lease's id.
fn admit(replicas: &[Replica], first: usize, label: usize, duration: &str) -> String {
    admit_counting(replicas, first, label, duration, &mut 0)
}

/// [`admit`], adding the 503s it met to `unavailable`.
fn admit_counting(
    replicas: &[Replica],
    first: usize,
    label: usize,
    duration: &str,
    unavailable: &mut usize,
) -> String {
    let body = json!({
        "team": "ml", "user": "ada", "project": "p", "workload": "training", "gpus": 1,
        "duration": duration, "labels": {"request": label.to_string()},
    })
    .to_string();
    let key = format!("request-{label}");
    let deadline = Instant::now() + Duration::from_secs(30);
    for attempt in 0.. {
        assert!(
            Instant::now() < deadline,
            "no replica admitted request {label}"
        );
        let replica = &replicas[(first + attempt) % replicas.len()];
        let sent = request_keyed(
            &replica.address,
            "POST",
            "/v1/admission",
            Some(&body),
            Some(&key),
        );
        match sent {
            Ok((200, answer)) => {
                let answer: Value = serde_json::from_str(&answer).unwrap();
                assert_eq!(answer["decision"], "admitted", "{answer}");
                return answer["lease"]["id"].as_str().unwrap().to_owned();
            }
            Ok((503, answer)) => {
                assert!(answer.contains("store_unavailable"), "{answer}");
                *unavailable += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(Sent::NotConnected | Sent::Unknown) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok((status, answer)) => panic!("request {label}: {status} {answer}"),
        }
    }
    unreachable!()
}

/// Every lease row: id → (state, release_reason, request label).
fn leases(url: &str) -> BTreeMap<String, (String, Option<String>, String)> {
    Postgres::client(url)
        .query("SELECT id, state, release_reason, labels FROM leases", &[])
        .unwrap()
        .iter()
        .map(|r| {
            let labels: Value = serde_json::from_str(r.get::<_, &str>(3)).unwrap();
            (
                r.get::<_, String>(0),
                (
                    r.get::<_, String>(1),
                    r.get::<_, Option<String>>(2),
                    labels["request"].as_str().unwrap_or("").to_owned(),
                ),
            )
        })
        .collect()
}

/// How many Actions of kind `action` the outbox holds per lease.
fn actions(url: &str, action: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for row in Postgres::client(url)
        .query(
            "SELECT payload FROM outbox WHERE topic = 'gpuwarden.actions'",
            &[],
        )
        .unwrap()
    {
        let record: Value = serde_json::from_str(row.get::<_, &str>(0)).unwrap();
        if record["action"] == action {
            if let Some(lease) = record["lease_id"].as_str() {
                *out.entry(lease.to_owned()).or_default() += 1;
            }
        }
    }
    out
}

struct Installation {
    _dir: tempfile::TempDir,
    _broker: Broker,
    provisioner: Provisioner,
    url: String,
    replicas: Vec<Replica>,
}

fn install(n: usize) -> Installation {
    install_on(n, support::pg::server().database())
}

/// [`install`] on the database at `url`.
fn install_on(n: usize, url: String) -> Installation {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let provisioner = Provisioner::default();
    let hook = provisioner.start();
    let replicas = (0..n)
        .map(|i| {
            let name = format!("r{i}");
            let config = write_config(dir.path(), &name, &url, &broker.bootstrap, &hook);
            start_replica(&config, &name)
        })
        .collect();
    Installation {
        _dir: dir,
        _broker: broker,
        provisioner,
        url,
        replicas,
    }
}

#[test]
fn killing_the_leader_under_load_loses_no_admission_and_a_new_leader_takes_over_expiry() {
    let mut ha = install(3);
    let first = wait_for_leader(&ha.replicas, None, Duration::from_secs(30));
    // Admissions at a steady rate through every replica, leases of 4 s: the leader expires
    // them as they come due.
    let mut admitted: Vec<(usize, String)> = Vec::new();
    let mut killed_at = None;
    let mut failover = None;
    // The longest an admission took, retries included: the gap a client saw.
    let mut slowest = Duration::ZERO;
    let rate = Duration::from_millis(50);
    let start = Instant::now();
    for i in 0..200 {
        if i == 60 {
            let leader = ha.replicas.iter_mut().find(|r| r.name == first).unwrap();
            // SIGKILL: no goodbye, its lease runs out by itself.
            drop(leader.process.take());
            let at = Instant::now();
            killed_at = Some(at);
            eprintln!(
                "killed the leader {first} after {} admissions",
                admitted.len()
            );
            // Watches for the next leader meanwhile.
            let others: Vec<(String, String)> = ha
                .replicas
                .iter()
                .filter(|r| r.process.is_some())
                .map(|r| (r.name.clone(), r.address.clone()))
                .collect();
            failover = Some(std::thread::spawn(move || loop {
                if let Some(name) = leader_of(&others) {
                    return (name, at.elapsed());
                }
                assert!(at.elapsed() < Duration::from_secs(60), "no new leader");
                std::thread::sleep(Duration::from_millis(20));
            }));
        }
        let asked = Instant::now();
        admitted.push((i, admit(&ha.replicas, i, i, "4s")));
        slowest = slowest.max(asked.elapsed());
        let next = start + rate * (i as u32 + 1);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    assert!(killed_at.is_some());
    let survivors: Vec<Replica> = std::mem::take(&mut ha.replicas)
        .into_iter()
        .filter(|r| r.process.is_some())
        .collect();
    let (second, took) = failover.unwrap().join().unwrap();
    assert_ne!(second, first);
    eprintln!(
        "new leader {second} {took:?} after the kill (leader lease 2 s); {} admitted; \
         slowest admission, retries included: {slowest:?}",
        admitted.len()
    );

    // Every admission answered "admitted" is in the store, once.
    let rows = leases(&ha.url);
    let ids: BTreeSet<&String> = admitted.iter().map(|(_, id)| id).collect();
    assert_eq!(ids.len(), admitted.len(), "a lease id answered twice");
    for (label, id) in &admitted {
        let (_, _, stored) = rows
            .get(id)
            .unwrap_or_else(|| panic!("admitted lease {id} is not in the store"));
        assert_eq!(stored, &label.to_string());
    }
    let mut per_request: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, _, label) in rows.values() {
        *per_request.entry(label.as_str()).or_default() += 1;
    }
    assert!(
        per_request.values().all(|n| *n == 1),
        "a request admitted twice: {per_request:?}"
    );
    assert_eq!(
        rows.len(),
        admitted.len(),
        "a lease no request was answered with"
    );

    // The new leader expires every lease, each reclaimed once.
    eventually("every lease expired", Duration::from_secs(60), || {
        let open: Vec<String> = leases(&ha.url)
            .into_iter()
            .filter(|(_, (state, _, _))| state != "released" && state != "failed")
            .map(|(id, (state, _, _))| format!("{id} {state}"))
            .collect();
        if open.is_empty() {
            Ok(())
        } else {
            Err(format!("{} open: {open:?}", open.len()))
        }
    });
    let reclaims = actions(&ha.url, "reclaim");
    for (id, (state, reason, _)) in leases(&ha.url) {
        assert_eq!(
            (state.as_str(), reason.as_deref()),
            ("released", Some("expired")),
            "lease {id}"
        );
        assert_eq!(reclaims.get(&id), Some(&1), "lease {id}'s reclaim Actions");
        assert!(
            ha.provisioner.calls("reclaim", &id) >= 1,
            "lease {id} never reclaimed"
        );
    }
    ha.replicas = survivors;
}

#[test]
fn a_leader_stopped_past_its_lease_changes_nothing_when_it_wakes() {
    let ha = install(2);
    let first = wait_for_leader(&ha.replicas, None, Duration::from_secs(30));
    let (stopped, other) = if ha.replicas[0].name == first {
        (&ha.replicas[0], &ha.replicas[1])
    } else {
        (&ha.replicas[1], &ha.replicas[0])
    };
    let pid = stopped.process.as_ref().unwrap().pid();
    // A lease that comes due while the leader is stopped.
    let due = admit(std::slice::from_ref(other), 0, 1, "3s");
    let kill = |signal: &str| {
        assert!(std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap()
            .success());
    };
    kill("-STOP");
    let paused = Instant::now();
    let second = wait_for_leader(std::slice::from_ref(other), None, Duration::from_secs(30));
    eprintln!(
        "{second} leads {:?} after {first} was stopped",
        paused.elapsed()
    );
    eventually(
        "the other replica to expire the lease",
        Duration::from_secs(30),
        || match leases(&ha.url).get(&due) {
            Some((state, reason, _)) if state == "released" => Ok(reason.clone()),
            other => Err(format!("{other:?}")),
        },
    );
    // Another lease due soon after the wake, while the woken replica may still believe it
    // leads.
    let later = admit(std::slice::from_ref(other), 0, 2, "1s");
    kill("-CONT");
    eventually(
        "the woken replica to follow",
        Duration::from_secs(30),
        || match request(&stopped.address, "GET", "/healthz", None) {
            Ok((200, body))
                if body.contains("\nrole: follower\n")
                    && body.contains(&format!("\nleader: {second}\n")) =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        },
    );
    eventually(
        "the later lease to expire",
        Duration::from_secs(30),
        || match leases(&ha.url).get(&later) {
            Some((state, _, _)) if state == "released" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    // Each lease reclaimed once, by the leader of the time.
    let reclaims = actions(&ha.url, "reclaim");
    assert_eq!(reclaims.get(&due), Some(&1), "{reclaims:?}");
    assert_eq!(reclaims.get(&later), Some(&1), "{reclaims:?}");
    assert_eq!(ha.provisioner.calls("reclaim", &due), 1);
    assert_eq!(ha.provisioner.calls("reclaim", &later), 1);
}

/// One HTTP request with `headers` (name, value) and a form body; (status, headers, body).
fn form(
    address: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        head.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    stream
        .write_all(format!("{head}\r\n{body}").as_bytes())
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_owned(), body.to_owned())
}

/// What a person sees does not depend on the replica that answers: signed in on one, the
/// session works on the other (and survives the first one's death), signing out on one ends it
/// on both, and failed logins on both count together towards one lockout.
#[test]
fn sessions_and_failed_logins_are_the_same_on_every_replica() {
    let mut ha = install(2);
    let (a, b) = (
        ha.replicas[0].address.clone(),
        ha.replicas[1].address.clone(),
    );
    let (status, head, _) = form(&a, "POST", "/ui/signin", &[], &format!("token={TOKEN}"));
    assert_eq!(status, 303, "{head}");
    let cookie = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("set-cookie: ")
                .or(l.strip_prefix("Set-Cookie: "))
        })
        .and_then(|c| c.split(';').next())
        .expect("a session cookie")
        .to_owned();
    // The first replica dies: the session still works on the second.
    drop(ha.replicas[0].process.take());
    let (status, head, page) = form(&b, "GET", "/ui/leases", &[("Cookie", &cookie)], "");
    assert_eq!(status, 200, "{head}\n{page}");
    assert!(page.contains("ada"), "{page}");
    // Its CSRF token is the session's, wherever it was drawn.
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a csrf field")
        .to_owned();
    let (status, head, _) = form(
        &b,
        "POST",
        "/ui/signout",
        &[("Cookie", &cookie)],
        &format!("csrf={csrf}"),
    );
    assert_eq!(status, 303, "{head}");
    let (status, head, _) = form(&b, "GET", "/ui/leases", &[("Cookie", &cookie)], "");
    assert_eq!((status, head.contains("/ui/signin")), (303, true), "{head}");

    // Failed logins with one wrong token, half on each replica: the token is locked out on
    // both once ten have failed in all (enforcer.login_limits.max_failures).
    let restarted = start_replica(&ha._dir.path().join("r0.toml"), "r0");
    let c = restarted.address.clone();
    for i in 0..10 {
        let address = if i % 2 == 0 { &c } else { &b };
        let (status, _, _) = form(address, "POST", "/ui/signin", &[], "token=wrong-token");
        assert_eq!(status, 401, "attempt {i}");
    }
    for address in [&c, &b] {
        eventually(
            "the lockout on every replica",
            Duration::from_secs(10),
            || match form(address, "POST", "/ui/signin", &[], "token=wrong-token") {
                (429, _, _) => Ok(()),
                (status, _, _) => Err(format!("{status}")),
            },
        );
    }
}

/// PostgreSQL restarted under load: while it is down every replica answers 503
/// `store_unavailable` (the client keeps asking), nothing is admitted that is not committed, and
/// once it is back the same replica processes admit again, without a restart.
#[test]
fn postgres_restarted_under_load_is_503_then_recovered_without_restarting_a_replica() {
    let server = Postgres::private();
    let ha = install_on(2, server.database());
    let pids: Vec<u32> = ha
        .replicas
        .iter()
        .map(|r| r.process.as_ref().unwrap().pid())
        .collect();
    let mut admitted = Vec::new();
    let mut unavailable = 0;
    std::thread::scope(|scope| {
        let (stop_now, stop) = std::sync::mpsc::channel();
        let server = &server;
        // Down for 2 s under the requests, then back.
        let outage = scope.spawn(move || {
            stop.recv().unwrap();
            server.stop();
            let down = Instant::now();
            std::thread::sleep(Duration::from_secs(2));
            server.run();
            down.elapsed()
        });
        for i in 0..120 {
            if i == 40 {
                stop_now.send(()).unwrap();
            }
            let id = admit_counting(&ha.replicas, i, i, "1h", &mut unavailable);
            admitted.push((i, id));
            std::thread::sleep(Duration::from_millis(25));
        }
        eprintln!("PostgreSQL was down {:?}", outage.join().unwrap());
    });
    eprintln!(
        "{} admitted, {unavailable} answers of 503 store_unavailable",
        admitted.len()
    );
    assert!(unavailable > 0, "no request met the outage");
    let rows = leases(&ha.url);
    assert_eq!(
        rows.len(),
        admitted.len(),
        "only the admitted leases are stored"
    );
    for (label, id) in &admitted {
        assert_eq!(rows.get(id).map(|r| r.2.clone()), Some(label.to_string()));
    }
    // The same processes, still running.
    for (replica, pid) in ha.replicas.iter().zip(pids) {
        assert_eq!(replica.process.as_ref().unwrap().pid(), pid);
        assert!(
            support::process_state(pid).is_some(),
            "{} exited",
            replica.name
        );
    }
}
