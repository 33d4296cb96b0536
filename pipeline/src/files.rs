//! `gpuwarden ingest`: the same decoder, validator, quarantine and writer as the Kafka path, fed
//! from JSON-lines files, for backfill and for trying gpuwarden on exported data.
//!
//! The input is cut into chunks of whole lines; chunks are decoded and written in parallel, each
//! to files named after the input and the chunk's line range, so ingesting the same file again
//! rewrites the same files instead of adding rows twice.

use std::io::{BufRead, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use crate::bounds::{Bounds, Direction};
use crate::buffer::{Arrival, Outcome, SourceBuffer, Table};
use crate::lake::{Lake, LakeError};
use crate::metrics::Metrics;
use crate::writer::{Job, Writers};

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
    /// A decoding thread failed (a bug): what it decoded may be missing from the lake.
    #[error("decoding {input} failed: {message}; this is a bug, and records of the input may be missing from the lake")]
    Decoder {
        /// The input's name.
        input: String,
        /// What the thread said.
        message: String,
    },
}

/// Bytes read at a time.
const READ_BLOCK: usize = 4 << 20;

/// Whole lines, as read, in one buffer (no allocation per line).
struct Chunk {
    data: Vec<u8>,
    /// `(start, end, 1-based line number)` of each non-empty line in `data`, newline excluded.
    lines: Vec<(usize, usize, i64)>,
    /// Where the next line not yet indexed starts.
    scanned: usize,
}

impl Chunk {
    fn with_capacity(lines: usize) -> Self {
        Self {
            data: Vec::with_capacity(lines * 512),
            lines: Vec::with_capacity(lines),
            scanned: 0,
        }
    }
}

/// Reads JSON lines of `table`'s records from `input` into the lake. `name` identifies the input
/// in file names and in quarantine rows (`file:<name>`); `chunk_lines` lines make one chunk;
/// `threads` chunks are decoded at once. A record dated further ahead of the time its chunk was
/// read than `bounds` allow is quarantined. Progress goes to the log every ten chunks.
#[allow(clippy::too_many_arguments)]
pub fn ingest(
    input: &mut dyn BufRead,
    name: &str,
    table: Table,
    lake: &Lake,
    chunk_lines: usize,
    threads: usize,
    bounds: &Bounds,
    metrics: &Arc<Metrics>,
) -> Result<FileReport, FileError> {
    ingest_blocks(
        input,
        name,
        table,
        lake,
        chunk_lines,
        threads,
        bounds,
        metrics,
        READ_BLOCK,
    )
}

#[allow(clippy::too_many_arguments)]
fn ingest_blocks(
    input: &mut dyn BufRead,
    name: &str,
    table: Table,
    lake: &Lake,
    chunk_lines: usize,
    threads: usize,
    bounds: &Bounds,
    metrics: &Arc<Metrics>,
    read_block: usize,
) -> Result<FileReport, FileError> {
    let source = format!("file-{}-{}", table.name(), sanitize(name));
    let topic = format!("file:{name}");
    let stop = Arc::new(AtomicBool::new(false));
    // A bounded queue: decoders wait for the writers instead of piling batches up in memory.
    let (writers, done) = Writers::start_bounded(
        threads,
        threads,
        lake.clone(),
        Arc::clone(metrics),
        Arc::clone(&stop),
    );
    let (chunk_tx, chunk_rx) = mpsc::sync_channel::<Chunk>(threads.max(1));
    // Decoded chunks come back to be filled again: their memory is allocated once.
    let (spare_tx, spare_rx) = mpsc::channel::<Chunk>();
    let chunk_rx = Arc::new(Mutex::new(chunk_rx));
    let (records, quarantined, future) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let writers = Arc::new(writers);
    let decoders: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let (chunk_rx, writers, metrics, records, quarantined, future) = (
                Arc::clone(&chunk_rx),
                Arc::clone(&writers),
                Arc::clone(metrics),
                Arc::clone(&records),
                Arc::clone(&quarantined),
                Arc::clone(&future),
            );
            let bounds = *bounds;
            let (source, topic, spare_tx) = (source.clone(), topic.clone(), spare_tx.clone());
            std::thread::spawn(move || loop {
                let chunk = match chunk_rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                    Ok(chunk) => chunk,
                    Err(_) => return,
                };
                let arrival = Arrival {
                    ms: crate::consume::wall_ms(),
                    bounds: &bounds,
                };
                let mut buffer = SourceBuffer::default();
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
                let mut chunk = chunk;
                chunk.data.clear();
                chunk.lines.clear();
                chunk.scanned = 0;
                let _ = spare_tx.send(chunk);
                let sealed = buffer
                    .seal()
                    .expect("batches of validated rows build")
                    .expect("a chunk has lines");
                writers.submit(Job {
                    source: source.clone(),
                    topic: topic.clone(),
                    partition: -1,
                    sealed,
                    journal: false,
                });
            })
        })
        .collect();

    let started = Instant::now();
    let (mut line_no, mut chunks) = (0i64, 0u64);
    let mut chunk = Chunk::with_capacity(chunk_lines);
    // Blocks are read straight into the chunk's buffer; lines are found with memchr and never
    // copied one by one. An unfinished last line moves to the next chunk.
    let read_error = loop {
        let n = match (&mut *input)
            .take(read_block as u64)
            .read_to_end(&mut chunk.data)
        {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                break Some(FileError::Read {
                    input: name.to_string(),
                    source,
                })
            }
        };
        let eof = n == 0;
        let mut start = chunk.scanned;
        while start < chunk.data.len() {
            let end = match memchr::memchr(b'\n', &chunk.data[start..]) {
                Some(i) => start + i,
                None if eof => chunk.data.len(),
                None => break,
            };
            line_no += 1;
            if !trim(&chunk.data[start..end]).is_empty() {
                chunk.lines.push((start, end, line_no));
            }
            start = end + 1;
        }
        chunk.scanned = start.min(chunk.data.len());
        if chunk.lines.len() >= chunk_lines || (eof && !chunk.lines.is_empty()) {
            let mut next = spare_rx
                .try_recv()
                .unwrap_or_else(|_| Chunk::with_capacity(chunk_lines));
            next.data.extend_from_slice(&chunk.data[chunk.scanned..]);
            chunk.data.truncate(chunk.scanned);
            let full = std::mem::replace(&mut chunk, next);
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
    let mut decoder_failed = None;
    for d in decoders {
        if let Err(panic) = d.join() {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "no message".into());
            decoder_failed = Some(FileError::Decoder {
                input: name.to_string(),
                message,
            });
        }
    }
    let writers =
        Arc::try_unwrap(writers).unwrap_or_else(|_| unreachable!("every decoder has finished"));
    writers.join();
    drop(done);
    if let Some(e) = read_error.or(decoder_failed) {
        return Err(e);
    }
    let (records, quarantined) = (
        records.load(Ordering::Relaxed),
        quarantined.load(Ordering::Relaxed),
    );
    Ok(FileReport {
        records,
        written: records - quarantined,
        quarantined,
        future: future.load(Ordering::Relaxed),
    })
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
    use super::*;

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
        for (block, chunk) in [(7, 37), (64, 1), (1 << 20, 1000)] {
            let mut input = std::io::Cursor::new(text.clone().into_bytes());
            let report = ingest_blocks(
                &mut input,
                "t.jsonl",
                Table::Samples,
                &lake,
                chunk,
                2,
                &Bounds::none(),
                &metrics,
                block,
            )
            .unwrap();
            assert_eq!(report.records, 300 - 6 + 1, "block {block}, chunk {chunk}");
            assert_eq!(report.quarantined, expected_bad.len() as u64 + 1);
        }
        // The quarantined lines carry their line numbers: read them back from the lake.
        let mut offsets = Vec::new();
        for entry in walk(&dir.path().join("quarantine")) {
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
        offsets.dedup();
        let mut want: Vec<i64> = expected_bad.clone();
        want.push(301);
        assert_eq!(offsets, want);
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
