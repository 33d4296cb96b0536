//! What the doors read and keep through the service besides the lease lifecycle: the audit
//! trail, each lease's recorded history, and the portal's sessions and sent forms where replicas
//! share the store.
//!
//! These change no lease and decide nothing; they are here so that a door asks the service and
//! never holds the store. Each answers the store's failure as [`ServiceError`], as every other
//! service call does.

use std::collections::HashSet;

use gpuwarden_schema::{Action, LeaseEvent};

use super::{Service, ServiceError};
use crate::store::PortalSession;

impl Service {
    /// Whether the store is shared by replicas (PostgreSQL), so that what one replica keeps for
    /// a door (the portal's sessions, the forms sent) must be kept there for every replica.
    pub fn store_is_shared(&self) -> bool {
        self.store.is_shared()
    }

    /// The newest `limit` Actions recorded (the audit trail), newest first; only those about
    /// `team` when given.
    pub async fn recent_actions(
        &self,
        limit: usize,
        team: Option<&str>,
    ) -> Result<Vec<Action>, ServiceError> {
        Ok(self.store.recent_actions(limit, team).await?)
    }

    /// The Actions about any of `lease_ids` recorded at or after `since_ms`, newest first (see
    /// [`crate::store::Store::lease_actions`] for why `since_ms` bounds the scan).
    pub async fn lease_actions(
        &self,
        lease_ids: HashSet<String>,
        since_ms: i64,
    ) -> Result<Vec<Action>, ServiceError> {
        Ok(self.store.lease_actions(lease_ids, since_ms).await?)
    }

    /// The LeaseEvents of any of `lease_ids` recorded at or after `since_ms`, newest first: a
    /// lease's grant and resizes, the GPUs it held over time.
    pub async fn lease_events(
        &self,
        lease_ids: HashSet<String>,
        since_ms: i64,
    ) -> Result<Vec<LeaseEvent>, ServiceError> {
        Ok(self.store.lease_events(lease_ids, since_ms).await?)
    }

    /// Opens a portal session on a shared store: `id_sha256` is the SHA-256 of the session id
    /// (the id itself is never kept), `session` the principal's name, the CSRF token and when it
    /// opened. Sessions older than `lifetime_ms` end first, then the principal's oldest beyond
    /// `per_principal - 1`, then the oldest of all beyond `kept - 1`.
    pub async fn portal_session_open(
        &self,
        id_sha256: &str,
        session: PortalSession,
        lifetime_ms: i64,
        per_principal: usize,
        kept: usize,
    ) -> Result<(), ServiceError> {
        Ok(self
            .store
            .portal_session_open(id_sha256, session, lifetime_ms, per_principal, kept)
            .await?)
    }

    /// The portal session whose id hashes to `id_sha256`, if it opened after `since_ms`.
    pub async fn portal_session(
        &self,
        id_sha256: &str,
        since_ms: i64,
    ) -> Result<Option<PortalSession>, ServiceError> {
        Ok(self.store.portal_session(id_sha256, since_ms).await?)
    }

    /// Ends the portal session whose id hashes to `id_sha256`.
    pub async fn portal_session_close(&self, id_sha256: &str) -> Result<(), ServiceError> {
        Ok(self.store.portal_session_close(id_sha256).await?)
    }

    /// Marks a portal request form's one-use `token` sent at `at_ms`: `Ok` the first time, else
    /// the lease it made (if any). Tokens sent more than `kept_ms` before are forgotten.
    pub async fn portal_submission_first(
        &self,
        token: &str,
        at_ms: i64,
        kept_ms: i64,
    ) -> Result<Result<(), Option<String>>, ServiceError> {
        Ok(self
            .store
            .portal_submission_first(token, at_ms, kept_ms)
            .await?)
    }

    /// Records the lease the portal request form sent with `token` made.
    pub async fn portal_submission_made(
        &self,
        token: &str,
        lease_id: &str,
    ) -> Result<(), ServiceError> {
        Ok(self.store.portal_submission_made(token, lease_id).await?)
    }
}
