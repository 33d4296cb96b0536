//! psql, the real PostgreSQL client, against the pipeline's SQL endpoint; and a raw client of
//! the protocol, for what psql does not show (the answer to a startup message).

use std::io::Write;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// psql, the real PostgreSQL client, against the SQL endpoint on 127.0.0.1:`port` as `user`:
/// database `gpuwarden`, no ~/.psqlrc, no `PG*` variable of the environment, never a prompt.
pub struct Psql {
    port: u16,
    user: String,
    password: Option<String>,
}

/// A query's answer with its column names; `None` for SQL NULL.
pub struct Answer {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl Psql {
    pub fn new(port: u16, user: &str, password: Option<&str>) -> Self {
        Self {
            port,
            user: user.into(),
            password: password.map(String::from),
        }
    }

    /// The connection alone; the caller adds how to print and what to run.
    pub fn command(&self) -> Command {
        let mut command = Command::new("psql");
        for (name, _) in std::env::vars() {
            if name.starts_with("PG") {
                command.env_remove(name);
            }
        }
        command
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U"])
            .arg(&self.user)
            // -X: no ~/.psqlrc; -w: never prompt.
            .args(["-d", "gpuwarden", "-X", "-w"])
            .env("PGCONNECT_TIMEOUT", "10")
            .env("PGSSLMODE", "disable")
            .env("PGPASSFILE", "/dev/null")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(password) = &self.password {
            command.env("PGPASSWORD", password);
        }
        command
    }

    /// Starts `sql` in the background; rows come back bare, and errors in their verbose form,
    /// with their SQLSTATE.
    pub fn spawn(&self, sql: &str) -> Child {
        self.command()
            .args(["-A", "-t", "-v", "VERBOSITY=verbose", "-c", sql])
            .spawn()
            .expect("psql (postgresql-client) is installed")
    }

    /// Runs `sql` with `-c`, stopping at the first error; rows come back bare, `|` between
    /// columns.
    pub fn run(&self, sql: &str) -> Output {
        self.command()
            .args(["-A", "-t", "-F", "|", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .expect("psql (postgresql-client) is installed")
    }

    /// Feeds `script` to psql's standard input, as one connection that goes on after an error;
    /// rows come back bare, `|` between columns.
    pub fn script(&self, script: &str) -> Output {
        let mut child = self
            .command()
            .args(["-A", "-t", "-F", "|"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("psql (postgresql-client) is installed");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// The rows of a query that must succeed, as `a|b` lines.
    #[track_caller]
    pub fn rows(&self, sql: &str) -> Vec<String> {
        let out = self.run(sql);
        assert!(
            out.status.success(),
            "{sql}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The number in the one row a query answers, or 0 while it fails or is not yet a number
    /// (a table the pipeline has not made yet).
    pub fn number_or_zero(&self, sql: &str) -> i64 {
        let out = self.run(sql);
        if !out.status.success() {
            return 0;
        }
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }

    /// The one row of a query that must succeed and return exactly one.
    #[track_caller]
    pub fn one(&self, sql: &str) -> String {
        let rows = self.rows(sql);
        assert_eq!(rows.len(), 1, "{sql}: {rows:?}");
        rows[0].clone()
    }

    /// Runs `sql` with the column names (which a time series needs for its `time` column) and
    /// NULL told apart from text; psql's error message when it fails.
    pub fn answer(&self, sql: &str) -> Result<Answer, String> {
        const NULL: &str = "\u{1}NULL";
        let out = self
            .command()
            .args(["-A", "-F", "\u{1f}", "-P", "footer=off"])
            .args([
                "-P",
                &format!("null={NULL}"),
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .output()
            .expect("psql (postgresql-client) is installed");
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut lines = stdout.lines();
        let columns: Vec<String> = lines
            .next()
            .ok_or("psql printed no header")?
            .split('\u{1f}')
            .map(str::to_string)
            .collect();
        let mut rows = Vec::new();
        for line in lines {
            let row: Vec<Option<String>> = line
                .split('\u{1f}')
                .map(|v| (v != NULL).then(|| v.to_string()))
                .collect();
            if row.len() != columns.len() {
                return Err(format!(
                    "a row psql printed does not split into {columns:?}: {line:?}"
                ));
            }
            rows.push(row);
        }
        Ok(Answer { columns, rows })
    }
}

/// A connection that sends a startup message (protocol 3.0, no password), and what it reads back.
pub struct RawClient(std::net::TcpStream);

impl RawClient {
    pub fn start(port: u16, user: &str) -> Self {
        let socket = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut body = 196_608_u32.to_be_bytes().to_vec();
        for part in ["user", user, "database", "gpuwarden", ""] {
            body.extend_from_slice(part.as_bytes());
            body.push(0);
        }
        let mut client = Self(socket);
        client.send(None, &body);
        client
    }

    /// Sends a message of type `kind` (none for the startup message) with `body`.
    pub fn send(&mut self, kind: Option<u8>, body: &[u8]) {
        use std::io::Write as _;
        let mut message: Vec<u8> = kind.into_iter().collect();
        message.extend_from_slice(&u32::try_from(body.len() + 4).unwrap().to_be_bytes());
        message.extend_from_slice(body);
        // The server may have closed its end already.
        let _ = self.0.write_all(&message);
    }

    /// The next message's type and body; `None` at the end of the stream.
    pub fn next(&mut self) -> Option<(u8, Vec<u8>)> {
        use std::io::Read as _;
        let mut header = [0u8; 5];
        self.0.read_exact(&mut header).ok()?;
        let length = u32::from_be_bytes(header[1..].try_into().unwrap()) as usize;
        let mut body = vec![0u8; length - 4];
        self.0.read_exact(&mut body).ok()?;
        Some((header[0], body))
    }
}

/// The SQLSTATE and message of an ErrorResponse body.
pub fn error_fields(body: &[u8]) -> (String, String) {
    let (mut code, mut text) = (String::new(), String::new());
    for field in body.split(|b| *b == 0).filter(|f| !f.is_empty()) {
        let value = String::from_utf8_lossy(&field[1..]).into_owned();
        match field[0] {
            b'C' => code = value,
            b'M' => text = value,
            _ => {}
        }
    }
    (code, text)
}
