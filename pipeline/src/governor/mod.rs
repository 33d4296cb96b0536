//! The SQL governor: every query a person submits (through the SQL endpoint or `gpuwarden sql`)
//! runs here, on threads of its own and under the limits of `[pipeline.sql_limits]`, so that no
//! query can hold back ingest, rollups, signals, `/metrics` or the endpoint's connections, and
//! every query can be stopped.
//!
//! - **Its own threads.** Queries run on a runtime that runs nothing else, its threads at a lower
//!   CPU priority (nice +10) than the rest of the process. Every operator of a plan yields its
//!   thread at least every `exec::SLICE`, so queries share the threads with each other, and a
//!   canceled query lets go of them within one slice.
//! - **Limits per user.** A statement timeout, a memory pool per query (operators that can spill
//!   to disk do), and a maximum of queries running at once, per user and in all; a query over a
//!   maximum waits up to `queue_timeout` for a slot, then is refused.
//! - **Cancellation.** A query ends when its stream is dropped (the client went away), when its
//!   session cancels it (a Postgres cancel request), when its deadline passes, or when the
//!   governor shuts down; the caller gets a [`QueryError`] that names why.
//!
//! The SQL endpoint tells the governor whose query it plans by running each connection inside
//! [`Session::scope`]; a query planned outside any session (`gpuwarden sql`) is the local user's.

mod error;
mod exec;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use gpuwarden_schema::config::{SqlLimits, SqlUser};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

pub use error::{sqlstate, QueryError, Reason};

/// The name `gpuwarden sql` runs its query as.
pub const LOCAL_USER: &str = "gpuwarden sql";

/// What one user's queries may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Longest a query may run, queueing included; `None` for no limit.
    pub statement_timeout: Option<Duration>,
    /// Memory one query may hold, bytes.
    pub query_memory: usize,
    /// Queries the user may run at once.
    pub max_queries: usize,
}

/// The limits of every user, and of all of them together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GovernorOptions {
    /// Limits of a user without limits of their own (anonymous users, `gpuwarden sql`).
    pub defaults: Limits,
    /// Where the default statement timeout was set, as errors name it.
    pub defaults_set_by: String,
    /// Limits by user name.
    pub users: HashMap<String, Limits>,
    /// Queries all users together may run at once.
    pub max_queries: usize,
    /// How long a query waits for a slot before it is refused.
    pub queue_timeout: Duration,
    /// Threads that run queries.
    pub threads: usize,
}

impl GovernorOptions {
    /// `[pipeline.sql_limits]`, with each `[[pipeline.sql_users]]` entry's own limits.
    pub fn from_config(limits: &SqlLimits, users: &[SqlUser]) -> Self {
        let defaults = Limits {
            statement_timeout: timeout(limits.statement_timeout),
            query_memory: usize::try_from(limits.query_memory).unwrap_or(usize::MAX),
            max_queries: limits.max_queries_per_user,
        };
        let users = users
            .iter()
            .map(|u| {
                let own = Limits {
                    statement_timeout: u
                        .statement_timeout
                        .map_or(defaults.statement_timeout, timeout),
                    query_memory: u.query_memory.map_or(defaults.query_memory, |m| {
                        usize::try_from(m).unwrap_or(usize::MAX)
                    }),
                    max_queries: u.max_queries.unwrap_or(defaults.max_queries),
                };
                (u.name.clone(), own)
            })
            .collect();
        let threads = match limits.threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        Self {
            defaults,
            defaults_set_by: "pipeline.sql_limits.statement_timeout".to_string(),
            users,
            max_queries: limits.max_queries,
            queue_timeout: limits.queue_timeout,
            threads,
        }
    }
}

/// `"0s"` means no limit.
fn timeout(limit: Duration) -> Option<Duration> {
    (!limit.is_zero()).then_some(limit)
}

/// Runs users' queries under their limits. See the module documentation.
pub struct Governor {
    options: GovernorOptions,
    /// The runtime queries run on; taken at shutdown.
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    executor: tokio::runtime::Handle,
    all: Arc<Semaphore>,
    /// One semaphore per configured user; anonymous users share one, since they choose their
    /// names.
    users: HashMap<String, Arc<Semaphore>>,
    anonymous: Arc<Semaphore>,
    running: Mutex<HashMap<u64, Arc<Control>>>,
    idle: Notify,
    next_query: AtomicU64,
    shut_down: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Governor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Governor")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Governor {
    /// Starts the query threads.
    pub fn new(options: GovernorOptions) -> std::io::Result<Arc<Self>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.threads.max(1))
            .thread_name("gpuwarden-sql")
            // A query's first task comes from another runtime: look for it often, so that a
            // small query does not wait behind the slices of a large one.
            .global_queue_interval(8)
            .on_thread_start(lower_priority)
            .enable_all()
            .build()?;
        let executor = runtime.handle().clone();
        let users = options
            .users
            .iter()
            .map(|(name, limits)| (name.clone(), Arc::new(Semaphore::new(limits.max_queries))))
            .collect();
        Ok(Arc::new(Self {
            all: Arc::new(Semaphore::new(options.max_queries)),
            anonymous: Arc::new(Semaphore::new(options.defaults.max_queries)),
            users,
            options,
            runtime: Mutex::new(Some(runtime)),
            executor,
            running: Mutex::new(HashMap::new()),
            idle: Notify::new(),
            next_query: AtomicU64::new(1),
            shut_down: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// A session context whose queries this governor runs (any query planned through it, by
    /// the SQL endpoint or by `ctx.sql(...)`).
    pub fn context(self: &Arc<Self>, config: SessionConfig) -> SessionContext {
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features()
            .with_query_planner(Arc::new(exec::GovernedPlanner::new(Arc::clone(self))))
            .build();
        SessionContext::new_with_state(state)
    }

    /// The limits of `user`'s queries.
    pub fn limits_of(&self, user: &str) -> &Limits {
        self.options
            .users
            .get(user)
            .unwrap_or(&self.options.defaults)
    }

    /// Queries running now (queued ones included).
    pub fn running(&self) -> usize {
        self.running.lock().expect("running queries").len()
    }

    /// Cancels every running query and refuses new ones, then waits up to `grace` for them to
    /// end (so that their clients get the error before their connection closes), and lets the
    /// query threads go.
    pub async fn shut_down(&self, grace: Duration) {
        self.shut_down.store(true, Ordering::SeqCst);
        let controls: Vec<Arc<Control>> = self
            .running
            .lock()
            .expect("running queries")
            .values()
            .cloned()
            .collect();
        if !controls.is_empty() {
            tracing::info!(
                queries = controls.len(),
                "canceling running SQL queries: shutting down"
            );
        }
        for control in controls {
            control.cancel(Reason::Shutdown);
        }
        let _ = tokio::time::timeout(grace, async {
            loop {
                let idle = self.idle.notified();
                if self.running() == 0 {
                    return;
                }
                idle.await;
            }
        })
        .await;
        if let Some(runtime) = self.runtime.lock().expect("runtime").take() {
            runtime.shutdown_background();
        }
    }

    fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::SeqCst)
    }

    /// Waits for a slot for one of `user`'s queries: one of theirs and one of all.
    async fn admit(&self, user: &str, limits: &Limits) -> Result<Permits, QueryError> {
        let own = self.users.get(user).unwrap_or(&self.anonymous);
        let acquire = async {
            let own = Arc::clone(own).acquire_owned().await;
            let all = Arc::clone(&self.all).acquire_owned().await;
            (own, all)
        };
        let wait = self.options.queue_timeout;
        let refused = || {
            if own.available_permits() == 0 {
                QueryError::TooManyOfUser {
                    user: user.to_string(),
                    limit: limits.max_queries,
                    waited: wait,
                }
            } else {
                QueryError::TooMany {
                    limit: self.options.max_queries,
                    waited: wait,
                }
            }
        };
        match tokio::time::timeout(wait, acquire).await {
            Ok((Ok(own), Ok(all))) => Ok(Permits {
                _own: own,
                _all: all,
            }),
            // The semaphores are never closed.
            Ok(_) => Err(QueryError::Shutdown),
            Err(_) => Err(refused()),
        }
    }

    fn register(&self, control: &Arc<Control>) -> u64 {
        let id = self.next_query.fetch_add(1, Ordering::Relaxed);
        self.running
            .lock()
            .expect("running queries")
            .insert(id, Arc::clone(control));
        if self.is_shut_down() {
            control.cancel(Reason::Shutdown);
        }
        id
    }

    fn unregister(&self, id: u64) {
        let mut running = self.running.lock().expect("running queries");
        running.remove(&id);
        if running.is_empty() {
            self.idle.notify_waiters();
        }
    }
}

impl Drop for Governor {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.get_mut().ok().and_then(Option::take) {
            runtime.shutdown_background();
        }
    }
}

/// A query's slots, given back when it ends.
struct Permits {
    _own: OwnedSemaphorePermit,
    _all: OwnedSemaphorePermit,
}

/// Lowers the calling thread's CPU priority (nice +10), so that when queries and the pipeline
/// want the same CPUs, the pipeline gets them. Linux gives each thread its own nice value.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10) {
        tracing::debug!(error = %e, "could not lower the priority of a SQL thread");
    }
}

/// How a query is told to stop: set once, with the reason, and read by every operator of its
/// plan between batches.
#[derive(Debug, Default)]
pub(crate) struct Control {
    reason: AtomicU8,
    notify: Notify,
}

impl Control {
    /// Stops the query, unless something stopped it already.
    pub(crate) fn cancel(&self, reason: Reason) {
        if self
            .reason
            .compare_exchange(0, reason as u8, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.notify.notify_waiters();
        }
    }

    /// Why the query was stopped, if it was.
    pub(crate) fn reason(&self) -> Option<Reason> {
        Reason::from_u8(self.reason.load(Ordering::Acquire))
    }

    /// Waits until the query is stopped.
    pub(crate) async fn stopped(&self) -> Reason {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = self.reason() {
                return reason;
            }
            notified.await;
        }
    }
}

tokio::task_local! {
    static SESSION: Arc<Session>;
}

/// One client connection of the SQL endpoint: who it is, once authenticated, and the query it
/// runs, so that a cancel request or a disconnect can stop it.
#[derive(Debug, Default)]
pub struct Session {
    user: OnceLock<String>,
    /// The client's `SET statement_timeout`, milliseconds (0: none).
    statement_timeout_ms: AtomicU64,
    current: Mutex<Vec<Arc<Control>>>,
}

impl Session {
    /// A session nobody has logged in to yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Runs `connection` (every query it plans) as this session.
    pub fn scope<F: Future>(self: Arc<Self>, connection: F) -> impl Future<Output = F::Output> {
        SESSION.scope(self, connection)
    }

    /// The session `scope` runs the caller in, if any.
    pub fn current() -> Option<Arc<Self>> {
        SESSION.try_with(Arc::clone).ok()
    }

    /// Names the user who logged in; later calls change nothing.
    pub fn logged_in(&self, user: &str) {
        let _ = self.user.set(user.to_string());
    }

    /// The user who logged in; `None` before the login succeeds.
    pub fn user(&self) -> Option<&str> {
        self.user.get().map(String::as_str)
    }

    /// Keeps the client's own `statement_timeout` (which may only shorten the user's).
    pub fn set_statement_timeout(&self, timeout: Option<Duration>) {
        let ms = timeout.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        self.statement_timeout_ms.store(ms, Ordering::Relaxed);
    }

    fn statement_timeout(&self) -> Option<Duration> {
        match self.statement_timeout_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Stops the queries the session runs now (a simple query with several statements starts
    /// them all at once); says whether there was any.
    pub fn cancel(&self, reason: Reason) -> bool {
        let current = self.current.lock().expect("current queries");
        for control in current.iter() {
            control.cancel(reason);
        }
        !current.is_empty()
    }

    fn started(&self, control: &Arc<Control>) {
        self.current
            .lock()
            .expect("current queries")
            .push(Arc::clone(control));
    }

    fn ended(&self, control: &Arc<Control>) {
        self.current
            .lock()
            .expect("current queries")
            .retain(|c| !Arc::ptr_eq(c, control));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::error::DataFusionError;

    /// Counts to a trillion: longer than any test.
    const ENDLESS: &str = "SELECT count(*) FROM generate_series(1, 1000000000000)";

    fn governor(queue_timeout: Duration, statement_timeout: Option<Duration>) -> Arc<Governor> {
        let limits = Limits {
            statement_timeout,
            query_memory: 64 << 20,
            max_queries: 1,
        };
        Governor::new(GovernorOptions {
            defaults: limits,
            defaults_set_by: "the test".into(),
            users: HashMap::new(),
            max_queries: 4,
            queue_timeout,
            threads: 2,
        })
        .unwrap()
    }

    async fn run(ctx: &SessionContext, sql: &str) -> Result<usize, DataFusionError> {
        let batches = ctx.sql(sql).await?.collect().await?;
        Ok(batches.iter().map(|b| b.num_rows()).sum())
    }

    fn code(result: Result<usize, DataFusionError>) -> (&'static str, String) {
        let error = result.expect_err("the query succeeded");
        sqlstate(&error).unwrap_or_else(|| panic!("no SQLSTATE for {error}"))
    }

    #[tokio::test]
    async fn a_query_past_its_timeout_is_canceled_and_its_slot_given_back() {
        let governor = governor(Duration::from_secs(5), Some(Duration::from_millis(300)));
        let ctx = governor.context(SessionConfig::new());
        let (code, message) = code(run(&ctx, ENDLESS).await);
        assert_eq!(code, "57014");
        assert!(message.contains("(300ms, the test)"), "{message}");
        assert_eq!(run(&ctx, "SELECT 1").await.unwrap(), 1, "the slot is free");
        assert_eq!(governor.running(), 0);
    }

    #[tokio::test]
    async fn a_second_query_of_a_user_at_their_maximum_is_refused_and_cancel_stops_the_first() {
        let governor = governor(Duration::ZERO, None);
        let ctx = Arc::new(governor.context(SessionConfig::new()));
        let session = Session::new();
        session.logged_in("ada");
        let first = tokio::spawn(Arc::clone(&session).scope({
            let ctx = Arc::clone(&ctx);
            async move { run(&ctx, ENDLESS).await }
        }));
        while governor.running() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The slot is taken once the first query's task runs.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (code, message) = code(run(&ctx, "SELECT 1").await);
        assert_eq!(code, "53300");
        assert!(message.contains("already runs 1"), "{message}");

        assert!(session.cancel(Reason::Canceled));
        let (code, message) = self::code(first.await.unwrap());
        assert_eq!(code, "57014");
        assert!(message.contains("user request"), "{message}");
    }

    #[tokio::test]
    async fn shutting_down_stops_running_queries_and_refuses_new_ones() {
        let governor = governor(Duration::from_secs(5), None);
        let ctx = Arc::new(governor.context(SessionConfig::new()));
        let running = tokio::spawn({
            let ctx = Arc::clone(&ctx);
            async move { run(&ctx, ENDLESS).await }
        });
        while governor.running() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        governor.shut_down(Duration::from_secs(5)).await;
        assert_eq!(code(running.await.unwrap()).0, "57P01");
        assert_eq!(code(run(&ctx, "SELECT 1").await).0, "57P01");
    }
}
