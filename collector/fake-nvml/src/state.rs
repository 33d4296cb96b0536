//! Process-global session state: NVML's init reference count, the current
//! script, the per-device sample counters, and turning an opaque device
//! handle back into a device. Sessions are leaked on purpose so that a handle
//! a caller kept past `nvmlShutdown` can never point at freed memory.

use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::codes::{NvmlReturn, GPU_IS_LOST, INVALID_ARGUMENT, UNINITIALIZED, UNKNOWN};
use crate::script::{self, DeviceScript, FailCode, FailMap, PciAddress, Script};

/// One scripted GPU plus its mutable sample counter.
pub(crate) struct Device {
    pub script: DeviceScript,
    pub pci: Option<PciAddress>,
    /// Number of `nvmlDeviceGetUtilizationRates` calls so far; atomic so that
    /// concurrent pollers each get a distinct sample.
    utilization_calls: AtomicU64,
}

/// A scripted MIG device: its UUID and the index of its GPU in `devices`.
pub(crate) struct MigDevice {
    pub uuid: String,
    pub parent: usize,
}

/// Everything one init..shutdown span sees.
pub(crate) struct Session {
    pub script: Script,
    pub devices: Vec<Device>,
    pub migs: Vec<MigDevice>,
}

/// How a call relates to the device's sample number.
#[derive(Clone, Copy)]
pub(crate) enum Sampling {
    /// A utilization call: it takes the next sample.
    Advance,
    /// Every other call: it reads the sample the last utilization call took.
    Current,
}

/// Picks the forced failure, if any, for one getter out of a device's map.
pub(crate) type FailSelector = fn(&FailMap) -> Option<FailCode>;

struct Global {
    refcount: u32,
    session: Option<&'static Session>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    refcount: 0,
    session: None,
});

fn global() -> MutexGuard<'static, Global> {
    // Nothing panics while holding the lock, but a poisoned lock must not turn
    // into a panic across the C boundary either.
    GLOBAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `nvmlInit*`: NVML counts inits, so only the first of a span reads the
/// script; later ones just bump the count.
pub(crate) fn init() -> NvmlReturn {
    let mut g = global();
    if g.refcount > 0 {
        g.refcount += 1;
        return crate::codes::SUCCESS;
    }
    match script::load_from_env() {
        Ok(script) => {
            g.session = Some(Box::leak(Box::new(Session::new(script))));
            g.refcount = 1;
            crate::codes::SUCCESS
        }
        Err(msg) => {
            use std::io::Write;
            // eprintln! would panic (and so abort, across extern "C") if
            // stderr were closed.
            let _ = writeln!(std::io::stderr(), "gpuwarden-fake-nvml: {msg}");
            UNKNOWN
        }
    }
}

/// `nvmlShutdown`: the last matching call ends the session.
pub(crate) fn shutdown() -> NvmlReturn {
    let mut g = global();
    if g.refcount == 0 {
        return UNINITIALIZED;
    }
    g.refcount -= 1;
    if g.refcount == 0 {
        g.session = None;
    }
    crate::codes::SUCCESS
}

/// The live session, or UNINITIALIZED.
pub(crate) fn session() -> Result<&'static Session, NvmlReturn> {
    global().session.ok_or(UNINITIALIZED)
}

impl Session {
    fn new(script: Script) -> Self {
        let devices = script
            .devices
            .iter()
            .map(|d| Device {
                pci: d.pci_bus_id.as_deref().and_then(PciAddress::parse),
                script: d.clone(),
                utilization_calls: AtomicU64::new(0),
            })
            .collect();
        let migs = script
            .devices
            .iter()
            .enumerate()
            .flat_map(|(parent, d)| {
                d.mig_devices.iter().map(move |m| MigDevice {
                    uuid: m.uuid.clone(),
                    parent,
                })
            })
            .collect();
        Self {
            script,
            devices,
            migs,
        }
    }

    /// Resolves a MIG device handle, by address as [`Session::device`] does.
    pub(crate) fn mig<H>(
        &'static self,
        handle: *const H,
    ) -> Result<&'static MigDevice, NvmlReturn> {
        self.migs
            .iter()
            .find(|m| ptr::addr_eq(*m as *const MigDevice, handle))
            .ok_or(INVALID_ARGUMENT)
    }

    /// Resolves a handle by address comparison only, so a stale or forged
    /// handle is rejected without ever being dereferenced.
    pub(crate) fn device<H>(
        &'static self,
        handle: *const H,
    ) -> Result<&'static Device, NvmlReturn> {
        self.devices
            .iter()
            .find(|d| ptr::addr_eq(*d as *const Device, handle))
            .ok_or(INVALID_ARGUMENT)
    }
}

impl MigDevice {
    /// The opaque handle handed to C callers.
    pub(crate) fn handle<H>(&'static self) -> *mut H {
        (self as *const MigDevice).cast_mut().cast()
    }
}

impl Device {
    /// The opaque handle handed to C callers.
    pub(crate) fn handle<H>(&'static self) -> *mut H {
        (self as *const Device).cast_mut().cast()
    }

    /// Sample number for this call, after the lost and forced-failure checks
    /// every per-device call goes through.
    pub(crate) fn sample(&self, sampling: Sampling, fail: FailSelector) -> Result<u64, NvmlReturn> {
        let sample = match sampling {
            Sampling::Advance => self.utilization_calls.fetch_add(1, Ordering::Relaxed),
            Sampling::Current => self
                .utilization_calls
                .load(Ordering::Relaxed)
                .saturating_sub(1),
        };
        if self.script.lost_at_sample.is_some_and(|n| sample >= n) {
            return Err(GPU_IS_LOST);
        }
        match fail(&self.script.fail) {
            Some(code) => Err(code.code()),
            None => Ok(sample),
        }
    }
}
