//! `gpuwarden collect` and `gpuwarden broker` as separate processes meeting over TCP, as in
//! production: the collector samples GPUs through the fake libnvidia-ml.so, kcat (a real Kafka
//! client) reads them back from the broker process, and /metrics serves dcgm-exporter's names.
//! A GPU's processes name its lease, directly or through their Slurm job. A GPU with GPM carries
//! its SM activity, and a GPU in MIG mode is published as its MIG devices.

mod support;

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use support::{
    eventually, http_get, log_line, metric, metrics_address, start_fake_nvml_collector, Broker,
    Config, Running, Substrate, H100,
};

/// The collector on NVML, sampling every second as host `e2e-host`, into the broker.
fn config(bootstrap: &str) -> Config {
    Config::new()
        .broker(bootstrap)
        .raw("[collector]\nsource = \"nvml\"\ninterval = \"1s\"\nhost = \"e2e-host\"\n")
}

fn write_script(dir: &std::path::Path) -> std::path::PathBuf {
    write_script_with_processes(dir, [None, None])
}

/// Two L40S; each GPU runs the process `pid`, if given, in every round.
fn write_script_with_processes(
    dir: &std::path::Path,
    pids: [Option<u32>; 2],
) -> std::path::PathBuf {
    let devices: Vec<serde_json::Value> = [0, 1]
        .iter()
        .map(|&i| {
            let processes: Vec<serde_json::Value> = pids[i]
                .iter()
                .map(|pid| serde_json::json!({"pid": pid, "used_memory_bytes": 1073741824u64}))
                .collect();
            serde_json::json!({
                "uuid": format!("GPU-0000000{i}-1111-2222-3333-444444444444"),
                "name": "NVIDIA L40S",
                "index": i,
                "pci_bus_id": format!("00000000:{:02X}:00.0", 0x17 + i * 0x10),
                "memory_total_bytes": 48305799168u64,
                "memory_used_bytes": [4294967296u64],
                "util_gpu_pct": [55 + i],
                "util_mem_pct": [20],
                "power_mw": [200000],
                "power_limit_mw": 350000,
                "energy_mj": [123456789],
                "temp_c": [55],
                "sm_clock_mhz": [2520],
                "processes": [processes]
            })
        })
        .collect();
    let script = serde_json::json!({ "devices": devices });
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

/// Starts the collector on the fake NVML playing `script` and waits until it has published 4
/// samples: its 2 GPUs sampled every second, two rounds within seconds. Returns it and the
/// address of its `/metrics`.
fn collect_two_rounds(config: &Path, script: &Path) -> (Running, String) {
    let (collector, running) = start_fake_nvml_collector(config, script);
    let address = metrics_address(&running);
    eventually(
        "4 samples published",
        Duration::from_secs(30),
        || match metric(&address, "gpuwarden_collector_samples_published_total") {
            Some(n) if n >= 4.0 => Ok(()),
            n => Err(format!("{n:?}")),
        },
    );
    (collector, address)
}

#[test]
fn collector_and_broker_processes_meet_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = config(&broker.bootstrap).write(dir.path().join("gpuwarden.toml"));
    let script = write_script(dir.path());

    let (collector, address) = collect_two_rounds(&config, &script);

    let (status, body) = http_get(&address, "/metrics");
    assert_eq!(status, 200);
    let expected_labels = "gpu=\"1\",UUID=\"GPU-00000001-1111-2222-3333-444444444444\",pci_bus_id=\"00000000:27:00.0\",device=\"nvidia1\",modelName=\"NVIDIA L40S\",Hostname=\"e2e-host\"";
    for line in [
        format!("DCGM_FI_DEV_GPU_UTIL{{{expected_labels}}} 56"),
        format!("DCGM_FI_DEV_POWER_USAGE{{{expected_labels}}} 200"),
        format!("DCGM_FI_DEV_FB_USED{{{expected_labels}}} 4096"),
        format!("DCGM_FI_DEV_FB_FREE{{{expected_labels}}} 41972"),
        format!("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{expected_labels}}} 123456789"),
        format!("DCGM_FI_DEV_SM_CLOCK{{{expected_labels}}} 2520"),
        format!("DCGM_FI_DEV_GPU_TEMP{{{expected_labels}}} 55"),
        format!("DCGM_FI_DEV_MEM_COPY_UTIL{{{expected_labels}}} 20"),
        "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter".to_string(),
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "/metrics lacks `{line}`:\n{body}"
        );
    }
    assert!(
        body.contains("gpuwarden_collector_samples_published_total"),
        "{body}"
    );
    assert_eq!(http_get(&address, "/healthz").0, 200);

    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(
        status.success(),
        "SIGTERM ends the collector cleanly: {status:?}\n{}",
        log.join("\n")
    );
    let stopped = log_line(&log, "collector stopped");
    let published = stopped["published"].as_u64().unwrap();
    assert_eq!(stopped["dropped"].as_u64(), Some(0));
    assert!(
        published >= 4,
        "at least the 4 /metrics showed before the stop: {published}"
    );

    // kcat, a real Kafka client, reads back exactly what the collector said it published.
    let records = published_samples(&broker.bootstrap);
    assert_eq!(records.len() as u64, published, "{records:#?}");
    for (key, sample) in &records {
        assert_eq!(sample["gpu_uuid"], *key);
        assert_eq!(sample["v"], 1);
        assert_eq!(sample["host"], "e2e-host");
        assert_eq!(sample["power_w"], 200.0);
        assert_eq!(sample["mem_total_bytes"], 48305799168u64);
    }
}

/// Every sample on gpuwarden.samples, with its key, as kcat (a real Kafka client) reads them.
fn published_samples(bootstrap: &str) -> Vec<(String, serde_json::Value)> {
    let out = Command::new("kcat")
        .args([
            "-C",
            "-b",
            bootstrap,
            "-t",
            "gpuwarden.samples",
            "-o",
            "beginning",
            "-e",
            "-q",
            "-f",
            "%k\t%s\n",
        ])
        .output()
        .expect("kcat is installed (.ci/run installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .map(|l| {
            let (key, value) = l.split_once('\t').unwrap();
            (key.to_string(), serde_json::from_str(value).unwrap())
        })
        .collect()
}

/// A process as a Slurm job's would be: only `vars` in its environment (and PATH).
struct JobProcess(Child);

impl JobProcess {
    fn start(vars: &[(&str, &str)]) -> Self {
        let child = Command::new("sleep")
            .arg("60")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(vars.iter().copied())
            .spawn()
            .unwrap();
        // Right after exec the kernel shows an empty environment for a moment: wait it out, so
        // the first sample already finds the job.
        let environ = format!("/proc/{}/environ", child.id());
        let until = Instant::now() + Duration::from_secs(5);
        while !std::fs::read(&environ).is_ok_and(|e| e.windows(12).any(|w| w == b"SLURM_JOB_ID")) {
            assert!(
                Instant::now() < until,
                "the child's environment never showed its job"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Self(child)
    }
}

impl Drop for JobProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn samples_name_the_slurm_job_of_the_gpus_processes() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    // This node's cluster, for a job whose environment does not name its own.
    let config = config(&broker.bootstrap)
        .raw("[collector]\nslurm_cluster = \"e2e\"\n")
        .write(dir.path().join("gpuwarden.toml"));
    // GPU 0: task 1 of array 4242 (run as job 4243) on cluster "study", as Slurm sets it up.
    // GPU 1: job 99, with no SLURM_CLUSTER_NAME.
    let array_task = JobProcess::start(&[
        ("SLURM_ARRAY_JOB_ID", "4242"),
        ("SLURM_ARRAY_TASK_ID", "1"),
        ("SLURM_JOB_ID", "4243"),
        ("SLURM_CLUSTER_NAME", "study"),
    ]);
    let plain_job = JobProcess::start(&[("SLURM_JOB_ID", "99")]);
    let script = write_script_with_processes(
        dir.path(),
        [Some(array_task.0.id()), Some(plain_job.0.id())],
    );

    let (collector, _) = collect_two_rounds(&config, &script);
    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));

    let records = published_samples(&broker.bootstrap);
    assert!(records.len() >= 4, "{records:#?}");
    for (_, sample) in &records {
        let want = match sample["gpu_index"].as_u64() {
            Some(0) => "slurm-study-4242",
            Some(1) => "slurm-e2e-99",
            other => panic!("no GPU {other:?} in the script: {sample}"),
        };
        assert_eq!(sample["lease_id"], want, "{sample}");
        assert_eq!(sample["process_count"], 1, "{sample}");
    }
}

#[test]
fn in_a_virtual_machine_idle_gpus_carry_the_lease_its_smbios_names() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    // The guest's /sys/firmware/dmi/entries: QEMU's OEM Strings structure for the libvirt
    // driver's `<oemStrings>`, the lease after another string.
    let dmi = dir.path().join("dmi");
    std::fs::create_dir_all(dmi.join("11-0")).unwrap();
    std::fs::write(
        dmi.join("11-0/raw"),
        b"\x0b\x05\x00\x0e\x02vendor=acme\0gpuwarden.lease_id=l-vm-e2e\0\0",
    )
    .unwrap();
    let config = config(&broker.bootstrap)
        .raw(&format!(
            "[collector]\ndmi_entries_dir = \"{}\"\n",
            dmi.display()
        ))
        .write(dir.path().join("gpuwarden.toml"));
    // GPU 0 runs a Slurm job inside the guest, which names its own lease; GPU 1 is idle.
    let job = JobProcess::start(&[("SLURM_JOB_ID", "77"), ("SLURM_CLUSTER_NAME", "vmc")]);
    let script = write_script_with_processes(dir.path(), [Some(job.0.id()), None]);

    let (collector, _) = collect_two_rounds(&config, &script);
    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
    let found = log_line(
        &log,
        "this is the virtual machine of a lease, as its SMBIOS OEM strings say: every GPU works \
         for it unless a process or pod names another lease",
    );
    assert_eq!(found["lease_id"], "l-vm-e2e", "{found}");

    let records = published_samples(&broker.bootstrap);
    assert!(records.len() >= 4, "{records:#?}");
    for (_, sample) in &records {
        let (lease, processes) = match sample["gpu_index"].as_u64() {
            Some(0) => ("slurm-vmc-77", 1),
            Some(1) => ("l-vm-e2e", 0),
            other => panic!("no GPU {other:?} in the script: {sample}"),
        };
        assert_eq!(sample["lease_id"], lease, "{sample}");
        assert_eq!(sample["process_count"], processes, "{sample}");
    }
}

#[test]
fn collect_without_a_driver_library_fails_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[collector]\nsource = \"nvml\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args([
            "collect",
            "--config",
            config.to_str().unwrap(),
            "--nvml-library",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "error: cannot load the NVIDIA driver library /nonexistent/libnvidia-ml.so.1"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("--source simulated"), "{stderr}");
}

#[test]
fn the_simulated_fleet_runs_the_leases_it_reads_from_kafka() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = Config::new()
        .broker(&broker.bootstrap)
        .raw("[collector]\nsource = \"simulated\"\ninterval = \"5s\"\n")
        .substrate(Substrate::simulated("sim").hosts("h100", 1, 4, H100))
        .write(dir.path().join("sim.toml"));
    // A lease granted on two GPUs picked by the fleet (no UUIDs), as the enforcer would publish it.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let grant = serde_json::json!({
        "v": 1, "ts_ms": now_ms - 60_000, "event": "granted", "lease_id": "l-sim-1", "team": "research",
        "user": "alice", "project": "llm", "workload": "training", "substrate": "sim",
        "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "gpu_uuids": []
    });
    let mut kcat = Command::new("kcat")
        .args([
            "-P",
            "-b",
            &broker.bootstrap,
            "-t",
            "gpuwarden.leases",
            "-K",
            "\t",
        ])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    writeln!(kcat.stdin.take().unwrap(), "l-sim-1\t{grant}").unwrap();
    assert!(kcat.wait().unwrap().success());

    // 60x: 5 s of event time per ~83 ms of wall time.
    let mut collector = Running::start(
        &[
            "collect",
            "--config",
            config.to_str().unwrap(),
            "--speed",
            "60",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    collector.wait_for_log("collector running", Duration::from_secs(30));
    // The run's length, not a wait for something: about three minutes of event time, in which
    // the fleet reads the lease from Kafka and runs it.
    std::thread::sleep(Duration::from_secs(3));
    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));

    let out = Command::new("kcat")
        .args([
            "-C",
            "-b",
            &broker.bootstrap,
            "-t",
            "gpuwarden.samples",
            "-o",
            "beginning",
            "-e",
            "-q",
        ])
        .output()
        .unwrap();
    let samples: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        samples.len() >= 40,
        "4 GPUs x ~36 rounds: {}",
        samples.len()
    );
    let leased: Vec<&serde_json::Value> = samples
        .iter()
        .filter(|s| s["lease_id"] == "l-sim-1")
        .collect();
    let leased_gpus: std::collections::BTreeSet<&str> = leased
        .iter()
        .map(|s| s["gpu_uuid"].as_str().unwrap())
        .collect();
    assert_eq!(leased_gpus.len(), 2, "the lease runs on exactly two GPUs");
    // The run covers about three minutes of event time starting now, which may fall in one of
    // training's checkpoint dips (the shapes themselves are checked over a day in
    // collector/tests/sim_shapes.rs): check what holds throughout, a running process holding
    // most of the GPU's memory.
    assert!(
        leased.iter().all(|s| s["process_count"] == 1
            && s["mem_used_bytes"].as_f64().unwrap()
                > 0.6 * s["mem_total_bytes"].as_f64().unwrap()),
        "the lease's work runs on its GPUs"
    );
    let free: Vec<&serde_json::Value> = samples
        .iter()
        .filter(|s| !leased_gpus.contains(s["gpu_uuid"].as_str().unwrap()))
        .collect();
    assert!(
        free.iter()
            .all(|s| s["util_gpu_pct"] == 0.0 && s["lease_id"].is_null()),
        "free GPUs stay idle"
    );
}

/// A spinning H100 with GPM (utilization 100 %, SM active 2 %) and an H100 in MIG mode split into
/// three `1g.10gb` and a `3g.40gb`, one slice unused.
fn write_gpm_and_mig_script(dir: &Path) -> std::path::PathBuf {
    let instance = |n: u32, profile: &str, slices: u32| {
        serde_json::json!({
            "uuid": format!("MIG-0000000{n}-aaaa-4bbb-8ccc-dddddddddddd"), "profile": profile,
            "slices": slices, "gpu_instance_id": 7 + n, "memory_total_bytes": 10200547328u64 * u64::from(slices),
            "memory_used_bytes": 0, "processes": [[]]
        })
    };
    let script = serde_json::json!({"devices": [
        {
            "uuid": "GPU-00000000-1111-2222-3333-444444444444", "name": "NVIDIA H100 80GB HBM3",
            "index": 0, "pci_bus_id": "00000000:17:00.0",
            "memory_total_bytes": 85520809984u64, "memory_used_bytes": [1073741824u64],
            "util_gpu_pct": 100, "util_mem_pct": 1, "power_mw": 150000, "processes": [[]],
            "gpm": {"sm_util": 2, "sm_occupancy": 1, "graphics_util": 100, "any_tensor_util": 0,
                    "dram_bw_util": 1}
        },
        {
            "uuid": "GPU-00000001-1111-2222-3333-444444444444", "name": "NVIDIA H100 80GB HBM3",
            "index": 1, "pci_bus_id": "00000000:27:00.0",
            "memory_total_bytes": 85520809984u64, "memory_used_bytes": 0,
            "power_mw": 210000, "energy_mj": 7000000, "gpm": {},
            "mig": {"enabled": true, "slices": 7, "instances": [
                instance(0, "1g.10gb", 1), instance(1, "1g.10gb", 1),
                instance(2, "1g.10gb", 1), instance(3, "3g.40gb", 3)
            ]}
        }
    ]});
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

#[test]
fn sm_activity_and_mig_devices_reach_metrics_and_kafka() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = config(&broker.bootstrap).write(dir.path().join("gpuwarden.toml"));
    let script = write_gpm_and_mig_script(dir.path());
    let (collector, running) = start_fake_nvml_collector(&config, &script);
    let address = metrics_address(&running);
    // Each round: the H100, 4 MIG devices and the unsliced rest.
    eventually(
        "two rounds published",
        Duration::from_secs(30),
        || match metric(&address, "gpuwarden_collector_samples_published_total") {
            Some(n) if n >= 12.0 => Ok(()),
            n => Err(format!("{n:?}")),
        },
    );
    let (status, body) = http_get(&address, "/metrics");
    assert_eq!(status, 200);
    for line in [
        "DCGM_FI_PROF_SM_ACTIVE{gpu=\"0\",UUID=\"GPU-00000000-1111-2222-3333-444444444444\",pci_bus_id=\"00000000:17:00.0\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"e2e-host\"} 0.02",
        "DCGM_FI_DEV_POWER_USAGE{gpu=\"1\",UUID=\"GPU-00000001-1111-2222-3333-444444444444\",pci_bus_id=\"00000000:27:00.0\",device=\"nvidia1\",modelName=\"NVIDIA H100 80GB HBM3\",GPU_I_PROFILE=\"3g.40gb\",Hostname=\"e2e-host\",mig_uuid=\"MIG-00000003-aaaa-4bbb-8ccc-dddddddddddd\"} 90",
        "DCGM_FI_DEV_POWER_USAGE{gpu=\"1\",UUID=\"GPU-00000001-1111-2222-3333-444444444444\",pci_bus_id=\"00000000:27:00.0\",device=\"nvidia1\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"e2e-host\"} 30",
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "/metrics lacks `{line}`:\n{body}"
        );
    }

    let (status, log) = collector.terminate(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
    let records = published_samples(&broker.bootstrap);
    let of = |uuid: &str| -> Vec<&serde_json::Value> {
        records
            .iter()
            .filter(|(key, _)| key == uuid)
            .map(|(_, s)| s)
            .collect()
    };
    let spinning = of("GPU-00000000-1111-2222-3333-444444444444");
    assert!(spinning.iter().all(|s| s["util_gpu_pct"] == 100.0));
    assert_eq!(
        spinning[0].get("sm_active_pct"),
        None,
        "no interval before the first sample"
    );
    assert!(spinning[1..].iter().all(|s| s["sm_active_pct"] == 2.0));
    let slice = of("MIG-00000003-aaaa-4bbb-8ccc-dddddddddddd");
    assert!(slice.len() >= 2);
    for s in &slice {
        assert_eq!(
            s["mig_parent_uuid"],
            "GPU-00000001-1111-2222-3333-444444444444"
        );
        assert_eq!(s["mig_profile"], "3g.40gb");
        assert_eq!(
            (s["mig_slices"].as_u64(), s["mig_parent_slices"].as_u64()),
            (Some(3), Some(7))
        );
        assert_eq!(s["gpu_model"], "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
        assert_eq!(s["util_gpu_pct"], 0.0, "no process on it");
    }
    let rest = of("GPU-00000001-1111-2222-3333-444444444444");
    assert_eq!(rest.len(), slice.len(), "the unsliced rest, once a round");
    for s in &rest {
        assert_eq!(s["mig_slices"], 1, "the one slice no MIG device holds");
        assert_eq!(s["mig_parent_slices"], 7);
        assert!(s["mig_profile"].is_null() && s["lease_id"].is_null(), "{s}");
        assert_eq!(s["util_gpu_pct"], 0.0);
    }
}
