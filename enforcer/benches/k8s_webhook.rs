//! Load generator for the Kubernetes admission webhook: what gpuwarden's answer to an
//! `AdmissionReview` costs over the TLS and JSON that any webhook pays.
//!
//! Three sides, each served by processes of their own with two runtime threads each (as
//! `gpuwarden enforce` runs), driven in turns by the same client over 127.0.0.1:
//! - the webhook: `gpuwarden_enforcer::kubernetes::router` over a SQLite lease store in a temp
//!   dir, served as `gpuwarden enforce` serves it (the same certificate loader, `ServerTls`;
//!   rustls with ring, hyper's HTTP/1, axum, mimalloc), with a `kubernetes` substrate whose API
//!   server is a small HTTP server in this process serving `nodes` (128 nodes of 8 H100s), as
//!   tests/kubernetes.rs does. Every review is a real decision, and an admitted pod a lease
//!   written to the store (a named lease waits for its commit) and to the driver's record of the
//!   pod. This binary runs it again as a child (`--serve enforcer`); with `--gpuwarden PATH` it
//!   starts `PATH enforce` instead, the release binary (which also runs the rules loop and the
//!   outbox publisher, here without a Kafka to reach);
//! - the webhook as a highly available installation runs it: two replicas of the above (two
//!   children, or two `PATH enforce`), each with a data dir of its own and the same
//!   `[enforcer.store] url`, one lease store in a real PostgreSQL server that the bench starts in
//!   a temp dir (Debian's `postgresql`, as the tests do: `synchronous_commit = on`, `fsync = on`),
//!   the client's connections spread over both (connection c to replica c % 2). Its latency at
//!   the fixed rate is compared with the SQLite webhook's in the same run (target: p99 within
//!   1.5×); `--no-postgres` leaves this side out;
//! - the peer: this binary run again with `--serve peer`, answering a fixed allowing
//!   `AdmissionReview` (the review parsed as JSON, its uid copied) on the same stack.
//!
//! The client keeps a pool of keep-alive HTTPS connections (the API server keeps its
//! connections to a webhook open) and sends each review once, every one a distinct GPU pod with
//! its own uid, prepared before the clock starts. Closed loop: as fast as answers come, in
//! rounds, the sides taking turns (the ratio is the median of the rounds'). Open loop: at a fixed
//! rate, latency counted from when the review was due, so a stall is not hidden by reviews that
//! were never sent. Each side's CPU time per review is read from /proc, summed over its server
//! processes (both replicas); the PostgreSQL server's own (postmaster and backends) is shown
//! apart, since the SQLite side has no such process.
//!
//! Mixes: `admit` (a team with a huge quota and budget: every review admitted) and `half`
//! (every second review from a namespace whose team's $1 budget denies it).
//!
//! `bench/k8s-webhook.sh` runs it in release mode. Arguments: `--rounds K`, `--requests N`
//! (closed loop, per side and round), `--rate R` and `--seconds S` (open loop), `--connections
//! C`, `--mix admit|half`, `--gpuwarden PATH`, `--no-postgres`.

#[path = "../../tests/support/postgres.rs"]
#[allow(dead_code, unreachable_pub)]
mod pg;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpuwarden_enforcer::drivers::{self, Driver, DriverContext};
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::config::StoreLocation;
use gpuwarden_schema::SystemClock;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1;
use hyper::{header, Request};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

#[path = "../../tests/support/pki.rs"]
mod pki;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Options {
    gpuwarden: Option<PathBuf>,
    rounds: usize,
    requests: usize,
    rate: u64,
    seconds: u64,
    connections: usize,
    mix: String,
    /// Runs the third side: two replicas on one PostgreSQL store.
    postgres: bool,
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        gpuwarden: None,
        rounds: 3,
        requests: 5_000,
        rate: 1_000,
        seconds: 10,
        connections: 16,
        mix: "admit".into(),
        postgres: true,
    };
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number = |name: &str| {
        value(name).map(|v| {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
    };
    o.gpuwarden = value("--gpuwarden").map(PathBuf::from);
    if let Some(v) = number("--rounds") {
        o.rounds = (v as usize).max(1);
    }
    if let Some(v) = number("--requests") {
        o.requests = v as usize;
    }
    if let Some(v) = number("--rate") {
        o.rate = v.max(1);
    }
    if let Some(v) = number("--seconds") {
        o.seconds = v;
    }
    if let Some(v) = number("--connections") {
        o.connections = (v as usize).max(1);
    }
    if let Some(v) = value("--mix") {
        assert!(v == "admit" || v == "half", "--mix takes admit or half");
        o.mix = v;
    }
    o.postgres = !args.iter().any(|a| a == "--no-postgres");
    o
}

// ---- the servers -----------------------------------------------------------------------------

/// The peer's answer: a fixed allow with the review's uid.
async fn allow(body: Bytes) -> axum::response::Response {
    use axum::response::IntoResponse;
    let review: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return (axum::http::StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let answer = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": review["request"]["uid"], "allowed": true}
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_vec(&answer).unwrap(),
    )
        .into_response()
}

/// The webhook of the substrate `k8s` of the config at `path`, over the lease store its
/// `[enforcer.store]` names (a fresh SQLite file by default), as `gpuwarden enforce` builds it.
async fn enforcer_router(path: &Path) -> axum::Router {
    let config = Arc::new(gpuwarden_schema::config::load(path).unwrap());
    let location = config.enforcer_store();
    if let StoreLocation::Sqlite(database) = &location {
        std::fs::create_dir_all(database.parent().unwrap()).unwrap();
    }
    // Off the runtime's threads, as `gpuwarden enforce` opens it: the PostgreSQL store connects
    // with the blocking `postgres` client, whose own runtime cannot start inside this one.
    let store = tokio::task::spawn_blocking(move || Store::open_at(&location))
        .await
        .unwrap()
        .unwrap();
    let mut built: std::collections::BTreeMap<String, Arc<dyn Driver>> = Default::default();
    for s in &config.substrates {
        let context = DriverContext {
            state_dir: config.storage.data_dir.join("drivers").join(&s.name),
            lease_refs: Some(gpuwarden_enforcer::service::lease_refs(store.clone())),
        };
        built.insert(
            s.name.clone(),
            Arc::from(drivers::build(s, &context).unwrap()),
        );
    }
    let service = Service::new(config, store, built, Arc::new(SystemClock));
    gpuwarden_enforcer::kubernetes::router(service, "k8s".into())
}

/// `--serve peer|enforcer CERT KEY [CONFIG]`: serves over TLS on 127.0.0.1 as `gpuwarden
/// enforce` serves its webhook, on two runtime threads; prints its address.
fn serve(args: &[String]) {
    let (kind, cert, key) = (&args[0], PathBuf::from(&args[1]), PathBuf::from(&args[2]));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let tls = gpuwarden_schema::tls::ServerTls::load(
            &gpuwarden_schema::config::TlsConfig {
                cert,
                key,
                client_ca: None,
                client_auth: None,
            },
            "bench",
            "bench",
            &[b"http/1.1"],
        )
        .unwrap();
        let acceptor = TlsAcceptor::from(tls.config());
        let app = match kind.as_str() {
            "peer" => axum::Router::new().route("/validate", axum::routing::post(allow)),
            "enforcer" => enforcer_router(Path::new(&args[3])).await,
            other => panic!("--serve {other}?"),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("listening {}", listener.local_addr().unwrap());
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(socket).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        tower::ServiceExt::oneshot(app.clone(), request)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}

// ---- the cluster's API: nodes ----------------------------------------------------------------

fn nodes() -> Value {
    let items: Vec<Value> = (0..128)
        .map(|i| {
            json!({
                "metadata": {"name": format!("h100-{i}"), "uid": format!("uid-h100-{i}"), "resourceVersion": "7",
                    "labels": {"kubernetes.io/hostname": format!("h100-{i}"), "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                "spec": {},
                "status": {"allocatable": {"cpu": "95500m", "memory": "1048Gi", "nvidia.com/gpu": "8", "pods": "110"}}
            })
        })
        .collect();
    json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "7"}, "items": items})
}

async fn fake_api_server() -> String {
    let app = axum::Router::new().route(
        "/api/v1/nodes",
        axum::routing::get(|| async { axum::Json(nodes()) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// The config (and kubeconfig) of one webhook in `dir`, its data in `dir/data`; its lease store
/// at the PostgreSQL URL `store` if given, else SQLite in the data dir.
fn write_config(dir: &Path, api: &str, cert: &Path, key: &Path, store: Option<&str>) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let store = store
        .map(|url| format!("\n[enforcer.store]\nurl = \"{url}\"\n"))
        .unwrap_or_default();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: bench\n  cluster:\n    server: {api}\n\
             users:\n- name: gpuwarden\n  user:\n    token: bench-token\n\
             contexts:\n- name: bench\n  context:\n    cluster: bench\n    user: gpuwarden\n\
             current-context: bench\n"
        ),
    )
    .unwrap();
    let path = dir.join("gpuwarden.toml");
    std::fs::write(
        &path,
        format!(
            r#"[storage]
data_dir = "{data}"

[enforcer]
listen = "127.0.0.1:0"
{store}
[pricing]
default_usd_per_gpu_hour = 2.0

[[teams]]
name = "ml"
members = ["ada"]
gpu_quota = 100000000
monthly_budget_usd = 1e15

[[teams]]
name = "lean"
members = ["ada"]
gpu_quota = 100000000
monthly_budget_usd = 1.0

[workloads.inference]
max_gpus = 8
max_duration = "24h"

[[substrates]]
name = "k8s"
driver = "kubernetes"

[substrates.kubernetes]
kubeconfig = "{kubeconfig}"
webhook_listen = "127.0.0.1:0"
webhook_tls = {{ cert = "{cert}", key = "{key}" }}
teams = {{ "ml-serving" = "ml", "lean-serving" = "lean" }}
users = {{ "oidc:ada@example.com" = "ada" }}
"#,
            data = dir.join("data").display(),
            kubeconfig = kubeconfig.display(),
            cert = cert.display(),
            key = key.display(),
        ),
    )
    .unwrap();
    path
}

/// A GPU pod being created, as the API server sends it: one GPU, its own name and uid.
fn review(n: usize, deny: bool) -> (String, Bytes) {
    let pod_uid = uuid::Uuid::new_v4().to_string();
    let review_uid = uuid::Uuid::new_v4().to_string();
    let namespace = if deny { "lean-serving" } else { "ml-serving" };
    let name = format!("serve-{n}-{}", &pod_uid[..8]);
    let body = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": review_uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": name,
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "oidc:ada@example.com", "uid": "u-1", "groups": ["system:authenticated"]},
            "object": {
                "kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": name, "namespace": namespace, "uid": pod_uid,
                    "creationTimestamp": "2026-12-05T06:00:00Z", "labels": {"app": "serve"},
                    "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                        "apiVersion": "v1", "time": "2026-12-05T06:00:00Z", "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:spec": {"f:containers": {}}}}]},
                "spec": {
                    "containers": [{"name": "server", "image": "vllm/vllm-openai:v0.9.0",
                        "resources": {"limits": {"memory": "32Gi", "nvidia.com/gpu": "1"},
                                      "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"}},
                        "terminationMessagePath": "/dev/termination-log",
                        "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}],
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
                    "serviceAccountName": "default", "securityContext": {}, "schedulerName": "default-scheduler",
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"
                },
                "status": {"phase": "Pending", "qosClass": "Burstable"}
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    });
    (review_uid, Bytes::from(serde_json::to_vec(&body).unwrap()))
}

/// Reviews `from..from + n`, with whether each should be admitted (by the enforcer; the peer
/// admits all).
fn reviews(from: usize, n: usize, half: bool) -> Vec<(String, Bytes, bool)> {
    (from..from + n)
        .map(|i| {
            let deny = half && i % 2 == 1;
            let (uid, body) = review(i, deny);
            (uid, body, !deny)
        })
        .collect()
}

// ---- the client ----------------------------------------------------------------------------

type Sender = http1::SendRequest<Full<Bytes>>;

async fn connect(address: SocketAddr, tls: TlsConnector) -> Sender {
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let stream = tls
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(connection);
    sender
}

/// Sends one review; checks the answer's uid and, for the enforcer, its decision.
async fn send(sender: &mut Sender, review: &(String, Bytes, bool), check_decision: bool) {
    sender.ready().await.unwrap();
    let request = Request::post("/validate")
        .header(header::HOST, "localhost")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(review.1.clone()))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(
        status.is_success(),
        "{status}: {}",
        String::from_utf8_lossy(&body)
    );
    #[derive(serde::Deserialize)]
    struct Answer<'a> {
        #[serde(borrow)]
        response: AnswerResponse<'a>,
    }
    #[derive(serde::Deserialize)]
    struct AnswerResponse<'a> {
        uid: &'a str,
        allowed: bool,
    }
    let answer: Answer<'_> = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
    assert_eq!(answer.response.uid, review.0);
    if check_decision {
        assert_eq!(
            answer.response.allowed,
            review.2,
            "{}",
            String::from_utf8_lossy(&body)
        );
    }
}

fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// The PostgreSQL server of the data dir `data`: its postmaster (from `postmaster.pid`) and the
/// postmaster's children (the backends of the store's sessions, the background workers).
fn postgres_processes(data: &Path) -> Vec<u32> {
    let Some(postmaster) = std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()
        .and_then(|f| f.lines().next()?.trim().parse::<u32>().ok())
    else {
        return Vec::new();
    };
    let parent = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (_, rest) = stat.rsplit_once(')')?;
        rest.split_whitespace().nth(1)?.parse::<u32>().ok()
    };
    let mut pids = vec![postmaster];
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if parent(pid) == Some(postmaster) {
            pids.push(pid);
        }
    }
    pids
}

struct Side {
    name: &'static str,
    /// The server processes' addresses; connection c goes to `addresses[c % len]`.
    addresses: Vec<SocketAddr>,
    /// The server processes, whose CPU time is summed.
    pids: Vec<u32>,
    /// The data dir of the PostgreSQL server holding the side's store, whose CPU time is
    /// counted apart.
    postgres: Option<PathBuf>,
    check_decision: bool,
}

/// CPU time so far of a side's servers, and of each process of its PostgreSQL server.
struct CpuReading {
    servers: Duration,
    store: Vec<(u32, Duration)>,
}

impl Side {
    fn cpu(&self) -> CpuReading {
        CpuReading {
            servers: self.pids.iter().map(|&pid| cpu_time(pid)).sum(),
            store: self
                .postgres
                .as_deref()
                .map(postgres_processes)
                .unwrap_or_default()
                .into_iter()
                .map(|pid| (pid, cpu_time(pid)))
                .collect(),
        }
    }

    /// CPU time per review since `before`, of the servers and of the PostgreSQL server (the
    /// processes that were there at `before`; a session's backend lives as long as the session).
    fn cpu_per_review(&self, before: &CpuReading, n: usize) -> (Duration, Duration) {
        let n = n.max(1) as u32;
        let servers = self
            .pids
            .iter()
            .map(|&pid| cpu_time(pid))
            .sum::<Duration>()
            .saturating_sub(before.servers);
        let store: Duration = before
            .store
            .iter()
            .map(|&(pid, was)| cpu_time(pid).saturating_sub(was))
            .sum();
        (servers / n, store / n)
    }

    async fn connect(&self, c: usize, tls: &TlsConnector) -> Sender {
        connect(self.addresses[c % self.addresses.len()], tls.clone()).await
    }
}

/// What a loop measured of one side.
struct Measured {
    /// CPU time per review of the side's servers, summed.
    cpu: Duration,
    /// Of its PostgreSQL server, if it has one.
    store_cpu: Duration,
}

impl Measured {
    fn describe(&self, side: &Side) -> String {
        match side.postgres {
            Some(_) => format!(
                "{:.0} µs CPU each, + {:.0} µs in PostgreSQL",
                self.cpu.as_secs_f64() * 1e6,
                self.store_cpu.as_secs_f64() * 1e6
            ),
            None => format!("{:.0} µs CPU each", self.cpu.as_secs_f64() * 1e6),
        }
    }
}

/// Closed loop: the reviews spread over the connections, as fast as answers come. Reviews per
/// second and the side's CPU time per review.
async fn closed_loop(
    side: &Side,
    tls: &TlsConnector,
    work: Vec<(String, Bytes, bool)>,
    connections: usize,
) -> (f64, Measured) {
    let n = work.len();
    let work = Arc::new(work);
    let mut senders = Vec::new();
    for c in 0..connections {
        senders.push(side.connect(c, tls).await);
    }
    let cpu = side.cpu();
    let start = Instant::now();
    let tasks: Vec<_> = senders
        .into_iter()
        .enumerate()
        .map(|(c, mut sender)| {
            let (work, check) = (work.clone(), side.check_decision);
            tokio::spawn(async move {
                for i in (c..work.len()).step_by(connections) {
                    send(&mut sender, &work[i], check).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let (cpu, store_cpu) = side.cpu_per_review(&cpu, n);
    (rate, Measured { cpu, store_cpu })
}

/// Open loop at `rate` reviews/s: latencies from when each was due, sorted. A pacing thread
/// hands the due times to the connections in turn (the OS timer, not tokio's 1 ms one).
async fn open_loop(
    side: &Side,
    tls: &TlsConnector,
    work: Vec<(String, Bytes, bool)>,
    rate: u64,
    connections: usize,
) -> (Vec<Duration>, Measured) {
    let total = work.len();
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let mut queues = Vec::with_capacity(connections);
    let mut tasks = Vec::with_capacity(connections);
    for c in 0..connections {
        let mut sender = side.connect(c, tls).await;
        let (due_times, mut due) =
            tokio::sync::mpsc::unbounded_channel::<(Instant, (String, Bytes, bool))>();
        queues.push(due_times);
        let check = side.check_decision;
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while let Some((due, review)) = due.recv().await {
                send(&mut sender, &review, check).await;
                latencies.push(due.elapsed());
            }
            latencies
        }));
    }
    let cpu = side.cpu();
    let start = Instant::now() + Duration::from_millis(100);
    let pacer = std::thread::spawn(move || {
        for (i, review) in work.into_iter().enumerate() {
            let due = start + interval * i as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            queues[i % queues.len()].send((due, review)).unwrap();
        }
    });
    let mut all = Vec::with_capacity(total);
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    pacer.join().unwrap();
    all.sort();
    let (cpu, store_cpu) = side.cpu_per_review(&cpu, total);
    (all, Measured { cpu, store_cpu })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Kills the child when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads `child`'s stream line by line until `pick` finds something in one.
fn wait_for_line<R: std::io::Read + Send + 'static>(
    stream: R,
    mut pick: impl FnMut(&str) -> Option<String> + Send + 'static,
) -> String {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut found = false;
        for line in std::io::BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if !found {
                if let Some(v) = pick(&line) {
                    found = true;
                    let _ = tx.send(v);
                }
            }
            // Keep draining, so that the child never blocks on a full pipe.
        }
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the server started within 2 minutes")
}

/// This binary again, serving `args` (`--serve …`); its process and address.
fn start_child(args: &[&str]) -> (Process, SocketAddr) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("--serve")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let address = wait_for_line(stdout, |line| {
        line.strip_prefix("listening ").map(str::to_owned)
    });
    (Process(child), address.parse().unwrap())
}

/// `gpuwarden enforce` from the binary at `gpuwarden`; its process and webhook address.
fn start_binary(gpuwarden: &Path, config: &Path) -> (Process, SocketAddr) {
    let mut child = Command::new(gpuwarden)
        .args(["enforce", "--config", config.to_str().unwrap()])
        .env("GPUWARDEN_LOG_FORMAT", "json")
        .env("RUST_LOG", "warn,gpuwarden=info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", gpuwarden.display()));
    let stderr = child.stderr.take().unwrap();
    let url = wait_for_line(stderr, |line| {
        let v: Value = serde_json::from_str(line).ok()?;
        let message = v["fields"]["message"].as_str().or(v["message"].as_str())?;
        (message == "kubernetes admission webhook running")
            .then(|| {
                v["fields"]["url"]
                    .as_str()
                    .or(v["url"].as_str())
                    .map(str::to_owned)
            })
            .flatten()
    });
    let address = url
        .trim_start_matches("https://")
        .trim_end_matches("/validate")
        .parse()
        .unwrap();
    (Process(child), address)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo nextest run --all-targets` lists every target's tests; this one has none.
    if args.iter().any(|a| a == "--list") {
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--serve") {
        serve(&args[i + 1..]);
        return;
    }
    let o = options(&args);
    // Before the runtime: the server's start and the new database use the blocking client, which
    // runs a runtime of its own. The server stops when this process ends.
    let postgres = o.postgres.then(pg::Postgres::private);
    let database = postgres.as_ref().map(pg::Postgres::database);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let dir = tempfile::tempdir().unwrap();
        let ca = pki::Ca::new(dir.path(), "webhook-ca");
        let leaf = ca.server("webhook");
        let api = fake_api_server().await;
        let start = |config: &Path| match &o.gpuwarden {
            Some(gpuwarden) => start_binary(gpuwarden, config),
            None => start_child(&[
                "enforcer",
                leaf.cert.to_str().unwrap(),
                leaf.key.to_str().unwrap(),
                config.to_str().unwrap(),
            ]),
        };
        let config = write_config(dir.path(), &api, &leaf.cert, &leaf.key, None);
        let (enforcer, enforcer_address) = start(&config);
        // The replicas: a data dir each, one store.
        let replicas: Vec<(Process, SocketAddr)> = match &database {
            Some(url) => (0..2)
                .map(|r| {
                    let replica = dir.path().join(format!("replica-{r}"));
                    start(&write_config(&replica, &api, &leaf.cert, &leaf.key, Some(url)))
                })
                .collect(),
            None => Vec::new(),
        };
        let (peer, peer_address) = start_child(&[
            "peer",
            leaf.cert.to_str().unwrap(),
            leaf.key.to_str().unwrap(),
        ]);
        let tls = TlsConnector::from(Arc::new(
            gpuwarden_schema::tls::client_config(&ca.cert, None, ("ca", "cert", "key")).unwrap(),
        ));
        let mut sides = vec![
            Side {
                name: "peer (fixed allow)",
                addresses: vec![peer_address],
                pids: vec![peer.0.id()],
                postgres: None,
                check_decision: false,
            },
            Side {
                name: "gpuwarden on SQLite",
                addresses: vec![enforcer_address],
                pids: vec![enforcer.0.id()],
                postgres: None,
                check_decision: true,
            },
        ];
        if let Some(server) = &postgres {
            sides.push(Side {
                name: "2 replicas on PostgreSQL",
                addresses: replicas.iter().map(|(_, a)| *a).collect(),
                pids: replicas.iter().map(|(p, _)| p.0.id()).collect(),
                postgres: Some(server.data.clone()),
                check_decision: true,
            });
        }
        let half = o.mix == "half";
        println!(
            "k8s webhook benchmark: mix {} ({}), {} keep-alive HTTPS connections; sides: {}; {} rounds of {} reviews per side, closed loop; {} reviews/s for {} s, open loop; load {}",
            o.mix,
            if half { "every second review denied by budget" } else { "every review admitted" },
            o.connections,
            sides.iter().map(|s| s.name).collect::<Vec<_>>().join(", "),
            o.rounds, o.requests, o.rate, o.seconds, loadavg()
        );
        // Warm up: connections, the driver's first read of the nodes, the caches.
        let mut next = 0;
        for side in &sides {
            closed_loop(side, &tls, reviews(next, 200, half), o.connections).await;
            next += 200;
        }
        // gpuwarden on SQLite / peer, and PostgreSQL / SQLite: throughput, CPU per review.
        let (mut ratios, mut cpu_ratios) = (Vec::new(), Vec::new());
        let (mut pg_ratios, mut pg_cpu_ratios) = (Vec::new(), Vec::new());
        let cpu_ratio = |a: &Measured, b: &Measured| {
            a.cpu.as_secs_f64() / b.cpu.as_secs_f64().max(1e-9)
        };
        for round in 1..=o.rounds {
            let mut line = format!("round {round}:");
            let mut results = Vec::new();
            for side in &sides {
                let work = reviews(next, o.requests, half);
                next += o.requests;
                let (rate, measured) = closed_loop(side, &tls, work, o.connections).await;
                line += &format!(
                    "  {} {rate:>6.0} reviews/s ({})",
                    side.name,
                    measured.describe(side)
                );
                results.push((rate, measured));
            }
            let ratio = results[1].0 / results[0].0;
            ratios.push(ratio);
            cpu_ratios.push(cpu_ratio(&results[1].1, &results[0].1));
            line += &format!("  ratio SQLite / peer {ratio:.2}");
            if let Some((rate, measured)) = results.get(2) {
                let ratio = rate / results[1].0;
                pg_ratios.push(ratio);
                pg_cpu_ratios.push(cpu_ratio(measured, &results[1].1));
                line += &format!(", PostgreSQL / SQLite {ratio:.2}");
            }
            println!("{line}");
        }
        println!(
            "closed loop, median of {} rounds: gpuwarden on SQLite / peer: throughput {:.2}, CPU per review {:.1}x{}; load {}",
            o.rounds,
            median(&mut ratios),
            median(&mut cpu_ratios),
            if pg_ratios.is_empty() {
                String::new()
            } else {
                format!(
                    "; 2 replicas on PostgreSQL / SQLite: throughput {:.2}, CPU per review (replicas only) {:.1}x",
                    median(&mut pg_ratios),
                    median(&mut pg_cpu_ratios)
                )
            },
            loadavg()
        );
        if o.seconds > 0 {
            let mut p99s = Vec::new();
            for side in &sides {
                let work = reviews(next, (o.rate * o.seconds) as usize, half);
                next += work.len();
                let (latencies, measured) =
                    open_loop(side, &tls, work, o.rate, o.connections).await;
                let p99 = percentile(&latencies, 0.99);
                p99s.push(p99);
                println!(
                    "at {} reviews/s  {}: p50 {:.2} ms  p99 {:.2} ms  p99.9 {:.2} ms  max {:.2} ms  ({} reviews, {}){}; load {}",
                    o.rate,
                    side.name,
                    ms(percentile(&latencies, 0.50)),
                    ms(p99),
                    ms(percentile(&latencies, 0.999)),
                    ms(latencies.last().copied().unwrap_or_default()),
                    latencies.len(),
                    measured.describe(side),
                    if side.check_decision {
                        format!(
                            "  (target p99 < 5 ms: {})",
                            if p99 < Duration::from_millis(5) { "met" } else { "missed" }
                        )
                    } else {
                        String::new()
                    },
                    loadavg()
                );
            }
            println!(
                "p99 gpuwarden on SQLite / peer at {} reviews/s: {:.2}",
                o.rate,
                p99s[1].as_secs_f64() / p99s[0].as_secs_f64().max(1e-9)
            );
            if let Some(postgres) = p99s.get(2) {
                let ratio = postgres.as_secs_f64() / p99s[1].as_secs_f64().max(1e-9);
                println!(
                    "p99 at {} reviews/s, 2 replicas on PostgreSQL / SQLite: {ratio:.2} (target <= 1.5: {})",
                    o.rate,
                    if ratio <= 1.5 { "met" } else { "missed" }
                );
            }
        }
        drop(peer);
        drop(replicas);
        drop(enforcer);
    });
}
