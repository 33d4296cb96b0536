//! The Parquet lake on disk: where each table's files go, how a file is written so that a crash
//! never leaves half of one, which hours must be rolled up again, and the flush journal that
//! lets a restarted pipeline remove files whose Kafka offsets were never committed.
//!
//! The lake is a directory, or a prefix of an S3 bucket ([`crate::store`]): the same layout, the
//! same names, and for each operation below the directory's way or the object store's
//! (docs/ARCHITECTURE.md#the-lake-on-object-storage). A role (the one process rolling up,
//! compacting or publishing signals) is an `flock` in a directory and a lease object that
//! expires in a bucket ([`Lake::try_lock`], [`crate::lease`]).
//!
//! Layout (docs/ARCHITECTURE.md#lake-layout):
//! `<lake>/<table>/date=YYYY-MM-DD/hour=HH/<source>-o<first>-<last>.parquet`. `<source>` is
//! `<topic>-p<partition>` for Kafka and `file-<table>-<name>` for `gpuwarden ingest`;
//! `<first>-<last>` is the offset (or line) range the file holds, so replaying the same range
//! rewrites the same file instead of adding one.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::DataType;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;
use serde::{Deserialize, Serialize};

use crate::buffer::ContentDigest;
use crate::store::ObjectLake;
use crate::versions::Versions;

/// Rows per Parquet row group: large enough to compress well, small enough to prune by.
pub const ROW_GROUP_ROWS: usize = 128 * 1024;

const HOUR_MS: i64 = 3_600_000;

/// The raw tables the rollups are computed from; writing to one of them marks the hour.
pub const ROLLUP_INPUTS: [&str; 2] = ["samples", "lease_events"];

/// The lake: a root directory (`<data_dir>/lake`), or a prefix of an object store.
#[derive(Debug, Clone)]
pub struct Lake {
    /// The lake itself when it is a directory; for a lake in an object store, the local
    /// directory where files are encoded before they are uploaded (see [`Lake::root`]).
    root: PathBuf,
    /// Where replaced files are kept for the queries that listed them.
    versions: Arc<Versions>,
    /// The object store the lake is in, if it is in one.
    objects: Option<Arc<ObjectLake>>,
    /// The lake's Delta tables (the rollups'), in the same place.
    delta: crate::delta::DeltaTables,
}

/// A lake operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum LakeError {
    /// A file system call failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path concerned.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Parquet encoding failed.
    #[error("writing Parquet {path}: {source}")]
    Parquet {
        /// The file being written.
        path: PathBuf,
        /// The encoder's error.
        source: parquet::errors::ParquetError,
    },
    /// The object store refused or failed a request, after its client's own retries (an
    /// external system: retried again later where the caller retries, e.g. ingest's writers).
    #[error("{action} {key} in {lake}: {source}")]
    Store {
        /// What was being done.
        action: &'static str,
        /// The object's key (empty for the store as a whole).
        key: String,
        /// The lake, `s3://bucket/prefix`.
        lake: String,
        /// The store's error (boxed: it is large, and every lake result carries the size).
        source: Box<object_store::Error>,
    },
    /// This process no longer holds the role it was working under: its lease on the lake
    /// expired without a renewal, or another process took the role over, or a conditional
    /// write found an object written by another holder since this one read it. Its work stops
    /// there, uncommitted; the holder now does it.
    #[error("{what} in {lake}: this process no longer holds the {role} role (its lease lapsed or another process took it over)")]
    Deposed {
        /// The role ("rollups").
        role: &'static str,
        /// What was being done.
        what: String,
        /// The lake, `s3://bucket/prefix`.
        lake: String,
    },
}

/// Wraps an OS error with what was being done to which path.
pub(crate) fn io<'p>(
    action: &'static str,
    path: &'p Path,
) -> impl FnOnce(std::io::Error) -> LakeError + 'p {
    move |source| LakeError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

pub use gpuwarden_schema::calendar::hour_of;
use gpuwarden_schema::calendar::{civil_from_days, days_from_civil};

/// `date=YYYY-MM-DD/hour=HH` of the hour starting at `hour_ms`.
pub fn hour_partition(hour_ms: i64) -> String {
    let days = hour_ms.div_euclid(86_400_000);
    let hour = hour_ms.rem_euclid(86_400_000) / HOUR_MS;
    let (y, m, d) = civil_from_days(days);
    format!("date={y:04}-{m:02}-{d:02}/hour={hour:02}")
}

/// The hour starting at `hour_ms` read back from its `date=YYYY-MM-DD` and `hour=HH` directory
/// names; `None` for anything else.
pub fn parse_hour_partition(date: &str, hour: &str) -> Option<i64> {
    let date = date.strip_prefix("date=")?;
    let hour: i64 = hour.strip_prefix("hour=")?.parse().ok()?;
    let mut parts = date.splitn(3, '-');
    let (y, m, d) = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || !(0..24).contains(&hour) {
        return None;
    }
    Some(days_from_civil(y, m, d) * 86_400_000 + hour * HOUR_MS)
}

/// A role that one process at a time holds on a lake ([`Lake::try_lock`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Rolling up (`rollups/.lock`, `_leases/rollups.json`).
    Rollups,
    /// Compacting and deleting past retention (`_compaction/.lock`, `_leases/compaction.json`).
    Compaction,
    /// Computing and publishing signals (`signals.lock`, `_leases/signals.json`).
    Signals,
}

impl Role {
    /// Its name, as in its lease object's.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rollups => "rollups",
            Self::Compaction => "compaction",
            Self::Signals => "signals",
        }
    }

    /// Its lock file in a directory lake, relative to the root.
    pub fn lock_file(self) -> PathBuf {
        match self {
            Self::Rollups => Path::new("rollups").join(".lock"),
            Self::Compaction => Path::new("_compaction").join(".lock"),
            Self::Signals => PathBuf::from("signals.lock"),
        }
    }
}

/// A role held on a lake ([`Lake::try_lock`]), given up when dropped. In a directory it is an
/// `flock` on the role's lock file, which the kernel drops with the process. In a bucket it is
/// the role's [`crate::lease::Lease`], renewed every third of its length by a thread of its own
/// while held and released when dropped; a holder that dies gives the role up when the lease
/// expires. A lease can be lost (renewals failing until it expires, or another process taking
/// the role over meanwhile): the holder asks [`LakeLock::check`] before each step it commits,
/// and its commits are conditional writes ([`Lake::write_state`]) besides.
#[derive(Debug)]
pub struct LakeLock {
    path: PathBuf,
    held: Held,
}

#[derive(Debug)]
enum Held {
    File(#[allow(dead_code)] File),
    Lease(LeaseKeeper),
}

/// The thread renewing a held lease, and what it found.
#[derive(Debug)]
struct LeaseKeeper {
    shared: Arc<LeaseShared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The lease's generation: greater for every later holder of the role.
    generation: u64,
}

#[derive(Debug)]
struct LeaseShared {
    lease: std::sync::Mutex<Option<crate::lease::Lease>>,
    /// Set to stop the renewals; the condition variable wakes the thread for it.
    stop: std::sync::Mutex<bool>,
    wake: std::sync::Condvar,
    /// Set once a renewal was refused: another process holds the role.
    deposed: std::sync::atomic::AtomicBool,
    role: Role,
    lake: String,
}

impl LeaseShared {
    /// Renews every third of the lease's length until stopped or deposed. A failed renewal
    /// (the store unreachable) is retried at the next turn: the lease stays valid until it
    /// expires, which [`LakeLock::check`] tells by its own clock.
    fn keep(&self, ttl: std::time::Duration) {
        let every = ttl / 3;
        loop {
            let stop = self.stop.lock().expect("not poisoned");
            let (stop, _) = self
                .wake
                .wait_timeout_while(stop, every, |stop| !*stop)
                .expect("not poisoned");
            if *stop {
                return;
            }
            drop(stop);
            let mut lease = self.lease.lock().expect("not poisoned");
            let Some(held) = lease.as_mut() else { return };
            match held.renew() {
                Ok(crate::lease::Held::Kept) => {}
                Ok(crate::lease::Held::Deposed) => {
                    tracing::warn!(role = self.role.name(), lake = %self.lake, "another process took this process's role over: its lease had lapsed");
                    self.deposed
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    *lease = None;
                    return;
                }
                Err(e) => {
                    tracing::warn!(role = self.role.name(), lake = %self.lake, error = %e, remaining_ms = held.remaining().as_millis() as u64, "could not renew this process's lease on its role; retrying");
                }
            }
        }
    }
}

impl LakeLock {
    /// The lock file, or the lease object, relative to the lake's root.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The generation of the lease this holder took (a bucket's; `None` for a directory's
    /// lock, which no other process can take while this one lives): a later holder of the
    /// role always has a greater one, so names carrying it never collide between holders.
    pub fn generation(&self) -> Option<u64> {
        match &self.held {
            Held::Lease(keeper) => Some(keeper.generation),
            Held::File(_) => None,
        }
    }

    /// `Ok` while the role is still this process's with time to spare (a third of its lease
    /// at least; always, for a directory's lock): the holder asks before each step it commits.
    /// [`LakeError::Deposed`] once it is not, naming `what` was about to be done.
    pub fn check(&self, what: &str) -> Result<(), LakeError> {
        let Held::Lease(keeper) = &self.held else {
            return Ok(());
        };
        let shared = &keeper.shared;
        let lease = shared.lease.lock().expect("not poisoned");
        let spare = lease
            .as_ref()
            .is_some_and(|lease| lease.remaining() >= lease.ttl() / 3);
        if spare && !shared.deposed.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        Err(LakeError::Deposed {
            role: shared.role.name(),
            what: what.to_string(),
            lake: shared.lake.clone(),
        })
    }
}

impl Drop for LakeLock {
    fn drop(&mut self) {
        let Held::Lease(keeper) = &mut self.held else {
            return;
        };
        *keeper.shared.stop.lock().expect("not poisoned") = true;
        keeper.shared.wake.notify_all();
        if let Some(thread) = keeper.thread.take() {
            let _ = thread.join();
        }
        let lease = keeper.shared.lease.lock().expect("not poisoned").take();
        if let Some(lease) = lease {
            // Released, the next holder need not wait out the expiry; failing to release costs
            // only that wait.
            if let Err(e) = lease.release() {
                tracing::warn!(role = keeper.shared.role.name(), lake = %keeper.shared.lake, error = %e, "could not release this process's lease; the role passes on when it expires");
            }
        }
    }
}

/// This process's name as a lease holder: host, process id and start time, so that a restarted
/// process never takes itself for its predecessor.
fn holder_name() -> String {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| {
                fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
            })
            .unwrap_or_else(|| "host".into());
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        format!("{host}/{}/{started:x}", std::process::id())
    })
    .clone()
}

/// What a state object ([`Lake::read_state`]) was read at, for the conditional write that
/// replaces it ([`Lake::write_state`]): its version in a bucket (none there yet: create it);
/// nothing in a directory, where the one lock holder writes it alone.
#[derive(Debug, Clone, Default)]
pub struct StateVersion(Option<object_store::UpdateVersion>);

/// What a flush is about to write, recorded before the first file is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    /// `<topic>-p<partition>` or `file-<table>-<name>`.
    pub source: String,
    /// First offset in the flush.
    pub first: i64,
    /// Last offset in the flush.
    pub last: i64,
    /// The files, relative to the lake root.
    pub files: Vec<PathBuf>,
}

impl Lake {
    /// The lake rooted at `root` (created if missing).
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, LakeError> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(io("creating", &root))?;
        let versions = Arc::new(Versions::of(&root));
        Ok(Self {
            delta: crate::delta::DeltaTables::in_dir(&root),
            root,
            versions,
            objects: None,
        })
    }

    /// The lake in `objects`, whose files are encoded under the local directory `staging`
    /// (created if missing) before they are uploaded.
    pub fn in_object_store(
        objects: ObjectLake,
        staging: impl Into<PathBuf>,
    ) -> Result<Self, LakeError> {
        let mut lake = Self::open(staging)?;
        lake.delta = crate::delta::DeltaTables::in_bucket(objects.clone());
        lake.objects = Some(Arc::new(objects));
        Ok(lake)
    }

    /// The lake the config names (`storage.lake`, `[storage.s3]`): a directory, or a prefix of
    /// an S3 bucket staged under `<data_dir>/lake-staging`.
    pub fn from_config(config: &gpuwarden_schema::config::Config) -> Result<Self, LakeError> {
        use gpuwarden_schema::config::LakeLocation;
        let location = config.lake().map_err(|message| LakeError::Io {
            action: "reading storage.lake",
            path: PathBuf::from(config.storage.lake.clone().unwrap_or_default()),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, message),
        })?;
        match location {
            LakeLocation::Directory(dir) => Self::open(dir),
            LakeLocation::S3 { bucket, prefix } => Self::in_object_store(
                ObjectLake::s3(&bucket, &prefix, &config.storage.s3)?,
                config.storage.data_dir.join("lake-staging"),
            ),
        }
    }

    /// The lake's root directory when it is a directory. For a lake in an object store, the
    /// local directory its files are encoded in before they are uploaded: nothing there is part
    /// of the lake.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The object store the lake is in; `None` for a directory.
    pub fn objects(&self) -> Option<&ObjectLake> {
        self.objects.as_deref()
    }

    /// The lake's Delta tables.
    pub fn delta(&self) -> &crate::delta::DeltaTables {
        &self.delta
    }

    /// `s3://bucket/prefix`, or the directory.
    pub fn location(&self) -> String {
        match &self.objects {
            Some(objects) => objects.display().to_string(),
            None => self.root.display().to_string(),
        }
    }

    /// The directory of one table's hour.
    pub fn hour_dir(&self, table: &str, hour_ms: i64) -> PathBuf {
        self.root.join(table).join(hour_partition(hour_ms))
    }

    /// The path of a file of `source` covering `first..=last` in one table's hour, relative to
    /// the lake root, whose records' digest is `digest`: the same records from the same place
    /// get the same name, and nothing else does.
    pub fn file_name(
        table: &str,
        hour_ms: i64,
        source: &str,
        first: i64,
        last: i64,
        digest: ContentDigest,
    ) -> PathBuf {
        PathBuf::from(table)
            .join(hour_partition(hour_ms))
            .join(format!(
                "{source}-o{first:020}-{last:020}-h{digest}.parquet"
            ))
    }

    /// Writes `batch` to `relative` atomically: a temporary file, fsync, rename, fsync of the
    /// directory. Returns the bytes written. A write to a table the rollups read marks its hour,
    /// so the next rollup computes that hour again whether the data is new or late.
    pub fn write(
        &self,
        relative: &Path,
        batch: &RecordBatch,
        table: &str,
        hour_ms: i64,
    ) -> Result<u64, LakeError> {
        if let Some(objects) = &self.objects {
            // One PUT publishes the whole file: no temporary object, nothing to rename.
            let bytes = encode(batch, relative)?;
            let size = bytes.len() as u64;
            objects.put(relative, bytes)?;
            self.marked_if_input(table, hour_ms)?;
            return Ok(size);
        }
        let path = self.root.join(relative);
        let dir = path
            .parent()
            .expect("lake files live in an hour directory")
            .to_path_buf();
        fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        let tmp = dir.join(format!(
            ".{}.tmp",
            path.file_name().unwrap().to_string_lossy()
        ));
        let file = File::create(&tmp).map_err(io("creating", &tmp))?;
        let props = writer_properties(&batch.schema(), ROW_GROUP_ROWS).build();
        let mut writer =
            ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(|source| {
                LakeError::Parquet {
                    path: tmp.clone(),
                    source,
                }
            })?;
        writer.write(batch).map_err(|source| LakeError::Parquet {
            path: tmp.clone(),
            source,
        })?;
        let file = writer.into_inner().map_err(|source| LakeError::Parquet {
            path: tmp.clone(),
            source,
        })?;
        file.sync_all().map_err(io("syncing", &tmp))?;
        let bytes = file.metadata().map_err(io("reading", &tmp))?.len();
        drop(file);
        self.install(&tmp, relative, table, hour_ms)?;
        Ok(bytes)
    }

    /// Puts the finished, synced file `tmp` (in [`Lake::staging_dir`] of its hour) in place as
    /// `relative`: in a directory, the replaced file is kept for the queries that listed it and
    /// the rename and the directory are synced; in an object store, the file is uploaded and
    /// then removed. A table the rollups read has its hour marked.
    pub(crate) fn install(
        &self,
        tmp: &Path,
        relative: &Path,
        table: &str,
        hour_ms: i64,
    ) -> Result<(), LakeError> {
        if let Some(objects) = &self.objects {
            objects.put_file(relative, tmp)?;
            fs::remove_file(tmp).map_err(io("removing", tmp))?;
            return self.marked_if_input(table, hour_ms);
        }
        let path = self.root.join(relative);
        // A query that listed the file being replaced reads it on from its kept version.
        self.retire(&path);
        fs::rename(tmp, &path).map_err(io("renaming into", &path))?;
        sync_dir(path.parent().expect("lake files live in an hour directory"))?;
        self.marked_if_input(table, hour_ms)
    }

    /// Marks the hour of a write to a table the rollups read.
    fn marked_if_input(&self, table: &str, hour_ms: i64) -> Result<(), LakeError> {
        if ROLLUP_INPUTS.contains(&table) {
            self.mark_for_recompute(table, hour_ms)?;
        }
        Ok(())
    }

    /// The local directory where a file of `table`'s hour is encoded: its hour directory in a
    /// directory lake (so the rename is within one directory), the same path under the staging
    /// directory for a lake in an object store.
    pub fn staging_dir(&self, table: &str, hour_ms: i64) -> PathBuf {
        self.hour_dir(table, hour_ms)
    }

    /// Keeps the file at `path`, about to be replaced or removed, for the queries that listed
    /// it ([`crate::versions`]). Failing to (a table on another filesystem than the lake's root,
    /// where a hard link cannot reach) costs only those queries, so it is logged, not fatal.
    fn retire(&self, path: &Path) {
        if let Err(e) = self.versions.retire(path) {
            tracing::warn!(path = %path.display(), error = %e, "could not keep the version of a replaced lake file; a query reading it now may fail");
        }
    }

    /// The hours of `table` that have a directory (in an object store: an object), ascending.
    pub fn hours(&self, table: &str) -> Result<Vec<i64>, LakeError> {
        let mut hours = Vec::new();
        if let Some(objects) = &self.objects {
            for date in objects.subdirs(Path::new(table))? {
                for hour in objects.subdirs(&Path::new(table).join(&date))? {
                    hours.extend(parse_hour_partition(&date, &hour));
                }
            }
            hours.sort_unstable();
            return Ok(hours);
        }
        for date in fs::read_dir(self.root.join(table))
            .into_iter()
            .flatten()
            .flatten()
        {
            let date_name = date.file_name();
            for hour in fs::read_dir(date.path()).into_iter().flatten().flatten() {
                if let Some(h) = parse_hour_partition(
                    &date_name.to_string_lossy(),
                    &hour.file_name().to_string_lossy(),
                ) {
                    hours.push(h);
                }
            }
        }
        hours.sort_unstable();
        Ok(hours)
    }

    /// Takes `role` on this lake without waiting; `Ok(None)` when another holder has it
    /// (another process, or another [`Lake::try_lock`] of the same role in this one).
    ///
    /// In a directory it is an exclusive `flock` on the role's lock file (created if missing),
    /// which lasts as long as the returned value and ends with the process however it ends, so
    /// a crash never leaves it taken. In a bucket it is the role's lease object
    /// (`_leases/<role>.json`, [`crate::lease::Lease`]) for `storage.s3.lease_ttl`, renewed
    /// while held and released when dropped; after a crash the role is free once the lease
    /// expires.
    pub fn try_lock(&self, role: Role) -> Result<Option<LakeLock>, LakeError> {
        if let Some(objects) = &self.objects {
            let ttl = objects.lease_ttl();
            let Some(lease) =
                crate::lease::Lease::try_take(objects, role.name(), &holder_name(), ttl)?
            else {
                return Ok(None);
            };
            let generation = lease.generation();
            let shared = Arc::new(LeaseShared {
                lease: std::sync::Mutex::new(Some(lease)),
                stop: std::sync::Mutex::new(false),
                wake: std::sync::Condvar::new(),
                deposed: std::sync::atomic::AtomicBool::new(false),
                role,
                lake: objects.display().to_string(),
            });
            let keeping = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name(format!("lease-{}", role.name()))
                .spawn(move || keeping.keep(ttl))
                .map_err(io("starting the lease thread of", Path::new(role.name())))?;
            return Ok(Some(LakeLock {
                path: crate::lease::Lease::path(role.name()),
                held: Held::Lease(LeaseKeeper {
                    shared,
                    thread: Some(thread),
                    generation,
                }),
            }));
        }
        let path = self.root.join(role.lock_file());
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io("creating", dir))?;
        }
        let file = File::create(&path).map_err(io("creating", &path))?;
        match file.try_lock() {
            Ok(()) => Ok(Some(LakeLock {
                path,
                held: Held::File(file),
            })),
            Err(fs::TryLockError::WouldBlock) => Ok(None),
            Err(fs::TryLockError::Error(source)) => Err(LakeError::Io {
                action: "locking",
                path,
                source,
            }),
        }
    }

    /// Where `role` is held on this lake, for messages: its lock file, or its lease object's URL.
    pub fn lock_location(&self, role: Role) -> PathBuf {
        match &self.objects {
            Some(objects) => PathBuf::from(format!(
                "{}/{}",
                objects.display(),
                crate::lease::Lease::path(role.name()).display()
            )),
            None => self.root.join(role.lock_file()),
        }
    }

    /// A small state object of the lake (`rollups/_state.json`, …) and the version read, for
    /// [`Lake::write_state`]; `None` when there is none.
    pub fn read_state(
        &self,
        relative: &Path,
    ) -> Result<Option<(Vec<u8>, StateVersion)>, LakeError> {
        if let Some(objects) = &self.objects {
            return Ok(objects
                .get_versioned(relative)?
                .map(|(bytes, version)| (bytes.to_vec(), StateVersion(Some(version)))));
        }
        let path = self.root.join(relative);
        match fs::read(&path) {
            Ok(bytes) => Ok(Some((bytes, StateVersion::default()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    /// Replaces the state object `relative` with `bytes`, atomically. In a bucket the write is
    /// conditional on `version` (what [`Lake::read_state`] read, or the last write here; none:
    /// that there is no object yet) and updates it: written by another process since, the
    /// state is not this one's to write, and [`LakeError::Deposed`] says so for `role`.
    pub fn write_state(
        &self,
        relative: &Path,
        bytes: Vec<u8>,
        version: &mut StateVersion,
        role: Role,
    ) -> Result<(), LakeError> {
        if let Some(objects) = &self.objects {
            let mode = match &version.0 {
                Some(v) => object_store::PutMode::Update(v.clone()),
                None => object_store::PutMode::Create,
            };
            let Some(written) = objects.put_if(relative, bytes, mode)? else {
                return Err(LakeError::Deposed {
                    role: role.name(),
                    what: format!(
                        "writing {} (another process wrote it since)",
                        relative.display()
                    ),
                    lake: objects.display().to_string(),
                });
            };
            version.0 = Some(written);
            return Ok(());
        }
        let path = self.root.join(relative);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io("creating", dir))?;
        }
        let tmp = path.with_extension("json.tmp");
        replace_durably(&tmp, &path, &bytes)
    }

    /// Serves the lake's raw files to `ctx` the way its own readers must see them: each hour as
    /// its compaction manifest says, and a file replaced or removed since a query listed it as
    /// the version it listed. (The rollup tables are Delta tables: [`Lake::delta`].)
    pub fn register_reader(&self, ctx: &datafusion::prelude::SessionContext) {
        match &self.objects {
            Some(objects) => objects.register(ctx),
            None => crate::versions::VersionedFs::register(ctx, &self.root),
        }
    }

    /// Registers the Parquet files under the lake's directories `dirs` (relative to its root)
    /// as the table `name` of `ctx`, which [`Lake::register_reader`] serves. In a directory
    /// lake, directories that do not exist are left out; none at all make an empty table.
    pub fn register_dirs(
        &self,
        ctx: &datafusion::prelude::SessionContext,
        name: &str,
        dirs: &[PathBuf],
        schema: arrow_schema::SchemaRef,
    ) -> Result<(), datafusion::error::DataFusionError> {
        match &self.objects {
            Some(objects) => {
                let urls: Vec<String> = dirs.iter().map(|d| objects.dir_url(d)).collect();
                if urls.is_empty() {
                    crate::listing::register_dirs(ctx, name, &[], schema)
                } else {
                    crate::listing::register_urls(ctx, name, &urls, schema)
                }
            }
            None => {
                let existing: Vec<PathBuf> = dirs
                    .iter()
                    .map(|d| self.root.join(d))
                    .filter(|d| d.is_dir())
                    .collect();
                crate::listing::register_dirs(ctx, name, &existing, schema)
            }
        }
    }

    /// Deletes what the lake keeps of replaced and removed files once no query can still read
    /// it ([`crate::versions::RETAIN`]): in a bucket, the `_versions/` objects; a directory
    /// prunes its own as it goes. Returns how many went.
    pub fn sweep_versions(&self) -> Result<usize, LakeError> {
        match &self.objects {
            Some(objects) => objects.sweep_versions(crate::versions::RETAIN),
            None => Ok(0),
        }
    }

    /// Removes a file written by [`Lake::write`], if it exists.
    pub fn remove(&self, relative: &Path) -> Result<bool, LakeError> {
        if let Some(objects) = &self.objects {
            // Kept for the queries that listed it, as in a directory.
            return objects.retire(relative);
        }
        let path = self.root.join(relative);
        self.retire(&path);
        match fs::remove_file(&path) {
            Ok(()) => {
                if let Some(dir) = path.parent() {
                    sync_dir(dir)?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    /// Records that an hour of `table` received data the rollups have not seen yet. The mark is
    /// a file, so it survives restarts until a rollup has consumed it.
    pub fn mark_for_recompute(&self, table: &str, hour_ms: i64) -> Result<(), LakeError> {
        if let Some(objects) = &self.objects {
            return objects.put(&Self::mark(table, hour_ms), Vec::new());
        }
        let dir = self.root.join("_recompute").join(table);
        fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        let mark = dir.join(hour_ms.to_string());
        if !mark.exists() {
            File::create(&mark).map_err(io("creating", &mark))?;
            sync_dir(&dir)?;
        }
        Ok(())
    }

    /// The mark of `table`'s hour, relative to the lake root.
    fn mark(table: &str, hour_ms: i64) -> PathBuf {
        Path::new("_recompute")
            .join(table)
            .join(hour_ms.to_string())
    }

    /// Hours of `table` marked for recomputation (start of hour, ms).
    pub fn marked_hours(&self, table: &str) -> Result<Vec<i64>, LakeError> {
        let relative = Path::new("_recompute").join(table);
        let mut hours: Vec<i64> = match &self.objects {
            Some(objects) => objects
                .list(&relative)?
                .iter()
                .filter_map(|mark| mark.to_str()?.parse().ok())
                .collect(),
            None => fs::read_dir(self.root.join(relative))
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect(),
        };
        hours.sort_unstable();
        Ok(hours)
    }

    /// Clears the recompute mark of an hour (the rollup consumed it).
    pub fn clear_mark(&self, table: &str, hour_ms: i64) -> Result<(), LakeError> {
        if let Some(objects) = &self.objects {
            return objects.delete(&Self::mark(table, hour_ms));
        }
        let mark = self
            .root
            .join("_recompute")
            .join(table)
            .join(hour_ms.to_string());
        match fs::remove_file(&mark) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &mark)(e)),
        }
    }

    /// A source's flush journal, relative to the lake root.
    fn intent(source: &str) -> PathBuf {
        Path::new("_ingest").join(format!("{source}.intent.json"))
    }

    fn intent_path(&self, source: &str) -> PathBuf {
        self.root.join(Self::intent(source))
    }

    /// Records a flush's files before they are written.
    pub fn write_intent(&self, intent: &Intent) -> Result<(), LakeError> {
        if let Some(objects) = &self.objects {
            let json = serde_json::to_vec(intent).expect("an intent serializes");
            return objects.put(&Self::intent(&intent.source), json);
        }
        let path = self.intent_path(&intent.source);
        let dir = path.parent().unwrap().to_path_buf();
        fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        replace_durably(
            &path.with_extension("tmp"),
            &path,
            &serde_json::to_vec(intent).expect("an intent serializes"),
        )
    }

    /// Forgets a flush whose offsets are committed.
    pub fn clear_intent(&self, source: &str) -> Result<(), LakeError> {
        if let Some(objects) = &self.objects {
            return objects.delete(&Self::intent(source));
        }
        let path = self.intent_path(source);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    /// The files of every flush not committed yet (each source's flush journal), relative to
    /// the lake root: a restart may delete them, so compaction leaves them alone.
    pub fn pending_files(&self) -> Result<std::collections::HashSet<PathBuf>, LakeError> {
        let mut files = std::collections::HashSet::new();
        if let Some(objects) = &self.objects {
            for name in objects.list(Path::new("_ingest"))? {
                let Some(source) = name
                    .to_str()
                    .and_then(|name| name.strip_suffix(".intent.json"))
                else {
                    continue;
                };
                let journal = Self::intent(source);
                // Gone since the listing: committed and cleared meanwhile.
                let Some(bytes) = objects.get(&journal)? else {
                    continue;
                };
                match serde_json::from_slice::<Intent>(&bytes) {
                    Ok(intent) => files.extend(intent.files),
                    Err(e) => {
                        tracing::warn!(key = %objects.key(&journal), error = %e, "unreadable flush journal");
                    }
                }
            }
            return Ok(files);
        }
        let dir = self.root.join("_ingest");
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(files),
            Err(e) => return Err(io("listing", &dir)(e)),
        };
        for entry in entries {
            let path = entry.map_err(io("listing", &dir))?.path();
            if !path.to_string_lossy().ends_with(".intent.json") {
                continue;
            }
            match fs::read(&path) {
                Ok(bytes) => match serde_json::from_slice::<Intent>(&bytes) {
                    Ok(intent) => files.extend(intent.files),
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "unreadable flush journal");
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("reading", &path)(e)),
            }
        }
        Ok(files)
    }

    /// After a restart: if the last flush of `source` was not committed (`committed` is the next
    /// offset to read), deletes its files, which the replay will write again. Returns how many
    /// files were removed.
    pub fn recover(&self, source: &str, committed: Option<i64>) -> Result<usize, LakeError> {
        let path = self.intent_path(source);
        let bytes = match &self.objects {
            Some(objects) => match objects.get(&Self::intent(source))? {
                Some(bytes) => bytes.to_vec(),
                None => return Ok(0),
            },
            None => match fs::read(&path) {
                Ok(bytes) => bytes,
                Err(_) => return Ok(0),
            },
        };
        let Ok(intent) = serde_json::from_slice::<Intent>(&bytes) else {
            tracing::warn!(path = %path.display(), "unreadable flush journal; removing it");
            return self.clear_intent(source).map(|()| 0);
        };
        let mut removed = 0;
        if committed.is_none_or(|next| next <= intent.last) {
            for file in &intent.files {
                if let Some(objects) = &self.objects {
                    // Nothing half-written to remove: an object is put whole or not at all.
                    if objects.exists(file)? {
                        objects.delete(file)?;
                        removed += 1;
                    }
                    continue;
                }
                let full = self.root.join(file);
                // A crash mid-write leaves the temporary file; readers skip it, but remove it.
                let tmp = full.with_file_name(format!(
                    ".{}.tmp",
                    full.file_name().unwrap_or_default().to_string_lossy()
                ));
                let _ = fs::remove_file(&tmp);
                match fs::remove_file(&full) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io("removing", &full)(e)),
                }
            }
            tracing::info!(
                source,
                first = intent.first,
                last = intent.last,
                removed,
                "removed files of a flush that was never committed; it will be replayed"
            );
        }
        self.clear_intent(source)?;
        Ok(removed)
    }
}

/// `batch` as the bytes of a Parquet file of the lake (`relative` names it in errors).
pub(crate) fn encode(batch: &RecordBatch, relative: &Path) -> Result<Vec<u8>, LakeError> {
    let parquet = |source| LakeError::Parquet {
        path: relative.to_path_buf(),
        source,
    };
    let props = writer_properties(&batch.schema(), ROW_GROUP_ROWS).build();
    let mut writer =
        ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).map_err(parquet)?;
    writer.write(batch).map_err(parquet)?;
    writer.into_inner().map_err(parquet)
}

/// How every Parquet file of the lake is encoded: zstd, page statistics, dictionaries for text.
pub(crate) fn writer_properties(
    schema: &arrow_schema::Schema,
    row_group_rows: usize,
) -> parquet::file::properties::WriterPropertiesBuilder {
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(3).expect("level 3 is valid"),
        ))
        .set_max_row_group_row_count(Some(row_group_rows))
        .set_statistics_enabled(EnabledStatistics::Page)
        // Dictionaries pay off for names (hosts, GPUs, models, leases), which repeat, and
        // cost time for measurements, which rarely do.
        .set_dictionary_enabled(false);
    for field in schema.fields() {
        if matches!(field.data_type(), DataType::Utf8 | DataType::LargeUtf8) {
            props =
                props.set_column_dictionary_enabled(ColumnPath::from(field.name().as_str()), true);
        }
    }
    props
}

/// Writes `bytes` to `tmp`, syncs it and renames it over `path`, then syncs the directory: a
/// reader finds the old contents or the new, and a crash leaves at most `tmp` behind.
pub(crate) fn replace_durably(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<(), LakeError> {
    let mut file = File::create(tmp).map_err(io("creating", tmp))?;
    file.write_all(bytes).map_err(io("writing", tmp))?;
    file.sync_all().map_err(io("syncing", tmp))?;
    fs::rename(tmp, path).map_err(io("renaming into", path))?;
    sync_dir(path.parent().expect("a file lives in a directory"))
}

/// Syncs a directory, so that the renames and removals in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), LakeError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> RecordBatch {
        let a: arrow_array::ArrayRef =
            std::sync::Arc::new(arrow_array::Int64Array::from(vec![1, 2, 3]));
        RecordBatch::try_from_iter([("x", a)]).unwrap()
    }

    #[test]
    fn a_lock_has_one_holder_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let held = lake
            .try_lock(Role::Rollups)
            .unwrap()
            .expect("a free lock is taken");
        assert_eq!(held.path(), dir.path().join("rollups/.lock"));
        assert!(
            lake.try_lock(Role::Rollups).unwrap().is_none(),
            "held elsewhere"
        );
        assert!(
            lake.try_lock(Role::Signals).unwrap().is_some(),
            "another role"
        );
        drop(held);
        assert!(
            lake.try_lock(Role::Rollups).unwrap().is_some(),
            "free again"
        );
    }

    #[test]
    fn hour_partitions_read_back() {
        for hour in [
            0,
            1_764_547_200_000,
            1_709_164_800_000 + 23 * HOUR_MS,
            -HOUR_MS,
        ] {
            let partition = hour_partition(hour);
            let (date, h) = partition.split_once('/').unwrap();
            assert_eq!(parse_hour_partition(date, h), Some(hour), "{partition}");
        }
        assert_eq!(parse_hour_partition("date=2026-13-01", "hour=00"), None);
    }

    #[test]
    fn recovery_removes_an_uncommitted_flush_and_keeps_a_committed_one() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let files = vec![
            Lake::file_name("samples", 0, "t-p0", 10, 19, ContentDigest(0)),
            Lake::file_name("samples", 3_600_000, "t-p0", 10, 19, ContentDigest(0)),
        ];
        let write = |lake: &Lake| {
            lake.write_intent(&Intent {
                source: "t-p0".into(),
                first: 10,
                last: 19,
                files: files.clone(),
            })
            .unwrap();
            for (i, f) in files.iter().enumerate() {
                lake.write(f, &batch(), "samples", i as i64 * 3_600_000)
                    .unwrap();
            }
        };
        write(&lake);
        std::fs::write(
            dir.path()
                .join("samples/date=1970-01-01/hour=00/.stray.parquet.tmp"),
            b"half",
        )
        .unwrap();
        // Committed up to 15 only: the flush (10..=19) was not committed.
        assert_eq!(lake.recover("t-p0", Some(15)).unwrap(), 2);
        assert!(files.iter().all(|f| !dir.path().join(f).exists()));
        assert_eq!(
            lake.recover("t-p0", Some(15)).unwrap(),
            0,
            "the journal is gone"
        );

        write(&lake);
        // Committed past the flush: its files stay, only the journal goes.
        assert_eq!(lake.recover("t-p0", Some(20)).unwrap(), 0);
        assert!(files.iter().all(|f| dir.path().join(f).exists()));
        // Nothing ever committed: everything goes.
        write(&lake);
        assert_eq!(lake.recover("t-p0", None).unwrap(), 2);
    }

    #[test]
    fn writes_are_atomic_and_mark_the_hours_of_rollup_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        lake.write(
            &Lake::file_name("signals", 0, "s", 0, 2, ContentDigest(0)),
            &batch(),
            "signals",
            0,
        )
        .unwrap();
        assert!(
            lake.marked_hours("signals").unwrap().is_empty(),
            "no rollup reads signals"
        );
        for (first, last) in [(0, 2), (0, 2), (3, 5)] {
            lake.write(
                &Lake::file_name("samples", 0, "s", first, last, ContentDigest(0)),
                &batch(),
                "samples",
                0,
            )
            .unwrap();
            assert_eq!(lake.marked_hours("samples").unwrap(), vec![0]);
            lake.clear_mark("samples", 0).unwrap();
            assert!(lake.marked_hours("samples").unwrap().is_empty());
        }
        let names: Vec<String> = std::fs::read_dir(lake.hour_dir("samples", 0))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names.len(),
            2,
            "no temporary file is left behind: {names:?}"
        );
    }

    #[test]
    fn hours_are_utc_partitions() {
        assert_eq!(hour_partition(0), "date=1970-01-01/hour=00");
        // 2026-12-02T13:34:11Z
        let ts = 1_796_218_451_000;
        assert_eq!(hour_partition(hour_of(ts)), "date=2026-12-02/hour=13");
        assert_eq!(hour_of(ts) % 3_600_000, 0);
        assert_eq!(
            hour_partition(hour_of(951_782_400_000)),
            "date=2000-02-29/hour=00"
        );
        assert_eq!(hour_of(-1), -3_600_000, "before the epoch rounds down");
    }

    #[test]
    fn file_names_sort_by_offset_and_name_their_source_and_content() {
        let name = Lake::file_name(
            "samples",
            0,
            "gpuwarden.samples-p3",
            10,
            99,
            ContentDigest(0xab),
        );
        assert_eq!(
            name,
            PathBuf::from("samples/date=1970-01-01/hour=00/gpuwarden.samples-p3-o00000000000000000010-00000000000000000099-h00000000000000ab.parquet")
        );
    }
}
