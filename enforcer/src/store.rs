//! The durable lease store: one SQLite database (WAL mode, `synchronous = FULL`) holding leases,
//! blocked teams, the latest team spend, and an outbox of records for Kafka.
//!
//! Every lease change writes its `LeaseEvent` (and, for admissions, its `Action`) to the outbox in
//! the same transaction, so the topics can never miss or invent a change; the publisher reads
//! [`Store::outbox_pending`] and marks rows with [`Store::outbox_mark_published`].
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
//! them, so a caller always reads its own changes.
//!
//! If a commit fails (disk full, I/O error), memory is ahead of the file: the store refuses every
//! later call with [`StoreError::Broken`] and the enforcer must restart, which reloads memory from
//! what the file holds. Callers whose changes were in the failed batch were told they failed.

use std::collections::VecDeque;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use gpuwarden_schema::config::PricingConfig;
use gpuwarden_schema::{
    end_after, Action, ActionKind, LeaseEvent, LeaseEventKind, Outcome, Record, ReleaseReason,
    Workload, V1,
};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use utoipa::ToSchema;

use crate::policy::{AdmissionRequest, Decision, HeldGpus, Holding, WorkloadName};

pub mod audit;

/// A lease store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed (disk, lock timeout, corruption); the operation did not happen.
    #[error("the lease store failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// No lease has this id.
    #[error("there is no lease {0}")]
    NotFound(String),
    /// The lease's state does not allow the change.
    #[error("lease {id} is {from} and cannot become {to}")]
    InvalidTransition {
        /// The lease.
        id: String,
        /// Its state.
        from: LeaseState,
        /// The state asked for.
        to: LeaseState,
    },
    /// A row holds something this version cannot read (written by a newer version, or edited).
    #[error("the lease store holds an unreadable row: {0}")]
    Corrupt(String),
    /// Another store (in this process or another) has the database open.
    #[error("the lease store {0} is in use by another enforcer; only one may open it at a time")]
    InUse(String),
    /// The store's files could not be opened or locked.
    #[error("the lease store failed: {0}")]
    Io(String),
    /// An earlier commit failed, so memory no longer matches the file; restart the enforcer.
    #[error("the lease store stopped after a failed commit ({0}); restart the enforcer to reload it from disk")]
    Broken(String),
    /// The database was written by a newer gpuwarden.
    #[error("the lease store is at schema version {found}; this build knows up to {known}")]
    TooNew {
        /// Version in the file.
        found: i64,
        /// Latest version this build knows.
        known: i64,
    },
}

/// Where a lease is in its life. `granted → active → releasing → released`, and `failed` from
/// any open state; `released` and `failed` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Admitted and recorded; the substrate is being asked to start it.
    Granted,
    /// The substrate runs it.
    Active,
    /// The substrate is being asked to end it.
    Releasing,
    /// Ended; its GPUs are free.
    Released,
    /// The substrate could not run or end it cleanly; its GPUs are free.
    Failed,
}

impl LeaseState {
    /// The snake_case name used in JSON and the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Active => "active",
            Self::Releasing => "releasing",
            Self::Released => "released",
            Self::Failed => "failed",
        }
    }

    /// Parses [`LeaseState::as_str`]'s names.
    pub fn parse(text: &str) -> Option<Self> {
        [
            Self::Granted,
            Self::Active,
            Self::Releasing,
            Self::Released,
            Self::Failed,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }

    /// Whether the lease still holds its GPUs.
    pub fn is_open(self) -> bool {
        matches!(self, Self::Granted | Self::Active | Self::Releasing)
    }

    /// Whether a lease in this state may move to `to`.
    pub fn can_become(self, to: LeaseState) -> bool {
        use LeaseState::*;
        matches!(
            (self, to),
            (Granted, Active | Releasing | Released | Failed)
                | (Active, Releasing | Released | Failed)
                | (Releasing, Releasing | Released | Failed)
        )
    }
}

impl std::fmt::Display for LeaseState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One lease. Times are Unix epoch milliseconds (UTC).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Lease {
    /// The lease's id.
    pub id: String,
    /// The team it is charged to.
    pub team: String,
    /// The person it is for.
    pub user: String,
    /// The project the work belongs to.
    pub project: String,
    /// The kind of work.
    #[schema(value_type = WorkloadName)]
    pub workload: Workload,
    /// The substrate it runs on.
    pub substrate: String,
    /// Full model name of its GPUs.
    pub gpu_model: String,
    /// GPUs held.
    pub gpu_count: u32,
    /// The GPUs held; empty on a substrate that picks devices itself.
    pub gpu_uuids: Vec<String>,
    /// Labels from the request.
    pub labels: BTreeMap<String, String>,
    /// Where it is in its life.
    pub state: LeaseState,
    /// When it was admitted.
    pub granted_at: i64,
    /// When it must end; null when it has no end.
    pub expires_at: Option<i64>,
    /// When it last changed.
    pub updated_at: i64,
    /// When it ended.
    pub released_at: Option<i64>,
    /// Why it ended.
    #[schema(value_type = Option<crate::policy::ReleaseReasonName>)]
    pub release_reason: Option<ReleaseReason>,
}

impl Lease {
    /// The policy's view of it.
    pub fn holding(&self, now_ms: i64) -> Holding {
        Holding {
            team: self.team.clone(),
            workload: self.workload,
            substrate: self.substrate.clone(),
            gpu_model: self.gpu_model.clone(),
            gpu_uuids: self.gpu_uuids.clone(),
            gpu_count: self.gpu_count,
            remaining: self
                .expires_at
                .map(|e| Duration::from_millis(e.saturating_sub(now_ms).max(0) as u64)),
        }
    }

    fn event(&self, kind: LeaseEventKind, ts_ms: i64) -> LeaseEvent {
        LeaseEvent {
            v: V1,
            ts_ms,
            event: kind,
            lease_id: self.id.clone(),
            team: self.team.clone(),
            user: self.user.clone(),
            project: self.project.clone(),
            workload: self.workload,
            substrate: self.substrate.clone(),
            gpu_model: self.gpu_model.clone(),
            gpu_count: self.gpu_count,
            gpu_uuids: self.gpu_uuids.clone(),
            labels: (!self.labels.is_empty()).then(|| self.labels.clone()),
            reason: self
                .release_reason
                .filter(|_| kind == LeaseEventKind::Released),
        }
    }
}

/// What the store knows that the policy needs: who holds what, who spent what, who is blocked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    /// GPUs each team holds in open leases.
    pub held_gpus: BTreeMap<String, u32>,
    /// Month-to-date spend per team: the latest `team_spend` signal of this month plus the cost
    /// the team's open leases have accrued since it (at their current GPU count).
    pub spend_usd: BTreeMap<String, f64>,
    /// Blocked teams.
    pub blocked: BTreeSet<String>,
    /// UUIDs held by open leases, by substrate (shared with the store, which copies a set only
    /// when it changes one a ledger still holds).
    pub busy: BTreeMap<String, Arc<HeldGpus>>,
    /// Pooled GPUs held by open leases, by substrate and model.
    pub pooled_in_use: BTreeMap<String, BTreeMap<String, u32>>,
}

/// A filter for [`Store::leases`].
#[derive(Debug, Clone, Default)]
pub struct LeaseFilter {
    /// Only leases of these teams (`None`: all teams).
    pub teams: Option<Vec<String>>,
    /// Only leases in this state.
    pub state: Option<LeaseState>,
}

/// One record waiting to be published.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// Position in the outbox; publish in this order.
    pub id: i64,
    /// Kafka topic.
    pub topic: String,
    /// Kafka key.
    pub key: String,
    /// The record's JSON.
    pub payload: String,
    /// When it was written.
    pub created_at: i64,
}

const MIGRATIONS: &[&str] = &[
    // 1: leases, the outbox, blocked teams, the latest spend per team.
    "CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        user TEXT NOT NULL,
        project TEXT NOT NULL,
        workload TEXT NOT NULL,
        substrate TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        gpu_count INTEGER NOT NULL,
        gpu_uuids TEXT NOT NULL,
        labels TEXT NOT NULL,
        state TEXT NOT NULL,
        granted_at INTEGER NOT NULL,
        expires_at INTEGER,
        updated_at INTEGER NOT NULL,
        released_at INTEGER,
        release_reason TEXT
    );
    CREATE INDEX leases_team_state ON leases (team, state);
    CREATE INDEX leases_state ON leases (state);
    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        topic TEXT NOT NULL,
        key TEXT NOT NULL,
        payload TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        published_at INTEGER
    );
    CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;
    CREATE TABLE blocked_teams (
        team TEXT PRIMARY KEY,
        reason TEXT NOT NULL,
        blocked_at INTEGER NOT NULL
    );
    CREATE TABLE team_spend (
        team TEXT PRIMARY KEY,
        month_to_date_usd REAL NOT NULL,
        burn_usd_per_hour REAL NOT NULL,
        ts_ms INTEGER NOT NULL
    );",
    // 2: the open leases live in memory, so nothing looks leases up by state any more; an index
    // holding the state is only rewritten on every transition. Listing by team keeps one.
    "DROP INDEX leases_team_state;
    DROP INDEX leases_state;
    CREATE INDEX leases_team ON leases (team);",
    // 3: the runtime rules: exemptions an admin granted, and the marks that make a rule's step
    // happen once whatever the signals repeat (a warning per idle run, a dry-run record).
    "CREATE TABLE exemptions (
        lease_id TEXT PRIMARY KEY,
        until_ms INTEGER NOT NULL,
        granted_by TEXT NOT NULL,
        reason TEXT NOT NULL,
        at INTEGER NOT NULL
    );
    CREATE TABLE rule_marks (
        key TEXT PRIMARY KEY,
        at INTEGER NOT NULL
    );",
    // 4: fewer b-trees for each commit to rewrite. Leases are kept in their id's order (WITHOUT
    // ROWID: the table is its primary key, no separate index of ids), and outbox ids are plain
    // rowids (AUTOINCREMENT rewrote sqlite_sequence on every insert; ids still only grow while
    // the newest row is kept, and the publisher needs only their order).
    "CREATE TABLE leases_v4 (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        user TEXT NOT NULL,
        project TEXT NOT NULL,
        workload TEXT NOT NULL,
        substrate TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        gpu_count INTEGER NOT NULL,
        gpu_uuids TEXT NOT NULL,
        labels TEXT NOT NULL,
        state TEXT NOT NULL,
        granted_at INTEGER NOT NULL,
        expires_at INTEGER,
        updated_at INTEGER NOT NULL,
        released_at INTEGER,
        release_reason TEXT
    ) WITHOUT ROWID;
    INSERT INTO leases_v4 SELECT * FROM leases;
    DROP TABLE leases;
    ALTER TABLE leases_v4 RENAME TO leases;
    CREATE INDEX leases_team ON leases (team);
    CREATE TABLE outbox_v4 (
        id INTEGER PRIMARY KEY,
        topic TEXT NOT NULL,
        key TEXT NOT NULL,
        payload TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        published_at INTEGER
    );
    INSERT INTO outbox_v4 SELECT * FROM outbox;
    DROP TABLE outbox;
    ALTER TABLE outbox_v4 RENAME TO outbox;
    CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;",
];

const OPEN: &str = "state IN ('granted', 'active', 'releasing')";
/// A lease row's columns, in the order `row_to_raw` reads them; a macro, so that the SQL of the
/// insert every admission runs is built once, at compile time.
macro_rules! lease_columns {
    () => {
        "id, team, user, project, workload, substrate, gpu_model, gpu_count, gpu_uuids, labels, \
         state, granted_at, expires_at, updated_at, released_at, release_reason"
    };
}
const COLUMNS: &str = lease_columns!();
const INSERT_LEASE: &str = concat!(
    "INSERT INTO leases (",
    lease_columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)"
);
/// Most jobs the writer commits in one transaction.
const MAX_BATCH: usize = 512;
/// Longest a change nobody waits for (see [`Pending::applied`]) stays uncommitted when no
/// waited-for change comes along to carry it.
const LAZY_COMMIT: Duration = Duration::from_millis(20);

/// The lease store. Cheap to clone; clones share one store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

struct Inner {
    path: PathBuf,
    /// What the policy reads, kept in step with the database: every change is applied here and
    /// its writes queued to the writer while this lock is held, so the writer commits changes
    /// in the order memory saw them.
    memory: Mutex<Memory>,
    /// Jobs for the writer thread.
    queue: Arc<Queue>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set (once) when a commit failed: memory is then ahead of the file, so the store refuses
    /// every later call until the enforcer restarts and reloads from the file.
    broken: Arc<OnceLock<String>>,
    /// Held (an exclusive lock on `<database>.lock`) for as long as the store is open.
    _owner: File,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The writer ends once it has committed what was queued.
        self.queue.close();
        if let Some(writer) = lock(&self.writer).take() {
            let _ = writer.join();
        }
    }
}

/// The open leases, the latest spend per team and the blocked teams.
#[derive(Default)]
struct Memory {
    /// Changed only through [`Memory::put`] and [`Memory::take`], which keep `held` in step.
    open: HashMap<String, Lease>,
    /// What the open leases hold, so that an admission reads it instead of walking them all.
    held: Held,
    spend: BTreeMap<String, (f64, i64)>,
    blocked: BTreeSet<String>,
    /// Lease → the time its exemption from the runtime rules ends.
    exempt: HashMap<String, i64>,
    /// Steps of the runtime rules already taken (see [`Store::record_once`]).
    marks: HashSet<String>,
}

/// What the open leases hold, by team and by substrate.
#[derive(Default)]
struct Held {
    /// GPUs, by team.
    gpus: BTreeMap<String, u32>,
    /// Named GPUs, by substrate.
    busy: BTreeMap<String, Arc<HeldGpus>>,
    /// Pooled GPUs, by substrate and model.
    pooled: BTreeMap<String, BTreeMap<String, u32>>,
    /// What each team's open leases cost over time, summed so that a team's spend is read
    /// without walking its leases.
    accruals: BTreeMap<String, Accruals>,
}

/// What a team's open leases have cost, kept as exact sums per model. A lease accrues from its
/// grant or from `since` (the team's latest spend signal, else the month's start), whichever is
/// later, so over the leases of a model the GPU-milliseconds to `now` are
/// `now × GPUs − since × GPUs granted by since − Σ grant × GPUs of those granted after`; the sums
/// of leases granted by `since` are folded in as `since` moves, each lease once.
#[derive(Default)]
struct Accruals {
    models: BTreeMap<String, ModelAccrual>,
}

/// One model's sums. Any `folded_until` is consistent while there are no leases, so the
/// default (0) is as good a start as any.
#[derive(Default)]
struct ModelAccrual {
    /// Open leases by grant time (ms): GPUs, and grant × GPUs.
    by_grant: BTreeMap<i64, (i64, i128)>,
    /// The same over every open lease.
    gpus: i64,
    weighted: i128,
    /// The same over the leases granted by `folded_until`.
    folded_until: i64,
    folded_gpus: i64,
    folded_weighted: i128,
}

impl ModelAccrual {
    /// Counts `gpus` GPUs granted at `granted_at` in the sums (negative: takes them out).
    fn add(&mut self, granted_at: i64, gpus: i64) {
        let weighted = i128::from(granted_at) * i128::from(gpus);
        let entry = self.by_grant.entry(granted_at).or_default();
        entry.0 += gpus;
        entry.1 += weighted;
        if entry.0 == 0 {
            self.by_grant.remove(&granted_at);
        }
        self.gpus += gpus;
        self.weighted += weighted;
        if granted_at <= self.folded_until {
            self.folded_gpus += gpus;
            self.folded_weighted += weighted;
        }
    }

    /// GPU-milliseconds accrued by `now`, counting from `since` (None when a lease or `since`
    /// lies after `now`: a clock that went back; the caller walks the leases then).
    fn gpu_ms(&mut self, since: i64, now: i64) -> Option<i128> {
        let latest = self.by_grant.last_key_value().map_or(i64::MIN, |(&g, _)| g);
        if now < since || now < latest {
            return None;
        }
        use std::ops::Bound::{Excluded, Included};
        if since > self.folded_until {
            for (_, &(g, w)) in self
                .by_grant
                .range((Excluded(self.folded_until), Included(since)))
            {
                self.folded_gpus += g;
                self.folded_weighted += w;
            }
        } else if since < self.folded_until {
            for (_, &(g, w)) in self
                .by_grant
                .range((Excluded(since), Included(self.folded_until)))
            {
                self.folded_gpus -= g;
                self.folded_weighted -= w;
            }
        }
        self.folded_until = since;
        let from = i128::from(since) * i128::from(self.folded_gpus)
            + (self.weighted - self.folded_weighted);
        Some(i128::from(now) * i128::from(self.gpus) - from)
    }
}

impl Accruals {
    /// Counts `lease`'s GPUs in its model's sums, `sign` 1, or takes them out, `sign` -1.
    fn add(&mut self, lease: &Lease, sign: i64) {
        let model = slot(&mut self.models, &lease.gpu_model);
        model.add(lease.granted_at, sign * i64::from(lease.gpu_count));
        if model.by_grant.is_empty() {
            self.models.remove(&lease.gpu_model);
        }
    }

    /// USD accrued by `now` since `since`, or None (see [`ModelAccrual::gpu_ms`]).
    fn usd(&mut self, since: i64, now: i64, pricing: &PricingConfig) -> Option<f64> {
        let mut usd = 0.0;
        for (model, accrual) in &mut self.models {
            let gpu_ms = accrual.gpu_ms(since, now)?;
            usd += gpu_ms as f64 / 3_600_000.0 * pricing.usd_per_gpu_hour(model);
        }
        Some(usd)
    }
}

/// One write the writer thread carries out.
enum Op {
    InsertLease(Box<Lease>),
    /// Stores the lease's state, GPUs, end, and release.
    UpdateLease(Box<Lease>),
    Outbox {
        topic: &'static str,
        key: String,
        payload: String,
        created_at: i64,
    },
    Block {
        team: String,
        reason: String,
        at: i64,
    },
    Unblock {
        team: String,
    },
    Spend {
        team: String,
        month_to_date_usd: f64,
        burn_usd_per_hour: f64,
        ts_ms: i64,
    },
    MarkPublished {
        ids: Vec<i64>,
        at: i64,
    },
    Exempt {
        lease_id: String,
        until_ms: i64,
        by: String,
        reason: String,
        at: i64,
    },
    Mark {
        key: String,
        at: i64,
    },
    /// A lease row a later one in the same batch replaced.
    Nothing,
}

type Read = Box<dyn FnOnce(&Connection) + Send>;

enum Job {
    /// Ops committed together; `done` hears once they are durable (or why not).
    Write {
        ops: Vec<Op>,
        done: oneshot::Sender<Result<(), String>>,
    },
    /// A query, run after every write queued before it.
    Read(Read),
}

/// The writer's queue. Jobs are queued in the order memory saw their changes. The writer is woken
/// when someone waits: a query (always awaited), or a caller awaiting a write's commit (see
/// [`Pending`]). Changes nobody waits for ride along with the next commit, or are committed
/// after [`LAZY_COMMIT`], so they never cost a commit of their own.
struct Queue {
    state: Mutex<QueueState>,
    wake: Condvar,
    /// Someone waits for a queued job: commit without delay. Changed only with `state` locked,
    /// so a caller who finds it set without the lock has nothing to do: the writer has not
    /// taken a batch since, and will take the caller's job with it.
    wanted: AtomicBool,
    /// Transactions committed, and the write jobs they carried.
    commits: AtomicU64,
    writes: AtomicU64,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    /// The store is closing: commit what is queued, then stop.
    closed: bool,
    /// The writer sleeps until woken (nothing was queued), so even a change nobody waits for
    /// must wake it, to be committed within [`LAZY_COMMIT`].
    idle: bool,
}

impl Queue {
    fn new() -> Self {
        Self {
            state: Mutex::new(QueueState::default()),
            wake: Condvar::new(),
            wanted: AtomicBool::new(false),
            commits: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        }
    }

    fn push(&self, job: Job, wanted: bool) -> Result<(), StoreError> {
        let mut state = lock(&self.state);
        if state.closed {
            return Err(closed());
        }
        state.jobs.push_back(job);
        if wanted {
            self.wanted.store(true, Ordering::Release);
        }
        if wanted || state.idle {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Someone waits for what is queued.
    fn want(&self) {
        if self.wanted.load(Ordering::Acquire) {
            return;
        }
        let _state = lock(&self.state);
        if !self.wanted.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    fn close(&self) {
        lock(&self.state).closed = true;
        self.wake.notify_one();
    }

    /// The next batch, once someone waits for it, or it has waited [`LAZY_COMMIT`], or the
    /// store is closing; `None` when the store has closed and everything is committed.
    fn next_batch(&self) -> Option<Vec<Job>> {
        let mut state = lock(&self.state);
        loop {
            if state.jobs.is_empty() {
                if state.closed {
                    return None;
                }
                // A wish for jobs already taken.
                self.wanted.store(false, Ordering::Release);
                state.idle = true;
                state = self
                    .wake
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
                state.idle = false;
                continue;
            }
            if self.wanted.load(Ordering::Acquire) || state.closed {
                break;
            }
            let (next, timeout) = self
                .wake
                .wait_timeout(state, LAZY_COMMIT)
                .unwrap_or_else(PoisonError::into_inner);
            state = next;
            if timeout.timed_out() {
                break;
            }
        }
        let n = state.jobs.len().min(MAX_BATCH);
        let batch: Vec<Job> = state.jobs.drain(..n).collect();
        // Whoever asked may be in what is left.
        self.wanted.store(!state.jobs.is_empty(), Ordering::Release);
        Some(batch)
    }
}

/// How the writer has grouped changes into transactions: each commit is one fsync, so
/// `writes / commits` is how many changes shared one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Transactions committed.
    pub commits: u64,
    /// Changes (admissions, transitions, spend, marks, …) they carried.
    pub writes: u64,
}

/// The outcome of a store call. Changes are applied to the store's memory at once (so the next
/// call sees them) and become durable when the writer thread commits them, together with
/// whatever else was queued meanwhile (group commit). Wait for that with `.await` in async code
/// or [`Pending::wait`] on a thread that may block; either gives the value only once it is on
/// disk, or the error.
#[must_use = "a change is durable only once its Pending is awaited or waited on"]
pub struct Pending<T> {
    state: PendingState<T>,
}

enum PendingState<T> {
    Ready(Result<T, StoreError>),
    /// The value, the writer's answer, and its queue (to wake it when someone waits).
    Write(T, oneshot::Receiver<Result<(), String>>, Arc<Queue>),
    Read(oneshot::Receiver<Result<T, StoreError>>),
}

impl<T> Pending<T> {
    fn ready(result: Result<T, StoreError>) -> Self {
        Self {
            state: PendingState::Ready(result),
        }
    }

    /// Blocks the calling thread until the value is durable. Not for async code (use `.await`).
    pub fn wait(self) -> Result<T, StoreError> {
        match self.state {
            PendingState::Ready(result) => result,
            PendingState::Write(value, done, queue) => {
                queue.want();
                settle_write(value, done.blocking_recv())
            }
            PendingState::Read(answer) => answer.blocking_recv().unwrap_or_else(|_| Err(closed())),
        }
    }
}

impl<T: Send + 'static> Pending<T> {
    /// The value as soon as the change is applied in memory, without waiting for the commit
    /// (which still happens, in order, with the changes queued after it). For a step whose loss
    /// in a crash a restart repairs, e.g. `granted → active`, which re-adoption redoes. A query
    /// still waits for its answer.
    pub async fn applied(self) -> Result<T, StoreError> {
        match self.state {
            PendingState::Write(value, _, _) => Ok(value),
            state => Self { state }.await,
        }
    }
}

impl<T: Send + 'static> std::future::IntoFuture for Pending<T> {
    type Output = Result<T, StoreError>;
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Self::Output> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            match self.state {
                PendingState::Ready(result) => result,
                PendingState::Write(value, done, queue) => {
                    queue.want();
                    settle_write(value, done.await)
                }
                PendingState::Read(answer) => answer.await.unwrap_or_else(|_| Err(closed())),
            }
        })
    }
}

fn settle_write<T>(
    value: T,
    done: Result<Result<(), String>, oneshot::error::RecvError>,
) -> Result<T, StoreError> {
    match done {
        Ok(Ok(())) => Ok(value),
        Ok(Err(why)) => Err(StoreError::Broken(why)),
        Err(_) => Err(closed()),
    }
}

fn closed() -> StoreError {
    StoreError::Broken("the lease store's writer stopped".into())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Memory is changed only after every check has passed, so a panic cannot leave it half
    // changed.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
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
        // The owner lock above already keeps other stores out; holding SQLite's lock for good
        // spares every commit its lock calls (and keeps the WAL index in heap memory).
        conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // Every commit is on disk before its caller hears of it; group commit keeps that cheap.
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        migrate(&mut conn)?;
        let memory = load(&conn)?;
        let queue = Arc::new(Queue::new());
        let broken = Arc::new(OnceLock::new());
        let writer = {
            let (broken, queue) = (broken.clone(), queue.clone());
            std::thread::Builder::new()
                .name("lease-store".into())
                .spawn(move || write_loop(conn, &queue, &broken))
                .map_err(|e| StoreError::Io(format!("cannot start the store's writer: {e}")))?
        };
        Ok(Self {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                memory: Mutex::new(memory),
                queue,
                writer: Mutex::new(Some(writer)),
                broken,
                _owner: owner,
            }),
        })
    }

    fn check(&self) -> Result<(), StoreError> {
        match self.inner.broken.get() {
            Some(why) => Err(StoreError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Queues `ops` (call with the memory lock held, after changing memory); the value is
    /// handed back once they are committed. The writer is not woken until someone waits.
    fn write<T>(&self, value: T, ops: Vec<Op>) -> Pending<T> {
        let (done, heard) = oneshot::channel();
        let queue = &self.inner.queue;
        match queue.push(Job::Write { ops, done }, false) {
            Ok(()) => Pending {
                state: PendingState::Write(value, heard, queue.clone()),
            },
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Runs `query` on the writer's connection after every write queued so far.
    fn read<T: Send + 'static>(
        &self,
        query: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Pending<T> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let (answer, heard) = oneshot::channel();
        let job = Job::Read(Box::new(move |conn| {
            let _ = answer.send(query(conn));
        }));
        match self.inner.queue.push(job, true) {
            Ok(()) => Pending {
                state: PendingState::Read(heard),
            },
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// How many transactions the writer has committed, and how many changes they carried.
    pub fn commit_stats(&self) -> CommitStats {
        let queue = &self.inner.queue;
        CommitStats {
            commits: queue.commits.load(Ordering::Relaxed),
            writes: queue.writes.load(Ordering::Relaxed),
        }
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Pending<i64> {
        self.read(
            |conn| Ok(conn.query_row("SELECT version FROM schema_version", [], |r| r.get(0))?),
        )
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
        decide: impl FnOnce(Ledger) -> Decision,
    ) -> Pending<(Decision, Option<Lease>)> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        let decision = decide(memory.ledger_of(&request.team, now_ms, pricing));
        if request.dry_run {
            return Pending::ready(Ok((decision, None)));
        }
        match (&decision.placement, decision.admitted()) {
            (Some(p), true) => {
                let lease = Lease {
                    // Time-ordered (v7): new leases land at the end of the id index, so a commit
                    // rewrites one index page, not a random one per lease.
                    id: uuid::Uuid::now_v7().to_string(),
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
                    expires_at: decision.duration.map(|d| end_after(now_ms, d)),
                    updated_at: now_ms,
                    released_at: None,
                    release_reason: None,
                };
                let detail = format!(
                    "{} GPUs of {} on {}, ${:.2}/h",
                    lease.gpu_count,
                    lease.gpu_model,
                    lease.substrate,
                    decision.estimate.usd_per_hour
                );
                let ops = vec![
                    Op::InsertLease(Box::new(lease.clone())),
                    outbox(&lease.event(LeaseEventKind::Granted, now_ms), now_ms),
                    outbox(
                        &action(
                            ActionKind::Admit,
                            &lease,
                            "admitted",
                            Outcome::Ok,
                            detail,
                            now_ms,
                        ),
                        now_ms,
                    ),
                ];
                memory.put(lease.clone());
                self.write((decision, Some(lease)), ops)
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
                let deny = Action {
                    v: V1,
                    ts_ms: now_ms,
                    action: ActionKind::Deny,
                    lease_id: None,
                    team: Some(request.team.clone()),
                    reason: reason.into(),
                    policy: None,
                    driver: None,
                    outcome: Outcome::Ok,
                    detail,
                };
                self.write((decision, None), vec![outbox(&deny, now_ms)])
            }
        }
    }

    /// One lease.
    pub fn lease(&self, id: &str) -> Pending<Option<Lease>> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        if let Some(lease) = lock(&self.inner.memory).open.get(id) {
            return Pending::ready(Ok(Some(lease.clone())));
        }
        let id = id.to_owned();
        self.read(move |conn| get_lease(conn, &id))
    }

    /// Leases matching `filter`, newest first.
    pub fn leases(&self, filter: &LeaseFilter) -> Pending<Vec<Lease>> {
        let filter = filter.clone();
        self.read(move |conn| {
            let mut sql = format!("SELECT {COLUMNS} FROM leases WHERE 1 = 1");
            let mut args: Vec<String> = Vec::new();
            if let Some(state) = filter.state {
                sql.push_str(" AND state = ?");
                args.push(state.as_str().into());
            }
            if let Some(teams) = &filter.teams {
                if teams.is_empty() {
                    sql.push_str(" AND 0 = 1");
                } else {
                    sql.push_str(&format!(
                        " AND team IN ({})",
                        vec!["?"; teams.len()].join(", ")
                    ));
                    args.extend(teams.iter().cloned());
                }
            }
            sql.push_str(" ORDER BY granted_at DESC, id");
            let mut stmt = conn.prepare(&sql)?;
            let rows = stmt.query_map(rusqlite::params_from_iter(args.iter()), row_to_raw)?;
            rows.map(|r| r.map_err(StoreError::from).and_then(RawLease::parse))
                .collect()
        })
    }

    /// Open leases, oldest grant first.
    pub fn open_leases(&self) -> Result<Vec<Lease>, StoreError> {
        self.check()?;
        let mut open: Vec<Lease> = lock(&self.inner.memory).open.values().cloned().collect();
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
    fn change(
        &self,
        id: &str,
        to: Option<LeaseState>,
        change: impl FnOnce(&mut Lease) -> Result<(), StoreError>,
        records: impl FnOnce(&Lease) -> Vec<Op>,
    ) -> Pending<Lease> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        let Some(current) = memory.open.get(id) else {
            drop(memory);
            let id = id.to_owned();
            return self.read(move |conn| match get_lease(conn, &id)? {
                None => Err(StoreError::NotFound(id)),
                Some(lease) => Err(StoreError::InvalidTransition {
                    id,
                    from: lease.state,
                    to: to.unwrap_or(lease.state),
                }),
            });
        };
        let mut lease = current.clone();
        if let Err(e) = change(&mut lease) {
            return Pending::ready(Err(e));
        }
        let mut ops = vec![Op::UpdateLease(Box::new(lease.clone()))];
        ops.extend(records(&lease));
        if lease.state.is_open() {
            memory.put(lease.clone());
        } else {
            memory.take(&lease.id);
            memory.exempt.remove(&lease.id);
        }
        self.write(lease, ops)
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
        self.change(
            id,
            Some(to),
            |lease| {
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
            |lease| {
                if lease.state.is_open() {
                    return Vec::new();
                }
                let outcome = if to == LeaseState::Failed {
                    Outcome::Failed
                } else {
                    Outcome::Ok
                };
                let why = lease.release_reason.unwrap_or(reason).as_str();
                vec![
                    outbox(&lease.event(LeaseEventKind::Released, now_ms), now_ms),
                    outbox(
                        &action(ActionKind::Reclaim, lease, why, outcome, detail, now_ms),
                        now_ms,
                    ),
                ]
            },
        )
    }

    /// Sets an open lease's end to `expires_at`.
    pub fn extend(&self, id: &str, expires_at: i64, now_ms: i64) -> Pending<Lease> {
        self.change(
            id,
            None,
            |lease| {
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
        decide: impl FnOnce(Ledger, &Lease) -> Decision,
    ) -> Pending<(Decision, Lease)> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        let refusal = |from| StoreError::InvalidTransition {
            id: id.into(),
            from,
            to: from,
        };
        let lease = match memory.open.get(id) {
            Some(l) if l.state == LeaseState::Releasing => {
                return Pending::ready(Err(refusal(l.state)))
            }
            Some(l) => l.clone(),
            None => {
                drop(memory);
                return self.refuse_ended(id);
            }
        };
        let decision = decide(memory.ledger_of(&lease.team, now_ms, pricing), &lease);
        let Some(placement) = decision.placement.clone().filter(|_| decision.admitted()) else {
            return Pending::ready(Ok((decision, lease)));
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
        let ops = vec![
            Op::UpdateLease(Box::new(lease.clone())),
            outbox(&lease.event(LeaseEventKind::Resized, now_ms), now_ms),
            outbox(
                &action(
                    ActionKind::Resize,
                    &lease,
                    reason,
                    Outcome::Ok,
                    detail,
                    now_ms,
                ),
                now_ms,
            ),
        ];
        memory.put(lease.clone());
        self.write((decision, lease), ops)
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
        self.change(
            id,
            None,
            |lease| {
                lease.gpu_uuids.clone_from(&previous.gpu_uuids);
                lease.gpu_count = previous.gpu_count;
                lease.updated_at = now_ms;
                Ok(())
            },
            |lease| {
                vec![
                    outbox(&lease.event(LeaseEventKind::Resized, now_ms), now_ms),
                    outbox(
                        &action(
                            ActionKind::Resize,
                            lease,
                            "substrate_failed",
                            Outcome::Failed,
                            detail,
                            now_ms,
                        ),
                        now_ms,
                    ),
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
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        let changed = match reason {
            Some(_) => memory.blocked.insert(team.to_owned()),
            None => memory.blocked.remove(team),
        };
        if !changed {
            return Pending::ready(Ok(()));
        }
        let record = Action {
            v: V1,
            ts_ms: now_ms,
            action: if reason.is_some() {
                ActionKind::Block
            } else {
                ActionKind::Unblock
            },
            lease_id: None,
            team: Some(team.into()),
            reason: reason.unwrap_or("unblocked").into(),
            policy: None,
            driver: None,
            outcome: Outcome::Ok,
            detail: String::new(),
        };
        let change = match reason {
            Some(r) => Op::Block {
                team: team.into(),
                reason: r.into(),
                at: now_ms,
            },
            None => Op::Unblock { team: team.into() },
        };
        self.write((), vec![change, outbox(&record, now_ms)])
    }

    /// Records a `team_spend` signal; an older one than the one kept is ignored.
    pub fn record_team_spend(
        &self,
        team: &str,
        month_to_date_usd: f64,
        burn_usd_per_hour: f64,
        ts_ms: i64,
    ) -> Pending<()> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        if memory.spend.get(team).is_some_and(|&(_, ts)| ts > ts_ms) {
            return Pending::ready(Ok(()));
        }
        memory
            .spend
            .insert(team.to_owned(), (month_to_date_usd, ts_ms));
        self.write(
            (),
            vec![Op::Spend {
                team: team.into(),
                month_to_date_usd,
                burn_usd_per_hour,
                ts_ms,
            }],
        )
    }

    /// Records an Action (it goes to Kafka through the outbox).
    pub fn record_action(&self, action: &Action) -> Pending<()> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let _memory = lock(&self.inner.memory);
        self.write((), vec![outbox(action, action.ts_ms)])
    }

    /// Records `action` unless a step under `key` was recorded before (in this run or an
    /// earlier one): the mark and the Action commit together. The answer says whether it was
    /// recorded now.
    pub fn record_once(&self, key: &str, action: &Action) -> Pending<bool> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        if !memory.marks.insert(key.to_owned()) {
            return Pending::ready(Ok(false));
        }
        let ops = vec![
            Op::Mark {
                key: key.to_owned(),
                at: action.ts_ms,
            },
            outbox(action, action.ts_ms),
        ];
        self.write(true, ops)
    }

    /// Whether a step under `key` was recorded by [`Store::record_once`].
    pub fn marked(&self, key: &str) -> bool {
        lock(&self.inner.memory).marks.contains(key)
    }

    /// Why a lease that is not open cannot change: it does not exist, or it has ended (read from
    /// the file).
    fn refuse_ended<T: Send + 'static>(&self, id: &str) -> Pending<T> {
        let id = id.to_owned();
        self.read(move |conn| match get_lease(conn, &id)? {
            None => Err(StoreError::NotFound(id)),
            Some(l) => Err(StoreError::InvalidTransition {
                id,
                from: l.state,
                to: l.state,
            }),
        })
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
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        let mut memory = lock(&self.inner.memory);
        let Some(lease) = memory.open.get(id).cloned() else {
            drop(memory);
            return self.refuse_ended(id);
        };
        memory.exempt.insert(lease.id.clone(), until_ms);
        let detail = format!(
            "exempt from the idle and duration rules until {} (granted by {by}): {reason}",
            humantime::format_rfc3339_millis(
                std::time::UNIX_EPOCH + Duration::from_millis(until_ms.max(0) as u64)
            )
        );
        let mut record = action(
            ActionKind::Alert,
            &lease,
            "exempt",
            Outcome::Ok,
            detail,
            now_ms,
        );
        record.policy = Some(lease.workload.as_str().into());
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
        self.write(lease, ops)
    }

    /// When the lease's exemption from the runtime rules ends, if it has one.
    pub fn exempt_until(&self, id: &str) -> Option<i64> {
        lock(&self.inner.memory).exempt.get(id).copied()
    }

    /// Up to `limit` unpublished outbox rows, oldest first.
    pub fn outbox_pending(&self, limit: usize) -> Pending<Vec<OutboxRow>> {
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, topic, key, payload, created_at FROM outbox \
                 WHERE published_at IS NULL ORDER BY id LIMIT ?1",
            )?;
            let rows = stmt.query_map([limit as i64], |r| {
                Ok(OutboxRow {
                    id: r.get(0)?,
                    topic: r.get(1)?,
                    key: r.get(2)?,
                    payload: r.get(3)?,
                    created_at: r.get(4)?,
                })
            })?;
            Ok(rows.collect::<Result<_, _>>()?)
        })
    }

    /// How many outbox rows wait to be published.
    pub fn outbox_pending_count(&self) -> Pending<usize> {
        self.read(|conn| {
            let n: i64 = conn
                .prepare_cached("SELECT count(*) FROM outbox WHERE published_at IS NULL")?
                .query_row([], |r| r.get(0))?;
            Ok(n as usize)
        })
    }

    /// Marks outbox rows as published (once Kafka has acknowledged them).
    pub fn outbox_mark_published(&self, ids: &[i64], now_ms: i64) -> Pending<()> {
        if let Err(e) = self.check() {
            return Pending::ready(Err(e));
        }
        self.write(
            (),
            vec![Op::MarkPublished {
                ids: ids.to_vec(),
                at: now_ms,
            }],
        )
    }
}

impl Memory {
    /// Records `lease` as open (replacing its previous version) and what it holds.
    fn put(&mut self, lease: Lease) {
        // A change of state, end or release holds what it held: only the lease is replaced.
        if let Some(open) = self.open.get_mut(&lease.id) {
            let holds_the_same = open.team == lease.team
                && open.substrate == lease.substrate
                && open.gpu_model == lease.gpu_model
                && open.gpu_count == lease.gpu_count
                && open.gpu_uuids == lease.gpu_uuids
                && open.granted_at == lease.granted_at;
            if holds_the_same {
                *open = lease;
                return;
            }
        }
        self.take(&lease.id);
        let held = &mut self.held;
        *slot(&mut held.gpus, &lease.team) += lease.gpu_count;
        if lease.gpu_uuids.is_empty() {
            *slot(slot(&mut held.pooled, &lease.substrate), &lease.gpu_model) += lease.gpu_count;
        } else {
            Arc::make_mut(slot(&mut held.busy, &lease.substrate))
                .extend(lease.gpu_uuids.iter().cloned());
        }
        slot(&mut held.accruals, &lease.team).add(&lease, 1);
        self.open.insert(lease.id.clone(), lease);
    }

    /// Forgets an open lease and what it held; a team or pooled model left holding nothing has
    /// no entry, as if it never held anything.
    fn take(&mut self, id: &str) -> Option<Lease> {
        let lease = self.open.remove(id)?;
        let held = &mut self.held;
        if let Some(gpus) = held.gpus.get_mut(&lease.team) {
            *gpus = gpus.saturating_sub(lease.gpu_count);
            if *gpus == 0 {
                held.gpus.remove(&lease.team);
            }
        }
        if lease.gpu_uuids.is_empty() {
            if let Some(models) = held.pooled.get_mut(&lease.substrate) {
                if let Some(n) = models.get_mut(&lease.gpu_model) {
                    *n = n.saturating_sub(lease.gpu_count);
                    if *n == 0 {
                        models.remove(&lease.gpu_model);
                    }
                }
                if models.is_empty() {
                    held.pooled.remove(&lease.substrate);
                }
            }
        } else if let Some(busy) = held.busy.get_mut(&lease.substrate) {
            // Kept when empty: placement follows this history of changes, and a new one would
            // make it count the substrate's free GPUs anew.
            let set = Arc::make_mut(busy);
            for uuid in &lease.gpu_uuids {
                set.remove(uuid);
            }
        }
        if let Some(accruals) = held.accruals.get_mut(&lease.team) {
            accruals.add(&lease, -1);
            if accruals.models.is_empty() {
                held.accruals.remove(&lease.team);
            }
        }
        Some(lease)
    }

    /// The whole ledger: every team's spend.
    fn ledger(&mut self, now_ms: i64, pricing: &PricingConfig) -> Ledger {
        let mut teams: BTreeSet<String> = self.held.accruals.keys().cloned().collect();
        teams.extend(self.spend.keys().cloned());
        let spend_usd = teams
            .into_iter()
            .filter_map(|team| {
                let usd = self.spend_of(&team, now_ms, pricing)?;
                Some((team, usd))
            })
            .collect();
        Ledger {
            spend_usd,
            ..self.holdings()
        }
    }

    /// The ledger an admission or resize for `team` reads: what every team holds, but only
    /// `team`'s spend (all the policy looks at).
    fn ledger_of(&mut self, team: &str, now_ms: i64, pricing: &PricingConfig) -> Ledger {
        let mut ledger = self.holdings();
        if let Some(usd) = self.spend_of(team, now_ms, pricing) {
            ledger.spend_usd.insert(team.to_owned(), usd);
        }
        ledger
    }

    /// Held GPUs and blocked teams, without spend.
    fn holdings(&self) -> Ledger {
        Ledger {
            held_gpus: self.held.gpus.clone(),
            spend_usd: BTreeMap::new(),
            blocked: self.blocked.clone(),
            busy: self.held.busy.clone(),
            pooled_in_use: self.held.pooled.clone(),
        }
    }

    /// `team`'s month-to-date spend: its latest spend signal of this month plus what its open
    /// leases have accrued since (or since the month began, or since they were granted,
    /// whichever is latest), at their current GPU counts. None when it has neither.
    fn spend_of(&mut self, team: &str, now_ms: i64, pricing: &PricingConfig) -> Option<f64> {
        let month_start = month_start_ms(now_ms);
        let signal = self
            .spend
            .get(team)
            .filter(|&&(_, ts)| ts >= month_start)
            .copied();
        let since = signal.map_or(month_start, |(_, ts)| ts);
        let accrued = match self.held.accruals.get_mut(team) {
            None if signal.is_none() => return None,
            None => 0.0,
            Some(accruals) => match accruals.usd(since, now_ms, pricing) {
                Some(usd) => usd,
                // A clock that went back: lease by lease, each accruing nothing before it began.
                None => self
                    .open
                    .values()
                    .filter(|l| l.team == team)
                    .map(|l| {
                        let ms = (now_ms - since.max(l.granted_at)).max(0);
                        ms as f64 / 3_600_000.0
                            * f64::from(l.gpu_count)
                            * pricing.usd_per_gpu_hour(&l.gpu_model)
                    })
                    .sum(),
            },
        };
        Some(signal.map_or(0.0, |(usd, _)| usd) + accrued)
    }
}

/// `map[key]`, inserted as the default first if absent; the key is copied only then.
fn slot<'m, V: Default>(map: &'m mut BTreeMap<String, V>, key: &str) -> &'m mut V {
    if !map.contains_key(key) {
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key).expect("the key was just inserted")
}

/// Reads what memory holds from the file.
fn load(conn: &Connection) -> Result<Memory, StoreError> {
    let mut memory = Memory::default();
    {
        let mut stmt = conn.prepare(&format!("SELECT {COLUMNS} FROM leases WHERE {OPEN}"))?;
        let rows = stmt.query_map([], row_to_raw)?;
        for row in rows {
            let lease = row.map_err(StoreError::from).and_then(RawLease::parse)?;
            memory.put(lease);
        }
    }
    {
        let mut stmt = conn.prepare("SELECT team, month_to_date_usd, ts_ms FROM team_spend")?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, f64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })?;
        for row in rows {
            let (team, usd, ts) = row?;
            memory.spend.insert(team, (usd, ts));
        }
    }
    {
        let mut stmt = conn.prepare("SELECT team FROM blocked_teams")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        memory.blocked = rows.collect::<Result<_, _>>()?;
    }
    {
        let mut stmt = conn.prepare("SELECT lease_id, until_ms FROM exemptions")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        for row in rows {
            let (lease, until) = row?;
            if memory.open.contains_key(&lease) {
                memory.exempt.insert(lease, until);
            }
        }
    }
    let mut stmt = conn.prepare("SELECT key FROM rule_marks")?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    memory.marks = rows.collect::<Result<_, _>>()?;
    Ok(memory)
}

/// The writer thread: takes every job queued, runs them in one transaction, commits, and tells
/// each write's caller. A failed commit breaks the store for good (memory is then ahead of the
/// file); every job after that is refused.
fn write_loop(mut conn: Connection, queue: &Queue, broken: &OnceLock<String>) {
    while let Some(batch) = queue.next_batch() {
        let writes = batch
            .iter()
            .filter(|j| matches!(j, Job::Write { .. }))
            .count() as u64;
        let mut waiting = Vec::with_capacity(batch.len());
        let result = match broken.get() {
            Some(why) => Err(why.clone()),
            None => run_batch(&mut conn, batch, &mut waiting).map_err(|e| e.to_string()),
        };
        match &result {
            Ok(()) if writes > 0 => {
                queue.commits.fetch_add(1, Ordering::Relaxed);
                queue.writes.fetch_add(writes, Ordering::Relaxed);
            }
            Ok(()) => {}
            Err(why) => {
                if broken.set(why.clone()).is_ok() {
                    tracing::error!(error = %why, "the lease store could not commit; it refuses every change until the enforcer restarts");
                }
            }
        }
        for done in waiting {
            let _ = done.send(result.clone());
        }
    }
}

fn run_batch(
    conn: &mut Connection,
    mut batch: Vec<Job>,
    waiting: &mut Vec<oneshot::Sender<Result<(), String>>>,
) -> Result<(), StoreError> {
    coalesce(&mut batch);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut failed = None;
    for job in batch {
        match job {
            Job::Read(query) => query(&tx),
            Job::Write { ops, done } => {
                waiting.push(done);
                if failed.is_none() {
                    failed = ops.iter().try_for_each(|op| apply(&tx, op)).err();
                }
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    tx.commit()?;
    Ok(())
}

/// Within one batch only a lease's last row matters (they commit together): each lease's last
/// insert or update is written with the lease as it ends the batch, and earlier ones are
/// dropped. A query in the batch may then see a lease's later state, which memory already
/// showed every caller.
fn coalesce(batch: &mut [Job]) {
    let mut rows: HashMap<String, Vec<(usize, usize)>> = HashMap::new();
    for (j, job) in batch.iter().enumerate() {
        if let Job::Write { ops, .. } = job {
            for (o, op) in ops.iter().enumerate() {
                if let Op::InsertLease(l) | Op::UpdateLease(l) = op {
                    rows.entry(l.id.clone()).or_default().push((j, o));
                }
            }
        }
    }
    for positions in rows.into_values() {
        let Some((&(first_job, first_op), rest)) = positions.split_first() else {
            continue;
        };
        let Some((&(last_job, last_op), between)) = rest.split_last() else {
            continue;
        };
        let lease = match take(batch, last_job, last_op) {
            Op::InsertLease(l) | Op::UpdateLease(l) => l,
            _ => unreachable!("only lease rows were indexed"),
        };
        for &(j, o) in between {
            take(batch, j, o);
        }
        // The first row keeps its kind (an insert stays an insert) and takes the last values.
        let first = op_at(batch, first_job, first_op);
        *first = match first {
            Op::InsertLease(_) => Op::InsertLease(lease),
            _ => Op::UpdateLease(lease),
        };
    }
}

fn op_at(batch: &mut [Job], job: usize, op: usize) -> &mut Op {
    match &mut batch[job] {
        Job::Write { ops, .. } => &mut ops[op],
        Job::Read(_) => unreachable!("only writes were indexed"),
    }
}

fn take(batch: &mut [Job], job: usize, op: usize) -> Op {
    std::mem::replace(op_at(batch, job, op), Op::Nothing)
}

fn apply(tx: &Connection, op: &Op) -> Result<(), StoreError> {
    match op {
        Op::InsertLease(l) => {
            tx.prepare_cached(INSERT_LEASE)?.execute(params![
                l.id,
                l.team,
                l.user,
                l.project,
                l.workload.as_str(),
                l.substrate,
                l.gpu_model,
                l.gpu_count,
                json(&l.gpu_uuids),
                json(&l.labels),
                l.state.as_str(),
                l.granted_at,
                l.expires_at,
                l.updated_at,
                l.released_at,
                l.release_reason.map(ReleaseReason::as_str),
            ])?;
        }
        Op::UpdateLease(l) => {
            tx.prepare_cached(
                "UPDATE leases SET gpu_count = ?2, gpu_uuids = ?3, state = ?4, expires_at = ?5, \
                 updated_at = ?6, released_at = ?7, release_reason = ?8 WHERE id = ?1",
            )?
            .execute(params![
                l.id,
                l.gpu_count,
                json(&l.gpu_uuids),
                l.state.as_str(),
                l.expires_at,
                l.updated_at,
                l.released_at,
                l.release_reason.map(ReleaseReason::as_str),
            ])?;
        }
        Op::Outbox {
            topic,
            key,
            payload,
            created_at,
        } => {
            tx.prepare_cached(
                "INSERT INTO outbox (topic, key, payload, created_at) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![topic, key, payload, created_at])?;
        }
        Op::Block { team, reason, at } => {
            tx.prepare_cached(
                "INSERT OR IGNORE INTO blocked_teams (team, reason, blocked_at) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![team, reason, at])?;
        }
        Op::Unblock { team } => {
            tx.prepare_cached("DELETE FROM blocked_teams WHERE team = ?1")?
                .execute([team])?;
        }
        Op::Spend {
            team,
            month_to_date_usd,
            burn_usd_per_hour,
            ts_ms,
        } => {
            tx.prepare_cached(
                "INSERT INTO team_spend (team, month_to_date_usd, burn_usd_per_hour, ts_ms) \
                 VALUES (?1, ?2, ?3, ?4) ON CONFLICT (team) DO UPDATE SET \
                 month_to_date_usd = excluded.month_to_date_usd, \
                 burn_usd_per_hour = excluded.burn_usd_per_hour, ts_ms = excluded.ts_ms \
                 WHERE excluded.ts_ms >= team_spend.ts_ms",
            )?
            .execute(params![team, month_to_date_usd, burn_usd_per_hour, ts_ms])?;
        }
        Op::Exempt {
            lease_id,
            until_ms,
            by,
            reason,
            at,
        } => {
            tx.prepare_cached(
                "INSERT INTO exemptions (lease_id, until_ms, granted_by, reason, at) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (lease_id) DO UPDATE SET \
                 until_ms = excluded.until_ms, granted_by = excluded.granted_by, \
                 reason = excluded.reason, at = excluded.at",
            )?
            .execute(params![lease_id, until_ms, by, reason, at])?;
        }
        Op::Mark { key, at } => {
            tx.prepare_cached("INSERT OR IGNORE INTO rule_marks (key, at) VALUES (?1, ?2)")?
                .execute(params![key, at])?;
        }
        Op::Nothing => {}
        Op::MarkPublished { ids, at } => {
            let mut stmt = tx.prepare_cached(
                "UPDATE outbox SET published_at = ?2 WHERE id = ?1 AND published_at IS NULL",
            )?;
            for id in ids {
                stmt.execute(params![id, at])?;
            }
        }
    }
    Ok(())
}

fn outbox<R: Record>(record: &R, now_ms: i64) -> Op {
    Op::Outbox {
        topic: R::TOPIC,
        key: record.key().to_owned(),
        payload: String::from_utf8(record.to_json()).expect("serde_json writes UTF-8"),
        created_at: now_ms,
    }
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute(
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
        [],
    )?;
    let version: Option<i64> = tx
        .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
        .optional()?;
    let version = match version {
        Some(v) => v,
        None => {
            tx.execute("INSERT INTO schema_version (version) VALUES (0)", [])?;
            0
        }
    };
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StoreError::TooNew {
            found: version,
            known,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        tx.execute_batch(sql)?;
        tx.execute("UPDATE schema_version SET version = ?1", [i as i64 + 1])?;
    }
    tx.commit()?;
    Ok(())
}

fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("string lists and maps serialize")
}

pub(crate) fn action(
    kind: ActionKind,
    lease: &Lease,
    reason: &str,
    outcome: Outcome,
    detail: String,
    ts_ms: i64,
) -> Action {
    Action {
        v: V1,
        ts_ms,
        action: kind,
        lease_id: Some(lease.id.clone()),
        team: Some(lease.team.clone()),
        reason: reason.into(),
        policy: None,
        driver: Some(lease.substrate.clone()),
        outcome,
        detail,
    }
}

type RawLease = (
    (String, String, String, String, String, String, String, u32),
    (
        String,
        String,
        String,
        i64,
        Option<i64>,
        i64,
        Option<i64>,
        Option<String>,
    ),
);

fn row_to_raw(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawLease> {
    Ok((
        (
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
            r.get(6)?,
            r.get(7)?,
        ),
        (
            r.get(8)?,
            r.get(9)?,
            r.get(10)?,
            r.get(11)?,
            r.get(12)?,
            r.get(13)?,
            r.get(14)?,
            r.get(15)?,
        ),
    ))
}

trait ParseRaw {
    fn parse(self) -> Result<Lease, StoreError>;
}

impl ParseRaw for RawLease {
    fn parse(self) -> Result<Lease, StoreError> {
        let ((id, team, user, project, workload, substrate, gpu_model, gpu_count), rest) = self;
        let (uuids, labels, state, granted_at, expires_at, updated_at, released_at, reason) = rest;
        let bad = |what: &str| StoreError::Corrupt(format!("lease {id}: {what}"));
        let workload = Workload::ALL
            .into_iter()
            .find(|w| w.as_str() == workload)
            .ok_or_else(|| bad("workload"))?;
        let release_reason = match reason {
            None => None,
            Some(r) => Some(
                serde_json::from_value(serde_json::Value::String(r))
                    .map_err(|_| bad("release_reason"))?,
            ),
        };
        Ok(Lease {
            workload,
            gpu_uuids: serde_json::from_str(&uuids).map_err(|_| bad("gpu_uuids"))?,
            labels: serde_json::from_str(&labels).map_err(|_| bad("labels"))?,
            state: LeaseState::parse(&state).ok_or_else(|| bad("state"))?,
            release_reason,
            id,
            team,
            user,
            project,
            substrate,
            gpu_model,
            gpu_count,
            granted_at,
            expires_at,
            updated_at,
            released_at,
        })
    }
}

fn get_lease(conn: &Connection, id: &str) -> Result<Option<Lease>, StoreError> {
    conn.query_row(
        &format!("SELECT {COLUMNS} FROM leases WHERE id = ?1"),
        [id],
        row_to_raw,
    )
    .optional()?
    .map(ParseRaw::parse)
    .transpose()
}

/// Start of the UTC calendar month holding `ms`.
fn month_start_ms(ms: i64) -> i64 {
    gpuwarden_schema::calendar::month_of(ms).0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A time in the middle of a month (2026-12-03).
    const NOW: i64 = 1_796_300_000_000;

    #[test]
    fn month_start_is_the_first_of_the_utc_month() {
        // 2024-03-15T12:00:00Z → 2024-03-01T00:00:00Z.
        assert_eq!(month_start_ms(1_710_504_000_000), 1_709_251_200_000);
        // 2024-02-29T23:59:59Z → 2024-02-01.
        assert_eq!(month_start_ms(1_709_251_199_000), 1_706_745_600_000);
        assert_eq!(month_start_ms(0), 0);
    }

    fn lease(id: &str, state: LeaseState, updated_at: i64) -> Box<Lease> {
        Box::new(Lease {
            id: id.into(),
            team: "ml".into(),
            user: "ada".into(),
            project: "p".into(),
            workload: Workload::Training,
            substrate: "sim".into(),
            gpu_model: "H100".into(),
            gpu_count: 1,
            gpu_uuids: vec!["GPU-0".into()],
            labels: BTreeMap::new(),
            state,
            granted_at: 0,
            expires_at: None,
            updated_at,
            released_at: None,
            release_reason: None,
        })
    }

    /// The holdings recounted from every open lease, as the ledger was once built each time.
    fn recount(memory: &Memory) -> Ledger {
        let mut ledger = Ledger {
            blocked: memory.blocked.clone(),
            ..Ledger::default()
        };
        for l in memory.open.values() {
            *slot(&mut ledger.held_gpus, &l.team) += l.gpu_count;
            if l.gpu_uuids.is_empty() {
                *slot(slot(&mut ledger.pooled_in_use, &l.substrate), &l.gpu_model) += l.gpu_count;
            } else {
                Arc::make_mut(slot(&mut ledger.busy, &l.substrate))
                    .extend(l.gpu_uuids.iter().cloned());
            }
        }
        ledger
    }

    /// A team's spend lease by lease, as the ledger once added it up each time.
    fn spend_lease_by_lease(
        memory: &Memory,
        team: &str,
        now: i64,
        pricing: &PricingConfig,
    ) -> Option<f64> {
        let month_start = month_start_ms(now);
        let signal = memory
            .spend
            .get(team)
            .filter(|&&(_, ts)| ts >= month_start)
            .copied();
        let since = signal.map_or(month_start, |(_, ts)| ts);
        let leases: Vec<&Lease> = memory.open.values().filter(|l| l.team == team).collect();
        if signal.is_none() && leases.is_empty() {
            return None;
        }
        let accrued: f64 = leases
            .iter()
            .map(|l| {
                let hours = (now - since.max(l.granted_at)).max(0) as f64 / 3_600_000.0;
                hours * f64::from(l.gpu_count) * pricing.usd_per_gpu_hour(&l.gpu_model)
            })
            .sum();
        Some(signal.map_or(0.0, |(usd, _)| usd) + accrued)
    }

    #[test]
    fn holdings_and_spend_kept_in_step_equal_a_recount_lease_by_lease() {
        let pricing = PricingConfig {
            default_usd_per_gpu_hour: 2.0,
            gpu: vec![gpuwarden_schema::config::GpuPrice {
                model_match: "h100".into(),
                usd_per_gpu_hour: 4.37,
            }],
            ..PricingConfig::default()
        };
        let mut memory = Memory::default();
        let month = month_start_ms(NOW);
        let hour: i64 = 3_600_000;
        memory.spend.insert("old".into(), (50.0, month - 1));
        let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d_u64);
        let teams = ["ml", "cv", "old"];
        let mut now = month + 2 * hour;
        for step in 0..3_000 {
            let id = format!("l{}", next(60));
            match next(8) {
                0 | 1 => drop(memory.take(&id)),
                // A transition: the same holdings, another state.
                3 if memory.open.contains_key(&id) => {
                    let mut l = memory.open[&id].clone();
                    l.state = LeaseState::Releasing;
                    l.updated_at = step;
                    memory.put(l);
                    assert_eq!(memory.open[&id].state, LeaseState::Releasing);
                }
                // A spend signal moves the time the team's leases accrue from, either way.
                2 => {
                    let ts = month + next(4 * hour as u64) as i64;
                    memory
                        .spend
                        .insert(teams[next(3) as usize].into(), (next(500) as f64, ts));
                }
                _ => {
                    // New, resized, moved or pooled: whatever it held before must be let go.
                    let mut l = *lease(&id, LeaseState::Active, step);
                    l.team = teams[next(3) as usize].into();
                    l.substrate = ["sim", "pool"][next(2) as usize].into();
                    l.gpu_model = ["NVIDIA H100 80GB HBM3", "A100"][next(2) as usize].into();
                    l.gpu_count = 1 + next(4) as u32;
                    l.gpu_uuids = match l.substrate.as_str() {
                        "pool" => Vec::new(),
                        _ => (0..l.gpu_count).map(|g| format!("GPU-{id}-{g}")).collect(),
                    };
                    l.granted_at = month + next(4 * hour as u64) as i64;
                    memory.put(l);
                }
            }
            // Mostly forward, now and then back (before some grants), or into the next month.
            now = match next(10) {
                0 => month + next(2 * hour as u64) as i64,
                1 => month + 32 * 24 * hour + next(hour as u64) as i64,
                _ => now.max(month + 4 * hour) + next(60_000) as i64,
            };
            let whole = memory.ledger(now, &pricing);
            let recounted = recount(&memory);
            assert_eq!(whole.held_gpus, recounted.held_gpus, "step {step}");
            let mut kept = whole.busy.clone();
            kept.retain(|_, held| !held.is_empty());
            assert_eq!(kept, recounted.busy, "step {step}");
            assert_eq!(whole.pooled_in_use, recounted.pooled_in_use, "step {step}");
            for team in teams {
                let want = spend_lease_by_lease(&memory, team, now, &pricing);
                let one = memory.ledger_of(team, now, &pricing);
                assert_eq!(one.held_gpus, whole.held_gpus);
                for (got, what) in [
                    (one.spend_usd.get(team), "alone"),
                    (whole.spend_usd.get(team), "in the whole ledger"),
                ] {
                    let same = match (got, want) {
                        (Some(&a), Some(b)) => (a - b).abs() <= 1e-9 * b.abs().max(1.0),
                        (a, b) => a.is_none() && b.is_none(),
                    };
                    assert!(
                        same,
                        "step {step}, {team} {what}: {got:?}, lease by lease {want:?}"
                    );
                }
            }
            if next(50) == 0 {
                // Back into this month, for the next steps.
                now = month + 4 * hour;
            }
        }
        assert!(memory.held.accruals.values().all(|a| !a.models.is_empty()));
    }

    fn write(ops: Vec<Op>) -> Job {
        Job::Write {
            ops,
            done: oneshot::channel().0,
        }
    }

    fn rows(batch: &[Job]) -> Vec<(&'static str, String, i64)> {
        batch
            .iter()
            .flat_map(|j| match j {
                Job::Write { ops, .. } => ops.iter().collect::<Vec<_>>(),
                Job::Read(_) => Vec::new(),
            })
            .filter_map(|op| match op {
                Op::InsertLease(l) => Some(("insert", l.id.clone(), l.updated_at)),
                Op::UpdateLease(l) => Some(("update", l.id.clone(), l.updated_at)),
                Op::Outbox { .. } => Some(("outbox", String::new(), 0)),
                _ => None,
            })
            .collect()
    }

    /// A database written by the version before migration 4 (leases with a rowid, an outbox
    /// with AUTOINCREMENT) opens with its leases and outbox as they were, and new outbox rows
    /// come after the old ones.
    #[test]
    fn migration_4_keeps_leases_and_the_outbox_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("enforcer.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE schema_version (version INTEGER NOT NULL);
                 INSERT INTO schema_version (version) VALUES (3);",
            )
            .unwrap();
            for sql in &MIGRATIONS[..3] {
                conn.execute_batch(sql).unwrap();
            }
            let mut ended = lease("lease-ended", LeaseState::Released, 5);
            ended.released_at = Some(5);
            ended.release_reason = Some(ReleaseReason::User);
            for op in [
                Op::InsertLease(lease("lease-open", LeaseState::Active, 3)),
                Op::InsertLease(ended),
            ] {
                apply(&conn, &op).unwrap();
            }
            for key in ["first", "second", "third"] {
                let op = Op::Outbox {
                    topic: "gpuwarden.actions",
                    key: key.into(),
                    payload: format!("{{\"key\":\"{key}\"}}"),
                    created_at: 1,
                };
                apply(&conn, &op).unwrap();
            }
            conn.execute("UPDATE outbox SET published_at = 2 WHERE key = 'first'", [])
                .unwrap();
        }

        let store = Store::open(&path).unwrap();
        assert_eq!(store.schema_version().wait().unwrap(), 4);
        let open = store.open_leases().unwrap();
        assert_eq!(open.len(), 1);
        assert_eq!(open[0], *lease("lease-open", LeaseState::Active, 3));
        let ended = store.lease("lease-ended").wait().unwrap().unwrap();
        assert_eq!(ended.state, LeaseState::Released);
        assert_eq!(ended.released_at, Some(5));
        let pending = store.outbox_pending(10).wait().unwrap();
        let keys: Vec<&str> = pending.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, ["second", "third"]);
        assert_eq!(pending[0].id, 2);
        store.block_team("ml", "budget_exceeded", 9).wait().unwrap();
        let pending = store.outbox_pending(10).wait().unwrap();
        assert_eq!(pending.len(), 3);
        assert!(pending[2].id > pending[1].id, "{pending:?}");
        let without_rowid: String = store
            .read(|conn| {
                Ok(conn.query_row(
                    "SELECT sql FROM sqlite_master WHERE name = 'leases'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .wait()
            .unwrap();
        assert!(without_rowid.contains("WITHOUT ROWID"), "{without_rowid}");
    }

    #[test]
    fn a_batch_writes_each_lease_once_with_its_last_values() {
        let outbox = || Op::Outbox {
            topic: "t",
            key: String::new(),
            payload: String::new(),
            created_at: 0,
        };
        let mut batch = vec![
            write(vec![
                Op::InsertLease(lease("a", LeaseState::Granted, 1)),
                outbox(),
            ]),
            write(vec![Op::UpdateLease(lease("b", LeaseState::Active, 2))]),
            Job::Read(Box::new(|_| {})),
            write(vec![Op::UpdateLease(lease("a", LeaseState::Active, 3))]),
            write(vec![
                Op::UpdateLease(lease("a", LeaseState::Released, 4)),
                outbox(),
            ]),
            write(vec![Op::UpdateLease(lease("b", LeaseState::Releasing, 5))]),
        ];
        coalesce(&mut batch);
        assert_eq!(
            rows(&batch),
            vec![
                ("insert", "a".into(), 4),
                ("outbox", String::new(), 0),
                ("update", "b".into(), 5),
                ("outbox", String::new(), 0),
            ]
        );
    }

    #[test]
    fn state_machine_refuses_going_back() {
        use LeaseState::*;
        assert!(Granted.can_become(Active));
        assert!(Active.can_become(Releasing));
        assert!(Releasing.can_become(Released));
        assert!(Active.can_become(Failed));
        assert!(!Active.can_become(Granted));
        assert!(!Released.can_become(Active));
        assert!(!Released.can_become(Released));
        assert!(!Failed.can_become(Releasing));
        assert!(!Releasing.can_become(Active));
    }
}
