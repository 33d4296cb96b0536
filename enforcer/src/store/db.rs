//! The queries the store runs on its database, whichever it is: [`Db`], implemented for SQLite
//! here and for PostgreSQL in `postgres.rs`. Memory answers what admission reads; these answer
//! the rest (closed leases, the outbox, the audit trail).

use std::collections::HashSet;

use rusqlite::{Connection, OptionalExtension};

use super::rows::{row_to_raw, ParseRaw, RawLease, COLUMNS, OPEN};
use super::types::{Lease, LeaseFilter, OutboxRow, StoreError};

/// The store's queries. Each runs after every write queued before it.
pub(super) trait Db {
    /// The database's schema version.
    fn schema_version(&mut self) -> Result<i64, StoreError>;
    /// One lease, open or not.
    fn lease(&mut self, id: &str) -> Result<Option<Lease>, StoreError>;
    /// Leases matching `filter`, newest grant first.
    fn leases(&mut self, filter: &LeaseFilter) -> Result<Vec<Lease>, StoreError>;
    /// Up to `limit` unpublished outbox rows, oldest first.
    fn outbox_pending(&mut self, limit: usize) -> Result<Vec<OutboxRow>, StoreError>;
    /// How many outbox rows wait to be published.
    fn outbox_pending_count(&mut self) -> Result<usize, StoreError>;
    /// The payloads of the newest `limit` outbox rows of `topic`, newest first.
    fn newest_payloads(&mut self, topic: &str, limit: usize) -> Result<Vec<String>, StoreError>;
    /// The payloads of the outbox rows of `topic` keyed by one of `keys` and created at or
    /// after `since_ms`, newest first; the scan stops at the first older row.
    fn keyed_payloads_since(
        &mut self,
        topic: &str,
        keys: &HashSet<String>,
        since_ms: i64,
    ) -> Result<Vec<String>, StoreError>;
    /// Up to `batch` ids of outbox rows above `after` that may be deleted: published before
    /// `published_before_ms`, not the newest row, not about a lease still open.
    fn prunable(
        &mut self,
        published_before_ms: i64,
        batch: usize,
        after: i64,
    ) -> Result<Vec<i64>, StoreError>;

    // What only a store shared by replicas keeps (PostgreSQL's `postgres::shared`): one
    // enforcer on SQLite keeps these in its own memory.

    /// Opens a portal session (see `postgres::shared::open`).
    fn session_open(
        &mut self,
        _id: &str,
        _session: &Session,
        _limits: (i64, i64, i64),
    ) -> Result<(), StoreError> {
        Err(not_shared())
    }
    /// A portal session opened after `since_ms`.
    fn session(&mut self, _id: &str, _since_ms: i64) -> Result<Option<Session>, StoreError> {
        Err(not_shared())
    }
    /// Ends a portal session.
    fn session_close(&mut self, _id: &str) -> Result<(), StoreError> {
        Err(not_shared())
    }
    /// Marks a request form's one-use token sent: `Ok` the first time, else the lease it made.
    fn submission_first(
        &mut self,
        _token: &str,
        _at_ms: i64,
        _kept_ms: i64,
    ) -> Result<Result<(), Option<String>>, StoreError> {
        Err(not_shared())
    }
    /// Records the lease a form made.
    fn submission_made(&mut self, _token: &str, _lease_id: &str) -> Result<(), StoreError> {
        Err(not_shared())
    }
    /// Records a failed login this replica saw.
    fn login_failed(
        &mut self,
        _replica: &str,
        _source: Option<&str>,
        _principal: Option<&str>,
        _at_ms: i64,
    ) -> Result<(), StoreError> {
        Err(not_shared())
    }
    /// The failed logins the other replicas saw after id `after` and since `since_ms`.
    fn login_failures(
        &mut self,
        _replica: &str,
        _after: i64,
        _since_ms: i64,
    ) -> Result<Vec<LoginFailure>, StoreError> {
        Err(not_shared())
    }
}

/// A portal session as a shared store keeps it: the principal's name, the CSRF token, and when
/// it was opened (ms).
pub type Session = (String, String, i64);

/// A failed login another replica saw: its id in the table, the source address, the SHA-256 of
/// the token presented (hex).
pub type LoginFailure = (i64, Option<String>, Option<String>);

fn not_shared() -> StoreError {
    StoreError::Io("only a lease store shared by replicas (PostgreSQL) keeps this".into())
}

/// SQLite's [`Db`]: the writer's connection (or its transaction).
pub(super) struct Sqlite<'c>(pub(super) &'c Connection);

impl Db for Sqlite<'_> {
    fn schema_version(&mut self) -> Result<i64, StoreError> {
        Ok(self
            .0
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))?)
    }

    fn lease(&mut self, id: &str) -> Result<Option<Lease>, StoreError> {
        self.0
            .query_row(
                &format!("SELECT {COLUMNS} FROM leases WHERE id = ?1"),
                [id],
                row_to_raw,
            )
            .optional()?
            .map(ParseRaw::parse)
            .transpose()
    }

    fn leases(&mut self, filter: &LeaseFilter) -> Result<Vec<Lease>, StoreError> {
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
        let mut stmt = self.0.prepare(&sql)?;
        let rows = stmt.query_map(rusqlite::params_from_iter(args.iter()), row_to_raw)?;
        rows.map(|r| r.map_err(StoreError::from).and_then(RawLease::parse))
            .collect()
    }

    fn outbox_pending(&mut self, limit: usize) -> Result<Vec<OutboxRow>, StoreError> {
        let mut stmt = self.0.prepare_cached(
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

    fn outbox_pending_count(&mut self) -> Result<usize, StoreError> {
        let n: i64 = self
            .0
            .prepare_cached("SELECT count(*) FROM outbox WHERE published_at IS NULL")?
            .query_row([], |r| r.get(0))?;
        Ok(n as usize)
    }

    fn newest_payloads(&mut self, topic: &str, limit: usize) -> Result<Vec<String>, StoreError> {
        let mut stmt = self.0.prepare_cached(
            "SELECT payload FROM outbox WHERE topic = ?1 ORDER BY id DESC LIMIT ?2",
        )?;
        let rows = stmt.query_map(rusqlite::params![topic, limit as i64], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn keyed_payloads_since(
        &mut self,
        topic: &str,
        keys: &HashSet<String>,
        since_ms: i64,
    ) -> Result<Vec<String>, StoreError> {
        let mut out = Vec::new();
        let mut stmt = self.0.prepare_cached(
            "SELECT key, payload, created_at FROM outbox WHERE topic = ?1 ORDER BY id DESC",
        )?;
        let mut rows = stmt.query([topic])?;
        while let Some(row) = rows.next()? {
            if row.get::<_, i64>(2)? < since_ms {
                break;
            }
            if keys.contains(&row.get::<_, String>(0)?) {
                out.push(row.get(1)?);
            }
        }
        Ok(out)
    }

    fn prunable(
        &mut self,
        published_before_ms: i64,
        batch: usize,
        after: i64,
    ) -> Result<Vec<i64>, StoreError> {
        let mut stmt = self.0.prepare_cached(&format!(
            "SELECT id FROM outbox WHERE id > ?3 AND published_at < ?1 \
             AND id < (SELECT max(id) FROM outbox) \
             AND NOT EXISTS (SELECT 1 FROM leases \
                 WHERE leases.id = outbox.key AND leases.{OPEN}) \
             ORDER BY id LIMIT ?2"
        ))?;
        let ids = stmt.query_map(
            rusqlite::params![published_before_ms, batch as i64, after],
            |r| r.get(0),
        )?;
        Ok(ids.collect::<Result<_, _>>()?)
    }
}
