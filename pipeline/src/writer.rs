//! Writer threads: turn sealed buffers into Parquet files in the lake, durably, and report back
//! so the consumer commits offsets only for what is on disk. A write that fails is retried with
//! backoff (the consumer stays paused meanwhile); nothing is acknowledged until it succeeds.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpuwarden_schema::retry::Backoff;

use crate::buffer::Sealed;
use crate::lake::{Intent, Lake, LakeError};
use crate::metrics::Metrics;

/// One flush: a source's sealed rows.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) source: String,
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) sealed: Sealed,
    /// Whether to journal the flush (Kafka sources: yes; files: their names suffice).
    pub(crate) journal: bool,
}

/// A finished flush.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) source: String,
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) last: i64,
    pub(crate) bytes: usize,
    pub(crate) files: Vec<PathBuf>,
}

/// A pool of writer threads.
pub(crate) struct Writers {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Writers {
    /// Starts `count` writers. `throttle` (bytes per second) slows them down, to test slow disks.
    /// The queue is unbounded: the caller bounds what it submits (the consumer counts the bytes
    /// in flight).
    pub(crate) fn start(
        count: usize,
        lake: Lake,
        metrics: Arc<Metrics>,
        throttle: Option<u64>,
        stop: Arc<AtomicBool>,
    ) -> (Self, Receiver<Done>) {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        Self::spawn(jobs, job_rx, count, lake, metrics, throttle, stop)
    }

    fn spawn(
        jobs: Sender<Job>,
        job_rx: Receiver<Job>,
        count: usize,
        lake: Lake,
        metrics: Arc<Metrics>,
        throttle: Option<u64>,
        stop: Arc<AtomicBool>,
    ) -> (Self, Receiver<Done>) {
        let (done_tx, done_rx) = mpsc::channel();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let threads = (0..count.max(1))
            .map(|i| {
                let (job_rx, done_tx, lake, metrics, stop) = (
                    Arc::clone(&job_rx),
                    done_tx.clone(),
                    lake.clone(),
                    Arc::clone(&metrics),
                    Arc::clone(&stop),
                );
                std::thread::Builder::new()
                    .name(format!("lake-writer-{i}"))
                    .spawn(move || loop {
                        let job = match job_rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                            Ok(job) => job,
                            Err(_) => return,
                        };
                        if let Some(done) = write_with_retry(&lake, &metrics, job, throttle, &stop)
                        {
                            if done_tx.send(done).is_err() {
                                return;
                            }
                        }
                    })
                    .expect("spawning a lake writer")
            })
            .collect();
        (
            Self {
                jobs: Some(jobs),
                threads,
            },
            done_rx,
        )
    }

    pub(crate) fn submit(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// Lets the writers finish what they have and stop.
    pub(crate) fn join(mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn write_with_retry(
    lake: &Lake,
    metrics: &Metrics,
    job: Job,
    throttle: Option<u64>,
    stop: &AtomicBool,
) -> Option<Done> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    loop {
        match write(lake, metrics, &job, throttle) {
            Ok(files) => {
                return Some(Done {
                    source: job.source,
                    topic: job.topic,
                    partition: job.partition,
                    last: job.sealed.last,
                    bytes: job.sealed.bytes,
                    files,
                });
            }
            Err(e) => {
                let pause = backoff.next_pause();
                tracing::error!(error = %e, source = %job.source, retry_in = ?pause, "cannot write to the lake; the data stays buffered and its offsets uncommitted");
                if stop.load(Ordering::SeqCst) {
                    return None;
                }
                std::thread::sleep(pause);
            }
        }
    }
}

fn write(
    lake: &Lake,
    metrics: &Metrics,
    job: &Job,
    throttle: Option<u64>,
) -> Result<Vec<PathBuf>, LakeError> {
    let started = Instant::now();
    let s = &job.sealed;
    let files: Vec<PathBuf> = s
        .batches
        .iter()
        .map(|(table, hour, _)| {
            Lake::file_name(table.name(), *hour, &job.source, s.first, s.last, s.digest)
        })
        .collect();
    if job.journal {
        lake.write_intent(&Intent {
            source: job.source.clone(),
            first: s.first,
            last: s.last,
            files: files.clone(),
        })?;
    }
    for ((table, hour, batch), file) in s.batches.iter().zip(&files) {
        let bytes = lake.write(file, batch, table.name(), *hour)?;
        metrics.written(table.name(), batch.num_rows(), bytes);
        if let Some(rate) = throttle {
            std::thread::sleep(Duration::from_secs_f64(
                bytes.max(1) as f64 / rate.max(1) as f64,
            ));
        }
    }
    metrics.flushed(started.elapsed().as_secs_f64());
    tracing::debug!(source = %job.source, first = s.first, last = s.last, files = files.len(), "flushed");
    Ok(files)
}
