//! The dependency rule (docs/ARCHITECTURE.md#crates-and-the-dependency-rule), read from
//! `cargo metadata`: `schema` depends on no other gpuwarden crate; `collector`, `pipeline` and
//! `enforcer` depend on `schema` only, never on one another; they meet in Kafka, not in code.

use std::collections::BTreeMap;
use std::process::Command;

const ROLES: [&str; 3] = [
    "gpuwarden-collector",
    "gpuwarden-pipeline",
    "gpuwarden-enforcer",
];

#[test]
fn role_crates_never_depend_on_one_another() {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let deps: BTreeMap<String, Vec<String>> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let names = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["name"].as_str().unwrap().to_string())
                .filter(|n| n.starts_with("gpuwarden"))
                .collect();
            (p["name"].as_str().unwrap().to_string(), names)
        })
        .collect();

    for krate in [
        "gpuwarden-schema",
        "gpuwarden-collector",
        "gpuwarden-pipeline",
        "gpuwarden-enforcer",
    ] {
        assert!(
            deps.contains_key(krate),
            "{krate} is missing from the workspace: {deps:?}"
        );
    }
    assert_eq!(
        deps["gpuwarden-schema"],
        Vec::<String>::new(),
        "schema depends on no gpuwarden crate"
    );
    for role in ROLES {
        // Test tools such as gpuwarden-fake-nvml are allowed; another role is not, not even as
        // a dev-dependency.
        let roles: Vec<&String> = deps[role]
            .iter()
            .filter(|d| ROLES.contains(&d.as_str()))
            .collect();
        assert!(
            roles.is_empty(),
            "{role} depends on {roles:?}; roles meet in Kafka topics, not in code"
        );
    }
    // Only the binary may depend on the role crates.
    for (package, its_deps) in &deps {
        if package == "gpuwarden" {
            continue;
        }
        for role in ROLES {
            assert!(
                !its_deps.contains(&role.to_string()),
                "{package} depends on {role}"
            );
        }
    }
}
