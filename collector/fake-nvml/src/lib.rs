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
//!       "mig_devices": [{"uuid": "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"}]
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
//!   recent utilization call (0 before the first).
//! * `lost_at_sample: N`: once the sample number is >= N, every call on that
//!   device, handle lookups included, returns NVML_ERROR_GPU_IS_LOST (15).
//! * `fail`: getter name (`uuid`, `name`, `index`, `pci_info`, `utilization`,
//!   `memory_info`, `power_usage`, `power_limit`, `energy`, `temperature`,
//!   `clock`, `processes`) to error (`not_supported` 3, `no_permission` 4,
//!   `timeout` 10, `gpu_is_lost` 15, `unknown` 999), returned on every call.
//!   A failing utilization call still advances the sample number.
//! * `pci_bus_id` must look like `DDDDDDDD:BB:DD.F`; it is returned verbatim
//!   as `busId` and reformatted as NVML's 4-digit-domain `busIdLegacy`.
//! * The graphics clock reads `sm_clock_mhz` too; memory and video clocks,
//!   and `nvmlDeviceGetMigMode`, are NOT_SUPPORTED.
//! * `mig_devices`: MIG devices on the GPU, by UUID (unique among all GPUs
//!   and MIG devices). `nvmlDeviceGetHandleByUUID` opens one (GPU_IS_LOST once
//!   its GPU is lost) and `nvmlDeviceGetDeviceHandleFromMigDeviceHandle` gives
//!   back its GPU; every other call rejects a MIG handle with
//!   INVALID_ARGUMENT, and the GPU itself is still sampled whole.
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
