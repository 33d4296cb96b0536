//! A process's environment as `/proc/<pid>/environ` holds it (NUL-separated `NAME=value`): one
//! variable's value, and the variable by which a process names its gpuwarden lease.
//!
//! Both lease finders read it: [`crate::nvml`]'s for a GPU's compute processes, and
//! [`crate::kubelet`]'s for a process in a pod's cgroup.

/// The environment variable that names a process's lease.
pub const LEASE_ENV: &str = "GPUWARDEN_LEASE_ID";

/// The value of `name` in a NUL-separated environment, the first if it appears twice (as
/// `getenv` does).
pub(crate) fn env_var<'e>(environ: &'e [u8], name: &str) -> Option<&'e [u8]> {
    environ.split(|b| *b == 0).find_map(|var| {
        var.strip_prefix(name.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"="))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_is_its_first_exact_name() {
        let environ = b"GPUWARDEN_LEASE_IDX=no\0GPUWARDEN_LEASE_ID=l-1\0GPUWARDEN_LEASE_ID=l-2\0";
        assert_eq!(env_var(environ, LEASE_ENV), Some(&b"l-1"[..]));
        assert_eq!(env_var(b"GPUWARDEN_LEASE_ID=\0", LEASE_ENV), Some(&b""[..]));
        assert_eq!(env_var(b"PATH=/bin\0", LEASE_ENV), None);
        assert_eq!(env_var(b"", LEASE_ENV), None);
    }
}
