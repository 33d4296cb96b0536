//! Load generator for `POST /v1/admission`: how much the enforcer's admission path costs over
//! the HTTP stack it runs on.
//!
//! In one process it serves (1) the real API (`api::router`) over a SQLite lease store in a temp
//! dir (WAL, synchronous as the store sets it) and a simulated substrate, and (2) a bare axum
//! handler that answers a fixed decision JSON: the HTTP stack's own limit. Each is driven over
//! 127.0.0.1 by keep-alive HTTP/1 connections, first as fast as they go (closed loop), then at a
//! fixed rate (open loop: latency counts from when a request was due, so a stall is not hidden
//! by requests that were never sent). Each cycle is a real admission — checked, written to the
//! store with its outbox rows, provisioned — followed by the release of the lease it created
//! (another write), so the fleet never fills; the bare handler answers both routes, so both
//! sides do two requests a cycle. Throughput is in cycles (admissions) per second; latency is
//! the admission's.
//!
//! The closed loop runs in rounds, the two sides taking turns, and the ratio reported is the
//! median of the rounds' ratios, so a slow spell of a shared machine weighs on both sides alike.
//! Each round also reports the process's CPU time per cycle (server, load generator and store
//! together), which a busy neighbour disturbs less than wall-clock rates.
//!
//! `bench/admission.sh` runs it in release mode. Arguments: `--rounds K` and `--requests N`
//! (closed loop: K rounds of N cycles per side), `--rate R` and `--seconds S` (open loop),
//! `--connections C`, `--hosts H` (the simulated fleet's hosts of 8 GPUs each, default 16),
//! `--held L` (leases admitted first and held open throughout): the two show whether an
//! admission's cost grows with the fleet or the leases open; and `--only bare|enforcer|replicas`
//! to run one side alone (no ratio), for a profiler to see that side by itself.
//!
//! A third side, `replicas`, is the enforcer as a highly available installation runs it: two
//! replicas (each its own service, store writer and PostgreSQL sessions) on one lease store in a
//! real PostgreSQL server that the bench starts in a temp dir (Debian's `postgresql`, as the
//! tests do; `synchronous_commit = on`), the connections spread over both. Its latency at the
//! fixed rate is compared with the SQLite enforcer's in the same run (target: p99 within 1.5×).
//! `--no-postgres` leaves it out.

#[path = "../../tests/support/postgres.rs"]
#[allow(dead_code, unreachable_pub)]
mod pg;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing;
use bytes::Bytes;
use gpuwarden_enforcer::api::{self, AppState};
use gpuwarden_enforcer::drivers::{self, Driver, DriverContext};
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::{CommitStats, Store};
use gpuwarden_schema::{Clock, SystemClock};
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1;
use hyper::{header, Request};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};

// The allocator the gpuwarden binary runs with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TOKEN: &str = "bench-admin-token";
const BODY: &str = r#"{"team":"ml","user":"ada","project":"bench","workload":"training","gpus":1,"duration":"1h"}"#;
const FIXED: &str = r#"{"decision":"admitted","reasons":[],"lease":{"id":"fixed"},"estimate":{"usd_per_hour":4.5,"max_usd":4.5}}"#;

struct Options {
    rounds: usize,
    requests: usize,
    rate: u64,
    seconds: u64,
    connections: usize,
    /// Run only the side of this name (`bare` or `enforcer`).
    only: Option<String>,
    /// Hosts of 8 GPUs in the simulated fleet.
    hosts: u64,
    /// Leases admitted before the rounds and held open throughout.
    held: u64,
    /// Runs the `replicas` side (two replicas on PostgreSQL).
    postgres: bool,
}

fn options() -> Options {
    let mut o = Options {
        rounds: 5,
        requests: 10_000,
        rate: 1_000,
        seconds: 10,
        connections: 16,
        only: None,
        hosts: 16,
        held: 0,
        postgres: true,
    };
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(|v| {
                v.parse::<u64>()
                    .unwrap_or_else(|_| panic!("{name} takes a number"))
            })
    };
    if let Some(v) = value("--rounds") {
        o.rounds = (v as usize).max(1);
    }
    if let Some(v) = value("--requests") {
        o.requests = v as usize;
    }
    if let Some(v) = value("--rate") {
        o.rate = v;
    }
    if let Some(v) = value("--seconds") {
        o.seconds = v;
    }
    if let Some(v) = value("--connections") {
        o.connections = v as usize;
    }
    if let Some(v) = value("--hosts") {
        o.hosts = v.max(1);
    }
    if let Some(v) = value("--held") {
        o.held = v;
    }
    if let Some(i) = args.iter().position(|a| a == "--only") {
        match args.get(i + 1).map(String::as_str) {
            Some(side @ ("bare" | "enforcer" | "replicas")) => o.only = Some(side.to_owned()),
            other => panic!("--only takes bare, enforcer or replicas, not {other:?}"),
        }
    }
    if args.iter().any(|a| a == "--no-postgres") {
        o.postgres = false;
    }
    o
}

fn config(dir: &std::path::Path, hosts: u64) -> gpuwarden_schema::config::Config {
    let hash: String = Sha256::digest(TOKEN.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let text = format!(
        r#"[storage]
data_dir = "{dir}"

[[teams]]
name = "ml"
members = ["ada"]
gpu_quota = 1000000
monthly_budget_usd = 1e12

[workloads.training]
max_gpus = 8
max_duration = "24h"
substrates = ["sim"]

[[substrates]]
name = "sim"
driver = "simulated"
hosts = [{{ prefix = "h", count = {hosts}, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" }}]

[[tokens]]
name = "root"
sha256 = "{hash}"
role = "admin"
"#,
        dir = dir.display()
    );
    gpuwarden_schema::config::parse("bench.toml", &text).expect("the bench config is valid")
}

async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

type Sender = http1::SendRequest<Full<Bytes>>;

async fn connect(address: SocketAddr) -> Sender {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(connection);
    sender
}

async fn post(sender: &mut Sender, address: SocketAddr, path: &str, body: &'static str) -> Bytes {
    sender.ready().await.unwrap();
    let request = Request::post(path)
        .header(header::HOST, address.to_string())
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(
        status.is_success(),
        "{path}: {status}: {}",
        String::from_utf8_lossy(&body)
    );
    body
}

/// What the load generator reads of an admission's answer (the rest is skipped unbuilt, so
/// reading a long answer costs the generator little more than reading the peer's short one).
#[derive(serde::Deserialize)]
struct Answer<'a> {
    decision: &'a str,
    #[serde(borrow)]
    lease: AnswerLease<'a>,
}

#[derive(serde::Deserialize)]
struct AnswerLease<'a> {
    id: &'a str,
}

/// One admission; returns the lease id.
async fn admit(sender: &mut Sender, address: SocketAddr) -> String {
    let body = post(sender, address, "/v1/admission", BODY).await;
    let answer: Answer<'_> = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
    assert_eq!(
        answer.decision,
        "admitted",
        "{}",
        String::from_utf8_lossy(&body)
    );
    answer.lease.id.to_owned()
}

async fn release(sender: &mut Sender, address: SocketAddr, lease: &str) {
    let path = format!("/v1/leases/{lease}/release");
    post(sender, address, &path, "{}").await;
}

/// CPU time (user + system) from a `/proc/.../stat` file: the 14th and 15th fields, in clock
/// ticks (100 a second on Linux). The command name before them is in parentheses and may hold
/// spaces, so fields are counted from its closing parenthesis.
fn stat_cpu_time(path: &std::path::Path) -> Duration {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
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

/// The whole process's CPU time so far, all threads.
fn cpu_time() -> Duration {
    stat_cpu_time("/proc/self/stat".as_ref())
}

/// The CPU time so far of the lease store's writer thread (named `lease-store`), if it runs.
fn store_cpu_time() -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "lease-store")
        })
        .map(|t| stat_cpu_time(&t.path().join("stat")))
        .sum()
}

/// What one closed-loop run measured.
struct Run {
    /// Cycles a second.
    rate: f64,
    /// The whole process's CPU time per cycle (server, load generator and store together).
    cpu_per_cycle: Duration,
    /// The store writer thread's share of it.
    store_per_cycle: Duration,
}

/// Changes per commit (one fsync each) between two readings of the store's counters.
fn per_commit(before: CommitStats, after: CommitStats) -> f64 {
    (after.writes - before.writes) as f64 / (after.commits - before.commits).max(1) as f64
}

/// Closed loop: `requests` cycles spread over the connections, as fast as answers come.
async fn max_throughput(addresses: &[SocketAddr], requests: usize, connections: usize) -> Run {
    let (cpu, store) = (cpu_time(), store_cpu_time());
    let start = Instant::now();
    let tasks: Vec<_> = (0..connections)
        .map(|c| {
            let n = requests / connections + usize::from(c < requests % connections);
            // The connections take the replicas in turn.
            let address = addresses[c % addresses.len()];
            tokio::spawn(async move {
                let mut sender = connect(address).await;
                for _ in 0..n {
                    let lease = admit(&mut sender, address).await;
                    release(&mut sender, address, &lease).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    Run {
        rate: requests as f64 / start.elapsed().as_secs_f64(),
        cpu_per_cycle: cpu_time().saturating_sub(cpu) / requests.max(1) as u32,
        store_per_cycle: store_cpu_time().saturating_sub(store) / requests.max(1) as u32,
    }
}

/// Open loop at `rate` requests/s for `seconds`; latencies (from when each request was due),
/// sorted. A pacing thread hands each due time to the connections in turn, sleeping with the OS
/// timer (tokio's timer ticks in whole milliseconds, which would add up to 1 ms of lateness to
/// every request); a connection still busy with its previous request starts the next late, and
/// that lateness counts.
async fn fixed_rate(
    addresses: &[SocketAddr],
    rate: u64,
    seconds: u64,
    connections: usize,
) -> Vec<Duration> {
    let total = (rate * seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let mut queues = Vec::with_capacity(connections);
    let tasks: Vec<_> = (0..connections)
        .map(|c| {
            let address = addresses[c % addresses.len()];
            let (due_times, mut due) = tokio::sync::mpsc::unbounded_channel::<Instant>();
            queues.push(due_times);
            tokio::spawn(async move {
                let mut sender = connect(address).await;
                let mut latencies = Vec::new();
                while let Some(due) = due.recv().await {
                    let lease = admit(&mut sender, address).await;
                    latencies.push(due.elapsed());
                    release(&mut sender, address, &lease).await;
                }
                latencies
            })
        })
        .collect();
    let start = Instant::now() + Duration::from_millis(100);
    let pacer = std::thread::spawn(move || {
        for i in 0..total {
            let due = start + interval * i as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            queues[i % queues.len()].send(due).unwrap();
        }
    });
    let mut all = Vec::with_capacity(total);
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    pacer.join().unwrap();
    all.sort();
    all
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

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    // `cargo nextest run --all-targets` lists every target's tests; this one has none.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let o = options();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let dir = tempfile::tempdir().unwrap();
        let config = Arc::new(config(dir.path(), o.hosts));
        let store = Store::open(&dir.path().join("enforcer.db")).unwrap();
        let mut built: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
        for s in &config.substrates {
            let context = DriverContext {
                state_dir: dir.path().join("drivers").join(&s.name),
                lease_refs: Some(gpuwarden_enforcer::service::lease_refs(store.clone())),
            };
            built.insert(s.name.clone(), Arc::from(drivers::build(s, &context).unwrap()));
        }
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let enforcer = serve(api::router(AppState::new(Service::new(
            config,
            store.clone(),
            built,
            clock,
        ))))
        .await;
        // Two replicas on one PostgreSQL store.
        // The PostgreSQL server and its database, set up off this runtime's threads (the
        // blocking client starts a runtime of its own).
        let server = if o.postgres {
            Some(
                tokio::task::spawn_blocking(|| {
                    let server = pg::Postgres::private();
                    let url = server.database();
                    (server, url)
                })
                .await
                .unwrap(),
            )
        } else {
            None
        };
        let mut replicas = Vec::new();
        let mut replica_stores = Vec::new();
        if let Some((_, url)) = &server {
            for r in 0..2 {
                let dir = dir.path().join(format!("replica-{r}"));
                let replica_config = Arc::new(self::config(&dir, o.hosts));
                // The blocking PostgreSQL client starts a runtime of its own: not on this one's.
                let opening = url.clone();
                let store = tokio::task::spawn_blocking(move || Store::open_postgres(&opening, None))
                    .await
                    .unwrap()
                    .unwrap();
                let mut built: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
                for s in &replica_config.substrates {
                    let context = DriverContext {
                        state_dir: dir.join("drivers").join(&s.name),
                        lease_refs: Some(gpuwarden_enforcer::service::lease_refs(store.clone())),
                    };
                    built.insert(s.name.clone(), Arc::from(drivers::build(s, &context).unwrap()));
                }
                let clock: Arc<dyn Clock> = Arc::new(SystemClock);
                replicas.push(
                    serve(api::router(AppState::new(Service::new(
                        replica_config,
                        store.clone(),
                        built,
                        clock,
                    ))))
                    .await,
                );
                replica_stores.push(store);
            }
        }
        let replica_commits = |stores: &[Store]| {
            stores.iter().fold(CommitStats::default(), |sum, s| {
                let c = s.commit_stats();
                CommitStats {
                    commits: sum.commits + c.commits,
                    writes: sum.writes + c.writes,
                }
            })
        };
        let fixed = || async { ([(header::CONTENT_TYPE, "application/json")], FIXED) };
        let bare = serve(
            axum::Router::new()
                .route("/v1/admission", routing::post(fixed))
                .route("/v1/leases/{id}/release", routing::post(fixed)),
        )
        .await;

        if o.held > 0 {
            let mut sender = connect(enforcer).await;
            for _ in 0..o.held {
                admit(&mut sender, enforcer).await;
            }
        }
        println!(
            "admission benchmark: {} connections, {} hosts of 8 GPUs, {} leases held open; {} rounds of {} cycles per side, closed loop; {} rps for {} s, open loop",
            o.connections, o.hosts, o.held, o.rounds, o.requests, o.rate, o.seconds
        );
        // The sides take turns, round by round, so a slow spell of the machine falls on both.
        let runs = |side: &str| {
            o.only.as_deref().is_none_or(|only| only == side)
                && (side != "replicas" || !replicas.is_empty())
        };
        let mut ratios = Vec::with_capacity(o.rounds);
        let mut cpu_ratios = Vec::with_capacity(o.rounds);
        for round in 1..=o.rounds {
            let mut line = format!("round {round}:");
            let bare_run = match runs("bare") {
                true => Some(max_throughput(&[bare], o.requests, o.connections).await),
                false => None,
            };
            if let Some(run) = &bare_run {
                line += &format!(
                    " bare {:>7.0} cycles/s ({:>4.0} µs CPU each) ",
                    run.rate,
                    micros(run.cpu_per_cycle)
                );
            }
            let commits = store.commit_stats();
            let real_run = match runs("enforcer") {
                true => Some(max_throughput(&[enforcer], o.requests, o.connections).await),
                false => None,
            };
            if let Some(run) = &real_run {
                let grouped = per_commit(commits, store.commit_stats());
                line += &format!(
                    " enforcer {:>6.0} admissions/s ({:>4.0} µs CPU each, {:>3.0} in the store's writer; {grouped:.1} changes per commit)",
                    run.rate,
                    micros(run.cpu_per_cycle),
                    micros(run.store_per_cycle),
                );
            }
            if runs("replicas") {
                let commits = replica_commits(&replica_stores);
                let run = max_throughput(&replicas, o.requests, o.connections).await;
                let grouped = per_commit(commits, replica_commits(&replica_stores));
                line += &format!(
                    " 2 replicas on PostgreSQL {:>6.0} admissions/s ({:>4.0} µs CPU each; {grouped:.1} changes per commit)",
                    run.rate,
                    micros(run.cpu_per_cycle),
                );
                if let Some(real_run) = &real_run {
                    line += &format!("  vs SQLite {:.2}", run.rate / real_run.rate);
                }
            }
            if let (Some(bare_run), Some(real_run)) = (&bare_run, &real_run) {
                let ratio = real_run.rate / bare_run.rate;
                line += &format!("  ratio {ratio:.2}");
                ratios.push(ratio);
                cpu_ratios.push(
                    bare_run.cpu_per_cycle.as_secs_f64()
                        / real_run.cpu_per_cycle.as_secs_f64().max(f64::MIN_POSITIVE),
                );
            }
            println!("{line}");
        }
        if !ratios.is_empty() {
            let ratio = median(&mut ratios);
            println!(
                "ratio enforcer / bare, median of {} rounds: {ratio:.2} (target >= 0.50: {}); by CPU per cycle: {:.2}",
                o.rounds,
                if ratio >= 0.5 { "met" } else { "missed" },
                median(&mut cpu_ratios)
            );
        }
        let mut p99s = BTreeMap::new();
        for (name, side, addresses) in [
            ("bare axum handler", "bare", vec![bare]),
            ("enforcer admission", "enforcer", vec![enforcer]),
            ("enforcer admission, 2 replicas on PostgreSQL", "replicas", replicas.clone()),
        ] {
            if !runs(side) || o.seconds == 0 {
                continue;
            }
            let counted = |side: &str| match side {
                "replicas" => replica_commits(&replica_stores),
                _ => store.commit_stats(),
            };
            let commits = counted(side);
            let latencies = fixed_rate(&addresses, o.rate, o.seconds, o.connections).await;
            let after = counted(side);
            let p99 = percentile(&latencies, 0.99);
            p99s.insert(side, p99);
            println!(
                "at {} rps  {name}: p50 {:.2} ms  p99 {:.2} ms  p99.9 {:.2} ms  max {:.2} ms  ({} requests{}){}",
                o.rate,
                ms(percentile(&latencies, 0.50)),
                ms(p99),
                ms(percentile(&latencies, 0.999)),
                ms(latencies.last().copied().unwrap_or_default()),
                latencies.len(),
                match side {
                    "enforcer" | "replicas" => format!(
                        ", {} commits, {:.1} changes per commit",
                        after.commits - commits.commits,
                        per_commit(commits, after)
                    ),
                    _ => String::new(),
                },
                if name.starts_with("enforcer") {
                    format!("  (target p99 < 5 ms: {})", if p99 < Duration::from_millis(5) { "met" } else { "missed" })
                } else {
                    String::new()
                }
            );
        }
        if let (Some(sqlite), Some(postgres)) = (p99s.get("enforcer"), p99s.get("replicas")) {
            let ratio = postgres.as_secs_f64() / sqlite.as_secs_f64().max(f64::MIN_POSITIVE);
            println!(
                "p99 at {} rps, 2 replicas on PostgreSQL / SQLite: {ratio:.2} (target <= 1.5: {})",
                o.rate,
                if ratio <= 1.5 { "met" } else { "missed" }
            );
        }
        drop(replica_stores);
        drop(server);
    });
}
