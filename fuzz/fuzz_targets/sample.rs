//! Samples as the pipeline reads them from `gpuwarden.samples`: its ingest and signals loop decode
//! with `SampleRow::from_json` (sonic-rs, borrowing strings) and append to a `SampleBuilder`. The
//! contract's decoder, `Sample::from_json` (serde_json), must agree with that hot path on every
//! input: both accept or both refuse, with the same record and the same refusal, and the hot
//! path's Arrow batch must read back as the contract's record. `check_record` checks the
//! contract's decoder itself.
#![no_main]

use gpuwarden_schema::sample_row::{SampleBuilder, SampleRow};
use gpuwarden_schema::{Record, Sample};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let contract = gpuwarden_fuzz::check_record::<Sample>(bytes);
    match (SampleRow::from_json(bytes), contract) {
        (Ok(row), Some(sample)) => {
            assert_eq!(to_sample(&row), sample, "the hot path read another sample");
            let mut builder = SampleBuilder::default();
            builder.append(&row);
            let batch = builder.finish().expect("a batch of one valid sample");
            assert_eq!(batch.schema(), Sample::arrow_schema());
            let back = Sample::from_record_batch(&batch).expect("the hot path's batch reads back");
            assert_eq!(
                back,
                vec![sample],
                "the hot path's batch holds another sample"
            );
        }
        (Err(hot), None) => {
            let err = Sample::from_json(bytes).expect_err("refused above");
            assert_eq!(
                hot.to_string(),
                err.to_string(),
                "the two decoders refuse differently"
            );
        }
        (Ok(row), None) => panic!(
            "the hot path accepts what the contract refuses ({}): {row:?}",
            Sample::from_json(bytes).expect_err("refused above")
        ),
        (Err(err), Some(sample)) => {
            panic!("the hot path refuses a valid sample ({err}): {sample:?}")
        }
    }
});

fn to_sample(row: &SampleRow<'_>) -> Sample {
    let text =
        |t: &Option<gpuwarden_schema::sample_row::Text<'_>>| t.as_ref().map(|t| t.to_string());
    Sample {
        v: row.v,
        ts_ms: row.ts_ms,
        interval_ms: row.interval_ms,
        host: row.host.to_string(),
        gpu_uuid: row.gpu_uuid.to_string(),
        gpu_model: row.gpu_model.to_string(),
        util_gpu_pct: row.util_gpu_pct,
        mem_used_bytes: row.mem_used_bytes,
        mem_total_bytes: row.mem_total_bytes,
        gpu_index: row.gpu_index,
        pci_bus_id: text(&row.pci_bus_id),
        util_mem_pct: row.util_mem_pct,
        power_w: row.power_w,
        power_limit_w: row.power_limit_w,
        energy_mj: row.energy_mj,
        temp_c: row.temp_c,
        sm_clock_mhz: row.sm_clock_mhz,
        process_count: row.process_count,
        lease_id: text(&row.lease_id),
        mig_profile: text(&row.mig_profile),
        labels: row.labels.clone(),
        sm_active_pct: row.sm_active_pct,
        sm_occupancy_pct: row.sm_occupancy_pct,
        tensor_active_pct: row.tensor_active_pct,
        dram_active_pct: row.dram_active_pct,
        gr_active_pct: row.gr_active_pct,
        mig_parent_uuid: text(&row.mig_parent_uuid),
        mig_slices: row.mig_slices,
        mig_parent_slices: row.mig_parent_slices,
        serving_requests: row.serving_requests,
    }
}
