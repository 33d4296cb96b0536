//! The writer: the one thread that owns the database connection, and the [`Queue`] that feeds
//! it. Every change's rows ([`Op`]s) are queued in the order memory saw the change; the writer
//! commits everything queued since its last commit in one transaction (group commit: one fsync
//! for many changes) and only then answers each caller through its [`Pending`]. Queries that need
//! the file run on the same connection, after the writes queued before them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use gpuwarden_schema::{Record, ReleaseReason};
use rusqlite::{params, Connection, TransactionBehavior};
use tokio::sync::oneshot;

use super::db::{Db, Sqlite};
use super::leader::Fence;
use super::memory::Memory;
use super::rows::{json, INSERT_LEASE};
use super::types::{Lease, StoreError};

/// Most jobs the writer commits in one transaction.
const MAX_BATCH: usize = 512;
/// Longest a change nobody waits for (see [`Pending::applied`]) stays uncommitted when no
/// waited-for change comes along to carry it.
const LAZY_COMMIT: Duration = Duration::from_millis(20);

/// WAL frames (pages) past which the writer checkpoints itself, after a commit (SQLite's
/// `wal_autocheckpoint`). The checkpointer thread normally keeps the WAL far below it; see
/// [`checkpoint_loop`].
pub(super) const WAL_LIMIT: u32 = 10_000;
/// How often the checkpointer looks for new commits to copy into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(50);

/// One write the writer thread carries out.
pub(super) enum Op {
    /// Inserts a new lease's row.
    InsertLease(Box<Lease>),
    /// Stores the lease's state, GPUs, end, and release.
    UpdateLease(Box<Lease>),
    /// Deletes a hold's row (bound to its lease, or forgotten).
    DeleteLease(String),
    /// Queues a record for Kafka (see [`outbox`]).
    Outbox {
        topic: &'static str,
        key: String,
        payload: String,
        created_at: i64,
    },
    /// Blocks a team.
    Block {
        team: String,
        reason: String,
        at: i64,
    },
    /// Lifts a team's block.
    Unblock { team: String },
    /// Keeps a team's spend signal unless a newer one is kept.
    Spend {
        team: String,
        month_to_date_usd: f64,
        burn_usd_per_hour: f64,
        ts_ms: i64,
    },
    /// Marks outbox rows published.
    MarkPublished { ids: Vec<i64>, at: i64 },
    /// Exempts a lease from the runtime rules.
    Exempt {
        lease_id: String,
        until_ms: i64,
        by: String,
        reason: String,
        at: i64,
    },
    /// Marks a rule's step taken.
    Mark { key: String, at: i64 },
    /// Keeps the time of the newest utilization signal handled for a lease.
    Signal { lease_id: String, ts_ms: i64 },
    /// Forgets an ended lease's utilization signal time.
    ForgetSignal(String),
    /// Deletes published outbox rows.
    DeletePublished(Vec<i64>),
    /// A lease row a later one in the same batch replaced.
    Nothing,
}

impl Op {
    /// What of memory this write changes, as the key another replica refetches it by (see
    /// `postgres::catch_up`): `l:<lease>`, `b:<team>` (blocked), `s:<team>` (spend),
    /// `e:<lease>` (exemption), `m:<mark>`, `g:<lease>` (signal time). None for the outbox.
    pub(super) fn changed(&self) -> Option<String> {
        Some(match self {
            Op::InsertLease(l) | Op::UpdateLease(l) => format!("l:{}", l.id),
            Op::DeleteLease(id) => format!("l:{id}"),
            Op::Block { team, .. } | Op::Unblock { team } => format!("b:{team}"),
            Op::Spend { team, .. } => format!("s:{team}"),
            Op::Exempt { lease_id, .. } => format!("e:{lease_id}"),
            Op::Mark { key, .. } => format!("m:{key}"),
            Op::Signal { lease_id, .. } | Op::ForgetSignal(lease_id) => format!("g:{lease_id}"),
            Op::Outbox { .. } | Op::MarkPublished { .. } | Op::DeletePublished(_) | Op::Nothing => {
                return None
            }
        })
    }
}

/// A query for the writer's database, which answers its caller itself.
pub(super) trait Query: Send {
    /// Runs the query and answers.
    fn run(self: Box<Self>, db: &mut dyn Db);
    /// Runs the query in a transaction not yet committed, and answers once it is, with the
    /// commit's failure if it failed (PostgreSQL, where a query may write what every replica
    /// shares: a portal session is not reported open before it is durable).
    fn run_until_committed(self: Box<Self>, db: &mut dyn Db) -> Done;
    /// Answers that the query could not run.
    fn fail(self: Box<Self>, error: StoreError);
}

/// Tells a change's caller how its commit went.
pub(super) type Done = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// A change decided on the writer's thread, inside its transaction (the PostgreSQL store, where
/// memory is brought up to date with the other replicas' commits first; see `postgres.rs`).
pub(super) trait Deferred: Send {
    /// Decides and applies the change to `memory`; the rows that make the database follow, and
    /// who to tell once they are committed, when it changed something (it answered already
    /// when it did not).
    fn run(self: Box<Self>, memory: &mut Memory, db: &mut dyn Db) -> Option<(Vec<Op>, Done)>;
    /// Answers that the change could not be made.
    fn fail(self: Box<Self>, error: StoreError);
}

/// What the writer is asked to do.
pub(super) enum Job {
    /// Ops committed together; `done` hears once they are durable (or why not). SQLite: the
    /// change was decided and applied to memory by its caller.
    Write {
        ops: Vec<Op>,
        done: oneshot::Sender<Result<(), String>>,
    },
    /// A change to decide in the writer's transaction (PostgreSQL); made only while the fence,
    /// when it has one, is the leader's (see `leader.rs`).
    Mutate(Box<dyn Deferred>, Option<Fence>),
    /// A query, run after every write queued before it (on PostgreSQL only while its fence, when
    /// it has one, is the leader's).
    Read(Box<dyn Query>, Option<Fence>),
    /// Another replica committed: bring memory up to date (PostgreSQL).
    CatchUp,
}

/// A [`Query`] from a closure and the channel of its answer.
struct Asked<T, F> {
    query: F,
    answer: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> Query for Asked<T, F>
where
    T: Send + 'static,
    F: FnOnce(&mut dyn Db) -> Result<T, StoreError> + Send,
{
    fn run(self: Box<Self>, db: &mut dyn Db) {
        let _ = self.answer.send((self.query)(db));
    }

    fn run_until_committed(self: Box<Self>, db: &mut dyn Db) -> Done {
        let result = (self.query)(db);
        let answer = self.answer;
        Box::new(move |committed| {
            let _ = answer.send(committed.and(result));
        })
    }

    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.answer.send(Err(error));
    }
}

/// The writer's queue. Jobs are queued in the order memory saw their changes. The writer is woken
/// when someone waits: a query (always awaited), or a caller awaiting a write's commit (see
/// [`Pending`]). Changes nobody waits for ride along with the next commit, or are committed
/// after [`LAZY_COMMIT`], so they never cost a commit of their own.
pub(super) struct Queue {
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
    pub(super) fn new() -> Self {
        Self {
            state: Mutex::new(QueueState::default()),
            wake: Condvar::new(),
            wanted: AtomicBool::new(false),
            commits: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        }
    }

    pub(super) fn push(&self, job: Job, wanted: bool) -> Result<(), StoreError> {
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

    /// Closes the queue: the writer commits what is queued, then stops.
    pub(super) fn close(&self) {
        lock(&self.state).closed = true;
        self.wake.notify_one();
    }

    /// Queues the rows of a change that memory has just applied; `value` is handed back once
    /// they are committed. Called only by `Store::mutate`, with the memory lock held, so that
    /// changes reach the writer in the order memory saw them. The writer is not woken until
    /// someone waits.
    pub(super) fn write<T>(self: &Arc<Self>, value: T, ops: Vec<Op>) -> Pending<T> {
        let (done, heard) = oneshot::channel();
        match self.push(Job::Write { ops, done }, false) {
            Ok(()) => Pending {
                state: PendingState::Write(value, heard, self.clone()),
            },
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Runs `query` on the writer's database after every write queued so far.
    pub(super) fn read<T: Send + 'static>(
        &self,
        fence: Option<Fence>,
        query: impl FnOnce(&mut dyn Db) -> Result<T, StoreError> + Send + 'static,
    ) -> Pending<T> {
        let (answer, heard) = oneshot::channel();
        let job = Job::Read(Box::new(Asked { query, answer }), fence);
        match self.push(job, true) {
            Ok(()) => Pending {
                state: PendingState::Read(heard),
            },
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Queues a change decided on the writer's thread: its caller hears the value through
    /// `value` (as soon as memory has it) and the commit through `committed`.
    pub(super) fn decided<T>(
        &self,
        job: Job,
        value: oneshot::Receiver<Result<T, StoreError>>,
        committed: oneshot::Receiver<Result<(), StoreError>>,
    ) -> Pending<T> {
        match self.push(job, true) {
            Ok(()) => Pending {
                state: PendingState::Decided(value, committed),
            },
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Counts a commit of `writes` changes.
    pub(super) fn count_commit(&self, writes: u64) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.writes.fetch_add(writes, Ordering::Relaxed);
    }

    /// How many transactions the writer has committed, and how many changes they carried.
    pub(super) fn stats(&self) -> CommitStats {
        CommitStats {
            commits: self.commits.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
        }
    }

    /// The next batch, once someone waits for it, or it has waited [`LAZY_COMMIT`], or the
    /// store is closing; `None` when the store has closed and everything is committed.
    pub(super) fn next_batch(&self) -> Option<Vec<Job>> {
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
    /// A change decided on the writer's thread (PostgreSQL): its value, as soon as memory has
    /// it, then whether it was committed.
    Decided(
        oneshot::Receiver<Result<T, StoreError>>,
        oneshot::Receiver<Result<(), StoreError>>,
    ),
}

impl<T> Pending<T> {
    /// An answer known at once: nothing was queued.
    pub(super) fn ready(result: Result<T, StoreError>) -> Self {
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
            PendingState::Decided(value, committed) => {
                let value = value.blocking_recv().unwrap_or_else(|_| Err(closed()))?;
                committed
                    .blocking_recv()
                    .unwrap_or_else(|_| Err(closed()))
                    .map(|()| value)
            }
        }
    }
}

impl<T: Send + 'static> Pending<T> {
    /// The value as soon as the change is applied in memory, without waiting for the commit
    /// (which still happens, in order, with the changes queued after it). For a step whose loss
    /// in a crash a restart repairs, e.g. `granted → active`, which re-adoption redoes. A query
    /// still waits for its answer. On PostgreSQL the value comes once the writer has decided
    /// the change in its transaction; should that transaction fail, memory is reloaded from the
    /// database and the change is gone, as after a crash.
    pub async fn applied(self) -> Result<T, StoreError> {
        match self.state {
            PendingState::Write(value, _, _) => Ok(value),
            PendingState::Decided(value, _) => value.await.unwrap_or_else(|_| Err(closed())),
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
                PendingState::Decided(value, committed) => {
                    let value = value.await.unwrap_or_else(|_| Err(closed()))?;
                    committed
                        .await
                        .unwrap_or_else(|_| Err(closed()))
                        .map(|()| value)
                }
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

/// Locks `mutex`, past a panic of an earlier holder.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Memory is changed only after every check has passed, so a panic cannot leave it half
    // changed; the queue's state changes by whole jobs.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The writer thread: takes every job queued, runs them in one transaction, commits, and tells
/// each write's caller. A failed commit breaks the store for good (memory is then ahead of the
/// file); every job after that is refused.
pub(super) fn write_loop(mut conn: Connection, queue: &Queue, broken: &OnceLock<String>) {
    while let Some(batch) = queue.next_batch() {
        let writes = batch
            .iter()
            .filter(|j| matches!(j, Job::Write { .. }))
            .count() as u64;
        // Only the PostgreSQL store's writer takes these.
        let batch: Vec<Job> = batch
            .into_iter()
            .filter_map(|job| match job {
                Job::Mutate(change, _) => {
                    change.fail(StoreError::Io("a change went to the SQLite writer".into()));
                    None
                }
                Job::CatchUp => None,
                job => Some(job),
            })
            .collect();
        let mut waiting = Vec::with_capacity(batch.len());
        let result = match broken.get() {
            Some(why) => Err(why.clone()),
            None => run_batch(&mut conn, batch, &mut waiting).map_err(|e| e.to_string()),
        };
        match &result {
            Ok(()) if writes > 0 => queue.count_commit(writes),
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

/// The checkpointer thread: every [`CHECKPOINT_EVERY`] that saw a commit, copies the committed
/// WAL frames into the database file and syncs it (a passive checkpoint, which never blocks the
/// writer, nor waits for it), until `stop`'s sender is dropped. Before, SQLite ran each
/// checkpoint inside the commit that crossed its threshold, and that commit's callers (and all
/// queued behind them) waited for it: a few milliseconds every thousand pages.
///
/// The WAL restarts from its beginning only once a checkpoint has copied all of it, i.e. when
/// no commit landed during one; under load that may not happen, and then the writer's own
/// checkpoint at [`WAL_LIMIT`] frames copies what is left (little, this thread having copied
/// the rest) and lets the WAL restart.
pub(super) fn checkpoint_loop(conn: &Connection, queue: &Queue, stop: &mpsc::Receiver<()>) {
    let mut seen = queue.stats().commits;
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(CHECKPOINT_EVERY) {
        let commits = queue.stats().commits;
        if commits == seen {
            continue;
        }
        seen = commits;
        // A failure leaves frames in the WAL for the next pass (or the writer's own checkpoint);
        // what was committed is on disk either way.
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::debug!(error = %e, "the lease store's checkpoint failed; retried later");
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
            Job::Read(query, _) => query.run(&mut Sqlite(&tx)),
            Job::Mutate(..) | Job::CatchUp => {}
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
        _ => unreachable!("only writes were indexed"),
    }
}

fn take(batch: &mut [Job], job: usize, op: usize) -> Op {
    std::mem::replace(op_at(batch, job, op), Op::Nothing)
}

/// Carries `op` out on the connection (in the writer's transaction).
pub(super) fn apply(tx: &Connection, op: &Op) -> Result<(), StoreError> {
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
                l.admission_key,
                l.substrate_ref,
            ])?;
        }
        Op::UpdateLease(l) => {
            tx.prepare_cached(
                "UPDATE leases SET gpu_count = ?2, gpu_uuids = ?3, state = ?4, expires_at = ?5, \
                 updated_at = ?6, released_at = ?7, release_reason = ?8, substrate_ref = ?9 \
                 WHERE id = ?1",
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
                l.substrate_ref,
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
        Op::Signal { lease_id, ts_ms } => {
            // The memory decided that it is the newest to keep (writes go in its order), even
            // when lower than the one kept: that one was past the clock's ceiling.
            tx.prepare_cached(
                "INSERT INTO lease_signals (lease_id, ts_ms) VALUES (?1, ?2) \
                 ON CONFLICT (lease_id) DO UPDATE SET ts_ms = excluded.ts_ms",
            )?
            .execute(params![lease_id, ts_ms])?;
        }
        Op::ForgetSignal(lease_id) => {
            tx.prepare_cached("DELETE FROM lease_signals WHERE lease_id = ?1")?
                .execute([lease_id])?;
        }
        Op::DeletePublished(ids) => {
            // Never a row Kafka has not acknowledged, whoever asked.
            let mut stmt =
                tx.prepare_cached("DELETE FROM outbox WHERE id = ?1 AND published_at IS NOT NULL")?;
            for id in ids {
                stmt.execute([id])?;
            }
        }
        Op::DeleteLease(id) => {
            tx.prepare_cached("DELETE FROM leases WHERE id = ?1")?
                .execute(params![id])?;
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

/// Queues `record` for its Kafka topic.
pub(super) fn outbox<R: Record>(record: &R, now_ms: i64) -> Op {
    Op::Outbox {
        topic: R::TOPIC,
        key: record.key().to_owned(),
        payload: String::from_utf8(record.to_json()).expect("serde_json writes UTF-8"),
        created_at: now_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::types::tests::lease;
    use crate::store::LeaseState;

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
                _ => Vec::new(),
            })
            .filter_map(|op| match op {
                Op::InsertLease(l) => Some(("insert", l.id.clone(), l.updated_at)),
                Op::UpdateLease(l) => Some(("update", l.id.clone(), l.updated_at)),
                Op::Outbox { .. } => Some(("outbox", String::new(), 0)),
                _ => None,
            })
            .collect()
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
            Job::CatchUp,
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
}
