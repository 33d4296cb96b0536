//! A scripted stand-in for NVIDIA's `libnvidia-ml.so`. Built as a `cdylib`,
//! it exports the NVML C symbols that `nvml-wrapper` 0.13 calls, so tests on
//! machines without a GPU run the real nvml-wrapper FFI path:
//!
//! ```text
//! GPUWARDEN_FAKE_NVML_SCRIPT=/path/to/script.json
//! Nvml::builder().lib_path("<target>/debug/libgpuwarden_fake_nvml.so".as_ref()).init()
//! ```
//!
//! # Script
//!
//! The JSON file named by `GPUWARDEN_FAKE_NVML_SCRIPT` is read when a session
//! starts (`nvmlInit_v2`/`nvmlInitWithFlags` while no session is open; NVML
//! counts inits, so the script is re-read only after the matching number of
//! `nvmlShutdown`s). If the variable is unset or the file is unreadable or
//! invalid, init returns NVML_ERROR_UNKNOWN (999) and one line on stderr says
//! why. Unknown keys are errors everywhere.
//!
//! ```json
//! {
//!   "driver_version": "550.54.15",
//!   "nvml_version": "12.550.54.15",
//!   "cuda_driver_version": 12040,
//!   "devices": [
//!     {
//!       "uuid": "GPU-11111111-2222-3333-4444-555555555555",
//!       "name": "NVIDIA H100 80GB HBM3",
//!       "index": 0,
//!       "pci_bus_id": "00000000:17:00.0",
//!       "memory_total_bytes": 85520809984,
//!       "memory_used_bytes": [1048576, 2097152],
//!       "util_gpu_pct": [95, 80, 0],
//!       "util_mem_pct": [40],
//!       "power_mw": [350000],
//!       "power_limit_mw": 700000,
//!       "energy_mj": [1000000, 1005000],
//!       "temp_c": [61],
//!       "sm_clock_mhz": [1980],
//!       "processes": [[{"pid": 1234, "used_memory_bytes": 1048576}]],
//!       "fail": {"power_usage": "not_supported", "temperature": "unknown"},
//!       "lost_at_sample": 3,
//!       "gpm": {"graphics_util": [100], "sm_util": [2, 60], "sm_occupancy": 1,
//!               "any_tensor_util": 0, "dram_bw_util": 3}
//!     },
//!     {
//!       "uuid": "GPU-66666666-7777-8888-9999-000000000000",
//!       "name": "NVIDIA H100 80GB HBM3",
//!       "memory_total_bytes": 85520809984, "memory_used_bytes": 0,
//!       "power_mw": 420000, "energy_mj": [7000000, 7004200],
//!       "gpm": {},
//!       "mig": {
//!         "enabled": true,
//!         "slices": 7,
//!         "instances": [
//!           {"uuid": "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "profile": "3g.40gb",
//!            "slices": 3, "gpu_instance_id": 2, "compute_instance_id": 0,
//!            "memory_total_bytes": 42949672960, "memory_used_bytes": [1073741824],
//!            "processes": [[{"pid": 1234}]],
//!            "gpm": {"graphics_util": 80, "sm_util": 75}}
//!         ]
//!       }
//!     }
//!   ]
//! }
//! ```
//!
//! * Every field is optional; an omitted value makes its getter return
//!   NVML_ERROR_NOT_SUPPORTED (3). `devices` defaults to none.
//! * List fields (`memory_used_bytes`, `util_*`, `power_mw`, `energy_mj`,
//!   `temp_c`, `sm_clock_mhz`) are indexed by the device's sample number and
//!   repeat their last element once exhausted; a bare number means a
//!   one-element list; an empty list is an error. `processes` is a list of
//!   per-sample process lists (`[[]]` = no processes); `used_memory_bytes`
//!   may be omitted (reported as NVML_VALUE_NOT_AVAILABLE).
//! * Sample number: a device's k-th `nvmlDeviceGetUtilizationRates` call
//!   (0-based) uses sample k; every other call uses the sample of the most
//!   recent utilization call (0 before the first). On a GPU in MIG mode,
//!   where NVML supports no utilization (NOT_SUPPORTED, which does not count),
//!   its k-th `nvmlDeviceGetMigMode` call takes sample k instead.
//! * `lost_at_sample: N`: once the sample number is >= N, every call on that
//!   device, handle lookups included, returns NVML_ERROR_GPU_IS_LOST (15).
//! * `fail`: getter name (`uuid`, `name`, `index`, `pci_info`, `utilization`,
//!   `memory_info`, `power_usage`, `power_limit`, `energy`, `temperature`,
//!   `clock`, `processes`, `gpm` for the GPM sample calls) to error
//!   (`not_supported` 3, `no_permission` 4, `timeout` 10, `gpu_is_lost` 15,
//!   `unknown` 999), returned on every call. A failing utilization call
//!   still advances the sample number.
//! * `pci_bus_id` must look like `DDDDDDDD:BB:DD.F`; it is returned verbatim
//!   as `busId` and reformatted as NVML's 4-digit-domain `busIdLegacy`.
//! * The graphics clock reads `sm_clock_mhz` too; memory and video clocks
//!   are NOT_SUPPORTED.
//! * `gpm`: the chip has GPU performance monitoring (Hopper and later;
//!   `nvmlGpmQueryDeviceSupport` says so, and `{}` is enough). Its keys are
//!   NVML's GPM metrics, each a list of percentages per interval: element
//!   `i` is the rate between the `i`-th and `(i+1)`-th GPM sample taken of
//!   this GPU (each `nvmlGpmSampleGet` takes the next), repeating its last.
//!   `nvmlGpmMetricsGet` averages a metric over the intervals between its
//!   two samples, which must be of one GPU (or GPU instance), the second
//!   taken later; a metric not scripted answers NOT_SUPPORTED in its slot.
//!   Without `gpm` every GPM call but the support query is NOT_SUPPORTED.
//! * `mig`: the GPU is MIG-capable. `enabled` is its (current and pending)
//!   mode; `slices` its compute slices (1, 2, 3, 4, 6, 7 or 8;
//!   `nvmlDeviceGetMaxMigDeviceCount` answers it, and
//!   `nvmlDeviceGetGpuInstanceProfileInfo` the plain `<n>_SLICE` profiles of
//!   1 to 4 slices up to it, and its own size); `instances` the MIG devices, by index, each one compute
//!   instance filling GPU instance `gpu_instance_id` (unique on the GPU).
//!   Their `slices` may not add up to more than the GPU's; their UUIDs are
//!   unique among all GPUs and MIG devices. A MIG device has the GPU's name
//!   with ` MIG <profile>`, its own memory and processes (indexed by the
//!   GPU's sample number; processes carry the GPU and compute instance ids),
//!   `nvmlDeviceGetAttributes_v2` (its slices and memory; engine counts 0),
//!   and GPM through `nvmlGpmMigSampleGet(gpu, gpu_instance_id)` from its
//!   `gpm`, which needs `gpm` on the GPU too. Utilization, power, energy,
//!   temperature, clocks, index and PCI information are NOT_SUPPORTED on a
//!   MIG device, as on the real driver; it shares its GPU's sample number,
//!   `lost_at_sample` and `fail`. A GPU in MIG mode has no utilization and
//!   no `processes` of its own: its process list is its MIG devices'.
//!
//! # Modules
//!
//! Modules are declared lowest layer first; a module uses only modules above
//! it in this list (`tests/workspace.rs` checks it): the return codes, the
//! script, the session state over both, and the exported symbols over all.

// This crate exists to export C symbols, which needs `#[no_mangle]` and raw
// pointers; the parent workspace forbids unsafe code everywhere else.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod codes;
pub mod script;
mod state;
pub mod ffi;

pub use script::SCRIPT_ENV;
