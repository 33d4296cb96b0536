//! Serving: the endpoint's threads ([`Server`]), the accept loop ([`serve`]), and each
//! connection's handlers. Connections are handled on threads of their own, and their queries run
//! on the [`Governor`]'s: each connection runs inside its [`Session`], so that the governor
//! applies its user's limits, a Postgres cancel request (psql's Ctrl-C) stops its query, and a
//! client that disconnects has its query stopped at once. Errors of the governor reach the client
//! with the SQLSTATE Postgres would give: 57014 canceled or timed out, 53200 out of memory, 53300
//! too many connections or queries.
//!
//! With a TLS acceptor (`[pipeline.sql_tls]`), pgwire answers a client's SSLRequest (and direct
//! TLS, ALPN `postgresql`) with it, and a client that logs in without TLS is refused
//! ([`super::login`]). Cancel requests, which carry no password and which libpq sends
//! unencrypted, are still honoured.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::prelude::SessionContext;
use datafusion_postgres::pgwire::api::auth::{DefaultServerParameterProvider, StartupHandler};
use datafusion_postgres::pgwire::api::cancel::{CancelHandler, DefaultCancelHandler};
use datafusion_postgres::pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use datafusion_postgres::pgwire::api::{
    ClientInfo, ConnectionManager, ErrorHandler, PgWireServerHandlers, RandomPidSecretKeyGenerator,
    METADATA_USER,
};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError};
use datafusion_postgres::pgwire::messages::cancel::CancelRequest;
use datafusion_postgres::DfSessionService;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use super::catalog::prepare;
use super::filter::hooks;
use super::login::{Auth, Connecting, Login};
use super::EndpointError;
use crate::governor::{self, Governor, Reason, Session};

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
        login: Login {
            auth: Arc::new(auth),
            parameters: Arc::new(parameters),
            pids: Arc::new(RandomPidSecretKeyGenerator::default()),
            connections: Arc::clone(&connections),
            max_connections,
            tls_required: tls.is_some(),
        },
        sessions: std::sync::Mutex::new(HashMap::new()),
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

/// What every connection shares.
struct Shared {
    login: Login,
    /// Logged-in sessions by process id: whom a cancel request stops.
    sessions: std::sync::Mutex<HashMap<i32, LoggedIn>>,
}

/// A logged-in session and the secret key a cancel request for it must give.
type LoggedIn = (Vec<u8>, Arc<Session>);

/// The handlers every connection shares.
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

/// One connection's state.
struct ConnectionState {
    shared: Arc<Shared>,
    session: Arc<Session>,
    /// Over `max_connections` when it was accepted: refused at startup.
    refused: bool,
    /// Its process id, once logged in.
    pid: std::sync::OnceLock<i32>,
}

impl Connecting for ConnectionState {
    fn login(&self) -> &Login {
        &self.shared.login
    }

    fn refused(&self) -> bool {
        self.refused
    }

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
}

impl ConnectionState {
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
        Arc::new(self.handlers.shared.login.startup(Arc::clone(&self.state)))
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
