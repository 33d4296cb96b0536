//! The NVML source through the real nvml-wrapper FFI path, against the scripted fake
//! `libnvidia-ml.so` built from `collector/fake-nvml`: values and units, a field the device
//! cannot report, a device lost mid-run, lease discovery from a process environment, a missing
//! library, the pods holding GPUs on a Kubernetes node (through a kubelet's PodResources API
//! served by tonic on a Unix socket), the lease of a virtual machine named by its SMBIOS OEM
//! strings (a faked `/sys/firmware/dmi/entries`), the whole way to the broker, SM activity from
//! GPM, and GPUs in MIG mode sampled as their MIG devices.

mod support;
#[path = "../src/kubelet/test_server.rs"]
#[allow(dead_code)]
mod test_server;

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpuwarden_collector::kubelet::podresources::{
    self, ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpuwarden_collector::kubelet::KubeletSettings;
use gpuwarden_collector::nvml::{NvmlLibrary, NvmlSource};
use gpuwarden_collector::{Collector, KafkaSink, Metrics, SinkSettings, SourceSpec};
use gpuwarden_schema::kafka::EmbeddedBroker;
use gpuwarden_schema::{AcceleratedClock, Record};
use serde_json::json;

/// The fake's script is named by a process-wide environment variable: one test at a time.
static NVML: Mutex<()> = Mutex::new(());

fn fake_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let candidates = [
        dir.join("libgpuwarden_fake_nvml.so"),
        dir.join("../libgpuwarden_fake_nvml.so"),
    ];
    candidates.into_iter().find(|p| p.exists()).expect(
        "the fake libnvidia-ml.so is built beside the tests (dev-dependency gpuwarden-fake-nvml)",
    )
}

/// A process with a lease in its environment, as a lease's workload would be.
struct LeasedProcess(Child);

impl LeasedProcess {
    fn start(lease: &str) -> Self {
        Self::start_with(lease, &[])
    }

    /// The process, with `vars` in its environment besides its lease.
    fn start_with(lease: &str, vars: &[(&str, &str)]) -> Self {
        let child = Command::new("sleep")
            .arg("60")
            .env("GPUWARDEN_LEASE_ID", lease)
            .envs(vars.iter().copied())
            .spawn()
            .unwrap();
        // Right after exec the kernel shows an empty environment for a moment: wait it out, so
        // the first sample already finds the lease.
        let environ = format!("/proc/{}/environ", child.id());
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !std::fs::read(&environ)
            .is_ok_and(|e| e.windows(18).any(|w| w == b"GPUWARDEN_LEASE_ID"))
        {
            assert!(
                std::time::Instant::now() < until,
                "the child's environment never showed the lease"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Self(child)
    }
}

impl Drop for LeasedProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fake `/sys/firmware/dmi/entries` of a guest whose SMBIOS OEM strings name `lease`, as
/// QEMU writes them for libvirt's `<oemStrings>`: one OEM Strings structure (type 11, QEMU's
/// handle 0x0E00) with the lease among other strings; a second one with only other strings, as
/// other firmware adds; and the BIOS's own entry.
fn dmi_entries(lease: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let entry = |name: &str, raw: &[u8]| {
        std::fs::create_dir(dir.path().join(name)).unwrap();
        std::fs::write(dir.path().join(name).join("raw"), raw).unwrap();
    };
    entry(
        "0-0",
        b"\x00\x18\x00\x00\x01\x02\xe8\x03\x00\x08\0\0\0\0\0\0\0\0\0\0\0\0\0\0SeaBIOS\0rel-1.16\0\0",
    );
    entry(
        "11-0",
        b"\x0b\x05\x00\x0c\x01io.systemd.credential:hostname=vm-7\0\0",
    );
    let mut oem = b"\x0b\x05\x00\x0e\x02vendor=acme\0gpuwarden.lease_id=".to_vec();
    oem.extend_from_slice(lease.as_bytes());
    oem.extend_from_slice(b"\0\0");
    entry("11-1", &oem);
    dir
}

const H100_TOTAL: u64 = 85_520_809_984;

fn script(dir: &std::path::Path, leased_pid: u32) -> PathBuf {
    let script = json!({
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "index": 0,
                "pci_bus_id": "00000000:17:00.0",
                "memory_total_bytes": H100_TOTAL,
                "memory_used_bytes": [1073741824u64, 2147483648u64],
                "util_gpu_pct": [95, 80, 0],
                "util_mem_pct": [40, 30, 0],
                "power_mw": [350000, 360500, 70250],
                "power_limit_mw": 700000,
                "energy_mj": [1000000, 1005000, 1010000],
                "temp_c": [61, 62, 40],
                "sm_clock_mhz": [1980, 1980, 345],
                "processes": [[{"pid": leased_pid, "used_memory_bytes": 1073741824u64}], [{"pid": leased_pid}], []]
            },
            {
                "uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000",
                "name": "NVIDIA A100-SXM4-40GB",
                "index": 1,
                "pci_bus_id": "00000000:27:00.0",
                "memory_total_bytes": 42949672960u64,
                "memory_used_bytes": [0],
                "util_gpu_pct": [10],
                "util_mem_pct": [1],
                "power_limit_mw": 400000,
                "energy_mj": [5],
                "temp_c": [35],
                "sm_clock_mhz": [210],
                "processes": [[]],
                "fail": {"power_usage": "not_supported"},
                "lost_at_sample": 2
            }
        ]
    });
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

#[test]
fn samples_carry_nvmls_values_in_the_contracts_units() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let leased = LeasedProcess::start("l-train-7");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), leased.0.id()),
    );
    let metrics = Arc::new(Metrics::default());
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source =
        NvmlSource::open(&nvml, "gpu-node-1".into(), None, Arc::clone(&metrics)).unwrap();
    assert_eq!(source.device_count(), 2);

    let first = source.sample(1_000_000, 5_000);
    assert_eq!(first.len(), 2);
    let h100 = &first[0];
    h100.validate().unwrap();
    assert_eq!(h100.host, "gpu-node-1");
    assert_eq!(h100.gpu_uuid, "GPU-aaaaaaaa-0000-0000-0000-000000000000");
    assert_eq!(h100.gpu_model, "NVIDIA H100 80GB HBM3");
    assert_eq!(h100.gpu_index, Some(0));
    assert_eq!(h100.pci_bus_id.as_deref(), Some("00000000:17:00.0"));
    assert_eq!((h100.ts_ms, h100.interval_ms), (1_000_000, 5_000));
    assert_eq!(h100.util_gpu_pct, 95.0);
    assert_eq!(h100.util_mem_pct, Some(40.0));
    assert_eq!(h100.mem_used_bytes, 1 << 30);
    assert_eq!(h100.mem_total_bytes, H100_TOTAL);
    assert_eq!(h100.power_w, Some(350.0), "milliwatts become watts");
    assert_eq!(h100.power_limit_w, Some(700.0));
    assert_eq!(
        h100.energy_mj,
        Some(1_000_000),
        "energy stays in millijoules"
    );
    assert_eq!(h100.temp_c, Some(61.0));
    assert_eq!(h100.sm_clock_mhz, Some(1980));
    assert_eq!(h100.process_count, Some(1));
    assert_eq!(
        h100.lease_id.as_deref(),
        Some("l-train-7"),
        "found in the process's environment"
    );

    let a100 = &first[1];
    a100.validate().unwrap();
    assert_eq!(
        a100.power_w, None,
        "a field the device cannot report is null"
    );
    assert_eq!(
        a100.power_limit_w,
        Some(400.0),
        "the device's other fields are still read"
    );
    assert_eq!(a100.lease_id, None);
    assert_eq!(
        metrics.nvml_errors_for("power_w"),
        1,
        "and the failure is counted"
    );

    let second = source.sample(1_005_000, 5_000);
    assert_eq!(second.len(), 2);
    assert_eq!(second[0].util_gpu_pct, 80.0);
    assert_eq!(second[0].power_w, Some(360.5));
    assert_eq!(second[0].lease_id.as_deref(), Some("l-train-7"));

    // Sample 2: the A100 falls off the bus; the H100 keeps being sampled.
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        third
            .iter()
            .map(|s| s.gpu_uuid.as_str())
            .collect::<Vec<_>>(),
        ["GPU-aaaaaaaa-0000-0000-0000-000000000000"]
    );
    assert_eq!(third[0].util_gpu_pct, 0.0);
    assert_eq!(third[0].process_count, Some(0));
    assert_eq!(third[0].lease_id, None, "no process, no lease");
    let fourth = source.sample(1_015_000, 5_000);
    assert_eq!(fourth.len(), 1, "a lost device stays skipped");
    assert!(metrics
        .render_own()
        .contains("gpuwarden_collector_devices_lost_total 1"));
    assert_eq!(metrics.nvml_errors_for("power_w"), 2);
}

#[test]
fn a_virtual_machines_gpus_work_for_the_lease_its_smbios_names() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let leased = LeasedProcess::start("l-train-7");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), leased.0.id()),
    );
    let dmi = dmi_entries("l-vm-7");
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source = NvmlSource::open(&nvml, "vm-7".into(), None, Arc::new(Metrics::default()))
        .unwrap()
        .with_guest_lease(dmi.path());

    let first = source.sample(1_000_000, 5_000);
    let leases = |samples: &[gpuwarden_schema::Sample]| {
        samples
            .iter()
            .map(|s| (s.process_count, s.lease_id.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        leases(&first),
        [
            (Some(1), Some("l-train-7".into())),
            (Some(0), Some("l-vm-7".into())),
        ],
        "a process's own lease first; the idle A100 works for the machine's lease"
    );
    source.sample(1_005_000, 5_000);
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        leases(&third),
        [(Some(0), Some("l-vm-7".into()))],
        "the H100, idle once its process is gone, too"
    );
    for s in first.iter().chain(&third) {
        s.validate().unwrap();
    }

    // The SMBIOS is read once, at start: a machine's lease is fixed when it boots.
    std::fs::remove_dir_all(dmi.path().join("11-1")).unwrap();
    assert_eq!(
        source.sample(1_015_000, 5_000)[0].lease_id.as_deref(),
        Some("l-vm-7")
    );
}

#[test]
fn in_a_virtual_machine_a_pods_lease_comes_before_the_machines() {
    let node = KubeNode::start();
    let dmi = dmi_entries("l-vm-7");
    let mut source = node
        .source("vm-node-7", Arc::new(Metrics::default()))
        .with_guest_lease(dmi.path());

    let first = source.sample(1_000_000, 5_000);
    assert_eq!(first[0].lease_id.as_deref(), Some("l-train-7"));
    assert_eq!(
        first[1].lease_id,
        Some(format!("k8s-{NOTEBOOK_UID}")),
        "the pod's lease, not the machine's"
    );
    source.sample(1_005_000, 5_000);
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        third[0]
            .labels
            .as_ref()
            .and_then(|l| l.get("k8s_pod"))
            .map(String::as_str),
        Some("train-0")
    );
    assert_eq!(
        third[0].lease_id.as_deref(),
        Some("l-vm-7"),
        "a pod whose lease cannot be found leaves the GPU to the machine's lease"
    );
}

#[test]
fn a_missing_driver_library_says_what_to_install() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let err = NvmlLibrary::open(Some(std::path::Path::new("/nonexistent/libnvidia-ml.so.1")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(err.contains("Install the NVIDIA driver"), "{err}");
    assert!(err.contains("--source simulated"), "{err}");
}

#[test]
fn collected_samples_reach_the_broker_exactly_as_produced() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let leased = LeasedProcess::start("l-e2e");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), leased.0.id()),
    );
    let broker = EmbeddedBroker::start(2).unwrap();
    let metrics = Arc::new(Metrics::default());
    let sink = KafkaSink::start(
        &support::client(broker.bootstrap_servers()),
        gpuwarden_schema::topics::SAMPLES,
        SinkSettings::default(),
        Arc::clone(&metrics),
    )
    .unwrap();
    // 1 s of event time per 10 ms of wall time.
    let clock = Arc::new(AcceleratedClock::from_now(100.0));
    // Inside a virtual machine of lease l-vm-e2e.
    let dmi = dmi_entries("l-vm-e2e");
    let spec = SourceSpec::Nvml {
        library: Some(fake_library()),
        host: "gpu-node-2".into(),
        slurm_cluster: None,
        kubelet: None,
        dmi_entries_dir: Some(dmi.path().to_path_buf()),
    };
    let collector = Collector::start(
        spec,
        sink,
        Duration::from_secs(1),
        clock,
        Arc::clone(&metrics),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let report = collector.stop(Duration::from_secs(30));

    assert!(
        report.published >= 6,
        "about 20 rounds of 1-2 GPUs: {report:?}"
    );
    assert_eq!(report.dropped, 0);
    let got = support::read_samples(
        broker.bootstrap_servers(),
        gpuwarden_schema::topics::SAMPLES,
        report.published as usize,
        Duration::from_secs(30),
    );
    assert_eq!(
        got.len() as u64,
        report.published,
        "the broker holds exactly what the collector published"
    );
    let a100 = got
        .iter()
        .filter(|(_, s)| s.gpu_uuid.starts_with("GPU-bbbb"))
        .count();
    assert_eq!(
        a100, 2,
        "the A100 was sampled twice before it fell off the bus"
    );
    assert!(
        got.iter()
            .filter(|(_, s)| s.gpu_uuid.starts_with("GPU-bbbb"))
            .all(|(_, s)| s.process_count == Some(0) && s.lease_id.as_deref() == Some("l-vm-e2e")),
        "the idle A100 works for the machine's lease: {got:#?}"
    );
    for (key, s) in &got {
        assert_eq!(key, &s.gpu_uuid);
        assert_eq!(s.host, "gpu-node-2");
        assert!(
            s.interval_ms >= 1 && s.interval_ms <= 5_000,
            "interval covers the time since the previous sample: {}",
            s.interval_ms
        );
    }
    let first_h100 = got
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.gpu_uuid.starts_with("GPU-aaaa"))
        .min_by_key(|s| s.ts_ms)
        .unwrap();
    assert_eq!(first_h100.power_w, Some(350.0));
    assert_eq!(first_h100.lease_id.as_deref(), Some("l-e2e"));
}

/// A pod whose one container holds device `id` of `resource`.
fn pod(namespace: &str, name: &str, container: &str, resource: &str, id: &str) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: vec![id.into()],
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// What the kubelet of the fake node says: pod `ml/train-0` holds the H100 by UUID, pod
/// `ml/notebook-1` the A100 by index, and a pod holds CPUs only.
fn kubelet_pods() -> ListPodResourcesResponse {
    ListPodResourcesResponse {
        pod_resources: vec![
            pod(
                "ml",
                "train-0",
                "trainer",
                "nvidia.com/gpu",
                "GPU-aaaaaaaa-0000-0000-0000-000000000000",
            ),
            pod("ml", "notebook-1", "lab", "nvidia.com/gpu", "1"),
            pod("ops", "agent", "main", "example.com/nic", "eth1"),
        ],
    }
}

const NOTEBOOK_UID: &str = "9a8b7c6d-1111-4222-8333-444455556666";

/// A Kubernetes node as the collector finds it: the fake NVML's two GPUs, the first used by a
/// process whose environment names lease `l-train-7`; a kubelet answering [`kubelet_pods`]; the
/// notebook pod's log directory (its uid); an empty `/proc` for the pods' processes. It holds
/// [`NVML`] while it lives.
struct KubeNode {
    nvml: NvmlLibrary,
    _dir: tempfile::TempDir,
    _leased: LeasedProcess,
    kubelet: test_server::TestKubelet,
    logs: tempfile::TempDir,
    proc: tempfile::TempDir,
    // Last, so that the lock is let go after everything above is gone.
    _one: MutexGuard<'static, ()>,
}

impl KubeNode {
    fn start() -> Self {
        let one = NVML.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let leased = LeasedProcess::start("l-train-7");
        std::env::set_var(
            "GPUWARDEN_FAKE_NVML_SCRIPT",
            script(dir.path(), leased.0.id()),
        );
        let kubelet = test_server::TestKubelet::start(test_server::Answer::Pods(kubelet_pods()));
        let logs = tempfile::tempdir().unwrap();
        std::fs::create_dir(logs.path().join(format!("ml_notebook-1_{NOTEBOOK_UID}"))).unwrap();
        Self {
            nvml: NvmlLibrary::open(Some(&fake_library())).unwrap(),
            _dir: dir,
            _leased: leased,
            kubelet,
            logs,
            proc: tempfile::tempdir().unwrap(),
            _one: one,
        }
    }

    /// The NVML source of node `name`, attributing GPUs to pods through this node's kubelet.
    fn source(&self, name: &str, metrics: Arc<Metrics>) -> NvmlSource<'_> {
        NvmlSource::open(&self.nvml, name.into(), None, metrics)
            .unwrap()
            .with_pods(KubeletSettings {
                pod_logs_dir: self.logs.path().to_path_buf(),
                proc_root: self.proc.path().to_path_buf(),
                ..KubeletSettings::new(&self.kubelet.socket, Duration::from_secs(3600))
            })
            .unwrap()
    }
}

#[test]
fn a_kubernetes_nodes_gpus_carry_their_pods_and_leases() {
    let node = KubeNode::start();
    let metrics = Arc::new(Metrics::default());
    let mut source = node.source("gpu-node-3", Arc::clone(&metrics));

    let samples = source.sample(1_000_000, 5_000);
    let labels = |s: &gpuwarden_schema::Sample| {
        s.labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect::<Vec<_>>()
    };
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let h100 = &samples[0];
    assert_eq!(
        labels(h100),
        [
            pair("k8s_container", "trainer"),
            pair("k8s_namespace", "ml"),
            pair("k8s_pod", "train-0"),
        ]
    );
    assert_eq!(
        h100.lease_id.as_deref(),
        Some("l-train-7"),
        "the GPU process's GPUWARDEN_LEASE_ID comes first; train-0 has no log directory anyway"
    );
    let a100 = &samples[1];
    assert_eq!(
        labels(a100),
        [
            pair("k8s_container", "lab"),
            pair("k8s_namespace", "ml"),
            pair("k8s_pod", "notebook-1"),
        ],
        "held by index"
    );
    let expected_lease = format!("k8s-{NOTEBOOK_UID}");
    assert_eq!(
        a100.lease_id.as_deref(),
        Some(expected_lease.as_str()),
        "an idle GPU (no process) works for its pod's lease"
    );
    for s in &samples {
        s.validate().unwrap();
        assert_eq!(
            gpuwarden_schema::Sample::from_json(&s.to_json()).unwrap(),
            *s,
            "the labels survive the wire"
        );
    }

    metrics.set_latest(&samples);
    let text = metrics.render();
    assert!(
        text.contains(&format!(
            "DCGM_FI_DEV_GPU_UTIL{{gpu=\"1\",UUID=\"GPU-bbbbbbbb-0000-0000-0000-000000000000\",\
             pci_bus_id=\"00000000:27:00.0\",device=\"nvidia1\",modelName=\"NVIDIA A100-SXM4-40GB\",\
             Hostname=\"gpu-node-3\",container=\"lab\",namespace=\"ml\",pod=\"notebook-1\",\
             lease_id=\"{expected_lease}\"}} 10\n"
        )),
        "{text}"
    );
    assert!(text.contains("gpuwarden_collector_podresources_errors_total 0\n"));
    assert_eq!(
        node.kubelet.calls(),
        1,
        "asked once an interval, not once a sample"
    );
}

#[test]
fn without_its_kubelet_a_node_is_sampled_without_pods() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        script(dir.path(), std::process::id()),
    );
    let metrics = Arc::new(Metrics::default());
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source = NvmlSource::open(&nvml, "gpu-node-4".into(), None, Arc::clone(&metrics))
        .unwrap()
        .with_pods(KubeletSettings::new(
            dir.path().join("no-kubelet.sock"),
            Duration::from_secs(3600),
        ))
        .unwrap();
    let samples = source.sample(1_000_000, 5_000);
    assert_eq!(samples.len(), 2, "every GPU is still sampled");
    assert!(samples.iter().all(|s| s.labels.is_none()));
    assert_eq!(metrics.podresources_errors_total(), 1);
    assert!(metrics
        .render()
        .contains("gpuwarden_collector_podresources_errors_total 1\n"));
}

const SPINNING_H100: &str = "GPU-cccccccc-0000-0000-0000-000000000000";
const PLAIN_A100: &str = "GPU-dddddddd-0000-0000-0000-000000000000";
const FAILING_H100: &str = "GPU-ffffffff-0000-0000-0000-000000000000";

/// An H100 spinning one tiny kernel (utilization 100 %, SM active 2 %, then 40 %), an A100
/// without GPM, and an H100 whose GPM sample calls fail.
fn gpm_script(dir: &std::path::Path) -> PathBuf {
    let gpu = |uuid: &str, name: &str, index: u32, util: u32| {
        json!({
            "uuid": uuid, "name": name, "index": index,
            "pci_bus_id": format!("00000000:{:02X}:00.0", 0x17 + index * 0x10),
            "memory_total_bytes": H100_TOTAL, "memory_used_bytes": 1u64 << 30,
            "util_gpu_pct": util, "util_mem_pct": 1, "power_mw": 120_000,
            "processes": [[]]
        })
    };
    let mut spinning = gpu(SPINNING_H100, "NVIDIA H100 80GB HBM3", 0, 100);
    spinning["gpm"] = json!({
        "graphics_util": 100, "sm_util": [2, 40], "sm_occupancy": 1.5,
        "any_tensor_util": 0, "dram_bw_util": 3
    });
    let mut failing = gpu(FAILING_H100, "NVIDIA H100 80GB HBM3", 2, 90);
    failing["gpm"] = json!({"sm_util": 50});
    failing["fail"] = json!({"gpm": "unknown"});
    let script = json!({"devices": [
        spinning,
        gpu(PLAIN_A100, "NVIDIA A100-SXM4-40GB", 1, 10),
        failing,
    ]});
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

/// `promtool check metrics` finds nothing wrong with `text` but what dcgm-exporter's names,
/// which are the contract, break of its style rules: the `modelName` label and the
/// `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` counter without `_total`.
fn promtool_accepts(text: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is installed (Debian's prometheus package; .ci/run installs it)");
    use std::io::Write as _;
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let dcgms_own = |line: &str| {
        line.starts_with("DCGM_FI_")
            && (line.ends_with("label names should be written in 'snake_case' not 'camelCase'")
                || line == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter metrics should have \"_total\" suffix")
    };
    let other: Vec<&str> = said.lines().filter(|l| !dcgms_own(l)).collect();
    assert!(
        other.is_empty(),
        "promtool (exit {:?}): {}\n{text}",
        out.status.code(),
        other.join("\n")
    );
    // Exit 3 is lint problems only (those above); anything else is a parse error.
    assert!(matches!(out.status.code(), Some(0 | 3)), "{said}");
}

/// The `/metrics` line of `family` whose labels contain `labels`, and its value.
fn metric_line<'t>(text: &'t str, family: &str, labels: &str) -> Option<(&'t str, f64)> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(labels))
        .map(|l| (l, l.rsplit_once(' ').unwrap().1.parse().unwrap()))
        .next()
}

#[test]
fn a_spinning_gpu_is_busy_by_utilization_and_idle_by_sm_activity() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("GPUWARDEN_FAKE_NVML_SCRIPT", gpm_script(dir.path()));
    let metrics = Arc::new(Metrics::default());
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source =
        NvmlSource::open(&nvml, "gpu-node-6".into(), None, Arc::clone(&metrics)).unwrap();
    let gpm = |s: &gpuwarden_schema::Sample| {
        [
            s.sm_active_pct,
            s.sm_occupancy_pct,
            s.tensor_active_pct,
            s.dram_active_pct,
            s.gr_active_pct,
        ]
    };

    let first = source.sample(1_000_000, 5_000);
    assert_eq!(first.len(), 3);
    for s in &first {
        s.validate().unwrap();
        assert_eq!(
            gpm(s),
            [None; 5],
            "GPM measures an interval: nothing before a GPU's second sample"
        );
    }

    let second = source.sample(1_005_000, 5_000);
    assert_eq!(
        second
            .iter()
            .map(|s| s.gpu_uuid.as_str())
            .collect::<Vec<_>>(),
        [SPINNING_H100, PLAIN_A100, FAILING_H100],
        "a GPM failure loses no sample"
    );
    let spinning = &second[0];
    assert_eq!(spinning.util_gpu_pct, 100.0, "busy by NVML's utilization");
    assert_eq!(
        gpm(spinning),
        [Some(2.0), Some(1.5), Some(0.0), Some(3.0), Some(100.0)],
        "all but idle by SM activity"
    );
    assert_eq!(gpm(&second[1]), [None; 5], "the A100 has no GPM");
    assert_eq!(second[1].util_gpu_pct, 10.0);
    assert_eq!(gpm(&second[2]), [None; 5]);
    assert_eq!(second[2].util_gpu_pct, 90.0);
    assert_eq!(
        metrics.nvml_errors_for("sm_active_pct"),
        2,
        "each failed GPM sample is counted"
    );
    for s in &second {
        s.validate().unwrap();
        assert_eq!(
            gpuwarden_schema::Sample::from_json(&s.to_json()).unwrap(),
            *s,
            "the GPM fields survive the wire"
        );
    }
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(
        third[0].sm_active_pct,
        Some(40.0),
        "each sample measures the interval since the one before"
    );

    metrics.set_latest(&second);
    let text = metrics.render();
    let labels = format!(
        "{{gpu=\"0\",UUID=\"{SPINNING_H100}\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia0\",\
         modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"gpu-node-6\"}}"
    );
    for (family, value) in [
        ("DCGM_FI_PROF_SM_ACTIVE", 0.02),
        ("DCGM_FI_PROF_SM_OCCUPANCY", 0.015),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.0),
        ("DCGM_FI_PROF_DRAM_ACTIVE", 0.03),
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 1.0),
    ] {
        let (line, got) = metric_line(&text, family, &labels)
            .unwrap_or_else(|| panic!("no {family} for the H100:\n{text}"));
        assert!((got - value).abs() < 1e-9, "{line}");
        assert!(text.contains(&format!("# TYPE {family} gauge\n")), "{text}");
        assert!(
            metric_line(&text, family, PLAIN_A100).is_none(),
            "no series for a GPU without GPM"
        );
    }
    assert!(text.contains(&format!("DCGM_FI_DEV_GPU_UTIL{labels} 100\n")));
    promtool_accepts(&text);
}

const MIG_H100: &str = "GPU-eeeeeeee-0000-0000-0000-000000000000";
const MIG_A100: &str = "GPU-abababab-0000-0000-0000-000000000000";
/// Compute slices of an A100 or H100.
const SLICES: u32 = 7;
const SLICE_1G_10GB: u64 = 10_200_547_328;
const A100_40GB: u64 = 42_949_672_960;

/// The UUID of MIG device `n` of a GPU (`h` on the H100, `a` on the A100).
fn mig(gpu: char, n: usize) -> String {
    format!(
        "MIG-{}-0000-4000-8000-00000000000{n}",
        gpu.to_string().repeat(8)
    )
}

/// An H100 in MIG mode split into 7 `1g.10gb` (GPU instances 7 to 13), the fourth running
/// process `h100_pid`; and an A100 in MIG mode with a `1g.5gb`, a `2g.10gb` running `a100_pid`
/// and another `1g.5gb`, 3 of its 7 slices unused. The H100 has GPM, the A100 not.
fn mig_script(dir: &std::path::Path, h100_pid: u32, a100_pid: u32) -> PathBuf {
    let h100_slices: Vec<serde_json::Value> = (0..7)
        .map(|n| {
            let processes = if n == 3 {
                json!([[{"pid": h100_pid, "used_memory_bytes": 1u64 << 30}]])
            } else {
                json!([[]])
            };
            json!({
                "uuid": mig('h', n), "profile": "1g.10gb", "slices": 1,
                "gpu_instance_id": 7 + n, "memory_total_bytes": SLICE_1G_10GB,
                "memory_used_bytes": if n == 3 { 1u64 << 30 } else { 0 },
                "processes": processes,
                "gpm": {"graphics_util": [37, 55], "sm_util": [12], "sm_occupancy": 8,
                        "any_tensor_util": 4, "dram_bw_util": 20}
            })
        })
        .collect();
    let a100_slice = |n: usize, profile: &str, slices: u32, gi: u32, pid: Option<u32>| {
        json!({
            "uuid": mig('a', n), "profile": profile, "slices": slices, "gpu_instance_id": gi,
            "memory_total_bytes": A100_40GB / 8 * u64::from(slices),
            "memory_used_bytes": if pid.is_some() { 1u64 << 30 } else { 0 },
            "processes": [pid.map_or(json!([]), |pid| json!([{"pid": pid}]))]
        })
    };
    let script = json!({"devices": [
        {
            "uuid": MIG_H100, "name": "NVIDIA H100 80GB HBM3", "index": 0,
            "pci_bus_id": "00000000:17:00.0",
            "memory_total_bytes": H100_TOTAL, "memory_used_bytes": 1u64 << 30,
            "power_mw": [700_000, 350_000], "power_limit_mw": 700_000,
            "energy_mj": [7_000_000, 7_003_501], "temp_c": 50, "sm_clock_mhz": 1980,
            "gpm": {},
            "mig": {"enabled": true, "slices": SLICES, "instances": h100_slices}
        },
        {
            "uuid": MIG_A100, "name": "NVIDIA A100-SXM4-40GB", "index": 1,
            "pci_bus_id": "00000000:27:00.0",
            "memory_total_bytes": A100_40GB, "memory_used_bytes": 1u64 << 30,
            "power_mw": 250_000, "power_limit_mw": 400_000, "energy_mj": 1_000_003,
            "mig": {"enabled": true, "slices": SLICES, "instances": [
                a100_slice(0, "1g.5gb", 1, 9, None),
                a100_slice(1, "2g.10gb", 2, 5, Some(a100_pid)),
                a100_slice(2, "1g.5gb", 1, 13, None),
            ]}
        }
    ]});
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

/// The samples of `gpu`'s MIG devices and its unsliced rest.
fn pieces_of<'s>(
    samples: &'s [gpuwarden_schema::Sample],
    gpu: &str,
) -> Vec<&'s gpuwarden_schema::Sample> {
    samples
        .iter()
        .filter(|s| s.mig_parent_uuid.as_deref() == Some(gpu) || s.gpu_uuid == gpu)
        .collect()
}

#[test]
fn a_gpu_in_mig_mode_is_sampled_as_its_mig_devices_and_unsliced_rest() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let on_h100 = LeasedProcess::start("l-slice-3");
    let on_a100 = LeasedProcess::start("l-a100-2g");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        mig_script(dir.path(), on_h100.0.id(), on_a100.0.id()),
    );
    let metrics = Arc::new(Metrics::default());
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source =
        NvmlSource::open(&nvml, "gpu-node-7".into(), None, Arc::clone(&metrics)).unwrap();

    let first = source.sample(1_000_000, 5_000);
    for s in &first {
        s.validate().unwrap();
    }
    assert_eq!(first.len(), 7 + 3 + 1);
    assert!(
        !first.iter().any(|s| s.gpu_uuid == MIG_H100),
        "a fully sliced GPU has no sample of its own"
    );

    let h100 = pieces_of(&first, MIG_H100);
    assert_eq!(h100.len(), 7);
    for (n, s) in h100.iter().enumerate() {
        assert_eq!(s.gpu_uuid, mig('h', n));
        assert_eq!(s.gpu_model, "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
        assert_eq!(s.mig_profile.as_deref(), Some("1g.10gb"));
        assert_eq!((s.mig_slices, s.mig_parent_slices), (Some(1), Some(SLICES)));
        assert_eq!(
            (s.gpu_index, s.pci_bus_id.as_deref()),
            (Some(0), Some("00000000:17:00.0"))
        );
        assert_eq!(s.mem_total_bytes, SLICE_1G_10GB, "the slice's own memory");
        assert_eq!((s.temp_c, s.sm_clock_mhz), (Some(50.0), Some(1980)));
        assert_eq!(s.util_mem_pct, None);
        let busy = n == 3;
        assert_eq!(s.process_count, Some(u32::from(busy)));
        assert_eq!(
            s.lease_id.as_deref(),
            busy.then_some("l-slice-3"),
            "a process on a slice names the slice's lease, and only its"
        );
        assert_eq!(
            s.util_gpu_pct,
            if busy { 100.0 } else { 0.0 },
            "before GPM has an interval: whether a process runs"
        );
        assert_eq!(s.sm_active_pct, None);
        assert_eq!(s.mem_used_bytes, if busy { 1 << 30 } else { 0 });
    }
    let power: f64 = h100.iter().map(|s| s.power_w.unwrap()).sum();
    assert!(
        (power - 700.0).abs() < 1e-9,
        "shares of power add up: {power}"
    );
    assert!((h100[0].power_w.unwrap() - 100.0).abs() < 1e-9);
    let energy: u64 = h100.iter().map(|s| s.energy_mj.unwrap()).sum();
    assert_eq!(
        energy, 7_000_000,
        "shares of energy add up to the millijoule"
    );

    let a100 = pieces_of(&first, MIG_A100);
    /// UUID, profile, slices, utilization, lease.
    type Piece<'s> = (&'s str, Option<&'s str>, Option<u32>, f64, Option<&'s str>);
    let shape: Vec<Piece<'_>> = a100
        .iter()
        .map(|s| {
            (
                s.gpu_uuid.as_str(),
                s.mig_profile.as_deref(),
                s.mig_slices,
                s.util_gpu_pct,
                s.lease_id.as_deref(),
            )
        })
        .collect();
    let (a0, a1, a2) = (mig('a', 0), mig('a', 1), mig('a', 2));
    assert_eq!(
        shape,
        [
            (a0.as_str(), Some("1g.5gb"), Some(1), 0.0, None),
            (
                a1.as_str(),
                Some("2g.10gb"),
                Some(2),
                100.0,
                Some("l-a100-2g")
            ),
            (a2.as_str(), Some("1g.5gb"), Some(1), 0.0, None),
            (MIG_A100, None, Some(3), 0.0, None),
        ],
        "the A100's slices, then its unsliced rest: idle, leased to no one"
    );
    let rest = a100[3];
    assert_eq!(
        (rest.mig_parent_uuid.as_deref(), rest.mig_parent_slices),
        (None, Some(SLICES))
    );
    assert_eq!(rest.gpu_model, "NVIDIA A100-SXM4-40GB");
    assert_eq!(rest.mem_total_bytes, A100_40GB - A100_40GB / 8 * 4);
    assert_eq!((rest.mem_used_bytes, rest.process_count), (0, Some(0)));
    let power: Vec<f64> = a100.iter().map(|s| s.power_w.unwrap()).collect();
    let want = [1.0, 2.0, 1.0, 3.0].map(|slices| 250.0 * slices / 7.0);
    for (got, want) in power.iter().zip(want) {
        assert!((got - want).abs() < 1e-9, "{power:?}");
    }
    assert_eq!(
        a100.iter().map(|s| s.energy_mj.unwrap()).sum::<u64>(),
        1_000_003
    );
    assert!(
        a100.iter().all(|s| s.sm_active_pct.is_none()),
        "the A100 has no GPM"
    );

    let second = source.sample(1_005_000, 5_000);
    let h100 = pieces_of(&second, MIG_H100);
    assert_eq!(
        (
            h100[3].util_gpu_pct,
            h100[3].sm_active_pct,
            h100[3].gr_active_pct
        ),
        (37.0, Some(12.0), Some(37.0)),
        "the GPU instance's graphics activity is the slice's utilization"
    );
    assert_eq!(
        (
            h100[3].sm_occupancy_pct,
            h100[3].tensor_active_pct,
            h100[3].dram_active_pct
        ),
        (Some(8.0), Some(4.0), Some(20.0))
    );
    assert!(
        h100.iter()
            .filter(|s| s.gpu_uuid != mig('h', 3))
            .all(|s| s.util_gpu_pct == 0.0 && s.sm_active_pct.is_none()),
        "no process has named the idle slices' GPU instances: idle, no GPM"
    );
    let power: f64 = h100.iter().map(|s| s.power_w.unwrap()).sum();
    assert!((power - 350.0).abs() < 1e-9);
    assert_eq!(
        h100.iter().map(|s| s.energy_mj.unwrap()).sum::<u64>(),
        7_003_501
    );
    assert_eq!(
        pieces_of(&second, MIG_A100)[1].util_gpu_pct,
        100.0,
        "without GPM a slice running a process is busy"
    );
    for s in &second {
        s.validate().unwrap();
        assert_eq!(
            gpuwarden_schema::Sample::from_json(&s.to_json()).unwrap(),
            *s
        );
    }
    let third = source.sample(1_010_000, 5_000);
    assert_eq!(pieces_of(&third, MIG_H100)[3].util_gpu_pct, 55.0);

    metrics.set_latest(&second);
    let text = metrics.render();
    let busy = metric_line(
        &text,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        &format!(
            "{{gpu=\"0\",UUID=\"{MIG_H100}\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia0\",\
             modelName=\"NVIDIA H100 80GB HBM3\",GPU_I_PROFILE=\"1g.10gb\",GPU_I_ID=\"10\",\
             Hostname=\"gpu-node-7\",mig_uuid=\"{}\",lease_id=\"l-slice-3\"}}",
            mig('h', 3)
        ),
    );
    assert_eq!(busy.map(|(_, v)| v), Some(0.37), "{text}");
    let idle = metric_line(&text, "DCGM_FI_DEV_FB_FREE", &mig('h', 0))
        .unwrap()
        .0;
    assert!(
        idle.contains(&format!(
            "UUID=\"{MIG_H100}\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia0\",\
             modelName=\"NVIDIA H100 80GB HBM3\",GPU_I_PROFILE=\"1g.10gb\",Hostname=\"gpu-node-7\""
        )),
        "a GPU instance not named yet has no GPU_I_ID: {idle}"
    );
    let rest = metric_line(
        &text,
        "DCGM_FI_DEV_POWER_USAGE",
        &format!(
            "{{gpu=\"1\",UUID=\"{MIG_A100}\",pci_bus_id=\"00000000:27:00.0\",device=\"nvidia1\",\
             modelName=\"NVIDIA A100-SXM4-40GB\",Hostname=\"gpu-node-7\"}}"
        ),
    )
    .unwrap();
    assert!(
        (rest.1 - 250.0 * 3.0 / 7.0).abs() < 1e-9,
        "the unsliced rest, labelled as its GPU: {}",
        rest.0
    );
    promtool_accepts(&text);
}

#[test]
fn mig_devices_named_by_the_kubelet_carry_their_pods() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let on_h100 = LeasedProcess::start("l-slice-3");
    std::env::set_var(
        "GPUWARDEN_FAKE_NVML_SCRIPT",
        mig_script(dir.path(), on_h100.0.id(), std::process::id()),
    );
    // What the kubelet says with the device plugin's `mixed` strategy: a pod per MIG device,
    // by UUID, and (DEVICE_ID_STRATEGY=index) a pod holding MIG device 2 of GPU 0 as `0:2`.
    const INFER_A_UID: &str = "1a2b3c4d-1111-4222-8333-444455556666";
    let kubelet =
        test_server::TestKubelet::start(test_server::Answer::Pods(ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "ml",
                    "infer-a",
                    "server",
                    "nvidia.com/mig-1g.10gb",
                    &mig('h', 0),
                ),
                pod(
                    "ml",
                    "infer-b",
                    "server",
                    "nvidia.com/mig-1g.10gb",
                    &mig('h', 1),
                ),
                pod("ml", "infer-c", "server", "nvidia.com/mig-1g.10gb", "0:2"),
                pod(
                    "ml",
                    "infer-3",
                    "server",
                    "nvidia.com/mig-1g.10gb",
                    &mig('h', 3),
                ),
                pod(
                    "ml",
                    "batch",
                    "worker",
                    "nvidia.com/mig-2g.10gb",
                    &mig('a', 1),
                ),
            ],
        }));
    let logs = tempfile::tempdir().unwrap();
    std::fs::create_dir(logs.path().join(format!("ml_infer-a_{INFER_A_UID}"))).unwrap();
    let metrics = Arc::new(Metrics::default());
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source = NvmlSource::open(&nvml, "gpu-node-8".into(), None, Arc::clone(&metrics))
        .unwrap()
        .with_pods(KubeletSettings {
            pod_logs_dir: logs.path().to_path_buf(),
            proc_root: dir.path().to_path_buf(),
            ..KubeletSettings::new(&kubelet.socket, Duration::from_secs(3600))
        })
        .unwrap();
    let samples = source.sample(1_000_000, 5_000);
    let pod_of = |uuid: &str| {
        let s = samples.iter().find(|s| s.gpu_uuid == uuid).unwrap();
        (
            s.labels
                .as_ref()
                .map(|l| (l["k8s_pod"].clone(), l["k8s_container"].clone())),
            s.lease_id.clone(),
        )
    };
    let held = |pod: &str, container: &str| Some((pod.to_owned(), container.to_owned()));
    assert_eq!(
        pod_of(&mig('h', 0)),
        (
            held("infer-a", "server"),
            Some(format!("k8s-{INFER_A_UID}"))
        ),
        "a slice works for the lease of the pod holding it"
    );
    assert_eq!(
        pod_of(&mig('h', 1)),
        (held("infer-b", "server"), None),
        "no log directory names infer-b's uid"
    );
    assert_eq!(
        pod_of(&mig('h', 2)),
        (held("infer-c", "server"), None),
        "held by index"
    );
    assert_eq!(
        pod_of(&mig('h', 3)),
        (held("infer-3", "server"), Some("l-slice-3".into())),
        "its process's lease comes first"
    );
    assert_eq!(pod_of(&mig('h', 4)), (None, None), "a slice no pod holds");
    assert_eq!(pod_of(&mig('a', 1)).0, held("batch", "worker"));
    assert_eq!(
        pod_of(MIG_A100),
        (None, None),
        "the unsliced rest belongs to no pod"
    );
    metrics.set_latest(&samples);
    let text = metrics.render();
    assert!(
        metric_line(&text, "DCGM_FI_DEV_FB_USED", &mig('h', 0))
            .unwrap()
            .0
            .contains("GPU_I_PROFILE=\"1g.10gb\",Hostname=\"gpu-node-8\",container=\"server\",namespace=\"ml\",pod=\"infer-a\",mig_uuid="),
        "{text}"
    );
    assert_eq!(kubelet.calls(), 1);
}

/// A vLLM-like metrics endpoint on loopback, a real HTTP server whose page the test rewrites;
/// `None` answers 503.
fn metrics_endpoint() -> (String, Arc<Mutex<Option<String>>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let page = Arc::new(Mutex::new(None::<String>));
    let serving = Arc::clone(&page);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = [0u8; 2048];
            let _ = stream.read(&mut request);
            let answer = match serving.lock().unwrap().clone() {
                Some(page) => format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{page}",
                    page.len()
                ),
                None => "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n".into(),
            };
            let _ = stream.write_all(answer.as_bytes());
        }
    });
    (url, page)
}

fn vllm_page(running: u32, waiting: u32) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests currently running on GPU.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{model_name=\"llama\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"llama\"}} {waiting}.0\n"
    )
}

#[test]
fn an_inference_servers_own_metrics_say_whether_its_gpu_is_serving() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (url, page) = metrics_endpoint();
    *page.lock().unwrap() = Some(vllm_page(2, 1));
    let server = LeasedProcess::start_with(
        "l-serve-1",
        &[
            ("GPUWARDEN_SERVING_METRICS", url.as_str()),
            (
                "GPUWARDEN_SERVING_EXPR",
                "vllm:num_requests_running + vllm:num_requests_waiting",
            ),
        ],
    );
    let script = json!({
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": "GPU-cccccccc-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "index": 0,
                "memory_total_bytes": H100_TOTAL,
                "pci_bus_id": "00000000:17:00.0",
                "memory_used_bytes": [H100_TOTAL / 2],
                "util_gpu_pct": [95],
                "util_mem_pct": [20],
                "power_limit_mw": 700000,
                "energy_mj": [5],
                "temp_c": [50],
                "sm_clock_mhz": [1980],
                "processes": [[{"pid": server.0.id(), "used_memory_bytes": H100_TOTAL / 2}]]
            },
            {
                "uuid": "GPU-dddddddd-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "index": 1,
                "memory_total_bytes": H100_TOTAL,
                "pci_bus_id": "00000000:27:00.0",
                "memory_used_bytes": [0],
                "util_gpu_pct": [0],
                "util_mem_pct": [0],
                "power_limit_mw": 700000,
                "energy_mj": [5],
                "temp_c": [35],
                "sm_clock_mhz": [210],
                "processes": [[]]
            }
        ]
    });
    let path = dir.path().join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    std::env::set_var("GPUWARDEN_FAKE_NVML_SCRIPT", &path);
    let nvml = NvmlLibrary::open(Some(&fake_library())).unwrap();
    let mut source = NvmlSource::open(
        &nvml,
        "gpu-node-9".into(),
        None,
        Arc::new(Metrics::default()),
    )
    .unwrap();
    let serving = |samples: &[gpuwarden_schema::Sample]| {
        samples
            .iter()
            .map(|s| (s.lease_id.clone(), s.serving_requests))
            .collect::<Vec<_>>()
    };

    let first = source.sample(1_000_000, 5_000);
    assert_eq!(
        first[0].util_gpu_pct, 95.0,
        "NVML reads the server's GPU busy"
    );
    assert_eq!(
        serving(&first),
        [(Some("l-serve-1".into()), Some(3.0)), (None, None)],
        "the server's requests running and waiting; the GPU without it has no measure"
    );
    for s in &first {
        s.validate().unwrap();
    }

    // No request: the heartbeat kernel keeps utilization up, the server says it serves none.
    *page.lock().unwrap() = Some(vllm_page(0, 0));
    let idle = source.sample(1_005_000, 5_000);
    assert_eq!(idle[0].util_gpu_pct, 95.0);
    assert_eq!(idle[0].serving_requests, Some(0.0));

    // An endpoint that fails gives no value this round (the GPU's own measures judge), and the
    // sample is kept.
    *page.lock().unwrap() = None;
    let failing = source.sample(1_010_000, 5_000);
    assert_eq!(
        serving(&failing),
        [(Some("l-serve-1".into()), None), (None, None)]
    );
    *page.lock().unwrap() = Some(vllm_page(1, 0));
    assert_eq!(
        source.sample(1_015_000, 5_000)[0].serving_requests,
        Some(1.0)
    );
}
