//! The enforcer's OpenAPI document, held to what the server does: schemathesis (pinned in
//! tests/requirements.txt) reads `/openapi.json` from a running `gpuwarden enforce` and sends it
//! requests the document allows and requests it rules out, with every check it has. Among them:
//! a request the document allows must not be refused as malformed (422), one it rules out must
//! be refused, every status answered must be documented with its body, and every body must match
//! its schema. The stateful phase follows the document's links from an admission to the lease's
//! own operations (read, extend, resize, exempt, release).
//!
//! Passing output is printed (the CI log shows how many cases were generated): see
//! .config/nextest.toml. Needs schemathesis: `GPUWARDEN_PYTHON` (set by .ci/run) names the
//! Python of a venv that has it.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::{http, Broker, Config, Running, Substrate, Team, Workload, H100};

const ADMIN_TOKEN: &str = "schemathesis-admin-token";

/// The schemathesis command beside the tests' Python (GPUWARDEN_PYTHON).
fn schemathesis() -> PathBuf {
    let python = support::venv_python("schemathesis", "import schemathesis");
    Path::new(&python)
        .parent()
        .expect("GPUWARDEN_PYTHON is a path")
        .join("schemathesis")
}

/// Two teams (one with a small budget), every workload on a simulated fleet of 32 H100s and 16
/// L40S, and an admin token, so that admissions succeed, are denied for quota, budget and
/// capacity, and leases can be followed through every operation.
fn write_config(dir: &Path, bootstrap: &str) -> PathBuf {
    Config::new()
        .broker(bootstrap)
        .data_dir(&dir.join("data"))
        .team(Team::new("research", 24, 50000.0).members(&["alice", "bob"]))
        .team(
            Team::new("analytics", 4, 10.0)
                .members(&["carol"])
                .allowed_models(&["L40S"]),
        )
        .workload(Workload::new("training").max_gpus(8).max_duration("72h"))
        .workload(Workload::new("inference").max_gpus(4))
        .workload(Workload::new("notebook").max_gpus(1).max_duration("8h"))
        .workload(Workload::new("batch").max_gpus(4).max_duration("24h"))
        .enforcer()
        // Schemathesis sends wrong tokens on purpose (its authentication checks), from one
        // address: too many to ever lock it out, so that every answer is the one its check
        // expects.
        .raw(
            r#"
[enforcer]
max_request_bytes = 16384
login_limits = { max_failures = 1000000, max_failures_per_source = 1000000 }
"#,
        )
        .substrate(
            Substrate::simulated("sim")
                .hosts("h100-", 4, 8, H100)
                .hosts("l40s-", 2, 8, "NVIDIA L40S"),
        )
        .token("root", ADMIN_TOKEN, "admin", &[])
        .write(dir.join("gpuwarden.toml"))
}

#[test]
fn schemathesis_finds_the_server_as_its_openapi_document_says() {
    let schemathesis = schemathesis();
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = write_config(dir.path(), &broker.bootstrap);
    let mut enforcer = Running::start(&["enforce", "--config", config.to_str().unwrap()], &[]);
    let line = enforcer.wait_for_log("enforcer running", Duration::from_secs(60));
    let api = line["api"].as_str().expect("the api field").to_string();

    let junit = dir.path().join("schemathesis-junit.xml");
    let settings = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/schemathesis/schemathesis.toml"
    );
    let out = Command::new(&schemathesis)
        .args(["--config-file", settings, "--no-color"])
        .args(["run", &format!("{api}/openapi.json")])
        .args(["--checks", "all"])
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        .args(["--header", &format!("Authorization: Bearer {ADMIN_TOKEN}")])
        .args(["--max-examples", "100", "--seed", "20261203"])
        .args(["--workers", "2", "--request-timeout", "10"])
        .args(["--report", "junit", "--report-junit-path"])
        .arg(&junit)
        .current_dir(dir.path())
        .output()
        .expect("runs schemathesis");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    // What the stateful phase left behind: leases it followed from admission to release.
    let address = api.trim_start_matches("http://");
    let released = http(
        address,
        "GET",
        "/v1/leases?state=released",
        Some(ADMIN_TOKEN),
        None,
    );
    let (status, log) = enforcer.terminate(Duration::from_secs(30));
    assert!(
        out.status.success(),
        "schemathesis found the server and its document apart (exit {:?}); the enforcer's log:\n{}",
        out.status.code(),
        log.join("\n")
    );
    assert!(
        status.success(),
        "the enforcer did not stop cleanly: {status:?}"
    );

    // It ran what it says: cases were generated, the stateful phase followed links, and leases
    // went from admission to release through them.
    let junit = std::fs::read_to_string(&junit).expect("a junit report");
    assert!(junit.contains("<testcase"), "{junit}");
    let count = |label: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(label))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("schemathesis printed no {label:?} line"))
    };
    assert!(
        count("API Links:") > 0,
        "the stateful phase covered no link"
    );
    let generated = text
        .lines()
        .find(|l| l.contains(" generated, "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .expect("schemathesis reports how many cases it generated");
    assert!(generated > 0, "schemathesis generated no case");
    assert_eq!(released.0, 200, "{}", released.1);
    let released: Vec<serde_json::Value> = serde_json::from_str(&released.1).unwrap();
    assert!(
        !released.is_empty(),
        "no lease was released: the stateful phase never followed an admission to its release"
    );
}
