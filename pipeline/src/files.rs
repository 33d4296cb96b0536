//! `gpuwarden ingest`: the same decoder, validator, quarantine and writer as the Kafka path, fed
//! from JSON-lines files, for backfill and for trying gpuwarden on exported data.
//!
//! The input is cut into chunks of whole lines; chunks are decoded and written in parallel, each
//! to files named after the input and the chunk's line range, so ingesting the same file again
//! rewrites the same files instead of adding rows twice.

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use crate::buffer::{Outcome, SourceBuffer, Table};
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
}

struct Chunk {
    /// 1-based line number of the first line.
    first_line: i64,
    lines: Vec<Vec<u8>>,
    numbers: Vec<i64>,
}

/// Reads JSON lines of `table`'s records from `input` into the lake. `name` identifies the input
/// in file names and in quarantine rows (`file:<name>`); `chunk_lines` lines make one chunk;
/// `threads` chunks are decoded at once. Progress goes to the log every ten chunks.
pub fn ingest(
    input: &mut dyn BufRead,
    name: &str,
    table: Table,
    lake: &Lake,
    chunk_lines: usize,
    threads: usize,
    metrics: &Arc<Metrics>,
) -> Result<FileReport, FileError> {
    let source = format!("file-{}-{}", table.name(), sanitize(name));
    let topic = format!("file:{name}");
    let stop = Arc::new(AtomicBool::new(false));
    let (writers, done) = Writers::start(
        threads,
        lake.clone(),
        Arc::clone(metrics),
        None,
        Arc::clone(&stop),
    );
    let (chunk_tx, chunk_rx) = mpsc::sync_channel::<Chunk>(threads.max(1));
    let chunk_rx = Arc::new(Mutex::new(chunk_rx));
    let (records, quarantined) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writers = Arc::new(writers);
    let decoders: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let (chunk_rx, writers, metrics, records, quarantined) = (
                Arc::clone(&chunk_rx),
                Arc::clone(&writers),
                Arc::clone(metrics),
                Arc::clone(&records),
                Arc::clone(&quarantined),
            );
            let (source, topic) = (source.clone(), topic.clone());
            std::thread::spawn(move || {
                let received_ms = crate::consume::wall_ms();
                loop {
                    let chunk = match chunk_rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                        Ok(chunk) => chunk,
                        Err(_) => return,
                    };
                    let mut buffer = SourceBuffer::default();
                    for (line, number) in chunk.lines.iter().zip(&chunk.numbers) {
                        let outcome = buffer.add(table, line, &topic, -1, *number, received_ms);
                        let bad = outcome == Outcome::Quarantined;
                        metrics.record_in(&topic, bad);
                        records.fetch_add(1, Ordering::Relaxed);
                        if bad {
                            quarantined.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    let sealed = buffer
                        .seal()
                        .expect("batches of validated rows build")
                        .expect("a chunk has lines");
                    debug_assert_eq!(sealed.first, chunk.numbers[0]);
                    let _ = chunk.first_line;
                    writers.submit(Job {
                        source: source.clone(),
                        topic: topic.clone(),
                        partition: -1,
                        sealed,
                        journal: false,
                    });
                }
            })
        })
        .collect();

    let started = Instant::now();
    let (mut line_no, mut chunks) = (0i64, 0u64);
    let mut chunk = Chunk {
        first_line: 1,
        lines: Vec::with_capacity(chunk_lines),
        numbers: Vec::with_capacity(chunk_lines),
    };
    let mut line = Vec::new();
    let read_error = loop {
        line.clear();
        match input.read_until(b'\n', &mut line) {
            Ok(0) => break None,
            Ok(_) => {}
            Err(source) => {
                break Some(FileError::Read {
                    input: name.to_string(),
                    source,
                })
            }
        }
        line_no += 1;
        let trimmed = trim(&line);
        if trimmed.is_empty() {
            continue;
        }
        chunk.lines.push(trimmed.to_vec());
        chunk.numbers.push(line_no);
        if chunk.lines.len() >= chunk_lines {
            let full = std::mem::replace(
                &mut chunk,
                Chunk {
                    first_line: line_no + 1,
                    lines: Vec::with_capacity(chunk_lines),
                    numbers: Vec::with_capacity(chunk_lines),
                },
            );
            if chunk_tx.send(full).is_err() {
                break None;
            }
            chunks += 1;
            if chunks % 10 == 0 {
                tracing::info!(input = name, lines = line_no, elapsed = ?started.elapsed(), "ingesting");
            }
        }
    };
    if !chunk.lines.is_empty() {
        let _ = chunk_tx.send(chunk);
    }
    drop(chunk_tx);
    for d in decoders {
        let _ = d.join();
    }
    let writers =
        Arc::try_unwrap(writers).unwrap_or_else(|_| unreachable!("every decoder has finished"));
    writers.join();
    drop(done);
    if let Some(e) = read_error {
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
