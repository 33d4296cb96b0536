//! A lease store's database for a test, on either of the store's databases: a new SQLite file in
//! a temp dir, or a new database on the test run's PostgreSQL server ([`super::pg`]). Each test
//! file adds what it looks at in the rows (`impl Db` in the file itself).

use std::path::PathBuf;

use gpuwarden_enforcer::store::Store;
use gpuwarden_schema::config::StoreLocation;

/// A store's database.
pub enum Db {
    /// An SQLite file, removed with its temp dir.
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
    /// A database of the test run's PostgreSQL server.
    Postgres { url: String },
}

impl Db {
    /// A new SQLite file.
    pub fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("enforcer.db");
        Self::Sqlite { _dir: dir, path }
    }

    /// A new PostgreSQL database.
    pub fn postgres() -> Self {
        Self::Postgres {
            url: super::pg::server().database(),
        }
    }

    pub fn is_sqlite(&self) -> bool {
        matches!(self, Self::Sqlite { .. })
    }

    /// Opens a store on the database (again).
    pub fn open(&self) -> Store {
        match self {
            Self::Sqlite { path, .. } => Store::open(path).unwrap(),
            Self::Postgres { url } => Store::open_postgres(url, None).unwrap(),
        }
    }

    /// Where the store is, as `[enforcer.store] url` names it.
    pub fn location(&self) -> StoreLocation {
        match self {
            Self::Sqlite { path, .. } => StoreLocation::Sqlite(path.clone()),
            Self::Postgres { url } => StoreLocation::Postgres {
                url: url.clone(),
                password_file: None,
            },
        }
    }
}
