//! `gpuwarden pipeline`: consumes gpuwarden's topics into the Parquet lake, rolls it up,
//! computes and publishes signals, and serves `/metrics` and the SQL endpoint.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use gpuwarden_pipeline::bounds::Bounds;
use gpuwarden_pipeline::{
    consume, hot, CompactOptions, Compactor, IngestOptions, Metrics, Rollup, RollupOptions,
    SignalsOptions,
};
use gpuwarden_schema::kafka::GroupMembership;
use gpuwarden_schema::signing::SigningKeys;
use gpuwarden_schema::tls::ServerTls;
use gpuwarden_schema::{config, Clock, SystemClock};

use super::kafka::{arm_shutdown_deadline, shutdown_signal, KafkaConnection};

/// Consume Kafka into the lake's Delta tables, roll them up, and publish signals for the
/// enforcer.
///
/// Reads gpuwarden.samples, .leases, .signals and .actions in the consumer group
/// pipeline.group_id into one Delta table per topic, <lake>/<table>/ (Parquet, zstd), <lake>
/// being storage.lake (a directory or an S3 prefix) or, unset, <storage.data_dir>/lake. Each
/// flush is one commit that carries the partition's last offset as a Delta transaction, and
/// Kafka's offsets are committed after it: a crash loses nothing, and a replay, or two
/// instances that both think they own a partition, adds every record once (a commit leaves out
/// what the table holds; a broker started again empty is another cluster, whose records are
/// new). Any Delta reader (DuckDB, polars, Spark) reads the tables as they are. Records that do not decode or validate go to the quarantine
/// table with the reason, and so do those whose time a host's wrong clock set: more than
/// pipeline.clock.max_skew (5m) ahead of their arrival, or, for samples, more than
/// pipeline.clock.max_age (1d) behind it. Each host's measured clock skew is on /metrics; a host
/// out of bounds is reported in a clock_skew signal, which the enforcer alerts on. Every pipeline.rollup_every it rolls up what changed (as `gpuwarden
/// rollup` does), so the open hour's spend shows in team_hourly within minutes, then compacts
/// the final hours (as `gpuwarden compact` does). Run more instances with the same group to
/// share partitions; one at a time rolls up and one compacts (a lock file, or in a bucket a
/// lease object).
///
/// Computes signals for the enforcer and publishes them on gpuwarden.signals: it keeps the last
/// pipeline.signals.window of samples (read from gpuwarden.samples outside the consumer group)
/// and every lease event in memory, and each time event time (the time the fleet as a whole has
/// reached, not the latest any one host sent) passes a multiple of pipeline.signals.every it
/// publishes lease_utilization per open lease, gpu_unattributed per
/// busy GPU no lease holds, and team_spend per team (month-to-date cost from team_hourly, and
/// the burn rate of its open leases). One instance per lake publishes (<lake>/signals.lock);
/// the others stand by and take over when it stops.
///
/// Serves every lake table, read-only, over the Postgres wire protocol on pipeline.sql_listen
/// (psql, Grafana, any Postgres client), to the [[pipeline.sql_users]] with their password
/// (SCRAM-SHA-256), and to anyone without one only if pipeline.sql_allow_anonymous = true.
/// When neither lets anybody in, the pipeline runs without the endpoint and logs a warning (so
/// that instances run only for ingest need no users), unless --sql-listen asks for it: then it
/// refuses to start.
///
/// Queries run on threads of their own, at a lower priority than the rest, under the limits of
/// [pipeline.sql_limits] (and each user's own): a statement timeout (SQLSTATE 57014), memory
/// per query (53200), queries per user and in all, and connections (53300). psql's Ctrl-C
/// cancels a query, and so does its client disconnecting.
///
/// Ctrl-C or SIGTERM cancels running SQL queries (their clients get SQLSTATE 57P01), writes
/// what is buffered, commits, and exits 0, within pipeline.shutdown_deadline (30 s by default;
/// past it, or at a second Ctrl-C, the process exits 1 at once, and what it had not committed
/// is read again at the next start).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file.
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Address for /metrics; overrides pipeline.metrics_listen (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", env = "GPUWARDEN_PIPELINE_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Address for the SQL endpoint; overrides pipeline.sql_listen (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", env = "GPUWARDEN_PIPELINE_SQL_LISTEN")]
    sql_listen: Option<std::net::SocketAddr>,
}

pub(crate) fn options(config: &config::Config, clock: Arc<dyn Clock>) -> IngestOptions {
    IngestOptions {
        flush_rows: config.pipeline.flush_rows,
        flush_age: config.pipeline.flush_age,
        max_buffered_bytes: usize::try_from(config.pipeline.max_buffered_bytes)
            .unwrap_or(usize::MAX),
        writers: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
        write_throttle: None,
        bounds: Bounds::streaming(&config.pipeline.clock),
        clock,
        signing: SigningKeys::from_config(&config.signing),
    }
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    // A bad storage.lake is refused before anything connects (start opens the lake after Kafka).
    super::lake_location(&config, "pipeline")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let kafka = KafkaConnection::open(&config)?;
        let listen = args
            .metrics_listen
            .unwrap_or(config.pipeline.metrics_listen);
        let mut pipeline = start(
            &config,
            &kafka,
            Arc::new(SystemClock),
            listen,
            args.sql_listen,
        )
        .await?;
        tokio::select! {
            _ = shutdown_signal() => {}
            failed = pipeline.failed() => return Err(failed),
        }
        arm_shutdown_deadline(
            config.pipeline.shutdown_deadline,
            "pipeline.shutdown_deadline",
        );
        pipeline.stop().await?;
        drop(kafka);
        Ok(ExitCode::SUCCESS)
    })
}

type Task<E> = Option<tokio::task::JoinHandle<Result<(), E>>>;

/// A running pipeline: ingest, rollups, signals, the SQL endpoint and `/metrics`.
pub(crate) struct Pipeline {
    /// Where `/metrics` is served.
    pub(crate) metrics_address: SocketAddr,
    /// Where the SQL endpoint listens, when it runs.
    pub(crate) sql_address: Option<SocketAddr>,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
    // Whichever way the pipeline ends, the blocking threads are told to stop: the runtime's
    // drop waits for them.
    _stop_on_exit: StopOnDrop,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    rollups: tokio::task::JoinHandle<()>,
    ingest: Task<gpuwarden_pipeline::IngestError>,
    signals: Task<gpuwarden_pipeline::hot::SignalsError>,
    sql: Option<gpuwarden_pipeline::endpoint::Server>,
    /// Reserves the ingest consumer's `group.instance.id` while the pipeline runs.
    _membership: GroupMembership,
}

/// Opens the lake and starts ingest from `kafka`, the rollups, the signals loop, the SQL
/// endpoint (on `sql_listen`, else pipeline.sql_listen) and `/metrics` on `metrics_listen`.
/// Records arrive on `clock`: the fleet's, so that its event time can be bounded.
pub(crate) async fn start(
    config: &config::Config,
    kafka: &KafkaConnection,
    clock: Arc<dyn Clock>,
    metrics_listen: SocketAddr,
    sql_listen: Option<SocketAddr>,
) -> anyhow::Result<Pipeline> {
    let lake = super::open_lake(config, "pipeline")?;
    let metrics = Arc::new(Metrics::default());
    let listener = tokio::net::TcpListener::bind(metrics_listen)
        .await
        .with_context(|| format!("binding /metrics to {metrics_listen}"))?;
    let metrics_address = listener.local_addr()?;
    // The SQL endpoint's certificate reloads, once it runs with one.
    let sql_tls = Arc::new(std::sync::OnceLock::<ServerTls>::new());
    let router = {
        let (metrics, sql_tls) = (Arc::clone(&metrics), Arc::clone(&sql_tls));
        super::metrics_http::router(move || {
            let mut page = metrics.render();
            gpuwarden_schema::kafka::broker_errors().render(&mut page);
            if let Some(tls) = sql_tls.get() {
                tls.render_metrics(&mut page);
            }
            page
        })
    };
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let sql = super::sql_endpoint::start(config, sql_listen, &lake, &metrics).await?;
    if let Some(tls) = sql.as_ref().and_then(|s| s.tls.clone()) {
        let _ = sql_tls.set(tls);
    }
    let sql_address = sql.as_ref().map(|s| s.address);
    tracing::info!(metrics = %format!("http://{metrics_address}/metrics"), sql = %sql_address.map_or_else(|| "off".to_string(), |a| a.to_string()), lake = %lake.root().display(), kafka = %kafka.bootstrap, "pipeline running");

    let rollups = tokio::spawn(rollup_loop(
        Rollup::new(
            lake.clone(),
            RollupOptions::from_config(config).with_clock(Arc::clone(&clock)),
        ),
        Compactor::new(lake.clone(), CompactOptions::from_config(config)),
        config.pipeline.rollup_every,
        Arc::clone(&metrics),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let signals = {
        let (client, lake, options, metrics, stop) = (
            kafka.client("signals"),
            lake.clone(),
            SignalsOptions::from_config(config, Arc::clone(&clock)),
            Arc::clone(&metrics),
            Arc::clone(&stop),
        );
        tokio::task::spawn_blocking(move || hot::run(&client, lake, options, metrics, stop))
    };
    // Static membership: a restarted pipeline takes its partitions back at once (on Kafka; the
    // mock broker of tests ignores it and forgets the killed member after kafka.session_timeout).
    let membership = GroupMembership::resolve(config, "pipeline")
        .context("choosing the ingest consumer's group.instance.id")?;
    let ingest = {
        let mut client = kafka.client("pipeline");
        membership.apply(&mut client);
        let (client, group, options, metrics, stop) = (
            client,
            config.pipeline.group_id.clone(),
            options(config, clock),
            Arc::clone(&metrics),
            Arc::clone(&stop),
        );
        tokio::task::spawn_blocking(move || {
            consume::run(&client, &group, lake, options, metrics, stop)
        })
    };
    Ok(Pipeline {
        metrics_address,
        sql_address,
        metrics,
        _stop_on_exit: StopOnDrop(Arc::clone(&stop)),
        stop,
        server,
        rollups,
        ingest: Some(ingest),
        signals: Some(signals),
        sql: sql.map(|s| s.server),
        _membership: membership,
    })
}

/// Waits for the SQL endpoint to stop by itself; never ends when there is none.
async fn sql_stopped(
    server: &mut Option<gpuwarden_pipeline::endpoint::Server>,
) -> Result<(), gpuwarden_pipeline::endpoint::EndpointError> {
    let Some(running) = server.as_mut() else {
        return std::future::pending().await;
    };
    let result = running.stopped().await;
    *server = None;
    result
}

/// Waits for `task` to end, taking it; never ends when there is none.
async fn ended<E>(task: &mut Task<E>) -> Result<Result<(), E>, tokio::task::JoinError> {
    match task.as_mut() {
        Some(handle) => {
            let result = handle.await;
            *task = None;
            result
        }
        None => std::future::pending().await,
    }
}

impl Pipeline {
    /// Waits until a part stops by itself (it should not), and says which and why.
    pub(crate) async fn failed(&mut self) -> anyhow::Error {
        let (part, result): (&str, anyhow::Result<()>) = tokio::select! {
            r = ended(&mut self.ingest) => ("ingest", r.map_err(Into::into).and_then(|r| r.map_err(Into::into))),
            r = ended(&mut self.signals) => ("the signals loop", r.map_err(Into::into).and_then(|r| r.map_err(Into::into))),
            r = sql_stopped(&mut self.sql) => ("the SQL endpoint", r.map_err(Into::into)),
        };
        match result {
            Ok(()) => anyhow::anyhow!("{part} stopped by itself"),
            Err(e) => e.context(format!("{part} failed")),
        }
    }

    /// Cancels running SQL queries (their clients are told why) and closes the SQL endpoint;
    /// the rest runs on.
    pub(crate) async fn stop_sql(&mut self) {
        if let Some(sql) = self.sql.take() {
            sql.shut_down(SQL_SHUTDOWN_GRACE).await;
        }
    }

    /// Cancels running SQL queries and closes the endpoint, then stops reading, writes and
    /// commits what is buffered, and stops serving `/metrics`.
    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        self.stop_sql().await;
        self.stop.store(true, Ordering::SeqCst);
        if let Some(ingest) = self.ingest.take() {
            ingest.await?.context("ingest failed while shutting down")?;
        }
        if let Some(signals) = self.signals.take() {
            signals
                .await?
                .context("the signals loop failed while shutting down")?;
        }
        self.server.abort();
        self.rollups.abort();
        tracing::info!(
            records = self.metrics.records_in_total(),
            quarantined = self.metrics.quarantined_total(),
            "pipeline stopped"
        );
        Ok(())
    }
}

/// How long canceled SQL queries have to tell their clients so before the endpoint closes.
const SQL_SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Sets the stop flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Rolls up every `every` until aborted, then compacts the hours the rollups found final and
/// deletes those past their retention. A failed run is logged and retried at the next tick:
/// the marks, the state file and the compaction manifests keep what it had still to do.
async fn rollup_loop(
    rollup: Rollup,
    compactor: Compactor,
    every: std::time::Duration,
    metrics: Arc<Metrics>,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let result = rollup.run().await;
        metrics.rolled_up(matches!(
            result,
            Err(ref e) if !matches!(e, gpuwarden_pipeline::rollup::RollupError::Busy(_))
        ));
        match result {
            Ok(report) if report.hours > 0 => tracing::info!(
                hours = report.hours,
                final_hours = report.final_hours,
                incremental_hours = report.incremental_hours,
                team_rows = report.team_rows,
                leases = report.leases,
                watermark = report.watermark,
                elapsed_ms = report.elapsed.as_millis() as u64,
                "rolled up"
            ),
            Ok(_) => {}
            Err(gpuwarden_pipeline::rollup::RollupError::Busy(path)) => {
                tracing::debug!(lock = %path.display(), "another process is rolling up this lake");
            }
            Err(e) => tracing::error!(error = %e, "rollup failed; retrying at the next tick"),
        }
        let watermark = gpuwarden_pipeline::compact::rollup_watermark(compactor.lake());
        match compactor.run(watermark).await {
            Ok(done) => metrics.maintained(Some(&done)),
            Err(gpuwarden_pipeline::compact::CompactError::Busy(path)) => {
                tracing::debug!(lock = %path.display(), "another process is compacting this lake");
            }
            Err(e) => {
                metrics.maintained(None);
                tracing::error!(error = %e, "compaction failed; retrying at the next tick");
            }
        }
    }
}
