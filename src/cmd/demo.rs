//! `gpuwarden demo`: the whole system in one process on a simulated fleet, with demo teams,
//! budgets and policies, and a workload generator that asks for GPUs through the real API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gpuwarden_enforcer::api::token_sha256_hex;
use gpuwarden_schema::config;
use gpuwarden_schema::{AcceleratedClock, Clock};
use hyper::Method;
use serde_json::{json, Value};

use super::api_client::ApiClient;
use super::up::{Listens, Stack};

/// The demo's admin token (printed at the start, for curl and `gpuwarden request`).
pub(crate) const ADMIN_TOKEN: &str = "demo-admin-token";
/// The token the workload generator uses: a provisioning front-end acting for the demo users.
const PORTAL_TOKEN: &str = "demo-portal-token";
/// A member's token, for a newcomer to sign in to the portal as alice of team research.
const MEMBER_TOKEN: &str = "demo-alice-token";
const SQL_USER: &str = "demo";
const SQL_PASSWORD: &str = "demo";

/// Run the whole system on a simulated fleet, with demo teams and work, in one process.
///
/// Starts an embedded Kafka broker, a simulated fleet of 4 hosts × 8 GPUs (two of H100, one of
/// A100, one of L40S), the pipeline (lake, rollups, signals, SQL endpoint), and the enforcer
/// with three teams, budgets and workload policies; then a workload generator asks for GPUs
/// through the enforcer's HTTP API as a provisioning front-end would: training, inference,
/// notebooks (some left idle, which get reclaimed), and a team that runs into its budget. Event
/// time runs --speed times faster than the wall clock (60: an hour a minute), from a day ago
/// (--start): the first 24 minutes fill the last day up to now, which is what dashboards show by
/// default.
///
/// It prints what to paste: the portal's URL with a member's token, the psql command line, the
/// API URL with a token and a curl, the metrics URLs, the lake, and the config it wrote (`gpuwarden up --config` runs it again).
/// Within two minutes psql shows team_hourly rows, and reclaims and denials in actions.
/// Ctrl-C stops it cleanly.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Event time per wall time.
    #[arg(long, default_value_t = 60.0)]
    speed: f64,
    /// Event time to start at, RFC 3339 (`2026-01-10T01:00:00Z`); default 24 hours ago.
    #[arg(long, value_parser = super::up::parse_time)]
    start: Option<i64>,
    /// Where the lake, the lease store and the config go; default a new directory under the
    /// system's temp dir.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// The admission API.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    api_listen: SocketAddr,
    /// The SQL endpoint (PostgreSQL wire protocol).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:5433")]
    sql_listen: SocketAddr,
    /// The pipeline's /metrics.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9401")]
    pipeline_metrics_listen: SocketAddr,
    /// The collector's /metrics (dcgm-exporter names).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9400")]
    collector_metrics_listen: SocketAddr,
    /// Stop after this long (wall time), e.g. `5m`; default: until Ctrl-C.
    #[arg(long, value_parser = config::parse_duration)]
    run_for: Option<Duration>,
}

/// The demo's config file: what `gpuwarden up --config` needs to run the same system.
fn demo_config(data_dir: &Path, args: &Args, signing_key: &str) -> String {
    format!(
        r#"# Written by `gpuwarden demo`. Run the same system again with:
#   gpuwarden up --config {config} --speed {speed}
[kafka]
brokers = "embedded"

# Signs the signals the pipeline sends the enforcer, and the lease events and actions it sends
# back; a record without a valid signature is refused.
[signing]
key = "{signing_key}"

[storage]
data_dir = "{data}"

[collector]
source = "simulated"
interval = "30s"
metrics_listen = "{collector_metrics}"

[collector.simulated]
speed = {speed}
seed = 7

[pipeline]
flush_age = "2s"
rollup_every = "10s"
metrics_listen = "{pipeline_metrics}"
sql_listen = "{sql}"

[[pipeline.sql_users]]
name = "{sql_user}"
password = "{sql_password}"

[pipeline.signals]
every = "1m"
window = "15m"

[pricing]
default_usd_per_gpu_hour = 2.0

[[pricing.gpu]]
match = "H100"
usd_per_gpu_hour = 4.0

[[pricing.gpu]]
match = "A100"
usd_per_gpu_hour = 2.5

[[pricing.gpu]]
match = "L40S"
usd_per_gpu_hour = 1.5

[[teams]]
name = "research"
members = ["alice", "bob"]
gpu_quota = 16
monthly_budget_usd = 50000.0

[[teams]]
name = "ml-platform"
members = ["carol", "dan"]
gpu_quota = 12
monthly_budget_usd = 20000.0

# Close to its budget: its work passes it within a few minutes of the demo.
[[teams]]
name = "analytics"
members = ["erin"]
gpu_quota = 6
monthly_budget_usd = 60.0

[workloads.training]
max_gpus = 8
max_duration = "24h"
idle_timeout = "1h"
on_idle = "reclaim"

[workloads.inference]
min_gpus = 1
max_gpus = 4
max_duration = "7d"
target_util_pct = 60.0

[workloads.notebook]
max_gpus = 2
max_duration = "8h"
idle_timeout = "30m"
warn_before = "10m"
on_idle = "reclaim"

[workloads.batch]
max_gpus = 4
max_duration = "6h"

[enforcer]
listen = "{api}"

[[substrates]]
name = "sim"
driver = "simulated"
hosts = [
  {{ prefix = "h100", count = 2, gpus = 8, gpu_model = "NVIDIA H100 80GB HBM3" }},
  {{ prefix = "a100", count = 1, gpus = 8, gpu_model = "NVIDIA A100-SXM4-80GB" }},
  {{ prefix = "l40s", count = 1, gpus = 8, gpu_model = "NVIDIA L40S" }},
]

# Token "{admin}".
[[tokens]]
name = "demo-admin"
sha256 = "{admin_hash}"
role = "admin"

# Token "{portal}": the workload generator, a front-end acting for the teams' users.
[[tokens]]
name = "portal"
sha256 = "{portal_hash}"
role = "service"
teams = ["research", "ml-platform", "analytics"]

# Token "{member}": alice of team research, as she signs in to the portal (/ui/).
[[tokens]]
name = "alice"
sha256 = "{member_hash}"
role = "member"
teams = ["research"]
"#,
        config = data_dir.join("gpuwarden.toml").display(),
        data = data_dir.display(),
        speed = args.speed,
        collector_metrics = args.collector_metrics_listen,
        pipeline_metrics = args.pipeline_metrics_listen,
        sql = args.sql_listen,
        api = args.api_listen,
        sql_user = SQL_USER,
        sql_password = SQL_PASSWORD,
        admin = ADMIN_TOKEN,
        portal = PORTAL_TOKEN,
        admin_hash = token_sha256_hex(ADMIN_TOKEN),
        portal_hash = token_sha256_hex(PORTAL_TOKEN),
        member = MEMBER_TOKEN,
        member_hash = token_sha256_hex(MEMBER_TOKEN),
    )
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.speed.is_finite() && args.speed > 0.0,
        "--speed must be a positive number, got {}",
        args.speed
    );
    let data_dir = match &args.data_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!(
            "gpuwarden-demo-{}",
            gpuwarden_schema::clock::wall_now_s()
        )),
    };
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating the demo's directory {}", data_dir.display()))?;
    let config_path = data_dir.join("gpuwarden.toml");
    std::fs::write(
        &config_path,
        demo_config(&data_dir, &args, &super::fresh_signing_key()?),
    )
    .with_context(|| format!("writing {}", config_path.display()))?;
    let config = Arc::new(config::load(&config_path)?);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let start = args
            .start
            .unwrap_or_else(|| gpuwarden_schema::clock::wall_now_ms() - 24 * 3_600_000);
        let clock: Arc<dyn Clock> = Arc::new(AcceleratedClock::new(start, args.speed));
        let listens = Listens {
            api: args.api_listen,
            sql: Some(args.sql_listen),
            pipeline_metrics: args.pipeline_metrics_listen,
            collector_metrics: args.collector_metrics_listen,
        };
        let stack = Stack::start(config, clock.clone(), listens)
            .await
            .context("starting the demo (another demo running? pick other ports with --api-listen, --sql-listen, --pipeline-metrics-listen, --collector-metrics-listen)")?;
        print_banner(&stack, &config_path, args.speed, start);
        let api = ApiClient::to(&format!("http://{}", stack.api()), Some(PORTAL_TOKEN));
        let generator = tokio::spawn(generate(api, clock));
        let result = stack.run_until_stopped(args.run_for).await;
        generator.abort();
        result?;
        println!("gpuwarden demo stopped; the lake stays in {}", data_dir.join("lake").display());
        Ok(ExitCode::SUCCESS)
    })
}

fn print_banner(stack: &Stack, config: &Path, speed: f64, start_ms: i64) {
    let start = humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(start_ms).unwrap_or(0)),
    );
    let sql = stack.sql().expect("the demo always serves SQL");
    println!(
        r#"gpuwarden demo is running: 32 simulated GPUs, 3 teams, event time at {speed}x from {start}.

  SQL (psql, Grafana: PostgreSQL data source, user {SQL_USER}, password {SQL_PASSWORD}):
    psql "postgres://{SQL_USER}:{SQL_PASSWORD}@{sql}/gpuwarden"
    SELECT hour, team, gpu_model, cost_usd, utilization_pct FROM team_hourly ORDER BY hour DESC LIMIT 10;
    SELECT to_timestamp_millis(ts_ms) AS at, action, reason, team, lease_id, outcome FROM actions ORDER BY ts_ms DESC LIMIT 10;

  Portal:  http://{api}/ui/   sign in as alice (member of research) with token {MEMBER_TOKEN},
           or as the admin (every team, the audit trail, the scorecard) with {ADMIN_TOKEN}

  Admission API: http://{api}   token: {ADMIN_TOKEN}
    curl -s -H 'Authorization: Bearer {ADMIN_TOKEN}' -H 'Content-Type: application/json' \
      -d '{{"team":"research","user":"alice","project":"llm","workload":"training","gpus":2,"duration":"2h"}}' \
      http://{api}/v1/admission
    gpuwarden leases --api http://{api} --token {ADMIN_TOKEN}

  Metrics: http://{collector}/metrics (GPUs, dcgm-exporter names)
           http://{pipeline}/metrics (pipeline)   http://{api}/metrics (enforcer)
  Lake:    {lake}
  Config:  {config}

Ctrl-C stops it."#,
        api = stack.api(),
        collector = stack.collector_metrics(),
        pipeline = stack.pipeline_metrics(),
        lake = stack.lake,
        config = config.display(),
    );
}

/// A small deterministic generator (splitmix64), so a demo run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One request the generator makes.
fn ask(
    team: &str,
    user: &str,
    workload: &str,
    gpus: u32,
    duration: &str,
    model: Option<&str>,
    idle: bool,
) -> Value {
    let mut body = json!({"team": team, "user": user, "project": "demo", "workload": workload,
        "gpus": gpus, "duration": duration});
    if let Some(model) = model {
        body["gpu_model"] = json!(model);
    }
    if idle {
        body["labels"] = json!({"sim_profile": "idle"});
    }
    body
}

/// Asks for GPUs as the demo's front-end: a first wave at once (one of each kind of work, two
/// notebooks left idle, analytics' work that runs into its budget, and one ask over the
/// notebook limit), then one request every 15 min of event time.
async fn generate(api: ApiClient, clock: Arc<dyn Clock>) {
    let first = [
        ask(
            "research",
            "alice",
            "training",
            4,
            "12h",
            Some("H100"),
            false,
        ),
        ask(
            "ml-platform",
            "carol",
            "inference",
            2,
            "7d",
            Some("L40S"),
            false,
        ),
        ask("research", "bob", "notebook", 1, "6h", Some("A100"), true),
        ask(
            "ml-platform",
            "dan",
            "notebook",
            1,
            "6h",
            Some("L40S"),
            true,
        ),
        ask("research", "bob", "notebook", 1, "4h", Some("A100"), false),
        ask(
            "analytics",
            "erin",
            "training",
            2,
            "6h",
            Some("H100"),
            false,
        ),
        ask("analytics", "erin", "batch", 2, "4h", Some("A100"), false),
        // More than a notebook may hold: denied with workload_limit.
        ask("research", "alice", "notebook", 4, "2h", None, false),
    ];
    for body in &first {
        submit(&api, body).await;
    }
    let mut rng = Rng(7);
    let every = clock.wall_for(Duration::from_secs(15 * 60));
    loop {
        tokio::time::sleep(every).await;
        let body = match rng.below(6) {
            0 => ask(
                "research",
                "alice",
                "training",
                2 + rng.below(3) as u32,
                "8h",
                Some("H100"),
                false,
            ),
            1 => ask(
                "ml-platform",
                "carol",
                "batch",
                1 + rng.below(2) as u32,
                "3h",
                Some("A100"),
                false,
            ),
            2 => ask(
                "research",
                "bob",
                "notebook",
                1,
                "4h",
                Some("A100"),
                rng.below(2) == 0,
            ),
            3 => ask(
                "ml-platform",
                "dan",
                "notebook",
                1,
                "4h",
                Some("L40S"),
                rng.below(2) == 0,
            ),
            4 => ask("analytics", "erin", "batch", 1, "2h", Some("A100"), false),
            _ => ask(
                "ml-platform",
                "carol",
                "inference",
                1,
                "1d",
                Some("L40S"),
                false,
            ),
        };
        submit(&api, &body).await;
    }
}

async fn submit(api: &ApiClient, body: &Value) {
    match api.call(Method::POST, "/v1/admission", Some(body)).await {
        Ok(answer) => {
            let codes: Vec<&str> = answer["reasons"]
                .as_array()
                .map(|r| r.iter().filter_map(|r| r["code"].as_str()).collect())
                .unwrap_or_default();
            tracing::info!(
                team = %body["team"].as_str().unwrap_or_default(),
                workload = %body["workload"].as_str().unwrap_or_default(),
                gpus = body["gpus"].as_u64().unwrap_or_default(),
                decision = %answer["decision"].as_str().unwrap_or_default(),
                reasons = ?codes,
                "demo request"
            );
        }
        Err(e) => tracing::warn!(error = %format!("{e:#}"), "demo request failed"),
    }
}
