//! `gpuwarden pipeline`: consumes gpuwarden's topics into the Parquet lake, serving `/metrics`
//! and the SQL endpoint.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use gpuwarden_pipeline::{consume, IngestOptions, Lake, Metrics};
use gpuwarden_schema::config;

use super::kafka::{shutdown_signal, KafkaConnection};

/// Consume Kafka into the Parquet lake.
///
/// Reads gpuwarden.samples, .leases, .signals and .actions in the consumer group
/// pipeline.group_id, writes them to <storage.data_dir>/lake/<table>/date=…/hour=…/ as Parquet
/// (zstd), and commits offsets only after the files are durable, so a crash loses nothing and a
/// replay rewrites the same files. Records that do not decode or validate go to the quarantine
/// table with the reason. Run more instances with the same group to share partitions.
///
/// Serves every lake table, read-only, over the Postgres wire protocol on pipeline.sql_listen
/// (psql, Grafana, any Postgres client), to the [[pipeline.sql_users]] with their password
/// (SCRAM-SHA-256), and to anyone without one only if pipeline.sql_allow_anonymous = true.
/// When neither lets anybody in, the pipeline runs without the endpoint and logs a warning (so
/// that instances run only for ingest need no users), unless --sql-listen asks for it: then it
/// refuses to start.
///
/// Ctrl-C or SIGTERM writes what is buffered, commits, and exits 0.
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

pub(crate) fn options(config: &config::Config) -> IngestOptions {
    IngestOptions {
        flush_rows: config.pipeline.flush_rows,
        flush_age: config.pipeline.flush_age,
        max_buffered_bytes: usize::try_from(config.pipeline.max_buffered_bytes)
            .unwrap_or(usize::MAX),
        writers: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
        write_throttle: None,
    }
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let lake = Lake::open(config.lake_dir()).context("opening the lake")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let kafka = KafkaConnection::open(&config)?;
        let metrics = Arc::new(Metrics::default());
        let listen = args.metrics_listen.unwrap_or(config.pipeline.metrics_listen);
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding /metrics to {listen}"))?;
        let address = listener.local_addr()?;
        let router = {
            let metrics = Arc::clone(&metrics);
            super::metrics_http::router(move || metrics.render())
        };
        let server = tokio::spawn(async move { axum::serve(listener, router).await });
        let sql = super::sql_endpoint::start(&config.pipeline, args.sql_listen, &lake).await?;
        let sql_address = sql.as_ref().map_or_else(|| "off".to_string(), |s| s.address.to_string());
        tracing::info!(metrics = %format!("http://{address}/metrics"), sql = %sql_address, lake = %lake.root().display(), kafka = %kafka.bootstrap, "pipeline running");
        let mut sql_task = sql.map(|sql| sql.task);

        let stop = Arc::new(AtomicBool::new(false));
        let ingest = {
            let (client, group, options, metrics, stop) = (kafka.client("pipeline"), config.pipeline.group_id.clone(), options(&config), Arc::clone(&metrics), Arc::clone(&stop));
            tokio::task::spawn_blocking(move || consume::run(&client, &group, lake, options, metrics, stop))
        };
        tokio::pin!(ingest);
        tokio::select! {
            _ = shutdown_signal() => {}
            result = &mut ingest => {
                result??;
                anyhow::bail!("ingest stopped by itself");
            }
            result = async { sql_task.as_mut().unwrap().await }, if sql_task.is_some() => {
                result?.context("the SQL endpoint failed")?;
                anyhow::bail!("the SQL endpoint stopped by itself");
            }
        }
        stop.store(true, Ordering::SeqCst);
        ingest.await?.context("ingest failed while shutting down")?;
        server.abort();
        if let Some(sql_task) = sql_task {
            sql_task.abort();
        }
        tracing::info!(records = metrics.records_in_total(), quarantined = metrics.quarantined_total(), "pipeline stopped");
        drop(kafka);
        Ok(ExitCode::SUCCESS)
    })
}
