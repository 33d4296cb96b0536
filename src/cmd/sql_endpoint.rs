//! The pipeline's SQL endpoint: decides whether it runs, binds it, loads its certificate
//! (`[pipeline.sql_tls]`, through [`gpuwarden_schema::tls`]), and serves the lake's session on
//! it with [`gpuwarden_pipeline::endpoint`], its queries run by a
//! [`gpuwarden_pipeline::governor::Governor`] under `[pipeline.sql_limits]`.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use gpuwarden_pipeline::endpoint::{Auth, Server};
use gpuwarden_pipeline::governor::{Governor, GovernorOptions};
use gpuwarden_pipeline::{Lake, Metrics};
use gpuwarden_schema::config::{self, Config};
use gpuwarden_schema::tls::ServerTls;

/// A running endpoint: its address, its server, and its TLS when it serves TLS.
pub(crate) struct SqlEndpoint {
    pub(crate) address: SocketAddr,
    pub(crate) server: Server,
    pub(crate) tls: Option<ServerTls>,
}

/// Binds and starts the endpoint, or returns `None` when nobody could log in to it (no
/// `[[pipeline.sql_users]]` and anonymous access off) and it was not asked for with `listen`.
/// Besides the lake it serves the config's `teams` and `workloads`. Failed and refused logins
/// are counted in `metrics`.
pub(crate) async fn start(
    full: &Config,
    listen: Option<SocketAddr>,
    lake: &Lake,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Option<SqlEndpoint>> {
    let config = &full.pipeline;
    let auth = Auth::from_config(config).counting_in(Arc::clone(metrics));
    if !auth.admits_anyone() {
        anyhow::ensure!(
            listen.is_none(),
            "--sql-listen was given but nobody could log in: add a [[pipeline.sql_users]] entry \
             (name, password) or set pipeline.sql_allow_anonymous = true"
        );
        tracing::warn!(
            "SQL endpoint off: no [[pipeline.sql_users]] and pipeline.sql_allow_anonymous is false"
        );
        return Ok(None);
    }
    let listen = listen.unwrap_or(config.sql_listen);
    let tls = match &config.sql_tls {
        Some(settings) => Some(ServerTls::load(
            settings,
            "pipeline.sql_tls",
            "sql",
            &[b"postgresql"],
        )?),
        None => {
            // The config's own address was checked when it was loaded; this is for --sql-listen.
            if let Some(why) = full.plaintext_refusal(config::Listener::Sql, listen) {
                anyhow::bail!("--sql-listen: {why}");
            }
            None
        }
    };
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("binding the SQL endpoint to {listen}"))?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;
    let options = GovernorOptions::from_config(&config.sql_limits, &config.sql_users);
    let threads = options.threads;
    let governor = Governor::new(options).context("starting the SQL query threads")?;
    let ctx = gpuwarden_pipeline::sql::context_with_config(
        lake,
        full,
        &governor,
        gpuwarden_pipeline::delta::AsOf::Latest,
    )
    .await
    .context("registering the lake's tables for the SQL endpoint")?;
    if auth.allows_anonymous() {
        tracing::warn!(sql = %address, "the SQL endpoint accepts connections without a password (pipeline.sql_allow_anonymous)");
    }
    let limits = &config.sql_limits;
    tracing::debug!(
        threads,
        max_queries = limits.max_queries,
        max_connections = limits.max_connections,
        "SQL endpoint limits"
    );
    let server = Server::start(
        listener,
        Arc::new(ctx),
        auth,
        governor,
        limits.max_connections,
        tls.as_ref()
            .map(|tls| tokio_rustls::TlsAcceptor::from(tls.config())),
    )?;
    Ok(Some(SqlEndpoint {
        address,
        server,
        tls,
    }))
}
