//! Who a `local` lease's command runs as, and how it is started as that account.
//!
//! A gpuwarden user maps to a system account through the substrate's `accounts` table, else
//! (with `same_name_accounts = true`) to the account of the same name; anyone else has none. The
//! account is looked up through the system's user database (`getpwnam_r`, so NSS: LDAP and SSSD
//! accounts resolve as they do for a login). An account with uid 0, a uid under `min_uid`
//! (default 1000: root and the system's service accounts), or a member of root's group or of a
//! group in `denied_groups` (default [`DENIED_GROUPS`]: groups as good as root, such as `docker`
//! or `disk`) is refused. An enforcer that does not run as root cannot switch accounts: it refuses
//! every user unless `run_as_enforcer = true` lets leases run as its own account (a workstation
//! whose one user runs the enforcer too; such a lease can read the enforcer's environment, config
//! and database). Admission asks [`Accounts::resolve`] before placing a lease, so a refused user
//! gets a
//! denial with a reason code instead of a lease that fails to start.
//!
//! [`Account::command`] builds the process: through util-linux's `setsid` (a session of its own,
//! without the enforcer's controlling terminal, whose input it could otherwise inject into with
//! TIOCSTI) and, as root, `setpriv` (the account's uid and primary gid, its supplementary groups
//! from `initgroups(3)`, `no_new_privs` so that no setuid program can take the privileges back);
//! otherwise directly, as the enforcer's own account. Either way the environment is scrubbed to the account's `HOME`, `USER`, `LOGNAME`,
//! `SHELL`, a fixed `PATH`, and the lease's own variables, and the process starts in the lease's
//! working directory, `<work_dir>/<lease_id>`, made for it and owned by the account (mode 0700).

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuwarden_schema::config::SubstrateConfig;
use nix::unistd::User;
use rustix::fs::{Mode, OFlags};

use super::{Refusal, RefusalCode};

/// The lowest uid a lease may run as when `min_uid` is not set.
pub const DEFAULT_MIN_UID: u32 = 1000;

/// The `PATH` a lease's command starts with.
pub const LEASE_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Where util-linux's `setpriv` is looked for, in order.
const SETPRIV: [&str; 3] = ["/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv"];

/// Where util-linux's `setsid` is looked for, in order.
const SETSID: [&str; 3] = ["/usr/bin/setsid", "/bin/setsid", "/usr/sbin/setsid"];

/// Groups whose members are as good as root, refused when `denied_groups` is not set.
pub const DENIED_GROUPS: [&str; 8] = [
    "root", "sudo", "wheel", "adm", "shadow", "disk", "docker", "lxd",
];

fn first_file(candidates: &[&str]) -> Option<PathBuf> {
    candidates
        .iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .map(Path::to_path_buf)
}

/// A substrate's mapping from gpuwarden users to system accounts.
#[derive(Debug, Clone)]
pub struct Accounts {
    substrate: String,
    map: BTreeMap<String, String>,
    same_name: bool,
    min_uid: u32,
    denied_groups: Vec<String>,
    /// Leases may run as the enforcer's own account (`run_as_enforcer`, non-root only).
    run_as_enforcer: bool,
    /// The enforcer's effective uid.
    own_uid: u32,
    /// `setpriv`, when the enforcer runs as root.
    setpriv: Option<PathBuf>,
    /// `setsid`, to start each lease in a session of its own.
    setsid: PathBuf,
}

/// A system account a lease may run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
    home: PathBuf,
    shell: PathBuf,
    /// `setpriv` when the process must switch to this account; none when it is the enforcer's.
    setpriv: Option<PathBuf>,
    setsid: PathBuf,
}

impl Accounts {
    /// The mapping of a `local` entry. As root, `setpriv` must exist (the message says where it
    /// was looked for).
    pub fn new(config: &SubstrateConfig) -> Result<Self, String> {
        let own_uid = rustix::process::geteuid().as_raw();
        let setsid = first_file(&SETSID).ok_or_else(|| {
            format!(
                "leases' commands start through util-linux's setsid, which is in none of {}",
                SETSID.join(", ")
            )
        })?;
        let setpriv = if own_uid == 0 {
            match first_file(&SETPRIV) {
                Some(p) => Some(p),
                None => {
                    return Err(format!(
                        "the enforcer runs as root, so leases' commands start through util-linux's \
                         setpriv to run as their users' accounts, and it is in none of {}",
                        SETPRIV.join(", ")
                    ))
                }
            }
        } else {
            None
        };
        Ok(Self {
            substrate: config.name.clone(),
            map: config.accounts.clone(),
            same_name: config.same_name_accounts.unwrap_or(false),
            min_uid: config.min_uid.unwrap_or(DEFAULT_MIN_UID),
            denied_groups: config
                .denied_groups
                .clone()
                .unwrap_or_else(|| DENIED_GROUPS.iter().map(|g| (*g).to_owned()).collect()),
            run_as_enforcer: config.run_as_enforcer.unwrap_or(false),
            own_uid,
            setpriv,
            setsid,
        })
    }

    /// The account `user`'s commands run as, or why there is none. Blocking: it may ask a
    /// directory service.
    pub fn resolve(&self, user: &str) -> Result<Account, Refusal> {
        let unmapped = |message: String| Refusal {
            code: RefusalCode::AccountUnmapped,
            message,
        };
        let privileged = |message: String| Refusal {
            code: RefusalCode::AccountPrivileged,
            message,
        };
        let name = match self.map.get(user) {
            Some(name) => name.as_str(),
            None if self.same_name => user,
            None => {
                return Err(unmapped(format!(
                    "user {user} has no system account on substrate {}: its `accounts` table does \
                     not name one and same_name_accounts is off",
                    self.substrate
                )))
            }
        };
        let entry = match User::from_name(name) {
            Ok(Some(entry)) => entry,
            Ok(None) => {
                return Err(unmapped(format!(
                "user {user} maps to system account {name}, which does not exist on substrate {}",
                self.substrate
            )))
            }
            Err(e) => {
                return Err(unmapped(format!(
                    "cannot look up system account {name} for user {user} on substrate {}: {e}",
                    self.substrate
                )))
            }
        };
        let (uid, gid) = (entry.uid.as_raw(), entry.gid.as_raw());
        if uid == 0 {
            return Err(privileged(format!(
                "user {user} maps to system account {name}, which is root; leases never run as root"
            )));
        }
        if uid < self.min_uid {
            return Err(privileged(format!(
                "user {user} maps to system account {name} (uid {uid}), below substrate {}'s \
                 min_uid {}: accounts under it belong to the system",
                self.substrate, self.min_uid
            )));
        }
        // Every group the account is in, its primary one too: a member of root's group, or of a
        // group as good as root, is refused.
        let cname = std::ffi::CString::new(name)
            .map_err(|_| unmapped(format!("system account name {name:?} holds a NUL byte")))?;
        let groups = nix::unistd::getgrouplist(&cname, entry.gid).map_err(|e| {
            unmapped(format!(
                "cannot list the groups of system account {name} for user {user}: {e}"
            ))
        })?;
        for group in groups {
            let group_name = nix::unistd::Group::from_gid(group)
                .ok()
                .flatten()
                .map(|g| g.name);
            let denied = group.as_raw() == 0
                || group_name
                    .as_ref()
                    .is_some_and(|g| self.denied_groups.contains(g));
            if denied {
                return Err(privileged(format!(
                    "user {user} maps to system account {name}, a member of group {} (gid {}), \
                     which is as good as root (substrate {}'s denied_groups)",
                    group_name.as_deref().unwrap_or("?"),
                    group.as_raw(),
                    self.substrate
                )));
            }
        }
        if self.setpriv.is_none() {
            if !self.run_as_enforcer {
                return Err(unmapped(format!(
                    "the enforcer runs as uid {}, not root, so it cannot run user {user}'s commands \
                     as their own account; run it as root, or set run_as_enforcer = true on \
                     substrate {} to run leases as the enforcer's account (they can then read its \
                     environment, config and database)",
                    self.own_uid, self.substrate
                )));
            }
            if uid != self.own_uid {
                return Err(unmapped(format!(
                    "user {user} maps to system account {name} (uid {uid}), but the enforcer runs \
                     as uid {} and can start commands only as itself",
                    self.own_uid
                )));
            }
        }
        Ok(Account {
            name: entry.name,
            uid,
            gid,
            home: entry.dir,
            shell: entry.shell,
            setpriv: self.setpriv.clone(),
            setsid: self.setsid.clone(),
        })
    }
}

impl Account {
    /// Its home directory.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// The process for `program args…` as this account, with only `vars` (the lease's variables)
    /// added to the account's own basic environment, starting in `work_dir`.
    pub fn command(
        &self,
        program: &str,
        args: &[String],
        vars: &[(&str, String)],
        work_dir: &Path,
    ) -> Command {
        // setsid(1) calls setsid(2) itself when it is not a group leader, as a child of the
        // enforcer is not: the lease's pid is then its session's and its process group's id.
        let mut command = Command::new(&self.setsid);
        match &self.setpriv {
            Some(setpriv) => {
                command
                    .arg(setpriv)
                    .arg("--reuid")
                    .arg(self.uid.to_string())
                    .arg("--regid")
                    .arg(self.gid.to_string())
                    .arg("--init-groups")
                    .arg("--no-new-privs")
                    .arg("--")
                    .arg(program);
            }
            None => {
                command.arg("--").arg(program);
            }
        }
        command
            .args(args)
            .env_clear()
            .env("HOME", &self.home)
            .env("USER", &self.name)
            .env("LOGNAME", &self.name)
            .env("SHELL", &self.shell)
            .env("PATH", LEASE_PATH)
            .env("PWD", work_dir)
            .envs(vars.iter().map(|(k, v)| (*k, v)))
            .current_dir(work_dir);
        command
    }

    /// `<root>/<lease_id>`, created for this account (mode 0700, owned by it) or, when it is
    /// already there (the lease started again), checked to be a directory of this account's.
    /// `root` is created if missing (mode 0711: the accounts can reach their own directory and
    /// list nobody else's). The directory is changed through a descriptor opened without following
    /// links, so a link planted in its place is refused rather than followed.
    pub fn work_dir(&self, root: &Path, lease_id: &str) -> Result<PathBuf, String> {
        if !root.exists() {
            std::fs::create_dir_all(root)
                .map_err(|e| format!("cannot create {}: {e}", root.display()))?;
            rustix::fs::chmod(root, Mode::from_raw_mode(0o711))
                .map_err(|e| format!("cannot set the mode of {}: {e}", root.display()))?;
        }
        // Whoever could write the root could swap a lease's directory for one of theirs.
        let held =
            rustix::fs::stat(root).map_err(|e| format!("cannot stat {}: {e}", root.display()))?;
        let own = rustix::process::geteuid().as_raw();
        if held.st_uid != own || held.st_mode & 0o022 != 0 {
            return Err(format!(
                "{} (work_dir) must belong to the enforcer's uid {own} and be writable by no one \
                 else; it belongs to uid {} with mode {:o}",
                root.display(),
                held.st_uid,
                held.st_mode & 0o7777
            ));
        }
        let dir = root.join(lease_id);
        match rustix::fs::mkdir(&dir, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
        }
        let fd = rustix::fs::open(
            &dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("cannot open {} as a directory: {e}", dir.display()))?;
        let stat = rustix::fs::fstat(fd.as_fd())
            .map_err(|e| format!("cannot stat {}: {e}", dir.display()))?;
        let ours = stat.st_uid == self.uid || stat.st_uid == rustix::process::geteuid().as_raw();
        if !ours {
            return Err(format!(
                "{} belongs to uid {}, neither to account {} nor to the enforcer",
                dir.display(),
                stat.st_uid,
                self.name
            ));
        }
        rustix::fs::fchown(
            fd.as_fd(),
            Some(rustix::process::Uid::from_raw(self.uid)),
            Some(rustix::process::Gid::from_raw(self.gid)),
        )
        .map_err(|e| {
            format!(
                "cannot give {} to account {}: {e}",
                dir.display(),
                self.name
            )
        })?;
        rustix::fs::fchmod(fd.as_fd(), Mode::from_raw_mode(0o700))
            .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))?;
        Ok(dir)
    }
}
