//! The SQL endpoint: serves a DataFusion session over the Postgres wire protocol, so that psql,
//! Grafana and any other Postgres client query the lake. datafusion-postgres (on pgwire) speaks
//! the protocol and answers the catalog queries clients send; this module owns what the library
//! leaves open: who may connect (SCRAM-SHA-256 against `[[pipeline.sql_users]]`, anonymous only
//! when `pipeline.sql_allow_anonymous` is set), what may run (queries and the session statements
//! clients send on connect, never anything that writes or changes the session every connection
//! shares), and the few Postgres functions client queries need that neither DataFusion nor
//! datafusion-postgres provides. It talks to nothing but its listener and the session it is given.
//!
//! Failed logins are limited ([`gpuwarden_schema::login_limit`], `[pipeline.login_limits]`): a
//! wrong password counts against the client's source address and against the user name it
//! tried; while either is locked out, a connection is refused at its startup message with
//! SQLSTATE 28000 and a message that says when to try again, before any SCRAM exchange. A login
//! that succeeds clears its user's count.
//!
//! Connections are handled on threads of their own ([`Server`]), and their queries run on the
//! [`Governor`]'s: each connection runs inside its [`Session`], so that the governor applies its
//! user's limits, a Postgres cancel request (psql's Ctrl-C) stops its query, and a client that
//! disconnects has its query stopped at once. Errors of the governor reach the client with the
//! SQLSTATE Postgres would give: 57014 canceled or timed out, 53200 out of memory, 53300 too many
//! connections or queries.
//!
//! With a TLS acceptor (`[pipeline.sql_tls]`), pgwire answers a client's SSLRequest (and direct
//! TLS, ALPN `postgresql`) with it, and a client that logs in without TLS is refused with 28000
//! (`RequireTls`): passwords and results never cross the network in the clear. Cancel
//! requests, which carry no password and which libpq sends unencrypted, are still honoured.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use datafusion::arrow::array::{Array, ArrayRef, AsArray, StringBuilder};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::ParamValues;
use datafusion::error::DataFusionError;
use datafusion::execution::context::SQLOptions;
use datafusion::logical_expr::{
    ColumnarValue, EmptyRelation, LogicalPlan, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature, TypeSignature, Volatility,
};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::{ObjectName, Set, Statement};
use datafusion_postgres::datafusion_pg_catalog::pg_catalog::context::EmptyContextProvider;
use datafusion_postgres::datafusion_pg_catalog::pg_catalog::setup_pg_catalog;
use datafusion_postgres::hooks::cursor::CursorStatementHook;
use datafusion_postgres::hooks::set_show::SetShowHook;
use datafusion_postgres::hooks::transactions::TransactionStatementHook;
use datafusion_postgres::hooks::HookClient;
use datafusion_postgres::pgwire::api::auth::sasl::scram::{
    gen_salted_password, random_nonce, ScramAuth, SCRAM_ITERATIONS,
};
use datafusion_postgres::pgwire::api::auth::sasl::SASLAuthStartupHandler;
use datafusion_postgres::pgwire::api::auth::{
    finish_authentication, protocol_negotiation, save_startup_parameters_to_metadata, AuthSource,
    DefaultServerParameterProvider, LoginInfo, Password, StartupHandler,
};
use datafusion_postgres::pgwire::api::cancel::{CancelHandler, DefaultCancelHandler};
use datafusion_postgres::pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use datafusion_postgres::pgwire::api::results::{Response, Tag};
use datafusion_postgres::pgwire::api::PgWireConnectionState;
use datafusion_postgres::pgwire::api::{
    ClientInfo, ConnectionManager, ErrorHandler, PgWireServerHandlers, PidSecretKeyGenerator,
    RandomPidSecretKeyGenerator, METADATA_USER,
};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use datafusion_postgres::pgwire::messages::cancel::CancelRequest;
use datafusion_postgres::pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use datafusion_postgres::{DfSessionService, QueryHook};
use futures::Sink;
use gpuwarden_schema::config::{LoginLimits, PipelineConfig};
use gpuwarden_schema::login_limit::{LockedOut, LoginLimiter, Scope};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use crate::governor::{self, Governor, Reason, Session};
use crate::Metrics;

mod catalog;

/// Why the endpoint could not be served.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The session could not be given the Postgres catalog and functions clients expect
    /// (an internal error: nothing the operator configured is at fault).
    #[error("preparing the SQL session for Postgres clients: {0}")]
    Session(#[source] DataFusionError),
    /// The threads that handle connections could not be started, or the listener handed to
    /// them.
    #[error("starting the SQL endpoint's threads: {0}")]
    Threads(#[source] std::io::Error),
}

/// Who may connect: the users of `[[pipeline.sql_users]]` with their password, and anyone else
/// without one only when anonymous access is on.
pub struct Auth {
    users: HashMap<String, Password>,
    allow_anonymous: bool,
    /// Keys the per-user salts, so that they differ between processes and cannot be predicted.
    salts: RandomState,
    /// What an unknown user's password is checked against: random, so that it never matches,
    /// and served with a salt like any user's, so that a client cannot tell which users exist.
    nobody: Vec<u8>,
    /// Failed logins per source address and per user name.
    logins: Mutex<LoginLimiter>,
    /// Where failed and refused logins are counted.
    metrics: Arc<Metrics>,
}

impl Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut users: Vec<&str> = self.users.keys().map(String::as_str).collect();
        users.sort_unstable();
        f.debug_struct("Auth")
            .field("users", &users)
            .field("allow_anonymous", &self.allow_anonymous)
            .finish_non_exhaustive()
    }
}

impl Auth {
    /// Users as (name, password). Passwords are kept only as SCRAM-SHA-256 salted passwords.
    pub fn new<'a>(
        users: impl IntoIterator<Item = (&'a str, &'a str)>,
        allow_anonymous: bool,
    ) -> Self {
        let salts = RandomState::new();
        let users = users
            .into_iter()
            .map(|(name, password)| {
                let salt = salt_for(&salts, name);
                let salted = gen_salted_password(password, &salt, SCRAM_ITERATIONS);
                (name.to_string(), Password::new(Some(salt), salted))
            })
            .collect();
        let nobody_salt = salt_for(&salts, "");
        let nobody = gen_salted_password(&random_nonce(), &nobody_salt, SCRAM_ITERATIONS);
        Self {
            users,
            allow_anonymous,
            salts,
            nobody,
            logins: Mutex::new(LoginLimiter::new(&LoginLimits::default())),
            metrics: Arc::default(),
        }
    }

    /// `[[pipeline.sql_users]]`, `pipeline.sql_allow_anonymous` and `[pipeline.login_limits]`.
    pub fn from_config(config: &PipelineConfig) -> Self {
        Self::new(
            config
                .sql_users
                .iter()
                .map(|u| (u.name.as_str(), u.password.as_str())),
            config.sql_allow_anonymous,
        )
        .with_login_limits(&config.login_limits)
    }

    /// Limits failed logins by `limits` (the defaults of [`LoginLimits`] otherwise).
    pub fn with_login_limits(mut self, limits: &LoginLimits) -> Self {
        self.logins = Mutex::new(LoginLimiter::new(limits));
        self
    }

    /// Counts failed and refused logins in `metrics` (the pipeline's `/metrics`).
    pub fn counting_in(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    fn limiter(&self) -> std::sync::MutexGuard<'_, LoginLimiter> {
        // The limiter's state is a set of counts, valid after any panic.
        self.logins.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a client from `source` may try to log in as `user`; counts it when it may not.
    fn may_try(&self, source: IpAddr, user: Option<&str>) -> Result<(), LockedOut> {
        let checked = self
            .limiter()
            .check(Some(source), user.map(str::as_bytes), Instant::now());
        if let Err(locked) = checked {
            self.metrics.sql_login_refused(locked.scope);
        }
        checked
    }

    /// Counts a wrong password from `source` for `user`.
    fn failed(&self, source: IpAddr, user: &str) {
        let failure = self
            .limiter()
            .failed(Some(source), Some(user.as_bytes()), Instant::now());
        self.metrics.sql_login_failed(&failure);
        for locked in failure.lockouts() {
            tracing::warn!(user = %user, peer = %source, scope = locked.scope.as_str(), retry_after_s = locked.retry_after_secs(), "too many failed SQL logins: locked out (pipeline.login_limits)");
        }
    }

    /// Clears `user`'s failed logins once it has logged in.
    fn succeeded(&self, user: &str) {
        self.limiter().succeeded(user.as_bytes());
    }

    /// Whether anyone at all can connect.
    pub fn admits_anyone(&self) -> bool {
        self.allow_anonymous || !self.users.is_empty()
    }

    /// Whether connections without a password are accepted.
    pub fn allows_anonymous(&self) -> bool {
        self.allow_anonymous
    }

    fn password_of(&self, user: &str) -> Password {
        self.users.get(user).cloned().unwrap_or_else(|| {
            Password::new(Some(salt_for(&self.salts, user)), self.nobody.clone())
        })
    }
}

fn salt_for(keys: &RandomState, user: &str) -> Vec<u8> {
    (0u8..2)
        .flat_map(|half| {
            let mut hasher = keys.build_hasher();
            half.hash(&mut hasher);
            user.hash(&mut hasher);
            hasher.finish().to_le_bytes()
        })
        .collect()
}

/// The endpoint running on threads of its own: what [`serve`] runs, and how it stops.
pub struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    task: JoinHandle<Result<(), EndpointError>>,
    governor: Arc<Governor>,
}

impl Server {
    /// Serves `ctx` on `listener` (a non-blocking listener) from two threads that do nothing
    /// else; `governor` is the one that runs `ctx`'s queries. With `tls`, clients must use it.
    pub fn start(
        listener: std::net::TcpListener,
        ctx: Arc<SessionContext>,
        auth: Auth,
        governor: Arc<Governor>,
        max_connections: usize,
        tls: Option<TlsAcceptor>,
    ) -> Result<Self, EndpointError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("gpuwarden-sql-connections")
            .enable_all()
            .build()
            .map_err(EndpointError::Threads)?;
        let task = runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).map_err(EndpointError::Threads)?;
            serve(listener, ctx, auth, max_connections, tls).await
        });
        Ok(Self {
            runtime: Some(runtime),
            task,
            governor,
        })
    }

    /// Waits until the endpoint stops by itself (it does only when it fails).
    pub async fn stopped(&mut self) -> Result<(), EndpointError> {
        match (&mut self.task).await {
            Ok(result) => result,
            Err(e) => Err(EndpointError::Threads(std::io::Error::other(e))),
        }
    }

    /// Cancels every running query (its client is told why), waits up to `grace` for them to
    /// end, and closes every connection.
    pub async fn shut_down(mut self, grace: Duration) {
        self.governor.shut_down(grace).await;
        self.task.abort();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Serves `ctx` to Postgres clients connecting to `listener` until the returned future is
/// dropped (which also closes every open connection), refusing connections past
/// `max_connections`. Each connection runs in its own [`Session`], for the governor that runs
/// `ctx`'s queries. With `tls`, a client that does not use it cannot log in.
///
/// The session is first given what Postgres clients query besides the lake: `information_schema`
/// shaped as Postgres's, `pg_catalog`, and functions such as `current_setting` and `format`.
/// Tables registered in `ctx` are served as they are, so a table that lists its files at every
/// scan shows new files to the next query.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<SessionContext>,
    auth: Auth,
    max_connections: usize,
    tls: Option<TlsAcceptor>,
) -> Result<(), EndpointError> {
    prepare(&ctx)?;
    let connections = Arc::new(ConnectionManager::new());
    let mut parameters = DefaultServerParameterProvider::default();
    parameters.is_superuser = false;
    parameters.default_transaction_read_only = true;
    let shared = Arc::new(Shared {
        auth: Arc::new(auth),
        parameters: Arc::new(parameters),
        pids: Arc::new(RandomPidSecretKeyGenerator::default()),
        connections: Arc::clone(&connections),
        sessions: std::sync::Mutex::new(HashMap::new()),
        max_connections,
        tls_required: tls.is_some(),
    });
    let handlers = Arc::new(Handlers {
        session: Arc::new(DfSessionService::new_with_hooks(ctx, hooks())),
        cancel: Arc::new(Cancel {
            pgwire: DefaultCancelHandler::new(connections),
            shared: Arc::clone(&shared),
        }),
        shared,
    });

    let mut open = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, peer)) => {
                    let connection = Arc::new(ConnectionState {
                        shared: Arc::clone(&handlers.shared),
                        session: Session::new(),
                        refused: open.len() >= max_connections,
                        pid: std::sync::OnceLock::new(),
                    });
                    let hangup = Hangup::watch(&socket);
                    let handlers = Arc::new(Connection {
                        handlers: Arc::clone(&handlers),
                        state: Arc::clone(&connection),
                    });
                    let tls = tls.clone();
                    open.spawn(Arc::clone(&connection.session).scope(crate::delta::scope_session_as_of(async move {
                        let served = datafusion_postgres::pgwire::tokio::process_socket(
                            socket,
                            tls,
                            handlers,
                        );
                        tokio::select! {
                            result = served => if let Err(e) = result {
                                tracing::debug!(peer = %peer, error = %e, "SQL connection ended with an error");
                            },
                            // Dropping pgwire's future drops the query's stream, which stops it.
                            () = hangup.closed() => {
                                tracing::debug!(peer = %peer, user = connection.session.user().unwrap_or_default(), "SQL client hung up");
                            }
                        }
                        connection.forget();
                    })));
                }
                Err(e) => {
                    // Out of file descriptors, usually: wait instead of spinning.
                    tracing::warn!(error = %e, "accepting a SQL connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = open.join_next(), if !open.is_empty() => {}
        }
    }
}

/// Tells when a client closed its end of the connection, while pgwire owns the socket and reads
/// nothing from it (a query runs): a second descriptor of the same socket, on which the hang-up
/// shows as the end of the stream, seen without reading what the client sent.
struct Hangup(Option<tokio::net::TcpStream>);

impl Hangup {
    fn watch(socket: &tokio::net::TcpStream) -> Self {
        use std::os::fd::AsFd as _;
        let watched = socket
            .as_fd()
            .try_clone_to_owned()
            .and_then(|fd| tokio::net::TcpStream::from_std(std::net::TcpStream::from(fd)));
        match watched {
            Ok(watched) => Self(Some(watched)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch a SQL connection for its client hanging up; its queries will run to their end if it does");
                Self(None)
            }
        }
    }

    /// Waits until the client has closed the connection (or forever, when unwatched).
    async fn closed(&self) {
        let Some(socket) = &self.0 else {
            return std::future::pending().await;
        };
        let mut byte = [0u8; 1];
        loop {
            match socket.peek(&mut byte).await {
                Ok(0) | Err(_) => return,
                // What the client sent is there for pgwire, which reads it when it is done
                // with the query: look again a little later.
                Ok(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// datafusion-postgres's own hooks (cursors, SET and SHOW, transactions), behind [`ReadOnly`].
fn hooks() -> Vec<Arc<dyn QueryHook>> {
    vec![
        Arc::new(ReadOnly),
        Arc::new(CursorStatementHook),
        Arc::new(SetShowHook),
        Arc::new(TransactionStatementHook),
    ]
}

/// Gives the session what Postgres clients query besides the lake's tables.
fn prepare(ctx: &SessionContext) -> Result<(), EndpointError> {
    catalog::register(ctx).map_err(EndpointError::Session)?;
    let catalog = ctx
        .state()
        .config()
        .options()
        .catalog
        .default_catalog
        .clone();
    setup_pg_catalog(ctx, &catalog, EmptyContextProvider)
        .map_err(|e| EndpointError::Session(*e))?;
    datafusion_postgres::datafusion_pg_functions::register_all(&mut *ctx.state_ref().write());
    ctx.register_udf(ScalarUDF::new_from_impl(CurrentSetting::new()));
    Ok(())
}

struct Shared {
    auth: Arc<Auth>,
    parameters: Arc<DefaultServerParameterProvider>,
    pids: Arc<RandomPidSecretKeyGenerator>,
    connections: Arc<ConnectionManager>,
    /// Logged-in sessions by process id: whom a cancel request stops.
    sessions: std::sync::Mutex<HashMap<i32, LoggedIn>>,
    max_connections: usize,
    /// `[pipeline.sql_tls]` is set: logins without TLS are refused.
    tls_required: bool,
}

/// A logged-in session and the secret key a cancel request for it must give.
type LoggedIn = (Vec<u8>, Arc<Session>);

struct Handlers {
    session: Arc<DfSessionService>,
    cancel: Arc<Cancel>,
    shared: Arc<Shared>,
}

/// One client connection: the handlers every connection shares, and its own state.
struct Connection {
    handlers: Arc<Handlers>,
    state: Arc<ConnectionState>,
}

struct ConnectionState {
    shared: Arc<Shared>,
    session: Arc<Session>,
    /// Over `max_connections` when it was accepted: refused at startup.
    refused: bool,
    /// Its process id, once logged in.
    pid: std::sync::OnceLock<i32>,
}

impl ConnectionState {
    /// Names the session's user and registers it for cancel requests.
    fn logged_in(&self, user: &str, pid: i32, secret: &[u8]) {
        self.session.logged_in(user);
        if self.pid.set(pid).is_ok() {
            self.shared
                .sessions
                .lock()
                .expect("sessions")
                .insert(pid, (secret.to_vec(), Arc::clone(&self.session)));
        }
    }

    /// Unregisters the session when the connection ends.
    fn forget(&self) {
        if let Some(pid) = self.pid.get() {
            self.shared.sessions.lock().expect("sessions").remove(pid);
        }
    }
}

impl PgWireServerHandlers for Connection {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        Arc::clone(&self.handlers.session)
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        Arc::clone(&self.handlers.session)
    }

    // Called once per connection: the SASL exchange keeps its state in its handler.
    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        let shared = &self.handlers.shared;
        let source: Arc<dyn AuthSource> = Arc::new(Passwords(Arc::clone(&shared.auth)));
        let pids: Arc<dyn PidSecretKeyGenerator> = shared.pids.clone();
        Arc::new(RequireTls {
            required: shared.tls_required,
            startup: Startup {
                sasl: SASLAuthStartupHandler::new(Arc::clone(&shared.parameters))
                    .with_scram(ScramAuth::new(source))
                    .with_pid_secret_key_generator(pids)
                    .with_connection_manager(Arc::clone(&shared.connections)),
                connection: Arc::clone(&self.state),
            },
        })
    }

    fn cancel_handler(&self) -> Arc<impl CancelHandler> {
        Arc::clone(&self.handlers.cancel)
    }

    fn error_handler(&self) -> Arc<impl ErrorHandler> {
        Arc::new(Errors)
    }
}

/// Cancel requests: stop the query of the session they name (it gets 57014), and let pgwire
/// interrupt a statement still being planned.
struct Cancel {
    pgwire: DefaultCancelHandler,
    shared: Arc<Shared>,
}

#[async_trait]
impl CancelHandler for Cancel {
    async fn on_cancel_request(&self, request: CancelRequest) {
        let secret = request.secret_key.to_bytes();
        let session = {
            let sessions = self.shared.sessions.lock().expect("sessions");
            sessions
                .get(&request.pid)
                .filter(|(known, _)| known.as_slice() == secret.as_ref())
                .map(|(_, session)| Arc::clone(session))
        };
        match session {
            Some(session) => {
                if session.cancel(Reason::Canceled) {
                    tracing::info!(
                        user = session.user().unwrap_or_default(),
                        "SQL query canceled by its client"
                    );
                }
            }
            None => tracing::debug!(pid = request.pid, "a cancel request names no session"),
        }
        self.pgwire.on_cancel_request(request).await;
    }
}

/// Gives the errors of the governor and of the memory pool the SQLSTATE Postgres would.
struct Errors;

impl ErrorHandler for Errors {
    fn on_error<C>(&self, client: &C, error: &mut PgWireError)
    where
        C: ClientInfo,
    {
        let PgWireError::ApiError(cause) = error else {
            return;
        };
        if let Some((code, message)) = governor::sqlstate(cause.as_ref()) {
            tracing::info!(user = client.metadata().get(METADATA_USER).map(String::as_str).unwrap_or_default(), code, error = %message, "SQL query ended by a limit");
            *error = PgWireError::UserError(Box::new(ErrorInfo::new(
                "ERROR".to_string(),
                code.to_string(),
                message,
            )));
        }
    }
}

/// The salted passwords SCRAM checks a client's proof against.
#[derive(Debug)]
struct Passwords(Arc<Auth>);

#[async_trait]
impl AuthSource for Passwords {
    async fn get_password(&self, login: &LoginInfo) -> PgWireResult<Password> {
        match login.user() {
            Some(user) => Ok(self.0.password_of(user)),
            None => Err(fatal("28000", "no user name given".to_string())),
        }
    }
}

/// Refuses a login without TLS when the endpoint serves TLS, before [`Startup`] sees it: a
/// password (or an anonymous user's queries) must not cross the network in the clear. The
/// refusal is Postgres's for a connection no `hostssl` rule admits: 28000.
struct RequireTls<S> {
    required: bool,
    startup: S,
}

#[async_trait]
impl<S: StartupHandler> StartupHandler for RequireTls<S> {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        if self.required
            && !client.is_secure()
            && matches!(message, PgWireFrontendMessage::Startup(_))
        {
            tracing::info!(peer = %client.socket_addr(), "SQL login without TLS refused");
            return Err(fatal(
                "28000",
                "the SQL endpoint requires TLS (pipeline.sql_tls): connect with sslmode=verify-full"
                    .to_string(),
            ));
        }
        self.startup.on_startup(client, message).await
    }
}

/// One connection's authentication: SCRAM-SHA-256, or none for an anonymous user; refused
/// at once past `max_connections`.
struct Startup {
    sasl: SASLAuthStartupHandler<DefaultServerParameterProvider>,
    connection: Arc<ConnectionState>,
}

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let shared = &self.connection.shared;
        if let PgWireFrontendMessage::Startup(ref startup) = message {
            if self.connection.refused {
                tracing::warn!(peer = %client.socket_addr(), limit = shared.max_connections, "SQL connection refused: too many connections");
                return Err(fatal(
                    "53300",
                    format!(
                        "sorry, too many clients already ({} connections are open: \
                         pipeline.sql_limits.max_connections)",
                        shared.max_connections
                    ),
                ));
            }
            let auth = &shared.auth;
            let user = startup.parameters.get(METADATA_USER);
            let peer = client.socket_addr();
            // Refused before any SCRAM exchange: a locked-out client learns nothing of its
            // password, and costs no key derivation.
            if let Err(locked) = auth.may_try(peer.ip(), user.map(String::as_str)) {
                let user = user.map(String::as_str).unwrap_or_default();
                tracing::info!(user = %user, peer = %peer, scope = locked.scope.as_str(), "SQL connection refused: locked out after too many failed logins");
                return Err(locked_out(user, locked));
            }
            if auth.allow_anonymous && user.is_some_and(|u| !auth.users.contains_key(u)) {
                protocol_negotiation(client, startup).await?;
                save_startup_parameters_to_metadata(client, startup);
                let (pid, secret_key) = shared.pids.generate(client);
                client.set_pid_and_secret_key(pid, secret_key.clone());
                // What pgwire's own handlers do, so that a cancel request reaches this connection.
                let (handle, guard) = shared.connections.register(pid, secret_key.clone());
                client.session_extensions().insert(handle);
                client.session_extensions().insert(guard);
                finish_authentication(client, shared.parameters.as_ref()).await?;
                let user = user.map(String::as_str).unwrap_or_default();
                self.connection
                    .logged_in(user, pid, secret_key.to_bytes().as_ref());
                tracing::debug!(user = %user, peer = %client.socket_addr(), "anonymous SQL connection");
                return Ok(());
            }
        }
        let result = self.sasl.on_startup(client, message).await;
        if result.is_ok() && matches!(client.state(), PgWireConnectionState::ReadyForQuery) {
            let (pid, secret_key) = client.pid_and_secret_key();
            let user = client
                .metadata()
                .get(METADATA_USER)
                .cloned()
                .unwrap_or_default();
            shared.auth.succeeded(&user);
            self.connection
                .logged_in(&user, pid, secret_key.to_bytes().as_ref());
        }
        match result {
            // pgwire names the user from the SCRAM message, which libpq leaves empty: name the
            // one the client logged in as, in the words Postgres uses.
            Err(PgWireError::InvalidPassword(_)) => {
                let user = client
                    .metadata()
                    .get(METADATA_USER)
                    .cloned()
                    .unwrap_or_default();
                tracing::warn!(user = %user, peer = %client.socket_addr(), "SQL password authentication failed");
                shared.auth.failed(client.socket_addr().ip(), &user);
                Err(fatal(
                    "28P01",
                    format!("password authentication failed for user \"{user}\""),
                ))
            }
            other => other,
        }
    }
}

/// The error a locked-out client gets: SQLSTATE 28000 (invalid authorization specification,
/// as Postgres refuses a login that no password could make succeed), and when to try again.
fn locked_out(user: &str, locked: LockedOut) -> PgWireError {
    let who = match locked.scope {
        Scope::Source => "from this address".to_string(),
        Scope::Principal => format!("for user \"{user}\""),
    };
    fatal(
        "28000",
        format!(
            "too many failed logins {who}; try again in {} s",
            locked.retry_after_secs()
        ),
    )
}

fn fatal(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "FATAL".to_string(),
        code.to_string(),
        message,
    )))
}

/// What the endpoint does with a statement, before anything else sees it.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// A query: planned, and run only if the plan writes nothing.
    Query,
    /// A cursor over these queries, each checked as a query.
    Cursor(Vec<Statement>),
    /// Handled further on (SHOW, SET, transactions, cursors): none of it writes.
    Pass,
    /// A session statement with nothing to do here, answered with this command tag.
    Done(String),
    /// Refused; says what was refused.
    Refuse(String),
}

fn verdict(statement: &Statement) -> Verdict {
    match statement {
        Statement::Query(_) | Statement::ExplainTable { .. } => Verdict::Query,
        Statement::Explain {
            statement: inner, ..
        } => match verdict(inner) {
            Verdict::Query => Verdict::Query,
            _ => Verdict::Refuse(kind(inner)),
        },
        Statement::Declare { stmts } => Verdict::Cursor(
            stmts
                .iter()
                .filter_map(|d| d.for_query.clone())
                .map(Statement::Query)
                .collect(),
        ),
        Statement::Set(set) => match shared_setting(set) {
            Some(name) => Verdict::Refuse(format!("SET {name}")),
            None if session_time_zone(set) => Verdict::Done("SET".to_string()),
            None => Verdict::Pass,
        },
        Statement::ShowVariable { .. }
        | Statement::ShowVariables { .. }
        | Statement::ShowStatus { .. }
        | Statement::ShowCatalogs { .. }
        | Statement::ShowDatabases { .. }
        | Statement::ShowSchemas { .. }
        | Statement::ShowTables { .. }
        | Statement::ShowViews { .. }
        | Statement::ShowColumns { .. }
        | Statement::ShowFunctions { .. }
        | Statement::ShowCreate { .. }
        | Statement::StartTransaction { .. }
        | Statement::Commit { .. }
        | Statement::Rollback { .. }
        | Statement::Fetch { .. }
        | Statement::Close { .. } => Verdict::Pass,
        // Nothing is kept between statements that these would release or reset (SQL-level
        // PREPARE is refused; pgwire owns protocol-level prepared statements).
        Statement::Discard { object_type } => Verdict::Done(format!("DISCARD {object_type}")),
        Statement::Deallocate { .. } => Verdict::Done("DEALLOCATE".to_string()),
        Statement::Reset(_) => Verdict::Done("RESET".to_string()),
        Statement::Savepoint { .. } => Verdict::Done("SAVEPOINT".to_string()),
        Statement::ReleaseSavepoint { .. } => Verdict::Done("RELEASE".to_string()),
        other => Verdict::Refuse(kind(other)),
    }
}

/// The statement's leading keywords, as Postgres names a command in its errors.
fn kind(statement: &Statement) -> String {
    let text = statement.to_string();
    let mut words = text.split_whitespace();
    let first = words.next().unwrap_or_default().to_uppercase();
    match first.as_str() {
        "CREATE" | "DROP" | "ALTER" => match words.next() {
            Some(second) => format!("{first} {}", second.to_uppercase()),
            None => first,
        },
        _ => first,
    }
}

/// DataFusion's own settings (and `timezone`, which it maps to one of them) belong to the session
/// that every connection shares: one client must not change them under the others.
fn shared_setting(set: &Set) -> Option<String> {
    let names: Vec<&ObjectName> = match set {
        Set::SingleAssignment { variable, .. } => vec![variable],
        Set::ParenthesizedAssignments { variables, .. } => variables.iter().collect(),
        Set::MultipleAssignments { assignments } => assignments.iter().map(|a| &a.name).collect(),
        _ => Vec::new(),
    };
    names
        .into_iter()
        .map(|n| n.to_string().to_lowercase().replace('"', ""))
        .find(|n| n.starts_with("datafusion."))
}

/// The value of `SET gpuwarden.as_of = …` (`TO`, quoted or not), if `statement` is one.
fn as_of_setting(statement: &Statement) -> Option<String> {
    let Statement::Set(Set::SingleAssignment {
        variable, values, ..
    }) = statement
    else {
        return None;
    };
    let name = variable.to_string().to_lowercase().replace('"', "");
    if name != AS_OF_SETTING {
        return None;
    }
    let value = values.first().map(ToString::to_string).unwrap_or_default();
    Some(value.trim_matches('\'').trim_matches('"').to_string())
}

/// The setting that reads the rollup tables as they stood: `SET gpuwarden.as_of = '2026-12-03
/// 00:00:00Z'` (a time), `= 412` (a version of their Delta logs), `= latest`.
pub const AS_OF_SETTING: &str = "gpuwarden.as_of";

fn set_as_of(value: &str) -> PgWireResult<Response> {
    match crate::delta::AsOf::parse(value) {
        Ok(as_of) => {
            crate::delta::set_session_as_of(as_of);
            Ok(Response::Execution(Tag::new("SET")))
        }
        Err(message) => Err(PgWireError::UserError(Box::new(ErrorInfo::new(
            "ERROR".to_string(),
            // invalid_parameter_value
            "22023".to_string(),
            format!("invalid value for {AS_OF_SETTING}: {message}"),
        )))),
    }
}

fn session_time_zone(set: &Set) -> bool {
    match set {
        Set::SingleAssignment { variable, .. } => {
            let name = variable.to_string().to_lowercase().replace('"', "");
            name == "timezone" || name == "time.zone"
        }
        _ => false,
    }
}

fn read_only(what: &str) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        // read_only_sql_transaction, as Postgres answers a write in a read-only transaction.
        "25006".to_string(),
        format!(
            "cannot execute {what}: the gpuwarden SQL endpoint is read-only \
             (queries: SELECT, WITH, EXPLAIN, SHOW; session: SET, BEGIN, COMMIT, ROLLBACK)"
        ),
    )))
}

/// Plans `statement` and refuses the plan if any part of it, subqueries included, would write
/// (`SELECT … INTO` creates a table, for instance).
async fn plan_read_only(ctx: &SessionContext, statement: &Statement) -> PgWireResult<LogicalPlan> {
    let plan = ctx
        .state()
        .statement_to_plan(DfStatement::Statement(Box::new(statement.clone())))
        .await
        .map_err(|e| PgWireError::ApiError(Box::new(e)))?;
    SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false)
        .verify_plan(&plan)
        .map_err(|e| {
            let why = match e {
                DataFusionError::Plan(why) => why,
                other => other.strip_backtrace(),
            };
            read_only(&format!("a query that writes ({why})"))
        })?;
    Ok(plan)
}

/// Refuses everything that writes, before datafusion-postgres's own hooks or DataFusion see it.
#[derive(Debug)]
struct ReadOnly;

impl ReadOnly {
    async fn check(
        &self,
        statement: &Statement,
        ctx: &SessionContext,
    ) -> Option<PgWireResult<Response>> {
        if let Some(value) = as_of_setting(statement) {
            return Some(set_as_of(&value));
        }
        match verdict(statement) {
            // datafusion-postgres plans the statement again to run it: planning costs little
            // next to running, and an error found here is the one it would have found.
            Verdict::Query => plan_read_only(ctx, statement).await.err().map(Err),
            Verdict::Cursor(queries) => check_all(ctx, &queries).await.err().map(Err),
            Verdict::Pass => None,
            Verdict::Done(tag) => Some(Ok(Response::Execution(Tag::new(&tag)))),
            Verdict::Refuse(what) => Some(Err(read_only(&what))),
        }
    }
}

async fn check_all(ctx: &SessionContext, queries: &[Statement]) -> PgWireResult<()> {
    for query in queries {
        plan_read_only(ctx, query).await?;
    }
    Ok(())
}

/// Hands the client's `SET statement_timeout` (which datafusion-postgres keeps in the
/// connection's metadata) to its session, for the governor: it may shorten the user's limit,
/// never lengthen it.
fn note_settings(metadata: &HashMap<String, String>) {
    if let Some(session) = Session::current() {
        let timeout = metadata
            .get("statement_timeout_ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis);
        session.set_statement_timeout(timeout);
    }
}

fn nothing() -> LogicalPlan {
    LogicalPlan::EmptyRelation(EmptyRelation {
        produce_one_row: false,
        schema: Arc::new(datafusion::common::DFSchema::empty()),
    })
}

#[async_trait]
impl QueryHook for ReadOnly {
    async fn handle_simple_query(
        &self,
        statement: &Statement,
        session_context: &SessionContext,
        client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        note_settings(client.metadata());
        self.check(statement, session_context).await
    }

    async fn handle_extended_parse_query(
        &self,
        statement: &Statement,
        session_context: &SessionContext,
        client: &(dyn ClientInfo + Send + Sync),
    ) -> Option<PgWireResult<LogicalPlan>> {
        note_settings(client.metadata());
        match verdict(statement) {
            // The plan checked here is the one that runs: no second planning.
            Verdict::Query => Some(plan_read_only(session_context, statement).await),
            Verdict::Cursor(queries) => check_all(session_context, &queries).await.err().map(Err),
            Verdict::Pass => None,
            Verdict::Done(_) => Some(Ok(nothing())),
            Verdict::Refuse(what) => Some(Err(read_only(&what))),
        }
    }

    async fn handle_extended_query(
        &self,
        statement: &Statement,
        _logical_plan: &LogicalPlan,
        _params: &ParamValues,
        _session_context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        // Checked at parse; only the statements answered here remain.
        match verdict(statement) {
            Verdict::Done(tag) => Some(Ok(Response::Execution(Tag::new(&tag)))),
            _ => None,
        }
    }
}

/// `current_setting(name [, missing_ok])`: the server settings clients ask for (Grafana asks
/// for `server_version_num` to pick its SQL dialect), with the values this server announces
/// when a client connects.
#[derive(Debug, PartialEq, Eq, Hash)]
struct CurrentSetting {
    signature: Signature,
}

impl CurrentSetting {
    fn new() -> Self {
        Self {
            signature: Signature::one_of(
                vec![
                    TypeSignature::Exact(vec![DataType::Utf8]),
                    TypeSignature::Exact(vec![DataType::Utf8, DataType::Boolean]),
                ],
                Volatility::Stable,
            ),
        }
    }
}

fn setting(name: &str) -> Option<&'static str> {
    Some(match name.to_lowercase().as_str() {
        // pgwire announces server_version 16.6 at startup.
        "server_version" => "16.6",
        "server_version_num" => "160006",
        "search_path" => "public",
        "timezone" => "UTC",
        "server_encoding" | "client_encoding" => "UTF8",
        "standard_conforming_strings" | "integer_datetimes" => "on",
        "transaction_read_only" | "default_transaction_read_only" => "on",
        "is_superuser" => "off",
        "max_identifier_length" => "63",
        _ => return None,
    })
}

impl ScalarUDFImpl for CurrentSetting {
    fn name(&self) -> &str {
        "current_setting"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> datafusion::error::Result<DataType> {
        Ok(DataType::Utf8)
    }

    fn invoke_with_args(
        &self,
        args: ScalarFunctionArgs,
    ) -> datafusion::error::Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let names = arrays[0].as_string::<i32>();
        let missing_ok = arrays.get(1).map(|a| a.as_boolean());
        let mut out = StringBuilder::with_capacity(names.len(), 8 * names.len());
        for i in 0..names.len() {
            if names.is_null(i) {
                out.append_null();
                continue;
            }
            let name = names.value(i);
            match setting(name) {
                Some(value) => out.append_value(value),
                None if missing_ok.is_some_and(|m| m.is_valid(i) && m.value(i)) => {
                    out.append_null()
                }
                None => {
                    return Err(DataFusionError::Execution(format!(
                        "unrecognized configuration parameter \"{name}\""
                    )))
                }
            }
        }
        let array: ArrayRef = Arc::new(out.finish());
        Ok(ColumnarValue::Array(array))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion_postgres::datafusion_pg_catalog::sql::PostgresCompatibilityParser;

    fn parse(sql: &str) -> Statement {
        PostgresCompatibilityParser::new()
            .parse(sql)
            .unwrap()
            .remove(0)
    }

    #[test]
    fn queries_and_session_statements_pass_and_writes_are_refused() {
        for sql in [
            "SELECT 1",
            "WITH a AS (SELECT 1) SELECT * FROM a",
            "EXPLAIN SELECT 1",
        ] {
            assert_eq!(verdict(&parse(sql)), Verdict::Query, "{sql}");
        }
        for sql in [
            "SHOW TIME ZONE",
            "SET extra_float_digits = 3",
            "SET application_name = 'x'",
            "BEGIN",
            "COMMIT",
            "ROLLBACK",
        ] {
            assert_eq!(verdict(&parse(sql)), Verdict::Pass, "{sql}");
        }
        assert_eq!(
            verdict(&parse("DISCARD ALL")),
            Verdict::Done("DISCARD ALL".into())
        );
        assert_eq!(
            verdict(&parse("SET timezone = 'Europe/Paris'")),
            Verdict::Done("SET".into())
        );
        for (sql, what) in [
            ("CREATE TABLE t (a INT)", "CREATE TABLE"),
            ("CREATE VIEW v AS SELECT 1", "CREATE VIEW"),
            ("INSERT INTO samples VALUES (1)", "INSERT"),
            ("UPDATE samples SET host = 'x'", "UPDATE"),
            ("DELETE FROM samples", "DELETE"),
            ("DROP TABLE samples", "DROP TABLE"),
            ("COPY samples TO '/tmp/x.csv'", "COPY"),
            ("EXPLAIN INSERT INTO samples VALUES (1)", "INSERT"),
            ("PREPARE p AS SELECT 1", "PREPARE"),
            (
                "SET datafusion.execution.batch_size = 1",
                "SET datafusion.execution.batch_size",
            ),
        ] {
            assert_eq!(verdict(&parse(sql)), Verdict::Refuse(what.into()), "{sql}");
        }
    }

    // psql 15 speaks only the simple protocol; JDBC, DBeaver and Metabase prepare statements.
    #[tokio::test]
    async fn the_extended_protocol_refuses_writes_when_they_are_prepared() {
        use datafusion_postgres::pgwire::api::stmt::QueryParser as _;
        let ctx = Arc::new(SessionContext::new());
        prepare(&ctx).unwrap();
        let service = DfSessionService::new_with_hooks(ctx, hooks());
        let parser = service.query_parser();
        let client = datafusion_postgres::testing::MockClient::new();
        for sql in [
            "CREATE TABLE t (a INT)",
            "INSERT INTO t VALUES (1)",
            "SELECT 1 AS a INTO t",
        ] {
            let err = match parser.parse_sql(&client, sql, &[]).await {
                Err(e) => e,
                Ok(_) => panic!("{sql} was accepted"),
            };
            let info = ErrorInfo::from(err);
            assert_eq!(info.code, "25006", "{sql}: {}", info.message);
        }
        for sql in [
            "SELECT $1::bigint + 1",
            "DISCARD ALL",
            "SET application_name = 'x'",
        ] {
            assert!(parser.parse_sql(&client, sql, &[]).await.is_ok(), "{sql}");
        }
    }

    // pgjdbc binds the patterns of its DatabaseMetaData queries (getColumns: `LIKE ?`) and
    // DBeaver the oids of its lookups, through the extended protocol, which psql 15 cannot
    // speak: each is planned, and its parameters typed as those clients send them.
    #[tokio::test]
    async fn jdbc_metadata_queries_are_planned_with_their_parameters() {
        use datafusion_postgres::pgwire::api::stmt::QueryParser as _;
        use datafusion_postgres::pgwire::api::Type;
        let ctx = Arc::new(SessionContext::new());
        prepare(&ctx).unwrap();
        let service = DfSessionService::new_with_hooks(ctx, hooks());
        let parser = service.query_parser();
        let client = datafusion_postgres::testing::MockClient::new();
        let pgjdbc_columns = "SELECT * FROM (SELECT current_database() AS current_database, \
            n.nspname,c.relname,a.attname,a.atttypid,a.attnotnull  OR (t.typtype = 'd' AND \
            t.typnotnull) AS attnotnull,a.atttypmod,a.attlen,t.typtypmod,row_number() OVER \
            (PARTITION BY a.attrelid ORDER BY a.attnum) AS attnum, nullif(a.attidentity, '') as \
            attidentity,nullif(a.attgenerated, '') as attgenerated,\
            pg_catalog.pg_get_expr(def.adbin, def.adrelid) AS adsrc,dsc.description,\
            t.typbasetype,t.typtype  FROM pg_catalog.pg_namespace n  JOIN pg_catalog.pg_class c \
            ON (c.relnamespace = n.oid)  JOIN pg_catalog.pg_attribute a ON (a.attrelid=c.oid)  \
            JOIN pg_catalog.pg_type t ON (a.atttypid = t.oid)  LEFT JOIN pg_catalog.pg_attrdef def \
            ON (a.attrelid=def.adrelid AND a.attnum = def.adnum)  LEFT JOIN \
            pg_catalog.pg_description dsc ON (c.oid=dsc.objoid AND a.attnum = dsc.objsubid)  LEFT \
            JOIN pg_catalog.pg_class dc ON (dc.oid=dsc.classoid AND dc.relname='pg_class')  LEFT \
            JOIN pg_catalog.pg_namespace dn ON (dc.relnamespace=dn.oid AND dn.nspname='pg_catalog')  \
            WHERE c.relkind in ('r','p','v','f','m') and a.attnum > 0 AND NOT a.attisdropped  AND \
            n.nspname LIKE $1 AND c.relname LIKE $2) c WHERE true  AND attname LIKE $3 ORDER BY \
            nspname,c.relname,attnum ";
        let dbeaver_tables = "SELECT c.oid,c.*,d.description,\
            pg_catalog.pg_get_expr(c.relpartbound, c.oid) as partition_expr,  \
            pg_catalog.pg_get_partkeydef(c.oid) as partition_key \nFROM pg_catalog.pg_class c\n\
            LEFT OUTER JOIN pg_catalog.pg_description d ON d.objoid=c.oid AND d.objsubid=0 AND \
            d.classoid='pg_class'::regclass\nWHERE c.relnamespace=$1 AND c.relkind not in \
            ('i','I','c')";
        for (sql, expected) in [
            (pgjdbc_columns, vec![Type::TEXT, Type::TEXT, Type::TEXT]),
            // An oid, as in Postgres (which names it `oid` rather than `regnamespace`).
            (dbeaver_tables, vec![Type::REGNAMESPACE]),
        ] {
            let statement = match parser.parse_sql(&client, sql, &[]).await {
                Ok(Some(statement)) => statement,
                Ok(None) => panic!("nothing planned for {sql}"),
                Err(e) => panic!("{sql}: {}", ErrorInfo::from(e).message),
            };
            assert_eq!(
                parser.get_parameter_types(&statement).unwrap(),
                expected,
                "{sql}"
            );
        }
    }

    #[tokio::test]
    async fn a_query_whose_plan_writes_is_refused() {
        let ctx = SessionContext::new();
        let err = plan_read_only(&ctx, &parse("SELECT 1 AS a INTO t"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("read-only"), "{err}");
        plan_read_only(&ctx, &parse("SELECT 1 AS a")).await.unwrap();
    }

    #[tokio::test]
    async fn current_setting_answers_what_the_server_announces() {
        let ctx = SessionContext::new();
        prepare(&ctx).unwrap();
        let one = |sql: &'static str| {
            let ctx = ctx.clone();
            async move {
                let batches = ctx.sql(sql).await?.collect().await?;
                Ok::<_, DataFusionError>(
                    datafusion::arrow::util::pretty::pretty_format_columns(
                        "v",
                        &[Arc::clone(batches[0].column(0))],
                    )?
                    .to_string(),
                )
            }
        };
        assert!(
            one("SELECT current_setting('server_version_num')::int / 100")
                .await
                .unwrap()
                .contains("1600")
        );
        assert!(one("SELECT current_setting('nope', true)")
            .await
            .unwrap()
            .contains("|   |"));
        let err = one("SELECT current_setting('nope')").await.unwrap_err();
        assert!(
            err.to_string()
                .contains("unrecognized configuration parameter \"nope\""),
            "{err}"
        );
    }

    #[test]
    fn unknown_users_get_a_salt_of_their_own_and_a_password_nobody_has() {
        let auth = Auth::new([("finops", "secret")], false);
        let known = auth.password_of("finops");
        let unknown = auth.password_of("mallory");
        assert_eq!(known.salt().unwrap().len(), 16);
        assert_eq!(unknown.salt().unwrap().len(), 16);
        assert_ne!(known.salt(), unknown.salt());
        assert_eq!(
            known.password(),
            gen_salted_password("secret", known.salt().unwrap(), SCRAM_ITERATIONS)
        );
        assert_eq!(
            auth.password_of("mallory").salt(),
            unknown.salt(),
            "stable per name"
        );
        assert!(!format!("{auth:?}").contains("secret"));
        assert!(auth.admits_anyone());
        assert!(!Auth::new([], false).admits_anyone());
    }
}
