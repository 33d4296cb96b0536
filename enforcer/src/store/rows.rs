//! A [`Lease`] as a row of the `leases` table: its columns, the insert of a new one, and reading
//! one back.

use gpuwarden_schema::Workload;

use serde::Serialize;

use super::types::{Lease, LeaseState, StoreError};

/// Which leases are open, as SQL.
pub(super) const OPEN: &str = "state IN ('granted', 'active', 'releasing')";
/// A lease row's columns, in the order `row_to_raw` reads them; a macro, so that the SQL of the
/// insert every admission runs is built once, at compile time.
macro_rules! lease_columns {
    () => {
        "id, team, \"user\", project, workload, substrate, gpu_model, gpu_count, gpu_uuids, labels, \
         state, granted_at, expires_at, updated_at, released_at, release_reason, admission_key, substrate_ref"
    };
}
/// [`lease_columns!`], for queries built at run time.
pub(super) const COLUMNS: &str = lease_columns!();
/// Inserts a lease row: its columns as `?1` to `?18`, in [`COLUMNS`]' order.
pub(super) const INSERT_LEASE: &str = concat!(
    "INSERT INTO leases (",
    lease_columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)"
);

/// A lease's list or map column, as JSON.
pub(super) fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("string lists and maps serialize")
}

/// A lease row as SQLite gives it, before [`ParseRaw::parse`] checks it.
pub(super) type RawLease = (
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
    Option<String>,
    Option<String>,
);

/// Reads a row of [`COLUMNS`].
pub(super) fn row_to_raw(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawLease> {
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
        r.get(16)?,
        r.get(17)?,
    ))
}

/// Turns a row into a [`Lease`], refusing one this version cannot read.
pub(super) trait ParseRaw {
    fn parse(self) -> Result<Lease, StoreError>;
}

impl ParseRaw for RawLease {
    fn parse(self) -> Result<Lease, StoreError> {
        let ((id, team, user, project, workload, substrate, gpu_model, gpu_count), rest, key, held) =
            self;
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
            admission_key: key,
            substrate_ref: held,
        })
    }
}
