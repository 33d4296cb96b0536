//! The versions of what gpuwarden keeps between runs, and the one refusal every reader of them
//! gives for data written by a newer gpuwarden (docs/src/contributors/upgrades.md).
//!
//! Each persisted format carries its own version: the lease store's `schema_version` table
//! (the enforcer's migrations), the lake's `_gpuwarden.json` (its layout), a `version` field in
//! each small JSON state object (`rollups/_state.json`, the drivers' records), and the config's
//! optional top-level `version`. A reader takes its format's versions up to its own, migrating
//! an older one forward where the format changed, and refuses a newer one with [`TooNew`],
//! which names both versions and the gpuwarden that wrote the data where the data says. This
//! module has no I/O: each owner reads its own bytes and asks [`check_json`] or [`check`].

use serde::Deserialize;

/// This build's version, as `gpuwarden --version` prints it (the workspace's version).
pub const GPUWARDEN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Data in a format newer than this build reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} has {format} version {found}{}; this gpuwarden ({GPUWARDEN_VERSION}) reads up to \
     {format} version {known}: upgrade gpuwarden",
    written_by.as_ref().map(|v| format!(", written by gpuwarden {v}")).unwrap_or_default()
)]
pub struct TooNew {
    /// The data, for a person: "the lake at /srv/lake", "rollups/_state.json in s3://b/lake".
    pub what: String,
    /// Which version it is: "layout", "state", "config".
    pub format: &'static str,
    /// The version the data has.
    pub found: u64,
    /// The latest version this build reads.
    pub known: u64,
    /// The gpuwarden that wrote the data, where the data says.
    pub written_by: Option<String>,
}

/// Refuses `found` when it is past `known`.
pub fn check(
    what: impl FnOnce() -> String,
    format: &'static str,
    found: u64,
    known: u64,
    written_by: Option<String>,
) -> Result<(), TooNew> {
    if found <= known {
        return Ok(());
    }
    Err(TooNew {
        what: what(),
        format,
        found,
        known,
        written_by,
    })
}

/// The version fields of a versioned JSON object, read before the rest of it: a newer format
/// may not decode as this build's type at all, and its reader should hear "upgrade", not
/// "unreadable".
#[derive(Debug, Default, Deserialize)]
struct Header {
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    written_by: Option<String>,
}

/// Checks the `version` (and `written_by`) fields of the JSON object `bytes` against `known`.
/// An object without `version` is version 1, as every such file was written before its format
/// carried one. Bytes that are not such an object pass: the caller's own decoding says what is
/// wrong with them.
pub fn check_json(
    bytes: &[u8],
    what: impl FnOnce() -> String,
    format: &'static str,
    known: u64,
) -> Result<(), TooNew> {
    let header: Header = serde_json::from_slice(bytes).unwrap_or_default();
    check(
        what,
        format,
        header.version.unwrap_or(1),
        known,
        header.written_by,
    )
}

/// Version 1, for `#[serde(default = "…")]` on a `version` field that older files lack.
pub fn one() -> u64 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_version_is_refused_naming_both_and_the_writer() {
        let err = check_json(
            br#"{"version": 3, "written_by": "0.3.0", "hours": "a shape this build lacks"}"#,
            || "rollups/_state.json in /srv/lake".into(),
            "state",
            1,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "rollups/_state.json in /srv/lake has state version 3, written by gpuwarden \
                 0.3.0; this gpuwarden ({GPUWARDEN_VERSION}) reads up to state version 1: \
                 upgrade gpuwarden"
            )
        );
        let unsigned = check(|| "the config x.toml".into(), "config", 2, 1, None).unwrap_err();
        assert_eq!(
            unsigned.to_string(),
            format!(
                "the config x.toml has config version 2; this gpuwarden ({GPUWARDEN_VERSION}) \
                 reads up to config version 1: upgrade gpuwarden"
            )
        );
    }

    #[test]
    fn absent_or_older_versions_and_other_bytes_pass() {
        let what = || unreachable!("no refusal");
        assert_eq!(check_json(br#"{"hours": {}}"#, what, "state", 1), Ok(()));
        assert_eq!(check_json(br#"{"version": 1}"#, what, "state", 2), Ok(()));
        assert_eq!(check_json(br#"{"version": 2}"#, what, "state", 2), Ok(()));
        assert_eq!(check_json(b"[1, 2]", what, "state", 1), Ok(()));
        assert_eq!(check_json(b"not json", what, "state", 1), Ok(()));
        assert!(check_json(br#"{"version": 2}"#, || "x".into(), "state", 1).is_err());
    }
}
