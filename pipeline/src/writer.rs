//! Writer threads: commit sealed buffers to the lake's Delta tables, each with its source's
//! offsets as a Delta transaction, and report back so the consumer commits the offsets to Kafka
//! too (for monitoring and as the place a restart starts reading; the tables' transactions are
//! what makes a replay land once). A write that fails is retried with backoff (the consumer
//! stays paused meanwhile); nothing is acknowledged until it succeeds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpuwarden_schema::retry::Backoff;

use crate::buffer::{Sealed, Table};
use crate::delta::{AppTxn, Appended, NewFile};
use crate::lake::{Lake, LakeError};
use crate::metrics::Metrics;

/// One flush: a source's sealed rows.
#[derive(Debug)]
pub(crate) struct Job {
    /// `<topic>-p<partition>`: what its files' names say.
    pub(crate) source: String,
    /// The Delta transaction app id its commits carry.
    pub(crate) app_id: String,
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) sealed: Sealed,
}

/// A finished flush.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) last: i64,
    pub(crate) bytes: usize,
    /// Files committed, of every table.
    pub(crate) files: usize,
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

/// Commits the flush to each table it has rows of: the topic's own table last, so that the
/// version it holds for the source says every table holds the source up to there (what a new
/// owner of the partition resumes after).
fn write(
    lake: &Lake,
    metrics: &Metrics,
    job: &Job,
    throttle: Option<u64>,
) -> Result<usize, LakeError> {
    let started = Instant::now();
    let s = &job.sealed;
    let main = Table::of_topic(&job.topic);
    let mut tables: Vec<Table> = s.batches.iter().map(|(table, _, _)| *table).collect();
    tables.sort_by_key(|t| (Some(*t) == main, t.name()));
    tables.dedup();
    let txn = AppTxn {
        app_id: job.app_id.clone(),
        last: s.last,
    };
    let mut committed = 0;
    for table in tables {
        let files: Vec<NewFile<'_>> = s
            .batches
            .iter()
            .zip(&s.offsets)
            .filter(|((t, _, _), _)| *t == table)
            .map(|((_, hour, batch), offsets)| NewFile {
                hour_ms: *hour,
                batch,
                offsets: Some(offsets),
            })
            .collect();
        let appended = crate::delta::block_on(lake.delta().append(
            table.name(),
            &table.schema(),
            &job.source,
            &files,
            Some(&txn),
        ))?;
        match appended {
            Appended::Committed {
                rows, files, bytes, ..
            } => {
                committed += files;
                metrics.written(table.name(), rows, bytes as u64);
                if let Some(rate) = throttle {
                    std::thread::sleep(Duration::from_secs_f64(
                        bytes.max(1) as f64 / rate.max(1) as f64,
                    ));
                }
            }
            Appended::AlreadyThere { held } => {
                tracing::info!(table = table.name(), source = %job.source, held, last = s.last, "the table holds this range already (another owner of the partition, or a replay after a restart): nothing added");
            }
        }
    }
    metrics.flushed(started.elapsed().as_secs_f64());
    tracing::debug!(source = %job.source, first = s.first, last = s.last, files = committed, "flushed");
    Ok(committed)
}
