//! Rows waiting to be written: decoded straight from message bytes into per-table, per-hour
//! Arrow builders (samples) or record lists (the low-volume tables), with bad records turned
//! into quarantine rows. One [`SourceBuffer`] holds one Kafka partition's (or one file chunk's)
//! rows between flushes, with the offset range they came from and a digest of the records'
//! bytes: a lake file is named after both, so that the same records written again replace their
//! file and other records never do (docs/src/contributors/lake.md#exactly-once-from-kafka-through-the-log).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::builder::{BinaryBuilder, Int64Builder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema};
use gpuwarden_schema::sample_row::{SampleBuilder, SampleCapacity, SampleRow};
use gpuwarden_schema::{topics, Action, DecodeError, LeaseEvent, Record, Signal};
use xxhash_rust::xxh3::Xxh3;

use crate::bounds::{Bounds, Direction, HostSkews, OutOfBounds};
use crate::lake::hour_of;

/// The lake's raw tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// `gpuwarden.samples`.
    Samples,
    /// `gpuwarden.leases`.
    LeaseEvents,
    /// `gpuwarden.signals`.
    Signals,
    /// `gpuwarden.actions`.
    Actions,
    /// Records that did not decode or validate, with why.
    Quarantine,
}

impl Table {
    /// The raw tables, in a stable order.
    pub const ALL: [Table; 5] = [
        Self::Samples,
        Self::LeaseEvents,
        Self::Signals,
        Self::Actions,
        Self::Quarantine,
    ];

    /// The table's name in the lake and in SQL.
    pub fn name(self) -> &'static str {
        match self {
            Self::Samples => "samples",
            Self::LeaseEvents => "lease_events",
            Self::Signals => "signals",
            Self::Actions => "actions",
            Self::Quarantine => "quarantine",
        }
    }

    /// The table a topic's records go to.
    pub fn of_topic(topic: &str) -> Option<Table> {
        match topic {
            topics::SAMPLES => Some(Self::Samples),
            topics::LEASES => Some(Self::LeaseEvents),
            topics::SIGNALS => Some(Self::Signals),
            topics::ACTIONS => Some(Self::Actions),
            _ => None,
        }
    }

    /// The table's Arrow schema.
    pub fn schema(self) -> Arc<Schema> {
        match self {
            Self::Samples => gpuwarden_schema::Sample::arrow_schema(),
            Self::LeaseEvents => LeaseEvent::arrow_schema(),
            Self::Signals => Signal::arrow_schema(),
            Self::Actions => Action::arrow_schema(),
            Self::Quarantine => quarantine_schema(),
        }
    }
}

/// The `quarantine` table: every record that could not be decoded or validated.
pub fn quarantine_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("ts_ms", DataType::Int64, false),
        Field::new("topic", DataType::Utf8, false),
        Field::new("partition", DataType::Int64, false),
        Field::new("offset", DataType::Int64, false),
        Field::new("field", DataType::Utf8, true),
        Field::new("reason", DataType::Utf8, false),
        Field::new("raw", DataType::Binary, false),
    ]))
}

/// One quarantined record.
#[derive(Debug, Clone, PartialEq)]
pub struct QuarantineRow {
    /// When it was received (the Kafka message timestamp, or the ingest time).
    pub ts_ms: i64,
    /// The topic (or `file:<path>`) it came from.
    pub topic: String,
    /// Its partition (-1 for files).
    pub partition: i32,
    /// Its offset (the line number for files).
    pub offset: i64,
    /// The field at fault, when one is.
    pub field: Option<String>,
    /// Why it was refused.
    pub reason: String,
    /// The record's bytes as received.
    pub raw: Vec<u8>,
}

fn quarantine_batch(rows: &[QuarantineRow]) -> Result<RecordBatch, ArrowError> {
    let mut ts = Int64Builder::new();
    let mut topic = StringBuilder::new();
    let mut partition = Int64Builder::new();
    let mut offset = Int64Builder::new();
    let mut field = StringBuilder::new();
    let mut reason = StringBuilder::new();
    let mut raw = BinaryBuilder::new();
    for r in rows {
        ts.append_value(r.ts_ms);
        topic.append_value(&r.topic);
        partition.append_value(i64::from(r.partition));
        offset.append_value(r.offset);
        field.append_option(r.field.as_deref());
        reason.append_value(&r.reason);
        raw.append_value(&r.raw);
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(ts.finish()),
        Arc::new(topic.finish()),
        Arc::new(partition.finish()),
        Arc::new(offset.finish()),
        Arc::new(field.finish()),
        Arc::new(reason.finish()),
        Arc::new(raw.finish()),
    ];
    RecordBatch::try_new(quarantine_schema(), columns)
}

enum Rows {
    Samples(Box<SampleBuilder>),
    LeaseEvents(Vec<LeaseEvent>),
    Signals(Vec<Signal>),
    Actions(Vec<Action>),
    Quarantine(Vec<QuarantineRow>),
}

impl Rows {
    fn new(table: Table) -> Self {
        match table {
            Table::Samples => Rows::Samples(Box::default()),
            Table::LeaseEvents => Rows::LeaseEvents(Vec::new()),
            Table::Signals => Rows::Signals(Vec::new()),
            Table::Actions => Rows::Actions(Vec::new()),
            Table::Quarantine => Rows::Quarantine(Vec::new()),
        }
    }

    fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        match self {
            Rows::Samples(b) => b.finish(),
            Rows::LeaseEvents(v) => LeaseEvent::to_record_batch(v),
            Rows::Signals(v) => Signal::to_record_batch(v),
            Rows::Actions(v) => Action::to_record_batch(v),
            Rows::Quarantine(v) => quarantine_batch(v),
        }
    }
}

/// What became of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Decoded into its table.
    Accepted(Table),
    /// Refused as invalid; written to `quarantine`.
    Quarantined,
    /// Refused because its time is out of bounds; written to `quarantine`.
    OutOfBounds(Direction),
}

impl Outcome {
    /// Whether the record went to `quarantine`.
    pub fn quarantined(self) -> bool {
        !matches!(self, Self::Accepted(_))
    }
}

/// When a record arrived, and the bounds its time must keep.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    /// Arrival time ([`crate::bounds::arrival_ms`]); it also dates a quarantine row.
    pub ms: i64,
    /// The bounds.
    pub bounds: &'a Bounds,
}

/// Why a record was refused.
enum Refusal {
    Invalid(DecodeError),
    OutOfBounds(OutOfBounds),
}

impl From<DecodeError> for Refusal {
    fn from(e: DecodeError) -> Self {
        Self::Invalid(e)
    }
}

/// A sealed buffer: one batch per (table, hour), and the offsets they came from.
#[derive(Debug)]
pub struct Sealed {
    /// First offset (or line) included.
    pub first: i64,
    /// Last offset (or line) included.
    pub last: i64,
    /// What the records were: see [`ContentDigest`].
    pub digest: ContentDigest,
    /// The batches.
    pub batches: Vec<(Table, i64, RecordBatch)>,
    /// Each batch's rows' offsets (or lines), ascending: which a commit may leave out
    /// because the table holds them already.
    pub offsets: Vec<Vec<i64>>,
    /// About how much memory they hold.
    pub bytes: usize,
}

/// Rows of one source (a partition, or a file chunk) since its last flush.
pub struct SourceBuffer {
    hours: BTreeMap<(Table, i64), Rows>,
    /// The offset of each row of `hours`, in the same order.
    offsets: BTreeMap<(Table, i64), Vec<i64>>,
    /// The sizes to make each hour's sample builder at ([`Self::with_sample_sizes`]).
    sizes: BTreeMap<i64, SampleCapacity>,
    first: Option<i64>,
    last: i64,
    digest: Xxh3,
    rows: usize,
    bytes: usize,
    started: Option<Instant>,
}

/// The XXH3 (64-bit) hash of the records a buffer took, each as its offset (or line number), its
/// length and its bytes, in the order taken: a hash whose output the xxHash specification fixes,
/// so a name stays the same across builds. It costs about 6 % of a record's decoding (SHA-256
/// cost 22 to 50 %), and guards against accidents, not against a writer of the topics, who can
/// harm the lake far more simply. Two sources' records that share a name
/// and an offset range (two exports called `late.jsonl`, two reads of standard input, a topic
/// recreated or a broker restarted from offset 0) differ here, so their files do too; the same
/// records read again give the same digest, so a replay rewrites its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentDigest(pub u64);

impl ContentDigest {
    /// The digest of a sequence of digests (a file made of several chunks' rows), in order.
    pub fn of_parts(parts: &[ContentDigest]) -> Self {
        let mut hasher = Xxh3::new();
        for part in parts {
            hasher.update(&part.0.to_le_bytes());
        }
        Self(hasher.digest())
    }
}

impl std::fmt::Display for ContentDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl std::fmt::Debug for SourceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceBuffer")
            .field("first", &self.first)
            .field("last", &self.last)
            .field("rows", &self.rows)
            .finish()
    }
}

impl Default for SourceBuffer {
    fn default() -> Self {
        Self {
            hours: BTreeMap::new(),
            offsets: BTreeMap::new(),
            sizes: BTreeMap::new(),
            first: None,
            last: -1,
            digest: Xxh3::new(),
            rows: 0,
            bytes: 0,
            started: None,
        }
    }
}

impl SourceBuffer {
    /// A buffer whose sample builders for the hours in `sizes` start at those sizes, so that
    /// they need not grow (a file chunk's hours, sized from the chunk before).
    pub fn with_sample_sizes(sizes: BTreeMap<i64, SampleCapacity>) -> Self {
        Self {
            sizes,
            ..Self::default()
        }
    }

    /// Decodes one record of `table` and buffers it, or buffers a quarantine row saying why not:
    /// it does not decode or validate, or its time is out of `arrival`'s bounds. `topic`,
    /// `partition`, `offset` locate it; each sample's clock skew goes to `skews` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        table: Table,
        payload: &[u8],
        topic: &str,
        partition: i32,
        offset: i64,
        arrival: &Arrival<'_>,
        skews: Option<&mut HostSkews>,
    ) -> Outcome {
        self.took(offset, payload);
        let (field, reason, outcome) = match self.decode(table, payload, arrival, skews) {
            Ok(hour) => {
                self.offsets.entry((table, hour)).or_default().push(offset);
                return Outcome::Accepted(table);
            }
            Err(Refusal::Invalid(err)) => (
                err.field().map(str::to_string),
                err.to_string(),
                Outcome::Quarantined,
            ),
            Err(Refusal::OutOfBounds(err)) => (
                Some("ts_ms".to_string()),
                format!("ts_ms: {err}"),
                Outcome::OutOfBounds(err.direction),
            ),
        };
        self.quarantine(QuarantineRow {
            ts_ms: arrival.ms,
            topic: topic.to_string(),
            partition,
            offset,
            field,
            reason,
            raw: payload.to_vec(),
        });
        outcome
    }

    /// Buffers a quarantine row for the record at `row.offset`, refused before decoding (its
    /// signature did not check out), keeping the offsets as [`Self::add`] does.
    pub fn refuse(&mut self, row: QuarantineRow) {
        self.took(row.offset, &row.raw);
        self.quarantine(row);
    }

    /// Counts the record at `offset` in the range, the digest and the rows.
    fn took(&mut self, offset: i64, payload: &[u8]) {
        self.first.get_or_insert(offset);
        self.last = self.last.max(offset);
        self.started.get_or_insert_with(Instant::now);
        self.rows += 1;
        self.digest.update(&offset.to_le_bytes());
        self.digest.update(&(payload.len() as u64).to_le_bytes());
        self.digest.update(payload);
    }

    /// Buffers a quarantine row for a record refused before decoding (e.g. an unknown topic).
    pub fn quarantine(&mut self, row: QuarantineRow) {
        self.bytes += row.raw.len() + row.reason.len() + 64;
        let hour = hour_of(row.ts_ms);
        self.offsets
            .entry((Table::Quarantine, hour))
            .or_default()
            .push(row.offset);
        match self
            .hours
            .entry((Table::Quarantine, hour))
            .or_insert_with(|| Rows::new(Table::Quarantine))
        {
            Rows::Quarantine(rows) => rows.push(row),
            _ => unreachable!("the quarantine entry holds quarantine rows"),
        }
    }

    fn decode(
        &mut self,
        table: Table,
        payload: &[u8],
        arrival: &Arrival<'_>,
        skews: Option<&mut HostSkews>,
    ) -> Result<i64, Refusal> {
        let within = |ts_ms: i64| {
            arrival
                .bounds
                .check(ts_ms, arrival.ms, table == Table::Samples)
                .map_err(Refusal::OutOfBounds)
        };
        let decoded;
        match table {
            Table::Samples => {
                let row = SampleRow::from_json(payload)?;
                if let Some(skews) = skews {
                    skews.observe(&row.host, row.ts_ms, arrival.ms);
                }
                within(row.ts_ms)?;
                let hour = hour_of(row.ts_ms);
                decoded = hour;
                let entry = self.hours.entry((table, hour)).or_insert_with(|| {
                    let builder = match self.sizes.get(&hour) {
                        Some(size) => SampleBuilder::with_capacity(size),
                        None => SampleBuilder::default(),
                    };
                    Rows::Samples(Box::new(builder))
                });
                let Rows::Samples(builder) = entry else {
                    unreachable!("samples entries hold a SampleBuilder")
                };
                let before = builder.approx_bytes();
                builder.append(&row);
                self.bytes += builder.approx_bytes() - before;
            }
            Table::LeaseEvents => {
                let event = LeaseEvent::from_json(payload)?;
                within(event.ts_ms)?;
                self.bytes += payload.len() + 128;
                let Rows::LeaseEvents(v) = self
                    .hours
                    .entry((table, {
                        decoded = hour_of(event.ts_ms);
                        decoded
                    }))
                    .or_insert_with(|| Rows::new(table))
                else {
                    unreachable!()
                };
                v.push(event);
            }
            Table::Signals => {
                let signal = Signal::from_json(payload)?;
                within(signal.ts_ms)?;
                self.bytes += payload.len() + 128;
                let Rows::Signals(v) = self
                    .hours
                    .entry((table, {
                        decoded = hour_of(signal.ts_ms);
                        decoded
                    }))
                    .or_insert_with(|| Rows::new(table))
                else {
                    unreachable!()
                };
                v.push(signal);
            }
            Table::Actions => {
                let action = Action::from_json(payload)?;
                within(action.ts_ms)?;
                self.bytes += payload.len() + 128;
                let Rows::Actions(v) = self
                    .hours
                    .entry((table, {
                        decoded = hour_of(action.ts_ms);
                        decoded
                    }))
                    .or_insert_with(|| Rows::new(table))
                else {
                    unreachable!()
                };
                v.push(action);
            }
            Table::Quarantine => unreachable!("nothing is decoded into quarantine"),
        }
        Ok(decoded)
    }

    /// Records buffered (quarantined ones included).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// About how much memory the buffer holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// When the oldest buffered record arrived.
    pub fn started(&self) -> Option<Instant> {
        self.started
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// Turns the buffer into batches and starts a new one.
    pub fn seal(&mut self) -> Result<Option<Sealed>, ArrowError> {
        let Some(first) = self.first else {
            return Ok(None);
        };
        let mut batches = Vec::with_capacity(self.hours.len());
        let mut offsets = Vec::with_capacity(self.hours.len());
        for ((table, hour), rows) in &mut self.hours {
            let batch = rows.finish()?;
            if batch.num_rows() > 0 {
                let taken = self.offsets.remove(&(*table, *hour)).unwrap_or_default();
                debug_assert_eq!(taken.len(), batch.num_rows());
                batches.push((*table, *hour, batch));
                offsets.push(taken);
            }
        }
        let sealed = Sealed {
            first,
            last: self.last,
            digest: ContentDigest(self.digest.digest()),
            batches,
            offsets,
            bytes: self.bytes,
        };
        *self = Self::default();
        Ok(Some(sealed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(payloads: &[(i64, &str)]) -> Sealed {
        let bounds = Bounds::none();
        let arrival = Arrival {
            ms: 0,
            bounds: &bounds,
        };
        let mut buffer = SourceBuffer::default();
        for (offset, payload) in payloads {
            buffer.add(
                Table::Samples,
                payload.as_bytes(),
                "t",
                0,
                *offset,
                &arrival,
                None,
            );
        }
        buffer.seal().unwrap().unwrap()
    }

    fn sample(gpu: &str) -> String {
        format!(
            r#"{{"v":1,"ts_ms":1000,"interval_ms":1000,"host":"h","gpu_uuid":"{gpu}","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}}"#
        )
    }

    #[test]
    fn the_digest_names_the_records_not_only_their_offsets() {
        let (a, b) = (sample("GPU-a"), sample("GPU-b"));
        let first = sealed(&[(0, &a), (1, "not json")]);
        assert_eq!(
            first.digest,
            sealed(&[(0, &a), (1, "not json")]).digest,
            "the same records again: the same digest"
        );
        for other in [
            sealed(&[(0, &b), (1, "not json")]),
            sealed(&[(0, &a), (1, "not json!")]),
            sealed(&[(1, &a), (2, "not json")]),
            sealed(&[(0, &a)]),
        ] {
            assert_ne!(other.digest, first.digest, "{other:?}");
        }
        // A record's bytes cannot shift into its neighbour's unnoticed.
        assert_ne!(
            sealed(&[(0, "ab"), (1, "c")]).digest,
            sealed(&[(0, "a"), (1, "bc")]).digest
        );
    }
}
