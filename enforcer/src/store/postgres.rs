//! The lease store on PostgreSQL, shared by several enforcer replicas.
//!
//! Each replica keeps the same memory as the SQLite store (what admission reads), but decides no
//! change on stale memory: its writer thread takes every queued change into one transaction that
//! first takes the store's one lock ([`LOCK_KEY`], `pg_advisory_xact_lock`), then brings memory
//! up to date with what other replicas committed ([`catch_up`]), and only then runs the changes
//! (the policy included) against memory, writes their rows, and commits. A replica's changes are
//! answered only once that commit returns, so "admitted" means durable in PostgreSQL.
//!
//! Why one lock rather than row locks or SERIALIZABLE: an admission reads the whole fleet's
//! holdings (placement picks among every team's free GPUs, a pooled substrate counts every
//! team's leases), so any finer lock would still be taken by nearly every admission, and
//! SERIALIZABLE would abort and retry the same conflicts. The lock is held for one transaction
//! of many changes (group commit, as SQLite's writer does), so the cost of a commit, and of the
//! lock's round trips, is shared by every change queued meanwhile.
//!
//! Every committed batch bumps `store_version` and records what of memory it changed in
//! `store_changes` (the keys of [`Op::changed`]); `NOTIFY gpuwarden_store` tells the other
//! replicas, whose listener thread queues a [`Job::CatchUp`], so their reads follow within
//! milliseconds, and their next change catches up exactly under the lock in any case. A replica
//! that finds the changes it missed pruned, or a database older than its memory, reloads memory
//! whole.
//!
//! When PostgreSQL cannot be reached, or a commit fails, every caller in the batch hears
//! [`StoreError::Unavailable`] (the API answers 503), memory is reloaded from the database before
//! the next batch (it may hold the failed batch's changes), and the writer reconnects on the
//! next job: no restart is needed. A commit whose answer was lost (the connection dropped during
//! `COMMIT`) is reported as failed, though it may have landed; it is never reported as done. A
//! client that retries an admission with its Idempotency-Key is then answered with the lease
//! that landed ([`super::Admitted::Keyed`]), not given a second one.
//!
//! Round trips: a batch that changes something sends `BEGIN` and the lock in one simple query,
//! reads the version and the changes it missed in one statement (and the rows they name in one
//! more), and writes its lease and outbox rows, the new version, what it changed and the
//! notification in one statement before `COMMIT`. The sessions run without PostgreSQL's JIT,
//! which compiled these short statements at a cost greater than running them.
//!
//! Each session sets `idle_in_transaction_session_timeout`, so a replica stopped inside its
//! transaction (paused, partitioned) loses the lock after [`IDLE_IN_TRANSACTION`] instead of
//! stopping every other replica, and its commit, when it wakes, fails.

use std::collections::{BTreeSet, HashMap};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuwarden_schema::ReleaseReason;
use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, GenericClient, NoTls, Statement};

use super::db::Db;
use super::leader::{self, Fence};
use super::memory::{recent_keys_sql, Memory, KEY_RETENTION_MS};
use super::rows::{json, ParseRaw, RawLease, COLUMNS, OPEN};
use super::types::{Lease, LeaseFilter, OutboxRow, StoreError};
use super::writer::{lock, Done, Job, Op, Queue};

/// The advisory lock every writing transaction takes ("gpuwarde" in ASCII).
pub(super) const LOCK_KEY: i64 = 0x6770_7577_6172_6465;
/// The channel a commit notifies.
pub(super) const CHANNEL: &str = "gpuwarden_store";
/// How long PostgreSQL lets a session sit inside a transaction before it ends the session (and
/// releases the store's lock): far above any batch's time, far below a client's patience.
pub(super) const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);
/// Longest wait for the store's lock (another replica holds it) before the batch fails.
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a statement runs.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a connection takes to open when the URL sets no `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How many versions of `store_changes` are kept for replicas catching up; one further behind
/// reloads memory whole.
const CHANGES_KEPT: i64 = 10_000;

/// The schema's changes on PostgreSQL, in order; `schema_version` is how many have run. The same
/// tables as SQLite's (`migrations.rs`), and the two tables that let replicas follow each other.
pub(super) const MIGRATIONS: &[&str] = &[
    // 1: the store as SQLite's migrations 1 to 5 leave it; the version and the changes of each
    // commit, for the other replicas' memory.
    r#"CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        team TEXT NOT NULL,
        "user" TEXT NOT NULL,
        project TEXT NOT NULL,
        workload TEXT NOT NULL,
        substrate TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        gpu_count INTEGER NOT NULL,
        gpu_uuids TEXT NOT NULL,
        labels TEXT NOT NULL,
        state TEXT NOT NULL,
        granted_at BIGINT NOT NULL,
        expires_at BIGINT,
        updated_at BIGINT NOT NULL,
        released_at BIGINT,
        release_reason TEXT
    );
    CREATE INDEX leases_team ON leases (team);
    CREATE INDEX leases_open ON leases (id) WHERE state IN ('granted', 'active', 'releasing');
    CREATE TABLE outbox (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        topic TEXT NOT NULL,
        key TEXT NOT NULL,
        payload TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        published_at BIGINT
    );
    CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;
    CREATE INDEX outbox_topic ON outbox (topic, id);
    CREATE TABLE blocked_teams (
        team TEXT PRIMARY KEY,
        reason TEXT NOT NULL,
        blocked_at BIGINT NOT NULL
    );
    CREATE TABLE team_spend (
        team TEXT PRIMARY KEY,
        month_to_date_usd DOUBLE PRECISION NOT NULL,
        burn_usd_per_hour DOUBLE PRECISION NOT NULL,
        ts_ms BIGINT NOT NULL
    );
    CREATE TABLE exemptions (
        lease_id TEXT PRIMARY KEY,
        until_ms BIGINT NOT NULL,
        granted_by TEXT NOT NULL,
        reason TEXT NOT NULL,
        at BIGINT NOT NULL
    );
    CREATE TABLE rule_marks (
        key TEXT PRIMARY KEY,
        at BIGINT NOT NULL
    );
    CREATE TABLE lease_signals (
        lease_id TEXT PRIMARY KEY,
        ts_ms BIGINT NOT NULL
    );
    CREATE TABLE store_version (version BIGINT NOT NULL);
    INSERT INTO store_version (version) VALUES (0);
    CREATE TABLE store_changes (
        version BIGINT PRIMARY KEY,
        keys TEXT NOT NULL
    );"#,
    // 2: the leader's lease (see leader.rs): who holds it, its term (the fencing token), and
    // when it runs out, on PostgreSQL's clock.
    r#"CREATE TABLE leader (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        holder TEXT NOT NULL,
        term BIGINT NOT NULL,
        expires_ms BIGINT NOT NULL
    );
    INSERT INTO leader (id, holder, term, expires_ms) VALUES (1, '', 0, 0);"#,
    // 3: what a person sees must not depend on the replica that answers: the portal's sessions
    // (by the SHA-256 of their id), the request forms already sent, and the failed logins each
    // replica saw, for the others' limits.
    r#"CREATE TABLE portal_sessions (
        id_sha256 TEXT PRIMARY KEY,
        principal TEXT NOT NULL,
        csrf TEXT NOT NULL,
        created_ms BIGINT NOT NULL
    );
    CREATE INDEX portal_sessions_principal ON portal_sessions (principal, created_ms);
    CREATE INDEX portal_sessions_created ON portal_sessions (created_ms);
    CREATE TABLE portal_submissions (
        token TEXT PRIMARY KEY,
        lease_id TEXT,
        at_ms BIGINT NOT NULL
    );
    CREATE INDEX portal_submissions_at ON portal_submissions (at_ms);
    CREATE TABLE login_failures (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        replica TEXT NOT NULL,
        source TEXT,
        principal_sha256 TEXT,
        at_ms BIGINT NOT NULL
    );"#,
    // 4: the client's Idempotency-Key of a lease, so that an admission retried after an answer
    // was lost (a commit that landed as the connection dropped) finds its lease, on any replica.
    // Keys are looked up in memory; the index serves loading the recent ones.
    r#"ALTER TABLE leases ADD COLUMN admission_key TEXT;
    CREATE INDEX leases_admission_key ON leases (granted_at) WHERE admission_key IS NOT NULL;"#,
    // 5: where a substrate holds a lease, as its driver writes it down (the Kubernetes driver's
    // pod or Deployment), for the driver of every replica: a pod admitted through one replica's
    // webhook, or created by one replica's driver, is deleted by whichever replica reclaims it.
    r#"ALTER TABLE leases ADD COLUMN substrate_ref TEXT;"#,
];

/// How to reach the database: the URL's settings, with the password from `password_file`, and
/// TLS when the URL asks for it.
#[derive(Clone)]
pub(super) struct Target {
    config: postgres::Config,
    /// rustls, verifying the server's certificate and name, with `sslmode=require` (or libpq's
    /// `verify-ca`, `verify-full`); none without.
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
    /// The URL without its password, for messages.
    shown: String,
}

/// Splits libpq's TLS settings out of `url`, which tokio-postgres does not read: whether TLS is
/// asked for (`sslmode` `require`, `verify-ca` or `verify-full`), and `sslrootcert`, the CAs to
/// trust instead of Mozilla's. The rest of the URL is returned as it was (`verify-*` written as
/// `require`, the mode tokio-postgres knows; the certificate is verified either way).
fn tls_settings(url: &str) -> (String, bool, Option<std::path::PathBuf>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), false, None);
    };
    let (mut tls, mut root) = (false, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslrootcert" => root = Some(std::path::PathBuf::from(value)),
            "sslmode" if matches!(value, "require" | "verify-ca" | "verify-full") => {
                tls = true;
                kept.push("sslmode=require".to_owned());
            }
            _ => kept.push(pair.to_owned()),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, tls, root)
}

/// A TLS client trusting Mozilla's roots (as the enforcer's HTTP client does).
fn mozilla_roots() -> Result<rustls::ClientConfig, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    Ok(
        rustls::ClientConfig::builder_with_provider(gpuwarden_schema::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Io(format!("enforcer.store.url: TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// `url` with its password, if any, replaced by `***`.
fn without_password(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((user, host)) => match user.split_once(':') {
                Some((u, _)) => format!("{scheme}://{u}:***@{host}"),
                None => url.to_owned(),
            },
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

impl Target {
    /// Reads `url` (libpq's URL form; `sslmode=require` with `sslrootcert=<CA file>`, or
    /// Mozilla's roots, for TLS) and the password in `password_file`'s first line.
    pub(super) fn new(
        url: &str,
        password_file: Option<&std::path::Path>,
    ) -> Result<Self, StoreError> {
        let shown = without_password(url);
        let (url, wants_tls, root) = tls_settings(url);
        let mut config = postgres::Config::from_str(&url).map_err(|e| {
            StoreError::Io(format!("enforcer.store.url is not a PostgreSQL URL: {e}"))
        })?;
        let tls = match (wants_tls, &root) {
            (true, Some(ca)) => Some(
                gpuwarden_schema::tls::client_config(
                    ca,
                    None,
                    ("enforcer.store.url sslrootcert", "", ""),
                )
                .map_err(|e| StoreError::Io(e.to_string()))?,
            ),
            (true, None) => Some(mozilla_roots()?),
            (false, Some(_)) => {
                return Err(StoreError::Io(
                    "enforcer.store.url: sslrootcert is given but sslmode is not require, \
                     verify-ca or verify-full, so the connection would not use TLS"
                        .into(),
                ))
            }
            (false, None) => None,
        }
        .map(tokio_postgres_rustls::MakeRustlsConnect::new);
        if let Some(path) = password_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                StoreError::Io(format!(
                    "enforcer.store.password_file: cannot read {}: {e}",
                    path.display()
                ))
            })?;
            config.password(text.lines().next().unwrap_or("").trim_end());
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        config.application_name("gpuwarden-enforcer");
        // No JIT compilation for the store's sessions: their statements are short lookups and
        // writes, and PostgreSQL's JIT (on by default) compiled some of them on every
        // execution, which cost more than everything else the store asked of it together
        // (72% of the machine's CPU in `bench/admission.sh`'s replicas side was LLVM's).
        let options = match config.get_options() {
            Some(given) => format!("{given} -c jit=off"),
            None => "-c jit=off".to_owned(),
        };
        config.options(&options);
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(10));
        Ok(Self { config, tls, shown })
    }

    /// A new session, with the store's timeouts set.
    pub(super) fn connect(&self) -> Result<Client, StoreError> {
        let connected = match &self.tls {
            Some(tls) => self.config.connect(tls.clone()),
            None => self.config.connect(NoTls),
        };
        let mut client = connected.map_err(|e| unavailable(&self.shown, &e))?;
        client
            .batch_execute(&format!(
                "SET idle_in_transaction_session_timeout = {}; SET lock_timeout = {}; \
                 SET statement_timeout = {}",
                IDLE_IN_TRANSACTION.as_millis(),
                LOCK_TIMEOUT.as_millis(),
                STATEMENT_TIMEOUT.as_millis()
            ))
            .map_err(|e| unavailable(&self.shown, &e))?;
        Ok(client)
    }

    /// The URL, without its password.
    pub(super) fn shown(&self) -> &str {
        &self.shown
    }
}

/// A PostgreSQL failure as the store reports it: [`StoreError::Unavailable`] when the database
/// could not be reached or the session ended (trying again may help), else
/// [`StoreError::Postgres`].
fn unavailable(target: &str, e: &postgres::Error) -> StoreError {
    let code = e.code().map(|c| c.code().to_owned());
    let reachable = e.as_db_error().is_some() && !e.is_closed();
    // The causes too: "error performing TLS handshake" alone does not say the certificate's
    // issuer is unknown.
    let mut why = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !why.contains(&text) {
            why.push_str(": ");
            why.push_str(&text);
        }
        source = cause.source();
    }
    match code.as_deref() {
        // Connection exceptions, an administrator's or a crash's shutdown, a server starting,
        // a lock not had in time, a session ended for sitting in its transaction.
        Some(c) if c.starts_with("08") || c.starts_with("57P") || c == "55P03" || c == "25P03" => {
            StoreError::Unavailable(format!("PostgreSQL at {target}: {why}"))
        }
        _ if !reachable => StoreError::Unavailable(format!("PostgreSQL at {target}: {why}")),
        _ => StoreError::Postgres(format!("PostgreSQL at {target}: {why}")),
    }
}

/// Brings the database's schema up to date, in one transaction under the store's lock, so
/// replicas starting together migrate once; refuses one written by a newer gpuwarden, naming
/// both versions.
pub(super) fn migrate(client: &mut Client, target: &str) -> Result<(), StoreError> {
    let fail = |e: postgres::Error| unavailable(target, &e);
    let mut tx = client.transaction().map_err(fail)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .map_err(fail)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
        .map_err(fail)?;
    let version: i64 = match tx
        .query_opt("SELECT version FROM schema_version", &[])
        .map_err(fail)?
    {
        Some(row) => row.get(0),
        None => {
            tx.execute("INSERT INTO schema_version (version) VALUES (0)", &[])
                .map_err(fail)?;
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
        tx.batch_execute(sql).map_err(fail)?;
        tx.execute("UPDATE schema_version SET version = $1", &[&(i as i64 + 1)])
            .map_err(fail)?;
    }
    tx.commit().map_err(fail)
}

/// A lease row as PostgreSQL gives it, as the SQLite reader's tuple.
fn raw(row: &postgres::Row) -> RawLease {
    let count: i32 = row.get(7);
    (
        (
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
            row.get(6),
            count.max(0) as u32,
        ),
        (
            row.get(8),
            row.get(9),
            row.get(10),
            row.get(11),
            row.get(12),
            row.get(13),
            row.get(14),
            row.get(15),
        ),
        row.get(16),
        row.get(17),
    )
}

/// Reads what memory holds, and the version it is at, from the database, in one snapshot.
fn load(client: &mut Client, target: &str) -> Result<Memory, StoreError> {
    let fail = |e: postgres::Error| unavailable(target, &e);
    let mut tx = client.transaction().map_err(fail)?;
    tx.batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .map_err(fail)?;
    let memory = read_memory(&mut tx, target)?;
    tx.commit().map_err(fail)?;
    Ok(memory)
}

/// [`load`]'s queries, in the transaction of `db` (a batch's, under the store's lock, when
/// [`catch_up`] reloads).
fn read_memory<C: GenericClient>(tx: &mut C, target: &str) -> Result<Memory, StoreError> {
    let fail = |e: postgres::Error| unavailable(target, &e);
    let mut memory = Memory::default();
    memory.version = tx
        .query_one("SELECT version FROM store_version", &[])
        .map_err(fail)?
        .get(0);
    for row in tx
        .query(&format!("SELECT {COLUMNS} FROM leases WHERE {OPEN}"), &[])
        .map_err(fail)?
    {
        memory.put(raw(&row).parse()?);
    }
    for row in tx
        .query(&recent_keys_sql("$1"), &[&KEY_RETENTION_MS])
        .map_err(fail)?
    {
        memory.note_key(&raw(&row).parse()?);
    }
    for row in tx
        .query("SELECT team, month_to_date_usd, ts_ms FROM team_spend", &[])
        .map_err(fail)?
    {
        memory.spend.insert(row.get(0), (row.get(1), row.get(2)));
    }
    for row in tx
        .query("SELECT team FROM blocked_teams", &[])
        .map_err(fail)?
    {
        memory.blocked.insert(row.get(0));
    }
    for row in tx
        .query("SELECT lease_id, until_ms FROM exemptions", &[])
        .map_err(fail)?
    {
        let lease: String = row.get(0);
        if memory.open(&lease).is_some() {
            memory.exempt.insert(lease, row.get(1));
        }
    }
    for row in tx
        .query("SELECT lease_id, ts_ms FROM lease_signals", &[])
        .map_err(fail)?
    {
        let lease: String = row.get(0);
        if memory.open(&lease).is_some() {
            memory.signals.insert(lease, row.get(1));
        }
    }
    for row in tx.query("SELECT key FROM rule_marks", &[]).map_err(fail)? {
        memory.marks.insert(row.get(0));
    }
    Ok(memory)
}

/// Brings `memory` up to what the database holds: refetches everything the commits since
/// memory's version changed (from `store_changes`), or reloads it whole when those are pruned or
/// the database is behind memory. Exact when run under the store's lock; otherwise memory may
/// get ahead of its version on some keys, which the next catch-up refetches again.
fn catch_up<C: GenericClient>(
    db: &mut C,
    memory: &Mutex<Memory>,
    target: &str,
) -> Result<(), StoreError> {
    let fail = |e: postgres::Error| unavailable(target, &e);
    let from = lock(memory).version;
    // The version and the changes since memory's, in one round trip: one row per change, or
    // one without when there is none.
    let rows = db
        .query(
            "SELECT v.version, c.version, c.keys FROM store_version v \
             LEFT JOIN store_changes c ON c.version > $1 ORDER BY c.version",
            &[&from],
        )
        .map_err(fail)?;
    let now: i64 = rows
        .first()
        .map(|r| r.get(0))
        .ok_or_else(|| StoreError::Corrupt("store_version has no row".into()))?;
    if now == from {
        return Ok(());
    }
    let changes: Vec<(i64, &str)> = rows
        .iter()
        .filter_map(|r| Some((r.get::<_, Option<i64>>(1)?, r.get::<_, Option<&str>>(2)?)))
        .collect();
    let complete = now > from
        && changes.first().map(|c| c.0) == Some(from + 1)
        && changes.last().map(|c| c.0) == Some(now);
    if !complete {
        tracing::info!(
            memory = from,
            database = now,
            "the lease store's memory is too far behind (or ahead of) PostgreSQL to catch up; reloading it"
        );
        let fresh = read_memory(db, target)?;
        *lock(memory) = fresh;
        return Ok(());
    }
    let mut keys: BTreeSet<String> = BTreeSet::new();
    for (_, listed) in &changes {
        let list: Vec<String> = serde_json::from_str(listed)
            .map_err(|e| StoreError::Corrupt(format!("store_changes: {e}")))?;
        keys.extend(list);
    }
    let of = |prefix: &str| -> Vec<String> {
        keys.iter()
            .filter_map(|k| k.strip_prefix(prefix).map(str::to_owned))
            .collect()
    };
    let (leases, blocked, spend) = (of("l:"), of("b:"), of("s:"));
    let (exempt, marks, signals) = (of("e:"), of("m:"), of("g:"));
    // Each kind of row asked for only when a commit changed one (a round trip each).
    let mut fetch = |sql: &str, keys: &Vec<String>| -> Result<Vec<postgres::Row>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        db.query(sql, &[keys]).map_err(fail)
    };
    let lease_rows = fetch(
        &format!("SELECT {COLUMNS} FROM leases WHERE id = ANY($1)"),
        &leases,
    )?;
    let blocked_rows = fetch(
        "SELECT team FROM blocked_teams WHERE team = ANY($1)",
        &blocked,
    )?;
    let spend_rows = fetch(
        "SELECT team, month_to_date_usd, ts_ms FROM team_spend WHERE team = ANY($1)",
        &spend,
    )?;
    let exempt_rows = fetch(
        "SELECT lease_id, until_ms FROM exemptions WHERE lease_id = ANY($1)",
        &exempt,
    )?;
    let signal_rows = fetch(
        "SELECT lease_id, ts_ms FROM lease_signals WHERE lease_id = ANY($1)",
        &signals,
    )?;
    let mut fetched = Vec::with_capacity(lease_rows.len());
    for row in &lease_rows {
        fetched.push(raw(row).parse()?);
    }
    let mut memory = lock(memory);
    let mut seen = BTreeSet::new();
    for lease in fetched {
        seen.insert(lease.id.clone());
        memory.note_key(&lease);
        if lease.state.is_open() {
            memory.put(lease);
        } else {
            forget(&mut memory, &lease.id);
        }
    }
    for id in leases.iter().filter(|id| !seen.contains(*id)) {
        forget(&mut memory, id);
    }
    for team in &blocked {
        memory.blocked.remove(team);
    }
    for row in &blocked_rows {
        memory.blocked.insert(row.get(0));
    }
    for row in &spend_rows {
        memory.spend.insert(row.get(0), (row.get(1), row.get(2)));
    }
    for id in &exempt {
        memory.exempt.remove(id);
    }
    for row in &exempt_rows {
        let id: String = row.get(0);
        if memory.open(&id).is_some() {
            memory.exempt.insert(id, row.get(1));
        }
    }
    for id in &signals {
        memory.signals.remove(id);
    }
    for row in &signal_rows {
        let id: String = row.get(0);
        if memory.open(&id).is_some() {
            memory.signals.insert(id, row.get(1));
        }
    }
    memory.marks.extend(marks);
    memory.version = now;
    Ok(())
}

/// Forgets an ended (or deleted) lease, and what memory kept about it.
fn forget(memory: &mut Memory, id: &str) {
    memory.take(id);
    memory.exempt.remove(id);
    memory.signals.remove(id);
}

/// Prepared statements of one session, by their SQL.
#[derive(Default)]
struct Statements(HashMap<&'static str, Statement>);

impl Statements {
    fn get<C: GenericClient>(
        &mut self,
        tx: &mut C,
        sql: &'static str,
    ) -> Result<Statement, postgres::Error> {
        if let Some(s) = self.0.get(sql) {
            return Ok(s.clone());
        }
        let s = tx.prepare(sql)?;
        self.0.insert(sql, s.clone());
        Ok(s)
    }
}

/// Carries `op`, one that is neither a lease row nor an outbox row, out in the writer's
/// transaction.
fn apply<C: GenericClient>(
    tx: &mut C,
    statements: &mut Statements,
    op: &Op,
) -> Result<(), postgres::Error> {
    match op {
        Op::InsertLease(_) | Op::UpdateLease(_) | Op::DeleteLease(_) | Op::Outbox { .. } => {
            unreachable!("lease and outbox rows are written together by write_rows")
        }
        Op::Block { team, reason, at } => {
            let s = statements.get(
                tx,
                "INSERT INTO blocked_teams (team, reason, blocked_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (team) DO NOTHING",
            )?;
            tx.execute(&s, &[team, reason, at])?;
        }
        Op::Unblock { team } => {
            let s = statements.get(tx, "DELETE FROM blocked_teams WHERE team = $1")?;
            tx.execute(&s, &[team])?;
        }
        Op::Spend {
            team,
            month_to_date_usd,
            burn_usd_per_hour,
            ts_ms,
        } => {
            let s = statements.get(
                tx,
                "INSERT INTO team_spend (team, month_to_date_usd, burn_usd_per_hour, ts_ms) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (team) DO UPDATE SET \
                 month_to_date_usd = excluded.month_to_date_usd, \
                 burn_usd_per_hour = excluded.burn_usd_per_hour, ts_ms = excluded.ts_ms \
                 WHERE excluded.ts_ms >= team_spend.ts_ms",
            )?;
            tx.execute(&s, &[team, month_to_date_usd, burn_usd_per_hour, ts_ms])?;
        }
        Op::MarkPublished { ids, at } => {
            let s = statements.get(
                tx,
                "UPDATE outbox SET published_at = $2 WHERE id = ANY($1) AND published_at IS NULL",
            )?;
            tx.execute(&s, &[ids, at])?;
        }
        Op::Exempt {
            lease_id,
            until_ms,
            by,
            reason,
            at,
        } => {
            let s = statements.get(
                tx,
                "INSERT INTO exemptions (lease_id, until_ms, granted_by, reason, at) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (lease_id) DO UPDATE SET \
                 until_ms = excluded.until_ms, granted_by = excluded.granted_by, \
                 reason = excluded.reason, at = excluded.at",
            )?;
            tx.execute(&s, &[lease_id, until_ms, by, reason, at])?;
        }
        Op::Mark { key, at } => {
            let s = statements.get(
                tx,
                "INSERT INTO rule_marks (key, at) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING",
            )?;
            tx.execute(&s, &[key, at])?;
        }
        Op::Signal { lease_id, ts_ms } => {
            let s = statements.get(
                tx,
                "INSERT INTO lease_signals (lease_id, ts_ms) VALUES ($1, $2) \
                 ON CONFLICT (lease_id) DO UPDATE SET ts_ms = excluded.ts_ms",
            )?;
            tx.execute(&s, &[lease_id, ts_ms])?;
        }
        Op::ForgetSignal(lease_id) => {
            let s = statements.get(tx, "DELETE FROM lease_signals WHERE lease_id = $1")?;
            tx.execute(&s, &[lease_id])?;
        }
        Op::DeletePublished(ids) => {
            // Never a row Kafka has not acknowledged, whoever asked.
            let s = statements.get(
                tx,
                "DELETE FROM outbox WHERE id = ANY($1) AND published_at IS NOT NULL",
            )?;
            tx.execute(&s, &[ids])?;
        }
        Op::Nothing => {}
    }
    Ok(())
}

/// The portal's state and the failed logins, shared by the replicas of a PostgreSQL store (see
/// [`Store::portal_session`](super::Store::portal_session) and its neighbours).
pub(super) mod shared {
    use postgres::GenericClient;

    use super::super::types::StoreError;

    use super::super::db::Session;

    fn fail(e: postgres::Error) -> StoreError {
        StoreError::Unavailable(format!("PostgreSQL: {e}"))
    }

    /// Opens a session, ending first those past `lifetime_ms`, then the oldest of the same
    /// principal beyond `per_principal - 1`, then the oldest of all beyond `kept - 1`.
    pub(in super::super) fn open<C: GenericClient>(
        db: &mut C,
        id_sha256: &str,
        session: &Session,
        lifetime_ms: i64,
        per_principal: i64,
        kept: i64,
    ) -> Result<(), StoreError> {
        let (principal, csrf, created_ms) = session;
        db.execute(
            "DELETE FROM portal_sessions WHERE created_ms <= $1",
            &[&(created_ms - lifetime_ms)],
        )
        .map_err(fail)?;
        db.execute(
            "DELETE FROM portal_sessions WHERE id_sha256 IN (SELECT id_sha256 FROM \
             portal_sessions WHERE principal = $1 ORDER BY created_ms DESC OFFSET $2)",
            &[principal, &(per_principal - 1).max(0)],
        )
        .map_err(fail)?;
        db.execute(
            "DELETE FROM portal_sessions WHERE id_sha256 IN (SELECT id_sha256 FROM \
             portal_sessions ORDER BY created_ms DESC OFFSET $1)",
            &[&(kept - 1).max(0)],
        )
        .map_err(fail)?;
        db.execute(
            "INSERT INTO portal_sessions (id_sha256, principal, csrf, created_ms) \
             VALUES ($1, $2, $3, $4)",
            &[&id_sha256, principal, csrf, created_ms],
        )
        .map_err(fail)?;
        Ok(())
    }

    /// The session, unless it is gone or opened before `since_ms`.
    pub(in super::super) fn get<C: GenericClient>(
        db: &mut C,
        id_sha256: &str,
        since_ms: i64,
    ) -> Result<Option<Session>, StoreError> {
        Ok(db
            .query_opt(
                "SELECT principal, csrf, created_ms FROM portal_sessions \
                 WHERE id_sha256 = $1 AND created_ms > $2",
                &[&id_sha256, &since_ms],
            )
            .map_err(fail)?
            .map(|r| (r.get(0), r.get(1), r.get(2))))
    }

    /// Ends a session.
    pub(in super::super) fn close<C: GenericClient>(
        db: &mut C,
        id_sha256: &str,
    ) -> Result<(), StoreError> {
        db.execute(
            "DELETE FROM portal_sessions WHERE id_sha256 = $1",
            &[&id_sha256],
        )
        .map_err(fail)?;
        Ok(())
    }

    /// Marks a form's one-use token sent at `at_ms`: `Ok` the first time, else the lease it
    /// made, if any. Tokens older than `kept_ms` are forgotten.
    pub(in super::super) fn first_time<C: GenericClient>(
        db: &mut C,
        token: &str,
        at_ms: i64,
        kept_ms: i64,
    ) -> Result<Result<(), Option<String>>, StoreError> {
        db.execute(
            "DELETE FROM portal_submissions WHERE at_ms < $1",
            &[&(at_ms - kept_ms)],
        )
        .map_err(fail)?;
        let new = db
            .execute(
                "INSERT INTO portal_submissions (token, at_ms) VALUES ($1, $2) \
                 ON CONFLICT (token) DO NOTHING",
                &[&token, &at_ms],
            )
            .map_err(fail)?;
        if new == 1 {
            return Ok(Ok(()));
        }
        let lease = db
            .query_opt(
                "SELECT lease_id FROM portal_submissions WHERE token = $1",
                &[&token],
            )
            .map_err(fail)?
            .and_then(|r| r.get::<_, Option<String>>(0));
        Ok(Err(lease))
    }

    /// Records the lease a form sent with `token` made.
    pub(in super::super) fn made<C: GenericClient>(
        db: &mut C,
        token: &str,
        lease_id: &str,
    ) -> Result<(), StoreError> {
        db.execute(
            "UPDATE portal_submissions SET lease_id = $2 WHERE token = $1",
            &[&token, &lease_id],
        )
        .map_err(fail)?;
        Ok(())
    }

    /// Records a failed login seen by `replica`.
    pub(in super::super) fn login_failed<C: GenericClient>(
        db: &mut C,
        replica: &str,
        source: Option<&str>,
        principal_sha256: Option<&str>,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        db.execute(
            "INSERT INTO login_failures (replica, source, principal_sha256, at_ms) \
             VALUES ($1, $2, $3, $4)",
            &[&replica, &source, &principal_sha256, &at_ms],
        )
        .map_err(fail)?;
        Ok(())
    }

    /// The failed logins other replicas than `replica` saw after id `after` and since
    /// `since_ms`: (id, source, principal's SHA-256). Rows from before `since_ms` are deleted.
    pub(in super::super) fn login_failures<C: GenericClient>(
        db: &mut C,
        replica: &str,
        after: i64,
        since_ms: i64,
    ) -> Result<Vec<super::super::db::LoginFailure>, StoreError> {
        db.execute("DELETE FROM login_failures WHERE at_ms < $1", &[&since_ms])
            .map_err(fail)?;
        Ok(db
            .query(
                "SELECT id, source, principal_sha256 FROM login_failures \
                 WHERE id > $1 AND replica <> $2 AND at_ms >= $3 ORDER BY id",
                &[&after, &replica, &since_ms],
            )
            .map_err(fail)?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }
}

/// PostgreSQL's [`Db`]: the writer's session, or its transaction.
pub(super) struct Pg<'a, C> {
    db: &'a mut C,
    target: &'a str,
}

impl<C: GenericClient> Pg<'_, C> {
    fn fail(&self, e: postgres::Error) -> StoreError {
        unavailable(self.target, &e)
    }
}

impl<C: GenericClient> Db for Pg<'_, C> {
    fn session_open(
        &mut self,
        id: &str,
        session: &super::db::Session,
        (lifetime_ms, per_principal, kept): (i64, i64, i64),
    ) -> Result<(), StoreError> {
        shared::open(self.db, id, session, lifetime_ms, per_principal, kept)
    }

    fn session(
        &mut self,
        id: &str,
        since_ms: i64,
    ) -> Result<Option<super::db::Session>, StoreError> {
        shared::get(self.db, id, since_ms)
    }

    fn session_close(&mut self, id: &str) -> Result<(), StoreError> {
        shared::close(self.db, id)
    }

    fn submission_first(
        &mut self,
        token: &str,
        at_ms: i64,
        kept_ms: i64,
    ) -> Result<Result<(), Option<String>>, StoreError> {
        shared::first_time(self.db, token, at_ms, kept_ms)
    }

    fn submission_made(&mut self, token: &str, lease_id: &str) -> Result<(), StoreError> {
        shared::made(self.db, token, lease_id)
    }

    fn login_failed(
        &mut self,
        replica: &str,
        source: Option<&str>,
        principal: Option<&str>,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        shared::login_failed(self.db, replica, source, principal, at_ms)
    }

    fn login_failures(
        &mut self,
        replica: &str,
        after: i64,
        since_ms: i64,
    ) -> Result<Vec<super::db::LoginFailure>, StoreError> {
        shared::login_failures(self.db, replica, after, since_ms)
    }

    fn schema_version(&mut self) -> Result<i64, StoreError> {
        let row = self
            .db
            .query_one("SELECT version FROM schema_version", &[])
            .map_err(|e| self.fail(e))?;
        Ok(row.get(0))
    }

    fn lease(&mut self, id: &str) -> Result<Option<Lease>, StoreError> {
        let row = self
            .db
            .query_opt(
                &format!("SELECT {COLUMNS} FROM leases WHERE id = $1"),
                &[&id],
            )
            .map_err(|e| self.fail(e))?;
        row.map(|r| raw(&r).parse()).transpose()
    }

    fn leases(&mut self, filter: &LeaseFilter) -> Result<Vec<Lease>, StoreError> {
        let state = filter.state.map(|s| s.as_str().to_owned());
        let teams: Option<Vec<String>> = filter.teams.as_ref().map(|t| t.to_vec());
        let rows = self
            .db
            .query(
                &format!(
                    "SELECT {COLUMNS} FROM leases WHERE ($1::text IS NULL OR state = $1) \
                     AND ($2::text[] IS NULL OR team = ANY($2)) ORDER BY granted_at DESC, id"
                ),
                &[&state, &teams],
            )
            .map_err(|e| self.fail(e))?;
        rows.iter().map(|r| raw(r).parse()).collect()
    }

    fn outbox_pending(&mut self, limit: usize) -> Result<Vec<OutboxRow>, StoreError> {
        let rows = self
            .db
            .query(
                "SELECT id, topic, key, payload, created_at FROM outbox \
                 WHERE published_at IS NULL ORDER BY id LIMIT $1",
                &[&(limit as i64)],
            )
            .map_err(|e| self.fail(e))?;
        Ok(rows
            .iter()
            .map(|r| OutboxRow {
                id: r.get(0),
                topic: r.get(1),
                key: r.get(2),
                payload: r.get(3),
                created_at: r.get(4),
            })
            .collect())
    }

    fn outbox_pending_count(&mut self) -> Result<usize, StoreError> {
        let row = self
            .db
            .query_one(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL",
                &[],
            )
            .map_err(|e| self.fail(e))?;
        Ok(row.get::<_, i64>(0) as usize)
    }

    fn newest_payloads(&mut self, topic: &str, limit: usize) -> Result<Vec<String>, StoreError> {
        let rows = self
            .db
            .query(
                "SELECT payload FROM outbox WHERE topic = $1 ORDER BY id DESC LIMIT $2",
                &[&topic, &(limit as i64)],
            )
            .map_err(|e| self.fail(e))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    fn keyed_payloads_since(
        &mut self,
        topic: &str,
        keys: &std::collections::HashSet<String>,
        since_ms: i64,
    ) -> Result<Vec<String>, StoreError> {
        // Rows are appended in time order, so those since `since_ms` are the newest ones; the
        // keys are then matched by the index on (topic, id) rather than by a scan.
        let keys: Vec<&String> = keys.iter().collect();
        let rows = self
            .db
            .query(
                "SELECT payload FROM outbox WHERE topic = $1 AND key = ANY($2) AND id >= \
                 coalesce((SELECT min(id) FROM outbox WHERE topic = $1 AND created_at >= $3), \
                 (SELECT max(id) + 1 FROM outbox), 0) ORDER BY id DESC",
                &[&topic, &keys, &since_ms],
            )
            .map_err(|e| self.fail(e))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    fn prunable(
        &mut self,
        published_before_ms: i64,
        batch: usize,
        after: i64,
    ) -> Result<Vec<i64>, StoreError> {
        let rows = self
            .db
            .query(
                &format!(
                    "SELECT id FROM outbox WHERE id > $3 AND published_at < $1 \
                     AND id < (SELECT max(id) FROM outbox) \
                     AND NOT EXISTS (SELECT 1 FROM leases \
                         WHERE leases.id = outbox.key AND leases.{OPEN}) \
                     ORDER BY id LIMIT $2"
                ),
                &[&published_before_ms, &(batch as i64), &after],
            )
            .map_err(|e| self.fail(e))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}

/// The PostgreSQL writer's session, and whether memory must be reloaded before it is trusted.
pub(super) struct Writer {
    target: Target,
    /// Set by the listener while a catch-up is queued; every batch catches up, so it is
    /// cleared as each one starts.
    catch_up_queued: Arc<AtomicBool>,
    client: Option<Client>,
    statements: Statements,
    /// Memory may hold changes that were not committed (a batch failed): reload it first.
    stale: bool,
}

impl Writer {
    /// A writer over `client`, whose memory was just loaded from it.
    pub(super) fn new(target: Target, client: Client, catch_up_queued: Arc<AtomicBool>) -> Self {
        Self {
            target,
            catch_up_queued,
            client: Some(client),
            statements: Statements::default(),
            stale: false,
        }
    }

    /// The writer thread: runs each batch in one transaction under the store's lock, until the
    /// queue closes.
    pub(super) fn run(mut self, queue: &Queue, memory: &Mutex<Memory>) {
        while let Some(batch) = queue.next_batch() {
            self.batch(batch, queue, memory);
        }
    }

    fn batch(&mut self, batch: Vec<Job>, queue: &Queue, memory: &Mutex<Memory>) {
        self.catch_up_queued.store(false, Ordering::Release);
        if let Err(e) = self.ready(memory) {
            tracing::warn!(error = %e, "the lease store cannot reach PostgreSQL; answering 503 until it can");
            fail_all(batch, &e);
            return;
        }
        let client = self.client.as_mut().expect("ready() connected");
        let mut made = Made::default();
        let writes = batch.iter().any(|j| matches!(j, Job::Mutate(..)));
        let mut jobs = batch.into_iter();
        let result = run_batch(
            client,
            &mut self.statements,
            self.target.shown(),
            writes,
            &mut jobs,
            memory,
            &mut made,
        );
        let Made { answers, changes } = made;
        match &result {
            Ok(()) => {
                if changes > 0 {
                    queue.count_commit(changes);
                }
                for done in answers {
                    done(Ok(()));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "a lease store transaction failed; its changes were not made");
                // Memory may hold the failed batch's changes.
                self.stale = true;
                if self.client.as_ref().is_none_or(Client::is_closed) {
                    self.client = None;
                }
                for done in answers {
                    done(Err(same(e)));
                }
                fail_all(jobs.collect(), e);
            }
        }
    }

    /// Connects if needed, and reloads memory if it may hold what was never committed.
    fn ready(&mut self, memory: &Mutex<Memory>) -> Result<(), StoreError> {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
        if self.client.is_none() {
            self.client = Some(self.target.connect()?);
            self.statements = Statements::default();
            self.stale = true;
        }
        if self.stale {
            let client = self.client.as_mut().expect("connected above");
            match load(client, self.target.shown()) {
                Ok(fresh) => {
                    *lock(memory) = fresh;
                    self.stale = false;
                    tracing::info!("the lease store reloaded its memory from PostgreSQL");
                }
                Err(e) => {
                    if client.is_closed() {
                        self.client = None;
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// The changes a batch made, and whom to tell how its commit went.
#[derive(Default)]
struct Made {
    answers: Vec<Done>,
    changes: u64,
}

/// Runs one batch in one transaction: the lock (when it writes), memory caught up, each job,
/// the rows, the version and its changes, the notification, the commit.
fn run_batch(
    client: &mut Client,
    statements: &mut Statements,
    target: &str,
    writes: bool,
    jobs: &mut std::vec::IntoIter<Job>,
    memory: &Mutex<Memory>,
    made: &mut Made,
) -> Result<(), StoreError> {
    let fail = |e: postgres::Error| unavailable(target, &e);
    if jobs.as_slice().iter().all(|j| matches!(j, Job::CatchUp)) {
        // Only other replicas' commits to follow: statements of their own (a transaction in
        // READ COMMITTED would add two round trips and no consistency; see `catch_up`).
        jobs.for_each(drop);
        return catch_up(client, memory, target);
    }
    let mut open = Open::begin(client, writes).map_err(fail)?;
    let tx: &mut Client = &mut open;
    catch_up(tx, memory, target)?;
    // The leader's lease as it stands now, if a job is fenced by it: the row is locked until
    // the commit, so a new leader cannot be elected in between.
    let fenced = jobs
        .as_slice()
        .iter()
        .any(|j| matches!(j, Job::Mutate(_, Some(_)) | Job::Read(_, Some(_))));
    let leader: Option<Fence> = if fenced {
        tx.query_opt(&format!("{} FOR SHARE", leader::holder_sql()), &[])
            .map_err(fail)?
            .map(|r| Fence {
                replica: r.get(0),
                term: r.get(1),
            })
    } else {
        None
    };
    let refused = |fence: &Option<Fence>, what: &str| -> Option<StoreError> {
        let fence = fence.as_ref()?;
        (leader.as_ref() != Some(fence)).then(|| {
            StoreError::Fenced(format!(
                "{what}: its term {} is not the leader's ({})",
                fence.term,
                leader
                    .as_ref()
                    .map_or("the lease has run out".to_owned(), |l| format!(
                        "{} holds term {}",
                        l.replica, l.term
                    ))
            ))
        })
    };
    let mut ops: Vec<Op> = Vec::new();
    // Every change this batch makes of memory, for the other replicas.
    let mut keys = BTreeSet::new();
    for job in jobs.by_ref() {
        match job {
            Job::Mutate(change, fence) => {
                if let Some(e) = refused(&fence, "change the lease store") {
                    change.fail(e);
                    continue;
                }
                let mut guard = lock(memory);
                let mut db = Pg {
                    db: &mut *tx,
                    target,
                };
                if let Some((rows, done)) = change.run(&mut guard, &mut db) {
                    ops.extend(rows);
                    made.answers.push(done);
                    made.changes += 1;
                }
            }
            Job::Read(query, fence) => {
                if let Some(e) = refused(&fence, "read for the leader's work") {
                    query.fail(e);
                    continue;
                }
                // Reads see the rows written before them in this transaction.
                if let Err(e) = write_rows(tx, statements, &ops, &mut keys, None) {
                    let e = fail(e);
                    query.fail(same(&e));
                    return Err(e);
                }
                ops.clear();
                made.answers.push(query.run_until_committed(&mut Pg {
                    db: &mut *tx,
                    target,
                }));
            }
            Job::CatchUp => {}
            Job::Write { done, .. } => {
                let _ = done.send(Err("a change went to the PostgreSQL writer".into()));
            }
        }
    }
    // With the version, what it changed and the notification, when it changed something.
    let bump = (made.changes > 0).then(|| lock(memory).version + 1);
    write_rows(tx, statements, &ops, &mut keys, bump).map_err(fail)?;
    if let Some(version) = bump.filter(|v| v % 1_000 == 0) {
        tx.execute(
            "DELETE FROM store_changes WHERE version <= $1",
            &[&(version - CHANGES_KEPT)],
        )
        .map_err(fail)?;
    }
    open.commit().map_err(fail)?;
    if let Some(version) = bump {
        lock(memory).version = version;
    }
    Ok(())
}

/// A transaction of the writer's session, begun by hand so that `BEGIN` and the store's lock
/// go in one round trip; rolled back if dropped before [`Open::commit`].
struct Open<'a> {
    client: &'a mut Client,
    done: bool,
}

impl<'a> Open<'a> {
    /// Begins a transaction, taking the store's lock ([`LOCK_KEY`]) first when `locked`.
    fn begin(client: &'a mut Client, locked: bool) -> Result<Self, postgres::Error> {
        if locked {
            client.batch_execute(&format!("BEGIN; SELECT pg_advisory_xact_lock({LOCK_KEY})"))?;
        } else {
            client.batch_execute("BEGIN")?;
        }
        Ok(Self {
            client,
            done: false,
        })
    }

    fn commit(mut self) -> Result<(), postgres::Error> {
        self.done = true;
        self.client.batch_execute("COMMIT")
    }
}

impl std::ops::Deref for Open<'_> {
    type Target = Client;

    fn deref(&self) -> &Client {
        self.client
    }
}

impl std::ops::DerefMut for Open<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.client
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        if !self.done && !self.client.is_closed() {
            // A failed statement left the transaction aborted; the session goes on.
            let _ = self.client.batch_execute("ROLLBACK");
        }
    }
}

/// Every lease row of a batch in one statement: new ones inserted, the others' changing columns
/// (as `Op::UpdateLease` writes them) updated; a macro, so that [`WRITE_AND_BUMP`] holds it
/// too. Its parameters are `$1` to `$18` (the argument only names the first, for the reader).
macro_rules! upsert_leases {
    ($first:literal) => {
        "INSERT INTO leases (id, team, \"user\", project, workload, substrate, \
         gpu_model, gpu_count, gpu_uuids, labels, state, granted_at, expires_at, updated_at, \
         released_at, release_reason, admission_key, substrate_ref) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
         $6::text[], $7::text[], $8::int[], $9::text[], $10::text[], $11::text[], $12::bigint[], \
         $13::bigint[], $14::bigint[], $15::bigint[], $16::text[], $17::text[], $18::text[]) \
         ON CONFLICT (id) DO UPDATE SET gpu_count = excluded.gpu_count, \
         gpu_uuids = excluded.gpu_uuids, state = excluded.state, expires_at = excluded.expires_at, \
         updated_at = excluded.updated_at, released_at = excluded.released_at, \
         release_reason = excluded.release_reason, substrate_ref = excluded.substrate_ref"
    };
}
/// [`upsert_leases!`] alone.
const UPSERT_LEASES: &str = upsert_leases!("$1");

/// Writes `ops` in the transaction, adding what of memory they change to `keys`: the lease rows
/// (each lease's last row of the batch: one upsert for all, one delete for the holds gone) and
/// the outbox rows (one insert for all, in order) each in one statement, since every statement
/// is a round trip; the rest one by one, in order. With `bump`, the batch's last rows: the
/// upsert, the outbox rows, the store's new version, what it changed (`keys`) and the
/// notification of the other replicas go in one statement ([`WRITE_AND_BUMP`]).
fn write_rows<C: GenericClient>(
    tx: &mut C,
    statements: &mut Statements,
    ops: &[Op],
    keys: &mut BTreeSet<String>,
    bump: Option<i64>,
) -> Result<(), postgres::Error> {
    let mut leases: Vec<(&str, Option<&Lease>)> = Vec::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut outbox: (Vec<&str>, Vec<&str>, Vec<&str>, Vec<i64>) = Default::default();
    for op in ops {
        keys.extend(op.changed());
        let row = match op {
            Op::InsertLease(l) | Op::UpdateLease(l) => (l.id.as_str(), Some(&**l)),
            Op::DeleteLease(id) => (id.as_str(), None),
            Op::Outbox {
                topic,
                key,
                payload,
                created_at,
            } => {
                outbox.0.push(topic);
                outbox.1.push(key);
                outbox.2.push(payload);
                outbox.3.push(*created_at);
                continue;
            }
            other => {
                apply(tx, statements, other)?;
                continue;
            }
        };
        match last.get(row.0) {
            Some(&i) => leases[i] = row,
            None => {
                last.insert(row.0, leases.len());
                leases.push(row);
            }
        }
    }
    let gone: Vec<&str> = leases
        .iter()
        .filter(|(_, l)| l.is_none())
        .map(|(id, _)| *id)
        .collect();
    if !gone.is_empty() {
        let s = statements.get(tx, "DELETE FROM leases WHERE id = ANY($1)")?;
        tx.execute(&s, &[&gone])?;
    }
    let kept: Vec<&Lease> = leases.iter().filter_map(|(_, l)| *l).collect();
    let text = |f: fn(&Lease) -> String| kept.iter().map(|l| f(l)).collect::<Vec<_>>();
    let columns = (
        text(|l| l.id.clone()),
        text(|l| l.team.clone()),
        text(|l| l.user.clone()),
        text(|l| l.project.clone()),
        text(|l| l.workload.as_str().to_owned()),
        text(|l| l.substrate.clone()),
        text(|l| l.gpu_model.clone()),
        kept.iter().map(|l| l.gpu_count as i32).collect::<Vec<_>>(),
        text(|l| json(&l.gpu_uuids)),
        text(|l| json(&l.labels)),
        text(|l| l.state.as_str().to_owned()),
        kept.iter().map(|l| l.granted_at).collect::<Vec<_>>(),
        kept.iter().map(|l| l.expires_at).collect::<Vec<_>>(),
        kept.iter().map(|l| l.updated_at).collect::<Vec<_>>(),
        kept.iter().map(|l| l.released_at).collect::<Vec<_>>(),
        kept.iter()
            .map(|l| l.release_reason.map(ReleaseReason::as_str))
            .collect::<Vec<_>>(),
        kept.iter()
            .map(|l| l.admission_key.as_deref())
            .collect::<Vec<_>>(),
        kept.iter()
            .map(|l| l.substrate_ref.as_deref())
            .collect::<Vec<_>>(),
    );
    let lease_params: [&(dyn postgres::types::ToSql + Sync); 18] = [
        &columns.0,
        &columns.1,
        &columns.2,
        &columns.3,
        &columns.4,
        &columns.5,
        &columns.6,
        &columns.7,
        &columns.8,
        &columns.9,
        &columns.10,
        &columns.11,
        &columns.12,
        &columns.13,
        &columns.14,
        &columns.15,
        &columns.16,
        &columns.17,
    ];
    if let Some(version) = bump {
        let changed = json(&*keys);
        let mut params: Vec<&(dyn postgres::types::ToSql + Sync)> = lease_params.to_vec();
        params.extend([
            &outbox.0 as &(dyn postgres::types::ToSql + Sync),
            &outbox.1,
            &outbox.2,
            &outbox.3,
            &version,
            &changed,
            &CHANNEL,
        ]);
        let s = statements.get(tx, WRITE_AND_BUMP)?;
        tx.execute(&s, &params)?;
        return Ok(());
    }
    if !kept.is_empty() {
        let s = statements.get(tx, UPSERT_LEASES)?;
        tx.execute(&s, &lease_params)?;
    }
    if !outbox.0.is_empty() {
        let s = statements.get(tx, INSERT_OUTBOX)?;
        tx.execute(&s, &[&outbox.0, &outbox.1, &outbox.2, &outbox.3])?;
    }
    Ok(())
}

/// The outbox rows of a batch in one statement, in their order (ids follow it).
const INSERT_OUTBOX: &str = "INSERT INTO outbox (topic, key, payload, created_at) \
     SELECT topic, key, payload, created_at \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) \
     WITH ORDINALITY AS row (topic, key, payload, created_at, n) ORDER BY n";

/// The last rows of a batch that changed something, in one statement: [`UPSERT_LEASES`] (`$1` to
/// `$18`), [`INSERT_OUTBOX`] (`$19` to `$22`), the store's new version (`$23`), what the batch
/// changed (`$24`) and the notification on channel `$25`. Every data-modifying CTE runs whether
/// or not the query reads it; with no lease or outbox rows those insert nothing.
const WRITE_AND_BUMP: &str = concat!(
    "WITH leases_written AS (",
    upsert_leases!("$1"),
    "), outbox_written AS (INSERT INTO outbox (topic, key, payload, created_at) \
     SELECT topic, key, payload, created_at \
     FROM unnest($19::text[], $20::text[], $21::text[], $22::bigint[]) \
     WITH ORDINALITY AS row (topic, key, payload, created_at, n) ORDER BY n), \
     bumped AS (UPDATE store_version SET version = $23), \
     recorded AS (INSERT INTO store_changes (version, keys) VALUES ($23, $24)) \
     SELECT pg_notify($25, $23::text)"
);

/// A copy of `e` for each caller of a failed batch.
fn same(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Corrupt(m) => StoreError::Corrupt(m.clone()),
        StoreError::Fenced(m) => StoreError::Fenced(m.clone()),
        StoreError::TooNew { found, known } => StoreError::TooNew {
            found: *found,
            known: *known,
        },
        other => StoreError::Postgres(other.to_string()),
    }
}

/// Answers every job of a batch that could not run.
fn fail_all(batch: Vec<Job>, e: &StoreError) {
    for job in batch {
        match job {
            Job::Mutate(change, _) => change.fail(same(e)),
            Job::Read(query, _) => query.fail(same(e)),
            Job::Write { done, .. } => {
                let _ = done.send(Err(e.to_string()));
            }
            Job::CatchUp => {}
        }
    }
}

/// The listener thread: on every notification of another replica's commit, queues a catch-up
/// (one at a time), until `stop` is set. Reconnects after a failure, and catches up then, in
/// case a notification was missed.
pub(super) fn listen(target: &Target, queue: &Queue, stop: &AtomicBool, pending: &AtomicBool) {
    let mut backoff =
        gpuwarden_schema::retry::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    while !stop.load(Ordering::Acquire) {
        let mut client = match target.connect() {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "the lease store's listener cannot reach PostgreSQL");
                std::thread::sleep(backoff.next_pause());
                continue;
            }
        };
        if let Err(e) = client.batch_execute(&format!("LISTEN {CHANNEL}")) {
            tracing::debug!(error = %e, "the lease store's listener could not LISTEN");
            std::thread::sleep(backoff.next_pause());
            continue;
        }
        backoff.reset();
        wake(queue, pending);
        while !stop.load(Ordering::Acquire) && !client.is_closed() {
            let mut notifications = client.notifications();
            let heard = match notifications
                .timeout_iter(Duration::from_millis(250))
                .next()
            {
                Ok(Some(_)) => true,
                Ok(None) => false,
                Err(e) => {
                    tracing::debug!(error = %e, "the lease store's listener lost PostgreSQL");
                    break;
                }
            };
            // Every notification already here is answered by the one catch-up.
            while let Ok(Some(_)) = notifications.iter().next() {}
            if heard {
                wake(queue, pending);
            }
        }
    }
}

/// Queues a catch-up unless one is queued already. Nobody waits for it: it rides along with the
/// next batch (which catches up anyway), or runs within the queue's lazy-commit delay (20 ms)
/// when the writer is idle, so a busy replica does not spend a transaction on each of the
/// others' commits.
fn wake(queue: &Queue, pending: &AtomicBool) {
    if !pending.swap(true, Ordering::AcqRel) && queue.push(Job::CatchUp, false).is_err() {
        pending.store(false, Ordering::Release);
    }
}

/// Opens the store's database: connects, migrates, loads memory.
pub(super) fn open(target: &Target) -> Result<(Client, Memory), StoreError> {
    let mut client = target.connect()?;
    migrate(&mut client, target.shown())?;
    let memory = load(&mut client, target.shown())?;
    Ok((client, memory))
}

/// What the store keeps to stop its PostgreSQL threads.
pub(super) struct Threads {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) listener: Option<std::thread::JoinHandle<()>>,
    /// The leader elector, once [`Store::elect`](super::Store::elect) started it.
    pub(super) elector: Mutex<Option<std::thread::JoinHandle<()>>>,
}
