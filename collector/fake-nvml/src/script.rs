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
    /// GPU performance monitoring: present means the chip has it (Hopper and
    /// later); its values are the whole GPU's.
    pub gpm: Option<GpmScript>,
    /// Multi-Instance GPU: present means the GPU is MIG-capable.
    pub mig: Option<MigScript>,
}

/// GPM metrics, each a per-interval series of percentages: value `i` is the
/// rate over the interval between the `i`-th and `(i+1)`-th GPM sample taken
/// of this GPU (or GPU instance). An omitted metric answers
/// NVML_ERROR_NOT_SUPPORTED in its slot of `nvmlGpmMetricsGet`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpmScript {
    /// NVML_GPM_METRIC_GRAPHICS_UTIL.
    pub graphics_util: Option<Series<f64>>,
    /// NVML_GPM_METRIC_SM_UTIL.
    pub sm_util: Option<Series<f64>>,
    /// NVML_GPM_METRIC_SM_OCCUPANCY.
    pub sm_occupancy: Option<Series<f64>>,
    /// NVML_GPM_METRIC_ANY_TENSOR_UTIL.
    pub any_tensor_util: Option<Series<f64>>,
    /// NVML_GPM_METRIC_DRAM_BW_UTIL.
    pub dram_bw_util: Option<Series<f64>>,
}

impl GpmScript {
    /// The series of NVML metric id `id`, if the script has one.
    pub fn metric(&self, id: u32) -> Option<&Series<f64>> {
        match id {
            GPM_GRAPHICS_UTIL => self.graphics_util.as_ref(),
            GPM_SM_UTIL => self.sm_util.as_ref(),
            GPM_SM_OCCUPANCY => self.sm_occupancy.as_ref(),
            GPM_ANY_TENSOR_UTIL => self.any_tensor_util.as_ref(),
            GPM_DRAM_BW_UTIL => self.dram_bw_util.as_ref(),
            _ => None,
        }
    }

    /// The average rate over intervals `from..to` (the numbers of the two
    /// GPM samples), as NVML computes it from two samples' counters. Both
    /// numbers count calls, so the loop is as long as the caller's polling.
    pub fn average(series: &Series<f64>, from: u64, to: u64) -> f64 {
        (from..to).map(|i| *series.at(i)).sum::<f64>() / (to - from) as f64
    }
}

// `nvmlGpmMetricId_t` values of the metrics a script can carry.
pub const GPM_GRAPHICS_UTIL: u32 = 1;
pub const GPM_SM_UTIL: u32 = 2;
pub const GPM_SM_OCCUPANCY: u32 = 3;
pub const GPM_ANY_TENSOR_UTIL: u32 = 5;
pub const GPM_DRAM_BW_UTIL: u32 = 10;

/// A MIG-capable GPU: its mode and the MIG devices (one compute instance
/// filling one GPU instance each) made on it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigScript {
    /// The current (and pending) MIG mode.
    pub enabled: bool,
    /// The GPU's compute slices: 7 on an A100 or H100, 4 on an A30.
    pub slices: u32,
    /// The MIG devices, in `nvmlDeviceGetMigDeviceHandleByIndex` order.
    #[serde(default)]
    pub instances: Vec<MigInstanceScript>,
}

/// The GPU slice counts NVML has GPU instance profiles for.
pub const PROFILE_SLICES: [u32; 7] = [1, 2, 3, 4, 7, 8, 6];

/// One MIG device.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigInstanceScript {
    pub uuid: String,
    /// The profile, e.g. `1g.10gb`; the device's name is the GPU's name,
    /// ` MIG `, and this.
    pub profile: String,
    /// Its compute slices.
    pub slices: u32,
    pub gpu_instance_id: u32,
    #[serde(default)]
    pub compute_instance_id: u32,
    pub memory_total_bytes: Option<u64>,
    pub memory_used_bytes: Option<Series<u64>>,
    /// One process list per sample of the GPU, as for a GPU.
    pub processes: Option<Vec<Vec<ProcessScript>>>,
    /// The GPU instance's GPM values, read with `nvmlGpmMigSampleGet`.
    pub gpm: Option<GpmScript>,
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
    /// `nvmlGpmSampleGet` and `nvmlGpmMigSampleGet`.
    pub gpm: Option<FailCode>,
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
        if let Some(mig) = &d.mig {
            validate_mig(script, i, d, mig)?;
        }
    }
    Ok(())
}

fn validate_mig(
    script: &Script,
    i: usize,
    d: &DeviceScript,
    mig: &MigScript,
) -> Result<(), String> {
    let at = |field: &str| format!("devices[{i}].mig.{field}");
    if !PROFILE_SLICES.contains(&mig.slices) {
        return Err(format!(
            "{}: {} is no GPU size NVML has profiles for ({PROFILE_SLICES:?})",
            at("slices"),
            mig.slices
        ));
    }
    if !mig.enabled && !mig.instances.is_empty() {
        return Err(format!(
            "{}: MIG devices need MIG mode enabled",
            at("instances")
        ));
    }
    if mig.enabled && d.processes.is_some() {
        // In MIG mode every process runs in a MIG device.
        return Err(format!(
            "devices[{i}].processes: a GPU in MIG mode has its processes in its MIG devices"
        ));
    }
    let used: u32 = mig.instances.iter().map(|m| m.slices).sum();
    if used > mig.slices {
        return Err(format!(
            "{}: the MIG devices take {used} slices of {}",
            at("instances"),
            mig.slices
        ));
    }
    for (j, m) in mig.instances.iter().enumerate() {
        let at = |field: &str| format!("devices[{i}].mig.instances[{j}].{field}");
        check_str(&at("uuid"), &Some(m.uuid.clone()), UUID_BUFFER)?;
        let name = format!(
            "{} MIG {}",
            d.name.as_deref().unwrap_or_default(),
            m.profile
        );
        check_str(&at("profile"), &Some(name), NAME_BUFFER)?;
        if m.profile.is_empty() {
            return Err(format!("{}: must not be empty", at("profile")));
        }
        if m.slices == 0 {
            return Err(format!("{}: must be at least 1", at("slices")));
        }
        if matches!(&m.processes, Some(p) if p.is_empty()) {
            return Err(format!(
                "{}: needs at least one sample (use [[]] for no processes)",
                at("processes")
            ));
        }
        let clash = script.devices.iter().enumerate().any(|(k, o)| {
            o.uuid.as_deref() == Some(&m.uuid)
                || o.mig
                    .iter()
                    .flat_map(|g| g.instances.iter().enumerate())
                    .any(|(l, other)| (k, l) != (i, j) && other.uuid == m.uuid)
        });
        if clash {
            return Err(format!("{}: duplicate uuid {:?}", at("uuid"), m.uuid));
        }
        if mig.instances[..j]
            .iter()
            .any(|o| o.gpu_instance_id == m.gpu_instance_id)
        {
            // One compute instance per GPU instance: GPM is per GPU instance.
            return Err(format!(
                "{}: duplicate GPU instance {}",
                at("gpu_instance_id"),
                m.gpu_instance_id
            ));
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
    fn checks_mig_layouts() {
        let gpu = |mig: &str| {
            format!(r#"{{"devices": [{{"uuid": "GPU-a", "name": "H100", "mig": {mig}}}]}}"#)
        };
        let one = |uuid: &str, gi: u32, slices: u32| {
            format!(
                r#"{{"uuid": "{uuid}", "profile": "{slices}g.10gb", "slices": {slices}, "gpu_instance_id": {gi}}}"#
            )
        };
        let ok = parse(&gpu(&format!(
            r#"{{"enabled": true, "slices": 7, "instances": [{}, {}]}}"#,
            one("MIG-1", 1, 4),
            one("MIG-2", 2, 3)
        )))
        .unwrap();
        let mig = ok.devices[0].mig.as_ref().unwrap();
        assert_eq!(
            (mig.instances.len(), mig.instances[1].compute_instance_id),
            (2, 0)
        );
        for (bad, why) in [
            (
                r#"{"enabled": true, "slices": 5}"#.to_string(),
                "no 5-slice GPU",
            ),
            (
                format!(
                    r#"{{"enabled": false, "slices": 7, "instances": [{}]}}"#,
                    one("MIG-1", 1, 1)
                ),
                "MIG off",
            ),
            (
                format!(
                    r#"{{"enabled": true, "slices": 7, "instances": [{}, {}]}}"#,
                    one("MIG-1", 1, 4),
                    one("MIG-2", 2, 4)
                ),
                "8 of 7 slices",
            ),
            (
                format!(
                    r#"{{"enabled": true, "slices": 7, "instances": [{}, {}]}}"#,
                    one("MIG-1", 1, 1),
                    one("MIG-1", 2, 1)
                ),
                "one UUID twice",
            ),
            (
                format!(
                    r#"{{"enabled": true, "slices": 7, "instances": [{}]}}"#,
                    one("GPU-a", 1, 1)
                ),
                "a GPU's UUID",
            ),
            (
                format!(
                    r#"{{"enabled": true, "slices": 7, "instances": [{}, {}]}}"#,
                    one("MIG-1", 3, 1),
                    one("MIG-2", 3, 1)
                ),
                "one GPU instance twice",
            ),
            (
                format!(
                    r#"{{"enabled": true, "slices": 7, "instances": [{}]}}"#,
                    one("MIG-1", 1, 0)
                ),
                "no slices",
            ),
            (
                r#"{"enabled": true, "slices": 7, "bogus": 1}"#.to_string(),
                "unknown key",
            ),
        ] {
            assert!(parse(&gpu(&bad)).is_err(), "{why}");
        }
        assert!(
            parse(r#"{"devices": [{"processes": [[]], "mig": {"enabled": true, "slices": 7}}]}"#)
                .is_err(),
            "a GPU in MIG mode has no processes of its own"
        );
        assert!(parse(r#"{"devices": [{"gpm": {"sm_util": [2], "sm_active": 1}}]}"#).is_err());
    }

    #[test]
    fn gpm_averages_the_rates_between_two_samples() {
        let s: Series<f64> = serde_json::from_str("[10, 20, 60]").unwrap();
        assert_eq!(GpmScript::average(&s, 0, 1), 10.0);
        assert_eq!(GpmScript::average(&s, 1, 3), 40.0);
        assert_eq!(GpmScript::average(&s, 2, 6), 60.0, "the last rate repeats");
        let gpm: GpmScript = serde_json::from_str(r#"{"sm_util": 2}"#).unwrap();
        assert!(gpm.metric(GPM_SM_UTIL).is_some());
        assert!(gpm.metric(GPM_GRAPHICS_UTIL).is_none());
        assert!(gpm.metric(4).is_none(), "INTEGER_UTIL is not scripted");
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
