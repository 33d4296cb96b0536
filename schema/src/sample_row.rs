//! The pipeline's hot path for samples: a [`SampleRow`] borrows its strings from the message
//! bytes (no allocation unless a string has escapes), is checked by the same rules as
//! [`Sample`], and is appended straight to the Arrow builders of a
//! [`SampleBuilder`], whose batches have exactly [`Sample`]'s lake schema.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use arrow_array::builder::{Float64Builder, Int64Builder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, Schema};
use serde::de::{Deserializer, Visitor};
use serde::Deserialize;

use crate::error::{DecodeError, ValidationError};
use crate::record::{decode_named, Record};
use crate::sample::{check, check_extra, Extra};
use crate::version::V1;
use crate::Sample;

/// A string borrowed from the input when it has no escapes, owned otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for TextVisitor<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(TextVisitor(std::marker::PhantomData))
    }
}

impl std::ops::Deref for Text<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// A Sample decoded without copying its strings. Same fields and rules as [`Sample`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[allow(missing_docs)]
// serde names the struct in its messages; they must be the same as Sample's.
#[serde(expecting = "struct Sample")]
pub struct SampleRow<'a> {
    pub v: V1,
    pub ts_ms: i64,
    pub interval_ms: i64,
    #[serde(borrow)]
    pub host: Text<'a>,
    #[serde(borrow)]
    pub gpu_uuid: Text<'a>,
    #[serde(borrow)]
    pub gpu_model: Text<'a>,
    pub util_gpu_pct: f64,
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
    pub gpu_index: Option<u32>,
    #[serde(borrow)]
    pub pci_bus_id: Option<Text<'a>>,
    pub util_mem_pct: Option<f64>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub energy_mj: Option<u64>,
    pub temp_c: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub process_count: Option<u32>,
    #[serde(borrow)]
    pub lease_id: Option<Text<'a>>,
    #[serde(borrow)]
    pub mig_profile: Option<Text<'a>>,
    pub labels: Option<BTreeMap<String, String>>,
    pub sm_active_pct: Option<f64>,
    pub sm_occupancy_pct: Option<f64>,
    pub tensor_active_pct: Option<f64>,
    pub dram_active_pct: Option<f64>,
    pub gr_active_pct: Option<f64>,
    #[serde(borrow)]
    pub mig_parent_uuid: Option<Text<'a>>,
    pub mig_slices: Option<u32>,
    pub mig_parent_slices: Option<u32>,
    pub serving_requests: Option<f64>,
}

impl<'a> SampleRow<'a> {
    /// Decodes and validates one JSON sample; the errors are [`Sample::from_json`]'s.
    pub fn from_json(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        // The hot path of ingest: sonic-rs parses with SIMD. Anything it refuses goes through
        // serde_json, whose errors name the field (and which has the last word on validity).
        let row: SampleRow<'a> = match sonic_rs::from_slice(bytes) {
            Ok(row) if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') => row,
            _ => decode_named(bytes, Sample::NAME)?,
        };
        row.validate()?;
        Ok(row)
    }

    /// The rules of the Sample contract.
    pub fn validate(&self) -> Result<(), ValidationError> {
        check(
            self.interval_ms,
            self.util_gpu_pct,
            self.mem_used_bytes,
            self.mem_total_bytes,
            self.energy_mj,
        )?;
        check_extra(&Extra {
            gpm: [
                self.sm_active_pct,
                self.sm_occupancy_pct,
                self.tensor_active_pct,
                self.dram_active_pct,
                self.gr_active_pct,
            ],
            mig_slices: self.mig_slices,
            mig_parent_slices: self.mig_parent_slices,
            serving_requests: self.serving_requests,
        })
    }
}

/// Arrow builders for the `samples` table; rows go in one at a time, batches come out with
/// [`Sample::arrow_schema`].
#[derive(Debug)]
pub struct SampleBuilder {
    ts_ms: Int64Builder,
    interval_ms: Int64Builder,
    host: StringBuilder,
    gpu_uuid: StringBuilder,
    gpu_model: StringBuilder,
    util_gpu_pct: Float64Builder,
    mem_used_bytes: Int64Builder,
    mem_total_bytes: Int64Builder,
    gpu_index: Int64Builder,
    pci_bus_id: StringBuilder,
    util_mem_pct: Float64Builder,
    power_w: Float64Builder,
    power_limit_w: Float64Builder,
    energy_mj: Int64Builder,
    temp_c: Float64Builder,
    sm_clock_mhz: Int64Builder,
    process_count: Int64Builder,
    lease_id: StringBuilder,
    mig_profile: StringBuilder,
    labels: StringBuilder,
    gpm: [Float64Builder; 5],
    mig_parent_uuid: StringBuilder,
    mig_slices: Int64Builder,
    mig_parent_slices: Int64Builder,
    serving_requests: Float64Builder,
    rows: usize,
    bytes: usize,
}

impl Default for SampleBuilder {
    fn default() -> Self {
        // Arrow's own default sizes.
        Self::with_capacity(&SampleCapacity {
            rows: 1024,
            strings: [1024; 8],
        })
    }
}

/// How many rows, and bytes of each string column, a [`SampleBuilder`] is made for: its
/// buffers are allocated at that size once instead of doubling as rows come. Taken from a
/// batch like the ones to come ([`SampleCapacity::of`]), it saves the copies and the fresh
/// memory that growing costs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleCapacity {
    /// Rows.
    pub rows: usize,
    /// Bytes of the values of each string column, in schema order (`host`, `gpu_uuid`,
    /// `gpu_model`, `pci_bus_id`, `lease_id`, `mig_profile`, `labels`, `mig_parent_uuid`).
    pub strings: [usize; 8],
}

impl SampleCapacity {
    /// The sizes of a `samples` batch (as [`SampleBuilder::finish`] makes), or `None` for a
    /// batch of another schema.
    pub fn of(batch: &RecordBatch) -> Option<Self> {
        let mut strings = [0; 8];
        for (bytes, name) in strings.iter_mut().zip(STRING_COLUMNS) {
            *bytes = batch
                .column_by_name(name)?
                .as_any()
                .downcast_ref::<arrow_array::StringArray>()?
                .value_data()
                .len();
        }
        Some(Self {
            rows: batch.num_rows(),
            strings,
        })
    }

    /// The same sizes with `1/den` more room, so that a batch a little larger than the one
    /// measured still fits.
    pub fn with_headroom(self, den: usize) -> Self {
        let more = |n: usize| n + n / den.max(1);
        Self {
            rows: more(self.rows),
            strings: self.strings.map(more),
        }
    }
}

/// The string columns of the `samples` schema, in the order of [`SampleCapacity::strings`].
const STRING_COLUMNS: [&str; 8] = [
    "host",
    "gpu_uuid",
    "gpu_model",
    "pci_bus_id",
    "lease_id",
    "mig_profile",
    "labels",
    "mig_parent_uuid",
];

impl SampleBuilder {
    /// A builder whose buffers hold `capacity` without growing.
    pub fn with_capacity(capacity: &SampleCapacity) -> Self {
        let n = capacity.rows;
        let [host, gpu_uuid, gpu_model, pci_bus_id, lease_id, mig_profile, labels, mig_parent_uuid] =
            capacity
                .strings
                .map(|bytes| StringBuilder::with_capacity(n, bytes));
        Self {
            ts_ms: Int64Builder::with_capacity(n),
            interval_ms: Int64Builder::with_capacity(n),
            host,
            gpu_uuid,
            gpu_model,
            util_gpu_pct: Float64Builder::with_capacity(n),
            mem_used_bytes: Int64Builder::with_capacity(n),
            mem_total_bytes: Int64Builder::with_capacity(n),
            gpu_index: Int64Builder::with_capacity(n),
            pci_bus_id,
            util_mem_pct: Float64Builder::with_capacity(n),
            power_w: Float64Builder::with_capacity(n),
            power_limit_w: Float64Builder::with_capacity(n),
            energy_mj: Int64Builder::with_capacity(n),
            temp_c: Float64Builder::with_capacity(n),
            sm_clock_mhz: Int64Builder::with_capacity(n),
            process_count: Int64Builder::with_capacity(n),
            lease_id,
            mig_profile,
            labels,
            gpm: std::array::from_fn(|_| Float64Builder::with_capacity(n)),
            mig_parent_uuid,
            mig_slices: Int64Builder::with_capacity(n),
            mig_parent_slices: Int64Builder::with_capacity(n),
            serving_requests: Float64Builder::with_capacity(n),
            rows: 0,
            bytes: 0,
        }
    }
}

fn opt_str<'t>(text: &'t Option<Text<'_>>) -> Option<&'t str> {
    text.as_ref().map(|t| &*t.0)
}

impl SampleBuilder {
    /// Appends a validated row. Values past `i64::MAX` cannot occur: validation refuses them.
    pub fn append(&mut self, row: &SampleRow<'_>) {
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.ts_ms.append_value(row.ts_ms);
        self.interval_ms.append_value(row.interval_ms);
        self.host.append_value(&*row.host);
        self.gpu_uuid.append_value(&*row.gpu_uuid);
        self.gpu_model.append_value(&*row.gpu_model);
        self.util_gpu_pct.append_value(row.util_gpu_pct);
        self.mem_used_bytes.append_value(as_i64(row.mem_used_bytes));
        self.mem_total_bytes
            .append_value(as_i64(row.mem_total_bytes));
        self.gpu_index.append_option(row.gpu_index.map(i64::from));
        self.pci_bus_id.append_option(opt_str(&row.pci_bus_id));
        self.util_mem_pct.append_option(row.util_mem_pct);
        self.power_w.append_option(row.power_w);
        self.power_limit_w.append_option(row.power_limit_w);
        self.energy_mj.append_option(row.energy_mj.map(as_i64));
        self.temp_c.append_option(row.temp_c);
        self.sm_clock_mhz
            .append_option(row.sm_clock_mhz.map(i64::from));
        self.process_count
            .append_option(row.process_count.map(i64::from));
        self.lease_id.append_option(opt_str(&row.lease_id));
        self.mig_profile.append_option(opt_str(&row.mig_profile));
        self.labels.append_option(
            row.labels
                .as_ref()
                .map(|l| serde_json::to_string(l).expect("a string map serializes")),
        );
        let gpm = [
            row.sm_active_pct,
            row.sm_occupancy_pct,
            row.tensor_active_pct,
            row.dram_active_pct,
            row.gr_active_pct,
        ];
        for (builder, value) in self.gpm.iter_mut().zip(gpm) {
            builder.append_option(value);
        }
        self.mig_parent_uuid
            .append_option(opt_str(&row.mig_parent_uuid));
        self.mig_slices.append_option(row.mig_slices.map(i64::from));
        self.mig_parent_slices
            .append_option(row.mig_parent_slices.map(i64::from));
        self.serving_requests.append_option(row.serving_requests);
        self.rows += 1;
        // Fixed-width columns plus the strings: close to what the builders hold.
        self.bytes += 232
            + row.host.len()
            + row.gpu_uuid.len()
            + row.gpu_model.len()
            + opt_str(&row.pci_bus_id).map_or(0, str::len)
            + opt_str(&row.lease_id).map_or(0, str::len);
    }

    /// Rows appended since the last [`finish`](Self::finish).
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether no row is waiting.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// About how many bytes the waiting rows take in memory.
    pub fn approx_bytes(&self) -> usize {
        self.bytes
    }

    /// The waiting rows as one batch of the `samples` schema; the builder is empty afterwards.
    pub fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        let rows = self.rows;
        let v: ArrayRef = Arc::new(arrow_array::Int64Array::from(vec![
            i64::from(V1::NUMBER);
            rows
        ]));
        let columns: Vec<ArrayRef> = vec![
            v,
            Arc::new(self.ts_ms.finish()),
            Arc::new(self.interval_ms.finish()),
            Arc::new(self.host.finish()),
            Arc::new(self.gpu_uuid.finish()),
            Arc::new(self.gpu_model.finish()),
            Arc::new(self.util_gpu_pct.finish()),
            Arc::new(self.mem_used_bytes.finish()),
            Arc::new(self.mem_total_bytes.finish()),
            Arc::new(self.gpu_index.finish()),
            Arc::new(self.pci_bus_id.finish()),
            Arc::new(self.util_mem_pct.finish()),
            Arc::new(self.power_w.finish()),
            Arc::new(self.power_limit_w.finish()),
            Arc::new(self.energy_mj.finish()),
            Arc::new(self.temp_c.finish()),
            Arc::new(self.sm_clock_mhz.finish()),
            Arc::new(self.process_count.finish()),
            Arc::new(self.lease_id.finish()),
            Arc::new(self.mig_profile.finish()),
            Arc::new(self.labels.finish()),
        ];
        let mut columns = columns;
        columns.extend(
            self.gpm
                .iter_mut()
                .map(|b| Arc::new(b.finish()) as ArrayRef),
        );
        columns.push(Arc::new(self.mig_parent_uuid.finish()));
        columns.push(Arc::new(self.mig_slices.finish()));
        columns.push(Arc::new(self.mig_parent_slices.finish()));
        columns.push(Arc::new(self.serving_requests.finish()));
        self.rows = 0;
        self.bytes = 0;
        let schema: Arc<Schema> = Sample::arrow_schema();
        RecordBatch::try_new(schema, columns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_borrow_their_strings_and_build_the_same_batch_as_samples() {
        let json = br#"{"v":1,"ts_ms":5000,"interval_ms":5000,"host":"node-1","gpu_uuid":"GPU-1","gpu_model":"NVIDIA \"H100\"","util_gpu_pct":42.5,"mem_used_bytes":1,"mem_total_bytes":2,"lease_id":"l-1","labels":{"k8s_pod":"p"}}"#;
        let row = SampleRow::from_json(json).unwrap();
        assert!(
            matches!(row.host.0, Cow::Borrowed(_)),
            "no escape: borrowed"
        );
        assert!(matches!(row.gpu_model.0, Cow::Owned(_)), "escapes: owned");
        let mut builder = SampleBuilder::default();
        builder.append(&row);
        builder.append(&row);
        assert_eq!(builder.len(), 2);
        let batch = builder.finish().unwrap();
        assert!(builder.is_empty());
        let sample = Sample::from_json(json).unwrap();
        let expected = Sample::to_record_batch(&[sample.clone(), sample]).unwrap();
        assert_eq!(batch, expected);
    }

    #[test]
    fn a_builder_sized_from_a_batch_builds_the_same_batches() {
        let json = br#"{"v":1,"ts_ms":5000,"interval_ms":5000,"host":"node-1","gpu_uuid":"GPU-12","gpu_model":"H100","util_gpu_pct":42.5,"mem_used_bytes":1,"mem_total_bytes":2,"lease_id":"l-1","labels":{"k":"v"}}"#;
        let row = SampleRow::from_json(json).unwrap();
        let mut builder = SampleBuilder::default();
        for _ in 0..3 {
            builder.append(&row);
        }
        let batch = builder.finish().unwrap();
        let size = SampleCapacity::of(&batch).unwrap();
        assert_eq!(
            size,
            SampleCapacity {
                rows: 3,
                strings: [18, 18, 12, 0, 9, 0, 27, 0],
            }
        );
        assert_eq!(
            size.with_headroom(2),
            SampleCapacity {
                rows: 4,
                strings: [27, 27, 18, 0, 13, 0, 40, 0],
            }
        );
        // Fewer rows than it was made for, and more: the same batches as an unsized builder's.
        for rows in [1, 3, 50] {
            let mut sized = SampleBuilder::with_capacity(&size);
            let mut unsized_ = SampleBuilder::default();
            for _ in 0..rows {
                sized.append(&row);
                unsized_.append(&row);
            }
            assert_eq!(sized.finish().unwrap(), unsized_.finish().unwrap());
        }
        let other = arrow_array::RecordBatch::try_from_iter([(
            "host",
            Arc::new(arrow_array::Int64Array::from(vec![1])) as ArrayRef,
        )])
        .unwrap();
        assert_eq!(SampleCapacity::of(&other), None, "not a samples batch");
    }

    #[test]
    fn rows_are_refused_exactly_as_samples_are() {
        for bad in [
            &br#"{"v":1}"#[..],
            br#"{"v":1,"ts_ms":1,"interval_ms":0,"host":"h","gpu_uuid":"g","gpu_model":"m","util_gpu_pct":1,"mem_used_bytes":1,"mem_total_bytes":2}"#,
            br#"{"v":1,"ts_ms":1,"interval_ms":5,"host":"h","gpu_uuid":"g","gpu_model":"m","util_gpu_pct":101,"mem_used_bytes":1,"mem_total_bytes":2}"#,
            br#"{"v":1,"ts_ms":1,"interval_ms":5,"host":7,"gpu_uuid":"g","gpu_model":"m","util_gpu_pct":1,"mem_used_bytes":1,"mem_total_bytes":2}"#,
            b"[1]",
            b"{\"v\":1,",
        ] {
            assert_eq!(SampleRow::from_json(bad).unwrap_err(), Sample::from_json(bad).unwrap_err());
        }
    }
}
