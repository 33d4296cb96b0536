//! A real PostgreSQL server for a test binary: Debian's `postgresql` package's `initdb` and
//! `postgres`, in a temporary directory, on a free loopback port, with the settings the enforcer's
//! README asks for (`synchronous_commit = on`, `fsync = on`). One server per test binary
//! ([`server`]); each test takes a database of its own ([`Postgres::database`]).
//!
//! The server runs under a watchdog shell that stops it (fast shutdown) once the test process is
//! gone, so a test binary that ends, passes or panics leaves no server behind. As root (CI), the
//! server runs as the `postgres` account the package creates, since PostgreSQL refuses root.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use std::time::{Duration, Instant};

/// The test binary's PostgreSQL server.
pub struct Postgres {
    /// Its loopback port.
    pub port: u16,
    /// The data directory.
    pub data: PathBuf,
    bin: PathBuf,
    dir: PathBuf,
    /// The watchdog shell (whose child is the server), while it runs.
    watchdog: Mutex<Option<Child>>,
    /// Runs commands as the `postgres` account (the process is root).
    as_postgres: bool,
    /// More `-c name=value` settings of the server's.
    settings: Vec<String>,
    /// The process whose end stops the server.
    owner: u32,
}

/// The server of this test run, started by the first test that asks and shared by every test
/// process of the run (nextest runs each test in a process of its own: the server is kept for
/// the process that started them, its parent, and stopped once that is gone). A test that stops
/// or restarts its server takes a [`Postgres::private`] one instead.
pub fn server() -> &'static Postgres {
    static SERVER: OnceLock<Postgres> = OnceLock::new();
    SERVER.get_or_init(Postgres::shared)
}

/// The directory of PostgreSQL's server programs: `GPUWARDEN_PG_BIN`, else the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout).
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("GPUWARDEN_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect(
            "PostgreSQL's server is installed (Debian's postgresql package; .ci/run installs it)",
        )
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("a PostgreSQL server under /usr/lib/postgresql/<version>/bin")
        .1
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Postgres {
    /// A server of this test's own, stopped when the test process ends.
    pub fn private() -> Self {
        let server = Self::private_stopped();
        server.run();
        server
    }

    /// A [`Postgres::private`] server, initialised but not started, so that a test may give it
    /// settings ([`Postgres::set`], [`Postgres::file`]) before [`Postgres::run`].
    pub fn private_stopped() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "gpuwarden-pg-{}-{}",
            std::process::id(),
            free_port()
        ));
        Self::init(dir, std::process::id(), free_port())
    }

    /// Sets `name = value` for the server's next start.
    pub fn set(&mut self, name: &str, value: &str) {
        self.settings.push(format!("{name}={value}"));
    }

    /// Copies `from` into the server's directory as `name`, readable by the server's account
    /// alone (as PostgreSQL wants a private key); its path.
    pub fn file(&self, from: &Path, name: &str) -> PathBuf {
        let to = self.dir.join(name);
        std::fs::copy(from, &to).unwrap();
        std::fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        if self.as_postgres {
            let status = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&to)
                .status()
                .unwrap();
            assert!(status.success());
        }
        to
    }

    /// The run's shared server: started under a lock by the first test process to ask, found
    /// by the others through the port it wrote.
    fn shared() -> Self {
        let owner = rustix::process::getppid()
            .map(|p| p.as_raw_nonzero().get() as u32)
            .unwrap_or_else(std::process::id);
        let dir = std::env::temp_dir().join(format!("gpuwarden-pg-shared-{owner}"));
        std::fs::create_dir_all(&dir).unwrap();
        let lock = std::fs::File::create(dir.join("lock")).unwrap();
        lock.lock().unwrap();
        let port_file = dir.join("port");
        if let Some(port) = std::fs::read_to_string(&port_file)
            .ok()
            .and_then(|p| p.trim().parse().ok())
        {
            let found = Self {
                port,
                data: dir.join("data"),
                bin: bin_dir(),
                dir: dir.clone(),
                watchdog: Mutex::new(None),
                as_postgres: rustix::process::geteuid().is_root(),
                owner,
                settings: Vec::new(),
            };
            if postgres::Client::connect(&found.url("postgres"), postgres::NoTls).is_ok() {
                return found;
            }
            // A server from a run before, gone: start afresh.
            let _ = std::fs::remove_dir_all(dir.join("data"));
        }
        let server = Self::init(dir, owner, free_port());
        server.run();
        std::fs::write(&port_file, server.port.to_string()).unwrap();
        drop(lock);
        server
    }

    /// A new data directory under `dir`, for a server on `port` that lives as long as process
    /// `owner`.
    fn init(dir: PathBuf, owner: u32, port: u16) -> Self {
        let bin = bin_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let as_postgres = rustix::process::geteuid().is_root();
        if as_postgres {
            // The server's account must reach its directory.
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            assert!(status.success(), "chown postgres {}", dir.display());
        }
        let data = dir.join("data");
        let server = Self {
            port,
            data: data.clone(),
            bin,
            dir,
            watchdog: Mutex::new(None),
            as_postgres,
            owner,
            settings: Vec::new(),
        };
        let out = server
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "gpuwarden", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        server
    }

    /// `program` of PostgreSQL's, as the account that owns the server.
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            // setpriv execs the program (runuser would stay as its parent, between the
            // watchdog's signals and the server).
            let mut c = Command::new("setpriv");
            c.args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--reset-env",
            ])
            .arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// Starts the server (again) under its watchdog and waits until it accepts connections.
    pub fn run(&self) {
        let mut watchdog = self.watchdog.lock().unwrap();
        assert!(watchdog.is_none(), "the PostgreSQL server already runs");
        let postgres = self.command("postgres");
        let mut argv: Vec<String> = std::iter::once(postgres.get_program())
            .chain(postgres.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        argv.extend(
            [
                "-D",
                self.data.to_str().unwrap(),
                "-p",
                &self.port.to_string(),
                "-k",
                self.dir.to_str().unwrap(),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=on",
                "-c",
                "synchronous_commit=on",
                "-c",
                "max_connections=200",
            ]
            .map(str::to_owned),
        );
        for setting in &self.settings {
            argv.extend(["-c".to_owned(), setting.clone()]);
        }
        let quoted: Vec<String> = argv.iter().map(|a| format!("'{a}'")).collect();
        // The watchdog: the server in the background, stopped (fast shutdown) when the test
        // process is gone, or when the watchdog is told to stop (SIGTERM).
        let script = format!(
            "{} 2>>'{}/server.log' & pg=$!; \
             trap 'kill -INT $pg; wait $pg; exit 0' TERM; \
             while kill -0 {pid} 2>/dev/null && kill -0 $pg 2>/dev/null; do sleep 0.2; done; \
             kill -INT $pg 2>/dev/null; wait $pg; \
             kill -0 {pid} 2>/dev/null || rm -rf '{dir}'",
            quoted.join(" "),
            self.dir.display(),
            pid = self.owner,
            dir = self.dir.display(),
        );
        // A session of its own, holding none of the test's output: the server outlives the
        // test process that started it when it is shared.
        let child = Command::new("setsid")
            .args(["bash", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        *watchdog = Some(child);
        drop(watchdog);
        self.wait_ready(Duration::from_secs(60));
    }

    /// Stops the server (fast shutdown: open sessions end, what was committed stays). Only a
    /// [`Postgres::private`] server's test may.
    pub fn stop(&self) {
        assert_eq!(
            self.owner,
            std::process::id(),
            "only a private server is stopped"
        );
        let Some(mut child) = self.watchdog.lock().unwrap().take() else {
            return;
        };
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&child),
            rustix::process::Signal::TERM,
        );
        let _ = child.wait();
    }

    fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            match postgres::Client::connect(&self.url("postgres"), postgres::NoTls) {
                Ok(_) => return,
                Err(e) if Instant::now() > deadline => panic!(
                    "PostgreSQL did not start within {within:?}: {e}; its log: {}",
                    std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
                ),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// The URL of database `name`.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://gpuwarden@127.0.0.1:{}/{name}", self.port)
    }

    /// A new, empty database for one test; its URL.
    pub fn database(&self) -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // Unique across the test processes sharing the server.
        let name = format!(
            "test_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = postgres::Client::connect(&self.url("postgres"), postgres::NoTls).unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        self.url(&name)
    }

    /// A session on the database at `url`, for a test to look at what the store wrote.
    pub fn client(url: &str) -> postgres::Client {
        postgres::Client::connect(url, postgres::NoTls).unwrap()
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Where the server keeps its socket and log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}
