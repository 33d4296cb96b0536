//! The S3 server of gpuwarden's lake-on-S3 tests: s3s-fs 0.14.1 (a directory served over the S3
//! API) behind a per-key read-write lock, so that each request sees one version of a key, as S3
//! promises. s3s-fs alone does two things in two steps (dev/s3-research/README.md): a conditional
//! write checks the ETag, then writes; a GET opens the file, then reads the ETag kept beside it,
//! so a write landing in between answers the old body with the new ETag, and a conditional write
//! on that ETag then succeeds over a version its writer never read. Writes (put, complete
//! multipart, copy, delete) hold a key's lock exclusively; GET and HEAD share it. Writes made to
//! the directory behind the server's back are not locked.
//!
//! `gpuwarden-s3-test-server [--host H] [--port P] [--request-log FILE] --access-key K
//! --secret-key S ROOT`: the arguments of `s3s-fs`, and a file to append one line per request to
//! (`<method> <path and query>`), for bench/lake-s3.sh to count requests by. It prints
//! `server is running at http://<address>` once it listens.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use s3s::dto::*;
use s3s::{S3, S3Request, S3Response, S3Result};
use s3s_fs::FileSystem;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// A lock per (bucket, key) ever requested.
type KeyLocks = HashMap<(String, String), Arc<RwLock<()>>>;

struct Locked {
    fs: FileSystem,
    locks: Mutex<KeyLocks>,
}

impl Locked {
    fn lock_of(&self, bucket: &str, key: &str) -> Arc<RwLock<()>> {
        let mut map = self.locks.lock().unwrap();
        map.entry((bucket.to_owned(), key.to_owned()))
            .or_default()
            .clone()
    }

    /// The key's lock, held alone: for a request that changes the key.
    async fn lock(&self, bucket: &str, key: &str) -> OwnedRwLockWriteGuard<()> {
        self.lock_of(bucket, key).write_owned().await
    }

    /// The key's lock, shared with other readers: for a request that reads the key's body or
    /// ETag, so that both come from one version.
    async fn read_lock(&self, bucket: &str, key: &str) -> OwnedRwLockReadGuard<()> {
        self.lock_of(bucket, key).read_owned().await
    }
}

#[async_trait]
impl S3 for Locked {
    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        self.fs.create_bucket(req).await
    }
    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        self.fs.delete_bucket(req).await
    }
    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.fs.get_bucket_location(req).await
    }
    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        // The body streams from the file opened under the lock: a later rename over the key
        // leaves it as it was.
        let _g = self.read_lock(&req.input.bucket, &req.input.key).await;
        self.fs.get_object(req).await
    }
    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.fs.head_bucket(req).await
    }
    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let _g = self.read_lock(&req.input.bucket, &req.input.key).await;
        self.fs.head_object(req).await
    }
    async fn list_buckets(
        &self,
        req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        self.fs.list_buckets(req).await
    }
    async fn list_objects(
        &self,
        req: S3Request<ListObjectsInput>,
    ) -> S3Result<S3Response<ListObjectsOutput>> {
        self.fs.list_objects(req).await
    }
    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        self.fs.list_objects_v2(req).await
    }
    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        self.fs.create_multipart_upload(req).await
    }
    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        self.fs.upload_part(req).await
    }
    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        self.fs.upload_part_copy(req).await
    }
    async fn list_parts(
        &self,
        req: S3Request<ListPartsInput>,
    ) -> S3Result<S3Response<ListPartsOutput>> {
        self.fs.list_parts(req).await
    }
    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        self.fs.abort_multipart_upload(req).await
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let _g = self.lock(&req.input.bucket, &req.input.key).await;
        self.fs.put_object(req).await
    }
    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let _g = self.lock(&req.input.bucket, &req.input.key).await;
        self.fs.complete_multipart_upload(req).await
    }
    async fn copy_object(
        &self,
        req: S3Request<CopyObjectInput>,
    ) -> S3Result<S3Response<CopyObjectOutput>> {
        let _g = self.lock(&req.input.bucket, &req.input.key).await;
        self.fs.copy_object(req).await
    }
    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        let _g = self.lock(&req.input.bucket, &req.input.key).await;
        self.fs.delete_object(req).await
    }
    async fn delete_objects(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let mut keys: Vec<String> = req
            .input
            .delete
            .objects
            .iter()
            .map(|o| o.key.clone())
            .collect();
        keys.sort();
        keys.dedup();
        let mut guards = Vec::with_capacity(keys.len());
        for k in &keys {
            guards.push(self.lock(&req.input.bucket, k).await);
        }
        self.fs.delete_objects(req).await
    }
}

/// The command line: s3s-fs's own options.
struct Args {
    host: String,
    port: u16,
    access_key: String,
    secret_key: String,
    root: String,
    request_log: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut host = "127.0.0.1".to_owned();
    let mut port = 0;
    let (mut access_key, mut secret_key, mut root) = (None, None, None);
    let mut request_log = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--host" => host = value("--host")?,
            "--port" => {
                port = value("--port")?
                    .parse()
                    .map_err(|e| format!("--port: {e}"))?
            }
            "--access-key" => access_key = Some(value("--access-key")?),
            "--request-log" => request_log = Some(value("--request-log")?),
            "--secret-key" => secret_key = Some(value("--secret-key")?),
            other if other.starts_with("--") => return Err(format!("unknown option {other}")),
            other => root = Some(other.to_owned()),
        }
    }
    Ok(Args {
        host,
        port,
        access_key: access_key.ok_or("--access-key is required")?,
        secret_key: secret_key.ok_or("--secret-key is required")?,
        root: root.ok_or("the root directory is required")?,
        request_log,
    })
}

#[tokio::main]
async fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(why) => {
            eprintln!(
                "gpuwarden-s3-test-server: {why}\nusage: gpuwarden-s3-test-server [--host H] \
                 [--port P] [--request-log FILE] --access-key K --secret-key S ROOT"
            );
            std::process::exit(2);
        }
    };
    let fs = FileSystem::new(&args.root).expect("the root directory");
    let mut builder = s3s::service::S3ServiceBuilder::new(Locked {
        fs,
        locks: Mutex::default(),
    });
    builder.set_auth(s3s::auth::SimpleAuth::from_single(
        args.access_key.as_str(),
        args.secret_key.as_str(),
    ));
    let service = builder.build();
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .expect("binds its address");
    println!(
        "server is running at http://{}",
        listener.local_addr().unwrap()
    );
    let log = args.request_log.map(|path| {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("--request-log {path}: {e}"));
        Arc::new(Mutex::new(std::io::LineWriter::new(file)))
    });
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        if let Some(log) = &log {
            use std::io::Write as _;
            let _ = writeln!(log.lock().unwrap(), "{} {}", req.method(), req.uri());
        }
        hyper::service::Service::call(&service, req)
    });
    let http = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    loop {
        let Ok((socket, _)) = listener.accept().await else {
            continue;
        };
        let conn = http
            .serve_connection(hyper_util::rt::TokioIo::new(socket), service.clone())
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}
