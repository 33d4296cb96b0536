//! The database's schema, as the migrations that build it: a database at version `n` has run the
//! first `n`, and [`migrate`] runs the rest when the store opens.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use super::types::StoreError;

/// The schema's changes, in order; a database's `schema_version` is how many it has run.
pub(super) const MIGRATIONS: &[&str] = &[
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
    // 5: the time of the newest `lease_utilization` signal the rules handled for each open
    // lease, so that an older one replayed after a restart is ignored as it was before.
    "CREATE TABLE lease_signals (
        lease_id TEXT PRIMARY KEY,
        ts_ms INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 6: the client's Idempotency-Key of a lease (see PostgreSQL's migration 4).
    "ALTER TABLE leases ADD COLUMN admission_key TEXT;
    CREATE INDEX leases_admission_key ON leases (granted_at) WHERE admission_key IS NOT NULL;",
    // 7: where a substrate holds a lease (see PostgreSQL's migration 5).
    "ALTER TABLE leases ADD COLUMN substrate_ref TEXT;",
];

/// Brings the database's schema up to date, in one transaction; refuses one written by a newer
/// gpuwarden.
pub(super) fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
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

#[cfg(test)]
mod tests {
    use rusqlite::params;

    use super::*;
    use crate::store::types::tests::lease;
    use crate::store::writer::{apply, Op};
    use crate::store::{LeaseState, Store};

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
            // Lease rows as that version wrote them (its columns, without later ones).
            let insert = "INSERT INTO leases (id, team, user, project, workload, substrate, \
                gpu_model, gpu_count, gpu_uuids, labels, state, granted_at, expires_at, \
                updated_at, released_at, release_reason) VALUES (?1, 'ml', 'ada', 'p', \
                'training', 'sim', 'H100', 1, '[\"GPU-0\"]', '{}', ?2, 0, NULL, ?3, ?4, ?5)";
            conn.execute(
                insert,
                params!["lease-open", "active", 3, None::<i64>, None::<&str>],
            )
            .unwrap();
            conn.execute(insert, params!["lease-ended", "released", 5, 5, "user"])
                .unwrap();
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
        assert_eq!(
            store.schema_version().wait().unwrap(),
            MIGRATIONS.len() as i64
        );
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
        drop(store);
        let without_rowid: String = Connection::open(&path)
            .unwrap()
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'leases'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(without_rowid.contains("WITHOUT ROWID"), "{without_rowid}");
    }
}
