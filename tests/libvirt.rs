//! `gpuwarden enforce` with a libvirt substrate (built with `--features libvirt`): leases asked
//! for with the CLI become virtual machines on libvirt's test hypervisor, which lives inside the
//! enforcer's process (`test:///default`), so what the driver did is read from the enforcer's
//! log and the API. The driver's own tests (`enforcer/tests/libvirt.rs`) read the domains back
//! through libvirt and run a real QEMU.

#![cfg(feature = "libvirt")]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use support::{sha256_hex, Broker, Running};

const TOKEN: &str = "libvirt-test-token";
const H100: &str = "NVIDIA H100 80GB HBM3";

fn write_config(dir: &Path, bootstrap: &str) -> PathBuf {
    let template = dir.join("gpu-vm.xml");
    std::fs::write(
        &template,
        "<domain type='test'><name>{{name}}</name><memory unit='MiB'>64</memory>\
         <os><type>hvm</type></os><devices/></domain>",
    )
    .unwrap();
    let path = dir.join("gpuwarden.toml");
    std::fs::write(
        &path,
        format!(
            r#"[kafka]
brokers = "{bootstrap}"
partitions = 3

[storage]
data_dir = "{data}"

[[teams]]
name = "ml"
members = ["ada"]
gpu_quota = 4
monthly_budget_usd = 100000.0

[workloads.training]
max_gpus = 4
max_duration = "24h"
substrates = ["vm-host-1"]

[enforcer]
listen = "127.0.0.1:0"

[[substrates]]
name = "vm-host-1"
driver = "libvirt"
[substrates.libvirt]
uri = "test:///default"
domain_template = "{template}"
grace_period = "1s"
gpus = [
  {{ pci = "0000:41:00.0", model = "{H100}" }},
  {{ pci = "0000:42:00.0", model = "{H100}" }},
]

[[tokens]]
name = "ada"
sha256 = "{hash}"
role = "member"
teams = ["ml"]
"#,
            data = dir.join("data").display(),
            template = template.display(),
            hash = sha256_hex(TOKEN),
        ),
    )
    .unwrap();
    path
}

fn cli(api: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(args)
        .env("GPUWARDEN_API", api)
        .env("GPUWARDEN_TOKEN", TOKEN)
        .env("GPUWARDEN_USER", "ada")
        .output()
        .expect("runs gpuwarden")
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn request(api: &str, gpus: &str) -> Output {
    cli(
        api,
        &[
            "request",
            "--team",
            "ml",
            "--workload",
            "training",
            "--gpus",
            gpus,
            "--model",
            H100,
            "--env",
            "--wait",
        ],
    )
}

fn lease_id(output: &Output) -> String {
    assert_eq!(output.status.code(), Some(0), "{}", text(output));
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("export GPUWARDEN_LEASE_ID="))
        .unwrap_or_else(|| panic!("no lease id in\n{}", text(output)))
        .trim_matches('\'')
        .to_owned()
}

#[test]
fn leases_on_a_libvirt_substrate_are_virtual_machines_started_and_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = write_config(dir.path(), &broker.bootstrap);
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_owned();

    let first = lease_id(&request(&api, "1"));
    let started = enforcer.wait_for_log(
        "started the lease's virtual machine",
        Duration::from_secs(30),
    );
    assert_eq!(started["domain"], format!("gpuwarden-{first}"), "{started}");

    // One of the host's two GPUs is held: two more do not fit, and the answer says why.
    let denied = request(&api, "2");
    assert_eq!(denied.status.code(), Some(3), "{}", text(&denied));
    assert!(text(&denied).contains("no_capacity"), "{}", text(&denied));

    let released = cli(&api, &["release", &first]);
    assert_eq!(released.status.code(), Some(0), "{}", text(&released));
    let reclaimed = enforcer.wait_for_log(
        "reclaimed the lease's virtual machine",
        Duration::from_secs(30),
    );
    assert_eq!(
        reclaimed["domain"],
        format!("gpuwarden-{first}"),
        "{reclaimed}"
    );

    // Both GPUs free again: one VM with two of them.
    let second = lease_id(&request(&api, "2"));
    let started = enforcer.wait_for_log(
        "started the lease's virtual machine",
        Duration::from_secs(30),
    );
    assert_eq!(
        started["domain"],
        format!("gpuwarden-{second}"),
        "{started}"
    );
    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
}
