//! `gpuwarden enforce`: the enforcer as a service. Opens the lease store, builds one driver per
//! `[[substrates]]` entry, re-adopts the leases a previous run left open, serves the admission
//! API with `/metrics`, releases leases past their end, and publishes the store's outbox to
//! Kafka. This module only wires: the outbox publisher and the signals consumer are
//! [`gpuwarden_enforcer::kafka`]'s, handed client settings from the command's
//! [`KafkaConnection`]. The API is served over plain HTTP by axum, or, with `[enforcer.tls]`,
//! over TLS by tokio-rustls and hyper (the certificate from [`gpuwarden_schema::tls`]); either
//! way each request carries the peer's address as `ConnectInfo<SocketAddr>`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::ConnectInfo;
use axum::Router;
use gpuwarden_enforcer::alerts::Alerts;
use gpuwarden_enforcer::api::AppState;
use gpuwarden_enforcer::drivers::{self, Driver, DriverContext};
use gpuwarden_enforcer::kafka::outbox::{stopped, Publisher};
use gpuwarden_enforcer::rules::Rules;
use gpuwarden_enforcer::service::Service;
use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::config::{self, StoreLocation};
use gpuwarden_schema::signing::SigningKeys;
use gpuwarden_schema::tls::ServerTls;
use gpuwarden_schema::{Clock, SystemClock};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use super::kafka::{shutdown_signal, KafkaConnection};

/// How often (event time) leases past their end and budgets are looked at, within
/// [`TICK_MIN`]..[`TICK_MAX`] of wall time.
const TICK_EVENT_TIME: Duration = Duration::from_secs(15);
const TICK_MIN: Duration = Duration::from_millis(50);
const TICK_MAX: Duration = Duration::from_secs(2);

/// How long a shutdown waits for the outbox to reach Kafka.
const FLUSH_ON_SHUTDOWN: Duration = Duration::from_secs(5);

/// How long a client has to finish its TLS handshake, so that idle sockets cannot pile up.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often (wall time) published outbox rows past `enforcer.outbox_retention` are deleted,
/// and how many per commit.
const PRUNE_EVERY: Duration = Duration::from_secs(10 * 60);
const PRUNE_BATCH: usize = 1_000;

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
    /// The API's base URL: `https://` with `[enforcer.tls]`, else `http://`.
    pub(crate) url: String,
    stop_tx: watch::Sender<bool>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    /// Starts and stops the leader's work as this replica gains and loses the leadership.
    leading: tokio::task::JoinHandle<()>,
    /// The watchers of the Slurm substrates' queues and the Kubernetes substrates' pods.
    slurm_watchers: Vec<tokio::task::JoinHandle<()>>,
    /// The Kubernetes substrates' admission webhooks.
    webhooks: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// Held until the enforcer has stopped: with `brokers = "embedded"` the broker lives as long
    /// as its connection, and the publisher and the consumer only hold client settings.
    _kafka: Arc<KafkaConnection>,
}

/// Opens the lease store, builds the drivers, re-adopts open leases, and starts the API on
/// `listen`, the runtime rules (on `clock`'s time) and the outbox publisher to `kafka`.
pub(crate) async fn start(
    config: Arc<config::Config>,
    kafka: Arc<KafkaConnection>,
    clock: Arc<dyn Clock>,
    listen: SocketAddr,
) -> anyhow::Result<Enforcer> {
    let tls = match &config.enforcer.tls {
        Some(settings) => Some(ServerTls::load(
            settings,
            "enforcer.tls",
            "api",
            &[b"http/1.1"],
        )?),
        None => {
            // The config's own address was checked when it was loaded; this is for --listen.
            if let Some(why) = config.plaintext_refusal(config::Listener::Api, listen) {
                anyhow::bail!("--listen: {why}");
            }
            None
        }
    };
    // The API's listener, bound before anything starts: a taken port stops the enforcer at
    // once rather than leaving its background tasks running without an API.
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the API to {listen}"))?;
    // Each Kubernetes substrate's admission webhook: its certificate and listener, before
    // anything starts, so that a missing file or a taken port stops the enforcer at once.
    let mut webhook_listeners = Vec::new();
    for s in &config.substrates {
        let Some(k) = &s.kubernetes else { continue };
        let tls = ServerTls::load(
            &k.webhook_tls,
            "substrates.kubernetes.webhook_tls",
            "kubernetes-webhook",
            &[b"http/1.1"],
        )?;
        let listener = tokio::net::TcpListener::bind(k.webhook_listen)
            .await
            .with_context(|| {
                format!(
                    "binding substrate {}'s admission webhook to {}",
                    s.name, k.webhook_listen
                )
            })?;
        webhook_listeners.push((s.name.clone(), tls, listener));
    }
    let location = config.enforcer_store();
    if let StoreLocation::Sqlite(database) = &location {
        if let Some(dir) = database.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
    }
    // Off the runtime's threads: the PostgreSQL store connects with the blocking `postgres`
    // client, whose own runtime cannot be started from inside this one.
    let opening = location.clone();
    let opened = tokio::task::spawn_blocking(move || Store::open_at(&opening))
        .await
        .context("opening the lease store")?;
    let store = opened.with_context(|| match &location {
        StoreLocation::Sqlite(database) => {
            format!("opening the lease store {}", database.display())
        }
        StoreLocation::Postgres { .. } => {
            "opening the lease store in PostgreSQL (enforcer.store.url)".into()
        }
    })?;
    let mut built: BTreeMap<String, Arc<dyn Driver>> = BTreeMap::new();
    for substrate in &config.substrates {
        let context = DriverContext {
            state_dir: config
                .storage
                .data_dir
                .join("drivers")
                .join(&substrate.name),
            lease_refs: Some(gpuwarden_enforcer::service::lease_refs(store.clone())),
        };
        let driver = drivers::build(substrate, &context)
            .with_context(|| format!("starting the driver of substrate {}", substrate.name))?;
        if let Some(kubernetes) = driver.kubernetes() {
            kubernetes.import_journal().await.with_context(|| {
                format!(
                    "reading the pods an earlier version kept for substrate {}",
                    substrate.name
                )
            })?;
        }
        built.insert(substrate.name.clone(), Arc::from(driver));
    }
    let store_location = store.location().to_owned();
    let service = Service::new(config.clone(), store.clone(), built, clock.clone());
    // Leadership: on PostgreSQL the replicas elect one to do what must happen once; an SQLite
    // store's one owner always leads.
    let replica = config
        .enforcer
        .leader
        .replica
        .clone()
        .unwrap_or_else(|| store.leadership().replica());
    store
        .elect(&replica, config.enforcer.leader.lease)
        .context("joining the leader election")?;
    let leader = LeaderContext {
        config: config.clone(),
        kafka: kafka.clone(),
        clock: clock.clone(),
        service: service.leading(),
        outbox: store.leading(),
    };
    if service.dry_run() {
        tracing::warn!("enforcer.mode = \"dry_run\": runtime rules record what they would do and change nothing");
    }
    // A replica that leads from the start (always, on SQLite) re-adopts the open leases before
    // its API answers.
    let first = if store.leadership().is_leader() {
        Some(leader.start().await?)
    } else {
        tracing::info!(
            replica = %replica,
            leader = %store.leadership().leader().0,
            "another replica leads; this one serves the API and follows"
        );
        None
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let leading = tokio::spawn(lead(
        leader,
        first,
        store.leadership().subscribe(),
        stop_rx.clone(),
    ));
    // Each Slurm substrate's queue, followed into its leases, read once before the API answers
    // its submit hook. Every replica reads it (the hook's answers need it); only the leader's
    // changes are made (the watchers run on the leading view, fenced).
    gpuwarden_enforcer::slurm::watch::prime(&service, Duration::from_secs(10)).await;
    let mut slurm_watchers: Vec<_> = config
        .substrates
        .iter()
        .filter(|s| s.driver == gpuwarden_schema::config::DriverKind::Slurm)
        .map(|s| {
            tokio::spawn(gpuwarden_enforcer::slurm::watch::run(
                service.leading(),
                s.name.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();
    // Each Kubernetes substrate's pods, followed into their leases.
    slurm_watchers.extend(
        config
            .substrates
            .iter()
            .filter(|s| s.driver == gpuwarden_schema::config::DriverKind::Kubernetes)
            .map(|s| {
                tokio::spawn(gpuwarden_enforcer::kubernetes::watch::run(
                    service.leading(),
                    s.name.clone(),
                    stop_rx.clone(),
                ))
            }),
    );

    // Each Kubernetes substrate's admission webhook, on the listener bound at the start.
    let mut webhooks = Vec::new();
    let mut webhook_tls = Vec::new();
    for (substrate, tls, listener) in webhook_listeners {
        tracing::info!(
            substrate = %substrate,
            url = %format!("https://{}/validate", listener.local_addr()?),
            "kubernetes admission webhook running"
        );
        webhooks.push(tokio::spawn(serve_tls(
            listener,
            gpuwarden_enforcer::kubernetes::router(service.clone(), substrate),
            TlsAcceptor::from(tls.config()),
            stop_rx.clone(),
        )));
        webhook_tls.push(tls);
    }
    let (metrics, store) = (service.metrics().clone(), store.clone());
    let leadership = store.leadership().clone();
    let reloads = tls.clone();
    // The portal reads idle cost and the scorecard's evidence from the lake under the data dir
    // (the pipeline's, where it runs beside the enforcer; an empty one elsewhere).
    let lake = super::open_lake(&config, "enforce")?;
    let insights: Arc<dyn gpuwarden_enforcer::portal::Insights> =
        Arc::new(super::assess::LakeInsights::new(lake));
    let app = gpuwarden_enforcer::portal::app(AppState::new(service), Some(insights)).merge(
        super::metrics_http::metrics_only(move || {
            let mut page = metrics.render_with(store.commit_stats());
            gpuwarden_schema::kafka::broker_errors().render(&mut page);
            gpuwarden_enforcer::metrics::render_leadership(&mut page, &leadership);
            let listeners: Vec<&ServerTls> = reloads.iter().chain(&webhook_tls).collect();
            if !listeners.is_empty() {
                gpuwarden_schema::tls::render_reloads(&mut page, &listeners);
            }
            page
        }),
    );
    let address = listener.local_addr()?;
    let url = format!(
        "{}://{address}",
        if tls.is_some() { "https" } else { "http" }
    );
    tracing::info!(
        api = %url,
        store = %store_location,
        kafka = %kafka.bootstrap,
        "enforcer running"
    );
    let server_stop = stop_rx.clone();
    let server = match tls {
        Some(tls) => tokio::spawn(serve_tls(
            listener,
            app,
            TlsAcceptor::from(tls.config()),
            server_stop,
        )),
        None => tokio::spawn(serve_plain(listener, app, server_stop)),
    };
    Ok(Enforcer {
        address,
        url,
        stop_tx,
        server,
        leading,
        slurm_watchers,
        webhooks,
        _kafka: kafka,
    })
}

/// What the leader's work needs: the leading (fenced) views of the service and of the store's
/// outbox, and how to reach Kafka.
struct LeaderContext {
    config: Arc<config::Config>,
    kafka: Arc<KafkaConnection>,
    clock: Arc<dyn Clock>,
    /// The service's leading view: every change it makes is fenced by the leadership.
    service: Service,
    /// The store's leading view, whose outbox the leader publishes to Kafka and prunes.
    outbox: Store,
}

/// The work only the leader does, while it leads: re-adopting open leases, the runtime rules
/// on signals and on the clock (expiry, budgets), outbox pruning and publishing, and the Kueue
/// admission check controllers.
struct LeaderWork {
    stop_tx: watch::Sender<bool>,
    ticking: tokio::task::JoinHandle<()>,
    /// Deletes published outbox rows past `enforcer.outbox_retention` (none: kept forever).
    pruning: Option<tokio::task::JoinHandle<()>>,
    /// The Kubernetes substrates' Kueue admission check controllers.
    kueue_controllers: Vec<tokio::task::JoinHandle<()>>,
    signals: tokio::task::JoinHandle<()>,
    signals_stop: Arc<AtomicBool>,
    publishing: tokio::task::JoinHandle<usize>,
}

impl LeaderContext {
    /// Starts the leader's work, once this replica leads.
    async fn start(&self) -> anyhow::Result<LeaderWork> {
        let (config, service, clock) = (&self.config, &self.service, &self.clock);
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
        let signing = SigningKeys::from_config(&config.signing);
        let publisher = Publisher::new(
            &self.kafka.client("enforcer"),
            self.outbox.clone(),
            clock.clone(),
            signing.clone(),
        )
        .context("creating the Kafka producer")?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let publishing = tokio::spawn(publisher.run(
            self.kafka.topic_setup(),
            stop_rx.clone(),
            FLUSH_ON_SHUTDOWN,
        ));
        let rules = Rules::new(
            service.clone(),
            Alerts::new(&config.enforcer.alert_webhooks),
        );
        let tick = clock.wall_for(TICK_EVENT_TIME).clamp(TICK_MIN, TICK_MAX);
        let ticking = tokio::spawn(rules_loop(
            service.clone(),
            rules.clone(),
            tick,
            stop_rx.clone(),
        ));
        let pruning = config.enforcer.outbox_retention.map(|retention| {
            tokio::spawn(prune_loop(
                self.outbox.clone(),
                clock.clone(),
                retention,
                PRUNE_EVERY,
                stop_rx.clone(),
            ))
        });
        let signals_stop = Arc::new(AtomicBool::new(false));
        // Static membership: a restarted enforcer takes its signal partitions back at once.
        let membership = gpuwarden_schema::kafka::GroupMembership::resolve(config, "enforcer")
            .context("choosing the signals consumer's group.instance.id")?;
        let mut signals_client = self.kafka.client("enforcer");
        membership.apply(&mut signals_client);
        let signals = tokio::spawn({
            let run = gpuwarden_enforcer::kafka::signals::run(
                signals_client,
                signing,
                rules,
                signals_stop.clone(),
            );
            async move {
                // The id's slot stays reserved for as long as the consumer runs.
                let _membership = membership;
                run.await;
            }
        });
        // Each Kubernetes substrate's Kueue admission check controller, where configured.
        let kueue_controllers: Vec<_> = config
            .substrates
            .iter()
            .filter(|s| s.kubernetes.as_ref().is_some_and(|k| k.kueue.is_some()))
            .map(|s| {
                tokio::spawn(gpuwarden_enforcer::kubernetes::kueue::run(
                    service.clone(),
                    s.name.clone(),
                    stop_rx.clone(),
                ))
            })
            .collect();
        Ok(LeaderWork {
            stop_tx,
            ticking,
            pruning,
            kueue_controllers,
            signals,
            signals_stop,
            publishing,
        })
    }
}

impl LeaderWork {
    /// Stops the leader's work and flushes the outbox for a few seconds.
    async fn stop(self) {
        let _ = self.stop_tx.send(true);
        self.ticking.abort();
        if let Some(pruning) = self.pruning {
            pruning.abort();
        }
        for controller in self.kueue_controllers {
            let _ = tokio::time::timeout(Duration::from_secs(5), controller).await;
        }
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
    }
}

/// Runs the leader's work while this replica leads: starts it when the replica becomes leader,
/// stops it when it no longer is (another took over, or its lease ran out) or the enforcer
/// stops. `first` is the work already started, when the replica led from the start.
async fn lead(
    context: LeaderContext,
    first: Option<LeaderWork>,
    mut leads: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let mut work = first;
    loop {
        match work.take() {
            Some(running) => {
                tokio::select! {
                    changed = async { leads.wait_for(|l| !*l).await.map(|_| ()) } => {
                        if changed.is_ok() {
                            tracing::warn!("this replica no longer leads: stopping the runtime rules, expiry, Kueue checks and publishing");
                        }
                        running.stop().await;
                        if changed.is_err() {
                            return;
                        }
                    }
                    () = stopped(&mut stop) => {
                        running.stop().await;
                        return;
                    }
                }
            }
            None => {
                tokio::select! {
                    changed = async { leads.wait_for(|l| *l).await.map(|_| ()) } => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    () = stopped(&mut stop) => return,
                }
                tracing::info!("this replica leads: starting the runtime rules, expiry, Kueue checks and publishing");
                match context.start().await {
                    Ok(started) => work = Some(started),
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), "could not start the leader's work; trying again");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }
    }
}

impl Enforcer {
    /// Stops serving (requests in flight finish), stops the rules, and flushes the outbox for
    /// a few seconds.
    pub(crate) async fn stop(self) {
        let _ = self.stop_tx.send(true);
        // A slow client cannot hold the shutdown for long.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server).await;
        for webhook in self.webhooks {
            let _ = tokio::time::timeout(Duration::from_secs(5), webhook).await;
        }
        for watcher in self.slurm_watchers {
            let _ = tokio::time::timeout(Duration::from_secs(5), watcher).await;
        }
        // The leader's work stops, flushing the outbox.
        let _ =
            tokio::time::timeout(FLUSH_ON_SHUTDOWN + Duration::from_secs(20), self.leading).await;
        tracing::info!("enforcer stopped");
    }
}

/// Serves `app` over plain HTTP until `stop`, then lets requests in flight finish.
async fn serve_plain(
    listener: tokio::net::TcpListener,
    app: Router,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async move { stopped(&mut stop).await })
    .await
}

/// Serves `app` over TLS until `stop`, then lets requests in flight finish (the caller bounds
/// how long). A client that fails its handshake (plain HTTP, an unknown CA, no client
/// certificate when one is required) is dropped and logged at debug level.
async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: Router,
    acceptor: TlsAcceptor,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (socket, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, usually: wait instead of spinning.
                    tracing::warn!(error = %e, "accepting an API connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = stopped(&mut stop) => break,
        };
        let (acceptor, app, watcher) = (acceptor.clone(), app.clone(), graceful.watcher());
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(socket)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        tracing::debug!(peer = %peer, error = %e, "API TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(peer = %peer, "API TLS handshake timed out");
                        return;
                    }
                };
            // What axum's `into_make_service_with_connect_info` gives each request.
            let service = hyper::service::service_fn(
                move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(ConnectInfo(peer));
                    tower::ServiceExt::oneshot(app.clone(), request)
                },
            );
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(peer = %peer, error = %e, "API connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Every `tick`: releases leases past their end, settles the grants a dead replica left
/// unstarted (a shared store), and re-checks budgets (a new month lifts a budget block without
/// waiting for a signal).
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
        match service.settle_stranded_grants().await {
            Ok(settled) if settled.running + settled.failed > 0 => {
                tracing::info!(
                    running = settled.running,
                    failed = settled.failed,
                    "settled leases granted by a replica that never reported them started"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "settling stranded grants failed"),
        }
        if let Err(e) = rules.check_budgets().await {
            tracing::warn!(error = %e, "checking budgets failed");
        }
    }
}

/// Every `every` (the first time one `every` after the start): deletes the outbox rows Kafka
/// acknowledged more than `retention` ago by `clock` (the time the publisher marks them with),
/// in batches of [`PRUNE_BATCH`]. Without it `enforcer.db` grows with every record ever sent.
async fn prune_loop(
    store: Store,
    clock: Arc<dyn Clock>,
    retention: Duration,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stopped(&mut stop) => return,
        }
        let before = clock.now_ms().saturating_sub(retention_ms);
        match store.prune_outbox(before, PRUNE_BATCH).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                rows = n,
                retention = %humantime::format_duration(retention),
                "deleted published outbox rows past enforcer.outbox_retention"
            ),
            Err(e) => tracing::warn!(error = %e, "pruning the outbox failed; tried again later"),
        }
    }
}

/// The TLS tests' CAs and certificates, made with the openssl command line.
#[cfg(test)]
#[path = "../../tests/support/pki.rs"]
mod pki;

#[cfg(test)]
mod tests {
    //! Both ways of serving give every request the peer's address (what the API's per-source
    //! limits read), and both stop when told to.

    use std::net::SocketAddr;

    use axum::extract::ConnectInfo;
    use axum::routing::get;
    use axum::Router;
    use bytes::Bytes;
    use gpuwarden_enforcer::outbound::{http_client, http_client_with_tls, HttpClient};
    use gpuwarden_schema::config::TlsConfig;
    use gpuwarden_schema::tls::{client_config, ServerTls};
    use http_body_util::{BodyExt as _, Full};
    use tokio::sync::watch;
    use tokio_rustls::TlsAcceptor;

    fn app() -> Router {
        Router::new().route(
            "/peer",
            get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
        )
    }

    async fn peer_seen(client: &HttpClient, url: &str) -> String {
        let request = hyper::Request::get(url)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// The server answers `/peer` with an address of 127.0.0.1 and a port of the client's, then
    /// ends once stopped.
    async fn check(
        served: impl std::future::Future<Output = std::io::Result<()>> + Send + 'static,
        stop: watch::Sender<bool>,
        client: HttpClient,
        url: String,
    ) {
        let server = tokio::spawn(served);
        let peer: SocketAddr = peer_seen(&client, &url).await.parse().unwrap();
        assert_eq!(peer.ip().to_string(), "127.0.0.1");
        assert_ne!(peer.port(), 0);
        drop(client);
        stop.send(true).unwrap();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), server).await;
        assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
    }

    /// The pruning timer deletes the rows Kafka acknowledged longer ago than the retention and
    /// leaves the others, and stops when told to.
    #[tokio::test]
    async fn the_outbox_is_pruned_on_a_timer() {
        use gpuwarden_enforcer::store::audit::Audit;
        use gpuwarden_enforcer::store::Store;
        use gpuwarden_schema::{ActionKind, ManualClock, Outcome};
        const DAY: i64 = 86_400_000;
        const NOW: i64 = 100 * DAY;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("enforcer.db")).unwrap();
        for reason in ["old", "pending", "recent", "newest"] {
            let alert = Audit::fleet(ActionKind::Alert, reason).at(NOW - 30 * DAY, Outcome::Ok, "");
            store.record_action(&alert).await.unwrap();
        }
        let rows = store.outbox_pending(10).await.unwrap();
        let [old, _, recent, newest] = [0, 1, 2, 3].map(|i| rows[i].id);
        store
            .outbox_mark_published(&[old, newest], NOW - 30 * DAY)
            .await
            .unwrap();
        store
            .outbox_mark_published(&[recent], NOW - DAY)
            .await
            .unwrap();
        let (stop, stopping) = watch::channel(false);
        let pruning = tokio::spawn(super::prune_loop(
            store.clone(),
            std::sync::Arc::new(ManualClock::new(NOW)),
            std::time::Duration::from_secs(7 * 86_400),
            std::time::Duration::from_millis(10),
            stopping,
        ));
        let mut left = Vec::new();
        for _ in 0..500 {
            left = store.recent_actions(10, None).await.unwrap();
            if left.len() < 4 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let reasons: Vec<&str> = left.iter().map(|a| a.reason.as_str()).collect();
        assert_eq!(reasons, ["newest", "recent", "pending"]);
        stop.send(true).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), pruning)
            .await
            .expect("the timer stops when told to")
            .unwrap();
    }

    #[tokio::test]
    async fn plain_requests_carry_the_peer_address() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/peer", listener.local_addr().unwrap());
        let (stop, stopped) = watch::channel(false);
        let served = super::serve_plain(listener, app(), stopped);
        check(served, stop, http_client(), url).await;
    }

    #[tokio::test]
    async fn tls_requests_carry_the_peer_address() {
        let dir = tempfile::tempdir().unwrap();
        let ca = super::pki::Ca::new(dir.path(), "ca");
        let leaf = ca.server("api");
        let settings = TlsConfig {
            cert: leaf.cert.clone(),
            key: leaf.key.clone(),
            client_ca: None,
            client_auth: None,
        };
        let tls = ServerTls::load(&settings, "enforcer.tls", "api", &[b"http/1.1"]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/peer", listener.local_addr().unwrap());
        let (stop, stopped) = watch::channel(false);
        let served = super::serve_tls(listener, app(), TlsAcceptor::from(tls.config()), stopped);
        let client =
            http_client_with_tls(client_config(&ca.cert, None, ("ca", "cert", "key")).unwrap());
        check(served, stop, client, url).await;
    }
}
