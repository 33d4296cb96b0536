//! End-to-end checks: load the built cdylib through nvml-wrapper exactly as
//! production code loads the real libnvidia-ml.so, and read scripted values
//! back through its safe API.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::{GpmSample, Nvml};
use serde_json::json;

const SCRIPT_ENV: &str = "GPUWARDEN_FAKE_NVML_SCRIPT";

/// The env var and the fake's session are process-global, so scenarios must
/// not interleave.
static SERIAL: Mutex<()> = Mutex::new(());

/// The cdylib cargo built for this test run. During `cargo test` cargo
/// leaves it in `<profile>/deps/`, beside this binary, and does not copy it
/// up to `<profile>/` (only `cargo build` does); a copy there may be stale,
/// so it is only the fallback.
fn lib_path() -> PathBuf {
    const NAME: &str = "libgpuwarden_fake_nvml.so";
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("test binary has a parent dir");
    let candidates = [deps.join(NAME), deps.join("..").join(NAME)];
    candidates
        .iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("fake NVML not built; looked at {candidates:?}"))
        .clone()
}

/// Holds the serial lock and owns the script file for one scenario.
struct Scenario {
    path: PathBuf,
    _serial: MutexGuard<'static, ()>,
}

impl Scenario {
    fn new(name: &str, script: &serde_json::Value) -> Self {
        let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        let path = std::env::temp_dir().join(format!(
            "gpuwarden-fake-nvml-{}-{name}.json",
            std::process::id()
        ));
        std::fs::write(&path, script.to_string()).expect("write script");
        std::env::set_var(SCRIPT_ENV, &path);
        Self {
            path,
            _serial: serial,
        }
    }

    /// Swaps in a new script; it takes effect at the next fresh init.
    fn rewrite(&self, script: &serde_json::Value) {
        std::fs::write(&self.path, script.to_string()).expect("rewrite script");
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        std::env::remove_var(SCRIPT_ENV);
    }
}

fn init() -> Result<Nvml, NvmlError> {
    let lib = lib_path();
    Nvml::builder().lib_path(lib.as_os_str()).init()
}

const UUID0: &str = "GPU-11111111-2222-3333-4444-555555555555";
const UUID1: &str = "GPU-66666666-7777-8888-9999-000000000000";

#[test]
fn scripted_values_read_back_and_advance_per_utilization_call() {
    let s = Scenario::new(
        "values",
        &json!({
            "driver_version": "550.54.15",
            "nvml_version": "12.550.54.15",
            "cuda_driver_version": 12040,
            "devices": [{
                "uuid": UUID0,
                "name": "NVIDIA H100 80GB HBM3",
                "index": 0,
                "pci_bus_id": "00000000:17:00.0",
                "memory_total_bytes": 85_520_809_984u64,
                "memory_used_bytes": [1_048_576, 2_097_152],
                "util_gpu_pct": [95, 80, 0],
                "util_mem_pct": [40],
                "power_mw": [350_000, 360_000],
                "power_limit_mw": 700_000,
                "energy_mj": [1_000_000, 1_005_000],
                "temp_c": 61,
                "sm_clock_mhz": [1980, 1755],
                "processes": [
                    [{"pid": 1234, "used_memory_bytes": 1_048_576}],
                    [{"pid": 1234, "used_memory_bytes": 2_097_152}, {"pid": 5678}],
                    []
                ]
            }]
        }),
    );
    let nvml = init().expect("init");
    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.550.54.15");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12040);
    assert_eq!(nvml.device_count().unwrap(), 1);
    assert!(matches!(
        nvml.device_by_index(1),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));

    let dev = nvml.device_by_index(0).unwrap();
    assert_eq!(dev.uuid().unwrap(), UUID0);
    assert_eq!(dev.name().unwrap(), "NVIDIA H100 80GB HBM3");
    assert_eq!(dev.index().unwrap(), 0);
    let pci = dev.pci_info().unwrap();
    assert_eq!(pci.bus_id, "00000000:17:00.0");
    assert_eq!((pci.domain, pci.bus, pci.device), (0, 0x17, 0));
    assert_eq!(nvml.device_by_uuid(UUID0).unwrap().uuid().unwrap(), UUID0);
    assert_eq!(dev.enforced_power_limit().unwrap(), 700_000);
    assert!(matches!(dev.mig_mode(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        dev.clock_info(Clock::Memory),
        Err(NvmlError::NotSupported)
    ));

    // Before any utilization call everything reads sample 0.
    assert_eq!(dev.power_usage().unwrap(), 350_000);
    assert_eq!(dev.memory_info().unwrap().used, 1_048_576);

    // What each successive utilization call, and the getters after it, see.
    struct Sample {
        gpu: u32,
        used: u64,
        power: u32,
        energy: u64,
        sm: u32,
        pids: &'static [u32],
    }
    let expected = [
        Sample {
            gpu: 95,
            used: 1_048_576,
            power: 350_000,
            energy: 1_000_000,
            sm: 1980,
            pids: &[1234],
        },
        Sample {
            gpu: 80,
            used: 2_097_152,
            power: 360_000,
            energy: 1_005_000,
            sm: 1755,
            pids: &[1234, 5678],
        },
        Sample {
            gpu: 0,
            used: 2_097_152,
            power: 360_000,
            energy: 1_005_000,
            sm: 1755,
            pids: &[],
        },
        Sample {
            gpu: 0,
            used: 2_097_152,
            power: 360_000,
            energy: 1_005_000,
            sm: 1755,
            pids: &[],
        },
    ];
    for (call, want) in expected.iter().enumerate() {
        let util = dev.utilization_rates().unwrap();
        assert_eq!((util.gpu, util.memory), (want.gpu, 40), "call {call}");
        let memory = dev.memory_info().unwrap();
        assert_eq!(memory.total, 85_520_809_984, "call {call}");
        assert_eq!(memory.used, want.used, "call {call}");
        assert_eq!(memory.free, 85_520_809_984 - want.used, "call {call}");
        assert_eq!(dev.power_usage().unwrap(), want.power, "call {call}");
        assert_eq!(
            dev.total_energy_consumption().unwrap(),
            want.energy,
            "call {call}"
        );
        assert_eq!(dev.temperature(TemperatureSensor::Gpu).unwrap(), 61);
        assert_eq!(dev.clock_info(Clock::SM).unwrap(), want.sm, "call {call}");
        assert_eq!(
            dev.clock_info(Clock::Graphics).unwrap(),
            want.sm,
            "call {call}"
        );
        let procs = dev.running_compute_processes().unwrap();
        let got: Vec<u32> = procs.iter().map(|p| p.pid).collect();
        assert_eq!(got, want.pids, "call {call}");
        assert_eq!(
            dev.running_compute_processes_count().unwrap() as usize,
            want.pids.len()
        );
        if call == 1 {
            assert_eq!(procs[0].used_gpu_memory, UsedGpuMemory::Used(2_097_152));
            assert_eq!(procs[1].used_gpu_memory, UsedGpuMemory::Unavailable);
            assert_eq!(procs[1].gpu_instance_id, None);
        }
    }

    // A fresh session re-reads the script and restarts the samples.
    drop(nvml);
    s.rewrite(&json!({"devices": [{"uuid": UUID1, "util_gpu_pct": [7, 8], "util_mem_pct": 1}]}));
    let nvml = init().expect("re-init");
    let dev = nvml.device_by_index(0).unwrap();
    assert_eq!(dev.uuid().unwrap(), UUID1);
    assert_eq!(dev.utilization_rates().unwrap().gpu, 7);
    assert!(matches!(dev.power_usage(), Err(NvmlError::NotSupported)));
}

#[test]
fn fail_entries_surface_as_matching_errors() {
    let _s = Scenario::new(
        "fail",
        &json!({
            "devices": [{
                "uuid": UUID0,
                "name": "NVIDIA A100-SXM4-40GB",
                "memory_total_bytes": 42_949_672_960u64,
                "memory_used_bytes": 1024,
                "util_gpu_pct": 50,
                "util_mem_pct": 10,
                "power_mw": 250_000,
                "energy_mj": 5,
                "temp_c": 40,
                "sm_clock_mhz": 1410,
                "processes": [[]],
                "fail": {
                    "power_usage": "not_supported",
                    "temperature": "unknown",
                    "energy": "no_permission",
                    "clock": "timeout",
                    "processes": "gpu_is_lost"
                }
            }]
        }),
    );
    let nvml = init().expect("init");
    let dev = nvml.device_by_index(0).unwrap();
    assert!(matches!(dev.power_usage(), Err(NvmlError::NotSupported)));
    assert!(matches!(
        dev.temperature(TemperatureSensor::Gpu),
        Err(NvmlError::Unknown)
    ));
    assert!(matches!(
        dev.total_energy_consumption(),
        Err(NvmlError::NoPermission)
    ));
    assert!(matches!(dev.clock_info(Clock::SM), Err(NvmlError::Timeout)));
    assert!(matches!(
        dev.running_compute_processes(),
        Err(NvmlError::GpuLost)
    ));
    // Omitted values are NOT_SUPPORTED; the rest of the device still works.
    assert!(matches!(
        dev.enforced_power_limit(),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(dev.pci_info(), Err(NvmlError::NotSupported)));
    assert!(matches!(dev.index(), Err(NvmlError::NotSupported)));
    assert_eq!(dev.name().unwrap(), "NVIDIA A100-SXM4-40GB");
    assert_eq!(dev.utilization_rates().unwrap().gpu, 50);
    assert_eq!(dev.memory_info().unwrap().used, 1024);
    assert_eq!(dev.uuid().unwrap(), UUID0);
}

#[test]
fn lost_gpu_fails_from_its_sample_on_while_others_keep_working() {
    let s = Scenario::new(
        "lost",
        &json!({
            "devices": [
                {"uuid": UUID0, "util_gpu_pct": [10, 20, 30], "util_mem_pct": 1,
                 "power_mw": 100_000, "memory_total_bytes": 100, "memory_used_bytes": 10,
                 "lost_at_sample": 2},
                {"uuid": UUID1, "util_gpu_pct": [60, 70], "util_mem_pct": 2,
                 "power_mw": 200_000}
            ]
        }),
    );
    let nvml = init().expect("init");
    let lost = nvml.device_by_index(0).unwrap();
    let ok = nvml.device_by_index(1).unwrap();
    assert_eq!(lost.utilization_rates().unwrap().gpu, 10);
    assert_eq!(lost.utilization_rates().unwrap().gpu, 20);
    assert_eq!(lost.power_usage().unwrap(), 100_000);
    // Third utilization call is sample 2: the GPU falls off the bus.
    assert!(matches!(lost.utilization_rates(), Err(NvmlError::GpuLost)));
    assert!(matches!(lost.power_usage(), Err(NvmlError::GpuLost)));
    assert!(matches!(lost.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(lost.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(lost.utilization_rates(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(0), Err(NvmlError::GpuLost)));
    assert!(matches!(
        nvml.device_by_uuid(UUID0),
        Err(NvmlError::GpuLost)
    ));

    assert_eq!(nvml.device_count().unwrap(), 2);
    assert_eq!(ok.utilization_rates().unwrap().gpu, 60);
    assert_eq!(ok.utilization_rates().unwrap().gpu, 70);
    assert_eq!(ok.utilization_rates().unwrap().gpu, 70);
    assert_eq!(ok.power_usage().unwrap(), 200_000);
    assert_eq!(nvml.device_by_uuid(UUID1).unwrap().uuid().unwrap(), UUID1);

    // lost_at_sample 0: lost from the start, even for handle lookups.
    drop(nvml);
    s.rewrite(&json!({"devices": [{"uuid": UUID0, "lost_at_sample": 0}]}));
    let nvml = init().expect("re-init");
    assert_eq!(nvml.device_count().unwrap(), 1);
    assert!(matches!(nvml.device_by_index(0), Err(NvmlError::GpuLost)));
}

const MIG0: &str = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
const MIG1: &str = "MIG-ffffffff-bbbb-cccc-dddd-eeeeeeeeeeee";

/// An H100 in MIG mode with a `3g.40gb` (GPU instance 2, one process) and a
/// `1g.10gb` (GPU instance 9, idle), and 3 of its 7 slices unused.
fn mig_h100(gpm: bool) -> serde_json::Value {
    let mut gpu = json!({
        "uuid": UUID1, "index": 1, "name": "NVIDIA H100 80GB HBM3",
        "memory_total_bytes": 85_520_809_984u64, "memory_used_bytes": [2_147_483_648u64],
        "power_mw": 300_000, "util_gpu_pct": 50, "util_mem_pct": 5,
        "mig": {"enabled": true, "slices": 7, "instances": [
            {"uuid": MIG0, "profile": "3g.40gb", "slices": 3, "gpu_instance_id": 2,
             "memory_total_bytes": 42_949_672_960u64, "memory_used_bytes": [1_073_741_824u64, 0],
             "processes": [[{"pid": 4242, "used_memory_bytes": 1_073_741_824u64}], []],
             "gpm": {"graphics_util": [90, 30], "sm_util": [80, 20]}},
            {"uuid": MIG1, "profile": "1g.10gb", "slices": 1, "gpu_instance_id": 9,
             "compute_instance_id": 0,
             "memory_total_bytes": 10_200_547_328u64, "memory_used_bytes": 0,
             "processes": [[]]}
        ]}
    });
    if gpm {
        gpu["gpm"] = json!({});
    }
    json!({"devices": [
        {"uuid": UUID0, "util_gpu_pct": [10], "lost_at_sample": 1},
        gpu
    ]})
}

#[test]
fn mig_devices_enumerate_under_their_gpu_with_their_own_memory_and_processes() {
    let s = Scenario::new("mig", &mig_h100(true));
    let nvml = init().expect("init");
    assert_eq!(nvml.device_count().unwrap(), 2, "MIG devices are not GPUs");
    let plain = nvml.device_by_index(0).unwrap();
    assert!(matches!(plain.mig_mode(), Err(NvmlError::NotSupported)));
    assert!(!plain.mig_is_mig_device_handle().unwrap());
    assert!(matches!(
        plain.mig_device_by_index(0),
        Err(NvmlError::NotSupported)
    ));

    let gpu = nvml.device_by_index(1).unwrap();
    let mode = gpu.mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (1, 1));
    assert_eq!(gpu.mig_device_count().unwrap(), 7);
    assert!(
        matches!(gpu.utilization_rates(), Err(NvmlError::NotSupported)),
        "NVML has no utilization for a GPU in MIG mode"
    );
    assert_eq!(gpu.power_usage().unwrap(), 300_000, "power is the GPU's");
    assert_eq!(gpu.memory_info().unwrap().total, 85_520_809_984);
    let slices: Vec<u32> = (0..17)
        .filter_map(|p| gpu.profile_info(p).ok())
        .map(|info| info.slice_count)
        .collect();
    assert_eq!(slices, [1, 2, 3, 4, 7], "the profiles of a 7-slice GPU");
    assert!(matches!(gpu.profile_info(17), Err(NvmlError::InvalidArg)));
    assert!(matches!(gpu.attributes(), Err(NvmlError::NotSupported)));
    let pids: Vec<(u32, Option<u32>)> = gpu
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| (p.pid, p.gpu_instance_id))
        .collect();
    assert_eq!(
        pids,
        [(4242, Some(2))],
        "the GPU's processes are its MIG devices'"
    );

    let big = gpu.mig_device_by_index(0).unwrap();
    let small = gpu.mig_device_by_index(1).unwrap();
    assert!(matches!(
        gpu.mig_device_by_index(2),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        gpu.mig_device_by_index(7),
        Err(NvmlError::InvalidArg)
    ));
    assert!(big.mig_is_mig_device_handle().unwrap());
    assert_eq!(big.uuid().unwrap(), MIG0);
    assert_eq!(big.name().unwrap(), "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
    assert_eq!(small.name().unwrap(), "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
    let attributes = big.attributes().unwrap();
    assert_eq!(
        (
            attributes.gpu_instance_slice_count,
            attributes.compute_instance_slice_count,
            attributes.memory_size_mb
        ),
        (3, 3, 40_960)
    );
    let memory = big.memory_info().unwrap();
    assert_eq!((memory.total, memory.used), (42_949_672_960, 1_073_741_824));
    let procs = big.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(
        (
            procs[0].pid,
            procs[0].gpu_instance_id,
            procs[0].compute_instance_id
        ),
        (4242, Some(2), Some(0))
    );
    assert!(small.running_compute_processes().unwrap().is_empty());
    for unsupported in [
        big.utilization_rates().map(|_| ()),
        big.power_usage().map(|_| ()),
        big.total_energy_consumption().map(|_| ()),
        big.temperature(TemperatureSensor::Gpu).map(|_| ()),
        big.index().map(|_| ()),
        big.mig_mode().map(|_| ()),
    ] {
        assert!(matches!(unsupported, Err(NvmlError::NotSupported)));
    }
    assert_eq!(big.mig_parent_device().unwrap().uuid().unwrap(), UUID1);
    assert_eq!(nvml.device_by_uuid(MIG1).unwrap().uuid().unwrap(), MIG1);
    assert!(
        matches!(gpu.mig_parent_device(), Err(NvmlError::InvalidArg)),
        "a GPU is no MIG device"
    );

    // The MIG mode call is the GPU's tick in MIG mode: the next sample.
    gpu.mig_mode().unwrap();
    assert_eq!(big.memory_info().unwrap().used, 0);
    assert!(big.running_compute_processes().unwrap().is_empty());

    drop(nvml);
    for bad in [
        json!({"devices": [{"uuid": UUID0, "mig": {"enabled": true, "slices": 7, "instances": [
            {"uuid": UUID0, "profile": "1g.10gb", "slices": 1, "gpu_instance_id": 1}]}}]}),
        json!({"devices": [{"mig": {"enabled": true, "slices": 7, "instances": [
            {"uuid": MIG0, "profile": "1g.10gb", "slices": 1, "gpu_instance_id": 1, "typo": 1}]}}]}),
    ] {
        s.rewrite(&bad);
        assert!(matches!(init(), Err(NvmlError::Unknown)), "{bad}");
    }

    // A MIG device of a lost GPU is lost with it.
    s.rewrite(
        &json!({"devices": [{"uuid": UUID0, "lost_at_sample": 0, "mig": {
        "enabled": true, "slices": 7, "instances": [
            {"uuid": MIG0, "profile": "7g.80gb", "slices": 7, "gpu_instance_id": 0}]}}]}),
    );
    let nvml = init().expect("re-init");
    assert!(matches!(nvml.device_by_uuid(MIG0), Err(NvmlError::GpuLost)));
}

const GPM_METRICS: [GpmMetricId; 5] = [
    GpmMetricId::SmUtil,
    GpmMetricId::SmOccupancy,
    GpmMetricId::AnyTensorUtil,
    GpmMetricId::DramBwUtil,
    GpmMetricId::GraphicsUtil,
];

/// The values of [`GPM_METRICS`] between two samples, `None` where NVML
/// answered an error in that metric's slot.
fn gpm_values(nvml: &Nvml, first: &GpmSample<'_>, second: &GpmSample<'_>) -> Vec<Option<f64>> {
    gpm_metrics_get(nvml, first, second, &GPM_METRICS)
        .unwrap()
        .into_iter()
        .map(|m| m.ok().map(|m| m.value))
        .collect()
}

#[test]
fn gpm_metrics_are_the_scripted_rates_between_two_samples() {
    let s = Scenario::new(
        "gpm",
        &json!({"devices": [
            {"uuid": UUID0, "util_gpu_pct": 100, "util_mem_pct": 1,
             "gpm": {"sm_util": [2, 4, 60], "sm_occupancy": 1, "any_tensor_util": 0,
                     "dram_bw_util": [3], "graphics_util": 100}},
            {"uuid": UUID1, "util_gpu_pct": 10, "util_mem_pct": 1}
        ]}),
    );
    let nvml = init().expect("init");
    let h100 = nvml.device_by_index(0).unwrap();
    let a100 = nvml.device_by_index(1).unwrap();
    assert!(h100.gpm_support().unwrap());
    assert!(
        !a100.gpm_support().unwrap(),
        "no GPM is an answer, not an error"
    );
    assert!(matches!(a100.gpm_sample(), Err(NvmlError::NotSupported)));

    let first = h100.gpm_sample().unwrap();
    let second = h100.gpm_sample().unwrap();
    assert_eq!(
        gpm_values(&nvml, &first, &second),
        [Some(2.0), Some(1.0), Some(0.0), Some(3.0), Some(100.0)]
    );
    let third = h100.gpm_sample().unwrap();
    let fourth = h100.gpm_sample().unwrap();
    assert_eq!(gpm_values(&nvml, &third, &fourth)[0], Some(60.0));
    assert_eq!(
        gpm_values(&nvml, &first, &fourth)[0],
        Some(22.0),
        "the average over the three intervals between them"
    );
    let info = gpm_metrics_get(&nvml, &first, &second, &[GpmMetricId::SmUtil]).unwrap();
    assert_eq!(info[0].as_ref().unwrap().metric_info.short_name, "sm_util");
    assert!(
        matches!(
            gpm_metrics_get(&nvml, &first, &second, &[GpmMetricId::IntegerUtil]).unwrap()[0],
            Err(NvmlError::NotSupported)
        ),
        "a metric not scripted fails in its own slot"
    );
    assert!(
        matches!(
            gpm_metrics_get(&nvml, &second, &first, &GPM_METRICS),
            Err(NvmlError::InvalidArg)
        ),
        "the second sample must be the later"
    );

    // A GPU instance's samples are its own, and do not mix with the GPU's.
    drop((first, second, third, fourth));
    drop(nvml);
    s.rewrite(&mig_h100(true));
    let nvml = init().expect("re-init");
    let gpu = nvml.device_by_index(1).unwrap();
    let gi2 = [
        gpu.gpm_mig_sample(2).unwrap(),
        gpu.gpm_mig_sample(2).unwrap(),
    ];
    let gi9 = [
        gpu.gpm_mig_sample(9).unwrap(),
        gpu.gpm_mig_sample(9).unwrap(),
    ];
    assert_eq!(
        gpm_values(&nvml, &gi2[0], &gi2[1]),
        [Some(80.0), None, None, None, Some(90.0)]
    );
    assert_eq!(gpm_values(&nvml, &gi9[0], &gi9[1]), [None; 5]);
    assert!(matches!(
        gpm_metrics_get(&nvml, &gi2[0], &gi9[1], &GPM_METRICS),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(gpu.gpm_mig_sample(3), Err(NvmlError::InvalidArg)));
    let third = gpu.gpm_mig_sample(2).unwrap();
    assert_eq!(gpm_values(&nvml, &gi2[1], &third)[4], Some(30.0));
    drop((gi2, gi9, third));
    drop(nvml);

    // An A100 (no GPM) in MIG mode has none per GPU instance either; a
    // forced failure fails the sample calls only.
    s.rewrite(&mig_h100(false));
    let nvml = init().expect("re-init");
    let gpu = nvml.device_by_index(1).unwrap();
    assert!(!gpu.gpm_support().unwrap());
    assert!(matches!(
        gpu.gpm_mig_sample(2),
        Err(NvmlError::NotSupported)
    ));
    drop(nvml);
    let mut failing = mig_h100(true);
    failing["devices"][1]["fail"] = json!({"gpm": "unknown"});
    s.rewrite(&failing);
    let nvml = init().expect("re-init");
    let gpu = nvml.device_by_index(1).unwrap();
    assert!(gpu.gpm_support().unwrap());
    assert!(matches!(gpu.gpm_mig_sample(2), Err(NvmlError::Unknown)));
    assert_eq!(gpu.power_usage().unwrap(), 300_000);
}

#[test]
fn bad_or_missing_script_fails_init_without_panicking() {
    let s = Scenario::new("bad", &json!({"devices": []}));

    std::env::remove_var(SCRIPT_ENV);
    assert!(matches!(init(), Err(NvmlError::Unknown)));

    std::env::set_var(SCRIPT_ENV, s.path.with_extension("missing"));
    assert!(matches!(init(), Err(NvmlError::Unknown)));

    std::env::set_var(SCRIPT_ENV, &s.path);
    s.rewrite(&json!({"devices": [{"uuid": UUID0, "typo_field": 1}]}));
    assert!(matches!(init(), Err(NvmlError::Unknown)));
    s.rewrite(&json!({"devices": [{"fail": {"power_usage": "on_fire"}}]}));
    assert!(matches!(init(), Err(NvmlError::Unknown)));

    // A valid script works again, and NVML-style init counting keeps the
    // session open until every Nvml is gone.
    s.rewrite(&json!({"devices": [{"uuid": UUID0}]}));
    let first = init().expect("init");
    let second = init().expect("second init");
    drop(first);
    assert_eq!(second.device_count().unwrap(), 1);
    drop(second);

    // An empty machine is a valid script.
    s.rewrite(&json!({}));
    let nvml = init().expect("init with no devices");
    assert_eq!(nvml.device_count().unwrap(), 0);
    assert!(matches!(
        nvml.sys_driver_version(),
        Err(NvmlError::NotSupported)
    ));
}

#[test]
fn concurrent_utilization_calls_each_take_one_sample() {
    let gpu: Vec<u32> = (0..=100).collect();
    let _s = Scenario::new(
        "concurrent",
        &json!({"devices": [{"uuid": UUID0, "util_gpu_pct": gpu, "util_mem_pct": 0}]}),
    );
    let nvml = init().expect("init");
    let dev = nvml.device_by_index(0).unwrap();
    let mut seen: Vec<u32> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    (0..25)
                        .map(|_| dev.utilization_rates().unwrap().gpu)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    seen.sort_unstable();
    assert_eq!(seen, (0..100).collect::<Vec<u32>>());
    assert_eq!(dev.utilization_rates().unwrap().gpu, 100);
}
