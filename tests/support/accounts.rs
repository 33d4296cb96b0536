//! System accounts for the local driver's tests: the account a test's leases run as, and
//! accounts a test makes for itself (and removes) to see a command run as someone else.
//!
//! Shared by the binary's tests (`tests/support/mod.rs`) and the enforcer's
//! (`enforcer/tests/support/mod.rs`, through `#[path]`).

use std::process::Command;
use std::time::Duration;

/// Whether the tests run as root, as CI does: only root can make accounts and run commands as
/// another account.
pub fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// The account that leases of tests which do not make one run as: `nobody` under root (an
/// unprivileged account every Debian system has), else the account running the tests, the only
/// one a non-root enforcer can run commands as.
pub fn lease_account() -> String {
    if running_as_root() {
        return "nobody".to_owned();
    }
    let out = Command::new("id").arg("-un").output().expect("id runs");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

/// An account (and a group it is a supplementary member of) made by `useradd` for one test and
/// removed when dropped. Root only.
#[derive(Debug)]
pub struct TestAccount {
    /// The account's name.
    pub name: String,
    /// The supplementary group's name.
    pub group: String,
}

impl TestAccount {
    /// Makes `gwt<pid><tag>` with a supplementary group `gwg<pid><tag>`; panics unless root.
    pub fn create(tag: &str) -> Self {
        assert!(running_as_root(), "making an account needs root");
        let id = std::process::id();
        let account = Self {
            name: format!("gwt{id}{tag}"),
            group: format!("gwg{id}{tag}"),
        };
        run_with_retry(&["groupadd", &account.group]);
        // No home directory is made; the shell is irrelevant (commands are started directly).
        run_with_retry(&[
            "useradd",
            "--no-create-home",
            "--no-user-group",
            "--gid",
            "users",
            "--groups",
            &account.group,
            "--shell",
            "/usr/sbin/nologin",
            &account.name,
        ]);
        account
    }

    /// The account's uid, as `id -u` prints it.
    pub fn uid(&self) -> u32 {
        id(&["-u", &self.name]).parse().expect("a uid")
    }

    /// The supplementary group's gid.
    pub fn group_gid(&self) -> u32 {
        let out = Command::new("getent")
            .args(["group", &self.group])
            .output()
            .expect("getent runs");
        let line = String::from_utf8(out.stdout).expect("utf-8");
        line.split(':')
            .nth(2)
            .expect("gid field")
            .parse()
            .expect("a gid")
    }
}

impl Drop for TestAccount {
    fn drop(&mut self) {
        let _ = try_run(&["userdel", &self.name]);
        let _ = try_run(&["groupdel", &self.group]);
    }
}

fn id(args: &[&str]) -> String {
    let out = Command::new("id").args(args).output().expect("id runs");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

fn try_run(argv: &[&str]) -> Result<(), String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `useradd` and `groupadd` lock /etc/passwd and /etc/group; tests running at once take turns.
fn run_with_retry(argv: &[&str]) {
    let mut last = String::new();
    for _ in 0..50 {
        match try_run(argv) {
            Ok(()) => return,
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{argv:?} failed: {last}");
}
