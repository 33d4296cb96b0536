//! The store's records: a [`Lease`] and its [`LeaseState`], the [`Ledger`] the policy reads, the
//! [`LeaseFilter`] for listing leases, an [`OutboxRow`] waiting for Kafka, and [`StoreError`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_schema::{LeaseEvent, LeaseEventKind, ReleaseReason, Workload, V1};

use crate::policy::{HeldGpus, Holding};

/// A lease store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed (disk, lock timeout, corruption); the operation did not happen.
    #[error("the lease store failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// PostgreSQL cannot be reached, or ended the session or transaction (the change did not
    /// happen; trying again, on this replica or another, may help).
    #[error("the lease store's database is unavailable: {0}")]
    Unavailable(String),
    /// A change only the leader may make, asked of a replica that does not lead (or no longer
    /// does: its term is not the lease's); nothing was changed.
    #[error("this replica does not lead, so it may not {0}")]
    Fenced(String),
    /// PostgreSQL refused a statement (the change did not happen).
    #[error("the lease store failed: {0}")]
    Postgres(String),
    /// An admission's Idempotency-Key was used before, for a lease the retry cannot be answered
    /// with (it has ended, or was asked for another user, project, workload or GPU count); the
    /// message names the key and the lease.
    #[error("{0}")]
    KeyReused(String),
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
    #[error(
        "the lease store is at schema version {found}; this gpuwarden ({}) knows up to \
         {known}: upgrade gpuwarden",
        gpuwarden_schema::format::GPUWARDEN_VERSION
    )]
    TooNew {
        /// Version in the file.
        found: i64,
        /// Latest version this build knows.
        known: i64,
    },
}

/// Where a lease is in its life. `granted → active → releasing → released`, and `failed` from
/// any open state; `released` and `failed` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
#[derive(Debug, Clone, PartialEq)]
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
    pub release_reason: Option<ReleaseReason>,
    /// The `Idempotency-Key` the client admitted it with, if any: the same key (for the same
    /// team) asked again is answered with this lease instead of a second one (see
    /// [`crate::store::Admitted::Keyed`]).
    pub admission_key: Option<String>,
    /// Where the substrate holds it, as its driver writes it down (JSON: the Kubernetes
    /// driver's pod or Deployment), so that the driver of every replica finds it; None when the
    /// driver keeps nothing.
    pub substrate_ref: Option<String>,
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

    /// The LeaseEvent that says the lease was granted, resized or released.
    pub(super) fn event(&self, kind: LeaseEventKind, ts_ms: i64) -> LeaseEvent {
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

/// A filter for [`Store::leases`](super::Store::leases).
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A one-GPU training lease of team `ml`, granted at 0, for the store's unit tests.
    pub(crate) fn lease(id: &str, state: LeaseState, updated_at: i64) -> Box<Lease> {
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
            admission_key: None,
            substrate_ref: None,
        })
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
