//! The lake ([`Lake`]): a directory, or a prefix of an S3 bucket ([`crate::objects`]), holding
//! one Delta table per raw table and per rollup table ([`crate::delta`]), the rollups' small
//! state objects, and the roles: the one process rolling up, compacting or publishing signals is
//! an `flock` in a directory and a lock object that expires in a bucket ([`Lake::try_lock`],
//! [`crate::bucket_lock`]) (docs/src/contributors/lake.md#lake-layout).

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::base::{
    hour_partition, parse_hour_partition, DeltaError, LakeError, ROW_GROUP_ROWS,
};
pub(crate) use crate::base::{io, replace_durably, writer_properties};
use crate::bucket_lock::{self, BucketLock};
use crate::objects::ObjectLake;

/// The lake: a root directory (`<data_dir>/lake`), or a prefix of an object store.
#[derive(Debug, Clone)]
pub struct Lake {
    /// The lake itself when it is a directory; for a lake in an object store, the local
    /// directory where files are encoded before they are uploaded (see [`Lake::root`]).
    root: PathBuf,
    /// The object store the lake is in, if it is in one.
    objects: Option<Arc<ObjectLake>>,
    /// The lake's Delta tables, in the same place.
    delta: crate::delta::DeltaTables,
}

pub use gpuwarden_schema::calendar::hour_of;

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
    /// Its name, as in its lock object's.
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
/// the role's [`BucketLock`], renewed every third of its length by a thread of its own while
/// held and released when dropped; a holder that dies gives the role up when the lock expires.
/// A bucket lock can be lost (renewals failing until it expires, or another process taking the
/// role over meanwhile): the holder asks [`LakeLock::check`] before each step it commits, and
/// its commits are conditional writes ([`Lake::write_state`]) besides.
#[derive(Debug)]
pub struct LakeLock {
    path: PathBuf,
    holding: Holding,
}

/// How a [`LakeLock`] holds its role.
#[derive(Debug)]
enum Holding {
    File(#[allow(dead_code)] File),
    Bucket(Keeper),
}

/// The thread renewing a held bucket lock, and what it found.
#[derive(Debug)]
struct Keeper {
    shared: Arc<KeeperShared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The lock's generation: greater for every later holder of the role.
    generation: u64,
}

#[derive(Debug)]
struct KeeperShared {
    lock: std::sync::Mutex<Option<BucketLock>>,
    /// Set to stop the renewals; the condition variable wakes the thread for it.
    stop: std::sync::Mutex<bool>,
    wake: std::sync::Condvar,
    /// Set once a renewal was refused: another process holds the role.
    deposed: std::sync::atomic::AtomicBool,
    role: Role,
    lake: String,
}

impl KeeperShared {
    /// Renews every third of the lock's length until stopped or deposed. A failed renewal
    /// (the object store unreachable) is retried at the next turn: the lock stays valid until it
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
            let mut lock = self.lock.lock().expect("not poisoned");
            let Some(held) = lock.as_mut() else { return };
            match held.renew() {
                Ok(bucket_lock::Held::Kept) => {}
                Ok(bucket_lock::Held::Deposed) => {
                    tracing::warn!(role = self.role.name(), lake = %self.lake, "another process took this process's role over: its lock had lapsed");
                    self.deposed
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    *lock = None;
                    return;
                }
                Err(e) => {
                    tracing::warn!(role = self.role.name(), lake = %self.lake, error = %e, remaining_ms = held.remaining().as_millis() as u64, "could not renew this process's lock on its role; retrying");
                }
            }
        }
    }
}

impl LakeLock {
    /// The lock file, or the lock object, relative to the lake's root.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The generation of the bucket lock this holder took (`None` for a directory's lock,
    /// which no other process can take while this one lives): a later holder of the
    /// role always has a greater one, so names carrying it never collide between holders.
    pub fn generation(&self) -> Option<u64> {
        match &self.holding {
            Holding::Bucket(keeper) => Some(keeper.generation),
            Holding::File(_) => None,
        }
    }

    /// `Ok` while the role is still this process's with time to spare (a third of its bucket
    /// lock's length at least; always, for a directory's lock): the holder asks before each step it commits.
    /// [`LakeError::Deposed`] once it is not, naming `what` was about to be done.
    pub fn check(&self, what: &str) -> Result<(), LakeError> {
        let Holding::Bucket(keeper) = &self.holding else {
            return Ok(());
        };
        let shared = &keeper.shared;
        let lock = shared.lock.lock().expect("not poisoned");
        let spare = lock
            .as_ref()
            .is_some_and(|lock| lock.remaining() >= lock.ttl() / 3);
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
        let Holding::Bucket(keeper) = &mut self.holding else {
            return;
        };
        *keeper.shared.stop.lock().expect("not poisoned") = true;
        keeper.shared.wake.notify_all();
        if let Some(thread) = keeper.thread.take() {
            let _ = thread.join();
        }
        let lock = keeper.shared.lock.lock().expect("not poisoned").take();
        if let Some(lock) = lock {
            // Released, the next holder need not wait out the expiry; failing to release costs
            // only that wait.
            if let Err(e) = lock.release() {
                tracing::warn!(role = keeper.shared.role.name(), lake = %keeper.shared.lake, error = %e, "could not release this process's lock; the role passes on when it expires");
            }
        }
    }
}

/// This process's name as a bucket lock's holder: host, process id and start time, so that a restarted
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
        let started = gpuwarden_schema::clock::wall_now()
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

/// gpuwarden's layout of a lake, kept in [`LAYOUT_FILE`] at its root: which tables there are,
/// where their files and state objects lie, and how they are read. Layout 1 was the layout
/// before Delta tables (`<table>/date=…/hour=…/`, which `gpuwarden lake migrate` moves and
/// `Rollup::run` refuses to roll up until it has); layout 2 is every table a Delta table
/// (docs/src/contributors/lake.md#lake-layout). A lake without the file is of the layout before it was
/// kept: 2, unless it still holds files of layout 1.
pub const LAKE_LAYOUT: u64 = 2;

/// The object at a lake's root that names its layout ([`LAKE_LAYOUT`]) and the gpuwarden that
/// wrote it.
pub const LAYOUT_FILE: &str = "_gpuwarden.json";

/// [`LAYOUT_FILE`]'s content. Its `layout` field stays in every later layout, so that every
/// gpuwarden can tell a lake it cannot read.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct LayoutMarker {
    layout: u64,
    #[serde(default)]
    written_by: Option<String>,
}

impl Lake {
    /// The lake rooted at `root` (created if missing); a relative `root` is taken from the
    /// current directory, as the config's `storage.data_dir` is. A lake of a layout newer than
    /// this build's ([`LAKE_LAYOUT`]) is refused with [`LakeError::TooNew`].
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, LakeError> {
        let lake = Self::open_dir(root.into())?;
        lake.check_layout()?;
        Ok(lake)
    }

    fn open_dir(root: PathBuf) -> Result<Self, LakeError> {
        fs::create_dir_all(&root).map_err(io("creating", &root))?;
        // Delta's log stores take a file URL, which only an absolute path makes.
        let absolute = std::path::absolute(&root).map_err(io("resolving", &root))?;
        Ok(Self {
            delta: crate::delta::DeltaTables::in_dir(&absolute),
            root,
            objects: None,
        })
    }

    /// The lake in `objects`, whose files are encoded under the local directory `staging`
    /// (created if missing) before they are uploaded. Refused as [`Lake::open`] refuses one.
    pub fn in_object_store(
        objects: ObjectLake,
        staging: impl Into<PathBuf>,
    ) -> Result<Self, LakeError> {
        let mut lake = Self::open_dir(staging.into())?;
        lake.delta = crate::delta::DeltaTables::in_bucket(objects.clone());
        lake.objects = Some(Arc::new(objects));
        lake.check_layout()?;
        Ok(lake)
    }

    /// The layout [`LAYOUT_FILE`] names, and the gpuwarden that wrote it; `None` for a lake
    /// without one.
    pub fn layout(&self) -> Result<Option<(u64, Option<String>)>, LakeError> {
        let Some((bytes, _)) = self.read_state(Path::new(LAYOUT_FILE))? else {
            return Ok(None);
        };
        let marker: LayoutMarker = serde_json::from_slice(&bytes).map_err(|e| LakeError::Io {
            action: "reading the lake's layout from",
            path: PathBuf::from(format!("{}/{LAYOUT_FILE}", self.location())),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
        Ok(Some((marker.layout, marker.written_by)))
    }

    /// Refuses a lake whose layout is newer than this build's. A lake whose layout cannot be
    /// read now (a bucket out of reach) is let through with a warning: opening a lake touched
    /// nothing before the layout was kept, and a process that only sometimes reads it (the
    /// enforcer's portal) must still start; what reads the lake later fails on its own.
    fn check_layout(&self) -> Result<(), LakeError> {
        let layout = match self.layout() {
            Ok(layout) => layout,
            Err(e) => {
                tracing::warn!(lake = %self.location(), error = %e, "cannot read the lake's layout; not checked");
                None
            }
        };
        if let Some((layout, written_by)) = layout {
            gpuwarden_schema::format::check(
                || format!("the lake at {}", self.location()),
                "layout",
                layout,
                LAKE_LAYOUT,
                written_by,
            )?;
        }
        Ok(())
    }

    /// Writes [`LAYOUT_FILE`] naming this build's layout where the lake has none, once its
    /// tables are known to be of it (the rollups do, under their role, once they find no file of
    /// the layout before Delta). In a bucket the write is conditional on there being no object
    /// yet: another process that wrote one first wins, and its layout is checked instead.
    pub fn mark_layout(&self) -> Result<(), LakeError> {
        if self.layout()?.is_some() {
            return self.check_layout();
        }
        let marker = LayoutMarker {
            layout: LAKE_LAYOUT,
            written_by: Some(gpuwarden_schema::format::GPUWARDEN_VERSION.to_owned()),
        };
        let bytes = serde_json::to_vec(&marker).expect("the layout marker serializes");
        let path = Path::new(LAYOUT_FILE);
        match self.write_state(path, bytes, &mut StateVersion::default(), Role::Rollups) {
            Ok(()) => Ok(()),
            Err(LakeError::Deposed { .. }) => self.check_layout(),
            Err(e) => Err(e),
        }
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

    /// The local directory where a file of `table` is encoded before it goes into the table:
    /// `_staging/<table>` under the lake in a directory lake (so that the move is a rename), under
    /// the staging directory for a lake in an object store.
    pub fn staging_dir(&self, table: &str) -> PathBuf {
        self.root.join("_staging").join(table)
    }

    /// Serves the lake's objects to `ctx` at `s3://<bucket>`, for the tables read file by file
    /// ([`crate::delta::DeltaTables::file_url`]); nothing to do for a directory.
    pub fn register_object_store(&self, ctx: &datafusion::prelude::SessionContext) {
        if let Some(objects) = &self.objects {
            objects.register(ctx);
        }
    }

    /// Takes `role` on this lake without waiting; `Ok(None)` when another holder has it
    /// (another process, or another [`Lake::try_lock`] of the same role in this one).
    ///
    /// In a directory it is an exclusive `flock` on the role's lock file (created if missing),
    /// which lasts as long as the returned value and ends with the process however it ends, so
    /// a crash never leaves it taken. In a bucket it is the role's lock object
    /// (`_leases/<role>.json`, [`BucketLock`]) for `storage.s3.lease_ttl`, renewed while held
    /// and released when dropped; after a crash the role is free once the lock expires.
    pub fn try_lock(&self, role: Role) -> Result<Option<LakeLock>, LakeError> {
        if let Some(objects) = &self.objects {
            let ttl = objects.lock_ttl();
            let Some(lock) = BucketLock::try_take(objects, role.name(), &holder_name(), ttl)?
            else {
                return Ok(None);
            };
            let generation = lock.generation();
            let shared = Arc::new(KeeperShared {
                lock: std::sync::Mutex::new(Some(lock)),
                stop: std::sync::Mutex::new(false),
                wake: std::sync::Condvar::new(),
                deposed: std::sync::atomic::AtomicBool::new(false),
                role,
                lake: objects.display().to_string(),
            });
            let keeping = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name(format!("lock-{}", role.name()))
                .spawn(move || keeping.keep(ttl))
                .map_err(io("starting the lock thread of", Path::new(role.name())))?;
            return Ok(Some(LakeLock {
                path: BucketLock::path(role.name()),
                holding: Holding::Bucket(Keeper {
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
                holding: Holding::File(file),
            })),
            Err(fs::TryLockError::WouldBlock) => Ok(None),
            Err(fs::TryLockError::Error(source)) => Err(LakeError::Io {
                action: "locking",
                path,
                source,
            }),
        }
    }

    /// Where `role` is held on this lake, for messages: its lock file, or its lock object's URL.
    pub fn lock_location(&self, role: Role) -> PathBuf {
        match &self.objects {
            Some(objects) => PathBuf::from(format!(
                "{}/{}",
                objects.display(),
                BucketLock::path(role.name()).display()
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
