//! The durable lease store: one SQLite database (WAL mode) holding leases, blocked teams, the
//! latest team spend, and an outbox of records for Kafka.
//!
//! Every lease change writes its `LeaseEvent` (and, for admissions, its `Action`) to the outbox in
//! the same transaction, so the topics can never miss or invent a change; the publisher reads
//! [`Store::outbox_pending`] and marks rows with [`Store::outbox_mark_published`]. Admission runs
//! the policy inside a `BEGIN IMMEDIATE` transaction ([`Store::admit`]): the quota and the GPUs in
//! use are read and the lease inserted while SQLite's write lock is held, so concurrent requests,
//! from this process or another on the same file, can never exceed a quota or place a GPU twice.
//! Calls block; async callers run them on a blocking thread.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpuwarden_schema::config::PricingConfig;
use gpuwarden_schema::{
    Action, ActionKind, LeaseEvent, LeaseEventKind, Outcome, Record, ReleaseReason, Workload, V1,
};
use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::policy::{AdmissionRequest, Decision, Holding, WorkloadName};

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
    #[schema(value_type = Option<String>)]
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
    /// UUIDs held by open leases, by substrate.
    pub busy: BTreeMap<String, BTreeSet<String>>,
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
];

const OPEN: &str = "state IN ('granted', 'active', 'releasing')";
const COLUMNS: &str = "id, team, user, project, workload, substrate, gpu_model, gpu_count, \
    gpu_uuids, labels, state, granted_at, expires_at, updated_at, released_at, release_reason";

/// The lease store. Cheap to clone; clones share one connection.
#[derive(Debug, Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
}

impl Store {
    /// Opens (creating if needed) the database at `path` and brings its schema up to date.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(30))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        migrate(&mut conn)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave a transaction open (rusqlite rolls back on
        // drop), so the connection is still sound.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Result<i64, StoreError> {
        Ok(self
            .lock()
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))?)
    }

    /// The ledger as of `now_ms`.
    pub fn ledger(&self, now_ms: i64, pricing: &PricingConfig) -> Result<Ledger, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let ledger = read_ledger(&tx, now_ms, pricing)?;
        tx.commit()?;
        Ok(ledger)
    }

    /// Admits a request atomically: reads the ledger, asks `decide` (the policy), and records the
    /// outcome, all inside one `BEGIN IMMEDIATE` transaction. An admitted decision becomes a
    /// `granted` lease with a `granted` LeaseEvent and an `admit` Action in the outbox; a denied
    /// one writes a `deny` Action. Nothing is written for a dry run.
    pub fn admit(
        &self,
        now_ms: i64,
        pricing: &PricingConfig,
        request: &AdmissionRequest,
        decide: impl FnOnce(&Ledger) -> Decision,
    ) -> Result<(Decision, Option<Lease>), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let ledger = read_ledger(&tx, now_ms, pricing)?;
        let decision = decide(&ledger);
        if request.dry_run {
            return Ok((decision, None));
        }
        let lease = match (&decision.placement, decision.admitted()) {
            (Some(p), true) => {
                let lease = Lease {
                    id: uuid::Uuid::new_v4().to_string(),
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
                    expires_at: decision
                        .duration
                        .map(|d| now_ms.saturating_add(d.as_millis() as i64)),
                    updated_at: now_ms,
                    released_at: None,
                    release_reason: None,
                };
                insert_lease(&tx, &lease)?;
                enqueue(&tx, &lease.event(LeaseEventKind::Granted, now_ms), now_ms)?;
                let detail = format!(
                    "{} GPUs of {} on {}, ${:.2}/h",
                    lease.gpu_count,
                    lease.gpu_model,
                    lease.substrate,
                    decision.estimate.usd_per_hour
                );
                enqueue(
                    &tx,
                    &action(
                        ActionKind::Admit,
                        &lease,
                        "admitted",
                        Outcome::Ok,
                        detail,
                        now_ms,
                    ),
                    now_ms,
                )?;
                Some(lease)
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
                enqueue(&tx, &deny, now_ms)?;
                None
            }
        };
        tx.commit()?;
        Ok((decision, lease))
    }

    /// One lease.
    pub fn lease(&self, id: &str) -> Result<Option<Lease>, StoreError> {
        let conn = self.lock();
        get_lease(&conn, id)
    }

    /// Leases matching `filter`, newest first.
    pub fn leases(&self, filter: &LeaseFilter) -> Result<Vec<Lease>, StoreError> {
        let conn = self.lock();
        let mut sql = format!("SELECT {COLUMNS} FROM leases WHERE 1 = 1");
        let mut args: Vec<String> = Vec::new();
        if let Some(state) = filter.state {
            sql.push_str(" AND state = ?");
            args.push(state.as_str().into());
        }
        if let Some(teams) = &filter.teams {
            sql.push_str(&format!(
                " AND team IN ({})",
                vec!["?"; teams.len()].join(", ")
            ));
            if teams.is_empty() {
                sql = sql.replace("team IN ()", "0 = 1");
            }
            args.extend(teams.iter().cloned());
        }
        sql.push_str(" ORDER BY granted_at DESC, id");
        let mut stmt = conn.prepare(&sql)?;
        let rows = stmt.query_map(rusqlite::params_from_iter(args.iter()), row_to_raw)?;
        rows.map(|r| r.map_err(StoreError::from).and_then(RawLease::parse))
            .collect()
    }

    /// Open leases whose end has come, for the runtime rules to reclaim.
    pub fn due_for_expiry(&self, now_ms: i64) -> Result<Vec<Lease>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM leases WHERE {OPEN} AND expires_at IS NOT NULL \
             AND expires_at <= ?1 ORDER BY expires_at, id"
        ))?;
        let rows = stmt.query_map([now_ms], row_to_raw)?;
        rows.map(|r| r.map_err(StoreError::from).and_then(RawLease::parse))
            .collect()
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
    ) -> Result<Lease, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut lease = get_lease(&tx, id)?.ok_or_else(|| StoreError::NotFound(id.into()))?;
        if !lease.state.can_become(to) {
            return Err(StoreError::InvalidTransition {
                id: id.into(),
                from: lease.state,
                to,
            });
        }
        lease.state = to;
        lease.updated_at = now_ms;
        if !to.is_open() {
            let reason = if to == LeaseState::Failed {
                ReleaseReason::Failed
            } else {
                reason
            };
            lease.released_at = Some(now_ms);
            lease.release_reason = Some(reason);
            enqueue(&tx, &lease.event(LeaseEventKind::Released, now_ms), now_ms)?;
            let outcome = if to == LeaseState::Failed {
                Outcome::Failed
            } else {
                Outcome::Ok
            };
            enqueue(
                &tx,
                &action(
                    ActionKind::Reclaim,
                    &lease,
                    reason.as_str(),
                    outcome,
                    detail.into(),
                    now_ms,
                ),
                now_ms,
            )?;
        }
        tx.execute(
            "UPDATE leases SET state = ?2, updated_at = ?3, released_at = ?4, release_reason = ?5 \
             WHERE id = ?1",
            params![
                id,
                to.as_str(),
                now_ms,
                lease.released_at,
                lease.release_reason.map(ReleaseReason::as_str)
            ],
        )?;
        tx.commit()?;
        Ok(lease)
    }

    /// Sets an open lease's end to `expires_at`.
    pub fn extend(&self, id: &str, expires_at: i64, now_ms: i64) -> Result<Lease, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut lease = get_lease(&tx, id)?.ok_or_else(|| StoreError::NotFound(id.into()))?;
        if !lease.state.is_open() {
            return Err(StoreError::InvalidTransition {
                id: id.into(),
                from: lease.state,
                to: lease.state,
            });
        }
        lease.expires_at = Some(expires_at);
        lease.updated_at = now_ms;
        tx.execute(
            "UPDATE leases SET expires_at = ?2, updated_at = ?3 WHERE id = ?1",
            params![id, expires_at, now_ms],
        )?;
        tx.commit()?;
        Ok(lease)
    }

    /// Resizes an open lease atomically: reads the ledger and the lease, asks `decide` (the
    /// policy), and on admission records the new GPUs with a `resized` LeaseEvent and a `resize`
    /// Action, inside one `BEGIN IMMEDIATE` transaction.
    pub fn resize(
        &self,
        id: &str,
        now_ms: i64,
        pricing: &PricingConfig,
        decide: impl FnOnce(&Ledger, &Lease) -> Decision,
    ) -> Result<(Decision, Lease), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut lease = get_lease(&tx, id)?.ok_or_else(|| StoreError::NotFound(id.into()))?;
        if !lease.state.is_open() || lease.state == LeaseState::Releasing {
            return Err(StoreError::InvalidTransition {
                id: id.into(),
                from: lease.state,
                to: lease.state,
            });
        }
        let ledger = read_ledger(&tx, now_ms, pricing)?;
        let decision = decide(&ledger, &lease);
        let Some(placement) = decision.placement.as_ref().filter(|_| decision.admitted()) else {
            return Ok((decision, lease));
        };
        let before = lease.gpu_count;
        lease.gpu_uuids = placement.gpu_uuids.clone();
        lease.gpu_count = placement.gpu_count;
        lease.updated_at = now_ms;
        tx.execute(
            "UPDATE leases SET gpu_count = ?2, gpu_uuids = ?3, updated_at = ?4 WHERE id = ?1",
            params![id, lease.gpu_count, json(&lease.gpu_uuids), now_ms],
        )?;
        enqueue(&tx, &lease.event(LeaseEventKind::Resized, now_ms), now_ms)?;
        let detail = format!("{before} → {} GPUs of {}", lease.gpu_count, lease.gpu_model);
        enqueue(
            &tx,
            &action(
                ActionKind::Resize,
                &lease,
                "requested",
                Outcome::Ok,
                detail,
                now_ms,
            ),
            now_ms,
        )?;
        tx.commit()?;
        Ok((decision, lease))
    }

    /// Stops a team's new admissions, with a `block` Action.
    pub fn block_team(&self, team: &str, reason: &str, now_ms: i64) -> Result<(), StoreError> {
        self.set_blocked(team, Some(reason), now_ms)
    }

    /// Lifts a team's block, with an `unblock` Action.
    pub fn unblock_team(&self, team: &str, now_ms: i64) -> Result<(), StoreError> {
        self.set_blocked(team, None, now_ms)
    }

    fn set_blocked(&self, team: &str, reason: Option<&str>, now_ms: i64) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let changed = match reason {
            Some(r) => tx.execute(
                "INSERT OR IGNORE INTO blocked_teams (team, reason, blocked_at) VALUES (?1, ?2, ?3)",
                params![team, r, now_ms],
            )?,
            None => tx.execute("DELETE FROM blocked_teams WHERE team = ?1", [team])?,
        };
        if changed > 0 {
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
            enqueue(&tx, &record, now_ms)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Records a `team_spend` signal; an older one than the one kept is ignored.
    pub fn record_team_spend(
        &self,
        team: &str,
        month_to_date_usd: f64,
        burn_usd_per_hour: f64,
        ts_ms: i64,
    ) -> Result<(), StoreError> {
        self.lock().execute(
            "INSERT INTO team_spend (team, month_to_date_usd, burn_usd_per_hour, ts_ms) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (team) DO UPDATE SET \
             month_to_date_usd = excluded.month_to_date_usd, \
             burn_usd_per_hour = excluded.burn_usd_per_hour, ts_ms = excluded.ts_ms \
             WHERE excluded.ts_ms >= team_spend.ts_ms",
            params![team, month_to_date_usd, burn_usd_per_hour, ts_ms],
        )?;
        Ok(())
    }

    /// Up to `limit` unpublished outbox rows, oldest first.
    pub fn outbox_pending(&self, limit: usize) -> Result<Vec<OutboxRow>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
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
    }

    /// Marks outbox rows as published (once Kafka has acknowledged them).
    pub fn outbox_mark_published(&self, ids: &[i64], now_ms: i64) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        {
            let mut stmt = tx.prepare(
                "UPDATE outbox SET published_at = ?2 WHERE id = ?1 AND published_at IS NULL",
            )?;
            for id in ids {
                stmt.execute(params![id, now_ms])?;
            }
        }
        tx.commit()?;
        Ok(())
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

fn insert_lease(tx: &Transaction<'_>, l: &Lease) -> Result<(), StoreError> {
    tx.execute(
        &format!(
            "INSERT INTO leases ({COLUMNS}) VALUES \
             (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)"
        ),
        params![
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
        ],
    )?;
    Ok(())
}

fn enqueue<R: Record>(tx: &Transaction<'_>, record: &R, now_ms: i64) -> Result<(), StoreError> {
    let payload = String::from_utf8(record.to_json()).expect("serde_json writes UTF-8");
    tx.execute(
        "INSERT INTO outbox (topic, key, payload, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![R::TOPIC, record.key(), payload, now_ms],
    )?;
    Ok(())
}

fn action(
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

fn read_ledger(
    conn: &Connection,
    now_ms: i64,
    pricing: &PricingConfig,
) -> Result<Ledger, StoreError> {
    let mut ledger = Ledger::default();
    let month_start = month_start_ms(now_ms);
    let mut spend_since: BTreeMap<String, i64> = BTreeMap::new();
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
            // A signal from an earlier month says nothing of this one.
            if ts >= month_start {
                ledger.spend_usd.insert(team.clone(), usd);
                spend_since.insert(team, ts);
            }
        }
    }
    let mut stmt = conn.prepare(&format!(
        "SELECT team, substrate, gpu_model, gpu_count, gpu_uuids, granted_at FROM leases WHERE {OPEN}"
    ))?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, u32>(3)?,
            r.get::<_, String>(4)?,
            r.get::<_, i64>(5)?,
        ))
    })?;
    for row in rows {
        let (team, substrate, model, count, uuids, granted_at) = row?;
        *ledger.held_gpus.entry(team.clone()).or_default() += count;
        let uuids: Vec<String> = serde_json::from_str(&uuids)
            .map_err(|_| StoreError::Corrupt(format!("a lease of team {team}: gpu_uuids")))?;
        if uuids.is_empty() {
            *ledger
                .pooled_in_use
                .entry(substrate)
                .or_default()
                .entry(model.clone())
                .or_default() += count;
        } else {
            ledger.busy.entry(substrate).or_default().extend(uuids);
        }
        let since = spend_since
            .get(&team)
            .copied()
            .unwrap_or(month_start)
            .max(granted_at);
        let hours = (now_ms - since).max(0) as f64 / 3_600_000.0;
        *ledger.spend_usd.entry(team).or_default() +=
            hours * f64::from(count) * pricing.usd_per_gpu_hour(&model);
    }
    ledger.blocked = {
        let mut stmt = conn.prepare("SELECT team FROM blocked_teams")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        rows.collect::<Result<_, _>>()?
    };
    Ok(ledger)
}

/// Start of the UTC calendar month holding `ms`.
fn month_start_ms(ms: i64) -> i64 {
    gpuwarden_schema::calendar::month_of(ms).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn month_start_is_the_first_of_the_utc_month() {
        // 2024-03-15T12:00:00Z → 2024-03-01T00:00:00Z.
        assert_eq!(month_start_ms(1_710_504_000_000), 1_709_251_200_000);
        // 2024-02-29T23:59:59Z → 2024-02-01.
        assert_eq!(month_start_ms(1_709_251_199_000), 1_706_745_600_000);
        assert_eq!(month_start_ms(0), 0);
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
