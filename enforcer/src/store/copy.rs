//! Copies a lease store from one database to another, whole and exactly: how an installation
//! moves from its SQLite file to PostgreSQL (and back). `gpuwarden store copy` is its front door.
//!
//! It opens a [`Store`] on each side first, which brings that database's schema up to date (each
//! database keeps its own numbering) and, on an SQLite file, takes the file's owner lock: an
//! enforcer still running on the source makes the copy fail with [`StoreError::InUse`], and the
//! stores stay open until the copy is over, so no enforcer starts on either file meanwhile. The
//! rows themselves go through connections of the copy's own, beside those stores: read in one
//! snapshot of the source (on PostgreSQL under the store's lock, so no replica writes
//! meanwhile), a batch at a time in each table's key order, and written in one transaction on the
//! target, which has all of them or none. A target holding any row is refused, unchanged.
//!
//! Every table is copied as it is, ids and times included: leases in every state (holds and
//! leases named by their substrate among them), the outbox (the audit trail, published or not),
//! blocked teams, spend, exemptions, rule marks and utilization signal times. On a PostgreSQL
//! target the outbox's identity is moved past the largest id copied, so new rows come after the
//! copied ones (SQLite's rowids do so by themselves), and `store_version` is bumped with no
//! `store_changes` row, so a replica that already had memory loaded reloads it whole.

use std::path::Path;
use std::time::Duration;

use gpuwarden_schema::config::StoreLocation;
use postgres::binary_copy::BinaryCopyInWriter;
use postgres::types::{ToSql, Type};
use postgres::IsolationLevel;

use super::postgres::{Target, LOCK_KEY};
use super::{Store, StoreError};

/// Rows read and written at a time: the copy's memory holds one batch, whatever the outbox's size.
const BATCH: usize = 10_000;
/// Longest wait for the store's lock on PostgreSQL: a replica still running holds it for a
/// batch at a time, and should have been stopped.
const LOCK_WAIT: Duration = Duration::from_secs(30);

/// What [`copy`] copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyReport {
    /// The source: its SQLite file, or its PostgreSQL URL without the password.
    pub from: String,
    /// The target, shown the same way.
    pub to: String,
    /// Rows copied, per table, in the order they were copied (every table of the store).
    pub rows: Vec<(&'static str, u64)>,
}

impl CopyReport {
    /// The rows copied of `table` (0 for a table the store does not have).
    pub fn rows_of(&self, table: &str) -> u64 {
        self.rows
            .iter()
            .find(|(t, _)| *t == table)
            .map_or(0, |(_, n)| *n)
    }

    /// Rows copied, all tables together.
    pub fn total(&self) -> u64 {
        self.rows.iter().map(|(_, n)| n).sum()
    }
}

/// Why a copy did not happen. No row reached the target in any case (opening it may have brought
/// its schema up to date, or made a new SQLite file of it).
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The source store could not be opened or read.
    #[error("the source store {location}: {step}: {error}")]
    Source {
        /// The source, without its password.
        location: String,
        /// What the copy was doing.
        step: String,
        /// What failed.
        #[source]
        error: StoreError,
    },
    /// The target store could not be opened or written.
    #[error("the target store {location}: {step}: {error}")]
    Target {
        /// The target, without its password.
        location: String,
        /// What the copy was doing.
        step: String,
        /// What failed.
        #[source]
        error: StoreError,
    },
    /// The target already holds rows: a copy goes only into an empty store.
    #[error(
        "the target store {location} is not empty ({}); copy into a new database or file",
        tables.iter().map(|(t, n)| format!("table {t} holds {n} rows")).collect::<Vec<_>>().join(", ")
    )]
    NotEmpty {
        /// The target, without its password.
        location: String,
        /// Each table that holds rows, and how many.
        tables: Vec<(&'static str, u64)>,
    },
    /// The source and the target are the same store.
    #[error("the source and the target are the same store ({0})")]
    Same(String),
}

/// Copies every row of the store at `from` into the empty store at `to` (see the module's
/// documentation), calling `progress` with a table's name and the rows of it copied so far
/// after each batch (once with 0 for an empty table).
pub fn copy(
    from: &StoreLocation,
    to: &StoreLocation,
    mut progress: impl FnMut(&str, u64),
) -> Result<CopyReport, CopyError> {
    if same(from, to) {
        return Err(CopyError::Same(shown(from)));
    }
    let mut source = Side::open(Role::Source, from)?;
    let mut target = Side::open(Role::Target, to)?;
    let (from_who, to_who) = (&source.who, &target.who);

    let mut writer = target.conn.writer().map_err(|e| {
        to_who.fail(
            "starting a transaction under the store's lock (is an enforcer running on it?)",
            e,
        )
    })?;
    let mut held = Vec::new();
    for table in TABLES {
        let n = writer
            .count(table)
            .map_err(|e| to_who.fail(format!("counting the rows of table {}", table.name), e))?;
        if n > 0 {
            held.push((table.name, n));
        }
    }
    if !held.is_empty() {
        return Err(CopyError::NotEmpty {
            location: to_who.location.clone(),
            tables: held,
        });
    }

    let mut reader = source.conn.reader().map_err(|e| {
        from_who.fail(
            "taking the store's lock and a snapshot (is an enforcer running on it?)",
            e,
        )
    })?;
    let mut rows = Vec::with_capacity(TABLES.len());
    for table in TABLES {
        let mut copied = 0;
        let mut after = None;
        loop {
            let batch = reader
                .batch(table, after.as_ref())
                .map_err(|e| from_who.fail(format!("reading table {}", table.name), e))?;
            if batch.is_empty() {
                break;
            }
            writer
                .write(table, &batch)
                .map_err(|e| to_who.fail(format!("writing table {}", table.name), e))?;
            copied += batch.len() as u64;
            progress(table.name, copied);
            if batch.len() < BATCH {
                break;
            }
            // Every table's key is its first column.
            after = batch.last().map(|row| row[0].clone());
        }
        if copied == 0 {
            progress(table.name, 0);
        }
        rows.push((table.name, copied));
    }
    writer
        .commit()
        .map_err(|e| to_who.fail("committing the copy", e))?;
    // The source's snapshot and lock are let go only now, with the copy in place.
    drop(reader);
    Ok(CopyReport {
        from: from_who.location.clone(),
        to: to_who.location.clone(),
        rows,
    })
}

/// Whether `a` and `b` name the same store: the same SQLite file, or the same PostgreSQL URL.
fn same(a: &StoreLocation, b: &StoreLocation) -> bool {
    match (a, b) {
        (StoreLocation::Sqlite(a), StoreLocation::Sqlite(b)) => canonical(a) == canonical(b),
        (StoreLocation::Postgres { url: a, .. }, StoreLocation::Postgres { url: b, .. }) => a == b,
        _ => false,
    }
}

/// `path` made absolute with its links resolved, as far as it exists.
fn canonical(path: &Path) -> std::path::PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            dir.canonicalize()
                .map_or_else(|_| path.to_owned(), |d| d.join(name))
        }
        _ => path.to_owned(),
    }
}

/// `location` for messages: the file, or the URL without its password.
fn shown(location: &StoreLocation) -> String {
    match location {
        StoreLocation::Sqlite(path) => path.display().to_string(),
        StoreLocation::Postgres { url, .. } => Target::new(url, None)
            .map(|t| t.shown().to_owned())
            .unwrap_or_else(|_| "in PostgreSQL (an invalid URL)".into()),
    }
}

/// Which side of the copy.
#[derive(Debug, Clone, Copy)]
enum Role {
    Source,
    Target,
}

/// A side of the copy, for its errors.
struct Who {
    role: Role,
    location: String,
}

impl Who {
    fn fail(&self, step: impl Into<String>, error: StoreError) -> CopyError {
        let (location, step) = (self.location.clone(), step.into());
        match self.role {
            Role::Source => CopyError::Source {
                location,
                step,
                error,
            },
            Role::Target => CopyError::Target {
                location,
                step,
                error,
            },
        }
    }
}

/// One side of the copy: the store opened on it, and the copy's own connection.
struct Side {
    who: Who,
    /// An SQLite file's store, open (and its owner lock held) until the copy is over. A
    /// PostgreSQL store is closed once it has migrated the schema: the store's lock, taken by the
    /// copy's own transactions, is what keeps its replicas out.
    _store: Option<Store>,
    conn: Conn,
}

impl Side {
    fn open(role: Role, location: &StoreLocation) -> Result<Self, CopyError> {
        let mut who = Who {
            role,
            location: shown(location),
        };
        if let (Role::Source, StoreLocation::Sqlite(path)) = (role, location) {
            // Opening would create it: an empty source is a mistyped path.
            if !path.exists() {
                return Err(who.fail(
                    "opening it",
                    StoreError::Io(format!("there is no file {}", path.display())),
                ));
            }
        }
        let store = Store::open_at(location).map_err(|e| who.fail("opening it", e))?;
        who.location = store.location().to_owned();
        let (store, conn) = match location {
            StoreLocation::Sqlite(path) => {
                let conn = sqlite(path).map_err(|e| who.fail("connecting", e))?;
                (Some(store), Conn::Sqlite(conn))
            }
            StoreLocation::Postgres { url, password_file } => {
                drop(store);
                let client = Target::new(url, password_file.as_deref())
                    .and_then(|t| {
                        let mut client = t.connect()?;
                        // The store's own limits are for short transactions; a copy's may be
                        // long, and sit idle while the other side works.
                        client
                            .batch_execute(&format!(
                                "SET idle_in_transaction_session_timeout = 0; \
                                 SET statement_timeout = 0; SET lock_timeout = {}",
                                LOCK_WAIT.as_millis()
                            ))
                            .map_err(pg)?;
                        Ok(client)
                    })
                    .map_err(|e| who.fail("connecting", e))?;
                (None, Conn::Postgres(client))
            }
        };
        Ok(Self {
            who,
            _store: store,
            conn,
        })
    }
}

/// A connection to the SQLite file at `path`, beside its store's (WAL lets both be open).
fn sqlite(path: &Path) -> Result<rusqlite::Connection, StoreError> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    // The copy is on disk once it has committed.
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

/// A PostgreSQL failure: [`StoreError::Postgres`] when the database refused a statement, else
/// [`StoreError::Unavailable`].
fn pg(e: postgres::Error) -> StoreError {
    if e.as_db_error().is_some() && !e.is_closed() {
        StoreError::Postgres(e.to_string())
    } else {
        StoreError::Unavailable(e.to_string())
    }
}

/// The copy's own connection to one side.
enum Conn {
    Sqlite(rusqlite::Connection),
    Postgres(postgres::Client),
}

impl Conn {
    /// Starts reading the source in one snapshot. On PostgreSQL the store's lock is taken first,
    /// for the session (a transaction's snapshot is taken by its first statement, which would
    /// miss what a replica commits while the copy waits for the lock), and let go when the
    /// connection closes.
    fn reader(&mut self) -> Result<Box<dyn Reader + '_>, StoreError> {
        Ok(match self {
            Self::Sqlite(conn) => Box::new(SqliteSide(conn.transaction()?)),
            Self::Postgres(client) => {
                client
                    .execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY])
                    .map_err(pg)?;
                let tx = client
                    .build_transaction()
                    .isolation_level(IsolationLevel::RepeatableRead)
                    .read_only(true)
                    .start()
                    .map_err(pg)?;
                Box::new(PgSide(tx))
            }
        })
    }

    /// Starts the target's one transaction, under the store's lock (SQLite's write lock, or the
    /// advisory lock every PostgreSQL replica writes under).
    fn writer(&mut self) -> Result<Box<dyn Writer + '_>, StoreError> {
        Ok(match self {
            Self::Sqlite(conn) => Box::new(SqliteSide(
                conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?,
            )),
            Self::Postgres(client) => {
                let mut tx = client.transaction().map_err(pg)?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
                    .map_err(pg)?;
                Box::new(PgSide(tx))
            }
        })
    }
}

/// The type of a column, as both databases hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// TEXT.
    Text,
    /// INTEGER on both (32 bits on PostgreSQL).
    Int4,
    /// INTEGER on SQLite, BIGINT on PostgreSQL.
    Int8,
    /// REAL on SQLite, DOUBLE PRECISION on PostgreSQL.
    Float8,
}

impl Kind {
    fn pg_type(self) -> Type {
        match self {
            Self::Text => Type::TEXT,
            Self::Int4 => Type::INT4,
            Self::Int8 => Type::INT8,
            Self::Float8 => Type::FLOAT8,
        }
    }
}

/// A table of the store: its name, and its columns, the first of which is its key.
struct Table {
    name: &'static str,
    columns: &'static [(&'static str, Kind)],
}

impl Table {
    fn key(&self) -> &'static str {
        self.columns[0].0
    }

    fn column_list(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|(c, _)| *c).collect();
        names.join(", ")
    }

    /// The query of a batch: `placeholder(1)` is the key to start after when `after`, and the
    /// batch's size is the next one.
    fn select(&self, after: bool, placeholder: fn(usize) -> String) -> String {
        let (key, columns) = (self.key(), self.column_list());
        let (filter, limit) = if after {
            (format!(" WHERE {key} > {}", placeholder(1)), placeholder(2))
        } else {
            (String::new(), placeholder(1))
        };
        format!(
            "SELECT {columns} FROM {} {filter} ORDER BY {key} LIMIT {limit}",
            self.name
        )
    }
}

use super::postgres::CHANNEL;
use Kind::{Float8, Int4, Int8, Text};

/// Every table of the store but each database's bookkeeping (`schema_version`, and PostgreSQL's
/// record of its replicas' commits), with every column, as the migrations of both databases leave
/// them. A migration that adds a table or a column adds it here (the unit test below checks
/// SQLite's).
const TABLES: &[Table] = &[
    Table {
        name: "leases",
        columns: &[
            ("id", Text),
            ("team", Text),
            ("\"user\"", Text),
            ("project", Text),
            ("workload", Text),
            ("substrate", Text),
            ("gpu_model", Text),
            ("gpu_count", Int4),
            ("gpu_uuids", Text),
            ("labels", Text),
            ("state", Text),
            ("granted_at", Int8),
            ("expires_at", Int8),
            ("updated_at", Int8),
            ("released_at", Int8),
            ("release_reason", Text),
            ("admission_key", Text),
            ("substrate_ref", Text),
        ],
    },
    Table {
        name: "outbox",
        columns: &[
            ("id", Int8),
            ("topic", Text),
            ("key", Text),
            ("payload", Text),
            ("created_at", Int8),
            ("published_at", Int8),
        ],
    },
    Table {
        name: "blocked_teams",
        columns: &[("team", Text), ("reason", Text), ("blocked_at", Int8)],
    },
    Table {
        name: "team_spend",
        columns: &[
            ("team", Text),
            ("month_to_date_usd", Float8),
            ("burn_usd_per_hour", Float8),
            ("ts_ms", Int8),
        ],
    },
    Table {
        name: "exemptions",
        columns: &[
            ("lease_id", Text),
            ("until_ms", Int8),
            ("granted_by", Text),
            ("reason", Text),
            ("at", Int8),
        ],
    },
    Table {
        name: "rule_marks",
        columns: &[("key", Text), ("at", Int8)],
    },
    Table {
        name: "lease_signals",
        columns: &[("lease_id", Text), ("ts_ms", Int8)],
    },
];

/// A value of a column, whichever database it came from.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Text(Option<String>),
    Int(Option<i64>),
    Real(Option<f64>),
}

type Row = Vec<Value>;

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        match self {
            Self::Text(v) => rusqlite::ToSql::to_sql(v),
            Self::Int(v) => rusqlite::ToSql::to_sql(v),
            Self::Real(v) => rusqlite::ToSql::to_sql(v),
        }
    }
}

/// A [`Value`] as PostgreSQL takes it for a column of its [`Kind`].
#[derive(Debug)]
enum PgValue<'a> {
    Text(Option<&'a str>),
    Int4(Option<i32>),
    Int8(Option<i64>),
    Float8(Option<f64>),
}

impl<'a> PgValue<'a> {
    fn of(value: &'a Value, kind: Kind, table: &str, column: &str) -> Result<Self, StoreError> {
        let bad = |what: String| StoreError::Corrupt(format!("{table}.{column}: {what}"));
        Ok(match (value, kind) {
            (Value::Text(v), Kind::Text) => Self::Text(v.as_deref()),
            (Value::Int(v), Kind::Int8) => Self::Int8(*v),
            (Value::Int(v), Kind::Int4) => Self::Int4(
                v.map(i32::try_from)
                    .transpose()
                    .map_err(|_| bad(format!("{v:?} does not fit PostgreSQL's INTEGER")))?,
            ),
            (Value::Real(v), Kind::Float8) => Self::Float8(*v),
            (v, k) => return Err(bad(format!("{v:?} is not of type {k:?}"))),
        })
    }

    fn sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Self::Text(v) => v,
            Self::Int4(v) => v,
            Self::Int8(v) => v,
            Self::Float8(v) => v,
        }
    }
}

/// The source, read in one snapshot.
trait Reader {
    /// Up to [`BATCH`] rows of `table` whose key comes after `after` (from the first when
    /// `None`), in key order.
    fn batch(&mut self, table: &Table, after: Option<&Value>) -> Result<Vec<Row>, StoreError>;
}

/// The target's one transaction.
trait Writer {
    /// How many rows `table` holds.
    fn count(&mut self, table: &Table) -> Result<u64, StoreError>;
    /// Inserts `rows` into `table` as they are.
    fn write(&mut self, table: &Table, rows: &[Row]) -> Result<(), StoreError>;
    /// Commits everything written.
    fn commit(self: Box<Self>) -> Result<(), StoreError>;
}

/// A transaction on an SQLite file.
struct SqliteSide<'c>(rusqlite::Transaction<'c>);

impl Reader for SqliteSide<'_> {
    fn batch(&mut self, table: &Table, after: Option<&Value>) -> Result<Vec<Row>, StoreError> {
        let mut stmt = self
            .0
            .prepare_cached(&table.select(after.is_some(), |i| format!("?{i}")))?;
        let limit = BATCH as i64;
        let mut rows = match after {
            Some(key) => stmt.query(rusqlite::params![key, limit])?,
            None => stmt.query(rusqlite::params![limit])?,
        };
        let mut out = Vec::with_capacity(BATCH);
        while let Some(row) = rows.next()? {
            let mut values = Vec::with_capacity(table.columns.len());
            for (i, (_, kind)) in table.columns.iter().enumerate() {
                values.push(match kind {
                    Kind::Text => Value::Text(row.get(i)?),
                    Kind::Int4 | Kind::Int8 => Value::Int(row.get(i)?),
                    Kind::Float8 => Value::Real(row.get(i)?),
                });
            }
            out.push(values);
        }
        Ok(out)
    }
}

impl Writer for SqliteSide<'_> {
    fn count(&mut self, table: &Table) -> Result<u64, StoreError> {
        let sql = format!("SELECT count(*) FROM {}", table.name);
        let n: i64 = self.0.query_row(&sql, [], |r| r.get(0))?;
        Ok(n as u64)
    }

    fn write(&mut self, table: &Table, rows: &[Row]) -> Result<(), StoreError> {
        let placeholders: Vec<String> =
            (1..=table.columns.len()).map(|i| format!("?{i}")).collect();
        let mut stmt = self.0.prepare_cached(&format!(
            "INSERT INTO {} ({}) VALUES ({})",
            table.name,
            table.column_list(),
            placeholders.join(", ")
        ))?;
        for row in rows {
            stmt.execute(rusqlite::params_from_iter(row))?;
        }
        Ok(())
    }

    fn commit(self: Box<Self>) -> Result<(), StoreError> {
        Ok(self.0.commit()?)
    }
}

/// A transaction on PostgreSQL.
struct PgSide<'c>(postgres::Transaction<'c>);

impl Reader for PgSide<'_> {
    fn batch(&mut self, table: &Table, after: Option<&Value>) -> Result<Vec<Row>, StoreError> {
        let sql = table.select(after.is_some(), |i| format!("${i}"));
        let limit = BATCH as i64;
        let rows = match after {
            Some(key) => {
                let key = PgValue::of(key, table.columns[0].1, table.name, table.key())?;
                self.0.query(&sql, &[key.sql(), &limit])
            }
            None => self.0.query(&sql, &[&limit]),
        }
        .map_err(pg)?;
        rows.iter()
            .map(|row| {
                table
                    .columns
                    .iter()
                    .enumerate()
                    .map(|(i, (_, kind))| {
                        Ok(match kind {
                            Kind::Text => Value::Text(row.try_get(i)?),
                            Kind::Int4 => {
                                Value::Int(row.try_get::<_, Option<i32>>(i)?.map(i64::from))
                            }
                            Kind::Int8 => Value::Int(row.try_get(i)?),
                            Kind::Float8 => Value::Real(row.try_get(i)?),
                        })
                    })
                    .collect::<Result<Row, postgres::Error>>()
                    .map_err(pg)
            })
            .collect()
    }
}

impl Writer for PgSide<'_> {
    fn count(&mut self, table: &Table) -> Result<u64, StoreError> {
        let sql = format!("SELECT count(*) FROM {}", table.name);
        let n: i64 = self.0.query_one(&sql, &[]).map_err(pg)?.get(0);
        Ok(n as u64)
    }

    fn write(&mut self, table: &Table, rows: &[Row]) -> Result<(), StoreError> {
        // COPY, which takes the outbox's ids as they are (an INSERT would need OVERRIDING
        // SYSTEM VALUE), and a batch in one round trip.
        let sink = self
            .0
            .copy_in(&format!(
                "COPY {} ({}) FROM STDIN (FORMAT binary)",
                table.name,
                table.column_list()
            ))
            .map_err(pg)?;
        let types: Vec<Type> = table.columns.iter().map(|(_, k)| k.pg_type()).collect();
        let mut sink = BinaryCopyInWriter::new(sink, &types);
        for row in rows {
            let values = row
                .iter()
                .zip(table.columns)
                .map(|(v, (column, kind))| PgValue::of(v, *kind, table.name, column))
                .collect::<Result<Vec<_>, _>>()?;
            let values: Vec<&(dyn ToSql + Sync)> = values.iter().map(PgValue::sql).collect();
            sink.write(&values).map_err(pg)?;
        }
        sink.finish().map_err(pg)?;
        Ok(())
    }

    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        let tx = &mut self.0;
        // New rows come after the copied ones.
        tx.execute(
            "SELECT setval(pg_get_serial_sequence('outbox', 'id'), max(id)) FROM outbox \
             HAVING max(id) IS NOT NULL",
            &[],
        )
        .map_err(pg)?;
        // A version no `store_changes` row explains: a replica with memory loaded reloads it.
        let version: i64 = tx
            .query_one(
                "UPDATE store_version SET version = version + 1 RETURNING version",
                &[],
            )
            .map_err(pg)?
            .get(0);
        tx.execute(
            "SELECT pg_notify($1, $2)",
            &[&CHANNEL, &version.to_string()],
        )
        .map_err(pg)?;
        self.0.commit().map_err(pg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables and columns copied are every one SQLite's migrations make, in their order.
    #[test]
    fn every_table_and_column_of_the_schema_is_copied() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        super::super::migrations::migrate(&mut conn).unwrap();
        let mut stmt = conn
            .prepare(
                "SELECT name FROM sqlite_master WHERE type = 'table' \
                 AND name NOT IN ('schema_version', 'sqlite_sequence') ORDER BY name",
            )
            .unwrap();
        let schema: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let mut copied: Vec<&str> = TABLES.iter().map(|t| t.name).collect();
        copied.sort_unstable();
        assert_eq!(schema, copied);
        for table in TABLES {
            let mut stmt = conn
                .prepare(&format!(
                    "SELECT name, type, pk FROM pragma_table_info('{}') ORDER BY cid",
                    table.name
                ))
                .unwrap();
            let columns: Vec<(String, String, i64)> = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            let expected: Vec<(String, String, i64)> = table
                .columns
                .iter()
                .enumerate()
                .map(|(i, (name, kind))| {
                    let sqlite_type = match kind {
                        Kind::Text => "TEXT",
                        Kind::Int4 | Kind::Int8 => "INTEGER",
                        Kind::Float8 => "REAL",
                    };
                    (
                        name.trim_matches('"').to_owned(),
                        sqlite_type.to_owned(),
                        i64::from(i == 0),
                    )
                })
                .collect();
            assert_eq!(columns, expected, "table {}", table.name);
        }
    }
}
