//! Reading a lake whose files are replaced under the reader.
//!
//! Compaction replaces an hour's raw files with its outputs and removes them, retention removes
//! whole hours, and a replay rewrites a file under its name. A query lists a table's
//! files, with their sizes, before it reads them: a file replaced between the two would be read
//! with the old size from the new file (`Src size is incorrect`, `Required field type_ is
//! missing`), and a removed one not at all.
//!
//! So a query reads the version it listed. [`Lake::write`] and [`Lake::remove`] keep the file
//! they replace or remove as a hard link `_versions/<inode>.parquet` for [`RETAIN`] (pruned at
//! most once a minute); the lake's
//! SQL sessions read local files through [`VersionedFs`], whose listing names each file with
//! its inode (`<name>.v<inode>.parquet`), and whose reads open that inode: the file at
//! the path if it is still the same one, else its kept version. A query running longer than
//! [`RETAIN`] over a file replaced meanwhile fails, naming the file.
//!
//! [`Lake::write`]: crate::lake::Lake::write
//! [`Lake::remove`]: crate::lake::Lake::remove

use std::fmt;
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;

use async_trait::async_trait;
use datafusion::object_store::local::LocalFileSystem;
use datafusion::object_store::path::Path;
use datafusion::object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use datafusion::prelude::SessionContext;
use futures::stream::{BoxStream, StreamExt as _, TryStreamExt as _};
use gpuwarden_schema::clock::wall_now_s;

use crate::compact::{Manifest, MANIFEST};

/// How long a replaced or removed lake file stays readable by queries that listed it.
pub const RETAIN: Duration = Duration::from_secs(10 * 60);

/// The directory under the lake root where replaced files are kept.
pub const VERSIONS_DIR: &str = "_versions";

/// How often the kept versions are looked through for ones past [`RETAIN`].
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// The kept versions of a lake's replaced files (`<lake>/_versions`).
#[derive(Debug)]
pub(crate) struct Versions {
    dir: PathBuf,
    /// When [`Versions::prune`] last ran, in seconds since the epoch.
    pruned_at: AtomicU64,
}

impl Versions {
    pub(crate) fn of(lake_root: &FsPath) -> Self {
        Self {
            dir: lake_root.join(VERSIONS_DIR),
            pruned_at: AtomicU64::new(0),
        }
    }

    /// Keeps the file at `path`, about to be replaced or removed, as `<dir>/<inode>.parquet`,
    /// and, at most every [`PRUNE_EVERY`], forgets the kept files older than [`RETAIN`].
    /// Nothing to keep is not an error.
    pub(crate) fn retire(&self, path: &FsPath) -> std::io::Result<()> {
        let inode = match std::fs::metadata(path) {
            Ok(metadata) => metadata.ino(),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        std::fs::create_dir_all(&self.dir)?;
        let now = wall_now_s();
        let last = self.pruned_at.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= PRUNE_EVERY.as_secs()
            && self
                .pruned_at
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.prune(now)?;
        }
        match std::fs::hard_link(path, self.dir.join(format!("{inode}.parquet"))) {
            Err(e) if e.kind() != ErrorKind::AlreadyExists => Err(e),
            _ => Ok(()),
        }
    }

    /// Removes kept versions linked more than [`RETAIN`] before `now` (a link's ctime is when
    /// it was made).
    fn prune(&self, now: u64) -> std::io::Result<()> {
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let Ok(metadata) = entry.metadata() else {
                continue;
            };
            let linked = u64::try_from(metadata.ctime()).unwrap_or(0);
            if now.saturating_sub(linked) > RETAIN.as_secs() {
                match std::fs::remove_file(entry.path()) {
                    Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// The local filesystem, read as the version each query listed (see the module docs).
#[derive(Debug)]
pub struct VersionedFs {
    inner: Arc<LocalFileSystem>,
    versions: PathBuf,
}

impl fmt::Display for VersionedFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VersionedFs({})", self.versions.display())
    }
}

const MARK: &str = ".v";
const EXTENSION: &str = ".parquet";

impl VersionedFs {
    /// Local files, with replaced ones kept under `<lake_root>/_versions`.
    pub fn new(lake_root: &FsPath) -> Self {
        Self {
            inner: Arc::new(LocalFileSystem::new()),
            versions: lake_root.join(VERSIONS_DIR),
        }
    }

    /// Serves every `file://` table of `ctx` through a [`VersionedFs`] of `lake_root`.
    pub fn register(ctx: &SessionContext, lake_root: &FsPath) {
        let url = datafusion::execution::object_store::ObjectStoreUrl::local_filesystem();
        ctx.runtime_env()
            .register_object_store(url.as_ref(), Arc::new(Self::new(lake_root)));
    }

    /// `dir/name` listed as `dir/name.v<inode>.parquet`: the name a read finds that inode by.
    fn name_version(meta: ObjectMeta) -> ObjectMeta {
        let inode = meta
            .e_tag
            .as_deref()
            .and_then(|tag| tag.split('-').next())
            .and_then(|hex| u64::from_str_radix(hex, 16).ok());
        match inode {
            Some(inode) if meta.location.as_ref().ends_with(EXTENSION) => {
                match Path::parse(format!("{}{MARK}{inode}{EXTENSION}", meta.location)) {
                    Ok(location) => ObjectMeta { location, ..meta },
                    Err(_) => meta,
                }
            }
            _ => meta,
        }
    }

    /// The path a versioned name was made from, and its inode.
    fn split(location: &Path) -> Option<(Path, u64)> {
        let name = location.as_ref().strip_suffix(EXTENSION)?;
        let (original, inode) = name.rsplit_once(MARK)?;
        if !original.ends_with(EXTENSION) {
            return None;
        }
        Some((Path::parse(original).ok()?, inode.parse().ok()?))
    }

    /// Opens `inode`: the file at `path` if it is still that one, else its kept version.
    fn open(&self, path: &FsPath, inode: u64) -> std::io::Result<(File, PathBuf)> {
        match File::open(path) {
            Ok(file) if file.metadata()?.ino() == inode => return Ok((file, path.to_owned())),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let kept = self.versions.join(format!("{inode}.parquet"));
        match File::open(&kept) {
            Ok(file) => Ok((file, kept)),
            Err(e) if e.kind() == ErrorKind::NotFound => Err(std::io::Error::new(
                ErrorKind::NotFound,
                format!(
                    "{} was replaced while the query read it, and the version it listed is \
                     gone (kept for {} s); run the query again",
                    path.display(),
                    RETAIN.as_secs()
                ),
            )),
            Err(e) => Err(e),
        }
    }
}

fn error(path: &FsPath, source: std::io::Error) -> datafusion::object_store::Error {
    if source.kind() == ErrorKind::NotFound {
        datafusion::object_store::Error::NotFound {
            path: path.display().to_string(),
            source: Box::new(source),
        }
    } else {
        datafusion::object_store::Error::Generic {
            store: "VersionedFs",
            source: Box::new(source),
        }
    }
}

/// How many times a listing is taken again when compactions keep committing under it.
pub(crate) const RELISTS: usize = 5;

/// An output an hour's compaction manifest names that a listing of the hour did not find.
#[derive(Debug)]
struct Unlisted {
    /// The hour directory's key.
    dir: String,
    /// The output's name.
    output: String,
}

/// A listing of the lake as its readers see it, shared by every store the lake is read through
/// (a directory's [`VersionedFs`], an object store's reader): `list` lists, answering the
/// objects and whatever else the listing carries (a delimiter listing's common prefixes, handed
/// back as they are), and only the objects [`shown`] shows are kept. While a manifest names an
/// output the listing missed (a compaction committed meanwhile), the lake is listed again, up to
/// [`RELISTS`] times, and then the listing fails ([`relisted`]).
pub(crate) async fn list_shown<T, L, LFut, F, Fut>(
    store: &'static str,
    prefix: Option<&Path>,
    list: L,
    manifest: F,
) -> Result<(Vec<ObjectMeta>, T)>
where
    L: Fn() -> LFut,
    LFut: std::future::Future<Output = Result<(Vec<ObjectMeta>, T)>>,
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<Manifest>>,
{
    let mut unlisted = None;
    for _ in 0..RELISTS {
        let (listed, rest) = list().await?;
        match shown(listed, &manifest).await? {
            Ok(shown) => return Ok((shown, rest)),
            Err(missing) => unlisted = Some(missing),
        }
    }
    Err(relisted(store, prefix, unlisted))
}

/// The files of `listed` that are part of their tables: in an hour with a compaction manifest,
/// the ones it shows ([`Manifest::shows`]); `manifest` reads an hour's manifest given the hour
/// directory's key. [`Unlisted`] when a manifest names an output the listing did not find: a
/// compaction committed while the hour was listed, so it must be listed again.
async fn shown<F, Fut>(
    listed: Vec<ObjectMeta>,
    manifest: F,
) -> Result<std::result::Result<Vec<ObjectMeta>, Unlisted>>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<Manifest>>,
{
    let dir_of = |meta: &ObjectMeta| -> (String, String) {
        let location = meta.location.as_ref();
        match location.rsplit_once('/') {
            Some((dir, name)) => (dir.to_owned(), name.to_owned()),
            None => (String::new(), location.to_owned()),
        }
    };
    let mut compacted: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for meta in &listed {
        let (dir, name) = dir_of(meta);
        if Manifest::concerns(&name) {
            compacted.entry(dir).or_default();
        }
    }
    if compacted.is_empty() {
        return Ok(Ok(listed));
    }
    for meta in &listed {
        let (dir, name) = dir_of(meta);
        if let Some(names) = compacted.get_mut(&dir) {
            names.push(name);
        }
    }
    let mut manifests = BTreeMap::new();
    for (dir, names) in compacted {
        let manifest = manifest(dir.clone()).await?;
        if let Some(output) = manifest.missing_in(names.iter().map(String::as_str)) {
            let output = output.to_owned();
            return Ok(Err(Unlisted { dir, output }));
        }
        manifests.insert(dir, manifest);
    }
    Ok(Ok(listed
        .into_iter()
        .filter(|meta| {
            let (dir, name) = dir_of(meta);
            manifests
                .get(&dir)
                .is_none_or(|manifest| manifest.shows(&name))
        })
        .collect()))
}

/// The manifest of the hour directory `dir` (a key of the local file system).
async fn local_manifest(inner: &LocalFileSystem, dir: String) -> Result<Manifest> {
    let path = inner.path_to_filesystem(&Path::from(dir.as_str()))?;
    Manifest::read(&path).map_err(|e| error(&path, e))
}

/// The error of a listing of `prefix` that found, each of the [`RELISTS`] times it was taken,
/// an output a manifest names missing (`unlisted`, the last time).
fn relisted(
    store: &'static str,
    prefix: Option<&Path>,
    unlisted: Option<Unlisted>,
) -> datafusion::object_store::Error {
    let what = match unlisted {
        Some(Unlisted { dir, output }) => format!(
            "{dir}/{MANIFEST} names {output}, which {RELISTS} listings in a row did not find: \
             either compactions kept committing while the query listed the lake (run it again), \
             or the file is gone and the hour damaged (`gpuwarden compact` says what to restore)"
        ),
        None => format!(
            "{}: compactions kept replacing files while it was listed {RELISTS} times; run the \
             query again",
            prefix.map_or("the lake", |p| p.as_ref())
        ),
    };
    datafusion::object_store::Error::Generic {
        store,
        source: what.into(),
    }
}

#[async_trait]
impl ObjectStore for VersionedFs {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let Some((original, inode)) = Self::split(location) else {
            return self.inner.get_opts(location, options).await;
        };
        let path = self.inner.path_to_filesystem(&original)?;
        let (file, opened) = self.open(&path, inode).map_err(|e| error(&path, e))?;
        let metadata = file.metadata().map_err(|e| error(&opened, e))?;
        let size = metadata.len();
        let range = match &options.range {
            Some(range) => {
                range
                    .as_range(size)
                    .map_err(|e| datafusion::object_store::Error::Generic {
                        store: "VersionedFs",
                        source: Box::new(e),
                    })?
            }
            None => 0..size,
        };
        let meta = ObjectMeta {
            location: location.clone(),
            last_modified: metadata
                .modified()
                .map_or_else(|_| Default::default(), Into::into),
            size,
            e_tag: None,
            version: None,
        };
        let payload = if options.head {
            GetResultPayload::Stream(futures::stream::empty().boxed())
        } else {
            GetResultPayload::File(file, opened)
        };
        Ok(GetResult {
            payload,
            meta,
            range,
            attributes: Default::default(),
        })
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        let inner = Arc::clone(&self.inner);
        let prefix = prefix.cloned();
        futures::stream::once(async move {
            let fs: &LocalFileSystem = &inner;
            let prefix = prefix.as_ref();
            let list = move || async move { Ok((fs.list(prefix).try_collect().await?, ())) };
            let shown = list_shown("VersionedFs", prefix, list, |dir| local_manifest(fs, dir));
            shown.await.map(|(shown, ())| shown)
        })
        .map_ok(|shown| futures::stream::iter(shown.into_iter().map(Ok)))
        .try_flatten()
        .map(|meta| meta.map(Self::name_version))
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        let fs: &LocalFileSystem = &self.inner;
        let list = move || async move {
            let mut listed = fs.list_with_delimiter(prefix).await?;
            Ok((std::mem::take(&mut listed.objects), listed))
        };
        let (shown, mut listed) =
            list_shown("VersionedFs", prefix, list, |dir| local_manifest(fs, dir)).await?;
        listed.objects = shown.into_iter().map(Self::name_version).collect();
        Ok(listed)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::object_store::ObjectStoreExt as _;

    #[tokio::test]
    async fn a_listed_file_reads_as_listed_after_it_is_replaced_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let file = root.join("t/hour=00/rollup.parquet");
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, b"first version").unwrap();
        let store = VersionedFs::new(root);
        let prefix = Path::from_filesystem_path(root.join("t")).unwrap();
        let listed: Vec<ObjectMeta> = store.list(Some(&prefix)).try_collect().await.unwrap();
        assert_eq!(listed.len(), 1);
        let first = listed[0].clone();
        assert!(
            first.location.as_ref().ends_with(".parquet"),
            "{}",
            first.location
        );
        assert_eq!(first.size, 13);

        // Replaced the way Lake::write replaces: keep the old inode, rename a new file over it.
        let versions = Versions::of(root);
        versions.retire(&file).unwrap();
        let tmp = root.join("t/hour=00/.rollup.parquet.tmp");
        std::fs::write(&tmp, b"the second, longer version").unwrap();
        std::fs::rename(&tmp, &file).unwrap();
        let bytes = store.get_range(&first.location, 6..13).await.unwrap();
        assert_eq!(&bytes[..], b"version");
        let whole = store
            .get(&first.location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&whole[..], b"first version");

        // A new listing reads the new file.
        let listed: Vec<ObjectMeta> = store.list(Some(&prefix)).try_collect().await.unwrap();
        assert_eq!(listed[0].size, 26);
        let second = listed[0].clone();
        assert_ne!(first.location, second.location);
        let head = store.head(&second.location).await.unwrap();
        assert_eq!(head.size, 26);

        // Removed the way Lake::remove removes: still readable by the listing that saw it.
        versions.retire(&file).unwrap();
        std::fs::remove_file(&file).unwrap();
        let whole = store
            .get(&second.location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&whole[..], b"the second, longer version");

        // Gone from the versions too: an error that says what happened.
        std::fs::remove_dir_all(root.join(VERSIONS_DIR)).unwrap();
        let err = store.get(&second.location).await.unwrap_err().to_string();
        assert!(
            err.contains("was replaced while the query read it"),
            "{err}"
        );
    }
}
