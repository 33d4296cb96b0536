//! The v1 records against docs/src/contributors/records.md: every invalid case is rejected
//! with a reason naming its field, valid records survive JSON and Arrow round trips unchanged,
//! and no bytes make the decoder panic.

use std::collections::BTreeMap;

use gpuwarden_schema::signal::JudgedBy;
use gpuwarden_schema::{
    Action, ActionKind, DecodeError, LeaseEvent, LeaseEventKind, Outcome, Record, ReleaseReason,
    Sample, Signal, SignalBody, Workload, V1,
};
use proptest::prelude::*;
use serde_json::{json, Value};

fn sample_json() -> Value {
    json!({
        "v": 1, "ts_ms": 1_767_225_600_000i64, "interval_ms": 5000, "host": "node-1",
        "gpu_uuid": "GPU-1", "gpu_model": "NVIDIA H100 80GB HBM3", "util_gpu_pct": 87.5,
        "mem_used_bytes": 1024, "mem_total_bytes": 85_520_809_984u64
    })
}

fn decode_sample(value: &Value) -> Result<Sample, DecodeError> {
    Sample::from_json(value.to_string().as_bytes())
}

fn field_of(err: &DecodeError) -> &str {
    err.field()
        .unwrap_or_else(|| panic!("error names no field: {err}"))
}

#[test]
fn minimal_sample_decodes_with_optional_fields_null() {
    let sample = decode_sample(&sample_json()).unwrap();
    assert_eq!(sample.util_gpu_pct, 87.5);
    assert_eq!(sample.power_w, None);
    assert_eq!(sample.labels, None);
    let back: Value = serde_json::from_slice(&sample.to_json()).unwrap();
    assert_eq!(
        back["power_w"],
        Value::Null,
        "optional fields are written as null"
    );
    assert_eq!(back["v"], json!(1));
}

#[test]
fn every_missing_required_sample_field_is_named() {
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
        let mut value = sample_json();
        value.as_object_mut().unwrap().remove(field);
        let err = decode_sample(&value).unwrap_err();
        assert_eq!(field_of(&err), field, "{err}");
        assert!(err.to_string().contains("missing"), "{err}");
    }
}

#[test]
fn every_wrong_typed_sample_field_is_named() {
    let wrong: [(&str, Value); 10] = [
        ("ts_ms", json!("yesterday")),
        ("ts_ms", json!(1.5)),
        ("interval_ms", json!(true)),
        ("host", json!(7)),
        ("gpu_uuid", json!(null)),
        ("util_gpu_pct", json!("high")),
        ("mem_used_bytes", json!(-1)),
        ("mem_total_bytes", json!([1])),
        ("power_w", json!("300W")),
        ("labels", json!({"k8s_pod": 3})),
    ];
    for (field, bad) in wrong {
        let mut value = sample_json();
        value[field] = bad.clone();
        let err = decode_sample(&value).unwrap_err();
        assert!(field_of(&err).starts_with(field), "{field} = {bad}: {err}");
    }
}

#[test]
fn sample_range_rules() {
    let cases: [(&str, Value, &str); 6] = [
        ("util_gpu_pct", json!(100.5), "outside 0..=100"),
        ("util_gpu_pct", json!(-0.1), "outside 0..=100"),
        ("interval_ms", json!(0), "outside 1..=3600000"),
        ("interval_ms", json!(3_600_001), "outside 1..=3600000"),
        ("interval_ms", json!(-5000), "outside 1..=3600000"),
        (
            "mem_used_bytes",
            json!(85_520_809_985u64),
            "more than mem_total_bytes",
        ),
    ];
    for (field, bad, reason) in cases {
        let mut value = sample_json();
        value[field] = bad.clone();
        let err = decode_sample(&value).unwrap_err();
        assert_eq!(field_of(&err), field, "{field} = {bad}: {err}");
        assert!(err.to_string().contains(reason), "{field} = {bad}: {err}");
    }
    // The bounds themselves are valid.
    for (field, edge) in [
        ("util_gpu_pct", json!(0)),
        ("util_gpu_pct", json!(100)),
        ("interval_ms", json!(1)),
        ("interval_ms", json!(3_600_000)),
    ] {
        let mut value = sample_json();
        value[field] = edge;
        decode_sample(&value).unwrap();
    }
}

#[test]
fn version_other_than_1_is_refused_by_name() {
    let mut value = sample_json();
    value["v"] = json!(2);
    let err = decode_sample(&value).unwrap_err();
    assert_eq!(field_of(&err), "v");
    assert!(
        err.to_string().contains("unsupported contract version 2"),
        "{err}"
    );
}

#[test]
fn bytes_that_are_not_a_record_are_json_or_shape_errors() {
    for bad in [&b""[..], b"{", b"not json", b"{\"v\":1,", b"\xff\xfe"] {
        match Sample::from_json(bad) {
            Err(DecodeError::Json { .. }) => {}
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bad)),
        }
    }
    // serde would happily read a struct from an array by position; records are objects.
    let positional: Vec<Value> = sample_json()
        .as_object()
        .unwrap()
        .values()
        .cloned()
        .collect();
    let mut positional = positional;
    positional.extend(std::iter::repeat_n(Value::Null, 12));
    assert!(matches!(
        Sample::from_json(Value::Array(positional).to_string().as_bytes()),
        Err(DecodeError::Shape { .. })
    ));
    let mut trailing = sample_json().to_string().into_bytes();
    trailing.extend_from_slice(b" {}");
    assert!(
        matches!(Sample::from_json(&trailing), Err(DecodeError::Json { .. })),
        "trailing bytes after a record"
    );
    for bad in [&b"[1,2]"[..], b"\"sample\"", b"42", b"null"] {
        match Sample::from_json(bad) {
            Err(DecodeError::Shape {
                record: "sample", ..
            }) => {}
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bad)),
        }
    }
}

fn lease_json() -> Value {
    json!({
        "v": 1, "ts_ms": 1_767_225_600_000i64, "event": "granted", "lease_id": "l-1",
        "team": "research", "user": "alice", "project": "llm", "workload": "training",
        "substrate": "sim", "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 2,
        "gpu_uuids": ["GPU-1", "GPU-2"]
    })
}

#[test]
fn lease_event_rules() {
    let ok = LeaseEvent::from_json(lease_json().to_string().as_bytes()).unwrap();
    assert_eq!(ok.workload, Workload::Training);
    let cases: [(&str, Value, &str); 6] = [
        ("event", json!("stolen"), "unknown variant"),
        ("workload", json!("gaming"), "unknown variant"),
        ("gpu_count", json!(0), "at least 1"),
        ("gpu_uuids", json!(["GPU-1"]), "gpu_count is 2"),
        ("reason", json!("idle"), "only released events"),
        ("team", json!(""), "must not be empty"),
    ];
    for (field, bad, reason) in cases {
        let mut value = lease_json();
        value[field] = bad.clone();
        let err = LeaseEvent::from_json(value.to_string().as_bytes()).unwrap_err();
        assert_eq!(field_of(&err), field, "{field} = {bad}: {err}");
        assert!(err.to_string().contains(reason), "{field} = {bad}: {err}");
    }
    let mut released = lease_json();
    released["event"] = json!("released");
    let err = LeaseEvent::from_json(released.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "reason");
    released["reason"] = json!("idle");
    let event = LeaseEvent::from_json(released.to_string().as_bytes()).unwrap();
    assert_eq!(event.reason, Some(ReleaseReason::Idle));
    // The substrate may pick devices itself: no UUIDs at all is valid.
    let mut no_uuids = lease_json();
    no_uuids.as_object_mut().unwrap().remove("gpu_uuids");
    assert!(LeaseEvent::from_json(no_uuids.to_string().as_bytes())
        .unwrap()
        .gpu_uuids
        .is_empty());
}

#[test]
fn signal_kinds_require_their_own_fields() {
    let spend = json!({"v": 1, "ts_ms": 10, "kind": "team_spend", "window_ms": 900000,
        "team": "research", "month_to_date_usd": 12.5, "burn_usd_per_hour": 3.0});
    let signal = Signal::from_json(spend.to_string().as_bytes()).unwrap();
    assert_eq!(
        signal.body,
        SignalBody::TeamSpend {
            team: "research".into(),
            month_to_date_usd: 12.5,
            burn_usd_per_hour: 3.0
        }
    );
    let mut missing = spend.clone();
    missing.as_object_mut().unwrap().remove("burn_usd_per_hour");
    let err = Signal::from_json(missing.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "burn_usd_per_hour", "{err}");
    assert!(
        err.to_string().contains("required for kind team_spend"),
        "{err}"
    );

    let skew = json!({"v": 1, "ts_ms": 10, "kind": "clock_skew", "window_ms": 30000,
        "host": "node-7", "skew_ms": 34_560_000_000i64});
    assert_eq!(
        Signal::from_json(skew.to_string().as_bytes()).unwrap().body,
        SignalBody::ClockSkew {
            host: "node-7".into(),
            skew_ms: 34_560_000_000
        }
    );
    let mut no_skew = skew.clone();
    no_skew.as_object_mut().unwrap().remove("skew_ms");
    let err = Signal::from_json(no_skew.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "skew_ms", "{err}");

    let util = json!({"v": 1, "ts_ms": 10, "kind": "lease_utilization", "window_ms": 900000,
        "lease_id": "l-1", "team": "t", "util_pct": 101, "idle_ms": 0, "gpus_active": 1,
        "gpus_total": 2, "mem_used_max_bytes": 5});
    let err = Signal::from_json(util.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "util_pct", "{err}");
    let mut bad_kind = util.clone();
    bad_kind["kind"] = json!("vibes");
    let err = Signal::from_json(bad_kind.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "kind", "{err}");
}

#[test]
fn action_needs_a_subject_unless_it_is_an_alert() {
    let mut action = json!({"v": 1, "ts_ms": 10, "action": "reclaim", "lease_id": null,
        "team": null, "reason": "idle", "policy": "workloads.notebook.idle_timeout",
        "driver": "simulated", "outcome": "ok", "detail": "idle for 30m"});
    let err = Action::from_json(action.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "lease_id");
    action["action"] = json!("alert");
    Action::from_json(action.to_string().as_bytes()).unwrap();
    action["outcome"] = json!("maybe");
    let err = Action::from_json(action.to_string().as_bytes()).unwrap_err();
    assert_eq!(field_of(&err), "outcome");
}

#[test]
fn keys_keep_related_records_in_one_partition() {
    let sample = decode_sample(&sample_json()).unwrap();
    assert_eq!(sample.key(), "GPU-1");
    let lease = LeaseEvent::from_json(lease_json().to_string().as_bytes()).unwrap();
    assert_eq!(lease.key(), "l-1");
    assert_eq!(Sample::TOPIC, "gpuwarden.samples");
    assert_eq!(LeaseEvent::TOPIC, "gpuwarden.leases");
    assert_eq!(Signal::TOPIC, "gpuwarden.signals");
    assert_eq!(Action::TOPIC, "gpuwarden.actions");
}

/// A sample written before v1 gained GPM and MIG fields is still valid, and a lake batch
/// written then (without their columns) still reads, with the new fields null.
#[test]
fn samples_from_before_gpm_and_mig_still_read() {
    let json = br#"{"v":1,"ts_ms":5000,"interval_ms":5000,"host":"h","gpu_uuid":"GPU-1","gpu_model":"NVIDIA A100","util_gpu_pct":42.0,"mem_used_bytes":1,"mem_total_bytes":2}"#;
    let sample = Sample::from_json(json).unwrap();
    assert_eq!((sample.sm_active_pct, sample.mig_slices), (None, None));
    assert!(!String::from_utf8(sample.to_json())
        .unwrap()
        .contains("sm_active_pct"));

    let batch = Sample::to_record_batch(std::slice::from_ref(&sample)).unwrap();
    // The first v1's columns end with `labels`; every later one is an optional addition.
    let labels = batch.schema().index_of("labels").unwrap();
    assert_eq!(labels, 20);
    let old_columns: Vec<usize> = (0..=labels).collect();
    let old = batch.project(&old_columns).unwrap();
    assert_eq!(Sample::from_record_batch(&old).unwrap(), vec![sample]);
}

/// Each GPM measure is a percentage and a MIG slice is at most its parent.
#[test]
fn gpm_and_mig_fields_are_checked() {
    let base = r#""v":1,"ts_ms":5000,"interval_ms":5000,"host":"h","gpu_uuid":"MIG-1","gpu_model":"m","util_gpu_pct":0,"mem_used_bytes":1,"mem_total_bytes":2"#;
    for (extra, field) in [
        (r#""sm_active_pct":100.5"#, "sm_active_pct"),
        (r#""dram_active_pct":-1"#, "dram_active_pct"),
        (r#""mig_slices":0"#, "mig_slices"),
        (r#""mig_slices":3,"mig_parent_slices":2"#, "mig_slices"),
        (r#""serving_requests":-1"#, "serving_requests"),
    ] {
        let json = format!("{{{base},{extra}}}");
        let err = Sample::from_json(json.as_bytes()).unwrap_err().to_string();
        assert!(err.contains(field), "{extra}: {err}");
        let row = gpuwarden_schema::sample_row::SampleRow::from_json(json.as_bytes());
        assert_eq!(row.unwrap_err().to_string(), err);
    }
    let json = format!(
        r#"{{{base},"sm_active_pct":2.5,"mig_parent_uuid":"GPU-p","mig_slices":1,"mig_parent_slices":7}}"#
    );
    let sample = Sample::from_json(json.as_bytes()).unwrap();
    assert_eq!(sample.sm_active_pct, Some(2.5));
    assert_eq!(sample.mig_parent_uuid.as_deref(), Some("GPU-p"));
}

// ---- property tests ----------------------------------------------------------------------

fn name() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_.:-]{1,24}"
}

fn labels() -> impl Strategy<Value = Option<BTreeMap<String, String>>> {
    proptest::option::of(proptest::collection::btree_map(
        "[a-z_]{1,12}",
        ".{0,16}",
        0..4,
    ))
}

fn finite(lo: f64, hi: f64) -> impl Strategy<Value = f64> {
    prop_oneof![Just(lo), Just(hi), lo..=hi]
}

prop_compose! {
    fn arb_sample()(
        ts_ms in 0i64..4_102_444_800_000, interval_ms in 1i64..=3_600_000,
        host in name(), gpu_uuid in name(), gpu_model in ".{1,32}", util in finite(0.0, 100.0),
        total in 0u64..=i64::MAX as u64, used_frac in 0.0f64..=1.0,
        gpu_index in proptest::option::of(any::<u32>()), pci in proptest::option::of(name()),
        util_mem in proptest::option::of(finite(0.0, 100.0)), power in proptest::option::of(finite(0.0, 1000.0)),
        limit in proptest::option::of(finite(0.0, 1000.0)), energy in proptest::option::of(0u64..=i64::MAX as u64),
        temp in proptest::option::of(finite(-20.0, 120.0)), clock in proptest::option::of(any::<u32>()),
        procs in proptest::option::of(any::<u32>()), lease in proptest::option::of(name()),
        mig in proptest::option::of(name()), labels in labels(),
    ) -> Sample {
        Sample {
            v: V1, ts_ms, interval_ms, host, gpu_uuid, gpu_model, util_gpu_pct: util,
            mem_used_bytes: (total as f64 * used_frac) as u64 / 2, mem_total_bytes: total,
            gpu_index, pci_bus_id: pci, util_mem_pct: util_mem, power_w: power, power_limit_w: limit,
            energy_mj: energy, temp_c: temp, sm_clock_mhz: clock, process_count: procs,
            lease_id: lease, mig_profile: mig, labels,
            sm_active_pct: None, sm_occupancy_pct: None, tensor_active_pct: None,
            dram_active_pct: None, gr_active_pct: None, mig_parent_uuid: None, mig_slices: None,
            mig_parent_slices: None, serving_requests: None,
        }
    }
}

prop_compose! {
    /// A sample with the fields v1 gained later (GPM measures, MIG slices) set or not.
    fn arb_sample_with_extras()(
        sample in arb_sample(),
        gpm in proptest::array::uniform5(proptest::option::of(finite(0.0, 100.0))),
        parent in proptest::option::of(name()),
        slices in proptest::option::of((1u32..=7).prop_flat_map(|s| (Just(s), s..=8))),
        serving in proptest::option::of(finite(0.0, 1e6)),
    ) -> Sample {
        let [sm_active_pct, sm_occupancy_pct, tensor_active_pct, dram_active_pct, gr_active_pct] = gpm;
        Sample {
            sm_active_pct, sm_occupancy_pct, tensor_active_pct, dram_active_pct, gr_active_pct,
            mig_parent_uuid: parent,
            mig_slices: slices.map(|(s, _)| s),
            mig_parent_slices: slices.map(|(_, p)| p),
            serving_requests: serving,
            ..sample
        }
    }
}

fn arb_lease() -> impl Strategy<Value = LeaseEvent> {
    let kind = prop_oneof![
        Just(LeaseEventKind::Granted),
        Just(LeaseEventKind::Resized),
        Just(LeaseEventKind::Released)
    ];
    let workload = prop_oneof![
        Just(Workload::Training),
        Just(Workload::Inference),
        Just(Workload::Notebook),
        Just(Workload::Batch)
    ];
    let reason = prop_oneof![
        Just(ReleaseReason::User),
        Just(ReleaseReason::Expired),
        Just(ReleaseReason::Idle),
        Just(ReleaseReason::Budget),
        Just(ReleaseReason::Admin),
        Just(ReleaseReason::Failed)
    ];
    (
        (any::<i64>(), kind, name(), name(), ".{0,12}", ".{0,12}"),
        (
            workload,
            name(),
            ".{1,32}",
            1u32..64,
            any::<bool>(),
            labels(),
            reason,
        ),
    )
        .prop_map(
            |(
                (ts_ms, event, lease_id, team, user, project),
                (workload, substrate, gpu_model, gpu_count, with_uuids, labels, reason),
            )| {
                LeaseEvent {
                    v: V1,
                    ts_ms,
                    event,
                    lease_id,
                    team,
                    user,
                    project,
                    workload,
                    substrate,
                    gpu_model,
                    gpu_count,
                    gpu_uuids: if with_uuids {
                        (0..gpu_count).map(|i| format!("GPU-{i}")).collect()
                    } else {
                        Vec::new()
                    },
                    labels,
                    reason: (event == LeaseEventKind::Released).then_some(reason),
                }
            },
        )
}

fn arb_signal() -> impl Strategy<Value = Signal> {
    let body = prop_oneof![
        (
            name(),
            name(),
            finite(0.0, 100.0),
            0i64..i64::MAX,
            0u32..8,
            8u32..16,
            0u64..=i64::MAX as u64,
            proptest::option::of(finite(0.0, 100.0)),
            proptest::option::of(prop_oneof![
                Just(JudgedBy::Util),
                Just(JudgedBy::SmActive),
                Just(JudgedBy::Mixed)
            ]),
        )
            .prop_map(
                |(
                    lease_id,
                    team,
                    util_pct,
                    idle_ms,
                    gpus_active,
                    gpus_total,
                    mem_used_max_bytes,
                    sm_active_pct,
                    idle_measure,
                )| SignalBody::LeaseUtilization {
                    lease_id,
                    team,
                    util_pct,
                    idle_ms,
                    gpus_active,
                    gpus_total,
                    mem_used_max_bytes,
                    sm_active_pct,
                    idle_measure,
                }
            ),
        (name(), name(), finite(0.0, 100.0)).prop_map(|(gpu_uuid, host, util_pct)| {
            SignalBody::GpuUnattributed {
                gpu_uuid,
                host,
                util_pct,
            }
        }),
        (name(), finite(0.0, 1e9), finite(0.0, 1e6)).prop_map(
            |(team, month_to_date_usd, burn_usd_per_hour)| SignalBody::TeamSpend {
                team,
                month_to_date_usd,
                burn_usd_per_hour
            }
        ),
        (name(), any::<i64>()).prop_map(|(host, skew_ms)| SignalBody::ClockSkew { host, skew_ms }),
    ];
    (any::<i64>(), 0i64..i64::MAX, body).prop_map(|(ts_ms, window_ms, body)| Signal {
        v: V1,
        ts_ms,
        window_ms,
        body,
    })
}

fn arb_action() -> impl Strategy<Value = Action> {
    let kind = prop_oneof![
        Just(ActionKind::Admit),
        Just(ActionKind::Deny),
        Just(ActionKind::Reclaim),
        Just(ActionKind::Resize),
        Just(ActionKind::Block),
        Just(ActionKind::Unblock),
        Just(ActionKind::Alert)
    ];
    let outcome = prop_oneof![
        Just(Outcome::Ok),
        Just(Outcome::Failed),
        Just(Outcome::DryRun)
    ];
    (
        any::<i64>(),
        kind,
        name(),
        proptest::option::of(name()),
        name(),
        proptest::option::of(name()),
        proptest::option::of(name()),
        outcome,
        ".{0,40}",
    )
        .prop_map(
            |(ts_ms, action, lease_id, team, reason, policy, driver, outcome, detail)| Action {
                v: V1,
                ts_ms,
                action,
                lease_id: Some(lease_id),
                team,
                reason,
                policy,
                driver,
                outcome,
                detail,
            },
        )
}

fn roundtrips<T: Record + PartialEq + std::fmt::Debug + Clone>(
    records: Vec<T>,
) -> Result<(), TestCaseError> {
    for record in &records {
        record
            .validate()
            .map_err(|e| TestCaseError::fail(format!("generated an invalid record: {e}")))?;
        let json = record.to_json();
        let back = T::from_json(&json)
            .map_err(|e| TestCaseError::fail(format!("{e}: {}", String::from_utf8_lossy(&json))))?;
        prop_assert_eq!(&back, record);
        prop_assert_eq!(back.to_json(), json);
    }
    let batch = T::to_record_batch(&records).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(batch.schema(), T::arrow_schema());
    let back = T::from_record_batch(&batch).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(back, records);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn samples_roundtrip(records in proptest::collection::vec(arb_sample_with_extras(), 0..8)) { roundtrips(records)?; }

    #[test]
    fn lease_events_roundtrip(records in proptest::collection::vec(arb_lease(), 0..8)) { roundtrips(records)?; }

    #[test]
    fn signals_roundtrip(records in proptest::collection::vec(arb_signal(), 0..8)) { roundtrips(records)?; }

    #[test]
    fn actions_roundtrip(records in proptest::collection::vec(arb_action(), 0..8)) { roundtrips(records)?; }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Sample::from_json(&bytes);
        let _ = LeaseEvent::from_json(&bytes);
        let _ = Signal::from_json(&bytes);
        let _ = Action::from_json(&bytes);
    }

    /// The ingest hot path (SampleRow, parsed by sonic-rs) accepts exactly what Sample accepts,
    /// with the same values, on valid and damaged records alike.
    #[test]
    fn sample_rows_agree_with_samples(sample in arb_sample_with_extras(), cut in any::<prop::sample::Index>(), byte in any::<u8>(), damage in any::<bool>()) {
        let mut json = sample.to_json();
        if damage {
            let i = cut.index(json.len());
            json[i] = byte;
        }
        let row = gpuwarden_schema::sample_row::SampleRow::from_json(&json);
        let full = Sample::from_json(&json);
        match (row, full) {
            (Ok(row), Ok(full)) => {
                let mut builder = gpuwarden_schema::sample_row::SampleBuilder::default();
                builder.append(&row);
                prop_assert_eq!(builder.finish().unwrap(), Sample::to_record_batch(&[full]).unwrap());
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            (a, b) => prop_assert!(false, "disagree on {:?}: {:?} vs {:?}", String::from_utf8_lossy(&json), a.map(|_| ()), b.map(|_| ())),
        }
    }

    /// Mutated valid records: closer to what a buggy producer sends than random bytes are.
    #[test]
    fn mutated_records_decode_or_fail_cleanly(sample in arb_sample_with_extras(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut json = sample.to_json();
        let i = cut.index(json.len());
        json[i] = byte;
        match Sample::from_json(&json) {
            Ok(decoded) => prop_assert!(decoded.validate().is_ok()),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        json.truncate(i);
        prop_assert!(Sample::from_json(&json).is_err(), "a truncated record decoded");
    }
}
