//! The sampling loop: one thread that owns the GPU source (and so all NVML calls), takes a
//! sample of every GPU each interval of event time, updates the `/metrics` gauges, and hands the
//! samples to the sink without waiting for Kafka.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use gpuwarden_schema::{Clock, LeaseEvent, Record, Sample};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::kubelet::KubeletSettings;
use crate::metrics::Metrics;
use crate::nvml::{NvmlLibrary, NvmlSource, NvmlStartError};
use crate::sim::Fleet;
use crate::sink::{KafkaSink, SinkReport};

/// Where samples come from.
pub enum SourceSpec {
    /// This host's GPUs through NVML.
    Nvml {
        /// `libnvidia-ml.so` to load; the system's when `None`.
        library: Option<PathBuf>,
        /// Host name written into samples.
        host: String,
        /// Slurm's `ClusterName` when this is a Slurm node: names the lease of a process found
        /// through its Slurm cgroup (`collector.slurm_cluster`).
        slurm_cluster: Option<String>,
        /// On a Kubernetes node: the kubelet to ask which pod holds each GPU
        /// (`collector.kubelet_socket`); `None` asks nothing.
        kubelet: Option<KubeletSettings>,
        /// The kernel's SMBIOS entries (`collector.dmi_entries_dir`), whose OEM strings name
        /// the lease of the virtual machine this runs in, if it is one; `None` reads nothing.
        dmi_entries_dir: Option<PathBuf>,
    },
    /// A simulated fleet, which follows the leases it reads from `gpuwarden.leases` when a
    /// consumer config is given.
    Simulated {
        /// The fleet.
        fleet: Box<Fleet>,
        /// Client settings to read lease events with.
        leases: Option<ClientConfig>,
    },
}

impl std::fmt::Debug for SourceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nvml {
                library,
                host,
                slurm_cluster,
                kubelet,
                dmi_entries_dir,
            } => f
                .debug_struct("Nvml")
                .field("library", library)
                .field("host", host)
                .field("slurm_cluster", slurm_cluster)
                .field("kubelet", kubelet)
                .field("dmi_entries_dir", dmi_entries_dir)
                .finish(),
            Self::Simulated { fleet, .. } => f
                .debug_struct("Simulated")
                .field("gpus", &fleet.gpus().len())
                .finish(),
        }
    }
}

/// The collector could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// NVML did not start.
    #[error(transparent)]
    Nvml(#[from] NvmlStartError),
    /// The thread that asks the kubelet could not be started.
    #[error("cannot start asking the kubelet for pods: {0}")]
    Kubelet(std::io::Error),
    /// The sampling thread ended (panicked) before it could say whether the source opened.
    #[error("the sampling thread stopped before the GPU source opened; see the log above")]
    SamplerDied,
    /// The lease consumer of the simulated fleet could not be created.
    #[error("cannot read lease events from Kafka: {0}")]
    Leases(#[from] KafkaError),
}

/// An open source. The NVML one borrows the library, which the sampling thread keeps on its
/// stack for as long as it samples.
enum Source<'n> {
    Nvml(Box<NvmlSource<'n>>),
    Simulated {
        fleet: Box<Fleet>,
        leases: Option<BaseConsumer>,
    },
}

/// Where samples come from, opened in two steps: NVML's library first, then the source over it.
enum Opening {
    // Boxed: the library's table of NVML symbols is large.
    Nvml(Box<NvmlLibrary>, NvmlSettings),
    Simulated(Source<'static>),
}

/// What the NVML source needs besides the library.
struct NvmlSettings {
    host: String,
    slurm_cluster: Option<String>,
    kubelet: Option<KubeletSettings>,
    dmi_entries_dir: Option<PathBuf>,
}

impl Opening {
    fn start(spec: SourceSpec) -> Result<Self, StartError> {
        Ok(match spec {
            SourceSpec::Nvml {
                library,
                host,
                slurm_cluster,
                kubelet,
                dmi_entries_dir,
            } => Opening::Nvml(
                Box::new(NvmlLibrary::open(library.as_deref())?),
                NvmlSettings {
                    host,
                    slurm_cluster,
                    kubelet,
                    dmi_entries_dir,
                },
            ),
            SourceSpec::Simulated { fleet, leases } => {
                let leases = leases.map(|client| lease_consumer(&client)).transpose()?;
                Opening::Simulated(Source::Simulated { fleet, leases })
            }
        })
    }
}

impl<'n> Source<'n> {
    fn nvml(
        library: &'n NvmlLibrary,
        settings: NvmlSettings,
        metrics: &Arc<Metrics>,
    ) -> Result<Self, StartError> {
        let mut nvml = NvmlSource::open(
            library,
            settings.host,
            settings.slurm_cluster,
            Arc::clone(metrics),
        )?;
        if let Some(dir) = settings.dmi_entries_dir {
            nvml = nvml.with_guest_lease(&dir);
        }
        if let Some(kubelet) = settings.kubelet {
            nvml = nvml.with_pods(kubelet).map_err(StartError::Kubelet)?;
        }
        Ok(Source::Nvml(Box::new(nvml)))
    }

    fn sample(&mut self, ts_ms: i64, interval_ms: i64) -> Vec<Sample> {
        match self {
            Source::Nvml(nvml) => nvml.sample(ts_ms, interval_ms),
            Source::Simulated { fleet, leases } => {
                if let Some(consumer) = leases {
                    apply_lease_events(consumer, fleet);
                }
                fleet.sample(ts_ms, interval_ms)
            }
        }
    }
}

/// Reads every partition of `gpuwarden.leases` from the beginning, without a consumer group's
/// commits: each simulated fleet must see every lease, and rebuilds its state from the topic.
fn lease_consumer(client: &ClientConfig) -> Result<BaseConsumer, KafkaError> {
    let mut client = client.clone();
    gpuwarden_schema::kafka::low_latency(&mut client)
        .set("group.id", "gpuwarden-simulated-fleet")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer = client.create()?;
    let topic = gpuwarden_schema::topics::LEASES;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut assignment = TopicPartitionList::new();
    for t in metadata.topics() {
        for p in t.partitions() {
            assignment.add_partition_offset(topic, p.id(), Offset::Beginning)?;
        }
    }
    consumer.assign(&assignment)?;
    Ok(consumer)
}

fn apply_lease_events(consumer: &BaseConsumer, fleet: &mut Fleet) {
    for _ in 0..10_000 {
        match consumer.poll(Duration::ZERO) {
            None => break,
            Some(Ok(message)) => match LeaseEvent::from_json(message.payload().unwrap_or_default())
            {
                Ok(event) => fleet.apply(&event),
                Err(e) => {
                    tracing::warn!(error = %e, offset = message.offset(), "ignoring an invalid lease event")
                }
            },
            Some(Err(e)) => {
                tracing::warn!(error = %e, "reading lease events failed; retrying");
                break;
            }
        }
    }
}

/// A running collector: the sampling thread and its sink.
pub struct Collector {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    sink: Option<KafkaSink>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector").finish_non_exhaustive()
    }
}

impl Collector {
    /// Opens the source on the sampling thread and starts sampling every `interval` of `clock`
    /// time. Returns once the source is open (or failed to open).
    pub fn start(
        spec: SourceSpec,
        sink: KafkaSink,
        interval: Duration,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StartError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let sender = sink.sender();
        let thread = {
            let stop = Arc::clone(&stop);
            let metrics = Arc::clone(&metrics);
            std::thread::Builder::new()
                .name("gpu-sampler".into())
                .spawn(move || {
                    let run = |source: Result<Source<'_>, StartError>| {
                        let mut source = match source {
                            Ok(source) => {
                                let _ = ready_tx.send(Ok(()));
                                source
                            }
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        };
                        sample_loop(
                            &mut source,
                            &sender,
                            interval,
                            clock.as_ref(),
                            &metrics,
                            &stop,
                        );
                    };
                    match Opening::start(spec) {
                        Ok(Opening::Nvml(library, settings)) => {
                            run(Source::nvml(&library, settings, &metrics));
                        }
                        Ok(Opening::Simulated(source)) => run(Ok(source)),
                        Err(e) => run(Err(e)),
                    }
                })
                .expect("spawning the sampling thread")
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                stop,
                thread: Some(thread),
                sink: Some(sink),
                metrics,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(StartError::SamplerDied)
            }
        }
    }

    /// The metrics this collector updates.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Stops sampling, then publishes what is buffered within `flush_deadline`.
    pub fn stop(mut self, flush_deadline: Duration) -> SinkReport {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.sink
            .take()
            .map(|s| s.close(flush_deadline))
            .unwrap_or_default()
    }
}

fn sample_loop(
    source: &mut Source,
    sink: &crate::sink::SinkSender,
    interval: Duration,
    clock: &dyn Clock,
    metrics: &Metrics,
    stop: &AtomicBool,
) {
    let interval_ms = i64::try_from(interval.as_millis())
        .unwrap_or(i64::MAX)
        .max(1);
    let mut last: Option<i64> = None;
    let mut next = clock.now_ms();
    while !stop.load(Ordering::SeqCst) {
        let now = clock.now_ms();
        if now < next {
            let wait = clock.wall_for(Duration::from_millis((next - now) as u64));
            std::thread::sleep(wait.clamp(Duration::from_millis(1), Duration::from_millis(100)));
            continue;
        }
        // The interval a sample covers is the time since the previous one, so a stalled loop
        // neither loses nor double-counts GPU time.
        let covered = last.map_or(interval_ms, |last| {
            (now - last).clamp(1, gpuwarden_schema::sample::MAX_INTERVAL_MS)
        });
        let samples = source.sample(now, covered);
        last = Some(now);
        metrics.sampled(samples.len());
        metrics.set_latest(&samples);
        sink.send(samples);
        next += interval_ms;
        if next <= now {
            // Fell behind by more than an interval: skip ahead instead of bursting.
            next = now + interval_ms;
        }
    }
}
