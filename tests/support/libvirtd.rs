//! A libvirtd of a test's own, in session mode, for tests that run real QEMU guests through the
//! libvirt driver (`enforcer/tests/libvirt.rs`, `tests/libvirt.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};

/// A libvirtd of the test's own, in session mode, as an unprivileged user (QEMU's session
/// driver; as root, libvirtd would be the system daemon and need its accounts and directories).
/// Dropping it kills it and every QEMU it started.
pub struct SessionDaemon {
    child: Child,
    pub dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Drop for SessionDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // QEMU outlives its libvirtd (as it should); the test's guests do not outlive the test.
        let dir = self.dir.path().display().to_string();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&dir) {
                if let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() {
                    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                }
            }
        }
    }
}

impl SessionDaemon {
    pub fn start() -> anyhow::Result<Self> {
        for (binary, package) in [
            ("libvirtd", "libvirt-daemon"),
            ("qemu-system-x86_64", "qemu-system-x86"),
        ] {
            ensure!(
                ["/usr/sbin", "/usr/bin"].iter().any(|d| Path::new(d).join(binary).exists()),
                "{binary} is not installed (Debian: {package}, libvirt-daemon-driver-qemu; .ci/run installs them)"
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("gpuwarden-libvirtd")
            .tempdir()?;
        let runtime = dir.path().join("run");
        std::fs::create_dir(&runtime)?;
        if rustix::process::geteuid().is_root() {
            // nobody's: its home and runtime dir are this one.
            for p in [dir.path(), runtime.as_path()] {
                std::os::unix::fs::chown(p, Some(65534), Some(65534))?;
            }
        }
        let socket = runtime.join("libvirt/libvirt-sock");
        let child = Self::spawn(dir.path(), &socket)?;
        Ok(Self { child, dir, socket })
    }

    fn spawn(dir: &Path, socket: &Path) -> anyhow::Result<Child> {
        let mut command = if rustix::process::geteuid().is_root() {
            let mut c = Command::new("setpriv");
            c.args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "libvirtd",
            ]);
            c
        } else {
            Command::new("libvirtd")
        };
        let log = dir.join("libvirtd.log");
        command
            .args(["--timeout", "300"])
            .env_clear()
            .env("HOME", dir)
            .env("XDG_RUNTIME_DIR", dir.join("run"))
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)?,
            );
        let child = command.spawn().context("starting libvirtd")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            ensure!(
                Instant::now() < deadline,
                "libvirtd made no socket at {} in 30 s; its log: {}",
                socket.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(child)
    }

    pub fn uri(&self) -> String {
        format!("qemu:///session?socket={}", self.socket.display())
    }

    /// Kills libvirtd (SIGKILL: no goodbye to its clients) and starts it again; its guests keep
    /// running, and the new one takes them back from its state directory.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        let _ = std::fs::remove_file(&self.socket);
        self.child = Self::spawn(self.dir.path(), &self.socket)?;
        Ok(())
    }
}

/// The command lines of the running QEMU processes whose guest is `name`.
pub fn qemu_command_line(name: &str) -> Option<String> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let line = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (line.contains("qemu-system") && line.contains(&format!("guest={name},")))
                .then_some(line)
        })
}

/// Gives `path` to the daemon's user (nobody, when the tests run as root), so that QEMU, which
/// runs as that user, can read or write it.
pub fn give_to_daemon(path: &Path) -> std::io::Result<()> {
    if rustix::process::geteuid().is_root() {
        std::os::unix::fs::chown(path, Some(65534), Some(65534))?;
    }
    Ok(())
}
