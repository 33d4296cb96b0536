//! The lake's object-store client ([`ObjectLake`]) for a lake in an S3-compatible bucket
//! (`storage.lake = "s3://bucket/prefix"`): the keys the lake's relative paths map to, and the
//! reads and writes the lake makes there (docs/src/contributors/object-storage.md).
//!
//! Every request runs on a small runtime of the lake's own (`lake-io` threads): the lake's callers
//! are writer threads, the ingest's finishing threads and query threads, each with its own
//! runtime or none, and the HTTP client's pooled connections must outlive whichever of them
//! happened to open one. The lake's synchronous methods hand a request to that runtime and wait
//! for its answer (`ObjectLake::block`); the stores handed to DataFusion run their requests
//! there too, through object_store's `SpawnedReqwestConnector`.
//!
//! Publication needs no temporary object: a PUT (or the completion of a multipart upload) makes
//! the whole object visible at once. Which objects make up a table is its Delta log's to say
//! (`delta`); the state objects and the roles' lock objects are written conditionally.

use std::fmt;
use std::future::Future;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::SessionContext;
use futures::stream::{BoxStream, TryStreamExt as _};
use gpuwarden_schema::config::S3Config;
use object_store::aws::AmazonS3Builder;
use object_store::client::SpawnedReqwestConnector;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt as _, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
    UpdateVersion, WriteMultipart,
};

use crate::base::LakeError;

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
    client: Arc<dyn ObjectStore>,
    /// `s3://<bucket>`: the store's URL in a DataFusion session.
    url: ObjectStoreUrl,
    /// Every key of the lake starts with it; empty for a whole bucket.
    prefix: Path,
    /// `s3://bucket/prefix`, for messages.
    display: String,
    io: Arc<IoRuntime>,
    /// How long a role's lock lasts unless renewed (`storage.s3.lease_ttl`).
    lock_ttl: std::time::Duration,
}

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
        let client = builder.build().map_err(|source| LakeError::ObjectStore {
            action: "configuring the client of",
            key: String::new(),
            lake: display.clone(),
            source: Box::new(source),
        })?;
        let url = ObjectStoreUrl::parse(format!("s3://{bucket}")).map_err(|e| {
            LakeError::ObjectStore {
                action: "naming",
                key: String::new(),
                lake: display.clone(),
                source: Box::new(object_store::Error::Generic {
                    store: "S3",
                    source: Box::new(e),
                }),
            }
        })?;
        let prefix = Path::parse(prefix).map_err(|source| LakeError::ObjectStore {
            action: "reading the prefix of",
            key: prefix.to_string(),
            lake: display.clone(),
            source: Box::new(source.into()),
        })?;
        Ok(Self {
            client: Arc::new(client),
            url,
            prefix,
            display,
            io,
            lock_ttl: s3.lease_ttl(),
        })
    }

    /// How long a role's lock object on this lake lasts unless its holder renews it
    /// (`storage.s3.lease_ttl`).
    pub fn lock_ttl(&self) -> std::time::Duration {
        self.lock_ttl
    }

    /// The client, with `/` the bucket's root.
    pub(crate) fn client(&self) -> Arc<dyn ObjectStore> {
        Arc::clone(&self.client)
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
        let request = request(Arc::clone(&self.client));
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
        move |source| LakeError::ObjectStore {
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
        self.block(move |client| async move {
            client.put(&k, PutPayload::from(bytes)).await.map(|_| ())
        })
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
            .map_err(crate::base::io("reading", path))?
            .len();
        if size <= PART_BYTES as u64 {
            let bytes = std::fs::read(path).map_err(crate::base::io("reading", path))?;
            self.put(relative, bytes)?;
            return Ok(size);
        }
        let (k, path_owned) = (key.clone(), path.to_path_buf());
        self.block(move |client| async move { upload(client, k, path_owned).await })
            .map_err(|e| match e {
                Upload::ObjectStore(source) => self.error("uploading", &key)(source),
                Upload::Read(source) => crate::base::io("reading", path)(source),
            })?;
        Ok(size)
    }

    /// The object `relative`, or `None` when there is none.
    pub fn get(&self, relative: &FsPath) -> Result<Option<Bytes>, LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |client| async move {
            match client.get(&k).await {
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
        match self.block(move |client| async move {
            let got = client.get(&k).await?;
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
        match self.block(move |client| async move {
            client
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

    /// Whether the object `relative` exists.
    pub fn exists(&self, relative: &FsPath) -> Result<bool, LakeError> {
        let key = self.key(relative);
        let k = key.clone();
        match self.block(move |client| async move { client.head(&k).await }) {
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
        match self.block(move |client| async move { client.delete(&k).await }) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("deleting", &key)(e)),
        }
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
            .block(move |client| async move { client.list(Some(&d)).try_collect().await })
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
        self.block(move |client| async move { client.list_with_delimiter(Some(&d)).await })
            .map_err(self.error("listing", &dir))
    }

    /// Serves the lake's objects to `ctx`'s tables at `s3://<bucket>`.
    pub fn register(&self, ctx: &SessionContext) {
        let reader = LakeReader {
            inner: Arc::clone(&self.client),
            display: self.display.clone(),
            _io: Arc::clone(&self.io),
        };
        ctx.runtime_env()
            .register_object_store(self.url.as_ref(), Arc::new(reader));
    }
}

/// Why a multipart upload failed: the object store's answer, or reading the local file.
enum Upload {
    ObjectStore(object_store::Error),
    Read(std::io::Error),
}

async fn upload(client: Arc<dyn ObjectStore>, key: Path, path: PathBuf) -> Result<(), Upload> {
    use tokio::io::AsyncReadExt as _;
    let mut file = tokio::fs::File::open(&path).await.map_err(Upload::Read)?;
    let mut upload = WriteMultipart::new_with_chunk_size(
        client
            .put_multipart(&key)
            .await
            .map_err(Upload::ObjectStore)?,
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
            return Err(Upload::ObjectStore(e));
        }
        upload.write(&buffer[..read]);
    }
    upload
        .finish()
        .await
        .map(|_| ())
        .map_err(Upload::ObjectStore)
}

/// The lake's bucket as a DataFusion session reads it: the client, holding the lake's runtime,
/// which its connections live on, for as long as the session keeps it.
struct LakeReader {
    inner: Arc<dyn ObjectStore>,
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

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}
