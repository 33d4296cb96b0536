//! The JSON script: its serde types, the checks run on it at init, and the
//! rule that turns a device's sample number into a value. Everything here is
//! plain safe Rust so the format can be unit-tested without going through FFI.

use serde::Deserialize;

/// Environment variable naming the script file; read at every init that
/// starts a fresh session (see the crate docs for the format).
pub const SCRIPT_ENV: &str = "GPUWARDEN_FAKE_NVML_SCRIPT";

// Buffer sizes from nvml.h. Strings are checked against them at init so that a
// caller using NVML's recommended buffer sizes never sees INSUFFICIENT_SIZE
// because of a typo in a script.
const DRIVER_VERSION_BUFFER: usize = 80;
const NVML_VERSION_BUFFER: usize = 80;
const UUID_BUFFER: usize = 96;
const NAME_BUFFER: usize = 96;
const PCI_BUS_ID_BUFFER: usize = 32;

/// Whole-machine script.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    pub driver_version: Option<String>,
    pub nvml_version: Option<String>,
    pub cuda_driver_version: Option<i32>,
    #[serde(default)]
    pub devices: Vec<DeviceScript>,
}

/// One GPU. Every value is optional: an omitted one makes its getter answer
/// NVML_ERROR_NOT_SUPPORTED, as a real GPU lacking the sensor would.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceScript {
    pub uuid: Option<String>,
    pub name: Option<String>,
    pub index: Option<u32>,
    pub pci_bus_id: Option<String>,
    pub memory_total_bytes: Option<u64>,
    pub memory_used_bytes: Option<Series<u64>>,
    pub util_gpu_pct: Option<Series<u32>>,
    pub util_mem_pct: Option<Series<u32>>,
    pub power_mw: Option<Series<u32>>,
    pub power_limit_mw: Option<u32>,
    pub energy_mj: Option<Series<u64>>,
    pub temp_c: Option<Series<u32>>,
    pub sm_clock_mhz: Option<Series<u32>>,
    /// One process list per sample. No scalar shorthand here: a bare list of
    /// processes would be indistinguishable from a list of samples.
    pub processes: Option<Vec<Vec<ProcessScript>>>,
    #[serde(default)]
    pub fail: FailMap,
    pub lost_at_sample: Option<u64>,
    /// MIG devices on this GPU, found by UUID and giving back their parent.
    #[serde(default)]
    pub mig_devices: Vec<MigDeviceScript>,
}

/// A MIG device: only its UUID, which `nvmlDeviceGetHandleByUUID` finds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigDeviceScript {
    pub uuid: String,
}

/// A process as `nvmlDeviceGetComputeRunningProcesses_v3` reports it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessScript {
    pub pid: u32,
    /// Omitted means NVML_VALUE_NOT_AVAILABLE, which is what WDDM and some
    /// containerised drivers report.
    pub used_memory_bytes: Option<u64>,
}

/// Per-getter forced failures. A struct rather than a map so that a misspelt
/// getter name is rejected instead of silently never firing.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailMap {
    pub uuid: Option<FailCode>,
    pub name: Option<FailCode>,
    pub index: Option<FailCode>,
    pub pci_info: Option<FailCode>,
    pub utilization: Option<FailCode>,
    pub memory_info: Option<FailCode>,
    pub power_usage: Option<FailCode>,
    pub power_limit: Option<FailCode>,
    pub energy: Option<FailCode>,
    pub temperature: Option<FailCode>,
    pub clock: Option<FailCode>,
    pub processes: Option<FailCode>,
}

/// The NVML errors a script may force, named as in the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailCode {
    NotSupported,
    NoPermission,
    Unknown,
    GpuIsLost,
    Timeout,
}

impl FailCode {
    /// The `nvmlReturn_t` value NVML uses for this error.
    pub fn code(self) -> u32 {
        match self {
            FailCode::NotSupported => 3,
            FailCode::NoPermission => 4,
            FailCode::Timeout => 10,
            FailCode::GpuIsLost => 15,
            FailCode::Unknown => 999,
        }
    }
}

/// A per-sample value list. A bare number is accepted as a one-element list
/// because most scripted values never change.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "OneOrMany<T>")]
pub struct Series<T>(Vec<T>);

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> TryFrom<OneOrMany<T>> for Series<T> {
    type Error = &'static str;

    fn try_from(value: OneOrMany<T>) -> Result<Self, Self::Error> {
        match value {
            OneOrMany::One(v) => Ok(Series(vec![v])),
            OneOrMany::Many(v) if v.is_empty() => Err("a value list must not be empty"),
            OneOrMany::Many(v) => Ok(Series(v)),
        }
    }
}

impl<T> Series<T> {
    /// Value for `sample`; the last element repeats once the list runs out.
    pub fn at(&self, sample: u64) -> &T {
        pick(&self.0, sample)
    }
}

/// Indexing rule shared by [`Series`] and the process lists. Callers
/// guarantee `values` is non-empty (checked at parse or init time).
pub fn pick<T>(values: &[T], sample: u64) -> &T {
    let last = values.len().saturating_sub(1);
    let i = usize::try_from(sample).map_or(last, |s| s.min(last));
    &values[i]
}

/// A parsed `domain:bus:device.function` PCI address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub function: u32,
}

impl PciAddress {
    /// Accepts NVML's `%08X:%02X:%02X.%X` form and the 4-digit-domain legacy
    /// form, in either case.
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.split(':');
        let (domain, bus, rest) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let (device, function) = rest.split_once('.')?;
        let hex = |t: &str| {
            if t.is_empty() || t.len() > 8 {
                None
            } else {
                u32::from_str_radix(t, 16).ok()
            }
        };
        Some(Self {
            domain: hex(domain)?,
            bus: hex(bus)?,
            device: hex(device)?,
            function: hex(function)?,
        })
    }

    /// `busIdLegacy` text as NVML formats it.
    pub fn legacy(&self) -> String {
        format!(
            "{:04X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// Reads, parses and checks the script named by [`SCRIPT_ENV`]. The error is
/// a one-line human message for stderr.
pub fn load_from_env() -> Result<Script, String> {
    let path = std::env::var_os(SCRIPT_ENV).ok_or_else(|| format!("{SCRIPT_ENV} is not set"))?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {SCRIPT_ENV}={}: {e}", path.to_string_lossy()))?;
    parse(&text).map_err(|e| format!("invalid script {}: {e}", path.to_string_lossy()))
}

/// Parses and checks a script's text.
pub fn parse(text: &str) -> Result<Script, String> {
    let script: Script = serde_json::from_str(text).map_err(|e| e.to_string())?;
    validate(&script)?;
    Ok(script)
}

fn validate(script: &Script) -> Result<(), String> {
    check_str(
        "driver_version",
        &script.driver_version,
        DRIVER_VERSION_BUFFER,
    )?;
    check_str("nvml_version", &script.nvml_version, NVML_VERSION_BUFFER)?;
    for (i, d) in script.devices.iter().enumerate() {
        let at = |field: &str| format!("devices[{i}].{field}");
        check_str(&at("uuid"), &d.uuid, UUID_BUFFER)?;
        check_str(&at("name"), &d.name, NAME_BUFFER)?;
        check_str(&at("pci_bus_id"), &d.pci_bus_id, PCI_BUS_ID_BUFFER)?;
        if let Some(bus_id) = &d.pci_bus_id {
            if PciAddress::parse(bus_id).is_none() {
                return Err(format!(
                    "{}: {bus_id:?} is not of the form DDDDDDDD:BB:DD.F",
                    at("pci_bus_id")
                ));
            }
        }
        if let Some(samples) = &d.processes {
            if samples.is_empty() {
                return Err(format!(
                    "{}: needs at least one sample (use [[]] for no processes)",
                    at("processes")
                ));
            }
        }
        if let Some(uuid) = &d.uuid {
            let clash = script.devices[..i]
                .iter()
                .any(|o| o.uuid.as_deref() == Some(uuid));
            if clash {
                // Handle-by-UUID could only ever find the first one.
                return Err(format!("{}: duplicate uuid {uuid:?}", at("uuid")));
            }
        }
        for (j, mig) in d.mig_devices.iter().enumerate() {
            let field = at(&format!("mig_devices[{j}].uuid"));
            check_str(&field, &Some(mig.uuid.clone()), UUID_BUFFER)?;
            let clash = script.devices.iter().enumerate().any(|(k, o)| {
                o.uuid.as_deref() == Some(&mig.uuid)
                    || o.mig_devices
                        .iter()
                        .enumerate()
                        .any(|(l, m)| (k, l) != (i, j) && m.uuid == mig.uuid)
            });
            if clash {
                return Err(format!("{field}: duplicate uuid {:?}", mig.uuid));
            }
        }
    }
    Ok(())
}

fn check_str(field: &str, value: &Option<String>, buffer: usize) -> Result<(), String> {
    match value {
        Some(s) if s.contains('\0') => Err(format!("{field}: contains a NUL byte")),
        Some(s) if s.len() >= buffer => Err(format!(
            "{field}: {} bytes does not fit NVML's {buffer}-byte buffer with its NUL",
            s.len()
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_accepts_scalar_and_repeats_last() {
        let s: Series<u32> = serde_json::from_str("7").unwrap();
        assert_eq!(*s.at(0), 7);
        assert_eq!(*s.at(9), 7);
        let s: Series<u32> = serde_json::from_str("[1, 2]").unwrap();
        assert_eq!(
            (*s.at(0), *s.at(1), *s.at(2), *s.at(u64::MAX)),
            (1, 2, 2, 2)
        );
        assert!(serde_json::from_str::<Series<u32>>("[]").is_err());
    }

    #[test]
    fn rejects_unknown_fields_and_fail_names() {
        assert!(parse(r#"{"devices": [{"uuid": "a", "utl_gpu_pct": [1]}]}"#).is_err());
        assert!(parse(r#"{"devices": [{"fail": {"power": "unknown"}}]}"#).is_err());
        assert!(parse(r#"{"devices": [{"fail": {"power_usage": "boom"}}]}"#).is_err());
        assert!(parse(r#"{"bogus": 1}"#).is_err());
    }

    #[test]
    fn checks_strings_processes_and_uuids() {
        assert!(parse(r#"{"devices": [{"pci_bus_id": "17:00.0"}]}"#).is_err());
        assert!(parse(r#"{"devices": [{"processes": []}]}"#).is_err());
        assert!(parse(r#"{"devices": [{"uuid": "a"}, {"uuid": "a"}]}"#).is_err());
        let long = "x".repeat(96);
        assert!(parse(&format!(r#"{{"devices": [{{"name": "{long}"}}]}}"#)).is_err());
        let ok = parse(
            r#"{"devices": [{"uuid": "a", "pci_bus_id": "00000000:17:00.0",
                "processes": [[]], "fail": {"clock": "timeout"}}]}"#,
        )
        .unwrap();
        assert_eq!(ok.devices[0].fail.clock, Some(FailCode::Timeout));
    }

    #[test]
    fn pci_address_round_trip() {
        let a = PciAddress::parse("00000000:17:00.0").unwrap();
        assert_eq!((a.domain, a.bus, a.device, a.function), (0, 0x17, 0, 0));
        assert_eq!(a.legacy(), "0000:17:00.0");
        let b = PciAddress::parse("0001:cA:1f.3").unwrap();
        assert_eq!(b.legacy(), "0001:CA:1F.3");
        assert!(PciAddress::parse("0000:17:00").is_none());
        assert!(PciAddress::parse("0000:17:00.0:1").is_none());
    }
}
