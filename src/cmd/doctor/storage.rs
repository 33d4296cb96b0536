//! The lake and the lease store: the lake takes a write where the pipeline writes, and the store
//! answers with a schema version this build can open.

use std::path::{Path, PathBuf};

use gpuwarden_enforcer::store::probe::{self, SchemaState};
use gpuwarden_pipeline::lake::{Lake, Role, StateVersion};
use gpuwarden_pipeline::objects::ObjectLake;
use gpuwarden_schema::config::{Config, LakeLocation, StoreLocation};

use super::{without_password, Line};

/// The lake's line: a probe object written where the rollups write their state, read back and
/// deleted. A directory that does not exist yet is not made (run as root, doctor would leave it
/// root's): the nearest directory above it must take a file instead.
pub(super) fn lake(config: &Config) -> Line {
    let location = match config.lake() {
        Ok(location) => location,
        Err(e) => return Line::fail("lake", format!("storage.lake: {e}"), "correct storage.lake"),
    };
    let probe = PathBuf::from(format!(
        "_doctor-{}-{}.json",
        host_name(),
        std::process::id()
    ));
    match location {
        LakeLocation::Directory(dir) => directory_lake(&dir, &probe),
        LakeLocation::S3 { bucket, prefix } => {
            let shown = LakeLocation::S3 {
                bucket: bucket.clone(),
                prefix: prefix.clone(),
            }
            .to_string();
            let staging = config.storage.data_dir.join("lake-staging");
            if let Err((text, fix)) = creatable(&staging, "storage.data_dir") {
                return Line::fail(
                    "lake",
                    format!("{shown}: its staging directory {text}"),
                    fix,
                );
            }
            let fix = "check storage.lake's bucket, [storage.s3] (endpoint, region, credentials) \
                       and that the credentials may put, get and delete objects under the prefix";
            let objects = match ObjectLake::s3(&bucket, &prefix, &config.storage.s3) {
                Ok(objects) => objects,
                Err(e) => return Line::fail("lake", e.to_string(), fix),
            };
            let body = probe_body();
            let written = objects
                .put(&probe, body.clone())
                .and_then(|()| objects.get(&probe))
                .and_then(|read| {
                    objects.delete(&probe)?;
                    Ok(read)
                });
            match written {
                Ok(Some(read)) if read.as_ref() == body.as_slice() => Line::ok(
                    "lake",
                    format!("{shown} took an object, gave it back and deleted it"),
                ),
                Ok(_) => Line::fail(
                    "lake",
                    format!("{shown}: an object written there did not read back the same"),
                    "check that the store at [storage.s3] endpoint is S3-compatible and consistent",
                ),
                Err(e) => Line::fail("lake", e.to_string(), fix),
            }
        }
    }
}

fn probe_body() -> Vec<u8> {
    format!(
        "{{\"written_by\":\"gpuwarden doctor\",\"at_ms\":{}}}",
        gpuwarden_schema::clock::wall_now_ms()
    )
    .into_bytes()
}

fn directory_lake(dir: &Path, probe: &Path) -> Line {
    let fix = format!(
        "let the account the pipeline runs as write {} (or set storage.lake to a directory it may write)",
        dir.display()
    );
    if !dir.exists() {
        return match creatable(dir, "storage.lake") {
            Ok(parent) => Line::ok(
                "lake",
                format!(
                    "{} does not exist yet; the pipeline makes it at its start ({} takes files)",
                    dir.display(),
                    parent.display()
                ),
            ),
            Err((text, fix)) => Line::fail("lake", format!("{} {text}", dir.display()), fix),
        };
    }
    if !dir.is_dir() {
        return Line::fail(
            "lake",
            format!("{} is not a directory", dir.display()),
            "set storage.lake to a directory",
        );
    }
    let lake = match Lake::open(dir) {
        Ok(lake) => lake,
        Err(e) => return Line::fail("lake", e.to_string(), fix),
    };
    let body = probe_body();
    let written = lake
        .write_state(
            probe,
            body.clone(),
            &mut StateVersion::default(),
            Role::Rollups,
        )
        .and_then(|()| lake.read_state(probe));
    let removed = std::fs::remove_file(dir.join(probe));
    match (written, removed) {
        (Ok(Some((read, _))), Ok(())) if read == body => Line::ok(
            "lake",
            format!(
                "{} took a file, gave it back and let it be deleted",
                dir.display()
            ),
        ),
        (Ok(_), Ok(())) => Line::fail(
            "lake",
            format!(
                "{}: a file written there did not read back the same",
                dir.display()
            ),
            "check the file system the lake is on",
        ),
        (Err(e), _) => Line::fail("lake", e.to_string(), fix),
        (Ok(_), Err(e)) => Line::fail(
            "lake",
            format!("{}: cannot delete {}: {e}", dir.display(), probe.display()),
            fix,
        ),
    }
}

/// Whether `path`, which does not exist, can be made: the nearest directory above it that
/// exists takes a file (made and removed). That directory, or what stands in the way and what
/// to do about `setting`, which names the path.
fn creatable(path: &Path, setting: &str) -> Result<PathBuf, (String, String)> {
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut above = absolute.as_path();
    loop {
        if above.exists() {
            break;
        }
        match above.parent() {
            Some(parent) => above = parent,
            None => {
                return Err((
                    "has no existing directory above it".into(),
                    format!("give {setting} an absolute path"),
                ))
            }
        }
    }
    if !above.is_dir() {
        return Err((
            format!(
                "cannot be made: {} is a file, not a directory",
                above.display()
            ),
            format!(
                "set {setting} to a directory, or move {} out of the way",
                above.display()
            ),
        ));
    }
    let trial = above.join(format!(".gpuwarden-doctor-{}", std::process::id()));
    match std::fs::File::create(&trial) {
        Ok(_) => {
            let _ = std::fs::remove_file(&trial);
            Ok(above.to_path_buf())
        }
        Err(e) => Err((
            format!("cannot be made: {} takes no file: {e}", above.display()),
            format!(
                "let the account gpuwarden runs as write {}, or make the directory for it",
                above.display()
            ),
        )),
    }
}

/// Why the store is not checked: the config names none and no enforcer made the default one.
pub(super) fn store_unconfigured(config: &Config) -> Option<String> {
    if config.enforcer.store.url.is_some() || config.enforcer.database.is_some() {
        return None;
    }
    let default = config.enforcer_database();
    (!default.exists()).then(|| {
        format!(
            "neither [enforcer.store] url nor enforcer.database is set, and {} does not exist \
             (no enforcer ran with this data_dir)",
            default.display()
        )
    })
}

/// The store's line: reachable, and at a schema version this build opens.
pub(super) fn store(config: &Config) -> Line {
    let location = config.enforcer_store();
    let known = probe::known_version(&location);
    let shown = match &location {
        StoreLocation::Sqlite(path) => path.display().to_string(),
        StoreLocation::Postgres { url, .. } => without_password(url),
    };
    match probe::schema(&location) {
        Ok(SchemaState::Absent) => {
            let StoreLocation::Sqlite(path) = &location else {
                unreachable!("only an SQLite file can be absent")
            };
            let setting = if config.enforcer.store.url.is_some() {
                "[enforcer.store] url"
            } else if config.enforcer.database.is_some() {
                "enforcer.database"
            } else {
                "storage.data_dir"
            };
            let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
            match creatable(dir.unwrap_or(Path::new(".")), setting) {
                Ok(dir) => Line::ok(
                    "store",
                    format!(
                        "{shown} does not exist yet; the enforcer creates it at schema version \
                         {known} at its start ({} takes files)",
                        dir.display()
                    ),
                ),
                Err((text, fix)) => Line::fail(
                    "store",
                    format!("{shown}: its directory {text}"),
                    fix,
                ),
            }
        }
        Ok(SchemaState::Empty) => Line::ok(
            "store",
            format!(
                "{shown} answered and holds no gpuwarden tables yet; the enforcer makes them \
                 (schema version {known}) at its start"
            ),
        ),
        Ok(SchemaState::At(version)) if version == known => Line::ok(
            "store",
            format!("{shown} answered: schema version {version}, this build's"),
        ),
        Ok(SchemaState::At(version)) if version < known => Line::ok(
            "store",
            format!(
                "{shown} answered: schema version {version}, older than this build's {known}: \
                 will migrate on start (once, forward only: back it up first to be able to go \
                 back)"
            ),
        ),
        Ok(SchemaState::At(version)) => Line::fail(
            "store",
            format!(
                "{shown} is at schema version {version}, newer than this build's {known}: a \
                 newer gpuwarden wrote it, and this one refuses to open it"
            ),
            format!(
                "run the gpuwarden release that wrote it, or a later one, here (this is {})",
                env!("CARGO_PKG_VERSION")
            ),
        ),
        Err(e) => Line::fail(
            "store",
            format!("{shown}: {e}"),
            match location {
                StoreLocation::Sqlite(_) => {
                    "check that the file is the enforcer's SQLite database and this account may read it"
                }
                StoreLocation::Postgres { .. } => {
                    "check [enforcer.store] url (host, port, user, database, sslmode) and \
                     password_file, and that PostgreSQL accepts connections from this host"
                }
            },
        ),
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        .unwrap_or_else(|| "host".into())
}
