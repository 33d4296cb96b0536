//! Process-global session state: NVML's init reference count, the current
//! script, the per-device sample counters, the GPM samples callers allocated,
//! and turning an opaque device handle back into a GPU or MIG device. Sessions
//! are leaked on purpose so that a handle a caller kept past `nvmlShutdown`
//! can never point at freed memory.

use std::collections::BTreeMap;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::codes::{NvmlReturn, GPU_IS_LOST, INVALID_ARGUMENT, UNINITIALIZED, UNKNOWN};
use crate::script::{
    self, DeviceScript, FailCode, FailMap, GpmScript, MigInstanceScript, PciAddress, Script,
};

/// One scripted GPU plus its mutable sample counters.
pub(crate) struct Device {
    pub script: DeviceScript,
    pub pci: Option<PciAddress>,
    /// Number of sample-taking calls so far (see [`Sampling`]);
    /// atomic so that concurrent pollers each get a distinct sample.
    sample_calls: AtomicU64,
    /// Number of `nvmlGpmSampleGet` calls that took a sample.
    gpm_calls: AtomicU64,
}

/// A scripted MIG device: its GPU's index in `devices` and its own index
/// among that GPU's MIG devices.
pub(crate) struct MigDevice {
    pub uuid: String,
    pub parent: usize,
    pub index: usize,
    /// Number of `nvmlGpmMigSampleGet` calls on its GPU instance that took a
    /// sample.
    gpm_calls: AtomicU64,
}

/// Everything one init..shutdown span sees.
pub(crate) struct Session {
    pub script: Script,
    pub devices: Vec<Device>,
    pub migs: Vec<MigDevice>,
}

/// What a device handle stands for.
#[derive(Clone, Copy)]
pub(crate) enum Target {
    /// A GPU.
    Gpu(&'static Device),
    /// A MIG device and the GPU it is on.
    Mig(&'static MigDevice, &'static Device),
}

impl Target {
    /// The physical GPU: the device itself, or a MIG device's parent. Its
    /// sample number, `lost_at_sample` and `fail` map hold for both.
    pub(crate) fn gpu(self) -> &'static Device {
        match self {
            Target::Gpu(d) | Target::Mig(_, d) => d,
        }
    }

    /// The GPU, if the handle is one (not a MIG device).
    pub(crate) fn whole(self) -> Option<&'static Device> {
        match self {
            Target::Gpu(d) => Some(d),
            Target::Mig(..) => None,
        }
    }

    /// The MIG device's script, if the handle is one.
    pub(crate) fn instance(self) -> Option<&'static MigInstanceScript> {
        match self {
            Target::Gpu(_) => None,
            Target::Mig(m, d) => d.script.mig.as_ref()?.instances.get(m.index),
        }
    }

    /// Sample number for this call (the GPU's, for a MIG device too), after
    /// the lost and forced-failure checks every per-device call goes through.
    pub(crate) fn sample(self, sampling: Sampling, fail: FailSelector) -> Result<u64, NvmlReturn> {
        let advance = match (sampling, self) {
            (Sampling::Utilization, Target::Gpu(d)) => !d.mig_enabled(),
            (Sampling::MigMode, Target::Gpu(d)) => d.mig_enabled(),
            _ => false,
        };
        self.gpu().sample(advance, fail)
    }
}

/// How a call relates to the GPU's sample number.
#[derive(Clone, Copy)]
pub(crate) enum Sampling {
    /// `nvmlDeviceGetUtilizationRates`: on a GPU not in MIG mode it takes the
    /// next sample.
    Utilization,
    /// `nvmlDeviceGetMigMode`: on a GPU in MIG mode, where utilization is not
    /// supported, it takes the next sample instead.
    MigMode,
    /// Every other call: it reads the sample the last taking call took.
    Current,
}

/// Picks the forced failure, if any, for one getter out of a device's map.
pub(crate) type FailSelector = fn(&FailMap) -> Option<FailCode>;

/// Which counters a GPM sample was taken of.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum GpmSource {
    /// A whole GPU, by index.
    Gpu(usize),
    /// A GPU instance, by the index of its MIG device in `migs`.
    Instance(usize),
}

/// A GPM sample once `nvmlGpm*SampleGet` filled it: the session, what it
/// measured and its number among that source's samples.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct GpmSnapshot {
    session: usize,
    pub source: GpmSource,
    pub number: u64,
}

struct Global {
    refcount: u32,
    session: Option<&'static Session>,
    /// GPM samples allocated and not freed, by handle value; `None` until a
    /// `nvmlGpm*SampleGet` fills one.
    gpm_samples: BTreeMap<usize, Option<GpmSnapshot>>,
    next_gpm_sample: usize,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    refcount: 0,
    session: None,
    gpm_samples: BTreeMap::new(),
    next_gpm_sample: 1,
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

/// `nvmlGpmSampleAlloc`: a fresh handle value. Handles are numbers, never
/// addresses, so nothing a caller passes back is ever dereferenced.
pub(crate) fn gpm_alloc() -> Result<usize, NvmlReturn> {
    let mut g = global();
    g.session.ok_or(UNINITIALIZED)?;
    // Multiples of 16 look like the aligned pointers real NVML hands out.
    let handle = g.next_gpm_sample * 16;
    g.next_gpm_sample += 1;
    g.gpm_samples.insert(handle, None);
    Ok(handle)
}

/// `nvmlGpmSampleFree`.
pub(crate) fn gpm_free(handle: usize) -> Result<(), NvmlReturn> {
    let mut g = global();
    g.gpm_samples
        .remove(&handle)
        .map(|_| ())
        .ok_or(INVALID_ARGUMENT)
}

/// Fills the sample `handle` with the next sample of `source`; `calls` is
/// that source's counter.
pub(crate) fn gpm_fill(
    session: &'static Session,
    handle: usize,
    source: GpmSource,
    calls: &AtomicU64,
) -> Result<(), NvmlReturn> {
    let mut g = global();
    let slot = g.gpm_samples.get_mut(&handle).ok_or(INVALID_ARGUMENT)?;
    *slot = Some(GpmSnapshot {
        session: ptr::from_ref(session) as usize,
        source,
        number: calls.fetch_add(1, Ordering::Relaxed),
    });
    Ok(())
}

/// The filled sample `handle` of the live session.
pub(crate) fn gpm_snapshot(
    session: &'static Session,
    handle: usize,
) -> Result<GpmSnapshot, NvmlReturn> {
    let g = global();
    let snapshot = g
        .gpm_samples
        .get(&handle)
        .copied()
        .flatten()
        .ok_or(INVALID_ARGUMENT)?;
    if snapshot.session != ptr::from_ref(session) as usize {
        return Err(INVALID_ARGUMENT);
    }
    Ok(snapshot)
}

impl Session {
    fn new(script: Script) -> Self {
        let devices = script
            .devices
            .iter()
            .map(|d| Device {
                pci: d.pci_bus_id.as_deref().and_then(PciAddress::parse),
                script: d.clone(),
                sample_calls: AtomicU64::new(0),
                gpm_calls: AtomicU64::new(0),
            })
            .collect();
        let migs = script
            .devices
            .iter()
            .enumerate()
            .flat_map(|(parent, d)| {
                d.mig
                    .iter()
                    .flat_map(|m| m.instances.iter().enumerate())
                    .map(move |(index, m)| MigDevice {
                        uuid: m.uuid.clone(),
                        parent,
                        index,
                        gpm_calls: AtomicU64::new(0),
                    })
            })
            .collect();
        Self {
            script,
            devices,
            migs,
        }
    }

    /// Resolves a GPU or MIG device handle by address comparison only, so a
    /// stale or forged handle is rejected without ever being dereferenced.
    pub(crate) fn target<H>(&'static self, handle: *const H) -> Result<Target, NvmlReturn> {
        if let Some(d) = self
            .devices
            .iter()
            .find(|d| ptr::addr_eq(*d as *const Device, handle))
        {
            return Ok(Target::Gpu(d));
        }
        self.migs
            .iter()
            .find(|m| ptr::addr_eq(*m as *const MigDevice, handle))
            .map(|m| Target::Mig(m, &self.devices[m.parent]))
            .ok_or(INVALID_ARGUMENT)
    }

    /// Resolves a MIG device handle; a GPU's is INVALID_ARGUMENT.
    pub(crate) fn mig<H>(
        &'static self,
        handle: *const H,
    ) -> Result<&'static MigDevice, NvmlReturn> {
        match self.target(handle)? {
            Target::Mig(m, _) => Ok(m),
            Target::Gpu(_) => Err(INVALID_ARGUMENT),
        }
    }

    /// The MIG device of GPU `parent` with GPU instance `gpu_instance_id`.
    pub(crate) fn instance_of(
        &'static self,
        parent: &'static Device,
        gpu_instance_id: u32,
    ) -> Option<(usize, &'static MigDevice)> {
        let instances = &parent.script.mig.as_ref()?.instances;
        self.migs.iter().enumerate().find(|(_, m)| {
            ptr::eq(&self.devices[m.parent], parent)
                && instances[m.index].gpu_instance_id == gpu_instance_id
        })
    }
}

impl MigDevice {
    /// The opaque handle handed to C callers.
    pub(crate) fn handle<H>(&'static self) -> *mut H {
        (self as *const MigDevice).cast_mut().cast()
    }

    /// Counter of its GPU instance's GPM samples.
    pub(crate) fn gpm_calls(&self) -> &AtomicU64 {
        &self.gpm_calls
    }
}

impl Device {
    /// The opaque handle handed to C callers.
    pub(crate) fn handle<H>(&'static self) -> *mut H {
        (self as *const Device).cast_mut().cast()
    }

    /// Whether the GPU is in MIG mode.
    pub(crate) fn mig_enabled(&self) -> bool {
        self.script.mig.as_ref().is_some_and(|m| m.enabled)
    }

    /// The GPU's GPM script, if the chip has GPM.
    pub(crate) fn gpm(&self) -> Option<&GpmScript> {
        self.script.gpm.as_ref()
    }

    /// Counter of the whole GPU's GPM samples.
    pub(crate) fn gpm_calls(&self) -> &AtomicU64 {
        &self.gpm_calls
    }

    /// Sample number for this call, after the lost and forced-failure checks
    /// every per-device call goes through.
    pub(crate) fn sample(&self, advance: bool, fail: FailSelector) -> Result<u64, NvmlReturn> {
        let sample = if advance {
            self.sample_calls.fetch_add(1, Ordering::Relaxed)
        } else {
            self.sample_calls.load(Ordering::Relaxed).saturating_sub(1)
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
