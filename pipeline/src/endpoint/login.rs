//! Who may log in: SCRAM-SHA-256 against `[[pipeline.sql_users]]` ([`Auth`]), anonymous only
//! when `pipeline.sql_allow_anonymous` is set, TLS required when the endpoint serves it, at most
//! `max_connections` at once, and failed logins limited ([`gpuwarden_schema::login_limit`],
//! `[pipeline.login_limits]`): a wrong password counts against the client's source address and
//! against the user name it tried; while either is locked out, a connection is refused at its
//! startup message with SQLSTATE 28000 and a message that says when to try again, before any
//! SCRAM exchange. A login that succeeds clears its user's count.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use async_trait::async_trait;
use datafusion_postgres::pgwire::api::auth::sasl::scram::{
    gen_salted_password, random_nonce, ScramAuth, SCRAM_ITERATIONS,
};
use datafusion_postgres::pgwire::api::auth::sasl::SASLAuthStartupHandler;
use datafusion_postgres::pgwire::api::auth::{
    finish_authentication, protocol_negotiation, save_startup_parameters_to_metadata, AuthSource,
    DefaultServerParameterProvider, LoginInfo, Password, StartupHandler,
};
use datafusion_postgres::pgwire::api::PgWireConnectionState;
use datafusion_postgres::pgwire::api::{
    ClientInfo, ConnectionManager, PidSecretKeyGenerator, RandomPidSecretKeyGenerator,
    METADATA_USER,
};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use datafusion_postgres::pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use futures::Sink;
use gpuwarden_schema::config::{LoginLimits, PipelineConfig};
use gpuwarden_schema::login_limit::{LockedOut, LoginLimiter, Scope};

use crate::Metrics;

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

/// `user`'s salt: 16 bytes, the same for the same name within a process.
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

/// What every connection's login shares: who may log in, what the server announces to a client
/// that does, the process ids and secret keys its cancel requests name, and the limits on
/// connections and TLS.
pub(super) struct Login {
    pub(super) auth: Arc<Auth>,
    pub(super) parameters: Arc<DefaultServerParameterProvider>,
    pub(super) pids: Arc<RandomPidSecretKeyGenerator>,
    pub(super) connections: Arc<ConnectionManager>,
    pub(super) max_connections: usize,
    /// `[pipeline.sql_tls]` is set: logins without TLS are refused.
    pub(super) tls_required: bool,
}

impl Login {
    /// The startup handler of `connection`: one per connection, for the SASL exchange keeps its
    /// state in its handler.
    pub(super) fn startup<N: Connecting>(&self, connection: Arc<N>) -> RequireTls<Startup<N>> {
        let source: Arc<dyn AuthSource> = Arc::new(Passwords(Arc::clone(&self.auth)));
        let pids: Arc<dyn PidSecretKeyGenerator> = self.pids.clone();
        RequireTls {
            required: self.tls_required,
            startup: Startup {
                sasl: SASLAuthStartupHandler::new(Arc::clone(&self.parameters))
                    .with_scram(ScramAuth::new(source))
                    .with_pid_secret_key_generator(pids)
                    .with_connection_manager(Arc::clone(&self.connections)),
                connection,
            },
        }
    }
}

/// What a login needs of the connection it is for.
pub(super) trait Connecting: Send + Sync {
    /// The endpoint's logins.
    fn login(&self) -> &Login;
    /// Whether the connection was one over `max_connections` when it was accepted: refused at
    /// startup.
    fn refused(&self) -> bool;
    /// Names the connection's user once it has logged in, and registers it for cancel requests
    /// under `pid` and `secret`.
    fn logged_in(&self, user: &str, pid: i32, secret: &[u8]);
}

/// Refuses a login without TLS when the endpoint serves TLS, before [`Startup`] sees it: a
/// password (or an anonymous user's queries) must not cross the network in the clear. The
/// refusal is Postgres's for a connection no `hostssl` rule admits: 28000.
pub(super) struct RequireTls<S> {
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
pub(super) struct Startup<N> {
    sasl: SASLAuthStartupHandler<DefaultServerParameterProvider>,
    connection: Arc<N>,
}

#[async_trait]
impl<N: Connecting> StartupHandler for Startup<N> {
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
        let login = self.connection.login();
        if let PgWireFrontendMessage::Startup(ref startup) = message {
            if self.connection.refused() {
                tracing::warn!(peer = %client.socket_addr(), limit = login.max_connections, "SQL connection refused: too many connections");
                return Err(fatal(
                    "53300",
                    format!(
                        "sorry, too many clients already ({} connections are open: \
                         pipeline.sql_limits.max_connections)",
                        login.max_connections
                    ),
                ));
            }
            let auth = &login.auth;
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
                let (pid, secret_key) = login.pids.generate(client);
                client.set_pid_and_secret_key(pid, secret_key.clone());
                // What pgwire's own handlers do, so that a cancel request reaches this connection.
                let (handle, guard) = login.connections.register(pid, secret_key.clone());
                client.session_extensions().insert(handle);
                client.session_extensions().insert(guard);
                finish_authentication(client, login.parameters.as_ref()).await?;
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
            login.auth.succeeded(&user);
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
                login.auth.failed(client.socket_addr().ip(), &user);
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

/// A login refused: SQLSTATE `code`, at severity FATAL (the connection ends).
fn fatal(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "FATAL".to_string(),
        code.to_string(),
        message,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

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
