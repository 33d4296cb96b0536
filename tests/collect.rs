//! `gpuwarden collect` and `gpuwarden broker` as separate processes meeting over TCP, as in
//! production: the collector samples GPUs through the fake libnvidia-ml.so, kcat (a real Kafka
//! client) reads them back from the broker process, and /metrics serves dcgm-exporter's names.

mod support;

use std::process::Command;
use std::time::Duration;

use support::{eventually, http_get, log_line, metric, start_fake_nvml_collector, Broker, Running};

fn write_config(dir: &std::path::Path, bootstrap: &str) -> std::path::PathBuf {
    let config = dir.join("gpuwarden.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbrokers = \"{bootstrap}\"\npartitions = 3\n\n[collector]\nsource = \"nvml\"\ninterval = \"1s\"\nhost = \"e2e-host\"\n"
        ),
    )
    .unwrap();
    config
}

fn write_script(dir: &std::path::Path) -> std::path::PathBuf {
    let devices: Vec<serde_json::Value> = [0, 1]
        .iter()
        .map(|i| {
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
                "processes": [[]]
            })
        })
        .collect();
    let script = serde_json::json!({ "devices": devices });
    let path = dir.join("nvml.json");
    std::fs::write(&path, script.to_string()).unwrap();
    path
}

#[test]
fn collector_and_broker_processes_meet_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = write_config(dir.path(), &broker.bootstrap);
    let script = write_script(dir.path());

    let (collector, running) = start_fake_nvml_collector(&config, &script);
    let metrics_url = running["metrics"]
        .as_str()
        .expect("the log names the metrics URL")
        .to_string();
    let address = metrics_url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string();
    // 2 GPUs sampled every second: two rounds published within seconds.
    eventually(
        "4 samples published",
        Duration::from_secs(30),
        || match metric(&address, "gpuwarden_collector_samples_published_total") {
            Some(n) if n >= 4.0 => Ok(()),
            n => Err(format!("{n:?}")),
        },
    );

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
    let records: Vec<(&str, serde_json::Value)> = text
        .lines()
        .map(|l| {
            let (key, value) = l.split_once('\t').unwrap();
            (key, serde_json::from_str(value).unwrap())
        })
        .collect();
    assert_eq!(records.len() as u64, published, "{text}");
    for (key, sample) in &records {
        assert_eq!(sample["gpu_uuid"], *key);
        assert_eq!(sample["v"], 1);
        assert_eq!(sample["host"], "e2e-host");
        assert_eq!(sample["power_w"], 200.0);
        assert_eq!(sample["mem_total_bytes"], 48305799168u64);
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
    let config = dir.path().join("sim.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbrokers = \"{}\"\npartitions = 3\n\n[collector]\nsource = \"simulated\"\ninterval = \"5s\"\n\n\
             [[substrates]]\nname = \"sim\"\ndriver = \"simulated\"\n\
             hosts = [{{ prefix = \"h100\", count = 1, gpus = 4, gpu_model = \"NVIDIA H100 80GB HBM3\" }}]\n",
            broker.bootstrap
        ),
    )
    .unwrap();
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
