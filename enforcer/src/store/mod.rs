//! The durable lease store: one SQLite database (WAL mode, `synchronous = FULL`) holding leases,
//! blocked teams, the latest team spend, and an outbox of records for Kafka.
//!
//! Every lease change writes its `LeaseEvent` (and, for admissions, its `Action`) to the outbox in
//! the same transaction, so the topics can never miss or invent a change; the publisher reads
//! [`Store::outbox_pending`] and marks rows with [`Store::outbox_mark_published`], and the
//! enforcer's timer deletes published rows past their retention with [`Store::prune_outbox`].
//!
//! One process owns a database at a time (an exclusive lock on `<database>.lock`), and it keeps
//! what admission reads in memory: the open leases, the latest spend per team, the blocked teams.
//! A change is checked and applied to memory under one lock, so concurrent requests can never
//! exceed a quota or place a GPU twice ([`Store::admit`]), and its rows are queued, under the same
//! lock, to a single writer thread that owns the connection. The writer commits everything queued
//! since its last commit in one transaction (group commit: one fsync for many changes) and only
//! then answers each caller, so a change is reported only once it is on disk. Every call returns
//! a [`Pending`] to `.await` (async code) or [`Pending::wait`] on (threads). The writer is woken
//! only when someone waits (a query, or a caller awaiting a commit), so a change nobody waits for
//! ([`Pending::applied`]) never costs a commit of its own: it rides along with the next one, or
//! is committed within 20 ms. [`Store::commit_stats`] counts commits and the changes
//! they carried. Queries that need the
//! file (closed leases, the outbox) run on the writer's connection after the writes queued before
//! them, so a caller always reads its own changes. A second thread, with a connection of its own,
//! checkpoints (copies the committed WAL into the database file and syncs it) while the writer
//! goes on committing, so no caller waits for a checkpoint's writes and sync.
//!
//! If a commit fails (disk full, I/O error), memory is ahead of the file: the store refuses every
//! later call with [`StoreError::Broken`] and the enforcer must restart, which reloads memory from
//! what the file holds. Callers whose changes were in the failed batch were told they failed.
//!
//! The one lock (check and apply to memory, queue the rows, all under the memory lock) is taken
//! in one place, `Store::mutate` in this file: every method that changes something describes its
//! change as a closure over memory and hands it to `mutate`.
//!
//! The code is split along the same lines; its parts are declared in this order, each using
//! only those before it:
//!
//! - `types.rs`: the records ([`Lease`], [`LeaseState`], [`Ledger`], [`LeaseFilter`],
//!   [`OutboxRow`]) and [`StoreError`];
//! - `rows.rs`: a lease as a row of the `leases` table;
//! - [`leader`]: which replica leads, and the fence its changes carry;
//! - `db.rs`: the queries memory does not answer, for either database (`Db`);
//! - `memory.rs`: what admission reads in memory, and the ledger and spend maths over it;
//! - `writer.rs`: the queue, the writer thread and its group commit, and [`Pending`];
//! - `migrations.rs`: the schema, as the migrations run when the store opens;
//! - `postgres.rs`: the PostgreSQL store, for several replicas (see [`Store::open_postgres`]);
//! - `election.rs`: the PostgreSQL elector thread that claims and renews the leadership;
//! - [`audit`]: the one builder of Action records;
//! - [`copy`]: copying a whole store into an empty one in another database (`gpuwarden store
//!   copy`);
//! - [`probe`]: a store's schema version, read without opening the store (`gpuwarden doctor`);
//! - this file: [`Store`], which ties memory and the writer together.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use gpuwarden_schema::config::PricingConfig;
use gpuwarden_schema::{end_after, Action, ActionKind, LeaseEventKind, Outcome, ReleaseReason};
use rusqlite::Connection;

use crate::policy::{AdmissionRequest, Decision};

mod types;
mod rows;
pub mod leader;
mod db;
mod memory;
mod writer;
mod migrations;
mod postgres;
mod election;
pub mod audit;
pub mod copy;
pub mod probe;

pub use db::{LoginFailure, Session as PortalSession};
/// The store's test lease, for the unit tests of the modules that use the store.
#[cfg(test)]
pub(crate) use types::tests::lease as test_lease;
pub use types::{Lease, LeaseFilter, LeaseState, Ledger, OutboxRow, StoreError};
pub use writer::{CommitStats, Pending};

use audit::Audit;
use db::Db;
use memory::{load, Memory};
use migrations::migrate;
use writer::{checkpoint_loop, lock, outbox, write_loop, Deferred, Done, Job, Op, Queue};

/// The id prefix of a hold: a granted lease whose substrate has not named it yet (a Slurm job
/// admitted at submission, before Slurm gave it its job id). A hold counts like any open lease
/// for quota, budget and capacity, but has no LeaseEvent or Action until [`Store::bind`] gives
/// it its substrate's id; [`Store::drop_hold`] forgets one whose job never came.
pub const HOLD_PREFIX: &str = "hold-";

/// How [`Store::admit_as`] records an admitted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    /// A lease, published at once.
    Lease,
    /// A hold (see [`HOLD_PREFIX`]).
    Hold,
    /// A lease, published at once, under the id its substrate gave the work (a Kubernetes
    /// pod's `k8s-<uid>`). Admitting an id that is already open answers with that lease and
    /// changes nothing, so a review the API server sends again is answered the same way.
    Named(String),
    /// A lease, published at once, recorded with the client's Idempotency-Key: asked again
    /// with a key the team used within the last day, the lease admitted with it is the answer
    /// and nothing changes (a retry after an answer was lost, on this replica or another); if
    /// that lease has ended, or was asked for someone or something else, the retry is refused.
    Keyed(String),
}

/// The lease store. Cheap to clone; clones share one store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
    /// Every change and query of this view is fenced by the replica's leadership (see
    /// [`Store::leading`]).
    fenced: bool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("location", &self.inner.location)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// The SQLite file, or the PostgreSQL URL without its password.
    location: String,
    /// What the policy reads, kept in step with the database. SQLite: every change is applied
    /// here and its writes queued to the writer while this lock is held (by [`Store::mutate`],
    /// the only code that does both), so the writer commits changes in the order memory saw
    /// them. PostgreSQL: changed only by the writer thread, inside its transaction.
    memory: Arc<Mutex<Memory>>,
    /// Which database, and what only it needs.
    backend: Backend,
    /// Whether this replica leads (always, on SQLite).
    leadership: Arc<leader::Leadership>,
    /// Jobs for the writer thread.
    queue: Arc<Queue>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The checkpointer thread, which stops when its sender is dropped.
    checkpointer: Mutex<Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>>,
    /// Set (once) when a commit failed: memory is then ahead of the file, so the store refuses
    /// every later call until the enforcer restarts and reloads from the file. (SQLite only:
    /// the PostgreSQL store reloads memory from the database itself.)
    broken: Arc<OnceLock<String>>,
}

/// The database behind a store.
enum Backend {
    /// An SQLite file, held (an exclusive lock on `<database>.lock`) for as long as the store is
    /// open.
    Sqlite { _owner: File },
    /// PostgreSQL, shared with other replicas: its listener and elector threads, and how to
    /// reach it (for the elector, started by [`Store::elect`]).
    Postgres(postgres::Threads, Box<postgres::Target>),
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Backend::Postgres(threads, _) = &mut self.backend {
            threads.stop.store(true, Ordering::Release);
            if let Some(listener) = threads.listener.take() {
                let _ = listener.join();
            }
            // The elector gives the leadership up as it stops, for a prompt failover.
            if let Some(elector) = lock(&threads.elector).take() {
                let _ = elector.join();
            }
        }
        if let Some((stop, checkpointer)) = lock(&self.checkpointer).take() {
            drop(stop);
            let _ = checkpointer.join();
        }
        // The writer ends once it has committed what was queued.
        self.queue.close();
        if let Some(writer) = lock(&self.writer).take() {
            let _ = writer.join();
        }
    }
}

/// What a change made of memory, decided by the closure given to [`Store::mutate`].
enum Change<T> {
    /// Memory was changed: `Vec<Op>` are the rows that make the file follow, and `T` the answer
    /// once they are committed.
    Write(T, Vec<Op>),
    /// Nothing to change (a dry run, a change made before, a request the policy refused): the
    /// answer now.
    Unchanged(T),
    /// The change is refused; memory is as it was.
    Refused(StoreError),
    /// Lease `id` is not open: the answer is why, read from the file once the lock is released
    /// (it does not exist, or it has ended; `to` is the state asked for, if any).
    NotOpen { id: String, to: Option<LeaseState> },
}

/// A replica's name when none is given: the host's name and the process id.
fn default_replica() -> String {
    format!(
        "{}-{}",
        rustix::system::uname().nodename().to_string_lossy(),
        std::process::id()
    )
}

/// A change handed to the PostgreSQL writer, and the channels of its answer: the value as soon
/// as memory has it (what [`Pending::applied`] waits for), then the commit.
struct Decide<T, F> {
    change: F,
    answer: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
    committed: tokio::sync::oneshot::Sender<Result<(), StoreError>>,
}

impl<T, F> Deferred for Decide<T, F>
where
    T: Send + 'static,
    F: FnOnce(&mut Memory) -> Change<T> + Send,
{
    fn run(self: Box<Self>, memory: &mut Memory, db: &mut dyn Db) -> Option<(Vec<Op>, Done)> {
        let Self {
            change,
            answer,
            committed,
        } = *self;
        let now = match change(memory) {
            Change::Write(value, ops) => {
                let _ = answer.send(Ok(value));
                let done: Done = Box::new(move |result: Result<(), StoreError>| {
                    let _ = committed.send(result);
                });
                return Some((ops, done));
            }
            Change::Unchanged(value) => Ok(value),
            Change::Refused(e) => Err(e),
            Change::NotOpen { id, to } => Err(not_open(db, id, to)),
        };
        let _ = answer.send(now);
        let _ = committed.send(Ok(()));
        None
    }

    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.answer.send(Err(error));
    }
}

/// A retry with Idempotency-Key `key` refused: it admitted `lease`, and `why` it is not this one.
fn reused(key: &str, lease: &str, why: &str) -> StoreError {
    StoreError::KeyReused(format!(
        "Idempotency-Key {key:?} admitted lease {lease}, and {why}; use a new key for a new request"
    ))
}

/// Why a retry with an Idempotency-Key cannot be answered with `lease`, the one admitted with
/// it: the request asks for someone or something else (a client that reused a key).
fn key_reused(lease: &Lease, request: &AdmissionRequest) -> Option<String> {
    let differs = [
        ("user", lease.user == request.user),
        ("project", lease.project == request.project),
        ("workload", lease.workload == request.workload),
        ("gpus", lease.gpu_count == request.gpus),
    ];
    let fields: Vec<&str> = differs
        .iter()
        .filter(|(_, same)| !same)
        .map(|(field, _)| *field)
        .collect();
    (!fields.is_empty()).then(|| format!("that lease was asked with another {}", fields.join(", ")))
}

/// Why lease `id`, not open, cannot change (to `to`, or at all): it does not exist, or it has
/// ended.
fn not_open(db: &mut dyn Db, id: String, to: Option<LeaseState>) -> StoreError {
    match db.lease(&id) {
        Err(e) => e,
        Ok(None) => StoreError::NotFound(id),
        Ok(Some(lease)) => StoreError::InvalidTransition {
            id,
            from: lease.state,
            to: to.unwrap_or(lease.state),
        },
    }
}

impl Store {
    /// Opens (creating if needed) the database at `path`, brings its schema up to date, loads
    /// the open leases, spend and blocks into memory, and starts the writer thread. Only one
    /// store may have a database open at a time: a second one, in this process or another, gets
    /// [`StoreError::InUse`].
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let lock_path = PathBuf::from(format!("{}.lock", path.display()));
        let owner = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| StoreError::Io(format!("cannot open {}: {e}", lock_path.display())))?;
        match owner.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StoreError::InUse(path.display().to_string()))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(StoreError::Io(format!(
                    "cannot lock {}: {e}",
                    lock_path.display()
                )))
            }
        }
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(30))?;
        // SQLite's locking stays NORMAL (the owner lock above keeps other stores out): the
        // checkpointer's connection below shares the WAL index with the writer's.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // Every commit is on disk before its caller hears of it; group commit keeps that cheap.
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        // The checkpointer thread copies the WAL into the database file, off the commit path.
        // The writer checkpoints only past this many WAL frames, when the checkpointer has not
        // found a quiet moment to let the WAL restart; what is left to copy then is what was
        // committed since the checkpointer's last pass, so the WAL stays bounded and the stall
        // short.
        conn.pragma_update(None, "wal_autocheckpoint", writer::WAL_LIMIT)?;
        migrate(&mut conn)?;
        let memory = load(&conn)?;
        let checkpoints = Connection::open(path)?;
        // A checkpoint syncs the WAL before copying it and the database file after.
        checkpoints.pragma_update(None, "synchronous", "FULL")?;
        let queue = Arc::new(Queue::new());
        let broken = Arc::new(OnceLock::new());
        let writer = {
            let (broken, queue) = (broken.clone(), queue.clone());
            std::thread::Builder::new()
                .name("lease-store".into())
                .spawn(move || write_loop(conn, &queue, &broken))
                .map_err(|e| StoreError::Io(format!("cannot start the store's writer: {e}")))?
        };
        let (stop_checkpoints, stopped) = std::sync::mpsc::channel();
        let checkpointer = {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name("lease-store-checkpoint".into())
                .spawn(move || checkpoint_loop(&checkpoints, &queue, &stopped))
                .map_err(|e| {
                    StoreError::Io(format!("cannot start the store's checkpointer: {e}"))
                })?
        };
        Ok(Self {
            fenced: false,
            inner: Arc::new(Inner {
                location: path.display().to_string(),
                memory: Arc::new(Mutex::new(memory)),
                backend: Backend::Sqlite { _owner: owner },
                leadership: Arc::new(leader::Leadership::sole(&default_replica())),
                queue,
                writer: Mutex::new(Some(writer)),
                checkpointer: Mutex::new(Some((stop_checkpoints, checkpointer))),
                broken,
            }),
        })
    }

    /// Opens the store where `location` says: an SQLite file ([`Store::open`]), or a
    /// PostgreSQL database ([`Store::open_postgres`]).
    pub fn open_at(location: &gpuwarden_schema::config::StoreLocation) -> Result<Self, StoreError> {
        use gpuwarden_schema::config::StoreLocation;
        match location {
            StoreLocation::Sqlite(path) => Self::open(path),
            StoreLocation::Postgres { url, password_file } => {
                Self::open_postgres(url, password_file.as_deref())
            }
        }
    }

    /// Opens the store in the PostgreSQL database at `url` (libpq's URL form; the password in
    /// `password_file`'s first line when given), which several stores (enforcer replicas) may
    /// share: brings its schema up to date (once, whoever starts first), loads memory, and
    /// starts the writer and the listener that follows the other replicas' commits. A database
    /// that cannot be reached is [`StoreError::Unavailable`]; one migrated by a newer gpuwarden
    /// is [`StoreError::TooNew`].
    pub fn open_postgres(url: &str, password_file: Option<&Path>) -> Result<Self, StoreError> {
        let target = postgres::Target::new(url, password_file)?;
        let (client, memory) = postgres::open(&target)?;
        let memory = Arc::new(Mutex::new(memory));
        let queue = Arc::new(Queue::new());
        let catch_up_queued = Arc::new(AtomicBool::new(false));
        let writer = {
            let (queue, memory) = (queue.clone(), memory.clone());
            let writer = postgres::Writer::new(target.clone(), client, catch_up_queued.clone());
            std::thread::Builder::new()
                .name("lease-store".into())
                .spawn(move || writer.run(&queue, &memory))
                .map_err(|e| StoreError::Io(format!("cannot start the store's writer: {e}")))?
        };
        let stop = Arc::new(AtomicBool::new(false));
        let listener = {
            let (queue, stop, target) = (queue.clone(), stop.clone(), target.clone());
            std::thread::Builder::new()
                .name("lease-store-listen".into())
                .spawn(move || postgres::listen(&target, &queue, &stop, &catch_up_queued))
                .map_err(|e| StoreError::Io(format!("cannot start the store's listener: {e}")))?
        };
        Ok(Self {
            fenced: false,
            inner: Arc::new(Inner {
                location: target.shown().to_owned(),
                memory,
                backend: Backend::Postgres(
                    postgres::Threads {
                        stop,
                        listener: Some(listener),
                        elector: Mutex::new(None),
                    },
                    Box::new(target.clone()),
                ),
                leadership: Arc::new(leader::Leadership::new(&default_replica())),
                queue,
                writer: Mutex::new(Some(writer)),
                checkpointer: Mutex::new(None),
                broken: Arc::new(OnceLock::new()),
            }),
        })
    }

    /// Whether the store is in PostgreSQL (shared with other replicas).
    pub fn is_shared(&self) -> bool {
        matches!(self.inner.backend, Backend::Postgres(..))
    }

    /// Takes part in electing the leader as `replica`, with a lease of `lease` (renewed every
    /// third of it; a leader that stops renewing is replaced within `lease`). On SQLite this
    /// store's one owner leads, as `replica`. Called once, at start; a second call changes
    /// nothing.
    pub fn elect(&self, replica: &str, lease: Duration) -> Result<(), StoreError> {
        match &self.inner.backend {
            Backend::Sqlite { .. } => {
                self.inner.leadership.lead_alone(replica);
                Ok(())
            }
            Backend::Postgres(threads, target) => {
                let mut elector = lock(&threads.elector);
                if elector.is_some() {
                    return Ok(());
                }
                self.inner.leadership.rename(replica);
                *elector = Some(election::spawn(
                    target.as_ref().clone(),
                    self.inner.leadership.clone(),
                    lease,
                    threads.stop.clone(),
                )?);
                Ok(())
            }
        }
    }

    /// Whether this replica leads, and who does.
    pub fn leadership(&self) -> &Arc<leader::Leadership> {
        &self.inner.leadership
    }

    /// This store for the leader's work: each change and query is made only while this replica
    /// leads, checked inside the transaction that makes it against the leader's lease (its term
    /// is the fencing token), else refused with [`StoreError::Fenced`].
    pub fn leading(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            fenced: true,
        }
    }

    /// The fence this view's jobs carry: `Ok(None)` unfenced (or on SQLite, whose one owner
    /// leads), the leader's fence, or why not.
    fn fence(&self, what: &str) -> Result<Option<leader::Fence>, StoreError> {
        if !self.fenced || !self.is_shared() {
            return Ok(None);
        }
        match self.inner.leadership.fence() {
            Some(fence) => Ok(Some(fence)),
            None => Err(StoreError::Fenced(format!(
                "{what} (the leader is {})",
                match self.inner.leadership.leader() {
                    (who, _) if who.is_empty() => "not known yet".to_owned(),
                    (who, term) => format!("{who}, term {term}"),
                }
            ))),
        }
    }

    /// Where the store is: the SQLite file, or the PostgreSQL URL without its password.
    pub fn location(&self) -> &str {
        &self.inner.location
    }

    fn check(&self) -> Result<(), StoreError> {
        match self.inner.broken.get() {
            Some(why) => Err(StoreError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Makes a change: the one place the store's invariant is kept.
    ///
    /// **A change is checked and applied to memory under one lock, and its rows are queued
    /// under the same lock.** `change` runs with the memory lock held: it reads what it needs,
    /// checks, and only once every check has passed changes memory (so a refusal, or a panic,
    /// leaves memory as it was) and says which rows make the file follow ([`Change::Write`]).
    /// Those rows are queued to the writer before the lock is released, so two changes can
    /// never both pass a check that only one of them should (a quota, a GPU placed twice), and
    /// the writer commits changes in the order memory saw them. Every method that changes
    /// memory or the file goes through here; none takes the lock and queues by hand.
    ///
    /// On PostgreSQL the change runs on the writer's thread instead, inside the transaction that
    /// holds the store's lock across every replica, on memory brought up to date with their
    /// commits first: the same invariant, fleet-wide.
    fn mutate<T: Send + 'static>(
        &self,
        change: impl FnOnce(&mut Memory) -> Change<T> + Send + 'static,
    ) -> Pending<T> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        if self.is_shared() {
            let fence = match self.fence("change the lease store") {
                Ok(fence) => fence,
                Err(e) => return Pending::ready(Err(e)),
            };
            let (answer, heard) = tokio::sync::oneshot::channel();
            let (committed, done) = tokio::sync::oneshot::channel();
            let job = Job::Mutate(
                Box::new(Decide {
                    change,
                    answer,
                    committed,
                }),
                fence,
            );
            return self.inner.queue.decided(job, heard, done);
        }
        let mut memory = lock(&self.inner.memory);
        let pending = match change(&mut memory) {
            Change::Write(value, ops) => self.inner.queue.write(value, ops),
            Change::Unchanged(value) => Pending::ready(Ok(value)),
            Change::Refused(e) => Pending::ready(Err(e)),
            Change::NotOpen { id, to } => {
                drop(memory);
                return self.refuse_not_open(id, to);
            }
        };
        // Only now, with the rows queued.
        drop(memory);
        pending
    }

    /// Why lease `id`, not open, cannot change (to `to`, or at all): it does not exist, or it
    /// has ended (read from the file).
    fn refuse_not_open<T: Send + 'static>(&self, id: String, to: Option<LeaseState>) -> Pending<T> {
        self.read(move |db| Err(not_open(db, id, to)))
    }

    /// Runs `query` on the writer's database after every write queued so far.
    fn read<T: Send + 'static>(
        &self,
        query: impl FnOnce(&mut dyn Db) -> Result<T, StoreError> + Send + 'static,
    ) -> Pending<T> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        match self.fence("read for the leader's work") {
            Ok(fence) => self.inner.queue.read(fence, query),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// How many transactions the writer has committed, and how many changes they carried.
    pub fn commit_stats(&self) -> CommitStats {
        self.inner.queue.stats()
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Pending<i64> {
        self.read(|db| db.schema_version())
    }

    /// The ledger as of `now_ms`.
    pub fn ledger(&self, now_ms: i64, pricing: &PricingConfig) -> Result<Ledger, StoreError> {
        self.check()?;
        Ok(lock(&self.inner.memory).ledger(now_ms, pricing))
    }

    /// Admits a request atomically: builds the ledger, asks `decide` (the policy), and records
    /// the outcome, with the store's memory locked throughout, so concurrent requests can never
    /// exceed a quota or place a GPU twice. An admitted decision becomes a `granted` lease with a
    /// `granted` LeaseEvent and an `admit` Action in the outbox; a denied one writes a `deny`
    /// Action. Nothing is written for a dry run.
    pub fn admit(
        &self,
        now_ms: i64,
        pricing: &PricingConfig,
        request: &AdmissionRequest,
        decide: impl FnOnce(Ledger) -> Decision + Send + 'static,
    ) -> Pending<(Decision, Option<Lease>)> {
        self.admit_as(now_ms, pricing, request, Admitted::Lease, decide)
    }

    /// [`Store::admit`], recording an admitted request as `admitted` says: a lease, or a hold
    /// (see [`HOLD_PREFIX`]) whose records wait for [`Store::bind`].
    pub fn admit_as(
        &self,
        now_ms: i64,
        pricing: &PricingConfig,
        request: &AdmissionRequest,
        admitted: Admitted,
        decide: impl FnOnce(Ledger) -> Decision + Send + 'static,
    ) -> Pending<(Decision, Option<Lease>)> {
        let (pricing, request) = (pricing.clone(), request.clone());
        self.mutate(move |memory| {
            let (pricing, request) = (&pricing, &request);
            let before = match &admitted {
                Admitted::Named(id) => memory.open(id),
                Admitted::Keyed(key) if !request.dry_run => {
                    match memory.keyed(&request.team, key, now_ms) {
                        None => None,
                        Some(id) => match memory.open(&id) {
                            Some(open) => match key_reused(open, request) {
                                None => Some(open),
                                Some(why) => return Change::Refused(reused(key, &id, &why)),
                            },
                            None => {
                                return Change::Refused(reused(key, &id, "that lease has ended"))
                            }
                        },
                    }
                }
                _ => None,
            };
            if let Some(open) = before {
                let usd_per_hour =
                    pricing.usd_per_gpu_hour(&open.gpu_model) * f64::from(open.gpu_count);
                let decision = Decision {
                    reasons: Vec::new(),
                    estimate: crate::policy::Estimate {
                        usd_per_hour,
                        max_usd: None,
                        gpu_model: Some(open.gpu_model.clone()),
                    },
                    placement: Some(crate::policy::Placement {
                        substrate: open.substrate.clone(),
                        gpu_model: open.gpu_model.clone(),
                        gpu_count: open.gpu_count,
                        gpu_uuids: open.gpu_uuids.clone(),
                    }),
                    duration: None,
                };
                return Change::Unchanged((decision, Some(open.clone())));
            }
            let decision = decide(memory.ledger_of(&request.team, now_ms, pricing));
            if request.dry_run {
                return Change::Unchanged((decision, None));
            }
            match (&decision.placement, decision.admitted()) {
                (Some(p), true) => {
                    // Time-ordered (v7): new leases land at the end of the id index, so a
                    // commit rewrites one index page, not a random one per lease.
                    let id = uuid::Uuid::now_v7().to_string();
                    let lease = Lease {
                        id: match &admitted {
                            Admitted::Lease | Admitted::Keyed(_) => id,
                            Admitted::Hold => format!("{HOLD_PREFIX}{id}"),
                            Admitted::Named(name) => name.clone(),
                        },
                        team: request.team.clone(),
                        user: request.user.clone(),
                        project: request.project.clone(),
                        workload: request.workload,
                        substrate: p.substrate.clone(),
                        gpu_model: p.gpu_model.clone(),
                        gpu_count: p.gpu_count,
                        gpu_uuids: p.gpu_uuids.clone(),
                        labels: request.labels.clone().unwrap_or_default(),
                        state: LeaseState::Granted,
                        granted_at: now_ms,
                        // A hold's substrate ends it at its time limit (the decision's
                        // duration, which the substrate is told).
                        expires_at: match admitted {
                            Admitted::Lease | Admitted::Named(_) | Admitted::Keyed(_) => {
                                decision.duration.map(|d| end_after(now_ms, d))
                            }
                            Admitted::Hold => None,
                        },
                        updated_at: now_ms,
                        released_at: None,
                        release_reason: None,
                        admission_key: match &admitted {
                            Admitted::Keyed(key) => Some(key.clone()),
                            _ => None,
                        },
                        substrate_ref: None,
                    };
                    let detail = format!(
                        "{} GPUs of {} on {}, ${:.2}/h",
                        lease.gpu_count,
                        lease.gpu_model,
                        lease.substrate,
                        decision.estimate.usd_per_hour
                    );
                    let admit = Audit::lease(ActionKind::Admit, &lease, "admitted").at(
                        now_ms,
                        Outcome::Ok,
                        detail,
                    );
                    let ops = match admitted {
                        Admitted::Lease | Admitted::Named(_) | Admitted::Keyed(_) => vec![
                            Op::InsertLease(Box::new(lease.clone())),
                            outbox(&lease.event(LeaseEventKind::Granted, now_ms), now_ms),
                            outbox(&admit, now_ms),
                        ],
                        Admitted::Hold => vec![Op::InsertLease(Box::new(lease.clone()))],
                    };
                    memory.put(lease.clone());
                    Change::Write((decision, Some(lease)), ops)
                }
                _ => {
                    let reason = decision
                        .reasons
                        .first()
                        .map_or("no_capacity", |r| r.code.as_str());
                    let detail = decision
                        .reasons
                        .iter()
                        .map(|r| format!("{}: {}", r.code.as_str(), r.message))
                        .collect::<Vec<_>>()
                        .join("; ");
                    let deny = Audit::team(ActionKind::Deny, &request.team, reason).at(
                        now_ms,
                        Outcome::Ok,
                        detail,
                    );
                    Change::Write((decision, None), vec![outbox(&deny, now_ms)])
                }
            }
        })
    }

    /// Lease `id` if it is open, from memory: never waits for the writer.
    pub fn open_lease(&self, id: &str) -> Result<Option<Lease>, StoreError> {
        self.check()?;
        Ok(lock(&self.inner.memory).open(id).cloned())
    }

    /// Lease `id` if it is open, as of every replica's latest commit: on PostgreSQL, read in the
    /// writer's transaction once memory has caught up under the store's lock (for a decision
    /// that must not miss what another replica has just committed); on SQLite, from memory.
    pub fn current_lease(&self, id: &str) -> Pending<Option<Lease>> {
        let id = id.to_owned();
        self.mutate(move |memory| Change::Unchanged(memory.open(&id).cloned()))
    }

    /// Writes down where the substrate holds open lease `id` ([`Lease::substrate_ref`]; None
    /// forgets it), for the driver of every replica. Whether the lease is open: nothing is
    /// written for one that is not.
    pub fn set_substrate_ref(&self, id: &str, substrate_ref: Option<String>) -> Pending<bool> {
        let id = id.to_owned();
        self.mutate(move |memory| {
            let Some(current) = memory.open(&id) else {
                return Change::Unchanged(false);
            };
            if current.substrate_ref == substrate_ref {
                return Change::Unchanged(true);
            }
            let mut lease = current.clone();
            lease.substrate_ref = substrate_ref;
            memory.put(lease.clone());
            Change::Write(true, vec![Op::UpdateLease(Box::new(lease))])
        })
    }

    /// One lease.
    pub fn lease(&self, id: &str) -> Pending<Option<Lease>> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        // Another replica may have changed it since memory last heard.
        if !self.is_shared() {
            if let Some(lease) = lock(&self.inner.memory).open(id) {
                return Pending::ready(Ok(Some(lease.clone())));
            }
        }
        let id = id.to_owned();
        self.read(move |db| db.lease(&id))
    }

    /// Leases matching `filter`, newest first.
    pub fn leases(&self, filter: &LeaseFilter) -> Pending<Vec<Lease>> {
        let filter = filter.clone();
        self.read(move |db| db.leases(&filter))
    }

    /// Open leases, oldest grant first.
    pub fn open_leases(&self) -> Result<Vec<Lease>, StoreError> {
        self.check()?;
        let mut open: Vec<Lease> = lock(&self.inner.memory).open_leases().cloned().collect();
        open.sort_by(|a, b| (a.granted_at, &a.id).cmp(&(b.granted_at, &b.id)));
        Ok(open)
    }

    /// Open leases whose end has come, for the runtime rules to reclaim.
    pub fn due_for_expiry(&self, now_ms: i64) -> Result<Vec<Lease>, StoreError> {
        let mut due: Vec<Lease> = self
            .open_leases()?
            .into_iter()
            .filter(|l| l.expires_at.is_some_and(|e| e <= now_ms))
            .collect();
        due.sort_by(|a, b| (a.expires_at, &a.id).cmp(&(b.expires_at, &b.id)));
        Ok(due)
    }

    /// Changes an open lease with `change` (which may refuse), keeps memory and the file in
    /// step, and queues the outbox records `records` derives from the changed lease. A lease
    /// that is not open is read from the file only to say why it cannot change.
    fn change_lease(
        &self,
        id: &str,
        to: Option<LeaseState>,
        change: impl FnOnce(&mut Lease) -> Result<(), StoreError> + Send + 'static,
        records: impl FnOnce(&Lease) -> Vec<Op> + Send + 'static,
    ) -> Pending<Lease> {
        let id = id.to_owned();
        self.mutate(move |memory| {
            let id = id.as_str();
            let Some(current) = memory.open(id) else {
                return Change::NotOpen {
                    id: id.to_owned(),
                    to,
                };
            };
            let mut lease = current.clone();
            if let Err(e) = change(&mut lease) {
                return Change::Refused(e);
            }
            let mut ops = vec![Op::UpdateLease(Box::new(lease.clone()))];
            ops.extend(records(&lease));
            if lease.state.is_open() {
                memory.put(lease.clone());
            } else {
                memory.take(&lease.id);
                memory.exempt.remove(&lease.id);
                if memory.signals.remove(&lease.id).is_some() {
                    ops.push(Op::ForgetSignal(lease.id.clone()));
                }
            }
            Change::Write(lease, ops)
        })
    }

    /// Moves a lease to `to`, refusing transitions the state machine does not allow. Reaching
    /// `released` or `failed` writes a `released` LeaseEvent (reason `reason`, or `failed`) and a
    /// `reclaim` Action to the outbox in the same transaction.
    pub fn transition(
        &self,
        id: &str,
        to: LeaseState,
        now_ms: i64,
        reason: ReleaseReason,
        detail: &str,
    ) -> Pending<Lease> {
        let detail = detail.to_owned();
        self.change_lease(
            id,
            Some(to),
            move |lease| {
                if !lease.state.can_become(to) {
                    return Err(StoreError::InvalidTransition {
                        id: lease.id.clone(),
                        from: lease.state,
                        to,
                    });
                }
                lease.state = to;
                lease.updated_at = now_ms;
                if !to.is_open() {
                    lease.released_at = Some(now_ms);
                    lease.release_reason = Some(if to == LeaseState::Failed {
                        ReleaseReason::Failed
                    } else {
                        reason
                    });
                }
                Ok(())
            },
            move |lease| {
                if lease.state.is_open() {
                    return Vec::new();
                }
                let outcome = if to == LeaseState::Failed {
                    Outcome::Failed
                } else {
                    Outcome::Ok
                };
                let why = lease.release_reason.unwrap_or(reason).as_str();
                let reclaim =
                    Audit::lease(ActionKind::Reclaim, lease, why).at(now_ms, outcome, detail);
                vec![
                    outbox(&lease.event(LeaseEventKind::Released, now_ms), now_ms),
                    outbox(&reclaim, now_ms),
                ]
            },
        )
    }

    /// Gives hold `hold_id` its substrate's lease id `lease_id`, in state `state` (`granted` or
    /// `active`): the hold's row becomes the lease's, and the lease's `granted` LeaseEvent (and
    /// `active`'s, as a second record when it already runs) and its `admit` Action (`detail`)
    /// go to the outbox, dated `now_ms`. Binding a hold already bound to `lease_id` (its hold is
    /// gone, the lease is open) changes nothing.
    pub fn bind(
        &self,
        hold_id: &str,
        lease_id: &str,
        state: LeaseState,
        now_ms: i64,
        detail: &str,
    ) -> Pending<Lease> {
        let (hold_id, lease_id, detail) =
            (hold_id.to_owned(), lease_id.to_owned(), detail.to_owned());
        self.mutate(move |memory| {
            let (hold_id, lease_id) = (hold_id.as_str(), lease_id.as_str());
            if let (None, Some(lease)) = (memory.open(hold_id), memory.open(lease_id)) {
                return Change::Unchanged(lease.clone());
            }
            let Some(hold) = memory.open(hold_id) else {
                return Change::NotOpen {
                    id: hold_id.to_owned(),
                    to: Some(state),
                };
            };
            if !hold_id.starts_with(HOLD_PREFIX) || memory.open(lease_id).is_some() {
                return Change::Refused(StoreError::InvalidTransition {
                    id: hold_id.to_owned(),
                    from: hold.state,
                    to: state,
                });
            }
            let mut lease = hold.clone();
            lease.id = lease_id.to_owned();
            lease.state = state;
            lease.updated_at = now_ms;
            memory.take(hold_id);
            memory.put(lease.clone());
            let ops = vec![
                Op::DeleteLease(hold_id.to_owned()),
                Op::InsertLease(Box::new(lease.clone())),
                outbox(&lease.event(LeaseEventKind::Granted, now_ms), now_ms),
                outbox(
                    &Audit::lease(ActionKind::Admit, &lease, "admitted").at(
                        now_ms,
                        Outcome::Ok,
                        detail,
                    ),
                    now_ms,
                ),
            ];
            Change::Write(lease, ops)
        })
    }

    /// Records `lease` (a job its substrate runs without having asked admission) as it is,
    /// with its `granted` LeaseEvent and an `admit` Action (reason `adopted`, `detail`); no
    /// policy decides. Adopting a lease id already open changes nothing.
    pub fn adopt(&self, lease: Lease, now_ms: i64, detail: &str) -> Pending<Lease> {
        let detail = detail.to_owned();
        self.mutate(move |memory| {
            if let Some(open) = memory.open(&lease.id) {
                return Change::Unchanged(open.clone());
            }
            let adopt =
                Audit::lease(ActionKind::Admit, &lease, "adopted").at(now_ms, Outcome::Ok, detail);
            let ops = vec![
                Op::InsertLease(Box::new(lease.clone())),
                outbox(&lease.event(LeaseEventKind::Granted, now_ms), now_ms),
                outbox(&adopt, now_ms),
            ];
            memory.put(lease.clone());
            Change::Write(lease, ops)
        })
    }

    /// Forgets hold `hold_id` (its job never reached the queue): its GPUs are free again, and
    /// nothing is published, since it never became a lease. Forgetting a hold that is gone
    /// changes nothing.
    pub fn drop_hold(&self, hold_id: &str) -> Pending<()> {
        let hold_id = hold_id.to_owned();
        self.mutate(move |memory| {
            let hold_id = hold_id.as_str();
            if !hold_id.starts_with(HOLD_PREFIX) || memory.open(hold_id).is_none() {
                return Change::Unchanged(());
            }
            memory.take(hold_id);
            memory.exempt.remove(hold_id);
            Change::Write((), vec![Op::DeleteLease(hold_id.to_owned())])
        })
    }

    /// Sets an open lease's end to `expires_at`.
    pub fn extend(&self, id: &str, expires_at: i64, now_ms: i64) -> Pending<Lease> {
        self.change_lease(
            id,
            None,
            move |lease| {
                lease.expires_at = Some(expires_at);
                lease.updated_at = now_ms;
                Ok(())
            },
            |_| Vec::new(),
        )
    }

    /// Resizes an open lease atomically: builds the ledger, asks `decide` (the policy) about the
    /// lease, and on admission records the new GPUs with a `resized` LeaseEvent and a `resize`
    /// Action, with the store's memory locked throughout.
    pub fn resize(
        &self,
        id: &str,
        now_ms: i64,
        pricing: &PricingConfig,
        reason: &str,
        why: &str,
        decide: impl FnOnce(Ledger, &Lease) -> Decision + Send + 'static,
    ) -> Pending<(Decision, Lease)> {
        let (id, pricing) = (id.to_owned(), pricing.clone());
        let (reason, why) = (reason.to_owned(), why.to_owned());
        self.mutate(move |memory| {
            let (id, pricing, reason, why) = (id.as_str(), &pricing, reason.as_str(), why.as_str());
            let lease = match memory.open(id) {
                Some(l) if l.state == LeaseState::Releasing => {
                    return Change::Refused(StoreError::InvalidTransition {
                        id: id.into(),
                        from: l.state,
                        to: l.state,
                    })
                }
                Some(l) => l.clone(),
                None => {
                    return Change::NotOpen {
                        id: id.to_owned(),
                        to: None,
                    }
                }
            };
            let decision = decide(memory.ledger_of(&lease.team, now_ms, pricing), &lease);
            let Some(placement) = decision.placement.clone().filter(|_| decision.admitted()) else {
                return Change::Unchanged((decision, lease));
            };
            let mut lease = lease;
            let before = lease.gpu_count;
            lease.gpu_uuids = placement.gpu_uuids;
            lease.gpu_count = placement.gpu_count;
            lease.updated_at = now_ms;
            let mut detail = format!("{before} → {} GPUs of {}", lease.gpu_count, lease.gpu_model);
            if !why.is_empty() {
                detail.push_str(": ");
                detail.push_str(why);
            }
            let resize =
                Audit::lease(ActionKind::Resize, &lease, reason).at(now_ms, Outcome::Ok, detail);
            let ops = vec![
                Op::UpdateLease(Box::new(lease.clone())),
                outbox(&lease.event(LeaseEventKind::Resized, now_ms), now_ms),
                outbox(&resize, now_ms),
            ];
            memory.put(lease.clone());
            Change::Write((decision, lease), ops)
        })
    }

    /// Puts a resized lease back on `previous`'s GPUs after its substrate failed to carry the
    /// resize out: a `resized` LeaseEvent with the old GPUs, so everyone downstream follows it
    /// back, and a failed `resize` Action saying why.
    pub fn undo_resize(
        &self,
        id: &str,
        previous: &Lease,
        now_ms: i64,
        detail: &str,
    ) -> Pending<Lease> {
        let detail = detail.to_owned();
        let previous = previous.clone();
        self.change_lease(
            id,
            None,
            move |lease| {
                lease.gpu_uuids.clone_from(&previous.gpu_uuids);
                lease.gpu_count = previous.gpu_count;
                lease.updated_at = now_ms;
                Ok(())
            },
            move |lease| {
                let failed = Audit::lease(ActionKind::Resize, lease, "substrate_failed").at(
                    now_ms,
                    Outcome::Failed,
                    detail,
                );
                vec![
                    outbox(&lease.event(LeaseEventKind::Resized, now_ms), now_ms),
                    outbox(&failed, now_ms),
                ]
            },
        )
    }

    /// Stops a team's new admissions, with a `block` Action.
    pub fn block_team(&self, team: &str, reason: &str, now_ms: i64) -> Pending<()> {
        self.set_blocked(team, Some(reason), now_ms)
    }

    /// Lifts a team's block, with an `unblock` Action.
    pub fn unblock_team(&self, team: &str, now_ms: i64) -> Pending<()> {
        self.set_blocked(team, None, now_ms)
    }

    fn set_blocked(&self, team: &str, reason: Option<&str>, now_ms: i64) -> Pending<()> {
        let (team, reason) = (team.to_owned(), reason.map(str::to_owned));
        self.mutate(move |memory| {
            let (team, reason) = (team.as_str(), reason.as_deref());
            let changed = match reason {
                Some(_) => memory.blocked.insert(team.to_owned()),
                None => memory.blocked.remove(team),
            };
            if !changed {
                return Change::Unchanged(());
            }
            let kind = if reason.is_some() {
                ActionKind::Block
            } else {
                ActionKind::Unblock
            };
            let record = Audit::team(kind, team, reason.unwrap_or("unblocked")).at(
                now_ms,
                Outcome::Ok,
                String::new(),
            );
            let change = match reason {
                Some(r) => Op::Block {
                    team: team.into(),
                    reason: r.into(),
                    at: now_ms,
                },
                None => Op::Unblock { team: team.into() },
            };
            Change::Write((), vec![change, outbox(&record, now_ms)])
        })
    }

    /// Records a `team_spend` signal; an older one than the one kept is ignored.
    ///
    /// Month-to-date spend only grows, so a figure below what this store had already counted
    /// by the signal's time (its last signal plus what the team's open leases accrued since,
    /// at `pricing`) is raised to that count. Such figures are normal: the pipeline reads them
    /// from the rollups, which lag the signal's time, and a period may be computed again (a
    /// standby taking over publishing) from rollups read at another time. Taken as they come,
    /// they would unblock a team just over its budget until the next signal blocks it again.
    pub fn record_team_spend(
        &self,
        team: &str,
        month_to_date_usd: f64,
        burn_usd_per_hour: f64,
        ts_ms: i64,
        pricing: &PricingConfig,
    ) -> Pending<()> {
        let (team, pricing) = (team.to_owned(), pricing.clone());
        self.mutate(move |memory| {
            let (team, pricing) = (team.as_str(), &pricing);
            if memory.spend.get(team).is_some_and(|&(_, ts)| ts > ts_ms) {
                return Change::Unchanged(());
            }
            let counted = memory.spend_of(team, ts_ms, pricing).unwrap_or(0.0);
            let month_to_date_usd = month_to_date_usd.max(counted);
            memory
                .spend
                .insert(team.to_owned(), (month_to_date_usd, ts_ms));
            let spend = Op::Spend {
                team: team.into(),
                month_to_date_usd,
                burn_usd_per_hour,
                ts_ms,
            };
            Change::Write((), vec![spend])
        })
    }

    /// Records an Action (it goes to Kafka through the outbox).
    pub fn record_action(&self, action: &Action) -> Pending<()> {
        let row = outbox(action, action.ts_ms);
        self.mutate(move |_| Change::Write((), vec![row]))
    }

    /// Records `action` unless a step under `key` was recorded before (in this run or an
    /// earlier one): the mark and the Action commit together. The answer says whether it was
    /// recorded now.
    pub fn record_once(&self, key: &str, action: &Action) -> Pending<bool> {
        let (key, at, row) = (key.to_owned(), action.ts_ms, outbox(action, action.ts_ms));
        self.mutate(move |memory| {
            if !memory.marks.insert(key.clone()) {
                return Change::Unchanged(false);
            }
            let ops = vec![Op::Mark { key, at }, row];
            Change::Write(true, ops)
        })
    }

    /// Whether a step under `key` was recorded by [`Store::record_once`].
    pub fn marked(&self, key: &str) -> bool {
        lock(&self.inner.memory).marks.contains(key)
    }

    /// Exempts an open lease from the runtime rules (idle, duration) until `until_ms`, recorded
    /// with who granted it and why, and audited as an `alert` Action with reason `exempt`.
    pub fn exempt(
        &self,
        id: &str,
        until_ms: i64,
        by: &str,
        reason: &str,
        now_ms: i64,
    ) -> Pending<Lease> {
        let (id, by, reason) = (id.to_owned(), by.to_owned(), reason.to_owned());
        self.mutate(move |memory| {
            let (id, by, reason) = (id.as_str(), by.as_str(), reason.as_str());
            let Some(lease) = memory.open(id).cloned() else {
                return Change::NotOpen {
                    id: id.to_owned(),
                    to: None,
                };
            };
            memory.exempt.insert(lease.id.clone(), until_ms);
            let detail = format!(
                "exempt from the idle and duration rules until {} (granted by {by}): {reason}",
                humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + Duration::from_millis(until_ms.max(0) as u64)
                )
            );
            // The policy it exempts from, named as the rules name it: `workloads.<workload>`.
            let record = Audit::lease(ActionKind::Alert, &lease, "exempt")
                .under_workload_policy(lease.workload)
                .at(now_ms, Outcome::Ok, detail);
            let ops = vec![
                Op::Exempt {
                    lease_id: lease.id.clone(),
                    until_ms,
                    by: by.into(),
                    reason: reason.into(),
                    at: now_ms,
                },
                outbox(&record, now_ms),
            ];
            Change::Write(lease, ops)
        })
    }

    /// When the lease's exemption from the runtime rules ends, if it has one.
    pub fn exempt_until(&self, id: &str) -> Option<i64> {
        lock(&self.inner.memory).exempt.get(id).copied()
    }

    /// Takes a `lease_utilization` signal of `ts_ms` about lease `id` as the newest handled for
    /// it, unless the lease is not open or one as new was handled before, in this run or an
    /// earlier one: the answer says whether to act on it. The time is kept in the file until
    /// the lease ends, so an old signal replayed after a restart is ignored as it would have
    /// been before. The time is queued ahead of whatever acting on the signal writes, so it is
    /// committed no later than any of that: awaiting [`Pending::applied`] is enough.
    ///
    /// No time later than `ceiling_ms` (the enforcer's now plus `pipeline.clock.max_skew`) is
    /// trusted: a signal dated past it is not taken (the caller refuses it first), and a kept
    /// time past it (the enforcer's clock moved back since, as `gpuwarden up --start` on an
    /// existing database does) no longer shuts out the signals dated before it.
    pub fn note_utilization_signal(&self, id: &str, ts_ms: i64, ceiling_ms: i64) -> Pending<bool> {
        let id = id.to_owned();
        self.mutate(move |memory| {
            let id = id.as_str();
            if ts_ms > ceiling_ms
                || memory.open(id).is_none()
                || memory
                    .signals
                    .get(id)
                    .is_some_and(|&t| t >= ts_ms && t <= ceiling_ms)
            {
                return Change::Unchanged(false);
            }
            memory.signals.insert(id.to_owned(), ts_ms);
            let keep = Op::Signal {
                lease_id: id.to_owned(),
                ts_ms,
            };
            Change::Write(true, vec![keep])
        })
    }

    /// Up to `limit` unpublished outbox rows, oldest first.
    pub fn outbox_pending(&self, limit: usize) -> Pending<Vec<OutboxRow>> {
        self.read(move |db| db.outbox_pending(limit))
    }

    /// The newest `limit` Actions recorded (the audit trail, as it went to the outbox),
    /// newest first; only those about `team` when given. A row that does not read as an Action
    /// is skipped.
    pub fn recent_actions(&self, limit: usize, team: Option<&str>) -> Pending<Vec<Action>> {
        use gpuwarden_schema::Record as _;
        let team = team.map(str::to_owned);
        self.read(move |db| {
            // Newest first over the outbox's ids; a team's rows are picked out of the payload
            // (the outbox keeps no team column), within a bounded scan.
            let scan = if team.is_some() { limit * 20 } else { limit };
            let mut out = Vec::new();
            for payload in db.newest_payloads(Action::TOPIC, scan)? {
                let Ok(action) = Action::from_json(payload.as_bytes()) else {
                    continue;
                };
                if team
                    .as_deref()
                    .is_none_or(|t| action.team.as_deref() == Some(t))
                {
                    out.push(action);
                }
                if out.len() >= limit {
                    break;
                }
            }
            Ok(out)
        })
    }

    /// The Actions about any of `lease_ids` recorded at or after `since_ms`, newest first. The
    /// scan walks the outbox back from its newest row and stops at the first row older than
    /// `since_ms` (rows are appended in time order), so it reads what was recorded since then
    /// and no more: callers pass the oldest grant time of the leases they ask about. A row that
    /// does not read as an Action is skipped.
    pub fn lease_actions(
        &self,
        lease_ids: std::collections::HashSet<String>,
        since_ms: i64,
    ) -> Pending<Vec<Action>> {
        self.lease_records(lease_ids, since_ms)
    }

    /// The LeaseEvents of any of `lease_ids` recorded at or after `since_ms`, newest first, read
    /// as [`Store::lease_actions`] reads Actions: a lease's grant and resizes, the GPUs it held
    /// over time.
    pub fn lease_events(
        &self,
        lease_ids: std::collections::HashSet<String>,
        since_ms: i64,
    ) -> Pending<Vec<gpuwarden_schema::LeaseEvent>> {
        self.lease_records(lease_ids, since_ms)
    }

    /// The outbox's records of topic `R` keyed by any of `lease_ids`, recorded at or after
    /// `since_ms`, newest first; a row that does not read as an `R` is skipped.
    fn lease_records<R: gpuwarden_schema::Record + Send + 'static>(
        &self,
        lease_ids: std::collections::HashSet<String>,
        since_ms: i64,
    ) -> Pending<Vec<R>> {
        self.read(move |db| {
            if lease_ids.is_empty() {
                return Ok(Vec::new());
            }
            Ok(db
                .keyed_payloads_since(R::TOPIC, &lease_ids, since_ms)?
                .iter()
                .filter_map(|payload| R::from_json(payload.as_bytes()).ok())
                .collect())
        })
    }

    /// How many outbox rows wait to be published.
    pub fn outbox_pending_count(&self) -> Pending<usize> {
        self.read(|db| db.outbox_pending_count())
    }

    /// Deletes outbox rows Kafka acknowledged before `published_before_ms`, `batch` rows per
    /// commit (so admissions are not held behind one long delete), and returns how many went.
    /// Never deleted: a row not yet published, a row of a lease still open (the portal reads a
    /// lease's history from the outbox), and the newest row (outbox ids are rowids, which only
    /// grow while the newest row is kept).
    pub async fn prune_outbox(
        &self,
        published_before_ms: i64,
        batch: usize,
    ) -> Result<usize, StoreError> {
        let batch = batch.max(1);
        let mut deleted = 0;
        // Each batch's scan starts after the last id of the one before, so the rows kept (open
        // leases', unpublished) are passed over once per run, not once per batch.
        let mut after = i64::MIN;
        loop {
            let ids: Vec<i64> = self
                .read(move |db| db.prunable(published_before_ms, batch, after))
                .await?;
            let n = ids.len();
            if let Some(&last) = ids.last() {
                after = last;
            }
            if n > 0 {
                self.mutate(move |_| Change::Write((), vec![Op::DeletePublished(ids)]))
                    .await?;
            }
            deleted += n;
            if n < batch {
                return Ok(deleted);
            }
        }
    }

    /// Opens a portal session where every replica reads it (a shared store only): `id_sha256`
    /// is the SHA-256 of the session id (the id itself is never stored), `session` the
    /// principal's name, the CSRF token and when it opened; first ended are those opened before
    /// `lifetime_ms`, then the oldest of the same principal beyond `per_principal - 1` and the
    /// oldest of all beyond `kept - 1`.
    pub fn portal_session_open(
        &self,
        id_sha256: &str,
        session: PortalSession,
        lifetime_ms: i64,
        per_principal: usize,
        kept: usize,
    ) -> Pending<()> {
        let id = id_sha256.to_owned();
        let limits = (lifetime_ms, per_principal as i64, kept as i64);
        self.read(move |db| db.session_open(&id, &session, limits))
    }

    /// The portal session whose id hashes to `id_sha256`, if it opened after `since_ms`.
    pub fn portal_session(&self, id_sha256: &str, since_ms: i64) -> Pending<Option<PortalSession>> {
        let id = id_sha256.to_owned();
        self.read(move |db| db.session(&id, since_ms))
    }

    /// Ends the portal session whose id hashes to `id_sha256`.
    pub fn portal_session_close(&self, id_sha256: &str) -> Pending<()> {
        let id = id_sha256.to_owned();
        self.read(move |db| db.session_close(&id))
    }

    /// Marks a request form's one-use `token` sent at `at_ms`: `Ok` the first time, else the
    /// lease it made (if any). Tokens sent more than `kept_ms` before are forgotten.
    pub fn portal_submission_first(
        &self,
        token: &str,
        at_ms: i64,
        kept_ms: i64,
    ) -> Pending<Result<(), Option<String>>> {
        let token = token.to_owned();
        self.read(move |db| db.submission_first(&token, at_ms, kept_ms))
    }

    /// Records the lease the form sent with `token` made.
    pub fn portal_submission_made(&self, token: &str, lease_id: &str) -> Pending<()> {
        let (token, lease) = (token.to_owned(), lease_id.to_owned());
        self.read(move |db| db.submission_made(&token, &lease))
    }

    /// Records a failed login this replica saw (source address, the SHA-256 of the token in
    /// hex), for the other replicas' limits.
    pub fn login_failed(
        &self,
        source: Option<String>,
        principal_sha256: Option<String>,
        at_ms: i64,
    ) -> Pending<()> {
        let replica = self.inner.leadership.replica();
        self.read(move |db| {
            db.login_failed(
                &replica,
                source.as_deref(),
                principal_sha256.as_deref(),
                at_ms,
            )
        })
    }

    /// The failed logins the other replicas saw after id `after` and since `since_ms` (older
    /// ones are deleted).
    pub fn login_failures(&self, after: i64, since_ms: i64) -> Pending<Vec<LoginFailure>> {
        let replica = self.inner.leadership.replica();
        self.read(move |db| db.login_failures(&replica, after, since_ms))
    }

    /// Marks outbox rows as published (once Kafka has acknowledged them). It changes nothing in
    /// memory, but is queued through `Store::mutate` like every other write.
    pub fn outbox_mark_published(&self, ids: &[i64], now_ms: i64) -> Pending<()> {
        let published = Op::MarkPublished {
            ids: ids.to_vec(),
            at: now_ms,
        };
        self.mutate(move |_| Change::Write((), vec![published]))
    }
}
