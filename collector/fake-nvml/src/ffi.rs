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
use crate::script::{self, pick, FailCode, FailMap, GpmScript, ProcessScript};
use crate::state::{self, Device, FailSelector, GpmSource, Sampling, Target};

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
/// initialised, valid handle (a GPU's or a MIG device's), valid arguments
/// (`bad_args`: a null output or an out-of-range enum), lost/forced failure
/// (a MIG device shares its GPU's), and finally whether the script has a
/// value at all for this kind of device: `None` is NOT_SUPPORTED.
fn query<T>(
    handle: NvmlDevice,
    bad_args: bool,
    sampling: Sampling,
    fail: FailSelector,
    value: impl FnOnce(Target, u64) -> Option<T>,
) -> Result<T, NvmlReturn> {
    let target = state::session()?.target(handle)?;
    if bad_args {
        return Err(INVALID_ARGUMENT);
    }
    let sample = target.sample(sampling, fail)?;
    value(target, sample).ok_or(NOT_SUPPORTED)
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
    device.sample(false, no_fail)?;
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
        |t, _| match t {
            Target::Gpu(d) => d.script.uuid.as_deref(),
            Target::Mig(m, _) => Some(m.uuid.as_str()),
        },
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
        |t, _| {
            let gpu = t.gpu().script.name.as_deref()?;
            Some(match t.instance() {
                // NVML names a MIG device after its GPU and profile.
                Some(mig) => format!("{gpu} MIG {}", mig.profile),
                None => gpu.to_owned(),
            })
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit_str(name, length, got.as_deref().map_err(|e| *e)) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    let got = query(
        device,
        index.is_null(),
        Sampling::Current,
        |f| f.index,
        |t, _| t.whole()?.script.index,
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
        |t, _| {
            let d = t.whole()?;
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
/// it then fails, as the clock of a real poller would. NVML does not support
/// utilization on a GPU in MIG mode nor on a MIG device: NOT_SUPPORTED, and
/// the sample number stays (see [`nvmlDeviceGetMigMode`]).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: NvmlDevice,
    utilization: *mut Utilization,
) -> NvmlReturn {
    let got = query(
        device,
        utilization.is_null(),
        Sampling::Utilization,
        |f| f.utilization,
        |t, s| {
            let d = t.whole().filter(|d| !d.mig_enabled())?;
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
        |t, s| match t.instance() {
            // A MIG device has its own memory.
            Some(mig) => Some((
                mig.memory_total_bytes?,
                *mig.memory_used_bytes.as_ref()?.at(s),
            )),
            None => Some((
                t.gpu().script.memory_total_bytes?,
                *t.gpu().script.memory_used_bytes.as_ref()?.at(s),
            )),
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
        |t, s| t.whole()?.script.power_mw.as_ref().map(|v| *v.at(s)),
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
        |t, _| t.whole()?.script.power_limit_mw,
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
        |t, s| t.whole()?.script.energy_mj.as_ref().map(|v| *v.at(s)),
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
        |t, s| t.whole()?.script.temp_c.as_ref().map(|v| *v.at(s)),
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
        |t, s| match clock_type {
            CLOCK_GRAPHICS | CLOCK_SM => t.whole()?.script.sm_clock_mhz.as_ref().map(|v| *v.at(s)),
            _ => None,
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(clock, got) }
}

/// A process as NVML reports it: MIG devices' processes carry their GPU and
/// compute instance.
fn process_info(p: &ProcessScript, instance: Option<&script::MigInstanceScript>) -> ProcessInfo {
    ProcessInfo {
        pid: p.pid,
        used_gpu_memory: p.used_memory_bytes.unwrap_or(VALUE_NOT_AVAILABLE_U64),
        gpu_instance_id: instance.map_or(NO_INSTANCE, |m| m.gpu_instance_id),
        compute_instance_id: instance.map_or(NO_INSTANCE, |m| m.compute_instance_id),
    }
}

/// The processes of `t` at sample `s`: a MIG device's own; on a GPU in MIG
/// mode, those of all its MIG devices; else the GPU's.
fn processes_at(t: Target, s: u64) -> Option<Vec<ProcessInfo>> {
    let of_instance = |m: &'static script::MigInstanceScript| {
        let procs = m
            .processes
            .as_deref()
            .map_or(&[][..], |p| pick(p, s).as_slice());
        procs.iter().map(move |p| process_info(p, Some(m)))
    };
    if let Some(m) = t.instance() {
        return Some(of_instance(m).collect());
    }
    let d = t.gpu();
    match &d.script.mig {
        Some(mig) if mig.enabled => Some(mig.instances.iter().flat_map(of_instance).collect()),
        _ => {
            let procs = pick(d.script.processes.as_deref()?, s);
            Some(procs.iter().map(|p| process_info(p, None)).collect())
        }
    }
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
        processes_at,
    );
    let procs = match got {
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
    for (i, info) in procs.into_iter().enumerate() {
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

// ---- MIG -----------------------------------------------------------------

/// A GPU's `mig` script; NOT_SUPPORTED for a GPU without one and for a MIG
/// device.
fn mig_script(t: Target) -> Option<&'static script::MigScript> {
    t.whole()?.script.mig.as_ref()
}

/// The current and pending mode (both as scripted). On a GPU in MIG mode
/// this call takes the next sample, as utilization does otherwise.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: NvmlDevice,
    current_mode: *mut c_uint,
    pending_mode: *mut c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        current_mode.is_null() || pending_mode.is_null(),
        Sampling::MigMode,
        no_fail,
        |t, _| mig_script(t).map(|m| c_uint::from(m.enabled)),
    );
    match got {
        Ok(mode) => {
            // SAFETY: both non-null (checked by `query`), caller contract.
            unsafe {
                current_mode.write(mode);
                pending_mode.write(mode);
            }
            SUCCESS
        }
        Err(code) => code,
    }
}

/// As on the real parts, the most MIG devices a GPU can hold is its slice
/// count.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: NvmlDevice,
    count: *mut c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        count.is_null(),
        Sampling::Current,
        no_fail,
        |t, _| mig_script(t).map(|m| m.slices),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(count, got) }
}

/// The `index`-th MIG device: INVALID_ARGUMENT past the maximum count,
/// NOT_FOUND where no MIG device is (MIG mode off, or fewer devices made).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: NvmlDevice,
    index: c_uint,
    mig_device: *mut NvmlDevice,
) -> NvmlReturn {
    let got = state::session().and_then(|s| {
        let target = s.target(device)?;
        if mig_device.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        target.sample(Sampling::Current, no_fail)?;
        let gpu = target.whole().ok_or(NOT_SUPPORTED)?;
        let mig = gpu.script.mig.as_ref().ok_or(NOT_SUPPORTED)?;
        if index >= mig.slices {
            return Err(INVALID_ARGUMENT);
        }
        s.migs
            .iter()
            .find(|m| ptr::eq(&s.devices[m.parent], gpu) && m.index == index as usize)
            .map(|m| m.handle())
            .ok_or(NOT_FOUND)
    });
    // SAFETY: forwarded caller contract.
    unsafe { emit(mig_device, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: NvmlDevice,
    is_mig_device: *mut c_uint,
) -> NvmlReturn {
    let got = query(
        device,
        is_mig_device.is_null(),
        Sampling::Current,
        no_fail,
        |t, _| Some(c_uint::from(t.instance().is_some())),
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(is_mig_device, got) }
}

/// `nvmlDeviceAttributes_t` (`_v2`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DeviceAttributes {
    pub multiprocessor_count: c_uint,
    pub shared_copy_engine_count: c_uint,
    pub shared_decoder_count: c_uint,
    pub shared_encoder_count: c_uint,
    pub shared_jpeg_count: c_uint,
    pub shared_ofa_count: c_uint,
    pub gpu_instance_slice_count: c_uint,
    pub compute_instance_slice_count: c_uint,
    pub memory_size_mb: c_ulonglong,
}

/// NVML answers it for MIG devices only. The engine counts are not scripted
/// and read 0.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: NvmlDevice,
    attributes: *mut DeviceAttributes,
) -> NvmlReturn {
    let got = query(
        device,
        attributes.is_null(),
        Sampling::Current,
        no_fail,
        |t, _| {
            let mig = t.instance()?;
            Some(DeviceAttributes {
                multiprocessor_count: 0,
                shared_copy_engine_count: 0,
                shared_decoder_count: 0,
                shared_encoder_count: 0,
                shared_jpeg_count: 0,
                shared_ofa_count: 0,
                gpu_instance_slice_count: mig.slices,
                compute_instance_slice_count: mig.slices,
                memory_size_mb: mig.memory_total_bytes.unwrap_or(0) >> 20,
            })
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(attributes, got) }
}

/// `nvmlGpuInstanceProfileInfo_t` (v1, unversioned).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpuInstanceProfileInfo {
    pub id: c_uint,
    pub is_p2p_supported: c_uint,
    pub slice_count: c_uint,
    pub instance_count: c_uint,
    pub multiprocessor_count: c_uint,
    pub copy_engine_count: c_uint,
    pub decoder_count: c_uint,
    pub encoder_count: c_uint,
    pub jpeg_count: c_uint,
    pub ofa_count: c_uint,
    pub memory_size_mb: c_ulonglong,
}

/// `NVML_GPU_INSTANCE_PROFILE_COUNT`: profile ids are below it.
const GPU_INSTANCE_PROFILE_COUNT: c_uint = 17;

/// The plain `NVML_GPU_INSTANCE_PROFILE_<n>_SLICE` ids are 0..=6, in the
/// order of [`script::PROFILE_SLICES`]; a GPU has those of 1 to 4 slices no
/// larger than itself, and the one of its own size. The other profiles
/// (media extensions, graphics) are not scripted.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: NvmlDevice,
    profile: c_uint,
    info: *mut GpuInstanceProfileInfo,
) -> NvmlReturn {
    let got = query(
        device,
        info.is_null() || profile >= GPU_INSTANCE_PROFILE_COUNT,
        Sampling::Current,
        no_fail,
        |t, _| {
            let mig = mig_script(t)?;
            let slices = *script::PROFILE_SLICES.get(profile as usize)?;
            if slices > mig.slices || (slices > 4 && slices != mig.slices) {
                return None;
            }
            let memory = t.gpu().script.memory_total_bytes.unwrap_or(0);
            Some(GpuInstanceProfileInfo {
                id: profile,
                is_p2p_supported: 0,
                slice_count: slices,
                instance_count: mig.slices / slices,
                multiprocessor_count: 0,
                copy_engine_count: 0,
                decoder_count: 0,
                encoder_count: 0,
                jpeg_count: 0,
                ofa_count: 0,
                memory_size_mb: (memory >> 20) * u64::from(slices) / u64::from(mig.slices),
            })
        },
    );
    // SAFETY: forwarded caller contract.
    unsafe { emit(info, got) }
}

// ---- GPM ------------------------------------------------------------------

/// Opaque target of `nvmlGpmSample_t`.
#[repr(C)]
pub struct NvmlGpmSampleSt {
    _opaque: [u8; 0],
}

/// `nvmlGpmSample_t`: a number standing for a sample (see
/// `state::gpm_alloc`); never dereferenced.
pub type NvmlGpmSample = *mut NvmlGpmSampleSt;

/// `nvmlGpmSupport_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpmSupport {
    pub version: c_uint,
    pub is_supported_device: c_uint,
}

/// `NVML_GPM_SUPPORT_VERSION`.
pub const GPM_SUPPORT_VERSION: c_uint = 1;

/// `nvmlGpmMetric_t`'s `metricInfo`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpmMetricInfo {
    pub short_name: *const c_char,
    pub long_name: *const c_char,
    pub unit: *const c_char,
}

/// `nvmlGpmMetric_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpmMetric {
    pub metric_id: c_uint,
    pub nvml_return: NvmlReturn,
    pub value: f64,
    pub metric_info: GpmMetricInfo,
}

/// `NVML_GPM_METRIC_MAX`: the length of `metrics`.
pub const GPM_METRIC_MAX: usize = 210;

/// `nvmlGpmMetricsGet_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpmMetricsGet {
    pub version: c_uint,
    pub num_metrics: c_uint,
    pub sample1: NvmlGpmSample,
    pub sample2: NvmlGpmSample,
    pub metrics: [GpmMetric; GPM_METRIC_MAX],
}

/// `NVML_GPM_METRICS_GET_VERSION`.
pub const GPM_METRICS_GET_VERSION: c_uint = 1;

/// Whether the chip has GPM: a GPU whose script has `gpm` (a MIG device
/// answers for its GPU). Unsupported is a successful answer, as in NVML.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: NvmlDevice,
    gpm_support: *mut GpmSupport,
) -> NvmlReturn {
    let got = query(
        device,
        gpm_support.is_null(),
        Sampling::Current,
        no_fail,
        |t, _| Some(c_uint::from(t.gpu().gpm().is_some())),
    );
    let supported = match got {
        Ok(s) => s,
        Err(code) => return code,
    };
    // SAFETY: non-null (checked by `query`); the caller set the version.
    let version = unsafe { ptr::addr_of!((*gpm_support).version).read() };
    if version != GPM_SUPPORT_VERSION {
        return ARGUMENT_VERSION_MISMATCH;
    }
    // SAFETY: as above.
    unsafe { ptr::addr_of_mut!((*gpm_support).is_supported_device).write(supported) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(gpm_sample: *mut NvmlGpmSample) -> NvmlReturn {
    let got = state::gpm_alloc().map(|handle| handle as NvmlGpmSample);
    // SAFETY: forwarded caller contract.
    unsafe { emit(gpm_sample, got) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleFree(gpm_sample: NvmlGpmSample) -> NvmlReturn {
    match state::gpm_free(gpm_sample as usize) {
        Ok(()) => SUCCESS,
        Err(code) => code,
    }
}

/// Takes the whole GPU's next GPM sample into `gpm_sample`.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleGet(
    device: NvmlDevice,
    gpm_sample: NvmlGpmSample,
) -> NvmlReturn {
    let got = state::session().and_then(|s| {
        let target = s.target(device)?;
        target.sample(Sampling::Current, |f| f.gpm)?;
        let Target::Gpu(gpu) = target else {
            // A MIG device's counters are its GPU instance's: nvmlGpmMigSampleGet.
            return Err(NOT_SUPPORTED);
        };
        gpu.gpm().ok_or(NOT_SUPPORTED)?;
        let index = s
            .devices
            .iter()
            .position(|d| ptr::eq(d, gpu))
            .ok_or(INVALID_ARGUMENT)?;
        state::gpm_fill(
            s,
            gpm_sample as usize,
            GpmSource::Gpu(index),
            gpu.gpm_calls(),
        )
    });
    match got {
        Ok(()) => SUCCESS,
        Err(code) => code,
    }
}

/// Takes the next GPM sample of GPU instance `gpu_instance_id` of a GPU in
/// MIG mode into `gpm_sample`.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: NvmlDevice,
    gpu_instance_id: c_uint,
    gpm_sample: NvmlGpmSample,
) -> NvmlReturn {
    let got = state::session().and_then(|s| {
        let target = s.target(device)?;
        target.sample(Sampling::Current, |f| f.gpm)?;
        let gpu = target.whole().ok_or(INVALID_ARGUMENT)?;
        gpu.gpm().ok_or(NOT_SUPPORTED)?;
        if !gpu.mig_enabled() {
            return Err(NOT_SUPPORTED);
        }
        let (index, mig) = s
            .instance_of(gpu, gpu_instance_id)
            .ok_or(INVALID_ARGUMENT)?;
        state::gpm_fill(
            s,
            gpm_sample as usize,
            GpmSource::Instance(index),
            mig.gpm_calls(),
        )
    });
    match got {
        Ok(()) => SUCCESS,
        Err(code) => code,
    }
}

/// The names NVML gives a metric, for the ones a script can carry.
fn metric_info(id: c_uint) -> GpmMetricInfo {
    let (short, long): (&'static CStr, &'static CStr) = match id {
        script::GPM_GRAPHICS_UTIL => (c"gr_util", c"graphics utilization"),
        script::GPM_SM_UTIL => (c"sm_util", c"SM utilization"),
        script::GPM_SM_OCCUPANCY => (c"sm_occupancy", c"SM occupancy"),
        script::GPM_ANY_TENSOR_UTIL => (c"any_tensor_util", c"any tensor utilization"),
        script::GPM_DRAM_BW_UTIL => (c"dram_bw_util", c"DRAM bandwidth utilization"),
        _ => {
            return GpmMetricInfo {
                short_name: ptr::null(),
                long_name: ptr::null(),
                unit: ptr::null(),
            }
        }
    };
    GpmMetricInfo {
        short_name: short.as_ptr(),
        long_name: long.as_ptr(),
        unit: c"%".as_ptr(),
    }
}

/// The script of a GPM sample's source.
fn gpm_script(s: &'static state::Session, source: GpmSource) -> Option<&'static GpmScript> {
    match source {
        GpmSource::Gpu(index) => s.devices[index].gpm(),
        GpmSource::Instance(index) => {
            let mig = &s.migs[index];
            s.devices[mig.parent].script.mig.as_ref()?.instances[mig.index]
                .gpm
                .as_ref()
        }
    }
}

/// Each requested metric between two samples of one source, the second
/// taken later: the average of its scripted rates over the intervals between
/// them. A metric the script lacks answers NOT_SUPPORTED in its own slot.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmMetricsGet(metrics_get: *mut GpmMetricsGet) -> NvmlReturn {
    let session = match state::session() {
        Ok(s) => s,
        Err(code) => return code,
    };
    if metrics_get.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: non-null, and the caller's struct per the contract.
    let (version, count, first, second) = unsafe {
        (
            ptr::addr_of!((*metrics_get).version).read(),
            ptr::addr_of!((*metrics_get).num_metrics).read(),
            ptr::addr_of!((*metrics_get).sample1).read(),
            ptr::addr_of!((*metrics_get).sample2).read(),
        )
    };
    if version != GPM_METRICS_GET_VERSION {
        return ARGUMENT_VERSION_MISMATCH;
    }
    if count as usize > GPM_METRIC_MAX {
        return INVALID_ARGUMENT;
    }
    let (first, second) = match (
        state::gpm_snapshot(session, first as usize),
        state::gpm_snapshot(session, second as usize),
    ) {
        (Ok(a), Ok(b)) if a.source == b.source && a.number < b.number => (a, b),
        _ => return INVALID_ARGUMENT,
    };
    let script = gpm_script(session, first.source);
    for i in 0..count as usize {
        // SAFETY: i < count <= GPM_METRIC_MAX, inside the caller's array.
        let slot = unsafe { ptr::addr_of_mut!((*metrics_get).metrics[i]) };
        // SAFETY: as above.
        let id = unsafe { ptr::addr_of!((*slot).metric_id).read() };
        let series = script.and_then(|g| g.metric(id));
        let (code, value) = match series {
            Some(series) => (
                SUCCESS,
                GpmScript::average(series, first.number, second.number),
            ),
            None => (NOT_SUPPORTED, 0.0),
        };
        // SAFETY: as above.
        unsafe {
            ptr::addr_of_mut!((*slot).nvml_return).write(code);
            ptr::addr_of_mut!((*slot).value).write(value);
            ptr::addr_of_mut!((*slot).metric_info).write(metric_info(id));
        }
    }
    SUCCESS
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
    fn mig_and_gpm_layouts_match_nvml_wrapper_sys() {
        assert_eq!(
            size_of::<DeviceAttributes>(),
            size_of::<sys::nvmlDeviceAttributes_t>()
        );
        assert_eq!(
            offset_of!(DeviceAttributes, compute_instance_slice_count),
            offset_of!(sys::nvmlDeviceAttributes_t, computeInstanceSliceCount)
        );
        assert_eq!(
            offset_of!(DeviceAttributes, memory_size_mb),
            offset_of!(sys::nvmlDeviceAttributes_t, memorySizeMB)
        );
        assert_eq!(
            size_of::<GpuInstanceProfileInfo>(),
            size_of::<sys::nvmlGpuInstanceProfileInfo_t>()
        );
        assert_eq!(
            offset_of!(GpuInstanceProfileInfo, slice_count),
            offset_of!(sys::nvmlGpuInstanceProfileInfo_t, sliceCount)
        );
        assert_eq!(
            offset_of!(GpuInstanceProfileInfo, memory_size_mb),
            offset_of!(sys::nvmlGpuInstanceProfileInfo_t, memorySizeMB)
        );
        assert_eq!(size_of::<GpmSupport>(), size_of::<sys::nvmlGpmSupport_t>());
        assert_eq!(size_of::<GpmMetric>(), size_of::<sys::nvmlGpmMetric_t>());
        assert_eq!(
            offset_of!(GpmMetric, value),
            offset_of!(sys::nvmlGpmMetric_t, value)
        );
        assert_eq!(
            offset_of!(GpmMetric, metric_info),
            offset_of!(sys::nvmlGpmMetric_t, metricInfo)
        );
        assert_eq!(
            size_of::<GpmMetricsGet>(),
            size_of::<sys::nvmlGpmMetricsGet_t>()
        );
        assert_eq!(
            offset_of!(GpmMetricsGet, sample2),
            offset_of!(sys::nvmlGpmMetricsGet_t, sample2)
        );
        assert_eq!(
            offset_of!(GpmMetricsGet, metrics),
            offset_of!(sys::nvmlGpmMetricsGet_t, metrics)
        );
        assert_eq!(GPM_SUPPORT_VERSION, sys::NVML_GPM_SUPPORT_VERSION);
        assert_eq!(GPM_METRICS_GET_VERSION, sys::NVML_GPM_METRICS_GET_VERSION);
        assert_eq!(
            GPM_METRIC_MAX as u32,
            sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_MAX
        );
        for (id, nvml) in [
            (
                script::GPM_GRAPHICS_UTIL,
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_GRAPHICS_UTIL,
            ),
            (
                script::GPM_SM_UTIL,
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_UTIL,
            ),
            (
                script::GPM_SM_OCCUPANCY,
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_SM_OCCUPANCY,
            ),
            (
                script::GPM_ANY_TENSOR_UTIL,
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_ANY_TENSOR_UTIL,
            ),
            (
                script::GPM_DRAM_BW_UTIL,
                sys::nvmlGpmMetricId_t_NVML_GPM_METRIC_DRAM_BW_UTIL,
            ),
        ] {
            assert_eq!(id, nvml);
        }
        assert_eq!(
            GPU_INSTANCE_PROFILE_COUNT,
            sys::NVML_GPU_INSTANCE_PROFILE_COUNT
        );
        for (profile, slices) in [
            (sys::NVML_GPU_INSTANCE_PROFILE_1_SLICE, 1),
            (sys::NVML_GPU_INSTANCE_PROFILE_2_SLICE, 2),
            (sys::NVML_GPU_INSTANCE_PROFILE_3_SLICE, 3),
            (sys::NVML_GPU_INSTANCE_PROFILE_4_SLICE, 4),
            (sys::NVML_GPU_INSTANCE_PROFILE_7_SLICE, 7),
            (sys::NVML_GPU_INSTANCE_PROFILE_8_SLICE, 8),
            (sys::NVML_GPU_INSTANCE_PROFILE_6_SLICE, 6),
        ] {
            assert_eq!(script::PROFILE_SLICES[profile as usize], slices);
        }
        assert_eq!(sys::NVML_DEVICE_MIG_ENABLE, 1);
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
