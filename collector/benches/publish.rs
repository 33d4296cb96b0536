//! Benchmark: samples encoded and published per second by the collector's path (simulated fleet
//! of 10,000 GPUs → JSON → bounded buffer → idempotent producer), as a ratio to a bare rdkafka
//! producer loop sending the same bytes with the same producer settings, in the same run, against
//! the same in-process broker. Run on one core: `bench/collector-publish.sh` (taskset -c 0).
//!
//! Reports per phase: samples/s, CPU µs per sample (process user+system time, broker included
//! for both phases alike), and peak RSS (VmHWM, reset between phases).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_collector::sim::Fleet;
use gpuwarden_collector::sink::producer_config;
use gpuwarden_collector::{KafkaSink, Metrics, SinkSettings};
use gpuwarden_schema::config;
use gpuwarden_schema::kafka::{ensure_topics, EmbeddedBroker};
use gpuwarden_schema::{Record, Sample};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

const GPUS_PER_HOST: u32 = 8;
const HOSTS: u32 = 1_250; // 10,000 GPUs
const ROUNDS: i64 = 20; // 200,000 samples per phase
const INTERVAL_MS: i64 = 5_000;
const START_MS: i64 = 1_767_225_600_000;

fn cpu_seconds() -> f64 {
    // utime and stime of the whole process, in clock ticks (fields 14 and 15 of /proc/self/stat).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    kb / 1024.0
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

struct Phase {
    name: &'static str,
    samples: usize,
    wall: Duration,
    cpu: f64,
    rss: f64,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.samples as f64 / self.wall.as_secs_f64()
    }
    fn print(&self) {
        println!(
            "{:<28} {:>9} samples  {:>8.3} s  {:>10.0} samples/s  {:>6.2} CPU µs/sample  peak RSS {:>7.1} MiB",
            self.name,
            self.samples,
            self.wall.as_secs_f64(),
            self.rate(),
            self.cpu * 1e6 / self.samples as f64,
            self.rss
        );
    }
}

fn fleet() -> Fleet {
    let text = format!(
        "[[substrates]]\nname = \"bench\"\ndriver = \"simulated\"\nhosts = [{{ prefix = \"h\", count = {HOSTS}, gpus = {GPUS_PER_HOST}, gpu_model = \"NVIDIA H100 80GB HBM3\" }}]\n"
    );
    let config = config::parse("bench.toml", &text).unwrap();
    Fleet::new(&config.substrates[0], 42).unwrap()
}

fn bare(client: &ClientConfig, settings: &SinkSettings, encoded: &[(Vec<u8>, Vec<u8>)]) -> Phase {
    reset_peak_rss();
    let producer: BaseProducer = producer_config(client, settings).create().unwrap();
    let (start, cpu) = (Instant::now(), cpu_seconds());
    for (key, payload) in encoded {
        loop {
            match producer.send(
                BaseRecord::<[u8], [u8]>::to(gpuwarden_schema::topics::SAMPLES)
                    .key(key)
                    .payload(payload),
            ) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    producer.poll(Duration::from_millis(1));
                }
                Err((e, _)) => panic!("bare producer: {e}"),
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(120)).unwrap();
    Phase {
        name: "bare rdkafka producer loop",
        samples: encoded.len(),
        wall: start.elapsed(),
        cpu: cpu_seconds() - cpu,
        rss: peak_rss_mib(),
    }
}

fn collector(
    client: &ClientConfig,
    settings: &SinkSettings,
    with_sampling: bool,
    rounds: &[Vec<Sample>],
) -> Phase {
    reset_peak_rss();
    let metrics = Arc::new(Metrics::default());
    let mut fleet = fleet();
    let sink = KafkaSink::start(
        client,
        gpuwarden_schema::topics::SAMPLES,
        settings.clone(),
        Arc::clone(&metrics),
    )
    .unwrap();
    let (start, cpu) = (Instant::now(), cpu_seconds());
    let mut total = 0;
    for (r, pre) in rounds.iter().enumerate() {
        let samples = if with_sampling {
            fleet.sample(START_MS + r as i64 * INTERVAL_MS, INTERVAL_MS)
        } else {
            pre.clone()
        };
        total += samples.len();
        sink.send(samples);
    }
    let report = sink.close(Duration::from_secs(300));
    assert_eq!(
        report.published as usize, total,
        "every sample published: {report:?}"
    );
    let name = if with_sampling {
        "collector (sim+encode+publish)"
    } else {
        "collector (encode+publish)"
    };
    Phase {
        name,
        samples: total,
        wall: start.elapsed(),
        cpu: cpu_seconds() - cpu,
        rss: peak_rss_mib(),
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // GPUWARDEN_BENCH_BROKER: a broker of its own process (bench/tansu.sh); else the mock
    // cluster in this one.
    let embedded;
    let bootstrap = match std::env::var("GPUWARDEN_BENCH_BROKER") {
        Ok(bootstrap) => {
            println!("broker: {bootstrap}, a process of its own (its CPU not counted)");
            bootstrap
        }
        Err(_) => {
            embedded = EmbeddedBroker::start(6).unwrap();
            println!("broker: librdkafka's mock cluster in this process");
            embedded.bootstrap_servers().to_string()
        }
    };
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", &bootstrap);
    ensure_topics(&client, &gpuwarden_schema::topics::ALL, 6, 1).unwrap();
    // Every round is handed over at once (no 5 s pause between them), so the buffer must hold
    // the whole run; the default 64 MiB would (rightly) drop the oldest.
    let settings = SinkSettings {
        max_buffer_bytes: 1 << 30,
        ..SinkSettings::default()
    };

    let mut fleet = fleet();
    let rounds: Vec<Vec<Sample>> = (0..ROUNDS)
        .map(|r| fleet.sample(START_MS + r * INTERVAL_MS, INTERVAL_MS))
        .collect();
    let encoded: Vec<(Vec<u8>, Vec<u8>)> = rounds
        .iter()
        .flatten()
        .map(|s| (s.key().as_bytes().to_vec(), s.to_json()))
        .collect();
    let bytes: usize = encoded.iter().map(|(k, v)| k.len() + v.len()).sum();
    println!(
        "{} GPUs x {ROUNDS} rounds = {} samples, {:.0} bytes/sample on the wire before compression",
        HOSTS * GPUS_PER_HOST,
        encoded.len(),
        bytes as f64 / encoded.len() as f64
    );
    let sim_start = Instant::now();
    let mut probe = self::fleet();
    for r in 0..ROUNDS {
        std::hint::black_box(probe.sample(START_MS + r * INTERVAL_MS, INTERVAL_MS));
    }
    println!(
        "simulated fleet alone: {:.1} ms per round of 10,000 GPUs",
        sim_start.elapsed().as_secs_f64() * 1e3 / ROUNDS as f64
    );

    // Warm the broker and the code paths once, then run the three phases in turn, several
    // times, and compare medians: a single run on a shared machine varies by tens of percent.
    let _ = bare(&client, &settings, &encoded[..20_000]);
    const REPEATS: usize = 5;
    let mut runs: [Vec<Phase>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..REPEATS {
        runs[0].push(bare(&client, &settings, &encoded));
        runs[1].push(collector(&client, &settings, false, &rounds));
        runs[2].push(collector(&client, &settings, true, &rounds));
    }
    println!();
    for phase in runs.iter().flatten() {
        phase.print();
    }
    let median = |phases: &mut Vec<Phase>| {
        phases.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
        phases.remove(phases.len() / 2)
    };
    let [mut peer, mut ours, mut ours_sim] = runs;
    let (peer, ours, ours_sim) = (median(&mut peer), median(&mut ours), median(&mut ours_sim));
    println!("\nmedians of {REPEATS} runs:");
    peer.print();
    ours.print();
    ours_sim.print();
    println!();
    println!(
        "ratio encode+publish / bare       = {:.2} (target >= 0.8)",
        ours.rate() / peer.rate()
    );
    println!(
        "ratio sim+encode+publish / bare   = {:.2}",
        ours_sim.rate() / peer.rate()
    );
    println!("note: peak RSS includes the run's input (200,000 samples, decoded and encoded) held by the bench itself");
}
