//! What the runtime rules, the substrates' watchers and the doors read and record through the
//! service besides the lease lifecycle: leases as the store has them (from this replica's
//! memory, or as every replica has committed them), the ledger, exemptions, steps recorded
//! once, team spend, the newest utilization signal of a lease, failed logins shared by replicas,
//! and this replica's leadership.
//!
//! These decide nothing; they are here so that nothing above the service holds the store. On a
//! [`Service::leading`] view every write is fenced by the leadership, as the lifecycle's are.

use std::sync::Arc;

use gpuwarden_schema::Action;

use super::{Service, ServiceError};
use crate::drivers::LeaseRefs;
use crate::store::leader::Leadership;
use crate::store::{Lease, Ledger, LoginFailure, Store};

/// What the service hands each driver it builds ([`crate::drivers::DriverContext`]): the one
/// write a driver makes to lease store `store`, where the substrate holds an open lease (the
/// Kubernetes driver's pods), and the read that goes with it. Drivers never hold the store.
pub fn lease_refs(store: Store) -> Arc<dyn LeaseRefs> {
    Arc::new(StoreLeaseRefs(store))
}

/// [`lease_refs`]' answer.
#[derive(Debug)]
struct StoreLeaseRefs(Store);

#[async_trait::async_trait]
impl LeaseRefs for StoreLeaseRefs {
    async fn set(&self, lease_id: &str, substrate_ref: Option<String>) -> Result<bool, String> {
        self.0
            .set_substrate_ref(lease_id, substrate_ref)
            .await
            .map_err(|e| e.to_string())
    }

    fn open_lease(&self, lease_id: &str) -> Option<Lease> {
        self.0.open_lease(lease_id).ok().flatten()
    }
}

impl Service {
    /// Lease `id` if it is open, from this replica's memory: never waits for the store's writer
    /// (the Slurm hook asks under slurmctld's locks, the webhook for every pod).
    pub fn open_lease(&self, id: &str) -> Result<Option<Lease>, ServiceError> {
        Ok(self.store.open_lease(id)?)
    }

    /// Every open lease, oldest grant first, from this replica's memory.
    pub fn open_leases(&self) -> Result<Vec<Lease>, ServiceError> {
        Ok(self.store.open_leases()?)
    }

    /// Lease `id` if it is open, as every replica has committed it (on a shared store, read
    /// from the database: for a caller that must not miss what another replica has just
    /// written; on SQLite, from memory).
    pub async fn current_lease(&self, id: &str) -> Result<Option<Lease>, ServiceError> {
        Ok(self.store.current_lease(id).await?)
    }

    /// Lease `id` as the store has it, open or ended, whoever asks: for the enforcer's own
    /// callers (the rules, the watchers, a door checking a lease it made), never for a
    /// principal's read (that is [`Service::lease`]).
    pub async fn stored_lease(&self, id: &str) -> Result<Option<Lease>, ServiceError> {
        Ok(self.store.lease(id).await?)
    }

    /// Each team's GPUs held, spend and block at `now_ms`, at the config's prices.
    pub fn ledger(&self, now_ms: i64) -> Result<Ledger, ServiceError> {
        Ok(self.store.ledger(now_ms, &self.inner.config.pricing)?)
    }

    /// When lease `id`'s exemption from the runtime rules ends, if it has one.
    pub fn exempt_until(&self, id: &str) -> Option<i64> {
        self.store.exempt_until(id)
    }

    /// Records `action` unless a step under `key` was recorded before (in this run or an earlier
    /// one), the mark and the Action in one commit; whether it was recorded now. The rules'
    /// alerts and dry-run steps, and the watchers' reports, are recorded once this way.
    pub async fn record_once(&self, key: &str, action: &Action) -> Result<bool, ServiceError> {
        Ok(self.store.record_once(key, action).await?)
    }

    /// Records a `team_spend` signal of `ts_ms` for admission's budget check (see
    /// [`crate::store::Store::record_team_spend`]: a figure below what the enforcer had already
    /// counted does not lower the spend).
    pub async fn record_team_spend(
        &self,
        team: &str,
        month_to_date_usd: f64,
        burn_usd_per_hour: f64,
        ts_ms: i64,
    ) -> Result<(), ServiceError> {
        Ok(self
            .store
            .record_team_spend(
                team,
                month_to_date_usd,
                burn_usd_per_hour,
                ts_ms,
                &self.inner.config.pricing,
            )
            .await?)
    }

    /// Takes a `lease_utilization` signal of `ts_ms` as lease `id`'s newest, unless the lease is
    /// not open or one as new was handled before; whether to act on it (see
    /// [`crate::store::Store::note_utilization_signal`], and `ceiling_ms` there). Answered once
    /// memory has it: the time commits no later than anything acting on the signal writes.
    pub async fn note_utilization_signal(
        &self,
        id: &str,
        ts_ms: i64,
        ceiling_ms: i64,
    ) -> Result<bool, ServiceError> {
        Ok(self
            .store
            .note_utilization_signal(id, ts_ms, ceiling_ms)
            .applied()
            .await?)
    }

    /// On a store shared by replicas, tells the others of a failed login this replica saw (its
    /// source address, the token's SHA-256 in hex) at `at_ms`, so that they count it too. Not
    /// waited for: a login is refused at once, and a lost record only lets one more try
    /// elsewhere.
    pub fn share_failed_login(
        &self,
        source: Option<String>,
        principal_sha256: Option<String>,
        at_ms: i64,
    ) {
        if self.store.is_shared() {
            drop(self.store.login_failed(source, principal_sha256, at_ms));
        }
    }

    /// The failed logins the other replicas of a shared store saw after id `after` and since
    /// `since_ms`.
    pub async fn login_failures(
        &self,
        after: i64,
        since_ms: i64,
    ) -> Result<Vec<LoginFailure>, ServiceError> {
        Ok(self.store.login_failures(after, since_ms).await?)
    }

    /// Whether a store shared by replicas answers (an SQLite store always does): a replica that
    /// cannot reach it cannot admit, so it reports itself not ready.
    pub async fn store_answers(&self) -> Result<(), ServiceError> {
        if self.store.is_shared() {
            self.store.schema_version().await?;
        }
        Ok(())
    }

    /// This replica's part in the leader election: whether it leads, and who does.
    pub fn leadership(&self) -> &Arc<Leadership> {
        self.store.leadership()
    }
}
