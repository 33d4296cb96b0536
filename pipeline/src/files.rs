//! `gpuwarden ingest`: the same decoder, validator and quarantine as the Kafka path, fed from
//! JSON-lines files, for backfill and for trying gpuwarden on exported data.
//!
//! The input is cut into chunks of whole lines, decoded in parallel into per-hour batches. One
//! sequencer takes the decoded chunks back in input order and appends each hour's rows to that
//! hour's open file, so an input in any time order gives one file per table and hour (up to
//! [`FILE_ROWS`] rows a file). Row groups are encoded in parallel as they fill and written to
//! the file's hidden temporary; a finished file is synced and renamed into place, so a reader
//! never sees half of one.
//!
//! A file is named after the input, the line range of the chunks whose rows of that hour it
//! holds and the digest of those chunks' lines (`file-<table>-<name>-o<first>-<last>-h<digest>`):
//! the files of one hour and input hold disjoint ranges, and another input of the same name
//! (another export called `late.jsonl`, another read of standard input) gets other names, never
//! replacing the first's files. Where a file ends depends only on the input and `chunk_lines`
//! (never on threads, timing or the memory budget), so ingesting the same input again, or again
//! after a crash, rewrites the same files instead of adding rows twice. For the same reason an
//! ingest that fails to read its input, or whose decoder fails, finishes no more files: the ones
//! it would finish early would cover a shorter range than a complete run's.
//!
//! A file is written as a hidden temporary of its own (the name's digest is known only at its
//! end), locked while it is written: the temporaries a crashed run left behind are unlocked, and
//! the next run that starts the same file removes them.
//!
//! Memory: at most [`IN_FLIGHT_CHUNKS`] per thread chunks are read and not yet taken by the
//! sequencer; rows waiting for their row group to fill are held up to the memory budget, past
//! which the hour holding the most is written out as a smaller row group of its open file (not as
//! a new file); and at most two row groups per thread are being encoded.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use gpuwarden_schema::sample_row::SampleCapacity;
use parquet::arrow::arrow_writer::{
    compute_leaves, ArrowColumnChunk, ArrowColumnWriter, ArrowRowGroupWriterFactory,
};
use parquet::arrow::ArrowWriter;
use parquet::errors::ParquetError;
use parquet::file::writer::SerializedFileWriter;

use crate::bounds::{Bounds, Direction};
use crate::buffer::{Arrival, ContentDigest, Outcome, SourceBuffer, Table};
use crate::lake::{io, Lake, LakeError, ROW_GROUP_ROWS};
use crate::metrics::Metrics;

/// What an ingest of one input did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileReport {
    /// Non-empty lines read.
    pub records: u64,
    /// Records written to their table.
    pub written: u64,
    /// Records written to `quarantine` instead.
    pub quarantined: u64,
    /// Of those, records dated too far ahead of the time they were read
    /// (`pipeline.clock.max_skew`).
    pub future: u64,
    /// Parquet files written, of every table.
    pub files: u64,
}

/// Ingest of a file failed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// Reading the input failed.
    #[error("reading {input}: {source}")]
    Read {
        /// The input's name.
        input: String,
        /// The error.
        source: std::io::Error,
    },
    /// Writing the lake failed.
    #[error(transparent)]
    Lake(#[from] LakeError),
    /// A decoding or encoding thread failed (a bug): what it held may be missing from the lake.
    #[error("decoding {input} failed: {message}; this is a bug, and records of the input may be missing from the lake")]
    Decoder {
        /// The input's name.
        input: String,
        /// What the thread said.
        message: String,
    },
}

/// How an input is read and buffered.
#[derive(Debug, Clone, Copy)]
pub struct IngestOptions {
    /// Lines a chunk holds. Chunks are the unit of decoding and of file ranges: ingesting the
    /// same input again rewrites the same files only with the same `chunk_lines`.
    pub chunk_lines: usize,
    /// Decoding threads, and as many encoding threads.
    pub threads: usize,
    /// Bytes of decoded rows held while their row groups fill, over all open files.
    pub buffer_bytes: usize,
    /// Files open at once at most; past it the one appended to longest ago is finished, and
    /// its hour starts a new file if more of its rows come. Like `chunk_lines`, it decides
    /// where files end: a re-run rewrites the same files only with the same value.
    pub open_files: usize,
}

impl IngestOptions {
    /// The options `gpuwarden ingest` runs with, but for `threads`.
    pub fn new(threads: usize) -> Self {
        Self {
            chunk_lines: CHUNK_LINES,
            threads,
            buffer_bytes: Self::DEFAULT_BUFFER_BYTES,
            open_files: OPEN_FILES,
        }
    }

    /// The default memory budget for rows waiting for their row group: 512 MiB, a full row
    /// group of samples (about 40 MiB) for a dozen hours at once.
    pub const DEFAULT_BUFFER_BYTES: usize = 512 << 20;
}

/// Lines a chunk holds by default: enough to keep both decoders and encoders busy, few enough
/// that the chunks in flight take little memory. Fixed rather than configured, since file
/// ranges follow chunks (see [`IngestOptions::chunk_lines`]).
pub const CHUNK_LINES: usize = 100_000;

/// Bytes read at a time.
const READ_BLOCK: usize = 4 << 20;

/// Rows a file holds at most (32 row groups); an hour with more gets several files.
pub const FILE_ROWS: usize = 32 * ROW_GROUP_ROWS;

/// Files open at once at most by default ([`IngestOptions::open_files`]): a month of hours
/// at once leaves a file descriptor limit of 1,024 room.
pub const OPEN_FILES: usize = 256;

/// Chunks read and not yet taken by the sequencer, per thread.
pub const IN_FLIGHT_CHUNKS: usize = 2;

/// Whole lines, as read, in one buffer (no allocation per line).
struct Chunk {
    /// `..filled` is what was read; the rest is room for the next read, zeroed once when the
    /// buffer grew and then reused, so that reading is one copy into memory already mapped.
    data: Vec<u8>,
    filled: usize,
    /// `(start, end, 1-based line number)` of each non-empty line in `data`, newline excluded.
    lines: Vec<(usize, usize, i64)>,
    /// Where the next line not yet indexed starts.
    scanned: usize,
    /// Its place in the input.
    seq: u64,
}

impl Chunk {
    fn with_capacity(lines: usize) -> Self {
        Self {
            data: Vec::with_capacity(lines * 512),
            filled: 0,
            lines: Vec::with_capacity(lines),
            scanned: 0,
            seq: 0,
        }
    }
}

/// A decoded chunk's rows: a batch per table and hour.
type HourBatches = Vec<(Table, i64, RecordBatch)>;

/// What the sequencer hears.
enum Msg {
    /// A chunk decoded into per-(table, hour) batches; `first..=last` are its lines, `digest`
    /// their digest.
    Decoded {
        seq: u64,
        first: i64,
        last: i64,
        batches: HourBatches,
    },
    /// A row group of file `file` encoded.
    Encoded {
        file: u64,
        chunks: Result<Vec<ArrowColumnChunk>, ParquetError>,
    },
    /// The reader is done: `chunks` chunks were sent, and all decoders have stopped; `complete`
    /// says whether the whole input was read and decoded.
    End { chunks: u64, complete: bool },
}

/// Row groups to encode.
struct EncodeJob {
    file: u64,
    schema: SchemaRef,
    writers: Vec<ArrowColumnWriter>,
    batches: Vec<RecordBatch>,
}

/// Reads JSON lines of `table`'s records from `input` into the lake. `name` identifies the input
/// in file names and in quarantine rows (`file:<name>`). A record dated further ahead of the
/// time its chunk was read than `bounds` allow is quarantined. Progress goes to the log every
/// ten chunks.
pub fn ingest(
    input: &mut dyn BufRead,
    name: &str,
    table: Table,
    lake: &Lake,
    options: IngestOptions,
    bounds: &Bounds,
    metrics: &Arc<Metrics>,
) -> Result<FileReport, FileError> {
    ingest_blocks(
        input, name, table, lake, options, bounds, metrics, READ_BLOCK,
    )
}

#[allow(clippy::too_many_arguments)]
fn ingest_blocks(
    input: &mut dyn BufRead,
    name: &str,
    table: Table,
    lake: &Lake,
    options: IngestOptions,
    bounds: &Bounds,
    metrics: &Arc<Metrics>,
    read_block: usize,
) -> Result<FileReport, FileError> {
    let threads = options.threads.max(1);
    let chunk_lines = options.chunk_lines.max(1);
    let source = format!("file-{}-{}", table.name(), sanitize(name));
    let topic = format!("file:{name}");
    let (msg_tx, msg_rx) = mpsc::channel::<Msg>();
    // Credits bound the chunks between the reader and the sequencer, decoded or not: the
    // sequencer hands one back for each chunk it has taken.
    let in_flight = IN_FLIGHT_CHUNKS * threads;
    let (credit_tx, credit_rx) = mpsc::sync_channel::<()>(in_flight);
    for _ in 0..in_flight {
        credit_tx.send(()).expect("the credits fit");
    }
    let (encode_tx, encode_rx) = mpsc::sync_channel::<EncodeJob>(threads);
    let encode_rx = Arc::new(Mutex::new(encode_rx));
    let encoders: Vec<_> = (0..threads)
        .map(|_| {
            let (encode_rx, msg_tx) = (Arc::clone(&encode_rx), msg_tx.clone());
            std::thread::spawn(move || loop {
                let job = match encode_rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                    Ok(job) => job,
                    Err(_) => return,
                };
                let chunks = encode(job.writers, &job.schema, &job.batches);
                if msg_tx
                    .send(Msg::Encoded {
                        file: job.file,
                        chunks,
                    })
                    .is_err()
                {
                    return;
                }
            })
        })
        .collect();
    let sequencer = {
        let (lake, metrics, source) = (lake.clone(), Arc::clone(metrics), source.clone());
        std::thread::spawn(move || {
            Sequencer::new(lake, metrics, source, options, encode_tx).run(msg_rx, credit_tx)
        })
    };

    let (chunk_tx, chunk_rx) = mpsc::sync_channel::<Chunk>(threads);
    // Decoded chunks come back to be filled again: their memory is allocated once.
    let (spare_tx, spare_rx) = mpsc::channel::<Chunk>();
    let chunk_rx = Arc::new(Mutex::new(chunk_rx));
    let (records, quarantined, future) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let decoders: Vec<_> = (0..threads)
        .map(|_| {
            let (chunk_rx, msg_tx, metrics, records, quarantined, future) = (
                Arc::clone(&chunk_rx),
                msg_tx.clone(),
                Arc::clone(metrics),
                Arc::clone(&records),
                Arc::clone(&quarantined),
                Arc::clone(&future),
            );
            let bounds = *bounds;
            let (topic, spare_tx) = (topic.clone(), spare_tx.clone());
            // Each hour's builders start at the size that hour had in the chunk before (with a
            // little room): growing them by doubling copied every column and, worse, took fresh
            // memory from the system for each chunk, which costs more than the decoding.
            let mut sizes = BTreeMap::new();
            std::thread::spawn(move || loop {
                let chunk = match chunk_rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                    Ok(chunk) => chunk,
                    Err(_) => return,
                };
                let arrival = Arrival {
                    ms: crate::consume::wall_ms(),
                    bounds: &bounds,
                };
                let mut buffer = SourceBuffer::with_sample_sizes(std::mem::take(&mut sizes));
                let (mut bad, mut ahead) = (0, 0);
                for &(start, end, number) in &chunk.lines {
                    let outcome = buffer.add(
                        table,
                        &chunk.data[start..end],
                        &topic,
                        -1,
                        number,
                        &arrival,
                        None,
                    );
                    bad += u64::from(outcome.quarantined());
                    ahead += u64::from(outcome == Outcome::OutOfBounds(Direction::Ahead));
                }
                let n = chunk.lines.len() as u64;
                metrics.records_in_n(&topic, n, bad);
                if ahead > 0 {
                    metrics.out_of_bounds(&topic, Direction::Ahead, ahead);
                }
                records.fetch_add(n, Ordering::Relaxed);
                quarantined.fetch_add(bad, Ordering::Relaxed);
                future.fetch_add(ahead, Ordering::Relaxed);
                let seq = chunk.seq;
                let mut chunk = chunk;
                chunk.filled = 0;
                chunk.lines.clear();
                chunk.scanned = 0;
                let _ = spare_tx.send(chunk);
                let sealed = buffer
                    .seal()
                    .expect("batches of validated rows build")
                    .expect("a chunk has lines");
                sizes = sealed
                    .batches
                    .iter()
                    .filter(|(table, _, _)| *table == Table::Samples)
                    .filter_map(|(_, hour, batch)| {
                        Some((*hour, SampleCapacity::of(batch)?.with_headroom(16)))
                    })
                    .collect();
                let decoded = Msg::Decoded {
                    seq,
                    first: sealed.first,
                    last: sealed.last,
                    batches: sealed.batches,
                };
                if msg_tx.send(decoded).is_err() {
                    return;
                }
            })
        })
        .collect();

    let started = Instant::now();
    let (mut line_no, mut chunks) = (0i64, 0u64);
    // The digest of the input's records (each line's number, length and bytes, in order): the
    // same content read with other chunks, blocks or threads gives the same one.
    let mut content = xxhash_rust::xxh3::Xxh3::new();
    let mut chunk = Chunk::with_capacity(chunk_lines);
    // Blocks are read straight into the chunk's buffer (a read this large passes a BufReader's
    // own buffer by); lines are found with memchr and never copied one by one. An unfinished
    // last line moves to the next chunk.
    let read_error = loop {
        let room = chunk.filled + read_block;
        if chunk.data.len() < room {
            chunk.data.resize(room, 0);
        }
        // A whole block unless the input ends (a pipe gives less at a time): chunks end where
        // blocks do, and must not depend on how the input was delivered.
        let mut n = 0;
        let failed = loop {
            if chunk.filled + n == room {
                break None;
            }
            match input.read(&mut chunk.data[chunk.filled + n..room]) {
                Ok(0) => break None,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => break Some(source),
            }
        };
        chunk.filled += n;
        if let Some(source) = failed {
            break Some(FileError::Read {
                input: name.to_string(),
                source,
            });
        }
        let eof = n == 0;
        let mut start = chunk.scanned;
        while start < chunk.filled {
            let end = match memchr::memchr(b'\n', &chunk.data[start..chunk.filled]) {
                Some(i) => start + i,
                None if eof => chunk.filled,
                None => break,
            };
            line_no += 1;
            if !trim(&chunk.data[start..end]).is_empty() {
                chunk.lines.push((start, end, line_no));
                content.update(&line_no.to_le_bytes());
                content.update(&((end - start) as u64).to_le_bytes());
                content.update(&chunk.data[start..end]);
            }
            start = end + 1;
        }
        chunk.scanned = start.min(chunk.filled);
        if chunk.lines.len() >= chunk_lines || (eof && !chunk.lines.is_empty()) {
            // Wait for the sequencer to take a chunk; none comes back if it has stopped.
            if credit_rx.recv().is_err() {
                break None;
            }
            let mut next = spare_rx
                .try_recv()
                .unwrap_or_else(|_| Chunk::with_capacity(chunk_lines));
            let tail = chunk.filled - chunk.scanned;
            if next.data.len() < tail {
                next.data.resize(tail, 0);
            }
            next.data[..tail].copy_from_slice(&chunk.data[chunk.scanned..chunk.filled]);
            next.filled = tail;
            chunk.filled = chunk.scanned;
            let mut full = std::mem::replace(&mut chunk, next);
            full.seq = chunks;
            if chunk_tx.send(full).is_err() {
                break None;
            }
            chunks += 1;
            if chunks % 10 == 0 {
                tracing::info!(input = name, lines = line_no, elapsed = ?started.elapsed(), "ingesting");
            }
        }
        if eof {
            break None;
        }
    };
    drop(chunk);
    drop(chunk_tx);
    let mut failed = None;
    for d in decoders {
        if let Err(panic) = d.join() {
            failed = Some(FileError::Decoder {
                input: name.to_string(),
                message: panic_message(panic),
            });
        }
    }
    let _ = msg_tx.send(Msg::End {
        chunks,
        complete: read_error.is_none() && failed.is_none(),
    });
    drop(msg_tx);
    let written = sequencer.join();
    for e in encoders {
        if let Err(panic) = e.join() {
            failed.get_or_insert(FileError::Decoder {
                input: name.to_string(),
                message: panic_message(panic),
            });
        }
    }
    let staged = match written {
        Ok(Ok(staged)) => staged,
        Ok(Err(e)) => return Err(read_error.or(failed).unwrap_or(e)),
        Err(panic) => {
            return Err(read_error.or(failed).unwrap_or(FileError::Decoder {
                input: name.to_string(),
                message: panic_message(panic),
            }))
        }
    };
    if let Some(e) = read_error.or(failed) {
        discard(lake, staged.adds);
        return Err(e);
    }
    let (records, mut quarantined) = (
        records.load(Ordering::Relaxed),
        quarantined.load(Ordering::Relaxed),
    );
    let staged = Staged {
        digest: ContentDigest(content.digest()),
        ..staged
    };
    let (files, again) = commit(lake, &source, table, staged)?;
    let mut written = records - quarantined;
    if again {
        tracing::info!(
            input = name,
            "this input's content was ingested before: nothing added"
        );
        (written, quarantined) = (0, 0);
    }
    tracing::info!(input = name, lines = line_no, files, elapsed = ?started.elapsed(), "ingested");
    Ok(FileReport {
        records,
        written,
        quarantined,
        future: future.load(Ordering::Relaxed),
        files,
    })
}

/// What an input's files are before their commit.
struct Staged {
    adds: Vec<(Table, deltalake_core::kernel::Add)>,
    /// The digest of the whole input's records (set once the reader has read them all).
    digest: ContentDigest,
    last: i64,
}

/// Commits an input's files, each table's in one commit (quarantine first, the input's table
/// last) with the transaction `<source>-h<digest of its records>`: ingesting the same content
/// again adds nothing, other content under the same name adds. Returns the files committed,
/// and whether the content was there already.
fn commit(
    lake: &Lake,
    source: &str,
    table: Table,
    staged: Staged,
) -> Result<(u64, bool), FileError> {
    let txn = crate::delta::AppTxn {
        app_id: format!("{source}-h{}", staged.digest),
        last: staged.last,
    };
    let mut tables: Vec<Table> = staged.adds.iter().map(|(t, _)| *t).collect();
    tables.sort_by_key(|t| (*t == table, t.name()));
    tables.dedup();
    let (mut files, mut again) = (0, false);
    let mut adds = staged.adds;
    for t in tables {
        let (these, rest): (Vec<_>, Vec<_>) = adds.into_iter().partition(|(a, _)| *a == t);
        adds = rest;
        let these: Vec<_> = these.into_iter().map(|(_, add)| add).collect();
        match crate::delta::block_on(lake.delta().commit_adds(
            t.name(),
            &t.schema(),
            these,
            Some(&txn),
        ))
        .map_err(LakeError::from)?
        {
            crate::delta::Appended::Committed { files: n, .. } => files += n as u64,
            crate::delta::Appended::AlreadyThere { .. } => again = true,
        }
    }
    Ok((files, again))
}

/// Deletes the files of an input that will not be committed.
fn discard(lake: &Lake, adds: Vec<(Table, deltalake_core::kernel::Add)>) {
    for (table, add) in adds {
        let _ = crate::delta::block_on(lake.delta().delete_file(table.name(), &add.path));
    }
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "no message".into())
}

/// Encodes one row group's columns.
fn encode(
    mut writers: Vec<ArrowColumnWriter>,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<Vec<ArrowColumnChunk>, ParquetError> {
    for batch in batches {
        let mut column_writers = writers.iter_mut();
        for (field, column) in schema.fields().iter().zip(batch.columns()) {
            for leaf in compute_leaves(field, column)? {
                column_writers
                    .next()
                    .ok_or_else(|| ParquetError::General("more leaves than writers".into()))?
                    .write(&leaf)?;
            }
        }
    }
    writers.into_iter().map(|w| w.close()).collect()
}

/// One table's hour being written.
struct OpenFile {
    table: Table,
    hour: i64,
    /// The last line of the last chunk it holds rows of.
    last: i64,
    /// Rows given to it, written or waiting.
    rows: usize,
    /// Rows waiting for their row group.
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    pending_bytes: usize,
    /// About how much memory a decoded row takes (from its first batch).
    row_bytes: usize,
    /// Row groups being encoded.
    encoding: usize,
    row_groups: usize,
    /// The last chunk that gave it rows.
    used: u64,
    /// No more rows come: finished once its row groups are in.
    closing: bool,
    tmp: PathBuf,
    schema: SchemaRef,
    factory: ArrowRowGroupWriterFactory,
    writer: SerializedFileWriter<File>,
}

/// Puts decoded chunks in input order into per-hour files (see the module docs).
struct Sequencer {
    lake: Lake,
    metrics: Arc<Metrics>,
    source: String,
    buffer_bytes: usize,
    open_files: usize,
    encode: Option<mpsc::SyncSender<EncodeJob>>,
    files: HashMap<u64, OpenFile>,
    /// The file each (table, hour) appends to.
    open: BTreeMap<(Table, i64), u64>,
    next_id: u64,
    pending_bytes: usize,
    /// Files being synced and renamed into place, oldest first.
    finishing: VecDeque<std::thread::JoinHandle<Result<(), LakeError>>>,
    /// Files in place, not committed yet: each table's adds.
    adds: Arc<Mutex<Vec<(Table, deltalake_core::kernel::Add)>>>,
    /// The last line taken.
    last: i64,
}

/// Files being synced at once at most.
const MAX_FINISHING: usize = 8;

impl Sequencer {
    fn new(
        lake: Lake,
        metrics: Arc<Metrics>,
        source: String,
        options: IngestOptions,
        encode: mpsc::SyncSender<EncodeJob>,
    ) -> Self {
        Self {
            lake,
            metrics,
            source,
            buffer_bytes: options.buffer_bytes,
            open_files: options.open_files.max(1),
            encode: Some(encode),
            files: HashMap::new(),
            open: BTreeMap::new(),
            next_id: 0,
            pending_bytes: 0,
            finishing: VecDeque::new(),
            adds: Arc::default(),
            last: 0,
        }
    }

    /// Runs until every chunk is in its files, put in their tables uncommitted; returns them.
    /// On an error the files still open are abandoned (their temporaries removed).
    fn run(
        mut self,
        inbox: mpsc::Receiver<Msg>,
        credits: mpsc::SyncSender<()>,
    ) -> Result<Staged, FileError> {
        let mut result = self.sequence(&inbox, &credits);
        // The reader, decoders and encoders stop once these are gone.
        drop((credits, inbox));
        self.encode.take();
        while !self.finishing.is_empty() {
            let finished = self.join_oldest();
            if result.is_ok() {
                result = finished;
            }
        }
        if result.is_err() {
            for file in self.files.values() {
                let _ = std::fs::remove_file(&file.tmp);
            }
        }
        let adds = std::mem::take(&mut *self.adds.lock().unwrap_or_else(|e| e.into_inner()));
        result.map(|()| Staged {
            adds,
            digest: ContentDigest(0),
            last: self.last,
        })
    }

    fn sequence(
        &mut self,
        inbox: &mpsc::Receiver<Msg>,
        credits: &mpsc::SyncSender<()>,
    ) -> Result<(), FileError> {
        let mut waiting: BTreeMap<u64, Taken> = BTreeMap::new();
        let mut next = 0u64;
        let mut end: Option<(u64, bool)> = None;
        loop {
            if let Some((chunks, complete)) = end {
                // Every decoder has stopped: a chunk missing now never comes.
                if !complete || next != chunks {
                    return Err(FileError::Decoder {
                        input: self.source.clone(),
                        message: "the input was not read and decoded whole".into(),
                    });
                }
                let open: Vec<u64> = self.open.values().copied().collect();
                for id in open {
                    self.close(id)?;
                }
                if self.files.is_empty() {
                    return Ok(());
                }
            }
            let Ok(msg) = inbox.recv() else {
                return Err(LakeError::Io {
                    action: "ingesting",
                    path: PathBuf::from(&self.source),
                    source: std::io::Error::other("the reader stopped"),
                }
                .into());
            };
            match msg {
                Msg::Decoded {
                    seq,
                    first,
                    last,
                    batches,
                } => {
                    waiting.insert(
                        seq,
                        Taken {
                            first,
                            last,
                            batches,
                        },
                    );
                    while let Some(chunk) = waiting.remove(&next) {
                        self.take(next, chunk)?;
                        next += 1;
                        let _ = credits.send(());
                    }
                }
                Msg::Encoded { file, chunks } => self.append(file, chunks)?,
                Msg::End { chunks, complete } => end = Some((chunks, complete)),
            }
        }
    }

    /// Takes chunk `seq`, in input order.
    fn take(&mut self, seq: u64, chunk: Taken) -> Result<(), FileError> {
        let Taken {
            first,
            last,
            batches,
        } = chunk;
        self.last = self.last.max(last);
        let mut touched = Vec::with_capacity(batches.len());
        for (table, hour, batch) in batches {
            let id = match self.open.get(&(table, hour)) {
                Some(&id) => id,
                None => self.start(table, hour, first, batch.schema())?,
            };
            let file = self.files.get_mut(&id).expect("an open file is known");
            if file.row_bytes == 0 {
                file.row_bytes = batch.get_array_memory_size() / batch.num_rows().max(1) + 1;
            }
            let bytes = batch.num_rows() * file.row_bytes;
            file.last = last;
            file.used = seq;
            file.rows += batch.num_rows();
            file.pending_rows += batch.num_rows();
            file.pending_bytes += bytes;
            file.pending.push(batch);
            self.pending_bytes += bytes;
            while self.files[&id].pending_rows >= ROW_GROUP_ROWS {
                self.submit(id, ROW_GROUP_ROWS)?;
            }
            touched.push(id);
        }
        for id in touched {
            if self.files.get(&id).is_some_and(|f| f.rows >= FILE_ROWS) {
                self.close(id)?;
            }
        }
        // Over the budget: the hour holding the most writes it as a smaller row group.
        while self.pending_bytes > self.buffer_bytes {
            let Some((&id, _)) = self
                .files
                .iter()
                .filter(|(_, f)| f.pending_rows > 0)
                .max_by_key(|(id, f)| (f.pending_bytes, std::cmp::Reverse(**id)))
            else {
                break;
            };
            let rows = self.files[&id].pending_rows;
            self.submit(id, rows)?;
        }
        Ok(())
    }

    /// Opens the file of `table`'s `hour` whose range starts at `first`, finishing the one
    /// appended to longest ago if as many as allowed are open.
    fn start(
        &mut self,
        table: Table,
        hour: i64,
        first: i64,
        schema: SchemaRef,
    ) -> Result<u64, FileError> {
        if self.open.len() >= self.open_files {
            let oldest = self
                .open
                .values()
                .copied()
                .min_by_key(|id| (self.files[id].used, *id))
                .expect("files are open");
            self.close(oldest)?;
        }
        let dir = self.lake.staging_dir(table.name());
        std::fs::create_dir_all(&dir).map_err(|source| LakeError::Io {
            action: "creating",
            path: dir.clone(),
            source,
        })?;
        let id = self.next_id;
        self.next_id += 1;
        let (tmp, out) = create_temporary(&dir, &format!(".{}-o{first:020}-", self.source), id)?;
        let parquet = |source| LakeError::Parquet {
            path: tmp.clone(),
            source,
        };
        let (writer, factory) = ArrowWriter::try_new(
            out,
            Arc::clone(&schema),
            Some(crate::lake::writer_properties(&schema, ROW_GROUP_ROWS).build()),
        )
        .and_then(ArrowWriter::into_serialized_writer)
        .map_err(parquet)?;
        self.files.insert(
            id,
            OpenFile {
                table,
                hour,
                last: first,
                rows: 0,
                pending: Vec::new(),
                pending_rows: 0,
                pending_bytes: 0,
                row_bytes: 0,
                encoding: 0,
                row_groups: 0,
                used: 0,
                closing: false,
                tmp,
                schema,
                factory,
                writer,
            },
        );
        self.open.insert((table, hour), id);
        Ok(id)
    }

    /// Sends the first `rows` waiting rows of file `id` to be encoded as one row group.
    fn submit(&mut self, id: u64, rows: usize) -> Result<(), FileError> {
        let file = self.files.get_mut(&id).expect("a submitted file is known");
        let mut batches = Vec::new();
        let mut taken = 0;
        let mut rest = Vec::new();
        for batch in file.pending.drain(..) {
            if taken >= rows {
                rest.push(batch);
            } else if taken + batch.num_rows() <= rows {
                taken += batch.num_rows();
                batches.push(batch);
            } else {
                let head = rows - taken;
                batches.push(batch.slice(0, head));
                rest.push(batch.slice(head, batch.num_rows() - head));
                taken = rows;
            }
        }
        let bytes = taken * file.row_bytes;
        file.pending = rest;
        file.pending_rows -= taken;
        file.pending_bytes -= bytes;
        self.pending_bytes -= bytes;
        let writers = file
            .factory
            .create_column_writers(file.row_groups)
            .map_err(|source| LakeError::Parquet {
                path: file.tmp.clone(),
                source,
            })?;
        file.row_groups += 1;
        file.encoding += 1;
        let job = EncodeJob {
            file: id,
            schema: Arc::clone(&file.schema),
            writers,
            batches,
        };
        self.encode
            .as_ref()
            .expect("encoders run until the sequencer ends")
            .send(job)
            .map_err(|_| FileError::Decoder {
                input: self.source.clone(),
                message: "the encoders stopped".into(),
            })
    }

    /// Takes no more rows into file `id`; it is finished once its row groups are in.
    fn close(&mut self, id: u64) -> Result<(), FileError> {
        let Some(file) = self.files.get_mut(&id) else {
            return Ok(());
        };
        if !file.closing {
            file.closing = true;
            self.open.remove(&(file.table, file.hour));
            let rows = file.pending_rows;
            if rows > 0 {
                self.submit(id, rows)?;
            }
        }
        self.finish_if_done(id)
    }

    /// Appends an encoded row group to file `id`.
    fn append(
        &mut self,
        id: u64,
        chunks: Result<Vec<ArrowColumnChunk>, ParquetError>,
    ) -> Result<(), FileError> {
        let file = self.files.get_mut(&id).expect("an encoded file is known");
        let parquet = |source| LakeError::Parquet {
            path: file.tmp.clone(),
            source,
        };
        let chunks = chunks.map_err(parquet)?;
        let mut row_group = file.writer.next_row_group().map_err(parquet)?;
        for chunk in chunks {
            chunk.append_to_row_group(&mut row_group).map_err(parquet)?;
        }
        row_group.close().map_err(parquet)?;
        file.encoding -= 1;
        self.finish_if_done(id)
    }

    /// Finishes file `id` if it is closing and all its row groups are in: footer, fsync, rename
    /// into place, as [`Lake::write`] does.
    fn finish_if_done(&mut self, id: u64) -> Result<(), FileError> {
        if !self
            .files
            .get(&id)
            .is_some_and(|f| f.closing && f.encoding == 0)
        {
            return Ok(());
        }
        let file = self.files.remove(&id).expect("checked above");
        let tmp = file.tmp;
        let out = file
            .writer
            .into_inner()
            .map_err(|source| LakeError::Parquet {
                path: tmp.clone(),
                source,
            })?;
        // Syncing waits on the disk, so a thread of its own syncs and moves the file into its
        // table while the sequencer goes on; files that end together (every open hour at the
        // end of the input) are synced at once instead of one after another.
        while self.finishing.len() >= MAX_FINISHING {
            self.join_oldest()?;
        }
        let (lake, metrics, rows, hour, schema) = (
            self.lake.clone(),
            Arc::clone(&self.metrics),
            file.rows,
            file.hour,
            file.schema,
        );
        let (table, source, adds) = (file.table, self.source.clone(), Arc::clone(&self.adds));
        self.finishing.push_back(std::thread::spawn(move || {
            out.sync_all().map_err(io("syncing", &tmp))?;
            let bytes = out.metadata().map_err(io("reading", &tmp))?.len();
            // The lock stays held until the file is in its table (moved, or uploaded and
            // removed): another run starting the same file would take it for a dead run's.
            let add = crate::delta::block_on(lake.delta().put_local_file(
                table.name(),
                &schema,
                &tmp,
                hour,
                &source,
                true,
            ))?;
            drop(out);
            metrics.written(table.name(), rows, bytes);
            tracing::debug!(file = %add.path, rows, bytes, "ingest file written, to be committed");
            adds.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((table, add));
            Ok(())
        }));
        Ok(())
    }

    /// Waits for the file finished longest ago to be synced and in place.
    fn join_oldest(&mut self) -> Result<(), FileError> {
        let Some(finishing) = self.finishing.pop_front() else {
            return Ok(());
        };
        match finishing.join() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(panic) => Err(FileError::Decoder {
                input: self.source.clone(),
                message: panic_message(panic),
            }),
        }
    }
}

/// A decoded chunk waiting for its turn in input order.
struct Taken {
    first: i64,
    last: i64,
    batches: HourBatches,
}

/// Creates and locks a new temporary `<prefix>p<pid>-<id>-<attempt>.tmp` in `dir` for a file being
/// written, after removing the temporaries with the same prefix that no process holds: what an
/// earlier run of the same input left when it died. The lock (`flock`) is the process's until
/// the file is closed or the process ends, so a run beside this one keeps its own.
fn create_temporary(dir: &Path, prefix: &str, id: u64) -> Result<(PathBuf, File), LakeError> {
    use rustix::fs::{flock, FlockOperation};
    for entry in std::fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        // `<prefix minus its dash>.tmp` is how gpuwarden named them before they had names of
        // their own.
        let older = prefix
            .strip_suffix('-')
            .is_some_and(|p| name.strip_suffix(".tmp") == Some(p));
        if !(older || name.starts_with(prefix) && name.ends_with(".tmp")) {
            continue;
        }
        let Ok(stale) = File::open(entry.path()) else {
            continue;
        };
        if flock(&stale, FlockOperation::NonBlockingLockExclusive).is_ok() {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    tracing::info!(file = %entry.path().display(), "removed the temporary of an ingest that stopped")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("removing", &entry.path())(e)),
            }
        }
    }
    for attempt in 0u32.. {
        let tmp = dir.join(format!(
            "{prefix}p{}-{id}-{attempt}.tmp",
            std::process::id()
        ));
        let out = match File::options().write(true).create_new(true).open(&tmp) {
            Ok(out) => out,
            // Another ingest in this process (the same pid) has this one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io("creating", &tmp)(e)),
        };
        flock(&out, FlockOperation::NonBlockingLockExclusive)
            .map_err(|e| io("locking", &tmp)(e.into()))?;
        // Another run's sweep may have taken it for a dead run's between its creation and the
        // lock, and removed it: then take another.
        if std::os::unix::fs::MetadataExt::nlink(&out.metadata().map_err(io("reading", &tmp))?) > 0
        {
            return Ok((tmp, out));
        }
    }
    unreachable!("the attempts go on until one holds")
}

fn trim(line: &[u8]) -> &[u8] {
    let mut end = line.len();
    while end > 0 && matches!(line[end - 1], b'\n' | b'\r' | b' ' | b'\t') {
        end -= 1;
    }
    &line[..end]
}

fn sanitize(name: &str) -> String {
    let base = std::path::Path::new(name)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(name);
    base.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
    use crate::lake::hour_of;

    #[test]
    fn lines_split_across_blocks_and_chunks_keep_their_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let mut text = String::new();
        let mut expected_bad = Vec::new();
        for i in 1..=300 {
            if i % 50 == 0 {
                text.push_str("   \r\n");
                continue;
            }
            if i % 77 == 0 {
                text.push_str("{\"v\":1,\n");
                expected_bad.push(i);
                continue;
            }
            text.push_str(&format!(
                "{{\"v\":1,\"ts_ms\":{},\"interval_ms\":5000,\"host\":\"h\",\"gpu_uuid\":\"GPU-{i}\",\"gpu_model\":\"m\",\"util_gpu_pct\":1,\"mem_used_bytes\":1,\"mem_total_bytes\":2}}\r\n",
                1_767_225_600_000i64 + i * 1000
            ));
        }
        text.push_str("{\"v\":1"); // a last line without a newline, and broken
        let metrics = Arc::new(Metrics::default());
        for (run, (block, chunk)) in [(7, 37), (64, 1), (1 << 20, 1000)].into_iter().enumerate() {
            let mut input = std::io::Cursor::new(text.clone().into_bytes());
            let report = ingest_blocks(
                &mut input,
                "t.jsonl",
                Table::Samples,
                &lake,
                IngestOptions {
                    chunk_lines: chunk,
                    ..IngestOptions::new(2)
                },
                &Bounds::none(),
                &metrics,
                block,
            )
            .unwrap();
            assert_eq!(report.records, 300 - 6 + 1, "block {block}, chunk {chunk}");
            // The same content read in other blocks and chunks is the same input: it lands once.
            let (written, quarantined) = if run == 0 {
                (
                    300 - 6 + 1 - expected_bad.len() as u64 - 1,
                    expected_bad.len() as u64 + 1,
                )
            } else {
                (0, 0)
            };
            assert_eq!((report.written, report.quarantined), (written, quarantined));
        }
        // The quarantined lines carry their line numbers: read them back from the lake.
        let mut offsets = Vec::new();
        for entry in committed(&lake, Table::Quarantine) {
            let file = std::fs::File::open(entry).unwrap();
            let reader =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                    .unwrap()
                    .build()
                    .unwrap();
            for batch in reader {
                let batch = batch.unwrap();
                let col = batch.column_by_name("offset").unwrap();
                let col = col
                    .as_any()
                    .downcast_ref::<arrow_array::Int64Array>()
                    .unwrap();
                offsets.extend(col.values().iter().copied());
            }
        }
        offsets.sort_unstable();
        // The same input three times (other blocks and chunks): the same content, committed once.
        let mut want: Vec<i64> = expected_bad.clone();
        want.push(301);
        assert_eq!(offsets, want);
    }

    /// `per_hour` samples in each of `hours` hours (the `i`th: GPU `i % 10` at second `i / 10`
    /// of its hour), in an order shuffled by a fixed seed; and the hours.
    fn shuffled_samples(hours: i64, per_hour: i64) -> (String, Vec<i64>) {
        let t0 = 1_767_225_600_000i64;
        let mut lines: Vec<(u64, String)> = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for h in 0..hours {
            for i in 0..per_hour {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                lines.push((seed, format!(
                    "{{\"v\":1,\"ts_ms\":{},\"interval_ms\":5000,\"host\":\"h\",\"gpu_uuid\":\"GPU-{}\",\"gpu_model\":\"m\",\"util_gpu_pct\":1,\"mem_used_bytes\":1,\"mem_total_bytes\":2}}\n",
                    t0 + h * 3_600_000 + (i / 10) * 1000,
                    i % 10
                )));
            }
        }
        lines.sort();
        let text = lines.into_iter().map(|(_, l)| l).collect();
        (text, (0..hours).map(|h| t0 + h * 3_600_000).collect())
    }

    /// The files of `table` its latest commit names, as local paths.
    fn committed(lake: &Lake, table: Table) -> Vec<PathBuf> {
        crate::delta::block_on(lake.delta().files(table.name(), crate::delta::AsOf::Latest))
            .unwrap()
            .map(|files| {
                files
                    .files
                    .iter()
                    .map(|f| lake.root().join(table.name()).join(&f.path))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every committed sample file of the lake: its path relative to the lake, and its
    /// `(ts_ms, gpu)`s.
    fn sample_files(lake: &std::path::Path) -> BTreeMap<PathBuf, Vec<(i64, String)>> {
        let mut files = BTreeMap::new();
        for path in committed(&Lake::open(lake).unwrap(), Table::Samples) {
            let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
                File::open(&path).unwrap(),
            )
            .unwrap()
            .build()
            .unwrap();
            let mut rows = Vec::new();
            for batch in reader {
                let batch = batch.unwrap();
                let ts = batch.column_by_name("ts_ms").unwrap();
                let ts = ts
                    .as_any()
                    .downcast_ref::<arrow_array::Int64Array>()
                    .unwrap();
                let gpu = arrow_array::cast::AsArray::as_string::<i32>(
                    batch.column_by_name("gpu_uuid").unwrap(),
                );
                for i in 0..batch.num_rows() {
                    rows.push((ts.value(i), gpu.value(i).to_string()));
                }
            }
            files.insert(path.strip_prefix(lake).unwrap().to_path_buf(), rows);
        }
        files
    }

    fn options(chunk_lines: usize, threads: usize, buffer_bytes: usize) -> IngestOptions {
        IngestOptions {
            chunk_lines,
            threads,
            buffer_bytes,
            open_files: 4,
        }
    }

    fn ingest_text(lake: &Lake, text: &str, options: IngestOptions) -> FileReport {
        ingest_blocks(
            &mut std::io::Cursor::new(text.as_bytes().to_vec()),
            "export.jsonl",
            Table::Samples,
            lake,
            options,
            &Bounds::none(),
            &Arc::new(Metrics::default()),
            4096,
        )
        .unwrap()
    }

    #[test]
    fn samples_in_any_order_make_one_file_per_hour_with_every_row_once() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let (text, hours) = shuffled_samples(3, 2_000);
        // Small chunks, so that every chunk holds rows of every hour, and a small budget, so
        // that waiting rows are written out as small row groups many times over.
        let report = ingest_text(
            &lake,
            &text,
            IngestOptions {
                chunk_lines: 100,
                threads: 3,
                buffer_bytes: 16 << 10,
                open_files: OPEN_FILES,
            },
        );
        assert_eq!(
            (report.records, report.written, report.files),
            (6_000, 6_000, 3)
        );
        let files = sample_files(dir.path());
        assert_eq!(files.len(), 3, "one file per hour: {:?}", files.keys());
        for (path, rows) in &files {
            let name = path.file_name().unwrap().to_str().unwrap();
            let hour = hours
                .iter()
                .find(|&&h| crate::delta::hour_of_file(name) == Some(h))
                .unwrap_or_else(|| panic!("{} is in no hour of the input", path.display()));
            assert_eq!(rows.len(), 2_000, "{}", path.display());
            assert!(rows.iter().all(|(ts, _)| hour_of(*ts) == *hour));
            let mut distinct = rows.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 2_000, "no row twice in {}", path.display());
            assert!(
                name[14..].starts_with("file-samples-export.jsonl-"),
                "{name}"
            );
        }
        // Spilling made many row groups: the rows are all there regardless.
        let row_groups: usize = committed(&lake, Table::Samples)
            .iter()
            .map(|p| {
                parquet::file::reader::FileReader::metadata(
                    &parquet::file::reader::SerializedFileReader::new(File::open(p).unwrap())
                        .unwrap(),
                )
                .num_row_groups()
            })
            .sum();
        assert!(row_groups > 3, "{row_groups} row groups");
        let (_, changed) = crate::delta::block_on(lake.delta().changed_hours("samples", Some(0)))
            .unwrap()
            .unwrap();
        assert_eq!(
            changed.unwrap().into_iter().collect::<Vec<_>>(),
            hours,
            "every hour is rolled up again"
        );
    }

    /// An input that gives at most a few bytes per read, as a pipe may.
    struct Trickle(std::io::Cursor<Vec<u8>>);

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(7);
            self.0.read(&mut buf[..n])
        }
    }

    #[test]
    fn an_input_read_a_few_bytes_at_a_time_makes_the_same_files() {
        // More hours than files stay open, so that file ranges show where chunks ended.
        let (text, _) = shuffled_samples(7, 60);
        let (whole, trickled) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let whole_lake = Lake::open(whole.path()).unwrap();
        let whole_report = ingest_text(&whole_lake, &text, options(20, 2, 1 << 20));
        let trickled_lake = Lake::open(trickled.path()).unwrap();
        let mut input = std::io::BufReader::with_capacity(
            1,
            Trickle(std::io::Cursor::new(text.clone().into_bytes())),
        );
        let trickled_report = ingest_blocks(
            &mut input,
            "export.jsonl",
            Table::Samples,
            &trickled_lake,
            options(20, 2, 1 << 20),
            &Bounds::none(),
            &Arc::new(Metrics::default()),
            4096,
        )
        .unwrap();
        assert_eq!(trickled_report, whole_report);
        let rows = |files: BTreeMap<PathBuf, Vec<(i64, String)>>| {
            let mut rows: Vec<_> = files.into_values().collect();
            rows.sort();
            rows
        };
        let files = sample_files(whole.path());
        assert!(files.len() > 7, "{} files", files.len());
        assert_eq!(rows(sample_files(trickled.path())), rows(files));
    }

    #[test]
    fn ingesting_the_same_content_again_adds_nothing_and_a_dead_runs_leftovers_go() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        // More hours than files stay open: hours met again after their file was finished get
        // a second file, with a line range disjoint from the first's.
        let hours = 7;
        let (text, _) = shuffled_samples(hours, 60);
        let total = (hours * 60) as usize;
        let report = ingest_text(
            &lake,
            &text,
            options(20, 2, IngestOptions::DEFAULT_BUFFER_BYTES),
        );
        assert_eq!(report.written, total as u64);
        let first = sample_files(dir.path());
        assert!(first.len() > hours as usize, "{} files", first.len());
        let rows: Vec<_> = first.values().flatten().cloned().collect();
        let mut distinct = rows.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!((rows.len(), distinct.len()), (total, total));

        // Again, with other threads and a budget that spills all the time: the same content,
        // so nothing is added, and the files put for it are deleted.
        let again = ingest_text(&lake, &text, options(20, 3, 1));
        assert_eq!((again.written, again.files), (0, 0));
        assert_eq!(sample_files(dir.path()), first);
        let on_disk = walk(&dir.path().join("samples")).len();
        assert_eq!(on_disk, first.len(), "no uncommitted file is left");

        // A run that died left temporaries no process holds (named as an older gpuwarden named
        // them, and as this one does) in the staging directory: the next run of the input
        // removes them. Other content under the same name adds its rows.
        let staging = lake.staging_dir("samples");
        for name in [
            ".file-samples-export.jsonl-o00000000000000000001-p1-0-0.tmp",
            ".file-samples-export.jsonl-o00000000000000000001.tmp",
        ] {
            std::fs::write(staging.join(name), b"PAR1 half").unwrap();
        }
        let other = text.replace("\"GPU-", "\"GPU-b");
        let report = ingest_text(&lake, &other, options(20, 1, 1 << 20));
        assert_eq!(report.written, total as u64);
        let rows: Vec<_> = sample_files(dir.path()).into_values().flatten().collect();
        assert_eq!(rows.len(), 2 * total);
        let leftovers: Vec<_> = walk_all(&staging)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|x| x == "tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    /// Two ingests of other content under one name at once (two `late.jsonl`, in parallel):
    /// neither takes the other's temporaries for a dead run's, and both keep every row.
    #[test]
    fn two_ingests_of_one_name_at_once_keep_both() {
        let (text, _) = shuffled_samples(12, 60);
        let other = text.replace("\"GPU-", "\"GPU-b");
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let lake = Lake::open(dir.path()).unwrap();
            std::thread::scope(|scope| {
                for text in [&text, &other] {
                    let lake = lake.clone();
                    scope.spawn(move || ingest_text(&lake, text, options(10, 2, 1 << 20)));
                }
            });
            let rows: Vec<_> = sample_files(dir.path()).into_values().flatten().collect();
            let mut distinct = rows.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!((rows.len(), distinct.len()), (2 * 720, 2 * 720));
            let leftovers: Vec<_> = walk_all(&lake.staging_dir("samples"))
                .into_iter()
                .filter(|p| p.extension().is_some_and(|x| x == "tmp"))
                .collect();
            assert!(leftovers.is_empty(), "{leftovers:?}");
        }
    }

    fn walk_all(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                out.extend(walk_all(&e.path()));
            } else {
                out.push(e.path());
            }
        }
        out
    }

    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                out.extend(walk(&e.path()));
            } else if e.path().extension().is_some_and(|x| x == "parquet") {
                out.push(e.path());
            }
        }
        out
    }
}
