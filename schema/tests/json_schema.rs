//! The committed JSON Schemas under `schema/json/` are what the Rust types generate. After a
//! deliberate contract change, rewrite them with `GPUWARDEN_BLESS=1 cargo test -p gpuwarden-schema`.

use std::path::PathBuf;

use gpuwarden_schema::json_schema::documents;

#[test]
fn committed_json_schemas_match_the_types() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("json");
    let bless = std::env::var_os("GPUWARDEN_BLESS").is_some();
    let mut drifted = Vec::new();
    for (name, generated) in documents() {
        let path = dir.join(name);
        if bless {
            std::fs::write(&path, &generated).unwrap();
            continue;
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        if committed != generated {
            drifted.push(name);
        }
    }
    assert!(
        drifted.is_empty(),
        "{drifted:?} differ from the types; if the contract change is deliberate, run \
         `GPUWARDEN_BLESS=1 cargo test -p gpuwarden-schema --test json_schema` and commit the result"
    );
}

#[test]
fn schemas_state_the_contract_rules() {
    let docs = documents();
    let sample: serde_json::Value = serde_json::from_str(&docs[0].1).unwrap();
    let props = &sample["properties"];
    assert_eq!(props["v"]["const"], 1);
    assert_eq!(props["util_gpu_pct"]["minimum"], 0.0);
    assert_eq!(props["util_gpu_pct"]["maximum"], 100.0);
    assert_eq!(props["interval_ms"]["minimum"], 1);
    assert_eq!(props["interval_ms"]["maximum"], 3_600_000);
    let required: Vec<&str> = sample["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for field in [
        "v",
        "ts_ms",
        "interval_ms",
        "host",
        "gpu_uuid",
        "gpu_model",
        "util_gpu_pct",
        "mem_used_bytes",
        "mem_total_bytes",
    ] {
        assert!(
            required.contains(&field),
            "{field} not required: {required:?}"
        );
    }
    assert!(!required.contains(&"power_w"));
    let signal: serde_json::Value = serde_json::from_str(&docs[2].1).unwrap();
    let text = signal.to_string();
    for kind in ["lease_utilization", "gpu_unattributed", "team_spend"] {
        assert!(text.contains(kind), "signal schema lacks kind {kind}");
    }
}
