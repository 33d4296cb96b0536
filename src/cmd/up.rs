//! `gpuwarden up`: the collector, the pipeline and the enforcer in one process, on one clock.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use gpuwarden_schema::config::{self, CollectorSource};
use gpuwarden_schema::{AcceleratedClock, Clock, SystemClock};

use super::kafka::{arm_shutdown_deadline, shutdown_signal, KafkaConnection};

/// Run the collector, the pipeline and the enforcer together in one process.
///
/// Each does what `gpuwarden collect`, `gpuwarden pipeline` and `gpuwarden enforce` do with the
/// same config, and they still meet only in Kafka: the configured cluster, or with
/// kafka.brokers = "embedded" a broker inside this process. It logs one line,
/// "gpuwarden up", with every address: the API, the SQL endpoint, the metrics and the lake.
///
/// With a simulated fleet (collector.source = "simulated"), --speed runs event time faster
/// than the wall clock (60 = an hour a minute), from --start (default now): rules, expiry and
/// the fleet all follow it. NVML runs in real time only.
///
/// Ctrl-C or SIGTERM cancels running SQL queries, then stops the collector (publishing what it
/// holds), the enforcer (flushing its outbox) and the pipeline (writing and committing what it
/// read), within pipeline.shutdown_deadline (past it, or at a second Ctrl-C, the process exits
/// 1 at once).
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file.
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Event time per wall time (simulated fleet only); overrides collector.simulated.speed.
    #[arg(long, env = "GPUWARDEN_SPEED")]
    speed: Option<f64>,
    /// Event time to start at, RFC 3339 (`2026-01-10T01:00:00Z`); default now. Needs a
    /// simulated fleet.
    #[arg(long, value_parser = parse_time)]
    start: Option<i64>,
    /// Address of the admission API; overrides enforcer.listen.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Address of the SQL endpoint; overrides pipeline.sql_listen.
    #[arg(long, value_name = "ADDR")]
    sql_listen: Option<SocketAddr>,
}

pub(crate) fn parse_time(text: &str) -> Result<i64, String> {
    humantime::parse_rfc3339_weak(text)
        .map_err(|e| format!("{e}; expected a time like 2026-01-10T01:00:00Z"))
        .and_then(|t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .map_err(|_| "times before 1970 are not supported".to_string())
        })
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut config = config::load(&args.config)?;
    if config.signing.key.is_none() {
        // Everything runs here, so a key made for this run signs and checks every record; a
        // pipeline or enforcer started apart from it needs the config's own.
        tracing::info!("no [signing] key in the config: signing this run's signals and actions with a key made for it");
        config.signing.key = Some(super::fresh_signing_key()?);
    }
    let config = Arc::new(config);
    let simulated = config.collector.source == CollectorSource::Simulated;
    let speed = args.speed.unwrap_or(if simulated {
        config.collector.simulated.speed
    } else {
        1.0
    });
    anyhow::ensure!(
        speed.is_finite() && speed > 0.0,
        "--speed must be a positive number, got {speed}"
    );
    anyhow::ensure!(
        simulated || (speed == 1.0 && args.start.is_none()),
        "--speed and --start need collector.source = \"simulated\": NVML runs in real time"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let clock: Arc<dyn Clock> = match args.start {
            Some(start) => Arc::new(AcceleratedClock::new(start, speed)),
            None if speed != 1.0 => Arc::new(AcceleratedClock::from_now(speed)),
            None => Arc::new(SystemClock),
        };
        let listens = Listens {
            api: args.listen.unwrap_or(config.enforcer.listen),
            sql: args.sql_listen,
            pipeline_metrics: config.pipeline.metrics_listen,
            collector_metrics: config.collector.metrics_listen,
        };
        let stack = Stack::start(config, clock, listens).await?;
        tracing::info!(
            api = %stack.api_url(),
            sql = %stack.sql().map_or_else(|| "off".to_string(), |a| a.to_string()),
            pipeline_metrics = %format!("http://{}/metrics", stack.pipeline_metrics()),
            collector_metrics = %format!("http://{}/metrics", stack.collector_metrics()),
            lake = %stack.lake,
            kafka = %stack.kafka.bootstrap,
            speed,
            "gpuwarden up"
        );
        stack.run_until_stopped(None).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Where a [`Stack`] listens.
pub(crate) struct Listens {
    pub(crate) api: SocketAddr,
    /// `None`: `pipeline.sql_listen`.
    pub(crate) sql: Option<SocketAddr>,
    pub(crate) pipeline_metrics: SocketAddr,
    pub(crate) collector_metrics: SocketAddr,
}

/// The collector, the pipeline and the enforcer running in this process.
pub(crate) struct Stack {
    /// pipeline.shutdown_deadline: how long stopping may take.
    shutdown_deadline: std::time::Duration,
    /// The lake: a directory, or `s3://bucket/prefix`.
    pub(crate) lake: String,
    pub(crate) kafka: Arc<KafkaConnection>,
    pipeline: super::pipeline::Pipeline,
    enforcer: super::enforce::Enforcer,
    collecting: super::collect::Collecting,
}

impl Stack {
    /// Connects to Kafka (starting the embedded broker if configured) and starts the pipeline,
    /// the enforcer and the collector, in that order, on `clock`.
    pub(crate) async fn start(
        config: Arc<config::Config>,
        clock: Arc<dyn Clock>,
        listens: Listens,
    ) -> anyhow::Result<Stack> {
        let lake = super::lake_location(&config, "up")?.to_string();
        let kafka = Arc::new(KafkaConnection::open(&config).context("connecting to Kafka")?);
        let pipeline = super::pipeline::start(
            &config,
            &kafka,
            clock.clone(),
            listens.pipeline_metrics,
            listens.sql,
        )
        .await
        .context("starting the pipeline")?;
        let enforcer =
            match super::enforce::start(config.clone(), kafka.clone(), clock.clone(), listens.api)
                .await
            {
                Ok(enforcer) => enforcer,
                Err(e) => {
                    let _ = pipeline.stop().await;
                    return Err(e.context("starting the enforcer"));
                }
            };
        let collecting = match super::collect::start(
            &config,
            &kafka,
            clock,
            config.collector.interval,
            None,
            listens.collector_metrics,
        )
        .await
        {
            Ok(collecting) => collecting,
            Err(e) => {
                // What started must stop: their threads would otherwise keep the process alive
                // (a machine without NVML left `up` hanging, its error never printed).
                enforcer.stop().await;
                let _ = pipeline.stop().await;
                return Err(e.context("starting the collector"));
            }
        };
        Ok(Stack {
            shutdown_deadline: config.pipeline.shutdown_deadline,
            lake,
            kafka,
            pipeline,
            enforcer,
            collecting,
        })
    }

    /// The admission API's address.
    pub(crate) fn api(&self) -> SocketAddr {
        self.enforcer.address
    }

    /// The admission API's base URL (`https://` when it serves TLS).
    pub(crate) fn api_url(&self) -> &str {
        &self.enforcer.url
    }

    /// The SQL endpoint's address, if it runs.
    pub(crate) fn sql(&self) -> Option<SocketAddr> {
        self.pipeline.sql_address
    }

    /// The pipeline's `/metrics` address.
    pub(crate) fn pipeline_metrics(&self) -> SocketAddr {
        self.pipeline.metrics_address
    }

    /// The collector's `/metrics` address.
    pub(crate) fn collector_metrics(&self) -> SocketAddr {
        self.collecting.metrics_address
    }

    /// Runs until Ctrl-C or SIGTERM (or `limit`, or a part of the pipeline failing), then stops
    /// the collector (publishing what it holds), the enforcer (flushing its outbox) and the
    /// pipeline (writing and committing what it read).
    pub(crate) async fn run_until_stopped(
        mut self,
        limit: Option<std::time::Duration>,
    ) -> anyhow::Result<()> {
        let limit = async {
            match limit {
                Some(limit) => tokio::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        let failure = tokio::select! {
            _ = shutdown_signal() => {
                arm_shutdown_deadline(self.shutdown_deadline, "pipeline.shutdown_deadline");
                None
            }
            _ = limit => {
                tracing::info!("--run-for elapsed; shutting down");
                None
            }
            failed = self.pipeline.failed() => {
                tracing::error!(error = %format!("{failed:#}"), "the pipeline stopped; shutting down");
                Some(failed)
            }
        };
        self.pipeline.stop_sql().await;
        self.collecting.stop().await?;
        self.enforcer.stop().await;
        self.pipeline.stop().await?;
        failure.map_or(Ok(()), Err)
    }
}
