//! `gpuwarden collect`: samples this host's GPUs (or a simulated fleet) and publishes them to
//! Kafka, serving `/metrics` meanwhile.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gpuwarden_collector::kubelet::KubeletSettings;
use gpuwarden_collector::sim::Fleet;
use gpuwarden_collector::{Collector, KafkaSink, Metrics, SinkSettings, SourceSpec};
use gpuwarden_schema::config::{self, CollectorSource, DriverKind};
use gpuwarden_schema::{AcceleratedClock, Clock, SystemClock};

use super::kafka::{shutdown_signal, KafkaConnection};

/// Sample GPUs (NVML or a simulated fleet) and publish them to Kafka.
///
/// Every interval (collector.interval, default 5s) each GPU of this host becomes one Sample on
/// the gpuwarden.samples topic, keyed by its UUID. With --source simulated, the fleet of the
/// config's `simulated` substrate is sampled instead, and it follows the leases the enforcer
/// grants. GPU gauges with dcgm-exporter's names are served on collector.metrics_listen/metrics.
/// Ctrl-C or SIGTERM publishes what is buffered, then exits.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file.
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Where samples come from; overrides collector.source.
    #[arg(long, value_enum, env = "GPUWARDEN_COLLECTOR_SOURCE")]
    source: Option<SourceArg>,
    /// Sampling interval, e.g. "5s"; overrides collector.interval.
    #[arg(long, value_parser = config::parse_duration, env = "GPUWARDEN_COLLECTOR_INTERVAL")]
    interval: Option<Duration>,
    /// Event time per wall time for the simulated source (60 = an hour per minute); overrides
    /// collector.simulated.speed.
    #[arg(long, env = "GPUWARDEN_SPEED")]
    speed: Option<f64>,
    /// Path of libnvidia-ml.so; overrides collector.nvml_library.
    #[arg(long, value_name = "PATH", env = "GPUWARDEN_NVML_LIBRARY")]
    nvml_library: Option<PathBuf>,
    /// The kubelet's PodResources socket, to attribute GPUs to pods on a Kubernetes node;
    /// overrides collector.kubelet_socket.
    #[arg(long, value_name = "PATH", env = "GPUWARDEN_KUBELET_SOCKET")]
    kubelet_socket: Option<PathBuf>,
    /// Address for /metrics; overrides collector.metrics_listen (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", env = "GPUWARDEN_COLLECTOR_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Stop after this much wall time (for scripted runs), e.g. "30s".
    #[arg(long, value_parser = config::parse_duration)]
    run_for: Option<Duration>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum SourceArg {
    Nvml,
    Simulated,
}

pub(crate) fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let mut config = config::load(&args.config)?;
    if let Some(source) = args.source {
        config.collector.source = match source {
            SourceArg::Nvml => CollectorSource::Nvml,
            SourceArg::Simulated => CollectorSource::Simulated,
        };
    }
    if let Some(socket) = args.kubelet_socket {
        config.collector.kubelet_socket = Some(socket);
    }
    let c = &config.collector;
    let interval = args.interval.unwrap_or(c.interval);
    anyhow::ensure!(
        interval >= Duration::from_secs(1) || c.source == CollectorSource::Simulated,
        "--interval must be at least 1s for NVML"
    );
    let speed = args.speed.unwrap_or(c.simulated.speed);
    anyhow::ensure!(
        speed.is_finite() && speed > 0.0,
        "--speed must be a positive number, got {speed}"
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let kafka = KafkaConnection::open(&config)?;
        let clock: Arc<dyn Clock> = if speed == 1.0 || config.collector.source == CollectorSource::Nvml {
            Arc::new(SystemClock)
        } else {
            Arc::new(AcceleratedClock::from_now(speed))
        };
        let listen = args.metrics_listen.unwrap_or(config.collector.metrics_listen);
        let collecting = start(&config, &kafka, clock, interval, args.nvml_library.clone(), listen).await?;
        match args.run_for {
            Some(limit) => {
                tokio::select! {
                    _ = tokio::time::sleep(limit) => tracing::info!("--run-for elapsed; shutting down"),
                    _ = shutdown_signal() => {}
                }
            }
            None => shutdown_signal().await,
        }
        collecting.stop().await?;
        drop(kafka);
        Ok(std::process::ExitCode::SUCCESS)
    })
}

/// A running collector and its `/metrics` server.
pub(crate) struct Collecting {
    /// Where `/metrics` is served.
    pub(crate) metrics_address: std::net::SocketAddr,
    collector: Collector,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Starts sampling `config.collector.source` every `interval` of `clock`'s time into
/// gpuwarden.samples on `kafka`, and serves `/metrics` on `listen`. A simulated fleet follows
/// the leases on gpuwarden.leases.
pub(crate) async fn start(
    config: &config::Config,
    kafka: &KafkaConnection,
    clock: Arc<dyn Clock>,
    interval: Duration,
    nvml_library: Option<PathBuf>,
    listen: std::net::SocketAddr,
) -> anyhow::Result<Collecting> {
    let metrics = Arc::new(Metrics::default());
    let spec = match config.collector.source {
        CollectorSource::Nvml => {
            let host = config.collector.host.clone().unwrap_or_else(hostname);
            let library = nvml_library.or(config.collector.nvml_library.clone());
            let slurm_cluster = config.collector.slurm_cluster.clone();
            let kubelet = config
                .collector
                .kubelet_socket
                .as_ref()
                .map(|socket| KubeletSettings {
                    pod_logs_dir: config.collector.pod_logs_dir.clone(),
                    ..KubeletSettings::new(socket, interval)
                });
            SourceSpec::Nvml {
                library,
                host,
                slurm_cluster,
                kubelet,
                dmi_entries_dir: Some(config.collector.dmi_entries_dir.clone()),
            }
        }
        CollectorSource::Simulated => {
            let substrate = match &config.collector.simulated.substrate {
                Some(name) => config.substrate(name).with_context(|| format!("no substrate is named `{name}`"))?,
                None => config
                    .substrates
                    .iter()
                    .find(|s| s.driver == DriverKind::Simulated)
                    .context("--source simulated needs a [[substrates]] entry with driver = \"simulated\"")?,
            };
            let fleet = Fleet::new(substrate, config.collector.simulated.seed)?;
            tracing::info!(substrate = %substrate.name, gpus = fleet.gpus().len(), speed = clock.speed(), "simulated fleet");
            SourceSpec::Simulated {
                fleet: Box::new(fleet),
                leases: Some(kafka.client("fleet")),
            }
        }
    };
    let settings = SinkSettings {
        max_buffer_bytes: usize::try_from(config.collector.buffer_max_bytes).unwrap_or(usize::MAX),
        max_buffer_age: config.collector.buffer_max_age,
        ..SinkSettings::default()
    };
    let sink = KafkaSink::start(
        &kafka.client("collector"),
        gpuwarden_schema::topics::SAMPLES,
        settings,
        Arc::clone(&metrics),
    )
    .context("creating the Kafka producer")?;
    let collector = Collector::start(spec, sink, interval, clock, Arc::clone(&metrics))?;

    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding /metrics to {listen}"))?;
    let metrics_address = listener.local_addr()?;
    tracing::info!(metrics = %format!("http://{metrics_address}/metrics"), kafka = %kafka.bootstrap, interval = %humantime::format_duration(interval), "collector running");
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            super::metrics_http::router(move || metrics.render()),
        )
        .await
    });
    Ok(Collecting {
        metrics_address,
        collector,
        server,
    })
}

impl Collecting {
    /// Stops sampling and publishes what is buffered (for up to 10 s).
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        let collector = self.collector;
        let report =
            tokio::task::spawn_blocking(move || collector.stop(Duration::from_secs(10))).await?;
        self.server.abort();
        tracing::info!(
            published = report.published,
            dropped = report.dropped,
            "collector stopped"
        );
        Ok(())
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
