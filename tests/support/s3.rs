//! An S3-compatible server of a test's own, for the lake on object storage:
//! `gpuwarden-s3-test-server` (dev/s3-test-server: s3s-fs 0.14.1 behind a per-key lock, which
//! `.ci/run` installs under /var/tmp/gpuwarden-s3s) serving a directory of the test on a port of
//! 127.0.0.1 that the kernel picks, with one bucket made through the S3 API. A test reaches it two
//! ways: an `ObjectStore` for its own reads and writes, and the standard AWS environment
//! variables for a `gpuwarden` process.
//!
//! It keeps each object as a file, `<root>/<bucket>/<key>`. s3s-fs alone checks a conditional
//! write before writing, so concurrent conditional writes to one key could both succeed, and a GET
//! reads the body and the ETag in two steps; the lock makes each request see one version of the
//! key (docs/src/contributors/object-storage.md).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::ObjectStore;

/// The credentials the server accepts, and the region the clients sign for.
pub const ACCESS_KEY: &str = "gpuwarden-test";
pub const SECRET_KEY: &str = "gpuwarden-test-secret";
pub const REGION: &str = "us-east-1";

/// The server binary: GPUWARDEN_S3_TEST_SERVER, else where .ci/run installs it. Missing, it fails
/// the test that needs it, saying how to install it.
pub fn server_binary() -> PathBuf {
    let path = std::env::var_os("GPUWARDEN_S3_TEST_SERVER")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/gpuwarden-s3s/bin/gpuwarden-s3-test-server"));
    assert!(
        path.is_file(),
        "the S3 server {} is missing: run `bash .ci/run`, or install it by hand:\n  \
         cargo install --locked --root /var/tmp/gpuwarden-s3s --path dev/s3-test-server",
        path.display()
    );
    path
}

/// A running S3 server with one bucket; stopped when dropped.
pub struct S3Server {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    pub bucket: String,
    /// The directory the server keeps its buckets in.
    pub root: PathBuf,
}

impl S3Server {
    /// Starts the S3 server over `root` (made if missing) and creates `bucket` in it.
    pub fn start(root: &Path, bucket: &str) -> Self {
        std::fs::create_dir_all(root).unwrap();
        let mut child = Command::new(server_binary())
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starts the S3 server");
        // The server logs its address once it listens. The thread reads its output to the end,
        // so that the server never blocks on a full pipe.
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent {
                    if let Some(at) = line.find("server is running at http://") {
                        let address = line[at + "server is running at ".len()..].trim();
                        let _ = tx.send(Ok(address.to_string()));
                        sent = true;
                    } else {
                        seen.push(line);
                    }
                }
            }
            if !sent {
                let _ = tx.send(Err(seen.join("\n")));
            }
        });
        let endpoint = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(endpoint)) => endpoint,
            Ok(Err(output)) => {
                let status = child.wait().unwrap();
                panic!("the S3 server exited ({status}) before listening; its output:\n{output}")
            }
            Err(_) => {
                let _ = child.kill();
                panic!("the S3 server did not say where it listens within 30 s")
            }
        };
        let server = Self {
            child,
            endpoint,
            bucket: bucket.to_string(),
            root: root.to_path_buf(),
        };
        server.create_bucket();
        server
    }

    /// CreateBucket, signed with SigV4 as any S3 client signs it (curl's --aws-sigv4).
    fn create_bucket(&self) {
        let out = Command::new("curl")
            .args(["--silent", "--show-error", "--fail-with-body", "-X", "PUT"])
            .args(["--aws-sigv4", &format!("aws:amz:{REGION}:s3")])
            // The SHA-256 of the empty body, which S3 requires as a header: curl 7.88 (Debian 12)
            // does not send it by itself (s3s-fs answers 400 without it).
            .args([
                "-H",
                "x-amz-content-sha256: \
                 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            ])
            .args(["--user", &format!("{ACCESS_KEY}:{SECRET_KEY}")])
            .arg(format!("{}/{}", self.endpoint, self.bucket))
            .output()
            .expect("runs curl");
        assert!(
            out.status.success(),
            "CreateBucket {}: {}{}",
            self.bucket,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The bucket's URL, as `storage.lake` will take it.
    pub fn url(&self) -> String {
        format!("s3://{}", self.bucket)
    }

    /// The standard AWS environment that points an S3 client at this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_string()),
            ("AWS_REGION", REGION.to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
        ]
    }

    /// An S3 client of the bucket, configured from [`Self::env`] alone, as object_store's
    /// `AmazonS3Builder::from_env` configures a process's.
    pub fn store(&self) -> Arc<dyn ObjectStore> {
        let mut builder = AmazonS3Builder::new().with_bucket_name(&self.bucket);
        for (name, value) in self.env() {
            let key = name
                .to_ascii_lowercase()
                .parse()
                .unwrap_or_else(|e| panic!("{name} is no object_store S3 setting: {e}"));
            builder = builder.with_config(key, value);
        }
        Arc::new(builder.build().expect("an S3 client of the test server"))
    }

    /// A config's `[storage]` for a lake under `prefix` of the bucket, reaching this server
    /// through `[storage.s3]` alone (no environment), with its data dir `data_dir`.
    pub fn storage_config(&self, data_dir: &Path, prefix: &str) -> String {
        format!(
            "[storage]\ndata_dir = \"{}\"\nlake = \"{}/{prefix}\"\n\n[storage.s3]\n\
             endpoint = \"{}\"\nallow_http = true\nregion = \"{REGION}\"\n\
             access_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{SECRET_KEY}\"\n",
            data_dir.display(),
            self.url(),
            self.endpoint,
        )
    }

    /// `<dir>/c.toml`, a config of [`Self::storage_config`] with `<dir>/data` as its data
    /// directory and the lake under `prefix`; returns its path.
    pub fn config_file(&self, dir: &Path, prefix: &str) -> std::path::PathBuf {
        let config = dir.join("c.toml");
        std::fs::write(&config, self.storage_config(&dir.join("data"), prefix)).unwrap();
        config
    }

    /// The lake under `prefix` of the bucket, reaching this server through its own settings (as
    /// [`Self::storage_config`] writes them), staging its files under `staging`.
    pub fn lake(&self, prefix: &str, staging: &Path) -> gpuwarden_pipeline::Lake {
        let s3 = gpuwarden_schema::config::S3Config {
            endpoint: Some(self.endpoint.clone()),
            region: Some(REGION.into()),
            access_key_id: Some(ACCESS_KEY.into()),
            secret_access_key: Some(SECRET_KEY.into()),
            allow_http: Some(true),
            ..Default::default()
        };
        let objects = gpuwarden_pipeline::objects::ObjectLake::s3(&self.bucket, prefix, &s3)
            .expect("a client of the test server");
        gpuwarden_pipeline::Lake::in_object_store(objects, staging).expect("the lake in the bucket")
    }

    /// The keys of the bucket's objects under `prefix`, sorted, as the server keeps them.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let bucket = self.root.join(&self.bucket);
        let mut keys = Vec::new();
        let mut dirs = vec![bucket.join(prefix)];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else {
                    let key = path
                        .strip_prefix(&bucket)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned();
                    keys.push(key);
                }
            }
        }
        keys.sort();
        keys
    }

    /// Where the server keeps the object `key` on disk.
    pub fn object_path(&self, key: &str) -> PathBuf {
        self.root.join(&self.bucket).join(key)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `test` on a lake in a directory, then on one in a bucket of an S3 server of the test's
/// own (docs/src/contributors/object-storage.md): the test's checks must hold on both.
pub fn on_each_lake(test: fn(gpuwarden_pipeline::Lake)) {
    let dir = tempfile::tempdir().unwrap();
    test(gpuwarden_pipeline::Lake::open(dir.path().join("lake")).unwrap());
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    test(server.lake("fleet", &dir.path().join("staging")));
}
