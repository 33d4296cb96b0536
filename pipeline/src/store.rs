//! A lake in an S3-compatible object store (`storage.lake = "s3://bucket/prefix"`): the client,
//! the keys the lake's relative paths map to, and the reads and writes [`crate::lake::Lake`]
//! makes of it there (docs/ARCHITECTURE.md#the-lake-on-object-storage).
//!
//! Every request runs on a small runtime of the lake's own (`lake-io` threads): the lake's callers
//! are writer threads, the ingest's finishing threads and query threads, each with its own
//! runtime or none, and the HTTP client's pooled connections must outlive whichever of them
//! happened to open one. The lake's synchronous methods hand a request to that runtime and wait
//! for its answer (`ObjectLake::block`); the stores handed to DataFusion run their requests
//! there too, through object_store's `SpawnedReqwestConnector`.
//!
//! Publication needs no temporary object: a PUT (or the completion of a multipart upload) makes
//! the whole object visible at once, and a file's name is its source and range, so a replay puts
//! the same object again. A reader of the lake sees it through `LakeReader`, which applies
//! each hour's compaction manifest to a listing as `VersionedFs` does for a directory.

use std::fmt;
use std::future::Future;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::SessionContext;
use futures::stream::{BoxStream, StreamExt as _, TryStreamExt as _};
use gpuwarden_schema::config::S3Config;
use object_store::aws::AmazonS3Builder;
use object_store::client::SpawnedReqwestConnector;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt as _, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
    UpdateVersion, WriteMultipart,
};

use crate::lake::LakeError;

/// Files larger than this go up as multipart uploads, in parts of this size.
const PART_BYTES: usize = 16 * 1024 * 1024;

/// The runtime every request of one lake runs on. Dropped without waiting, so that a lake may be
/// dropped anywhere, an async context included.
struct IoRuntime(Option<tokio::runtime::Runtime>);

impl IoRuntime {
    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("runs until dropped").handle()
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// The lake's prefix of a bucket, and the client that reaches it. A clone shares the client
/// and its runtime.
#[derive(Clone)]
pub struct ObjectLake {
    store: Arc<dyn ObjectStore>,
    /// `s3://<bucket>`: the store's URL in a DataFusion session.
    url: ObjectStoreUrl,
    /// Every key of the lake starts with it; empty for a whole bucket.
    prefix: Path,
    /// `s3://bucket/prefix`, for messages.
    display: String,
    io: Arc<IoRuntime>,
    /// How long a role's lease lasts unless renewed (`storage.s3.lease_ttl`).
    lease_ttl: std::time::Duration,
}

/// Where an object the lake replaced or removed is kept for the queries that listed it,
/// relative to the lake's root: `_versions/<its own relative key>`.
pub const VERSIONS: &str = "_versions";

impl fmt::Debug for ObjectLake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectLake({})", self.display)
    }
}

impl ObjectLake {
    /// A client of `s3://bucket/prefix`, configured from `s3` and, for what it leaves unset,
    /// the standard AWS environment variables. Builds the client only: a bucket that cannot be
    /// reached fails the first request, with the store's answer.
    pub fn s3(bucket: &str, prefix: &str, s3: &S3Config) -> Result<Self, LakeError> {
        let display = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("lake-io")
            .enable_all()
            .build()
            .map_err(|source| LakeError::Io {
                action: "starting the IO threads of",
                path: PathBuf::from(&display),
                source,
            })?;
        let io = Arc::new(IoRuntime(Some(runtime)));
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_http_connector(SpawnedReqwestConnector::new(io.handle().clone()));
        if let Some(endpoint) = &s3.endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        if let Some(region) = &s3.region {
            builder = builder.with_region(region);
        }
        if let Some(key) = &s3.access_key_id {
            builder = builder.with_access_key_id(key);
        }
        if let Some(secret) = &s3.secret_access_key {
            builder = builder.with_secret_access_key(secret);
        }
        if let Some(token) = &s3.session_token {
            builder = builder.with_token(token);
        }
        if let Some(allow) = s3.allow_http {
            builder = builder.with_allow_http(allow);
        }
        let store = builder.build().map_err(|source| LakeError::Store {
            action: "configuring the client of",
            key: String::new(),
            lake: display.clone(),
            source: Box::new(source),
        })?;
        let url =
            ObjectStoreUrl::parse(format!("s3://{bucket}")).map_err(|e| LakeError::Store {
                action: "naming",
                key: String::new(),
                lake: display.clone(),
                source: Box::new(object_store::Error::Generic {
                    store: "S3",
                    source: Box::new(e),
                }),
            })?;
        let prefix = Path::parse(prefix).map_err(|source| LakeError::Store {
            action: "reading the prefix of",
            key: prefix.to_string(),
            lake: display.clone(),
            source: Box::new(source.into()),
        })?;
        Ok(Self {
            store: Arc::new(store),
            url,
            prefix,
            display,
            io,
            lease_ttl: s3.lease_ttl(),
        })
    }

    /// How long a role's lease on this lake lasts unless its holder renews it.
    pub fn lease_ttl(&self) -> std::time::Duration {
        self.lease_ttl
    }

    /// The client, with `/` the bucket's root.
    pub(crate) fn store(&self) -> Arc<dyn ObjectStore> {
        Arc::clone(&self.store)
    }

    /// `s3://bucket/prefix`.
    pub fn display(&self) -> &str {
        &self.display
    }

    /// The key of `relative` (a path relative to the lake's root, `/`-separated on any OS).
    pub fn key(&self, relative: &FsPath) -> Path {
        let mut key = self.prefix.clone();
        for part in relative.iter() {
            key = key.join(part.to_string_lossy().as_ref());
        }
        key
    }

    /// The URL DataFusion lists the directory `relative` of the lake by (ends with `/`).
    pub fn dir_url(&self, relative: &FsPath) -> String {
        format!("{}{}/", self.url.as_str(), self.key(relative))
    }

    /// Runs `request` on the lake's runtime and waits for it. Callable from any thread; from an
    /// async context it blocks that thread meanwhile, as a file system call would.
    fn block<T, F>(&self, request: impl FnOnce(Arc<dyn ObjectStore>) -> F) -> T
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let request = request(Arc::clone(&self.store));
        self.io.handle().spawn(async move {
            let _ = tx.send(request.await);
        });
        rx.recv()
            .expect("the lake's IO runtime runs as long as the lake")
    }

    fn error(
        &self,
        action: &'static str,
        key: &Path,
    ) -> impl FnOnce(object_store::Error) -> LakeError {
        let (key, lake) = (key.to_string(), self.display.clone());
        move |source| LakeError::Store {
            action,
            key,
            lake,
            source: Box::new(source),
        }
    }

    /// Puts `bytes` as `relative`, replacing what was there: visible whole or not at all.
    pub fn put(&self, relative: &FsPath, bytes: Vec<u8>) -> Result<(), LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        self.block(
            move |store| async move { store.put(&k, PutPayload::from(bytes)).await.map(|_| ()) },
        )
        .map_err(self.error("writing", &key))
    }

    /// Uploads the local file `path` as `relative`: one PUT up to `PART_BYTES`, a multipart
    /// upload above. The object appears when the upload completes, whole. A failed upload is
    /// aborted, so that no parts are left to pay for, except when its last part fails
    /// (`WriteMultipart::finish` aborts only a failed completion): those parts wait for the
    /// bucket's rule for incomplete multipart uploads. Returns the size.
    pub fn put_file(&self, relative: &FsPath, path: &FsPath) -> Result<u64, LakeError> {
        let key = self.key(relative);
        let size = std::fs::metadata(path)
            .map_err(crate::lake::io("reading", path))?
            .len();
        if size <= PART_BYTES as u64 {
            let bytes = std::fs::read(path).map_err(crate::lake::io("reading", path))?;
            self.put(relative, bytes)?;
            return Ok(size);
        }
        let (k, path_owned) = (key.clone(), path.to_path_buf());
        self.block(move |store| async move { upload(store, k, path_owned).await })
            .map_err(|e| match e {
                Upload::Store(source) => self.error("uploading", &key)(source),
                Upload::Read(source) => crate::lake::io("reading", path)(source),
            })?;
        Ok(size)
    }

    /// The object `relative`, or `None` when there is none.
    pub fn get(&self, relative: &FsPath) -> Result<Option<Bytes>, LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |store| async move {
            match store.get(&k).await {
                Ok(got) => got.bytes().await,
                Err(e) => Err(e),
            }
        }) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("reading", &key)(e)),
        }
    }

    /// The object `relative` and the version it was read at (its ETag, and its version id where
    /// the bucket keeps versions), or `None` when there is none: what a conditional
    /// [`ObjectLake::put_if`] names to replace exactly this object.
    pub fn get_versioned(
        &self,
        relative: &FsPath,
    ) -> Result<Option<(Bytes, UpdateVersion)>, LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |store| async move {
            let got = store.get(&k).await?;
            let version = UpdateVersion {
                e_tag: got.meta.e_tag.clone(),
                version: got.meta.version.clone(),
            };
            Ok((got.bytes().await?, version))
        }) {
            Ok(read) => Ok(Some(read)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("reading", &key)(e)),
        }
    }

    /// Puts `bytes` as `relative` only if `mode` holds when the store writes it: `Create`, no
    /// object there; `Update(v)`, the object there is still the version `v`. Returns the new
    /// object's version, or `None` when the condition did not hold and nothing was written.
    ///
    /// A conditional PUT the client retried (a timeout, a 5xx) after the store had already
    /// written it answers `None`: the caller may lose what it in fact won, never the reverse.
    pub fn put_if(
        &self,
        relative: &FsPath,
        bytes: Vec<u8>,
        mode: PutMode,
    ) -> Result<Option<UpdateVersion>, LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |store| async move {
            store
                .put_opts(&k, PutPayload::from(bytes), PutOptions::from(mode))
                .await
        }) {
            Ok(put) => Ok(Some(UpdateVersion {
                e_tag: put.e_tag,
                version: put.version,
            })),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Ok(None),
            Err(e) => Err(self.error("writing", &key)(e)),
        }
    }

    /// The Parquet metadata (footer) of the object `relative`, read with a HEAD and a ranged GET
    /// of its end (two when the footer is larger than the first guess), not the whole file.
    /// (Bounded ranges, not suffix ranges: s3s-fs answers 500 to a suffix longer than the
    /// object, which S3 answers with the whole object.)
    pub fn parquet_metadata(
        &self,
        relative: &FsPath,
    ) -> Result<parquet::file::metadata::ParquetMetaData, LakeError> {
        const GUESS: u64 = 64 * 1024;
        let key = self.key(relative);
        let k = key.clone();
        let size = self
            .block(move |store| async move { store.head(&k).await })
            .map_err(self.error("reading the footer of", &key))?
            .size;
        let suffix = |n: u64| {
            let k = key.clone();
            self.block(move |store| async move {
                let options = GetOptions {
                    range: Some(object_store::GetRange::Bounded(
                        size.saturating_sub(n)..size,
                    )),
                    ..GetOptions::default()
                };
                store.get_opts(&k, options).await?.bytes().await
            })
            .map_err(self.error("reading the footer of", &key))
        };
        let parquet = |source| LakeError::Parquet {
            path: relative.to_path_buf(),
            source,
        };
        let mut tail = suffix(GUESS)?;
        let footer_of = |tail: &Bytes| -> Result<usize, LakeError> {
            let end: [u8; 8] = tail
                .get(tail.len().saturating_sub(8)..)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| {
                    parquet(parquet::errors::ParquetError::General(
                        "shorter than a Parquet footer".into(),
                    ))
                })?;
            let footer = parquet::file::metadata::FooterTail::try_new(&end).map_err(parquet)?;
            Ok(footer.metadata_length())
        };
        let length = footer_of(&tail)?;
        if length + 8 > tail.len() {
            tail = suffix(length as u64 + 8)?;
        }
        let start = tail.len() - 8 - length;
        parquet::file::metadata::ParquetMetaDataReader::decode_metadata(
            &tail[start..tail.len() - 8],
        )
        .map_err(parquet)
    }

    /// Whether the object `relative` exists.
    pub fn exists(&self, relative: &FsPath) -> Result<bool, LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |store| async move { store.head(&k).await }) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.error("looking up", &key)(e)),
        }
    }

    /// Deletes the object `relative`; a missing one is not an error (S3's DELETE answers the
    /// same either way).
    pub fn delete(&self, relative: &FsPath) -> Result<(), LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |store| async move { store.delete(&k).await }) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("deleting", &key)(e)),
        }
    }

    /// Removes the object `relative` so that a query that listed it still reads it: copied
    /// first to `_versions/<relative>` (a server-side copy), where
    /// [`ObjectLake::sweep_versions`] deletes it [`crate::versions::RETAIN`] later, and read
    /// from there by `LakeReader` when the original is gone. `false` when there was nothing.
    /// Only objects that are never written again with other bytes are retired this way (raw
    /// files, whose names are their offsets and digests), so a kept version is the version a
    /// query listed.
    pub fn retire(&self, relative: &FsPath) -> Result<bool, LakeError> {
        let key = self.key(relative);
        let kept = self.key(&FsPath::new(VERSIONS).join(relative));
        let (from, to) = (key.clone(), kept);
        match self.block(move |store| async move { store.copy(&from, &to).await }) {
            Ok(()) => {}
            Err(object_store::Error::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(self.error("keeping a version of", &key)(e)),
        }
        self.delete(relative)?;
        Ok(true)
    }

    /// Deletes the versions kept by [`ObjectLake::retire`] that were kept longer ago than
    /// `retain` (by the store's clock, against this host's: they should agree to well within
    /// it). Returns how many went.
    pub fn sweep_versions(&self, retain: std::time::Duration) -> Result<usize, LakeError> {
        let dir = self.key(FsPath::new(VERSIONS));
        let d = dir.clone();
        let listed: Vec<ObjectMeta> = self
            .block(move |store| async move { store.list(Some(&d)).try_collect().await })
            .map_err(self.error("listing", &dir))?;
        let cutoff = crate::lease::now_ms()
            .saturating_sub(i64::try_from(retain.as_millis()).unwrap_or(i64::MAX));
        let old: Vec<Path> = listed
            .into_iter()
            .filter(|meta| meta.last_modified.timestamp_millis() < cutoff)
            .map(|meta| meta.location)
            .collect();
        let count = old.len();
        for key in old {
            let k = key.clone();
            match self.block(move |store| async move { store.delete(&k).await }) {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.error("deleting", &key)(e)),
            }
        }
        Ok(count)
    }

    /// The objects right under the directory `relative` (not in its subdirectories): their
    /// names and sizes.
    pub fn list_dir(&self, relative: &FsPath) -> Result<Vec<(String, u64)>, LakeError> {
        Ok(self
            .list_with_delimiter(relative)?
            .objects
            .into_iter()
            .filter_map(|meta| Some((meta.location.filename()?.to_string(), meta.size)))
            .collect())
    }

    /// The objects under the directory `relative`, at any depth, as paths relative to it.
    pub fn list(&self, relative: &FsPath) -> Result<Vec<PathBuf>, LakeError> {
        let dir = self.key(relative);
        let d = dir.clone();
        let listed: Vec<ObjectMeta> = self
            .block(move |store| async move { store.list(Some(&d)).try_collect().await })
            .map_err(self.error("listing", &dir))?;
        Ok(listed
            .into_iter()
            .filter_map(|meta| {
                let parts: Vec<String> = meta
                    .location
                    .prefix_match(&dir)?
                    .map(|p| p.as_ref().to_string())
                    .collect();
                Some(parts.iter().collect())
            })
            .collect())
    }

    /// The names of the "directories" right under `relative` (the common prefixes of a listing
    /// with the `/` delimiter).
    pub fn subdirs(&self, relative: &FsPath) -> Result<Vec<String>, LakeError> {
        Ok(self
            .list_with_delimiter(relative)?
            .common_prefixes
            .into_iter()
            .filter_map(|p| Some(p.filename()?.to_string()))
            .collect())
    }

    /// One level of the directory `relative`: a listing with the `/` delimiter.
    fn list_with_delimiter(&self, relative: &FsPath) -> Result<ListResult, LakeError> {
        let dir = self.key(relative);
        let d = dir.clone();
        self.block(move |store| async move { store.list_with_delimiter(Some(&d)).await })
            .map_err(self.error("listing", &dir))
    }

    /// Serves the lake's objects to `ctx`'s tables at `s3://<bucket>`, read through
    /// `LakeReader`.
    pub fn register(&self, ctx: &SessionContext) {
        let reader = LakeReader {
            inner: Arc::clone(&self.store),
            prefix: self.prefix.clone(),
            display: self.display.clone(),
            _io: Arc::clone(&self.io),
        };
        ctx.runtime_env()
            .register_object_store(self.url.as_ref(), Arc::new(reader));
    }
}

enum Upload {
    Store(object_store::Error),
    Read(std::io::Error),
}

async fn upload(store: Arc<dyn ObjectStore>, key: Path, path: PathBuf) -> Result<(), Upload> {
    use tokio::io::AsyncReadExt as _;
    let mut file = tokio::fs::File::open(&path).await.map_err(Upload::Read)?;
    let mut upload = WriteMultipart::new_with_chunk_size(
        store.put_multipart(&key).await.map_err(Upload::Store)?,
        PART_BYTES,
    );
    let mut buffer = vec![0; PART_BYTES];
    loop {
        let read = match file.read(&mut buffer).await {
            Ok(0) => break,
            Ok(read) => read,
            Err(e) => {
                let _ = upload.abort().await;
                return Err(Upload::Read(e));
            }
        };
        if let Err(e) = upload.wait_for_capacity(2).await {
            let _ = upload.abort().await;
            return Err(Upload::Store(e));
        }
        upload.write(&buffer[..read]);
    }
    upload.finish().await.map(|_| ()).map_err(Upload::Store)
}

/// The lake's bucket as DataFusion reads it: listings show each hour as its compaction manifest
/// says ([`crate::compact::Manifest::shows`]), like `VersionedFs` for a directory; writes go
/// through unchanged. Holds the lake's runtime, which its client's connections live on.
struct LakeReader {
    inner: Arc<dyn ObjectStore>,
    /// The lake's prefix: a retired object's kept version is `<prefix>/_versions/<relative>`.
    prefix: Path,
    display: String,
    _io: Arc<IoRuntime>,
}

impl fmt::Debug for LakeReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LakeReader({})", self.display)
    }
}

impl fmt::Display for LakeReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Reads the manifest of the hour directory `dir` (a key) through `store`.
async fn read_manifest(
    store: Arc<dyn ObjectStore>,
    dir: String,
) -> Result<crate::compact::Manifest> {
    let key = Path::from(dir).join(crate::compact::MANIFEST);
    let bytes = match store.get(&key).await {
        Ok(got) => got.bytes().await?,
        Err(object_store::Error::NotFound { .. }) => return Ok(Default::default()),
        Err(e) => return Err(e),
    };
    crate::compact::Manifest::parse(&bytes, key.as_ref()).map_err(|e| {
        object_store::Error::Generic {
            store: "S3",
            source: Box::new(e),
        }
    })
}

#[async_trait]
impl ObjectStore for LakeReader {
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

    /// A file removed since it was listed (retired: a compaction's input, a replaced rollup
    /// file) is read from the version kept for this.
    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        match self.inner.get_opts(location, options.clone()).await {
            Err(object_store::Error::NotFound { path, source }) => {
                let Some(relative) = location.prefix_match(&self.prefix) else {
                    return Err(object_store::Error::NotFound { path, source });
                };
                let kept = relative.fold(self.prefix.clone().join(VERSIONS), |key, part| {
                    key.join(part.as_ref())
                });
                match self.inner.get_opts(&kept, options).await {
                    Err(object_store::Error::NotFound { .. }) => {
                        Err(object_store::Error::NotFound { path, source })
                    }
                    found => found,
                }
            }
            got => got,
        }
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
            let (store, prefix) = (&inner, prefix.as_ref());
            let list = move || async move { Ok((store.list(prefix).try_collect().await?, ())) };
            let read = |dir: String| read_manifest(Arc::clone(store), dir);
            let shown = crate::versions::list_shown("S3", prefix, list, read).await;
            shown.map(|(shown, ())| shown)
        })
        .map_ok(|shown| futures::stream::iter(shown.into_iter().map(Ok)))
        .try_flatten()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        let store = &self.inner;
        let list = move || async move {
            let mut listed = store.list_with_delimiter(prefix).await?;
            Ok((std::mem::take(&mut listed.objects), listed))
        };
        let read = |dir: String| read_manifest(Arc::clone(store), dir);
        let (shown, mut listed) = crate::versions::list_shown("S3", prefix, list, read).await?;
        listed.objects = shown;
        Ok(listed)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}
