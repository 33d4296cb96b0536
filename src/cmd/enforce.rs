//! `gpuwarden enforce`: the enforcer as a service. Opens the lease store, builds one driver per
//! `[[substrates]]` entry, re-adopts the leases a previous run left open, serves the admission
//! API with `/metrics`, releases leases past their end, and publishes the store's outbox to
//! Kafka. This module only wires: the outbox publisher and the signals consumer are
//! [`gpuwarden_enforcer::kafka`]'s, handed client settings from the command's
//! [`KafkaConnection`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gpuwarden_enforcer::alerts::Alerts;
use gpuwarden_enforcer::api::{self, AppState};
use gpuwarden_enforcer::drivers::{self, Driver, DriverContext};
use gpuwarden_enforcer::kafka::outbox::{stopped, Publisher};
use gpuwarden_enforcer::rules::Rules;
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::config;
use gpuwarden_schema::{Clock, SystemClock};
use tokio::sync::watch;

use super::kafka::{shutdown_signal, KafkaConnection};

/// How often (event time) leases past their end and budgets are looked at, within
/// [`TICK_MIN`]..[`TICK_MAX`] of wall time.
const TICK_EVENT_TIME: Duration = Duration::from_secs(15);
const TICK_MIN: Duration = Duration::from_millis(50);
const TICK_MAX: Duration = Duration::from_secs(2);

/// How long a shutdown waits for the outbox to reach Kafka.
const FLUSH_ON_SHUTDOWN: Duration = Duration::from_secs(5);

/// Serve the admission API and enforce leases.
///
/// Opens the lease store (enforcer.database, or <data_dir>/enforcer.db), builds a driver for every
/// [[substrates]] entry (state under <data_dir>/drivers/<name>/), and re-adopts the leases left
/// open by a previous run: a lease its substrate still runs stays active, one it no longer runs
/// is marked failed. Then it serves the API (POST /v1/admission, /v1/leases, /v1/teams/{team},
/// /healthz, /metrics, /openapi.json) on enforcer.listen, releases leases whose time is up
/// (reason "expired"), keeps each team's month-to-date spend from the pipeline's team_spend
/// signals (for the budget check), and publishes every lease event and action to Kafka from the store's
/// outbox: a record is marked published only once Kafka has acknowledged it, so nothing is lost
/// while Kafka is down. Ctrl-C or SIGTERM stops serving and flushes the outbox for a few seconds.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file.
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Address of the API; overrides enforcer.listen (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", env = "GPUWARDEN_ENFORCER_LISTEN")]
    listen: Option<SocketAddr>,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = Arc::new(config::load(&args.config)?);
    let listen = args.listen.unwrap_or(config.enforcer.listen);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let kafka = Arc::new(KafkaConnection::open_lazy(&config)?);
        let enforcer = start(config, kafka, Arc::new(SystemClock), listen).await?;
        shutdown_signal().await;
        enforcer.stop().await;
        Ok(ExitCode::SUCCESS)
    })
}

/// A running enforcer: the API, the runtime rules and the outbox publisher.
pub(crate) struct Enforcer {
    /// Where the API listens.
    pub(crate) address: SocketAddr,
    stop_tx: watch::Sender<bool>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    ticking: tokio::task::JoinHandle<()>,
    signals: tokio::task::JoinHandle<()>,
    signals_stop: Arc<AtomicBool>,
    /// Held until the enforcer has stopped: with `brokers = "embedded"` the broker lives as long
    /// as its connection, and the publisher and the consumer only hold client settings.
    _kafka: Arc<KafkaConnection>,
    publishing: tokio::task::JoinHandle<usize>,
}

/// Opens the lease store, builds the drivers, re-adopts open leases, and starts the API on
/// `listen`, the runtime rules (on `clock`'s time) and the outbox publisher to `kafka`.
pub(crate) async fn start(
    config: Arc<config::Config>,
    kafka: Arc<KafkaConnection>,
    clock: Arc<dyn Clock>,
    listen: SocketAddr,
) -> anyhow::Result<Enforcer> {
    let database = config.enforcer_database();
    if let Some(dir) = database.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let store = Store::open(&database)
        .with_context(|| format!("opening the lease store {}", database.display()))?;
    let mut built: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
    for substrate in &config.substrates {
        let context = DriverContext {
            state_dir: config
                .storage
                .data_dir
                .join("drivers")
                .join(&substrate.name),
        };
        let driver = drivers::build(substrate, &context)
            .with_context(|| format!("starting the driver of substrate {}", substrate.name))?;
        built.insert(substrate.name.clone(), Arc::from(driver));
    }
    let service = Service::new(config.clone(), store.clone(), built, clock.clone());
    let readopted = service
        .readopt()
        .await
        .map_err(|e| anyhow::anyhow!("re-adopting open leases: {e}"))?;
    tracing::info!(
        running = readopted.running,
        failed = readopted.failed,
        unknown = readopted.unknown,
        "re-adopted open leases"
    );

    let publisher = Publisher::new(&kafka.client("enforcer"), store.clone(), clock.clone())
        .context("creating the Kafka producer")?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let publishing =
        tokio::spawn(publisher.run(kafka.topic_setup(), stop_rx.clone(), FLUSH_ON_SHUTDOWN));
    let rules = Rules::new(
        service.clone(),
        Alerts::new(&config.enforcer.alert_webhooks),
    );
    if service.dry_run() {
        tracing::warn!("enforcer.mode = \"dry_run\": runtime rules record what they would do and change nothing");
    }
    let tick = clock.wall_for(TICK_EVENT_TIME).clamp(TICK_MIN, TICK_MAX);
    let ticking = tokio::spawn(rules_loop(
        service.clone(),
        rules.clone(),
        tick,
        stop_rx.clone(),
    ));
    let signals_stop = Arc::new(AtomicBool::new(false));
    let signals = tokio::spawn(gpuwarden_enforcer::kafka::signals::run(
        kafka.client("enforcer"),
        rules,
        signals_stop.clone(),
    ));

    let (metrics, store) = (service.metrics().clone(), service.store().clone());
    let app =
        api::router(AppState::new(service)).merge(super::metrics_http::metrics_only(move || {
            metrics.render_with(store.commit_stats())
        }));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the API to {listen}"))?;
    let address = listener.local_addr()?;
    tracing::info!(
        api = %format!("http://{address}"),
        database = %database.display(),
        kafka = %kafka.bootstrap,
        "enforcer running"
    );
    let mut server_stop = stop_rx.clone();
    // Connect info gives the API each request's peer address, which failed logins are
    // limited by (enforcer.login_limits).
    let server = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async move {
        stopped(&mut server_stop).await;
    });
    let server = tokio::spawn(async move { server.await });
    Ok(Enforcer {
        address,
        stop_tx,
        server,
        ticking,
        signals,
        signals_stop,
        publishing,
        _kafka: kafka,
    })
}

impl Enforcer {
    /// Stops serving (requests in flight finish), stops the rules, and flushes the outbox for
    /// a few seconds.
    pub(crate) async fn stop(self) {
        let _ = self.stop_tx.send(true);
        // A slow client cannot hold the shutdown for long.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server).await;
        self.ticking.abort();
        self.signals_stop.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(10), self.signals).await;
        match tokio::time::timeout(FLUSH_ON_SHUTDOWN + Duration::from_secs(1), self.publishing).await {
            Ok(Ok(left)) if left > 0 => tracing::warn!(
                pending = left,
                "outbox records not yet in Kafka; they are published on the next start"
            ),
            Ok(_) => tracing::info!("outbox flushed"),
            Err(_) => tracing::warn!("the outbox publisher did not stop in time; pending records are published on the next start"),
        }
        tracing::info!("enforcer stopped");
    }
}

/// Every `tick`: releases leases past their end and re-checks budgets (a new month lifts a
/// budget block without waiting for a signal).
async fn rules_loop(
    service: Service,
    rules: Rules,
    tick: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = stopped(&mut stop) => return,
        }
        if let Err(e) = service.expire_due().await {
            tracing::warn!(error = %e, "looking for expired leases failed");
        }
        if let Err(e) = rules.check_budgets().await {
            tracing::warn!(error = %e, "checking budgets failed");
        }
    }
}
