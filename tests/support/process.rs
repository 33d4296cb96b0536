//! A `gpuwarden` process as a test drives it: started with JSON logs that are read as they come,
//! stopped with a signal; the output of a command that must succeed; and what /proc says of a
//! process and of its SQL query threads.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::eventually;

/// A running `gpuwarden` process whose stderr log lines are collected as they arrive.
pub struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    out: mpsc::Receiver<String>,
    pub log: Vec<String>,
}

/// Sends each line `from` gives to a channel, from a thread of its own.
fn forward_lines(from: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Running {
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args(["--log-format", "json"])
            .args(args)
            .envs(envs.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts gpuwarden");
        let lines = forward_lines(child.stderr.take().unwrap());
        let out = forward_lines(child.stdout.take().unwrap());
        Self {
            child,
            lines,
            out,
            log: Vec::new(),
        }
    }

    /// Waits for a log line containing `needle`; returns it as JSON.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> serde_json::Value {
        let until = Instant::now() + timeout;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return serde_json::from_str(&line)
                            .unwrap_or(serde_json::Value::String(line));
                    }
                }
                Err(_) => panic!(
                    "no log line with {needle:?} within {timeout:?}; log so far:\n{}",
                    self.log.join("\n")
                ),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Every log line so far, those that arrived since the last look included.
    pub fn log_so_far(&mut self) -> String {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push(line);
        }
        self.log.join("\n")
    }

    /// Sends SIGTERM and waits for the exit, collecting the rest of the log.
    pub fn terminate(mut self, timeout: Duration) -> (ExitStatus, Vec<String>) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        // On a timeout the panic drops `self`, which kills the process.
        let status = eventually("the exit on SIGTERM", timeout, || {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Ok(status);
            }
            while let Ok(line) = self.lines.try_recv() {
                self.log.push(line);
            }
            Err(format!("still running; log:\n{}", self.log.join("\n")))
        });
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.log.push(line);
        }
        (status, std::mem::take(&mut self.log))
    }

    /// The next line of standard output, trimmed; panics after `timeout` or at its end.
    pub fn stdout_line(&mut self, timeout: Duration) -> String {
        match self.out.recv_timeout(timeout) {
            Ok(line) => line.trim().to_string(),
            Err(e) => panic!(
                "no line on stdout within {timeout:?} ({e}); log so far:\n{}",
                self.log.join("\n")
            ),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The JSON line of `log` (a process's stderr in `--log-format json`) whose message is
/// `message`; panics, showing the log, when there is none.
pub fn log_line(log: &[String], message: &str) -> serde_json::Value {
    log.iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"] == message || l["message"] == message)
        .unwrap_or_else(|| panic!("no {message:?} line:\n{}", log.join("\n")))
}

/// The state of process `pid` as /proc/<pid>/stat gives it (`R` running, `S` sleeping, `T`
/// stopped, `Z` a zombie, …); `None` once it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (2nd field) is in parentheses and may hold anything; the state follows it.
    stat.rsplit_once(") ")?.1.chars().next()
}

/// CPU time, in clock ticks, the SQL query threads (`gpuwarden-sql`) of process `pid` have used
/// so far.
pub fn sql_threads_cpu(pid: u32) -> u64 {
    let mut ticks = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let Ok(name) = std::fs::read_to_string(task.join("comm")) else {
            continue;
        };
        if name.trim() != "gpuwarden-sql" {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.join("stat")) else {
            continue;
        };
        // utime and stime, the 14th and 15th fields; the name (2nd) is in parentheses.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    ticks
}

/// How many clock ticks (1/100 s) the SQL query threads of `pid` use over `over`.
pub fn sql_threads_busy(pid: u32, over: Duration) -> u64 {
    let before = sql_threads_cpu(pid);
    std::thread::sleep(over);
    sql_threads_cpu(pid) - before
}

/// Waits until a query keeps the SQL threads of `pid` busy: a fifth of a CPU or more, which
/// they get even when every CPU is busy with other work, at their lower priority.
pub fn until_sql_threads_busy(pid: u32) {
    eventually(
        "a query keeping the SQL threads busy",
        Duration::from_secs(60),
        || {
            let ticks = sql_threads_busy(pid, Duration::from_millis(500));
            if ticks >= 10 {
                Ok(())
            } else {
                Err(format!("{ticks} ticks in 500 ms"))
            }
        },
    );
}

/// The standard output of a command that must have succeeded; a failure panics, showing both
/// its outputs.
pub fn ok(out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
