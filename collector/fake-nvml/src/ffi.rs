//! The exported C symbols and the `#[repr(C)]` structs they fill, laid out
//! exactly as nvml.h (and so nvml-wrapper-sys 0.10) declares them. This is
//! the only module that touches raw pointers.
//!
//! Every export shares one safety contract, the one nvml.h documents: each
//! pointer argument is null or valid for the read/write NVML would do, and a
//! `(buffer, length)` pair describes writable memory of that length. Null
//! pointers are rejected with NVML_ERROR_INVALID_ARGUMENT; device handles are
//! validated by address and never dereferenced.

// The symbol names are NVML's ABI and cannot follow Rust naming.
#![allow(non_snake_case)]
// The shared contract above stands in for a `# Safety` section per export.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::ptr;

use crate::codes::{
    message_ptr, NvmlReturn, ARGUMENT_VERSION_MISMATCH, INSUFFICIENT_SIZE, INVALID_ARGUMENT,
    NOT_FOUND, NOT_SUPPORTED, SUCCESS, UNKNOWN,
};
use crate::script::{pick, FailCode, FailMap, ProcessScript};
use crate::state::{self, Device, FailSelector, Sampling};

/// Opaque target of `nvmlDevice_t`; callers only ever hold the pointer.
#[repr(C)]
pub struct NvmlDeviceSt {
    _opaque: [u8; 0],
}

/// `nvmlDevice_t`.
pub type NvmlDevice = *mut NvmlDeviceSt;

/// `nvmlPciInfo_t` (the v3 layout `nvmlDeviceGetPciInfo_v3` fills).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PciInfo {
    pub bus_id_legacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [c_char; 32],
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlMemory_t` (v1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`: size in the low bits, version at bit 24.
/// nvml-wrapper sets exactly this before calling, and real NVML rejects
/// anything else, so the fake does too.
pub const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<MemoryV2>() as c_uint) | (2 << 24);

/// `nvmlProcessInfo_t`, which in NVML 12 is the v2 layout; the `_v2` and
/// `_v3` process queries both fill it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `NVML_VALUE_NOT_AVAILABLE` widened to the 64-bit memory field.
const VALUE_NOT_AVAILABLE_U64: c_ulonglong = c_ulonglong::MAX;
/// Instance id NVML reports when MIG is off.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

const TEMPERATURE_GPU: c_uint = 0;
const CLOCK_GRAPHICS: c_uint = 0;
const CLOCK_SM: c_uint = 1;
const CLOCK_MEM: c_uint = 2;
const CLOCK_VIDEO: c_uint = 3;

fn no_fail(_: &FailMap) -> Option<FailCode> {
    None
}

/// The common path of every per-device getter, in NVML's check order:
/// initialised, valid handle, valid arguments (`bad_args`: a null output or
/// an out-of-range enum), lost/forced failure, and
/// finally whether the script has a value at all.
fn query<T>(
    handle: NvmlDevice,
    bad_args: bool,
    sampling: Sampling,
    fail: FailSelector,
    value: impl FnOnce(&'static Device, u64) -> Option<T>,
) -> Result<T, NvmlReturn> {
    let device = state::session()?.device(handle)?;
    if bad_args {
        return Err(INVALID_ARGUMENT);
    }
    let sample = device.sample(sampling, fail)?;
    value(device, sample).ok_or(NOT_SUPPORTED)
}

/// Writes a getter's result through `out`.
unsafe fn emit<T>(out: *mut T, got: Result<T, NvmlReturn>) -> NvmlReturn {
    match got {
        Ok(_) if out.is_null() => INVALID_ARGUMENT,
        Ok(v) => {
            // SAFETY: non-null, and the caller's contract makes it writable.
            unsafe { out.write(v) };
            SUCCESS
        }
        Err(code) => code,
    }
}

/// Copies `src` plus a NUL into a caller buffer of `len` bytes.
unsafe fn emit_str(dst: *mut c_char, len: c_uint, got: Result<&str, NvmlReturn>) -> NvmlReturn {
    let src = match got {
        Ok(s) => s.as_bytes(),
        Err(code) => return code,
    };
    if dst.is_null() {
        return INVALID_ARGUMENT;
    }
    if src.len() >= len as usize {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: `dst` is non-null and, per the contract, valid for `len` bytes,
    // which we just checked covers the string and its NUL.
    unsafe {
        ptr::copy_nonoverlapping(src.as_ptr().cast::<c_char>(), dst, src.len());
        dst.add(src.len()).write(0);
    }
    SUCCESS
}

/// Copies as much of `src` as fits into a fixed C char array, NUL-terminated.
fn fill_fixed<const N: usize>(src: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(src.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

// ---- init / shutdown / errors -------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> NvmlReturn {
    state::init()
}

/// Flags (NO_GPUS, NO_ATTACH) change nothing observable in a fake.
#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    state::init()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> NvmlReturn {
    state::shutdown()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    message_ptr(result)
}

// ---- system ---------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    let got =
        state::session().and_then(|s| s.script.driver_version.as_deref().ok_or(NOT_SUPPORTED));
    // SAFETY: forwarded caller contract.
    unsafe { emit_str(version, length, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    let got = state::session().and_then(|s| s.script.nvml_version.as_deref().ok_or(NOT_SUPPORTED));
    // SAFETY: forwarded caller contract.
    unsafe { emit_str(version, length, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(
    cuda_driver_version: *mut c_int,
) -> NvmlReturn {
    let got = state::session().and_then(|s| s.script.cuda_driver_version.ok_or(NOT_SUPPORTED));
    // SAFETY: forwarded caller contract.
    unsafe { emit(cuda_driver_version, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    cuda_driver_version: *mut c_int,
) -> NvmlReturn {
    // SAFETY: same signature and contract.
    unsafe { nvmlSystemGetCudaDriverVersion(cuda_driver_version) }
}

// ---- device enumeration ---------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(device_count: *mut c_uint) -> NvmlReturn {
    let got = state::session().and_then(|s| c_uint::try_from(s.devices.len()).map_err(|_| UNKNOWN));
    // SAFETY: forwarded caller contract.
    unsafe { emit(device_count, got) }
}

/// A lost GPU cannot be opened either, so lookups go through the lost check
/// (but not the per-getter `fail` map).
fn lookup_result(device: &'static Device) -> Result<NvmlDevice, NvmlReturn> {
    device.sample(Sampling::Current, no_fail)?;
    Ok(device.handle())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    let got = state::session().and_then(|s| {
        if device.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let d = s.devices.get(index as usize).ok_or(INVALID_ARGUMENT)?;
        lookup_result(d)
    });
    // SAFETY: forwarded caller contract.
    unsafe { emit(device, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    let session = match state::session() {
        Ok(s) => s,
        Err(code) => return code,
    };
    if uuid.is_null() || device.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: non-null, and nvml.h requires a NUL-terminated string.
    let wanted = unsafe { CStr::from_ptr(uuid) }.to_bytes();
    let gpu = session
        .devices
        .iter()
        .find(|d| d.script.uuid.as_deref().map(str::as_bytes) == Some(wanted));
    let got = match gpu {
        Some(gpu) => lookup_result(gpu),
        // A MIG device's UUID opens the MIG device, while its GPU is on the bus.
        None => match session.migs.iter().find(|m| m.uuid.as_bytes() == wanted) {
            Some(mig) => lookup_result(&session.devices[mig.parent]).map(|_| mig.handle()),
            None => Err(NOT_FOUND),
        },
    };
    // SAFETY: forwarded caller contract.
    unsafe { emit(device, got) }
}

/// The GPU of a MIG device handle; any other handle is INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: NvmlDevice,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    let got = state::session().and_then(|s| {
        if device.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let mig = s.mig(mig_device)?;
        lookup_result(&s.devices[mig.parent])
    });
    // SAFETY: forwarded caller contract.
    unsafe { emit(device, got) }
}

// ---- identity -------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: NvmlDevice,
    uuid: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        uuid.is_null(),
        Sampling::Current,
        |f| f.uuid,
        |d, _| d.script.uuid.as_deref(),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit_str(uuid, length, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: NvmlDevice,
    name: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        name.is_null(),
        Sampling::Current,
        |f| f.name,
        |d, _| d.script.name.as_deref(),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit_str(name, length, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    let got = query(
        device,
        index.is_null(),
        Sampling::Current,
        |f| f.index,
        |d, _| d.script.index,
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(index, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: NvmlDevice,
    pci: *mut PciInfo,
) -> NvmlReturn {
    let got = query(
        device,
        pci.is_null(),
        Sampling::Current,
        |f| f.pci_info,
        |d, _| {
            let bus_id = d.script.pci_bus_id.as_deref()?;
            let addr = d.pci?;
            Some(PciInfo {
                bus_id_legacy: fill_fixed(&addr.legacy()),
                domain: addr.domain,
                bus: addr.bus,
                device: addr.device,
                pci_device_id: 0,
                pci_sub_system_id: 0,
                bus_id: fill_fixed(bus_id),
            })
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(pci, got) }
}

// ---- telemetry ------------------------------------------------------------

/// Each call is one sample: it advances the device's sample number even when
/// it then fails, as the clock of a real poller would.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: NvmlDevice,
    utilization: *mut Utilization,
) -> NvmlReturn {
    let got = query(
        device,
        utilization.is_null(),
        Sampling::Advance,
        |f| f.utilization,
        |d, s| {
            Some(Utilization {
                gpu: *d.script.util_gpu_pct.as_ref()?.at(s),
                memory: *d.script.util_mem_pct.as_ref()?.at(s),
            })
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(utilization, got) }
}

fn memory_values(device: NvmlDevice, out_is_null: bool) -> Result<(u64, u64), NvmlReturn> {
    query(
        device,
        out_is_null,
        Sampling::Current,
        |f| f.memory_info,
        |d, s| {
            Some((
                d.script.memory_total_bytes?,
                *d.script.memory_used_bytes.as_ref()?.at(s),
            ))
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut Memory,
) -> NvmlReturn {
    let got = memory_values(device, memory.is_null()).map(|(total, used)| Memory {
        total,
        free: total.saturating_sub(used),
        used,
    });
    // SAFETY: forwarded caller contract.
    unsafe { emit(memory, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut MemoryV2,
) -> NvmlReturn {
    let (total, used) = match memory_values(device, memory.is_null()) {
        Ok(v) => v,
        Err(code) => return code,
    };
    // SAFETY: `memory` is non-null (checked by `memory_values`) and points to
    // the caller's struct, whose version field it must have set.
    let version = unsafe { ptr::addr_of!((*memory).version).read() };
    if version != MEMORY_V2_VERSION {
        return ARGUMENT_VERSION_MISMATCH;
    }
    let info = MemoryV2 {
        version,
        total,
        // The fake has no driver-reserved carve-out; free is what is left.
        reserved: 0,
        free: total.saturating_sub(used),
        used,
    };
    // SAFETY: forwarded caller contract.
    unsafe { emit(memory, Ok(info)) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: NvmlDevice,
    power: *mut c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        power.is_null(),
        Sampling::Current,
        |f| f.power_usage,
        |d, s| d.script.power_mw.as_ref().map(|v| *v.at(s)),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(power, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: NvmlDevice,
    limit: *mut c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        limit.is_null(),
        Sampling::Current,
        |f| f.power_limit,
        |d, _| d.script.power_limit_mw,
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(limit, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: NvmlDevice,
    energy: *mut c_ulonglong,
) -> NvmlReturn {
    let got = query(
        device,
        energy.is_null(),
        Sampling::Current,
        |f| f.energy,
        |d, s| d.script.energy_mj.as_ref().map(|v| *v.at(s)),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(energy, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: NvmlDevice,
    sensor_type: c_uint,
    temp: *mut c_uint,
) -> NvmlReturn {
    // NVML_TEMPERATURE_GPU is the only sensor nvml.h defines.
    let bad_sensor = sensor_type != TEMPERATURE_GPU;
    let got = query(
        device,
        temp.is_null() || bad_sensor,
        Sampling::Current,
        |f| f.temperature,
        |d, s| d.script.temp_c.as_ref().map(|v| *v.at(s)),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(temp, got) }
}

/// Graphics and SM clocks coincide on current datacenter parts, so both read
/// `sm_clock_mhz`; memory and video clocks are not scripted.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: NvmlDevice,
    clock_type: c_uint,
    clock: *mut c_uint,
) -> NvmlReturn {
    let bad_type = !matches!(
        clock_type,
        CLOCK_GRAPHICS | CLOCK_SM | CLOCK_MEM | CLOCK_VIDEO
    );
    let got = query(
        device,
        clock.is_null() || bad_type,
        Sampling::Current,
        |f| f.clock,
        |d, s| match clock_type {
            CLOCK_GRAPHICS | CLOCK_SM => d.script.sm_clock_mhz.as_ref().map(|v| *v.at(s)),
            _ => None,
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(clock, got) }
}

/// NVML's two-call protocol: with `*info_count` too small (0 is the usual
/// probe) it stores the needed count and answers INSUFFICIENT_SIZE; otherwise
/// it fills `infos` and stores how many it wrote.
unsafe fn running_processes(
    device: NvmlDevice,
    info_count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    let got = query(
        device,
        info_count.is_null(),
        Sampling::Current,
        |f| f.processes,
        |d, s| d.script.processes.as_deref().map(|p| pick(p, s).as_slice()),
    );
    let procs: &[ProcessScript] = match got {
        Ok(p) => p,
        Err(code) => return code,
    };
    let Ok(needed) = c_uint::try_from(procs.len()) else {
        return UNKNOWN;
    };
    // SAFETY: `info_count` is non-null (checked by `query`) and in/out per
    // the contract.
    let capacity = unsafe { info_count.read() };
    // SAFETY: as above.
    unsafe { info_count.write(needed) };
    if capacity < needed {
        return INSUFFICIENT_SIZE;
    }
    if needed > 0 && infos.is_null() {
        return INVALID_ARGUMENT;
    }
    for (i, p) in procs.iter().enumerate() {
        let info = ProcessInfo {
            pid: p.pid,
            used_gpu_memory: p.used_memory_bytes.unwrap_or(VALUE_NOT_AVAILABLE_U64),
            gpu_instance_id: NO_INSTANCE,
            compute_instance_id: NO_INSTANCE,
        };
        // SAFETY: `infos` is non-null and the caller promised room for
        // `capacity >= needed > i` entries.
        unsafe { infos.add(i).write(info) };
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: NvmlDevice,
    info_count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    // SAFETY: forwarded caller contract.
    unsafe { running_processes(device, info_count, infos) }
}

/// Same struct layout as `_v3` (`nvmlProcessInfo_v2_t`); kept for callers
/// built with nvml-wrapper's `legacy-functions` feature.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: NvmlDevice,
    info_count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    // SAFETY: forwarded caller contract.
    unsafe { running_processes(device, info_count, infos) }
}

/// MIG is never enabled on a scripted GPU; answering NOT_SUPPORTED sends
/// callers down the whole-GPU path, as on consumer cards.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: NvmlDevice,
    current_mode: *mut c_uint,
    pending_mode: *mut c_uint,
) -> NvmlReturn {
    let got: Result<(), NvmlReturn> = query(
        device,
        current_mode.is_null() || pending_mode.is_null(),
        Sampling::Current,
        no_fail,
        |_, _| None,
    );
    match got {
        Ok(()) => SUCCESS,
        Err(code) => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvml_wrapper_sys::bindings as sys;
    use std::mem::{align_of, offset_of, size_of};

    /// The layouts must match the bindings nvml-wrapper reads them with.
    #[test]
    fn struct_layouts_match_nvml_wrapper_sys() {
        assert_eq!(size_of::<PciInfo>(), size_of::<sys::nvmlPciInfo_t>());
        assert_eq!(align_of::<PciInfo>(), align_of::<sys::nvmlPciInfo_t>());
        assert_eq!(
            offset_of!(PciInfo, domain),
            offset_of!(sys::nvmlPciInfo_t, domain)
        );
        assert_eq!(
            offset_of!(PciInfo, bus_id),
            offset_of!(sys::nvmlPciInfo_t, busId)
        );
        assert_eq!(
            offset_of!(PciInfo, pci_sub_system_id),
            offset_of!(sys::nvmlPciInfo_t, pciSubSystemId)
        );

        assert_eq!(
            size_of::<Utilization>(),
            size_of::<sys::nvmlUtilization_t>()
        );
        assert_eq!(size_of::<Memory>(), size_of::<sys::nvmlMemory_t>());
        assert_eq!(
            offset_of!(Memory, used),
            offset_of!(sys::nvmlMemory_t, used)
        );

        assert_eq!(size_of::<MemoryV2>(), size_of::<sys::nvmlMemory_v2_t>());
        assert_eq!(
            offset_of!(MemoryV2, total),
            offset_of!(sys::nvmlMemory_v2_t, total)
        );
        assert_eq!(
            offset_of!(MemoryV2, reserved),
            offset_of!(sys::nvmlMemory_v2_t, reserved)
        );
        assert_eq!(
            offset_of!(MemoryV2, free),
            offset_of!(sys::nvmlMemory_v2_t, free)
        );
        assert_eq!(
            offset_of!(MemoryV2, used),
            offset_of!(sys::nvmlMemory_v2_t, used)
        );

        assert_eq!(
            size_of::<ProcessInfo>(),
            size_of::<sys::nvmlProcessInfo_t>()
        );
        assert_eq!(
            offset_of!(ProcessInfo, used_gpu_memory),
            offset_of!(sys::nvmlProcessInfo_t, usedGpuMemory)
        );
        assert_eq!(
            offset_of!(ProcessInfo, compute_instance_id),
            offset_of!(sys::nvmlProcessInfo_t, computeInstanceId)
        );
        assert_eq!(
            size_of::<ProcessInfo>(),
            size_of::<sys::nvmlProcessInfo_v2_t>()
        );
    }

    #[test]
    fn constants_match_nvml_wrapper_sys() {
        assert_eq!(
            sys::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
            crate::codes::GPU_IS_LOST
        );
        assert_eq!(
            sys::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
            ARGUMENT_VERSION_MISMATCH
        );
        assert_eq!(sys::nvmlClockType_enum_NVML_CLOCK_SM, CLOCK_SM);
        assert_eq!(
            sys::nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU,
            TEMPERATURE_GPU
        );
        assert_eq!(MEMORY_V2_VERSION, 40 | (2 << 24));
    }

    #[test]
    fn fill_fixed_truncates_with_nul() {
        let a: [c_char; 4] = fill_fixed("abcdef");
        assert_eq!(a, [b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]);
    }

    /// Raw-ABI edge cases nvml-wrapper never provokes. The only unit test
    /// touching the global session, so it needs no serialisation.
    #[test]
    fn raw_abi_edge_cases() {
        use crate::codes::{GPU_IS_LOST, UNINITIALIZED};
        let path = std::env::temp_dir().join(format!("fake-nvml-unit-{}.json", std::process::id()));
        std::fs::write(
            &path,
            r#"{"devices": [{"uuid": "GPU-x", "name": "abc",
            "memory_total_bytes": 10, "memory_used_bytes": 4, "util_gpu_pct": 1,
            "util_mem_pct": 1, "lost_at_sample": 1}]}"#,
        )
        .unwrap();
        std::env::set_var(crate::SCRIPT_ENV, &path);
        unsafe {
            let mut count: c_uint = 0;
            assert_eq!(nvmlDeviceGetCount_v2(&mut count), UNINITIALIZED);
            assert_eq!(nvmlShutdown(), UNINITIALIZED);
            assert_eq!(nvmlInit_v2(), SUCCESS);
            std::fs::remove_file(&path).unwrap();
            assert_eq!(nvmlDeviceGetCount_v2(ptr::null_mut()), INVALID_ARGUMENT);
            let mut dev: NvmlDevice = ptr::null_mut();
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(0, &mut dev), SUCCESS);

            let mut buf = [1 as c_char; 4];
            assert_eq!(
                nvmlDeviceGetName(dev, buf.as_mut_ptr(), 3),
                INSUFFICIENT_SIZE
            );
            assert_eq!(nvmlDeviceGetName(dev, buf.as_mut_ptr(), 4), SUCCESS);
            assert_eq!(CStr::from_ptr(buf.as_ptr()).to_str().unwrap(), "abc");
            assert_eq!(nvmlDeviceGetName(dev, ptr::null_mut(), 4), INVALID_ARGUMENT);

            let mut mem: MemoryV2 = std::mem::zeroed();
            assert_eq!(
                nvmlDeviceGetMemoryInfo_v2(dev, &mut mem),
                ARGUMENT_VERSION_MISMATCH
            );
            mem.version = MEMORY_V2_VERSION;
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(dev, &mut mem), SUCCESS);
            assert_eq!((mem.total, mem.free, mem.used, mem.reserved), (10, 6, 4, 0));

            let mut t: c_uint = 0;
            assert_eq!(nvmlDeviceGetTemperature(dev, 1, &mut t), INVALID_ARGUMENT);
            let forged = 0x1000 as NvmlDevice;
            assert_eq!(
                nvmlDeviceGetTemperature(forged, 0, &mut t),
                INVALID_ARGUMENT
            );

            let mut n: c_uint = 0;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v3(dev, &mut n, ptr::null_mut()),
                NOT_SUPPORTED
            );
            let mut util = Utilization { gpu: 0, memory: 0 };
            assert_eq!(nvmlDeviceGetUtilizationRates(dev, &mut util), SUCCESS);
            assert_eq!(nvmlDeviceGetUtilizationRates(dev, &mut util), GPU_IS_LOST);

            assert_eq!(CStr::from_ptr(nvmlErrorString(GPU_IS_LOST)), c"GPU is lost");
            assert_eq!(CStr::from_ptr(nvmlErrorString(12345)), c"Unknown Error");

            // Two inits need two shutdowns; afterwards old handles are stale.
            assert_eq!(nvmlInit_v2(), SUCCESS);
            assert_eq!(nvmlShutdown(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut count), SUCCESS);
            assert_eq!(nvmlShutdown(), SUCCESS);
            assert_eq!(nvmlDeviceGetTemperature(dev, 0, &mut t), UNINITIALIZED);
        }
        std::env::remove_var(crate::SCRIPT_ENV);
    }
}
