//! The lease of the virtual machine this collector runs in, read from the machine's SMBIOS OEM
//! strings.
//!
//! A GPU passed through to a guest disappears from the host's NVML, so the collector runs inside
//! the guest, where no process needs to name a lease: gpuwarden's `libvirt` driver writes the
//! lease into the domain's SMBIOS OEM strings (`<oemStrings><entry>gpuwarden.lease_id=<id>`,
//! which QEMU passes as `-smbios type=11,value=gpuwarden.lease_id=<id>`), and the guest's kernel
//! shows each SMBIOS structure as `<type>-<instance>/raw` under `/sys/firmware/dmi/entries`
//! (`collector.dmi_entries_dir`; the kernel's `dmi-sysfs`, a module on some distributions; the
//! `raw` files are readable by root only, so an unprivileged collector warns and finds none).
//! [`read_lease`] reads every `11-*` (OEM Strings) structure there, byte-exactly and
//! bounds-checked: a truncated, oversized or otherwise malformed file, or an id outside
//! [`is_lease_id`]'s rules, is ignored with one warning, never a panic. Several structures may
//! exist (systemd credentials and cloud vendors use OEM strings too); two different leases named
//! name none, since a guest belongs to one lease.
//!
//! It is read once, at start: a domain's SMBIOS is fixed when it boots, and the driver gives a
//! lease a domain of its own, so the lease cannot change while the collector runs. The NVML
//! source ([`crate::nvml`]) then gives it to every sample whose lease no process or pod names,
//! idle GPUs included: a passed-through GPU works for the machine's lease whether or not
//! anything runs on it.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use gpuwarden_schema::lease::{is_lease_id, LEASE_ID_MAX};
pub use gpuwarden_schema::libvirt::OEM_LEASE_PREFIX;
use thiserror::Error;

/// The default of `collector.dmi_entries_dir`: where Linux shows each SMBIOS structure.
pub const DEFAULT_DMI_ENTRIES_DIR: &str = "/sys/firmware/dmi/entries";

/// SMBIOS structure type 11, OEM Strings.
const OEM_STRINGS: u8 = 11;

/// The formatted area of an OEM Strings structure: type, length, 2-byte handle, string count.
const HEADER_LEN: usize = 5;

/// The most bytes read from one `raw` file: a whole SMBIOS 2 table has at most 65535 bytes, and
/// real OEM Strings structures are well under a kilobyte, so a file past this is no structure
/// firmware wrote.
const RAW_MAX: u64 = 64 << 10;

/// Why the bytes of a `raw` file are not an OEM Strings structure.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RawError {
    /// Fewer bytes than the formatted area of an OEM Strings structure.
    #[error("{0} bytes, fewer than the 5 of an OEM Strings structure's header")]
    Short(usize),
    /// The type byte is not 11.
    #[error("structure type {0}, not 11 (OEM Strings)")]
    Type(u8),
    /// The length byte points before the string count or past the end of the file.
    #[error("its length byte says {length}, outside 5..={available}")]
    Length {
        /// The length byte.
        length: u8,
        /// The bytes there are.
        available: usize,
    },
    /// The string set runs to the end of the file without its terminating NUL.
    #[error("its string set has no terminating NUL (truncated)")]
    Unterminated,
    /// The string set begins with an empty string, which SMBIOS does not allow.
    #[error("its string set begins with an empty string")]
    EmptyString,
    /// The count byte disagrees with the strings present.
    #[error("its count byte says {count} strings, the string set has {found}")]
    Count {
        /// The count byte.
        count: u8,
        /// The strings present.
        found: usize,
    },
    /// Bytes follow the string set's terminating NUL.
    #[error("{0} bytes follow the end of the structure")]
    Trailing(usize),
}

/// The strings of one raw OEM Strings structure, as the kernel shows it: type 11, the length of
/// the formatted area, a 2-byte handle, the string count; then, from offset `length`, the
/// string set: each string ended by a NUL, the set by one more (two NULs when it is empty).
/// Nothing is assumed that the bytes do not say.
pub fn oem_strings(raw: &[u8]) -> Result<Vec<&[u8]>, RawError> {
    let (&kind, &length, &count) = match raw {
        [kind, length, _, _, count, ..] => (kind, length, count),
        _ => return Err(RawError::Short(raw.len())),
    };
    if kind != OEM_STRINGS {
        return Err(RawError::Type(kind));
    }
    let mut rest = match raw.get(usize::from(length)..) {
        Some(rest) if usize::from(length) >= HEADER_LEN => rest,
        _ => {
            return Err(RawError::Length {
                length,
                available: raw.len(),
            })
        }
    };
    let mut strings = Vec::new();
    loop {
        match rest.iter().position(|&b| b == 0) {
            None => return Err(RawError::Unterminated),
            Some(0) if strings.is_empty() => {
                // A set without strings is two NULs.
                rest = match rest {
                    [0, 0, tail @ ..] => tail,
                    [0] => return Err(RawError::Unterminated),
                    _ => return Err(RawError::EmptyString),
                };
                break;
            }
            Some(0) => {
                // The NUL after the last string's.
                rest = &rest[1..];
                break;
            }
            Some(end) => {
                strings.push(&rest[..end]);
                rest = &rest[end + 1..];
            }
        }
    }
    if !rest.is_empty() {
        return Err(RawError::Trailing(rest.len()));
    }
    if strings.len() != usize::from(count) {
        return Err(RawError::Count {
            count,
            found: strings.len(),
        });
    }
    Ok(strings)
}

/// What one OEM string says about the machine's lease: nothing (another string), a
/// well-formed lease id, or an id that is not one (an error for a person, with the value
/// shown safely).
fn lease_in(string: &[u8]) -> Option<Result<String, String>> {
    let value = string.strip_prefix(OEM_LEASE_PREFIX.as_bytes())?;
    Some(match std::str::from_utf8(value) {
        Ok(id) if is_lease_id(id) => Ok(id.to_owned()),
        _ => Err(format!(
            "`{OEM_LEASE_PREFIX}{}` names no lease: an id is 1 to {LEASE_ID_MAX} ASCII letters, \
             digits, '-', '_' or '.', not starting with '.'",
            shown(value)
        )),
    })
}

/// At most 64 bytes of an untrusted value, escaped, for a log line.
fn shown(value: &[u8]) -> String {
    let head = &value[..value.len().min(64)];
    let mut text: String = String::from_utf8_lossy(head).escape_debug().collect();
    if value.len() > head.len() {
        text.push_str(&format!("… ({} bytes)", value.len()));
    }
    text
}

/// What the SMBIOS entries of a directory say.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// The well-formed lease ids named, each once, in the order of the entries' instances.
    pub leases: Vec<String>,
    /// Each OEM Strings entry that could not be used, with why (one per file).
    pub ignored: Vec<(PathBuf, String)>,
}

/// Reads every OEM Strings structure (`11-<instance>/raw`) under `dir`, in instance order.
/// Fails only when `dir` itself cannot be listed.
pub fn scan(dir: &Path) -> std::io::Result<Scan> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let instance = name
            .to_str()
            .and_then(|name| name.strip_prefix("11-"))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u32>().ok());
        if let Some(instance) = instance {
            entries.push((instance, dir.join(name).join("raw")));
        }
    }
    entries.sort();
    let mut scan = Scan::default();
    for (_, path) in entries {
        match read_raw(&path) {
            Err(why) => scan.ignored.push((path, why)),
            Ok(raw) => match oem_strings(&raw) {
                Err(e) => scan.ignored.push((path, e.to_string())),
                Ok(strings) => {
                    let mut bad = None;
                    for found in strings.into_iter().filter_map(lease_in) {
                        match found {
                            Ok(id) if !scan.leases.contains(&id) => scan.leases.push(id),
                            Ok(_) => {}
                            Err(why) => bad = bad.or(Some(why)),
                        }
                    }
                    if let Some(why) = bad {
                        scan.ignored.push((path, why));
                    }
                }
            },
        }
    }
    Ok(scan)
}

/// The bytes of a `raw` file, at most [`RAW_MAX`]. Only a regular file is opened: a FIFO in a
/// directory set up by hand would block the sampling thread's start for good.
fn read_raw(path: &Path) -> Result<Vec<u8>, String> {
    let metadata = std::fs::metadata(path).map_err(|e| format!("cannot be read: {e}"))?;
    if !metadata.is_file() {
        return Err("is not a regular file".into());
    }
    let file = std::fs::File::open(path).map_err(|e| format!("cannot be read: {e}"))?;
    let mut raw = Vec::new();
    file.take(RAW_MAX + 1)
        .read_to_end(&mut raw)
        .map_err(|e| format!("cannot be read: {e}"))?;
    if raw.len() as u64 > RAW_MAX {
        return Err(format!(
            "is over {RAW_MAX} bytes, which no SMBIOS structure is"
        ));
    }
    Ok(raw)
}

/// The lease the machine's SMBIOS names under `dir` (see the module's doc), logging once what
/// was found: the lease, or that none was named and why.
pub fn read_lease(dir: &Path) -> Option<String> {
    let scan = match scan(dir) {
        Ok(scan) => scan,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(dir = %dir.display(), "no SMBIOS entries directory: GPUs are not attributed to a virtual machine's lease (inside a VM, load the kernel's dmi-sysfs module or set collector.dmi_entries_dir)");
            return None;
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot list the SMBIOS entries directory (collector.dmi_entries_dir): GPUs are not attributed to a virtual machine's lease");
            return None;
        }
    };
    for (path, why) in &scan.ignored {
        tracing::warn!(file = %path.display(), reason = %why, "ignoring an SMBIOS OEM Strings entry");
    }
    match scan.leases.as_slice() {
        [] => {
            tracing::info!(dir = %dir.display(), "the SMBIOS OEM strings name no gpuwarden lease: this is not a virtual machine of gpuwarden's libvirt driver");
            None
        }
        [lease] => {
            tracing::info!(lease_id = %lease, "this is the virtual machine of a lease, as its SMBIOS OEM strings say: every GPU works for it unless a process or pod names another lease");
            Some(lease.clone())
        }
        several => {
            tracing::warn!(leases = ?several, "the SMBIOS OEM strings name several gpuwarden leases; a machine belongs to one, so GPUs are attributed to none of them");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An OEM Strings structure as QEMU builds it for `-smbios type=11,value=…,value=…`
    /// (formatted area of 5 bytes, handle 0x0E00 as QEMU numbers type 11, the strings, the set's
    /// closing NUL).
    const QEMU_OEM_STRINGS: &[u8] = b"\x0b\x05\x00\x0e\x03\
        io.systemd.credential:hostname=vm-7\0\
        gpuwarden.lease_id=l-vm-7\0\
        tenant=ml\0\
        \0";

    /// The bytes of an OEM Strings structure with `strings`, as the kernel shows it.
    fn structure(handle: u16, strings: &[&[u8]]) -> Vec<u8> {
        let [lo, hi] = handle.to_le_bytes();
        let mut raw = vec![11, 5, lo, hi, strings.len() as u8];
        for s in strings {
            raw.extend_from_slice(s);
            raw.push(0);
        }
        if strings.is_empty() {
            raw.push(0);
        }
        raw.push(0);
        raw
    }

    #[test]
    fn the_strings_of_a_real_structure_are_read_in_order() {
        let strings = oem_strings(QEMU_OEM_STRINGS).unwrap();
        assert_eq!(
            strings,
            [
                &b"io.systemd.credential:hostname=vm-7"[..],
                b"gpuwarden.lease_id=l-vm-7",
                b"tenant=ml"
            ]
        );
        let leases: Vec<_> = strings.into_iter().filter_map(lease_in).collect();
        assert_eq!(leases, [Ok("l-vm-7".to_owned())], "the lease, not first");
        assert_eq!(
            structure(
                0x0e00,
                &[
                    b"io.systemd.credential:hostname=vm-7",
                    b"gpuwarden.lease_id=l-vm-7",
                    b"tenant=ml"
                ]
            ),
            QEMU_OEM_STRINGS,
            "the test's builder writes what QEMU does"
        );
    }

    #[test]
    fn a_longer_formatted_area_and_an_empty_set_are_read() {
        // A later SMBIOS version may add fields: the strings start at `length`, wherever that is.
        assert_eq!(
            oem_strings(b"\x0b\x07\x01\x00\x01\xaa\xbbgpuwarden.lease_id=l-1\0\0").unwrap(),
            [&b"gpuwarden.lease_id=l-1"[..]]
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x01\x00\x00\0\0").unwrap(),
            Vec::<&[u8]>::new()
        );
    }

    #[test]
    fn every_truncation_of_a_structure_is_refused() {
        for len in 0..QEMU_OEM_STRINGS.len() {
            let cut = &QEMU_OEM_STRINGS[..len];
            let err = oem_strings(cut).unwrap_err();
            let expected = if len < 5 {
                RawError::Short(len)
            } else {
                RawError::Unterminated
            };
            assert_eq!(err, expected, "{len} bytes");
        }
        let empty = b"\x0b\x05\x01\x00\x00\0\0";
        assert_eq!(oem_strings(&empty[..6]), Err(RawError::Unterminated));
    }

    #[test]
    fn missing_terminators_and_wrong_counts_are_refused() {
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x01gpuwarden.lease_id=l-1"),
            Err(RawError::Unterminated),
            "no NUL at all"
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x01gpuwarden.lease_id=l-1\0"),
            Err(RawError::Unterminated),
            "no NUL closing the set"
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x02a\0gpuwarden.lease_id=l-1\0"),
            Err(RawError::Unterminated)
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x01\0gpuwarden.lease_id=l-1\0\0"),
            Err(RawError::EmptyString)
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x03a\0b\0\0"),
            Err(RawError::Count { count: 3, found: 2 })
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x01\0\0"),
            Err(RawError::Count { count: 1, found: 0 })
        );
        assert_eq!(
            oem_strings(b"\x0b\x05\x00\x0b\x01a\0\0gpuwarden.lease_id=l-1\0\0"),
            Err(RawError::Trailing(24)),
            "a string after the set's end is no string of it"
        );
    }

    #[test]
    fn a_header_that_is_no_oem_strings_header_is_refused() {
        assert_eq!(
            oem_strings(b"\x01\x05\x00\x0b\x01a\0\0"),
            Err(RawError::Type(1))
        );
        assert_eq!(
            oem_strings(b"\x0b\x04\x00\x0b\x01a\0\0"),
            Err(RawError::Length {
                length: 4,
                available: 8
            })
        );
        assert_eq!(
            oem_strings(b"\x0b\xff\x00\x0b\x01a\0\0"),
            Err(RawError::Length {
                length: 255,
                available: 8
            })
        );
        assert_eq!(
            oem_strings(b"\x0b\x08\x00\x0b\x00\0\0\0"),
            Err(RawError::Unterminated),
            "a formatted area that eats the set"
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_what_is_read_is_consistent() {
        // A fixed xorshift sequence: small structures, mostly near-valid, many broken.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0;
        for _ in 0..20_000 {
            let len = (next() % 24) as usize;
            let mut raw: Vec<u8> = (0..len)
                .map(|_| match next() % 4 {
                    0 => 0,
                    1 => b'a',
                    _ => next() as u8,
                })
                .collect();
            if let Some(first) = raw.first_mut() {
                if next() % 4 != 0 {
                    *first = 11;
                }
            }
            if raw.len() > 1 && next() % 2 == 0 {
                raw[1] = 5;
            }
            if let Ok(strings) = oem_strings(&raw) {
                accepted += 1;
                assert_eq!(strings.len(), usize::from(raw[4]), "{raw:?}");
                assert!(
                    strings.iter().all(|s| !s.is_empty() && !s.contains(&0)),
                    "{raw:?}"
                );
            }
        }
        assert!(accepted > 0, "the sequence reaches valid structures too");
    }

    #[test]
    fn only_well_formed_lease_ids_are_taken() {
        let lease = |s: &[u8]| lease_in(s);
        assert_eq!(lease(b"gpuwarden.lease_id=l-1"), Some(Ok("l-1".into())));
        assert_eq!(
            lease(b"gpuwarden.lease_id=kueue-5a1e2c3d-0b4f-4e6a-8c7d-9e0f1a2b3c4d-2"),
            Some(Ok("kueue-5a1e2c3d-0b4f-4e6a-8c7d-9e0f1a2b3c4d-2".into()))
        );
        assert_eq!(lease(b"gpuwarden.lease_id"), None);
        assert_eq!(lease(b"GPUWARDEN.LEASE_ID=l-1"), None, "the exact prefix");
        assert_eq!(lease(b"x-gpuwarden.lease_id=l-1"), None);
        let long = format!("gpuwarden.lease_id={}", "x".repeat(LEASE_ID_MAX));
        assert_eq!(lease(long.as_bytes()), Some(Ok("x".repeat(LEASE_ID_MAX))));
        for bad in [
            &b"gpuwarden.lease_id="[..],
            b"gpuwarden.lease_id=l-1\n",
            b"gpuwarden.lease_id=l\x1b[31m-1",
            b"gpuwarden.lease_id=l\x7f1",
            b"gpuwarden.lease_id= l-1",
            b"gpuwarden.lease_id=../etc",
            b"gpuwarden.lease_id=.l",
            b"gpuwarden.lease_id=l-\xff",
            b"gpuwarden.lease_id=l\xc3\xa9",
            b"gpuwarden.lease_id=l-1=l-2",
        ] {
            let why = lease(bad).unwrap().unwrap_err();
            assert!(why.contains("names no lease"), "{why}");
            assert!(!why.chars().any(char::is_control), "escaped: {why:?}");
        }
        let over = format!("gpuwarden.lease_id={}", "x".repeat(LEASE_ID_MAX + 1));
        let why = lease(over.as_bytes()).unwrap().unwrap_err();
        assert!(why.contains("(201 bytes)"), "shown cut short: {why}");
    }

    /// A fake `/sys/firmware/dmi/entries`.
    struct Entries(tempfile::TempDir);

    impl Entries {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }

        fn entry(&self, name: &str, raw: &[u8]) -> &Self {
            let dir = self.0.path().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("raw"), raw).unwrap();
            self
        }

        fn path(&self) -> &Path {
            self.0.path()
        }
    }

    /// A type-1 (System Information) structure whose strings happen to hold the lease's
    /// prefix: not an OEM string, so not read.
    const SYSTEM_INFORMATION: &[u8] = b"\x01\x1b\x00\x01\x01\x02\x03\x04\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\x06\0\0QEMU\0gpuwarden.lease_id=l-wrong\0pc\0\0";

    #[test]
    fn the_lease_is_found_among_several_structures_and_other_entries() {
        let entries = Entries::new();
        entries
            .entry("0-0", b"\x00\x18\x00\x00\x01\x02\xe8\x03\x00\x08\0\0\0\0\0\0\0\0\0\0\0\0\0\0SeaBIOS\0rel-1.16\0\0")
            .entry("1-0", SYSTEM_INFORMATION)
            .entry("11-0", &structure(0x0b00, &[b"io.systemd.credential:x=y"]))
            .entry("11-1", QEMU_OEM_STRINGS)
            .entry("11-2", &structure(0x0b02, &[b"gpuwarden.lease_id=l-vm-7"]))
            .entry("127-0", b"\x7f\x04\xff\xfe\0\0");
        let scan = scan(entries.path()).unwrap();
        assert_eq!(scan.leases, ["l-vm-7"], "named twice, one lease");
        assert_eq!(scan.ignored, []);
        assert_eq!(read_lease(entries.path()), Some("l-vm-7".into()));
    }

    #[test]
    fn broken_entries_are_ignored_each_with_its_reason() {
        let entries = Entries::new();
        entries
            .entry("11-0", &QEMU_OEM_STRINGS[..20])
            .entry(
                "11-1",
                &structure(0x0b01, &[b"gpuwarden.lease_id=l 7", b"a"]),
            )
            .entry("11-2", b"\x01\x05\x00\x0b\x00\0\0")
            .entry("11-3", &vec![11; RAW_MAX as usize + 1])
            .entry("11-10", &structure(0x0b0a, &[b"gpuwarden.lease_id=l-vm-9"]))
            .entry("11-x", &structure(0, &[b"gpuwarden.lease_id=l-other"]))
            .entry("111-0", &structure(0, &[b"gpuwarden.lease_id=l-other"]));
        std::fs::create_dir(entries.path().join("11-4")).unwrap();
        std::fs::create_dir_all(entries.path().join("11-5/raw")).unwrap();
        std::fs::create_dir(entries.path().join("11-6")).unwrap();
        let fifo = std::process::Command::new("mkfifo")
            .arg(entries.path().join("11-6/raw"))
            .status()
            .unwrap();
        assert!(fifo.success());
        let scan = scan(entries.path()).unwrap();
        assert_eq!(scan.leases, ["l-vm-9"]);
        let why: Vec<(String, &str)> = scan
            .ignored
            .iter()
            .map(|(path, why)| {
                let entry = path.parent().unwrap().file_name().unwrap();
                (entry.to_string_lossy().into_owned(), why.as_str())
            })
            .collect();
        assert_eq!(why.len(), 7, "{why:#?}");
        assert_eq!(why[0].0, "11-0");
        assert!(why[0].1.contains("truncated"), "{}", why[0].1);
        assert_eq!(why[1].0, "11-1");
        assert!(
            why[1].1.contains("`gpuwarden.lease_id=l 7` names no lease"),
            "{}",
            why[1].1
        );
        assert_eq!(why[2].0, "11-2");
        assert!(why[2].1.contains("type 1, not 11"), "{}", why[2].1);
        assert_eq!(why[3].0, "11-3");
        assert!(why[3].1.contains("over 65536 bytes"), "{}", why[3].1);
        assert_eq!(why[4].0, "11-4");
        assert!(why[4].1.contains("cannot be read"), "{}", why[4].1);
        assert_eq!(why[5], ("11-5".into(), "is not a regular file"));
        assert_eq!(
            why[6],
            ("11-6".into(), "is not a regular file"),
            "a FIFO is not opened (it would block)"
        );
        assert_eq!(read_lease(entries.path()), Some("l-vm-9".into()));
    }

    #[test]
    fn no_lease_several_leases_or_no_directory_name_none() {
        let entries = Entries::new();
        assert_eq!(scan(entries.path()).unwrap(), Scan::default());
        assert_eq!(read_lease(entries.path()), None, "no entries");
        entries.entry("11-0", &structure(0x0b00, &[b"vendor"]));
        assert_eq!(
            read_lease(entries.path()),
            None,
            "no lease among the strings"
        );
        entries
            .entry("11-1", &structure(0x0b01, &[b"gpuwarden.lease_id=l-a"]))
            .entry("11-2", &structure(0x0b02, &[b"gpuwarden.lease_id=l-b"]));
        assert_eq!(scan(entries.path()).unwrap().leases, ["l-a", "l-b"]);
        assert_eq!(read_lease(entries.path()), None, "two leases: neither");
        assert_eq!(read_lease(&entries.path().join("missing")), None);
        assert_eq!(
            scan(&entries.path().join("missing")).unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
    }
}
