//! A look at a lease store's schema version without opening the store: no migration, no lock,
//! no memory loaded, nothing written. `gpuwarden doctor` asks it whether the store it is
//! configured with can be reached, and whether this build can open it as it is (an older schema
//! is migrated once when the enforcer starts; a newer one is refused, [`StoreError::TooNew`]).

use std::path::Path;
use std::time::Duration;

use gpuwarden_schema::config::StoreLocation;
use rusqlite::{Connection, OpenFlags, OptionalExtension};

use super::types::StoreError;

/// What [`schema`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaState {
    /// An SQLite file that does not exist yet: the enforcer creates it at its first start.
    Absent,
    /// A database without gpuwarden's tables (a new PostgreSQL database, an empty file): the
    /// enforcer makes them at its first start.
    Empty,
    /// A database at this schema version.
    At(i64),
}

/// The schema version this build's SQLite store migrates to.
pub fn sqlite_version() -> i64 {
    super::migrations::MIGRATIONS.len() as i64
}

/// The schema version this build's PostgreSQL store migrates to.
pub fn postgres_version() -> i64 {
    super::postgres::MIGRATIONS.len() as i64
}

/// The schema version this build migrates a store at `location` to.
pub fn known_version(location: &StoreLocation) -> i64 {
    match location {
        StoreLocation::Sqlite(_) => sqlite_version(),
        StoreLocation::Postgres { .. } => postgres_version(),
    }
}

/// The schema version of the store at `location`, read-only. PostgreSQL's connection waits at
/// most the URL's `connect_timeout` (3 s when it sets none); SQLite's read waits at most 2 s for
/// a writer's lock.
pub fn schema(location: &StoreLocation) -> Result<SchemaState, StoreError> {
    match location {
        StoreLocation::Sqlite(path) => sqlite_schema(path),
        StoreLocation::Postgres { url, password_file } => {
            postgres_schema(url, password_file.as_deref())
        }
    }
}

fn sqlite_schema(path: &Path) -> Result<SchemaState, StoreError> {
    if !path.exists() {
        return Ok(SchemaState::Absent);
    }
    // Read-only, and never created: a running enforcer's WAL is read as a reader would.
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::from_secs(2))?;
    let has_table: Option<String> = conn
        .query_row(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    if has_table.is_none() {
        return Ok(SchemaState::Empty);
    }
    let version: Option<i64> = conn
        .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
        .optional()?;
    Ok(version.map_or(SchemaState::Empty, SchemaState::At))
}

fn postgres_schema(url: &str, password_file: Option<&Path>) -> Result<SchemaState, StoreError> {
    let target = super::postgres::Target::new(url, password_file)?;
    let mut client = target.connect()?;
    let failed =
        |e: postgres::Error| StoreError::Postgres(format!("PostgreSQL at {}: {e}", target.shown()));
    let exists: bool = client
        .query_one("SELECT to_regclass('schema_version') IS NOT NULL", &[])
        .map_err(failed)?
        .get(0);
    if !exists {
        return Ok(SchemaState::Empty);
    }
    let row = client
        .query_opt("SELECT version FROM schema_version", &[])
        .map_err(failed)?;
    Ok(row.map_or(SchemaState::Empty, |r| SchemaState::At(r.get(0))))
}
