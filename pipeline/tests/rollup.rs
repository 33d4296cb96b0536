//! The rollups against a small lake whose every number was computed by hand, one definition of
//! docs/src/finops/definitions.md at a time. The fixture, in minutes after hour H
//! (every sample's interval is one minute: the sample at k covers minute k − 1 to k, so the one
//! at 0 lies in the hour before H):
//!
//! - g1 (H100, host h1): a sample every minute, k = 0..119 (ts = H + k min), 50 % busy, 300 W.
//! - g2 (H100, host h1): k = 30..59, idle (0 %), no power reading.
//! - g3 (A100, host h2): k = 0..59, 100 % busy; k = 30 sent twice, the copy at 20 %.
//! - g4 (Tesla T4, host h2): k = 5 naming lease L4 (10 %), k = 6 naming an unknown lease (80 %).
//! - L1 "ml": granted at 0 on [g1] ×1, resized at 30 to [g1, g2] ×2, released at 90.
//! - L2 "web": granted at 15 on [g3] ×1, still running.
//! - L3 "research": granted at 20 on [g1] ×1 (a later grant than L1's), released at 40.
//! - L4 "ml": granted at 0, ×2 H100 with no GPU ids, released at 10.
//!
//! The watermark is H + 119 min; lateness is 10 min, so H is final and H + 1h is not.

use std::collections::BTreeMap;

#[path = "../../tests/support/s3.rs"]
#[allow(dead_code, unreachable_pub)]
mod s3;

use gpuwarden_pipeline::lake::hour_of;
use gpuwarden_pipeline::{sql, Lake, Rollup, RollupOptions};
use gpuwarden_schema::config::{GpuPrice, IdleMeasure, PricingConfig};
use gpuwarden_schema::{LeaseEvent, Record, Sample};
use s3::on_each_lake;
use serde_json::{json, Value};

const H: i64 = 1_795_996_800_000; // 2026-11-30T00:00:00Z
const MIN: i64 = 60_000;
const H100: &str = "NVIDIA H100 80GB HBM3";
const A100: &str = "NVIDIA A100-SXM4-40GB";
const T4: &str = "Tesla T4";

fn sample(
    gpu: &str,
    model: &str,
    host: &str,
    k: i64,
    util: f64,
    power: Option<f64>,
    lease: Option<&str>,
) -> Sample {
    Sample::from_json(
        json!({"v": 1, "ts_ms": H + k * MIN, "interval_ms": MIN, "host": host, "gpu_uuid": gpu,
               "gpu_model": model, "util_gpu_pct": util, "mem_used_bytes": 1000 + k,
               "mem_total_bytes": 1_000_000, "power_w": power, "lease_id": lease})
        .to_string()
        .as_bytes(),
    )
    .unwrap()
}

fn event(k: i64, kind: &str, lease: &str, team: &str, count: u32, gpus: &[&str]) -> LeaseEvent {
    let mut e = json!({"v": 1, "ts_ms": H + k * MIN, "event": kind, "lease_id": lease,
        "team": team, "user": format!("{team}-user"), "project": "p", "workload": "training",
        "substrate": "sim", "gpu_model": H100, "gpu_count": count, "gpu_uuids": gpus});
    if kind == "released" {
        e["reason"] = json!("user");
    }
    if lease == "L2" {
        e["gpu_model"] = json!(A100);
        e["workload"] = json!("inference");
    }
    LeaseEvent::from_json(e.to_string().as_bytes()).unwrap()
}

/// Writes records to the lake the way ingest does: one file per hour, under a source name.
fn put<R: Record + Clone>(
    lake: &Lake,
    table: &str,
    source: &str,
    records: &[R],
    ts: impl Fn(&R) -> i64,
) {
    let mut by_hour: BTreeMap<i64, Vec<R>> = BTreeMap::new();
    for r in records {
        by_hour.entry(hour_of(ts(r))).or_default().push(r.clone());
    }
    let batches: Vec<(i64, arrow_array::RecordBatch)> = by_hour
        .into_iter()
        .map(|(hour, rows)| (hour, R::to_record_batch(&rows).unwrap()))
        .collect();
    let files: Vec<_> = batches
        .iter()
        .map(|(hour, batch)| gpuwarden_pipeline::delta::NewFile {
            hour_ms: *hour,
            batch,
            offsets: None,
        })
        .collect();
    gpuwarden_pipeline::delta::block_on(lake.delta().append(
        table,
        &batches[0].1.schema(),
        source,
        &files,
        None,
    ))
    .unwrap();
}

fn fixture(lake: &Lake) {
    let mut samples = Vec::new();
    for k in 0..120 {
        samples.push(sample("g1", H100, "h1", k, 50.0, Some(300.0), None));
    }
    for k in 30..60 {
        samples.push(sample("g2", H100, "h1", k, 0.0, None, None));
    }
    for k in 0..60 {
        samples.push(sample("g3", A100, "h2", k, 100.0, None, None));
    }
    samples.push(sample("g3", A100, "h2", 30, 20.0, None, None));
    samples.push(sample("g4", T4, "h2", 5, 10.0, None, Some("L4")));
    samples.push(sample("g4", T4, "h2", 6, 80.0, None, Some("ghost")));
    put(lake, "samples", "fixture", &samples, |s| s.ts_ms);
    let events = vec![
        event(0, "granted", "L1", "ml", 1, &["g1"]),
        event(30, "resized", "L1", "ml", 2, &["g1", "g2"]),
        event(90, "released", "L1", "ml", 2, &[]),
        event(15, "granted", "L2", "web", 1, &["g3"]),
        event(20, "granted", "L3", "research", 1, &["g1"]),
        event(40, "released", "L3", "research", 1, &[]),
        event(0, "granted", "L4", "ml", 2, &[]),
        event(10, "released", "L4", "ml", 2, &[]),
        // A replay of L1's grant counts once.
        event(0, "granted", "L1", "ml", 1, &["g1"]),
    ];
    put(lake, "lease_events", "fixture", &events, |e| e.ts_ms);
}

/// A state file of the lake, as stored.
fn state_file(lake: &Lake, relative: &str) -> Vec<u8> {
    lake.read_state(std::path::Path::new(relative))
        .unwrap()
        .unwrap_or_else(|| panic!("{relative} is in the lake"))
        .0
}

fn options() -> RollupOptions {
    RollupOptions {
        pricing: PricingConfig {
            default_usd_per_gpu_hour: 1.0,
            idle_util_pct: 5.0,
            gpu: vec![
                GpuPrice {
                    model_match: "h100".into(),
                    usd_per_gpu_hour: 4.0,
                },
                GpuPrice {
                    model_match: "A100".into(),
                    usd_per_gpu_hour: 2.0,
                },
                // Never reached for an A100: the entry before it matches first.
                GpuPrice {
                    model_match: "A100-SXM4".into(),
                    usd_per_gpu_hour: 99.0,
                },
            ],
            energy_usd_per_kwh: 0.25,
            co2e_g_per_kwh: Some(400.0),
            ..PricingConfig::default()
        },
        idle_measures: BTreeMap::new(),
        lateness_ms: 10 * MIN,
        idle_ms: 5 * MIN,
        max_skew_ms: 5 * MIN,
        clock: std::sync::Arc::new(gpuwarden_schema::SystemClock),
        part_rows: gpuwarden_pipeline::rollup::DEFAULT_PART_ROWS,
        settle_ms: MIN,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Rows of a query as JSON objects (timestamps cast to ms by the query).
fn rows(rt: &tokio::runtime::Runtime, lake: &Lake, query: &str) -> Vec<Value> {
    let (_, batches) = rt.block_on(sql::query(lake, query)).unwrap();
    let mut writer = datafusion::arrow::json::ArrayWriter::new(Vec::new());
    for batch in &batches {
        writer.write(batch).unwrap();
    }
    writer.finish().unwrap();
    let bytes = writer.into_inner();
    if bytes.is_empty() {
        return Vec::new();
    }
    serde_json::from_slice(&bytes).unwrap()
}

/// team_hourly as `(hour offset in hours, team, model) -> row`.
fn team_hourly(
    rt: &tokio::runtime::Runtime,
    lake: &Lake,
) -> BTreeMap<(i64, String, String), Value> {
    rows(
        rt,
        lake,
        "SELECT CAST(hour AS BIGINT) AS hour_ms, * FROM team_hourly ORDER BY hour, team, gpu_model",
    )
    .into_iter()
    .map(|r| {
        let key = (
            (r["hour_ms"].as_i64().unwrap() - H) / 3_600_000,
            r["team"].as_str().unwrap().to_owned(),
            r["gpu_model"].as_str().unwrap().to_owned(),
        );
        (key, r)
    })
    .collect()
}

fn close(actual: &Value, expected: f64, what: &str) {
    let actual = actual
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: {actual} is not a number"));
    assert!(
        (actual - expected).abs() <= 1e-9 * expected.abs().max(1.0),
        "{what}: got {actual}, expected {expected}"
    );
}

/// Checks every measure of a team_hourly row: (allocated, observed, busy, idle, cost,
/// idle cost, energy); utilization follows from busy and observed.
fn check(
    rows: &BTreeMap<(i64, String, String), Value>,
    key: (i64, &str, &str),
    expected: [f64; 7],
) {
    let row = rows
        .get(&(key.0, key.1.to_owned(), key.2.to_owned()))
        .unwrap_or_else(|| panic!("no team_hourly row {key:?}; rows: {:#?}", rows.keys()));
    let names = [
        "allocated_gpu_hours",
        "observed_gpu_hours",
        "busy_gpu_hours",
        "idle_gpu_hours",
        "cost_usd",
        "idle_cost_usd",
        "energy_kwh",
    ];
    for (name, value) in names.iter().zip(expected) {
        close(&row[*name], value, &format!("{key:?} {name}"));
    }
    // Energy priced at $0.25 and 400 g CO2e a kWh; no GPM in this fixture, every sampled
    // piece judged by utilization.
    close(
        &row["energy_cost_usd"],
        expected[6] * 0.25,
        &format!("{key:?} energy_cost_usd"),
    );
    close(
        &row["co2e_kg"],
        expected[6] * 0.4,
        &format!("{key:?} co2e_kg"),
    );
    close(
        &row["sm_active_gpu_hours"],
        0.0,
        &format!("{key:?} SM-active"),
    );
    close(&row["gpm_observed_gpu_hours"], 0.0, &format!("{key:?} GPM"));
    let (busy, observed) = (expected[2], expected[1]);
    let measure = if observed > 0.0 {
        json!("util")
    } else {
        Value::Null
    };
    assert_eq!(
        row.get("idle_measure").unwrap_or(&Value::Null),
        &measure,
        "{key:?} idle_measure"
    );
    if observed > 0.0 {
        close(
            &row["utilization_pct"],
            100.0 * busy / observed,
            &format!("{key:?} utilization_pct"),
        );
    } else {
        assert!(
            row.get("utilization_pct").is_none_or(Value::is_null),
            "{key:?}: no samples, no utilization"
        );
    }
}

#[test]
fn team_hourly_follows_every_definition() {
    on_each_lake(team_hourly_follows_every_definition_on);
}

fn team_hourly_follows_every_definition_on(lake: Lake) {
    fixture(&lake);
    let rt = rt();
    let report = rt
        .block_on(Rollup::new(lake.clone(), options()).run())
        .unwrap();
    assert_eq!(report.watermark, Some(H + 119 * MIN));
    // H − 1h holds the first minute-long intervals of g1 and g3, which end at H.
    assert_eq!((report.hours, report.final_hours, report.leases), (3, 2, 4));

    let t = team_hourly(&rt, &lake);
    let h = 1.0 / 60.0; // one one-minute sample, in hours
                        // The minute before H: g1 (50 %, 300 W) and g3 (100 %), held by no lease.
    check(
        &t,
        (-1, "(unallocated)", H100),
        [h, h, 0.5 * h, 0.0, 4.0 * h, 0.0, 300.0 * 60_000.0 / 3.6e9],
    );
    check(
        &t,
        (-1, "(unallocated)", A100),
        [h, h, h, 0.0, 2.0 * h, 0.0, 0.0],
    );
    // L1 in H: g1 in minutes 0..20 and 40..60 (L3's later grant owns g1 in 20..40), g2 in
    // 30..59 (its sample at 30 covers 29..30, before the resize gave L1 g2); allocated 30 min
    // × 1 GPU + 30 min × 2 GPUs. Plus L4: 10 min × 2 GPUs allocated, and the T4 sample that
    // names it (minute 4..5, within L4's segment, which lists no GPU), priced as L4's H100s.
    check(
        &t,
        (0, "ml", H100),
        [
            1.5 + 20.0 * h,
            69.0 * h + h,
            40.0 * h * 0.5 + 0.1 * h,
            29.0 * h,
            (1.5 + 20.0 * h) * 4.0,
            29.0 * h * 4.0,
            300.0 * 40.0 * 60_000.0 / 3.6e9,
        ],
    );
    // g2's minute 29..30, idle, before L1 held it.
    check(
        &t,
        (0, "(unallocated)", H100),
        [h, h, 0.0, h, 4.0 * h, 4.0 * h, 0.0],
    );
    check(
        &t,
        (0, "research", H100),
        [20.0 * h, 20.0 * h, 10.0 * h, 0.0, 80.0 * h, 0.0, 0.1],
    );
    // L2 from minute 15; g3's last sample (59) ends its time at 59. The duplicate at minute 30
    // counts once, at its larger utilization.
    check(
        &t,
        (0, "web", A100),
        [45.0 * h, 44.0 * h, 44.0 * h, 0.0, 90.0 * h, 0.0, 0.0],
    );
    // g3 before L2's grant: a busy GPU no lease holds.
    check(
        &t,
        (0, "(unallocated)", A100),
        [15.0 * h, 15.0 * h, 15.0 * h, 0.0, 30.0 * h, 0.0, 0.0],
    );
    // The sample naming an unknown lease falls through to GPU matching, and g4 has no lease:
    // unallocated, at the default price.
    check(
        &t,
        (0, "(unallocated)", T4),
        [h, h, 0.8 * h, 0.0, h, 0.0, 0.0],
    );
    // H + 1h: L1 until its release at minute 90 (2 GPUs; g2's samples ended at 59), g1
    // unallocated from minute 90 to its last sample's end at 119; L2 still running: allocated
    // up to the watermark (minute 119), with no samples.
    check(
        &t,
        (1, "ml", H100),
        [
            1.0,
            0.5,
            0.25,
            0.0,
            4.0,
            0.0,
            300.0 * 30.0 * 60_000.0 / 3.6e9,
        ],
    );
    check(
        &t,
        (1, "(unallocated)", H100),
        [
            29.0 * h,
            29.0 * h,
            14.5 * h,
            0.0,
            29.0 * h * 4.0,
            0.0,
            300.0 * 29.0 * 60_000.0 / 3.6e9,
        ],
    );
    check(
        &t,
        (1, "web", A100),
        [59.0 * h, 0.0, 0.0, 0.0, 118.0 * h, 0.0, 0.0],
    );
    assert_eq!(t.len(), 11, "no other rows: {:#?}", t.keys());
    assert!(t.iter().all(|(k, r)| r["final"] == json!(k.0 <= 0)));
}

#[test]
fn gpu_hourly_lease_usage_and_leases() {
    on_each_lake(gpu_hourly_lease_usage_and_leases_on);
}

fn gpu_hourly_lease_usage_and_leases_on(lake: Lake) {
    fixture(&lake);
    let rt = rt();
    rt.block_on(Rollup::new(lake.clone(), options()).run())
        .unwrap();

    let g3 = rows(
        &rt,
        &lake,
        "SELECT samples, observed_gpu_hours, utilization_pct, mem_used_max_bytes, host
         FROM gpu_hourly WHERE gpu_uuid = 'g3' ORDER BY hour",
    );
    assert_eq!(
        g3.len(),
        2,
        "H − 1h holds the interval of g3's first sample"
    );
    assert_eq!(g3[0]["samples"], json!(0));
    close(
        &g3[0]["observed_gpu_hours"],
        1.0 / 60.0,
        "g3 observed before H",
    );
    let g3 = &g3[1..];
    assert_eq!(g3[0]["samples"], json!(60), "the duplicate counts once");
    close(
        &g3[0]["observed_gpu_hours"],
        59.0 / 60.0,
        "g3 observed in H",
    );
    close(&g3[0]["utilization_pct"], 100.0, "g3 utilization");
    assert_eq!(g3[0]["mem_used_max_bytes"], json!(1059));
    assert_eq!(g3[0]["host"], json!("h2"));

    let usage = rows(
        &rt,
        &lake,
        r#"SELECT lease_id, team, "user", gpu_count, CAST(released_at AS BIGINT) AS released_ms,
                  release_reason, allocated_gpu_hours, observed_gpu_hours, busy_gpu_hours,
                  idle_gpu_hours, utilization_pct, cost_usd, idle_cost_usd, energy_kwh
           FROM lease_usage ORDER BY lease_id"#,
    );
    assert_eq!(usage.len(), 4);
    let l1 = &usage[0];
    assert_eq!(
        (&l1["lease_id"], &l1["team"], &l1["user"], &l1["gpu_count"]),
        (&json!("L1"), &json!("ml"), &json!("ml-user"), &json!(2))
    );
    assert_eq!(l1["released_ms"], json!(H + 90 * MIN));
    assert_eq!(l1["release_reason"], json!("user"));
    close(&l1["allocated_gpu_hours"], 2.5, "L1 allocated");
    // g1: 70 min at 50 %; g2: 29 idle minutes (its first interval ended at the resize).
    close(&l1["observed_gpu_hours"], 99.0 / 60.0, "L1 observed");
    close(&l1["busy_gpu_hours"], 35.0 / 60.0, "L1 busy");
    close(&l1["utilization_pct"], 3500.0 / 99.0, "L1 utilization");
    close(&l1["cost_usd"], 10.0, "L1 cost");
    close(&l1["idle_cost_usd"], 29.0 / 60.0 * 4.0, "L1 idle cost");
    close(&l1["energy_kwh"], 0.35, "L1 energy");
    let l2 = &usage[1];
    assert!(l2["released_ms"].is_null());
    close(
        &l2["allocated_gpu_hours"],
        (45.0 + 59.0) / 60.0,
        "L2 allocated",
    );
    close(&l2["cost_usd"], 2.0 * (45.0 + 59.0) / 60.0, "L2 cost");

    let leases = rows(
        &rt,
        &lake,
        "SELECT lease_id, state, gpu_count, gpu_uuids, workload FROM leases ORDER BY lease_id",
    );
    assert_eq!(
        leases
            .iter()
            .map(|l| (
                l["lease_id"].as_str().unwrap(),
                l["state"].as_str().unwrap()
            ))
            .collect::<Vec<_>>(),
        vec![
            ("L1", "released"),
            ("L2", "active"),
            ("L3", "released"),
            ("L4", "released")
        ]
    );
    assert_eq!(leases[0]["gpu_uuids"], json!(["g1", "g2"]));
    assert_eq!(leases[1]["workload"], json!("inference"));
}

#[test]
fn focus_costs_has_every_mandatory_column_with_focus_types() {
    on_each_lake(focus_costs_has_every_mandatory_column_with_focus_types_on);
}

fn focus_costs_has_every_mandatory_column_with_focus_types_on(lake: Lake) {
    fixture(&lake);
    let rt = rt();
    rt.block_on(Rollup::new(lake.clone(), options()).run())
        .unwrap();
    let (schema, _) = rt
        .block_on(sql::query(&lake, "SELECT * FROM focus_costs"))
        .unwrap();
    use datafusion::arrow::datatypes::DataType;
    for (column, kind, nullable) in [
        ("BilledCost", "decimal", false),
        ("EffectiveCost", "decimal", false),
        ("ListCost", "decimal", false),
        ("ContractedCost", "decimal", false),
        ("BillingAccountId", "text", false),
        ("BillingAccountName", "text", true),
        ("BillingCurrency", "text", false),
        ("BillingPeriodStart", "time", false),
        ("BillingPeriodEnd", "time", false),
        ("ChargeCategory", "text", false),
        ("ChargeClass", "text", true),
        ("ChargeDescription", "text", true),
        ("ChargePeriodStart", "time", false),
        ("ChargePeriodEnd", "time", false),
        ("InvoiceIssuerName", "text", false),
        ("PricingQuantity", "decimal", true),
        ("PricingUnit", "text", true),
        ("ProviderName", "text", false),
        ("PublisherName", "text", false),
        ("ServiceCategory", "text", false),
        ("ServiceName", "text", false),
        ("ResourceId", "text", true),
        ("SubAccountId", "text", true),
        ("Tags", "text", true),
        ("ConsumedQuantity", "decimal", true),
        ("ConsumedUnit", "text", true),
        ("x_IdleGpuHours", "float", false),
        ("x_UtilizationPct", "float", true),
    ] {
        let field = schema
            .field_with_name(column)
            .unwrap_or_else(|_| panic!("focus_costs has no {column}"));
        let ok = match kind {
            "decimal" => matches!(field.data_type(), DataType::Decimal128(..)),
            "text" => field.data_type() == &DataType::Utf8,
            "time" => {
                matches!(field.data_type(), DataType::Timestamp(_, Some(tz)) if &**tz == "UTC")
            }
            _ => field.data_type() == &DataType::Float64,
        };
        assert!(ok, "{column}: {:?}", field.data_type());
        assert_eq!(field.is_nullable(), nullable, "{column} nullability");
    }

    let focus = rows(
        &rt,
        &lake,
        r#"SELECT CAST("ChargePeriodStart" AS BIGINT) AS start_ms,
                  CAST("BillingPeriodStart" AS BIGINT) AS month_ms,
                  CAST("BillingPeriodEnd" AS BIGINT) AS month_end_ms,
                  CAST("BilledCost" AS DOUBLE) AS billed, CAST("PricingQuantity" AS DOUBLE) AS qty,
                  "ResourceId", "SubAccountId", "Tags", "ChargeCategory", "BillingCurrency",
                  "ChargeClass", "x_IdleGpuHours", CAST("x_EnergyCost" AS DOUBLE) AS energy_cost,
                  "x_Co2eKg", "x_EnergyKwh"
           FROM focus_costs ORDER BY start_ms, "SubAccountId", "ResourceId""#,
    );
    // One row per lease and hour, and one per GPU model and hour for unallocated capacity.
    assert_eq!(
        focus.len(),
        11 + 1,
        "L1 and L4 are separate rows of ml's H100s in H"
    );
    let l1 = focus
        .iter()
        .find(|r| r["ResourceId"] == json!("L1") && r["start_ms"] == json!(H))
        .unwrap();
    close(&l1["billed"], 6.0, "L1 BilledCost in H");
    close(&l1["qty"], 1.5, "L1 PricingQuantity in H");
    close(&l1["x_IdleGpuHours"], 29.0 / 60.0, "L1 idle GPU-hours in H");
    // g1 at 300 W for L1's 40 minutes of it: 0.2 kWh, $0.05, 80 g.
    close(&l1["x_EnergyKwh"], 0.2, "L1 kWh in H");
    close(&l1["energy_cost"], 0.05, "L1 x_EnergyCost in H");
    close(&l1["x_Co2eKg"], 0.08, "L1 x_Co2eKg in H");
    assert_eq!(l1["SubAccountId"], json!("ml"));
    assert_eq!(l1["ChargeCategory"], json!("Usage"));
    assert_eq!(l1["BillingCurrency"], json!("USD"));
    assert!(l1["ChargeClass"].is_null());
    let tags: Value = serde_json::from_str(l1["Tags"].as_str().unwrap()).unwrap();
    assert_eq!(
        tags,
        json!({"user": "ml-user", "project": "p", "workload": "training"})
    );
    // November 2026.
    assert_eq!(l1["month_ms"], json!(1_793_491_200_000_i64));
    assert_eq!(l1["month_end_ms"], json!(1_796_083_200_000_i64));
    let unallocated = focus
        .iter()
        .filter(|r| r["SubAccountId"] == json!("(unallocated)"))
        .count();
    // Two models in H − 1h, three in H, one in H + 1h.
    assert_eq!(unallocated, 6);
    // The FOCUS export prices the same hours team_hourly does.
    let total: f64 = focus.iter().map(|r| r["billed"].as_f64().unwrap()).sum();
    let team_total = rows(&rt, &lake, "SELECT sum(cost_usd) AS c FROM team_hourly");
    close(
        &team_total[0]["c"],
        total,
        "focus total vs team_hourly total",
    );
}

#[test]
fn late_data_and_late_lease_events_recompute_their_hours_and_nothing_else() {
    on_each_lake(late_data_and_late_lease_events_recompute_their_hours_and_nothing_else_on);
}

fn late_data_and_late_lease_events_recompute_their_hours_and_nothing_else_on(lake: Lake) {
    fixture(&lake);
    let rt = rt();
    let rollup = Rollup::new(lake.clone(), options());
    rt.block_on(rollup.run()).unwrap();
    let before = team_hourly(&rt, &lake);

    // Nothing new: only the hour that is not final yet is computed again, to the same rows.
    let again = rt.block_on(rollup.run()).unwrap();
    assert_eq!((again.hours, again.final_hours), (1, 0));
    assert_eq!(team_hourly(&rt, &lake), before);

    // A late sample for the final hour H, on the unallocated T4, in a file of its own.
    let late = [sample("g4", T4, "h2", 30, 0.0, None, None)];
    put(&lake, "samples", "late", &late, |s| s.ts_ms);
    let report = rt.block_on(rollup.run()).unwrap();
    // A sample landing in an hour marks the hour before it only when its interval may reach
    // back into it (the file's least ts_ms less its greatest interval_ms): minute 30 does not.
    assert_eq!(report.hours, 2, "H (late data) and H + 1h (not final)");
    let after = team_hourly(&rt, &lake);
    let t4 = (0, "(unallocated)".to_owned(), T4.to_owned());
    close(
        &after[&t4]["observed_gpu_hours"],
        2.0 / 60.0,
        "late sample counted",
    );
    close(
        &after[&t4]["idle_gpu_hours"],
        1.0 / 60.0,
        "late sample idle",
    );

    // A late grant of g4 from minute 50 with a sample under it: the lease event marks H, so
    // H and everything after it is recomputed, and the sample moves to the new lease.
    put(
        &lake,
        "lease_events",
        "late",
        &[event(50, "granted", "L5", "late-team", 1, &["g4"])],
        |e| e.ts_ms,
    );
    put(
        &lake,
        "samples",
        "late2",
        &[sample("g4", T4, "h2", 55, 50.0, None, None)],
        |s| s.ts_ms,
    );
    let report = rt.block_on(rollup.run()).unwrap();
    assert_eq!(report.hours, 2, "H (marked by both) and H + 1h");
    let after = team_hourly(&rt, &lake);
    let late_team = (0, "late-team".to_owned(), H100.to_owned());
    close(
        &after[&late_team]["observed_gpu_hours"],
        1.0 / 60.0,
        "sample under the late lease",
    );
    close(
        &after[&late_team]["allocated_gpu_hours"],
        10.0 / 60.0,
        "minutes 50..60 in H",
    );
    close(
        &after[&(1, "late-team".to_owned(), H100.to_owned())]["allocated_gpu_hours"],
        59.0 / 60.0,
        "running to the watermark",
    );
    close(
        &after[&t4]["observed_gpu_hours"],
        2.0 / 60.0,
        "earlier T4 samples stay unallocated",
    );
    // The run read every commit of the raw tables: none is left for the next.
    let (state, _) = lake
        .read_state(std::path::Path::new("rollups/_state.json"))
        .unwrap()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state).unwrap();
    for table in ["samples", "lease_events"] {
        let read = state["read"][table].as_u64().unwrap();
        let (latest, hours) =
            gpuwarden_pipeline::delta::block_on(lake.delta().changed_hours(table, Some(read)))
                .unwrap()
                .unwrap();
        assert_eq!((latest, hours.unwrap().len()), (read, 0), "{table}");
    }
}

#[test]
fn an_empty_lake_rolls_up_to_nothing_and_tables_are_still_queryable() {
    on_each_lake(an_empty_lake_rolls_up_to_nothing_and_tables_are_still_queryable_on);
}

fn an_empty_lake_rolls_up_to_nothing_and_tables_are_still_queryable_on(lake: Lake) {
    let rt = rt();
    let report = rt
        .block_on(Rollup::new(lake.clone(), options()).run())
        .unwrap();
    assert_eq!(report.watermark, None);
    for table in [
        "team_hourly",
        "gpu_hourly",
        "lease_usage",
        "focus_costs",
        "leases",
    ] {
        assert!(
            rows(&rt, &lake, &format!("SELECT * FROM {table}")).is_empty(),
            "{table}"
        );
    }
}

#[test]
fn an_hour_with_allocation_and_no_samples_at_all_is_rolled_up() {
    on_each_lake(an_hour_with_allocation_and_no_samples_at_all_is_rolled_up_on);
}

fn an_hour_with_allocation_and_no_samples_at_all_is_rolled_up_on(lake: Lake) {
    put(
        &lake,
        "samples",
        "s",
        &[sample("g1", H100, "h1", 5, 50.0, None, None)],
        |s| s.ts_ms,
    );
    put(
        &lake,
        "lease_events",
        "s",
        &[
            event(0, "granted", "L1", "ml", 1, &["g1"]),
            event(150, "released", "L1", "ml", 1, &[]),
        ],
        |e| e.ts_ms,
    );
    let rt = rt();
    let report = rt
        .block_on(Rollup::new(lake.clone(), options()).run())
        .unwrap();
    assert_eq!(
        report.hours, 4,
        "H with a sample, H − 1h that its interval could reach, H + 1h and H + 2h with the \
         lease alone"
    );
    let t = team_hourly(&rt, &lake);
    check(&t, (1, "ml", H100), [1.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0]);
    check(&t, (2, "ml", H100), [0.5, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0]);
}

/// A backfill can hold history whose one host's clock ran ahead (a year ahead, yet in the past:
/// `gpuwarden ingest` cannot tell it from the rest). The watermark is the fleet's all the same; a
/// host that falls silent holds it back for `idle_timeout` (5 min here) and no longer; the
/// hosts' times carry over from one run to the next in `_hosts.json`.
#[test]
fn the_watermark_is_the_fleets_one_clock_cannot_drag_it_and_a_silent_host_lets_go() {
    on_each_lake(the_watermark_is_the_fleets_one_clock_cannot_drag_it_and_a_silent_host_lets_go_on);
}

fn the_watermark_is_the_fleets_one_clock_cannot_drag_it_and_a_silent_host_lets_go_on(lake: Lake) {
    let rt = rt();
    let minutes = |host: &str, gpu: &str, from: i64, to: i64| -> Vec<Sample> {
        (from..=to)
            .map(|k| sample(gpu, H100, host, k, 50.0, None, None))
            .collect()
    };
    let mut samples = minutes("a", "ga", 0, 30);
    samples.extend(minutes("b", "gb", 0, 30));
    samples.extend(minutes("c", "gc", 0, 30));
    let year = 365 * 24 * 60;
    samples.push(sample("gw", H100, "wrong", year, 100.0, None, Some("L")));
    put(&lake, "samples", "backfill", &samples, |s| s.ts_ms);
    put(
        &lake,
        "lease_events",
        "backfill",
        &[event(0, "granted", "L", "ml", 1, &["ga"])],
        |e| e.ts_ms,
    );
    let rollup = Rollup::new(lake.clone(), options());
    let report = rt.block_on(rollup.run()).unwrap();
    assert_eq!(report.watermark, Some(H + 30 * MIN));
    assert_eq!(report.hosts, 3, "the host dated past now is not remembered");
    let allocated = |rt: &tokio::runtime::Runtime| {
        rows(
            rt,
            &lake,
            "SELECT allocated_gpu_hours FROM lease_usage WHERE lease_id = 'L'",
        )[0]["allocated_gpu_hours"]
            .as_f64()
            .unwrap()
    };
    // The running lease is charged to the fleet's minute 30, not to a year later.
    close(&json!(allocated(&rt)), 0.5, "L allocated to the watermark");

    // c falls silent; a and b go on. Within the idle timeout c still holds the watermark…
    let mut more = minutes("a", "ga", 31, 34);
    more.extend(minutes("b", "gb", 31, 34));
    put(&lake, "samples", "live-1", &more, |s| s.ts_ms);
    let report = rt.block_on(rollup.run()).unwrap();
    assert_eq!(
        report.watermark,
        Some(H + 30 * MIN),
        "held by c, 4 min behind"
    );
    // …past it, c no longer does.
    let mut more = minutes("a", "ga", 35, 40);
    more.extend(minutes("b", "gb", 35, 40));
    put(&lake, "samples", "live-2", &more, |s| s.ts_ms);
    let report = rt.block_on(rollup.run()).unwrap();
    assert_eq!(
        report.watermark,
        Some(H + 40 * MIN),
        "c is 10 min behind: idle"
    );
    close(
        &json!(allocated(&rt)),
        40.0 / 60.0,
        "L allocated to the new watermark",
    );
    let hosts: BTreeMap<String, (i64, i64)> =
        serde_json::from_slice(&state_file(&lake, "rollups/_hosts.json")).unwrap();
    assert_eq!(hosts["a"].0, H + 40 * MIN);
    assert_eq!(hosts["c"].0, H + 30 * MIN);
    assert!(!hosts.contains_key("wrong"), "{hosts:?}");
}

/// Two hosts of three stop for good; in event time alone they are the median. What lets them
/// go is that nothing new of them is seen for `idle_timeout` on the rollup's clock. And a lake
/// whose state a wrong watermark once finalized into the future is put right.
#[test]
fn most_of_the_fleet_falling_silent_holds_the_watermark_for_the_idle_timeout_at_most() {
    on_each_lake(
        most_of_the_fleet_falling_silent_holds_the_watermark_for_the_idle_timeout_at_most_on,
    );
}

fn most_of_the_fleet_falling_silent_holds_the_watermark_for_the_idle_timeout_at_most_on(
    lake: Lake,
) {
    let rt = rt();
    let clock = std::sync::Arc::new(gpuwarden_schema::ManualClock::new(H + 10 * MIN));
    let options = RollupOptions {
        clock: clock.clone(),
        ..options()
    };
    let rollup = Rollup::new(lake.clone(), options);
    let minutes = |host: &str, from: i64, to: i64| -> Vec<Sample> {
        (from..=to)
            .map(|k| sample(&format!("g{host}"), H100, host, k, 50.0, None, None))
            .collect()
    };
    let mut samples = minutes("a", 0, 10);
    samples.extend(minutes("b", 0, 10));
    samples.extend(minutes("c", 0, 10));
    put(&lake, "samples", "s0", &samples, |s| s.ts_ms);
    // A state left by a rollup before the bounds: three hours ahead recorded final.
    let year = 365 * 24 * 60 * MIN;
    let damaged = json!({"hours": {
        (H + year).to_string(): true, (H + year + 60 * MIN).to_string(): true,
        (H + 2 * 60 * MIN).to_string(): true}, "pending": []});
    lake.write_state(
        std::path::Path::new("rollups/_state.json"),
        damaged.to_string().into_bytes(),
        &mut Default::default(),
        gpuwarden_pipeline::lake::Role::Rollups,
    )
    .unwrap();
    let report = rt.block_on(rollup.run()).unwrap();
    assert_eq!(report.watermark, Some(H + 10 * MIN));
    assert_eq!(
        report.hours, 5,
        "H − 1h (where the samples at minute 0 began), H, and the three hours wrongly final: \
         computed again"
    );
    let state: Value = serde_json::from_slice(&state_file(&lake, "rollups/_state.json")).unwrap();
    assert_eq!(
        state["hours"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        [&(H - 60 * MIN).to_string(), &H.to_string()],
        "hours with nothing in them are forgotten"
    );

    // b and c stop at minute 10; a goes on, a minute per minute of the clock.
    let mut watermarks = Vec::new();
    for k in 11..=20 {
        put(
            &lake,
            "samples",
            &format!("a{k}"),
            &minutes("a", k, k),
            |s| s.ts_ms,
        );
        clock.set(H + k * MIN);
        watermarks.push(rt.block_on(rollup.run()).unwrap().watermark.unwrap());
    }
    let held = watermarks.iter().filter(|w| **w == H + 10 * MIN).count();
    assert_eq!(
        held, 5,
        "held while b and c were last seen 5 min ago or less: {watermarks:?}"
    );
    assert_eq!(watermarks.last(), Some(&(H + 20 * MIN)));
    assert!(
        watermarks.windows(2).all(|w| w[0] <= w[1]),
        "never back: {watermarks:?}"
    );
}

/// Rollups an hour apart (from cron, after each host's export is ingested): a host is seen only
/// when a run reads its new samples, so hosts seen by the last run are not silent however long
/// ago that was, and one host's later export does not move the watermark past the others.
#[test]
fn hosts_seen_by_the_last_run_are_not_silent_however_far_apart_the_runs() {
    on_each_lake(hosts_seen_by_the_last_run_are_not_silent_however_far_apart_the_runs_on);
}

fn hosts_seen_by_the_last_run_are_not_silent_however_far_apart_the_runs_on(lake: Lake) {
    let rt = rt();
    let clock = std::sync::Arc::new(gpuwarden_schema::ManualClock::new(H + 65 * MIN));
    let rollup = Rollup::new(
        lake.clone(),
        RollupOptions {
            clock: clock.clone(),
            ..options()
        },
    );
    let export = |host: &str, from: i64, to: i64| -> Vec<Sample> {
        (from..=to)
            .step_by(5)
            .map(|k| sample(&format!("g{host}"), H100, host, k, 50.0, None, None))
            .collect()
    };
    for host in ["a", "b", "c"] {
        put(
            &lake,
            "samples",
            &format!("{host}-1"),
            &export(host, 0, 60),
            |s| s.ts_ms,
        );
    }
    assert_eq!(
        rt.block_on(rollup.run()).unwrap().watermark,
        Some(H + 60 * MIN)
    );
    // An hour later only a's next export has come in.
    clock.set(H + 125 * MIN);
    put(&lake, "samples", "a-2", &export("a", 65, 120), |s| s.ts_ms);
    assert_eq!(
        rt.block_on(rollup.run()).unwrap().watermark,
        Some(H + 60 * MIN),
        "b and c were seen by the last run"
    );
    // b's and c's follow: the fleet is at 120 min.
    clock.set(H + 185 * MIN);
    for host in ["b", "c"] {
        put(
            &lake,
            "samples",
            &format!("{host}-2"),
            &export(host, 65, 120),
            |s| s.ts_ms,
        );
    }
    assert_eq!(
        rt.block_on(rollup.run()).unwrap().watermark,
        Some(H + 120 * MIN)
    );
}

/// lease_hourly as `(hour offset in hours, lease id or "") -> row`.
fn lease_hourly(rt: &tokio::runtime::Runtime, lake: &Lake) -> BTreeMap<(i64, String), Value> {
    rows(
        rt,
        lake,
        "SELECT CAST(hour AS BIGINT) AS hour_ms, * FROM lease_hourly ORDER BY hour, lease_id",
    )
    .into_iter()
    .map(|r| {
        let lease = r["lease_id"].as_str().unwrap_or_default().to_owned();
        (((r["hour_ms"].as_i64().unwrap() - H) / 3_600_000, lease), r)
    })
    .collect()
}

/// The worked case of docs/src/finops/definitions.md#attribution: samples whose intervals straddle a
/// grant, a resize that adds a GPU, a resize that takes one away, a release and hour edges.
#[test]
fn attribution_splits_intervals_at_grants_resizes_releases_and_hours() {
    on_each_lake(attribution_splits_intervals_at_grants_resizes_releases_and_hours_on);
}

fn attribution_splits_intervals_at_grants_resizes_releases_and_hours_on(lake: Lake) {
    let five = |gpu: &str, k: i64, util: f64, power: Option<f64>, lease: Option<&str>| {
        let mut s = sample(gpu, H100, "h1", 0, util, power, lease);
        s.ts_ms = H + k * 5 * MIN;
        s.interval_ms = 5 * MIN;
        s
    };
    let mut samples = Vec::new();
    for k in 1..=24 {
        samples.push(five("g1", k, 0.0, None, None));
        // g2's exporter names A one sample late: from 0:35 to 1:30.
        let named = (7..=18).contains(&k).then_some("A");
        samples.push(five("g2", k, 50.0, Some(100.0), named));
    }
    put(&lake, "samples", "worked", &samples, |s| s.ts_ms);
    put(
        &lake,
        "lease_events",
        "worked",
        &[
            event(12, "granted", "A", "ml", 1, &["g1"]),
            event(33, "resized", "A", "ml", 2, &["g1", "g2"]),
            event(51, "resized", "A", "ml", 1, &["g2"]),
            event(87, "released", "A", "ml", 1, &[]),
        ],
        |e| e.ts_ms,
    );
    let rt = rt();
    let report = rt
        .block_on(Rollup::new(lake.clone(), options()).run())
        .unwrap();
    assert_eq!(report.watermark, Some(H + 2 * HOUR));

    let m = 1.0 / 60.0; // one GPU-minute, in GPU-hours
    let energy = |minutes: f64| 100.0 * minutes * 60_000.0 / 3.6e9;
    let l = lease_hourly(&rt, &lake);
    // (allocated, observed, busy, idle, energy) per lease and hour.
    let expected: [((i64, &str), [f64; 5]); 4] = [
        // A: g1 0:12-0:51 (idle), g2 0:33-1:00 (50 %); 21 min x 1 + 18 min x 2 + 9 min x 1.
        (
            (0, "A"),
            [66.0 * m, 66.0 * m, 13.5 * m, 39.0 * m, energy(27.0)],
        ),
        // A: g2 1:00-1:27; the sample at 1:30 names A but its last 3 minutes are nobody's.
        ((1, "A"), [27.0 * m, 27.0 * m, 13.5 * m, 0.0, energy(27.0)]),
        // g1 0:00-0:12 and 0:51-1:00, g2 0:00-0:33.
        (
            (0, ""),
            [54.0 * m, 54.0 * m, 16.5 * m, 21.0 * m, energy(33.0)],
        ),
        // g1 1:00-2:00 (the sample at 2:00 included), g2 1:27-2:00.
        (
            (1, ""),
            [93.0 * m, 93.0 * m, 16.5 * m, 60.0 * m, energy(33.0)],
        ),
    ];
    for ((hour, lease), values) in expected {
        let row = l
            .get(&(hour, lease.to_owned()))
            .unwrap_or_else(|| panic!("no lease_hourly row ({hour}, {lease:?}): {:?}", l.keys()));
        let names = [
            "allocated_gpu_hours",
            "observed_gpu_hours",
            "busy_gpu_hours",
            "idle_gpu_hours",
            "energy_kwh",
        ];
        for (name, value) in names.into_iter().zip(values) {
            close(&row[name], value, &format!("({hour}, {lease:?}) {name}"));
        }
    }
    assert_eq!(l.len(), 4, "no other rows: {:?}", l.keys());

    let usage = rows(
        &rt,
        &lake,
        "SELECT allocated_gpu_hours, observed_gpu_hours, idle_cost_usd, cost_usd FROM lease_usage",
    );
    close(&usage[0]["allocated_gpu_hours"], 93.0 * m, "A allocated");
    close(&usage[0]["observed_gpu_hours"], 93.0 * m, "A observed");
    close(&usage[0]["idle_cost_usd"], 39.0 * m * 4.0, "A idle cost");
    close(&usage[0]["cost_usd"], 93.0 * m * 4.0, "A cost");

    // A sample counts in the hour of its ts_ms; its time in the hours its interval lies in.
    let g1 = rows(
        &rt,
        &lake,
        "SELECT CAST(hour AS BIGINT) AS hour_ms, samples, observed_gpu_hours, utilization_pct
         FROM gpu_hourly WHERE gpu_uuid = 'g1' ORDER BY hour",
    );
    let g1: Vec<(i64, i64, f64, bool)> = g1
        .iter()
        .map(|r| {
            (
                (r["hour_ms"].as_i64().unwrap() - H) / HOUR,
                r["samples"].as_i64().unwrap(),
                r["observed_gpu_hours"].as_f64().unwrap(),
                r.get("utilization_pct").is_none_or(Value::is_null),
            )
        })
        .collect();
    assert_eq!(
        g1,
        vec![(0, 11, 1.0, false), (1, 12, 1.0, false), (2, 1, 0.0, true)]
    );
}

/// SplitMix64, seeded: the same random fleets on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

const HOUR: i64 = 60 * MIN;

/// Random fleets: GPUs sampled at irregular intervals with gaps, leases granted, resized onto
/// other GPUs and released at arbitrary milliseconds, exporters naming the right lease, a stale
/// one or none. Whatever the fleet, in every hour the watermark has passed no lease is observed
/// longer than it was allocated, nor busy or idle longer than observed, and no time is lost or
/// counted twice: the hours' observed time adds up to the samples' intervals.
#[test]
fn observed_never_exceeds_allocated_and_every_sampled_millisecond_counts_once() {
    let rt = rt();
    for seed in 0..6u64 {
        let mut rng = Rng(seed);
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let gpus = ["g1", "g2", "g3", "g4"];
        let end = H + 3 * HOUR;

        let mut events = Vec::new();
        // Which lease lists which GPU from when: (lease, start, end, gpus).
        let mut spans: Vec<(String, i64, i64, Vec<&str>)> = Vec::new();
        for lease in 0..4 {
            let id = format!("L{lease}");
            let mut t = H + rng.below(2 * HOUR as u64) as i64 - HOUR / 2;
            let mut kind = "granted";
            let released = rng.below(3) != 0;
            for _ in 0..1 + rng.below(3) {
                let count = 1 + rng.below(3) as usize;
                let offset = rng.below(4) as usize;
                let on: Vec<&str> = (0..count).map(|i| gpus[(offset + i) % 4]).collect();
                events.push(event(0, kind, &id, "t", count as u32, &on));
                events.last_mut().unwrap().ts_ms = t;
                let next = t + 1 + rng.below(HOUR as u64) as i64;
                spans.push((id.clone(), t, next, on));
                t = next;
                kind = "resized";
            }
            if released {
                events.push(event(0, "released", &id, "t", 1, &[]));
                events.last_mut().unwrap().ts_ms = t;
            } else {
                spans.last_mut().unwrap().2 = i64::MAX;
            }
        }

        let mut samples = Vec::new();
        let mut total_ms = 0;
        for (i, gpu) in gpus.iter().enumerate() {
            let mut previous = H - HOUR / 2 + rng.below(HOUR as u64) as i64;
            loop {
                // Mostly every 10 s to 5 min, sometimes a gap of up to an hour.
                let step = if rng.below(10) == 0 {
                    1 + rng.below(HOUR as u64) as i64
                } else {
                    10_000 + rng.below(290_000) as i64
                };
                let ts = previous + step;
                if ts > end {
                    break;
                }
                // A dropped sample leaves its interval unobserved.
                if rng.below(15) != 0 {
                    // Name the lease holding the GPU a few minutes off ts (a lagging exporter),
                    // or none.
                    let when = ts + rng.below(10 * MIN as u64) as i64 - 5 * MIN;
                    let named = spans
                        .iter()
                        .find(|s| s.1 <= when && when < s.2 && s.3.contains(gpu))
                        .filter(|_| rng.below(2) == 0)
                        .map(|s| s.0.clone());
                    let util = [0.0, 3.0, 50.0, 100.0][rng.below(4) as usize];
                    let mut s = sample(gpu, H100, &format!("h{i}"), 0, util, Some(200.0), None);
                    (s.ts_ms, s.interval_ms, s.lease_id) = (ts, step, named);
                    total_ms += step;
                    samples.push(s);
                }
                previous = ts;
            }
        }
        put(&lake, "samples", "random", &samples, |s| s.ts_ms);
        put(&lake, "lease_events", "random", &events, |e| e.ts_ms);
        let report = rt
            .block_on(Rollup::new(lake.clone(), options()).run())
            .unwrap();
        let watermark = report.watermark.unwrap();

        let mut observed_ms = 0.0;
        for ((hour, lease), row) in lease_hourly(&rt, &lake) {
            let [allocated, observed, busy, idle] = [
                "allocated_gpu_hours",
                "observed_gpu_hours",
                "busy_gpu_hours",
                "idle_gpu_hours",
            ]
            .map(|c| row[c].as_f64().unwrap());
            observed_ms += observed * HOUR as f64;
            let slack = 1e-9;
            let what = format!("seed {seed}, hour {hour}, lease {lease:?}");
            assert!(
                busy <= observed + slack,
                "{what}: busy {busy} > observed {observed}"
            );
            assert!(
                idle <= observed + slack,
                "{what}: idle {idle} > observed {observed}"
            );
            if H + (hour + 1) * HOUR <= watermark {
                assert!(
                    observed <= allocated + slack,
                    "{what}: observed {observed} > allocated {allocated}"
                );
            }
        }
        assert!(
            (observed_ms - total_ms as f64).abs() < 1e-3,
            "seed {seed}: the hours hold {observed_ms} ms, the samples {total_ms} ms"
        );
    }
}

/// Every row of a rollup table as text, floats to 9 significant digits (sums taken in another
/// order differ in the last bits), sorted.
fn table_rows(rt: &tokio::runtime::Runtime, lake: &Lake, table: &str) -> Vec<String> {
    fn canonical(value: &Value) -> String {
        match value {
            Value::Number(n) if n.is_f64() => format!("{:.8e}", n.as_f64().unwrap()),
            Value::Object(fields) => fields
                .iter()
                .map(|(k, v)| format!("{k}={}", canonical(v)))
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        }
    }
    let mut rows: Vec<String> = rows(rt, lake, &format!("SELECT * FROM {table}"))
        .iter()
        .map(canonical)
        .collect();
    rows.sort();
    rows
}

/// Asserts that every rollup table of `actual` has the rows of `expected`'s (each with more
/// than `at_least` rows), naming the first difference.
fn same_tables(
    rt: &tokio::runtime::Runtime,
    (expected_lake, expected_how): (&Lake, &str),
    (actual_lake, actual_how): (&Lake, &str),
    at_least: usize,
) {
    for table in ["gpu_hourly", "lease_hourly", "team_hourly", "focus_costs"] {
        let (expected, actual) = (
            table_rows(rt, expected_lake, table),
            table_rows(rt, actual_lake, table),
        );
        assert!(expected.len() > at_least, "{table}: {expected:?}");
        if let Some(i) =
            (0..expected.len().max(actual.len())).find(|&i| expected.get(i) != actual.get(i))
        {
            panic!(
                "{table}: {} rows {actual_how}, {} {expected_how}; first difference:\n  {actual_how}: {:?}\n  {expected_how}: {:?}",
                actual.len(),
                expected.len(),
                actual.get(i),
                expected.get(i)
            );
        }
    }
}

/// An hour with more samples than `part_rows` is computed a part at a time, its samples split
/// by GPU: every rollup table comes out as when the hour is computed at once, with duplicates
/// in other files, lease edges, leases listing no GPU and unknown leases among the samples.
#[test]
fn an_hour_computed_in_parts_by_gpu_is_the_hour_computed_at_once() {
    let rt = rt();
    let mut rng = Rng(23);
    let gpus: Vec<String> = (0..40).map(|i| format!("g{i:02}")).collect();
    let models = [H100, A100, T4];
    let teams = ["ml", "web", "research"];
    let mut events = Vec::new();
    for lease in 0..8usize {
        let id = format!("L{lease}");
        let team = teams[lease % 3];
        let on: Vec<&str> = (0..3)
            .map(|j| gpus[(lease * 5 + j) % 40].as_str())
            .collect();
        let listed: &[&str] = if lease == 7 { &[] } else { &on };
        let granted = H + rng.below(HOUR as u64) as i64 - HOUR / 2;
        events.push(event(0, "granted", &id, team, 3, listed));
        events.last_mut().unwrap().ts_ms = granted;
        if lease % 2 == 0 {
            events.push(event(0, "released", &id, team, 1, &[]));
            events.last_mut().unwrap().ts_ms = granted + 1 + rng.below(HOUR as u64) as i64;
        }
    }
    let (mut samples, mut copies) = (Vec::new(), Vec::new());
    for (i, gpu) in gpus.iter().enumerate() {
        let mut ts = H - HOUR / 2 + rng.below(MIN as u64) as i64;
        while ts < H + 2 * HOUR {
            let step = 20_000 + rng.below(60_000) as i64;
            let lease = match rng.below(6) {
                0 | 1 => Some(format!("L{}", (i / 5) % 8)),
                2 => Some("ghost".to_string()),
                _ => None,
            };
            let util = [0.0, 3.0, 50.0, 100.0][rng.below(4) as usize];
            let mut s = sample(
                gpu,
                models[i % 3],
                &format!("h{}", i / 8),
                0,
                util,
                Some(100.0 + i as f64),
                lease.as_deref(),
            );
            (s.ts_ms, s.interval_ms) = (ts, step);
            if rng.below(20) == 0 {
                // Delivered again, in another file, disagreeing.
                let mut copy = s.clone();
                copy.util_gpu_pct = 100.0 - util;
                copy.lease_id = None;
                copies.push(copy);
            }
            samples.push(s);
            ts += step;
        }
    }
    let lake_of = |part_rows: usize| {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        put(&lake, "samples", "a", &samples, |s| s.ts_ms);
        put(&lake, "samples", "b", &copies, |s| s.ts_ms);
        put(&lake, "lease_events", "events", &events, |e| e.ts_ms);
        let options = RollupOptions {
            part_rows,
            ..options()
        };
        let report = rt
            .block_on(Rollup::new(lake.clone(), options).run())
            .unwrap();
        assert!(report.hours >= 3, "{report:?}");
        assert!(
            !dir.path().join("rollups/_tmp").exists(),
            "an hour's parts are removed once it is computed"
        );
        (dir, lake)
    };
    let (_whole_dir, whole) = lake_of(gpuwarden_pipeline::rollup::DEFAULT_PART_ROWS);
    // About 2,900 samples an hour (and the next hour's): a dozen parts.
    let (_parts_dir, parts) = lake_of(250);
    same_tables(&rt, (&whole, "at once"), (&parts, "in parts"), 10);
}

/// A pipeline's rollup runs every minute or so on a lake that grows: each run starts from the
/// partials the last one kept and reads only the samples after them. Whatever order the data
/// arrive in (in time, late by up to half an hour, duplicates disagreeing with what came
/// first, lease events late) and wherever the process restarts, the tables come out as one run
/// over the whole lake computes them.
#[test]
fn incremental_runs_equal_a_run_from_scratch_whatever_the_arrival_order() {
    let rt = rt();
    for seed in [5, 17, 41] {
        let mut rng = Rng(seed);
        let gpus: Vec<String> = (0..24).map(|i| format!("g{i:02}")).collect();
        let models = [H100, A100, T4];
        let teams = ["ml", "web", "research"];
        let mut events = Vec::new();
        // The last fleet has no lease events at all: the lake has no such table.
        let leases = if seed == 41 { 0 } else { 10 };
        for lease in 0..leases {
            let id = format!("L{lease}");
            let team = teams[lease % 3];
            let on = |shift: usize| -> Vec<&str> {
                (0..3)
                    .map(|j| gpus[(lease * 3 + j + shift) % 24].as_str())
                    .collect()
            };
            let first = on(0);
            let listed: &[&str] = if lease == 9 { &[] } else { &first };
            let granted = H - HOUR / 2 + rng.below(2 * HOUR as u64) as i64;
            events.push(event(0, "granted", &id, team, 3, listed));
            events.last_mut().unwrap().ts_ms = granted;
            let mut at = granted;
            if lease % 3 == 1 {
                at += 1 + rng.below(HOUR as u64) as i64;
                let moved = on(1);
                events.push(event(0, "resized", &id, team, 2, &moved[..2]));
                events.last_mut().unwrap().ts_ms = at;
            }
            if lease % 2 == 0 {
                events.push(event(0, "released", &id, team, 1, &[]));
                events.last_mut().unwrap().ts_ms = at + 1 + rng.below(HOUR as u64) as i64;
            }
        }
        let end = H + 2 * HOUR;
        let mut samples = Vec::new();
        for (i, gpu) in gpus.iter().enumerate() {
            let mut ts = H - HOUR / 2 + rng.below(MIN as u64) as i64;
            while ts < end {
                let step = 15_000 + rng.below(60_000) as i64;
                let lease = match rng.below(6) {
                    0 | 1 => Some(format!("L{}", i / 3 % 10)),
                    2 => Some("ghost".to_string()),
                    _ => None,
                };
                let util = [0.0, 3.0, 50.0, 100.0][rng.below(4) as usize];
                let mut s = sample(
                    gpu,
                    models[i % 3],
                    &format!("h{}", i / 8),
                    0,
                    util,
                    (rng.below(5) > 0).then_some(100.0 + i as f64),
                    lease.as_deref(),
                );
                (s.ts_ms, s.interval_ms) = (ts, step);
                if rng.below(25) == 0 {
                    // Delivered again later, disagreeing.
                    let mut copy = s.clone();
                    copy.util_gpu_pct = 100.0 - util;
                    copy.lease_id = None;
                    copy.mem_used_bytes += 7;
                    samples.push(copy);
                }
                samples.push(s);
                ts += step;
            }
        }
        // Arrival: in windows of four minutes, as a pipeline's flushes land; one sample in 300
        // and one lease event in 8 land up to half an hour late.
        let window = 4 * MIN;
        let arrival = |ts: i64, late: bool, rng: &mut Rng| -> i64 {
            let at = ts
                + if late {
                    rng.below(30 * MIN as u64) as i64
                } else {
                    0
                };
            (at.max(H - HOUR) - (H - HOUR)) / window
        };
        let mut sample_chunks: BTreeMap<i64, Vec<Sample>> = BTreeMap::new();
        for s in &samples {
            let chunk = arrival(s.ts_ms, rng.below(300) == 0, &mut rng);
            sample_chunks.entry(chunk).or_default().push(s.clone());
        }
        let mut event_chunks: BTreeMap<i64, Vec<LeaseEvent>> = BTreeMap::new();
        for e in &events {
            let chunk = arrival(e.ts_ms, rng.below(8) == 0, &mut rng);
            event_chunks.entry(chunk).or_default().push(e.clone());
        }
        let last = *sample_chunks
            .keys()
            .chain(event_chunks.keys())
            .max()
            .unwrap();

        let (_dir, lake) = {
            let dir = tempfile::tempdir().unwrap();
            let lake = Lake::open(dir.path()).unwrap();
            (dir, lake)
        };
        let mut rollup = Rollup::new(lake.clone(), options());
        let (mut hours, mut incremental, mut restarts) = (0, 0, 0);
        for chunk in 0..=last {
            if let Some(events) = event_chunks.get(&chunk) {
                put(&lake, "lease_events", &format!("e{chunk}"), events, |e| {
                    e.ts_ms
                });
            }
            if let Some(samples) = sample_chunks.get(&chunk) {
                put(&lake, "samples", &format!("s{chunk}"), samples, |s| s.ts_ms);
            }
            if rng.below(10) == 0 {
                rollup = Rollup::new(lake.clone(), options());
                restarts += 1;
            }
            let report = rt.block_on(rollup.run()).unwrap();
            hours += report.hours;
            incremental += report.incremental_hours;
        }
        // Restarts, late samples and late lease events make hours computed whole again.
        assert!(
            incremental * 3 >= hours,
            "seed {seed}: a third of the hours at least start from kept partials ({incremental} of {hours}, {restarts} restarts)"
        );

        let (_scratch_dir, scratch) = {
            let dir = tempfile::tempdir().unwrap();
            let lake = Lake::open(dir.path()).unwrap();
            (dir, lake)
        };
        put(&scratch, "samples", "all", &samples, |s| s.ts_ms);
        if !events.is_empty() {
            put(&scratch, "lease_events", "all", &events, |e| e.ts_ms);
        }
        let whole = rt
            .block_on(Rollup::new(scratch.clone(), options()).run())
            .unwrap();
        assert_eq!(whole.incremental_hours, 0);
        same_tables(
            &rt,
            (&scratch, "from scratch"),
            (&lake, &format!("incrementally (seed {seed})")),
            5,
        );
    }
}

/// A sample of any fields (the interval one minute, ending at minute `k` after H).
fn sample_of(k: i64, fields: Value) -> Sample {
    let mut s = json!({"v": 1, "ts_ms": H + k * MIN, "interval_ms": MIN, "host": "h1",
        "gpu_model": H100, "mem_used_bytes": 1000, "mem_total_bytes": 1_000_000});
    for (key, value) in fields.as_object().unwrap() {
        s[key] = value.clone();
    }
    Sample::from_json(s.to_string().as_bytes()).unwrap()
}

/// A lease's grant at minute `k`, of `workload`, on `gpus` (as many as it lists).
fn grant(k: i64, lease: &str, team: &str, workload: &str, gpus: &[&str]) -> LeaseEvent {
    let e = json!({"v": 1, "ts_ms": H + k * MIN, "event": "granted", "lease_id": lease,
        "team": team, "user": "u", "project": "p", "workload": workload, "substrate": "sim",
        "gpu_model": H100, "gpu_count": gpus.len(), "gpu_uuids": gpus});
    LeaseEvent::from_json(e.to_string().as_bytes()).unwrap()
}

/// One directory lake with `samples` and `events`, rolled up with `options`; H's `lease_hourly`
/// rows by lease id ("" for unallocated).
fn rolled_up(
    samples: &[Sample],
    events: &[LeaseEvent],
    options: RollupOptions,
) -> (tempfile::TempDir, Lake, BTreeMap<String, Value>) {
    let dir = tempfile::tempdir().unwrap();
    let lake = Lake::open(dir.path().join("lake")).unwrap();
    put(&lake, "samples", "s", samples, |s| s.ts_ms);
    put(&lake, "lease_events", "s", events, |e| e.ts_ms);
    let rt = rt();
    rt.block_on(Rollup::new(lake.clone(), options).run())
        .unwrap();
    let hour = lease_hourly(&rt, &lake)
        .into_iter()
        .filter(|((h, _), _)| *h == 0)
        .map(|((_, lease), row)| (lease, row))
        .collect();
    (dir, lake, hour)
}

/// An hour of samples of one GPU, a minute each, with `fields` besides the time.
fn hour_of_gpu(gpu: &str, fields: impl Fn(i64) -> Value) -> Vec<Sample> {
    (1..=60)
        .map(|k| {
            let mut f = fields(k);
            f["gpu_uuid"] = json!(gpu);
            sample_of(k, f)
        })
        .collect()
}

/// Idleness by SM activity (docs/src/finops/definitions.md#idle): a GPU spinning at 100 %
/// utilization with 2 % of its SMs active is idle for a workload judged by `sm_active` and
/// busy for one judged by `util`; a GPU without GPM is judged by utilization whatever its
/// workload asks, and a row says which measure judged its time (`mixed` when both did).
#[test]
fn a_spinning_gpu_is_idle_by_sm_activity_and_a_gpu_without_gpm_falls_back_to_utilization() {
    let mut samples = hour_of_gpu(
        "spin",
        |_| json!({"util_gpu_pct": 100.0, "sm_active_pct": 2.0}),
    );
    samples.extend(hour_of_gpu("old", |_| json!({"util_gpu_pct": 100.0})));
    // GPM for the first half hour only: half the time judged each way.
    samples.extend(hour_of_gpu("half", |k| {
        if k <= 30 {
            json!({"util_gpu_pct": 100.0, "sm_active_pct": 50.0})
        } else {
            json!({"util_gpu_pct": 100.0})
        }
    }));
    // No lease: judged by pricing.idle_measure.
    samples.extend(hour_of_gpu(
        "free",
        |_| json!({"util_gpu_pct": 100.0, "sm_active_pct": 1.0}),
    ));
    let events = [
        grant(0, "LS", "spin", "training", &["spin"]),
        grant(0, "LO", "old", "training", &["old"]),
        grant(0, "LH", "half", "training", &["half"]),
    ];
    let training_by_sm = RollupOptions {
        idle_measures: [(gpuwarden_schema::Workload::Training, IdleMeasure::SmActive)].into(),
        ..options()
    };
    // Per lease: idle GPU-hours, the measure, SM-active and GPM-observed GPU-hours.
    let expect = |rows: &BTreeMap<String, Value>, lease: &str, want: (f64, &str, f64, f64)| {
        let row = &rows[lease];
        close(
            &row["observed_gpu_hours"],
            1.0,
            &format!("{lease} observed"),
        );
        close(&row["busy_gpu_hours"], 1.0, &format!("{lease} busy"));
        close(&row["idle_gpu_hours"], want.0, &format!("{lease} idle"));
        close(
            &row["idle_cost_usd"],
            want.0 * 4.0,
            &format!("{lease} idle cost"),
        );
        assert_eq!(row["idle_measure"], json!(want.1), "{lease} idle_measure");
        close(
            &row["sm_active_gpu_hours"],
            want.2,
            &format!("{lease} SM-active"),
        );
        close(
            &row["gpm_observed_gpu_hours"],
            want.3,
            &format!("{lease} GPM-observed"),
        );
    };
    let (_dir, lake, rows) = rolled_up(&samples, &events, training_by_sm);
    expect(&rows, "LS", (1.0, "sm_active", 0.02, 1.0));
    expect(&rows, "LO", (0.0, "util", 0.0, 0.0));
    expect(&rows, "LH", (0.0, "mixed", 0.25, 0.5));
    expect(&rows, "", (0.0, "util", 0.01, 1.0));
    let rt = rt();
    let gpus = rows_by(&rt, &lake, "SELECT gpu_uuid AS k, idle_gpu_hours, idle_measure, sm_active_gpu_hours FROM gpu_hourly WHERE CAST(hour AS BIGINT) = 1795996800000");
    assert_eq!(gpus["spin"]["idle_measure"], json!("sm_active"));
    close(
        &gpus["spin"]["idle_gpu_hours"],
        1.0,
        "spin idle in gpu_hourly",
    );
    assert_eq!(gpus["half"]["idle_measure"], json!("mixed"));
    let teams = rows_by(&rt, &lake, "SELECT team AS k, idle_gpu_hours, idle_measure FROM team_hourly WHERE CAST(hour AS BIGINT) = 1795996800000");
    assert_eq!(teams["spin"]["idle_measure"], json!("sm_active"));
    assert_eq!(teams["half"]["idle_measure"], json!("mixed"));

    // Judged by utilization, the same GPU is busy; SM activity is still measured.
    let (_dir, _, rows) = rolled_up(&samples, &events, options());
    expect(&rows, "LS", (0.0, "util", 0.02, 1.0));
    expect(&rows, "LH", (0.0, "util", 0.25, 0.5));

    // pricing.idle_measure judges every lease without one of its own, and unallocated time.
    let mut all_by_sm = options();
    all_by_sm.pricing.idle_measure = IdleMeasure::SmActive;
    let (_dir, _, rows) = rolled_up(&samples, &events, all_by_sm);
    expect(&rows, "LS", (1.0, "sm_active", 0.02, 1.0));
    expect(&rows, "LO", (0.0, "util", 0.0, 0.0));
    expect(&rows, "", (1.0, "sm_active", 0.01, 1.0));
}

/// Rows of `query` keyed by its column `k`.
fn rows_by(rt: &tokio::runtime::Runtime, lake: &Lake, query: &str) -> BTreeMap<String, Value> {
    rows(rt, lake, query)
        .into_iter()
        .map(|r| (r["k"].as_str().unwrap_or_default().to_owned(), r))
        .collect()
}

/// The worked MIG case of docs/src/finops/definitions.md#mig-slices: an H100 ($4 an hour)
/// split into seven `1g.10gb` slices, three held by team a, two by b, one by c (idle) and one
/// by nobody, costs $4 an hour in all: a pays 3/7 of it, b 2/7, c 1/7, and the free slice is
/// 1/7 of unallocated capacity. A second H100 with one `3g.40gb` slice (team d) leaves 4/7
/// unsliced: unallocated. Each slice sample carries a seventh of its GPU's 350 W per slice.
#[test]
fn a_gpu_split_into_mig_slices_costs_what_the_whole_gpu_costs() {
    let slice_model = format!("{H100} MIG 1g.10gb");
    let mut samples = Vec::new();
    for i in 0..7 {
        let util = if i == 5 { 0.0 } else { 80.0 };
        samples.extend(hour_of_gpu(&format!("MIG-{i}"), |_| {
            json!({"gpu_model": slice_model, "util_gpu_pct": util, "power_w": 50.0,
                   "mig_profile": "1g.10gb", "mig_parent_uuid": "GPU-P", "mig_slices": 1,
                   "mig_parent_slices": 7})
        }));
    }
    samples.extend(hour_of_gpu("MIG-Q", |_| {
        json!({"gpu_model": format!("{H100} MIG 3g.40gb"), "util_gpu_pct": 100.0,
               "power_w": 150.0, "mig_profile": "3g.40gb", "mig_parent_uuid": "GPU-Q",
               "mig_slices": 3, "mig_parent_slices": 7})
    }));
    // The unsliced rest of GPU-Q: its parent's UUID, no profile, the free slices.
    samples.extend(hour_of_gpu(
        "GPU-Q",
        |_| json!({"util_gpu_pct": 0.0, "power_w": 200.0, "mig_slices": 4, "mig_parent_slices": 7}),
    ));
    let events = [
        grant(0, "La", "a", "training", &["MIG-0", "MIG-1", "MIG-2"]),
        grant(0, "Lb", "b", "training", &["MIG-3", "MIG-4"]),
        grant(0, "Lc", "c", "notebook", &["MIG-5"]),
        grant(0, "Ld", "d", "training", &["MIG-Q"]),
    ];
    let (_dir, lake, rows) = rolled_up(&samples, &events, options());
    let seventh = 1.0 / 7.0;
    for (lease, slices, idle, energy) in [
        ("La", 3.0, 0.0, 0.15),
        ("Lb", 2.0, 0.0, 0.1),
        ("Lc", 1.0, 1.0, 0.05),
        ("Ld", 3.0, 0.0, 0.15),
    ] {
        let row = &rows[lease];
        let share = slices * seventh;
        close(
            &row["allocated_gpu_hours"],
            share,
            &format!("{lease} allocated"),
        );
        close(
            &row["observed_gpu_hours"],
            share,
            &format!("{lease} observed"),
        );
        close(&row["cost_usd"], share * 4.0, &format!("{lease} cost"));
        close(
            &row["idle_gpu_hours"],
            idle * share,
            &format!("{lease} idle"),
        );
        close(&row["energy_kwh"], energy, &format!("{lease} energy"));
    }
    close(
        &rows["La"]["busy_gpu_hours"],
        3.0 * seventh * 0.8,
        "La busy",
    );
    let rt = rt();
    let teams = rows_by(
        &rt,
        &lake,
        "SELECT team || ' ' || gpu_model AS k, cost_usd, allocated_gpu_hours, energy_kwh \
         FROM team_hourly WHERE CAST(hour AS BIGINT) = 1795996800000",
    );
    // The free 1g slice and the unsliced 4/7 of GPU-Q, each priced as its H100.
    close(
        &teams[&format!("(unallocated) {slice_model}")]["cost_usd"],
        seventh * 4.0,
        "the free slice",
    );
    close(
        &teams[&format!("(unallocated) {H100}")]["cost_usd"],
        4.0 * seventh * 4.0,
        "GPU-Q's unsliced rest",
    );
    // GPU-P: a, b, c and the free slice add up to the whole H100's hour.
    let gpu_p: f64 = ["a", "b", "c"]
        .iter()
        .map(|t| teams[&format!("{t} {H100}")]["cost_usd"].as_f64().unwrap())
        .sum::<f64>()
        + teams[&format!("(unallocated) {slice_model}")]["cost_usd"]
            .as_f64()
            .unwrap();
    close(&json!(gpu_p), 4.0, "GPU-P costs one H100-hour");
    let total: f64 = teams
        .values()
        .map(|r| r["cost_usd"].as_f64().unwrap())
        .sum();
    close(&json!(total), 8.0, "two H100s, one hour");
    let energy: f64 = teams
        .values()
        .map(|r| r["energy_kwh"].as_f64().unwrap())
        .sum();
    close(&json!(energy), 0.7, "two GPUs at 350 W");
    // gpu_hourly counts each slice in GPU-equivalents.
    let gpus = rows_by(
        &rt,
        &lake,
        "SELECT gpu_uuid AS k, observed_gpu_hours FROM gpu_hourly \
         WHERE CAST(hour AS BIGINT) = 1795996800000",
    );
    close(&gpus["MIG-0"]["observed_gpu_hours"], seventh, "a 1g slice");
    close(
        &gpus["GPU-Q"]["observed_gpu_hours"],
        4.0 * seventh,
        "GPU-Q's rest",
    );
}

/// Energy priced (docs/src/finops/definitions.md#energy): `energy_cost_usd` = kWh × the price
/// of a kWh, `co2e_kg` = kWh × grams per kWh / 1000, in every rollup and in FOCUS's `x_`
/// columns; without a factor there are no emissions figures.
#[test]
fn energy_cost_and_emissions_follow_the_kwh_in_team_hourly_and_focus() {
    // One GPU at 300 W for an hour (0.3 kWh) under L1, one at 150 W for an hour, no lease.
    let mut samples = hour_of_gpu("g1", |_| json!({"util_gpu_pct": 50.0, "power_w": 300.0}));
    samples.extend(hour_of_gpu(
        "g2",
        |_| json!({"util_gpu_pct": 50.0, "power_w": 150.0}),
    ));
    let events = [grant(0, "L1", "ml", "training", &["g1"])];
    let mut priced = options();
    priced.pricing.energy_usd_per_kwh = 0.25;
    priced.pricing.co2e_g_per_kwh = Some(400.0);
    let mut unpriced = priced.clone();
    let (_dir, lake, rows) = rolled_up(&samples, &events, priced);
    close(&rows["L1"]["energy_cost_usd"], 0.075, "L1 energy cost");
    close(&rows["L1"]["co2e_kg"], 0.12, "L1 CO2e");
    close(
        &rows[""]["energy_cost_usd"],
        0.0375,
        "unallocated energy cost",
    );
    let rt = rt();
    let hour = "CAST(hour AS BIGINT) = 1795996800000";
    let teams = rows_by(
        &rt,
        &lake,
        &format!(
            "SELECT team AS k, energy_kwh, energy_cost_usd, co2e_kg FROM team_hourly WHERE {hour}"
        ),
    );
    close(&teams["ml"]["energy_kwh"], 0.3, "ml kWh");
    close(&teams["ml"]["energy_cost_usd"], 0.075, "ml energy cost");
    close(&teams["ml"]["co2e_kg"], 0.12, "ml CO2e");
    close(&teams["(unallocated)"]["co2e_kg"], 0.06, "unallocated CO2e");
    let focus = rows_by(
        &rt,
        &lake,
        r#"SELECT COALESCE("ResourceId", '') AS k, CAST("x_EnergyCost" AS DOUBLE) AS cost,
                  "x_Co2eKg" AS co2e, "x_EnergyKwh" AS kwh, "x_SmActiveGpuHours" AS sm
           FROM focus_costs"#,
    );
    close(&focus["L1"]["cost"], 0.075, "x_EnergyCost");
    close(&focus["L1"]["co2e"], 0.12, "x_Co2eKg");
    close(&focus["L1"]["kwh"], 0.3, "x_EnergyKwh");
    close(&focus[""]["cost"], 0.0375, "unallocated x_EnergyCost");
    close(&focus["L1"]["sm"], 0.0, "no GPM, no SM-active hours");
    let usage = rows_by(
        &rt,
        &lake,
        "SELECT lease_id AS k, energy_cost_usd, co2e_kg FROM lease_usage",
    );
    close(
        &usage["L1"]["energy_cost_usd"],
        0.075,
        "lease_usage energy cost",
    );
    close(&usage["L1"]["co2e_kg"], 0.12, "lease_usage CO2e");

    // No factor: no emissions figures; energy at no price costs nothing.
    unpriced.pricing.energy_usd_per_kwh = 0.0;
    unpriced.pricing.co2e_g_per_kwh = None;
    let (_dir, _, rows) = rolled_up(&samples, &events, unpriced);
    assert!(rows["L1"]["co2e_kg"].is_null(), "{}", rows["L1"]);
    close(&rows["L1"]["energy_cost_usd"], 0.0, "free energy");
}
