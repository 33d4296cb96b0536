//! Compaction (Delta OPTIMIZE of final hours) and retention as an operator runs them:
//! `gpuwarden compact` after a backfill, killed at every step and at random times, two holders
//! of a bucket's role racing to commit the same hours, and `gpuwarden pipeline` compacting the
//! hours it finds final by itself.

mod support;

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::process::ok;
use support::s3::S3Server;
use support::{config_lake_i64, eventually, ingest_samples, lake_i64, Broker, Config};

/// 2026-01-01T00:00:00Z.
const T0: i64 = 1_767_225_600_000;
const HOUR_MS: i64 = 3_600_000;
/// Every hour of the tests' data is final by then.
const WATERMARK: &str = "2030-01-01T00:00:00Z";

/// Rows, distinct (GPU, time) pairs, and a checksum of the utilization, in one figure: equal
/// before and after means every row is there exactly once.
const FIGURES: &str = "SELECT count(*) * 1000000000 + count(DISTINCT (gpu_uuid, ts_ms)) * 1000 \
                       + CAST(sum(util_gpu_pct) AS BIGINT) % 1000 FROM samples";

fn sample(gpu: usize, ts_ms: i64) -> String {
    serde_json::json!({
        "v": 1, "ts_ms": ts_ms, "interval_ms": 5000, "host": format!("node-{}", gpu / 8),
        "gpu_uuid": format!("GPU-{gpu:04}"), "gpu_model": "NVIDIA A100-SXM4-80GB",
        "util_gpu_pct": ((gpu * 7 + (ts_ms / 5000) as usize * 13) % 100) as f64,
        "mem_used_bytes": 1u64 << 30, "mem_total_bytes": 85899345920u64
    })
    .to_string()
}

/// Samples of `gpus`, every 5 s over `hours` hours from T0, in reverse time order.
fn lines(gpus: std::ops::Range<usize>, hours: i64) -> String {
    let mut out = Vec::new();
    for step in (0..hours * 720).rev() {
        for gpu in gpus.clone() {
            out.push(sample(gpu, T0 + step * 5_000));
        }
    }
    out.join("\n")
}

/// The tests' samples are from 2026-01-01: kept whatever the date.
const KEEP: &str = "[pipeline.retention]\nsamples = \"forever\"\n";

fn storage_config(dir: &Path, extra: &str) -> PathBuf {
    Config::new()
        .data_dir(&dir.join("data"))
        .raw(extra)
        .write(dir.join("c.toml"))
}

fn compact(config: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpuwarden"));
    command
        .args(["compact", "--config", config.to_str().unwrap()])
        .args(["--watermark", WATERMARK])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// The files of each hour of samples, as the table's latest commit names them.
fn files_per_hour(lake: &gpuwarden_pipeline::Lake) -> Vec<usize> {
    use gpuwarden_pipeline::delta::{block_on, AsOf};
    let mut hours = std::collections::BTreeMap::<i64, usize>::new();
    if let Some(files) = block_on(lake.delta().files("samples", AsOf::Latest)).unwrap() {
        for file in files.files {
            *hours.entry(file.hour_ms.unwrap()).or_default() += 1;
        }
    }
    hours.into_values().collect()
}

/// Where a test's lake is: a directory, or a prefix of a bucket of the tests' S3 server.
enum Files<'a> {
    Dir(PathBuf),
    Bucket(&'a S3Server, &'static str, PathBuf),
}

impl Files<'_> {
    /// The data files of the samples table where they are kept (in a bucket, the server's own
    /// files behind its objects), by their path in the table.
    fn samples_files(&self) -> Vec<(String, PathBuf)> {
        match self {
            Self::Dir(dir) => std::fs::read_dir(dir.join("samples"))
                .unwrap()
                .flatten()
                .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                .filter(|(name, _)| name.ends_with(".parquet"))
                .collect(),
            Self::Bucket(server, prefix, _) => server
                .keys(&format!("{prefix}/samples/"))
                .into_iter()
                .filter(|k| k.ends_with(".parquet") && !k.contains("/_delta_log/"))
                .map(|k| {
                    let name = k.rsplit('/').next().unwrap().to_string();
                    (name, server.object_path(&k))
                })
                .collect(),
        }
    }

    /// The paths of the files the samples table's commits ever added (from each commit in
    /// its log, where it is kept).
    fn samples_ever_added(&self) -> std::collections::BTreeSet<String> {
        let commits: Vec<PathBuf> = match self {
            Self::Dir(dir) => std::fs::read_dir(dir.join("samples/_delta_log"))
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .collect(),
            Self::Bucket(server, prefix, _) => server
                .keys(&format!("{prefix}/samples/_delta_log/"))
                .into_iter()
                .map(|k| server.object_path(&k))
                .collect(),
        };
        commits
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .flat_map(|p| {
                std::fs::read_to_string(p)
                    .unwrap()
                    .lines()
                    .filter_map(|l| {
                        let action: serde_json::Value = serde_json::from_str(l).ok()?;
                        Some(action.get("add")?.get("path")?.as_str()?.to_string())
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The lake.
    fn lake(&self) -> gpuwarden_pipeline::Lake {
        match self {
            Self::Dir(dir) => gpuwarden_pipeline::Lake::open(dir).unwrap(),
            Self::Bucket(server, prefix, staging) => server.lake(prefix, staging),
        }
    }
}

/// A lake under `fleet` of a bucket of an S3 server of the test's own, with samples kept forever
/// and `lease_ttl = "3s"` (a killed run's role is free 3 s later), and the config reaching it.
fn bucket_lake(dir: &Path) -> (S3Server, PathBuf) {
    let server = S3Server::start(&dir.join("s3"), "lake");
    let config = Config::new()
        .raw(&server.storage_config(&dir.join("data"), "fleet"))
        .raw("[storage.s3]\nlease_ttl = \"3s\"\n")
        .raw(KEEP)
        .write(dir.join("c.toml"));
    (server, config)
}

/// Three sources' samples, 4 GPUs each over 2 hours: three files in each hour.
fn ingest_parts(dir: &Path, config: &Path) {
    for part in 0..3 {
        ingest_samples(
            config,
            &dir.join(format!("part{part}.jsonl")),
            &lines(part * 4..part * 4 + 4, 2),
        );
    }
}

/// `gpuwarden compact`'s output. A bucket's compaction role stays with a killed run until its
/// lease expires (the tests' `lease_ttl` is 3 s): a run that finds it held (exit 2) is tried
/// again until then.
fn compact_output(config: &Path, crash_at: Option<&str>) -> std::process::Output {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut command = compact(config);
        if let Some(step) = crash_at {
            command.env("GPUWARDEN_COMPACT_CRASH_AT", step);
        }
        let out = command.output().unwrap();
        if out.status.code() != Some(2) || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn a_compaction_killed_at_any_step_leaves_every_row_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = storage_config(dir.path(), KEEP);
    killed_at_any_step(
        dir.path(),
        &config,
        &Files::Dir(dir.path().join("data/lake")),
    );
}

/// The same in a bucket: outputs uploaded, the commit a create-only PUT of the log's next
/// version.
#[test]
fn a_compaction_in_a_bucket_killed_at_any_step_leaves_every_row_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let (server, config) = bucket_lake(dir.path());
    killed_at_any_step(
        dir.path(),
        &config,
        &Files::Bucket(&server, "fleet", dir.path().join("staging")),
    );
}

fn killed_at_any_step(dir: &Path, config: &Path, files: &Files<'_>) {
    let config = config.to_path_buf();
    let lake = files.lake();
    let figures = || config_lake_i64(&config, FIGURES);
    ingest_parts(dir, &config);
    let mut expected = figures();
    assert_eq!(expected / 1_000_000_000, 3 * 4 * 1_440);
    let first = files_per_hour(&lake);
    assert!(first.iter().all(|&n| n >= 3), "{first:?}");

    for (late, step) in ["outputs-written", "before-commit", "after-commit"]
        .into_iter()
        .enumerate()
    {
        let out = compact_output(&config, Some(step));
        assert_eq!(
            out.status.signal(),
            Some(9),
            "{step}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(figures(), expected, "after a crash at {step}");
        // Late data for every hour: the next compaction has work again.
        ingest_samples(
            &config,
            &dir.join(format!("late{late}.jsonl")),
            &lines(100 + late * 2..102 + late * 2, 2),
        );
        expected = figures();
    }

    let stdout = ok(compact_output(&config, None));
    assert!(stdout.contains("hours compacted: 2"), "{stdout}");
    assert_eq!(figures(), expected);
    assert_eq!(files_per_hour(&lake), [1, 1]);

    // The same input ingested again is the same content: nothing is added.
    ingest_samples(&config, &dir.join("part0.jsonl"), &lines(0..4, 2));
    assert_eq!(figures(), expected);
    assert_eq!(files_per_hour(&lake), [1, 1]);
    let out = compact_output(&config, None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("hours compacted: 0"), "{stdout}");

    // The killed runs' outputs are files no commit ever added. Once older than the table keeps
    // removed files (30 days), a compaction's VACUUM deletes them; the files OPTIMIZE replaced
    // stay while as-of reads may need them (their removal is recent), whatever their age.
    let added = files.samples_ever_added();
    let (orphans, committed): (Vec<_>, Vec<_>) = files
        .samples_files()
        .into_iter()
        .partition(|(name, _)| !added.contains(name));
    let orphans: Vec<PathBuf> = orphans.into_iter().map(|(_, path)| path).collect();
    assert!(!orphans.is_empty(), "the killed runs left their outputs");
    let long_ago = std::time::SystemTime::now() - Duration::from_secs(31 * 24 * 3600);
    for path in orphans.iter().chain(committed.iter().map(|(_, p)| p)) {
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
    }
    let out = compact_output(&config, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        orphans.iter().all(|p| !p.exists()),
        "the orphans are deleted: {orphans:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        committed.iter().all(|(_, p)| p.exists()),
        "every file a commit added is kept"
    );
    assert_eq!(figures(), expected);
    assert_eq!(files_per_hour(&lake), [1, 1]);
}

/// Whether the process `pid` is stopped (by SIGSTOP).
fn is_stopped(pid: u32) -> bool {
    support::process_state(pid) == Some('T')
}

/// `gpuwarden compact` with `GPUWARDEN_COMPACT_STOP_AT=before-commit`, once it has stopped
/// itself there: after its last check of the lease, before its commit. Started again while a
/// run that holds the role refuses it (exit 2), until the lease that run held lapses.
fn stopped_before_commit(config: &Path) -> std::process::Child {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut child = compact(config)
            .env("GPUWARDEN_COMPACT_STOP_AT", "before-commit")
            .spawn()
            .unwrap();
        loop {
            if is_stopped(child.id()) {
                return child;
            }
            if let Some(status) = child.try_wait().unwrap() {
                let out = child.wait_with_output().unwrap();
                assert!(
                    status.code() == Some(2) && Instant::now() < deadline,
                    "{status}: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                break;
            }
            assert!(Instant::now() < deadline, "never stopped before its commit");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The output of `child`, which must exit within a minute: a child still running then (or
/// stopped again) is killed and the test fails with what it wrote.
fn finished(mut child: std::process::Child, what: &str) -> std::process::Output {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        let stopped_again = started.elapsed() > Duration::from_secs(1) && is_stopped(child.id());
        if started.elapsed() > Duration::from_secs(60) || stopped_again {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn resume(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-CONT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Two holders of a bucket's compaction role, one after the other, each stopped between its
/// last check of the lease and its commit: the first was stopped past its lease, the second
/// took the role over and compacted the same hours from the same version. Resumed, the first's
/// commit lands (nothing has removed its inputs yet); the second's, which removes the same
/// inputs, is refused by the Delta log's conflict check, and its hours are left for the next
/// run. Every row is there exactly once throughout.
#[test]
fn a_compactor_paused_past_its_lease_cannot_commit_over_the_one_that_took_its_role() {
    let dir = tempfile::tempdir().unwrap();
    let (server, config) = bucket_lake(dir.path());
    ingest_parts(dir.path(), &config);
    let figures = || config_lake_i64(&config, FIGURES);
    let expected = figures();
    let lake = server.lake("fleet", &dir.path().join("staging"));

    let first = stopped_before_commit(&config);
    let second = stopped_before_commit(&config);
    resume(&first);
    let out = finished(first, "the first, resumed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Its commit lands; it may then find its lease lost before its next hour.
    assert!(
        out.status.success() || stderr.contains("no longer holds the compaction role"),
        "{stdout}{stderr}"
    );
    assert_eq!(figures(), expected, "after the first's commit");

    resume(&second);
    let out = finished(second, "the second, resumed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("hours left for the next run (conflict)"),
        "the log refused the second's commit: {stdout}{stderr}"
    );
    assert_eq!(figures(), expected, "after the second's refused commit");
    let out = compact_output(&config, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(figures(), expected);
    assert_eq!(files_per_hour(&lake), [1, 1]);
}

#[test]
fn a_compaction_killed_at_random_times_leaves_every_row_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = storage_config(dir.path(), KEEP);
    let lake = dir.path().join("data/lake");
    for part in 0..4 {
        ingest_samples(
            &config,
            &dir.path().join(format!("part{part}.jsonl")),
            &lines(part * 10..part * 10 + 10, 2),
        );
    }
    let started = Instant::now();
    let out = compact(&config).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let full = started.elapsed();
    let mut expected = lake_i64(&lake, FIGURES);

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("seed {seed}; one whole compaction took {full:?}");
    let mut state = seed | 1;
    let mut killed = 0;
    for round in 0..10 {
        ingest_samples(
            &config,
            &dir.path().join(format!("late{round}.jsonl")),
            &lines(200 + round..201 + round, 2),
        );
        expected = lake_i64(&lake, FIGURES);
        // xorshift: a delay anywhere in what a whole compaction takes.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let delay = full.mul_f64((state % 1_000) as f64 / 1_000.0);
        let mut child = compact(&config).spawn().unwrap();
        std::thread::sleep(delay);
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            killed += 1;
        }
        child.wait().unwrap();
        assert_eq!(
            lake_i64(&lake, FIGURES),
            expected,
            "round {round}: killed after {delay:?} (seed {seed})"
        );
    }
    println!("{killed} of 10 compactions killed before they finished");
    let out = compact(&config).output().unwrap();
    assert!(out.status.success());
    assert_eq!(lake_i64(&lake, FIGURES), expected);
    assert_eq!(
        files_per_hour(&gpuwarden_pipeline::Lake::open(&lake).unwrap()),
        [1, 1]
    );
}

#[test]
fn retention_deletes_old_hours_and_says_so_while_rollups_stay() {
    let dir = tempfile::tempdir().unwrap();
    let config = storage_config(
        dir.path(),
        "[pipeline]\nclock.max_age = \"1h\"\n[pipeline.retention]\nsamples = \"3h\"\n",
    );
    let lake = dir.path().join("data/lake");
    // 2026-01-01: two hours, more than three hours before the watermark given below.
    ingest_samples(&config, &dir.path().join("old.jsonl"), &lines(0..4, 2));
    let rollup = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["rollup", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(rollup.status.success());
    let before = lake_i64(&lake, "SELECT count(*) FROM gpu_hourly");
    assert!(before > 0);
    let samples = lake_i64(&lake, "SELECT count(*) FROM samples");

    // Retention counts back from the fleet's watermark, not the wall clock: a lake of history
    // (these samples are from 2026-01-01) keeps what is recent in it.
    let stdout = ok(Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["compact", "--config", config.to_str().unwrap()])
        .output()
        .unwrap());
    assert!(
        stdout.contains("retention: samples: 0 hours deleted"),
        "{stdout}"
    );
    assert_eq!(lake_i64(&lake, "SELECT count(*) FROM samples"), samples);

    let stdout = ok(compact(&config).output().unwrap());
    assert!(
        stdout.contains("retention: samples: 2 hours deleted (2 files"),
        "{stdout}"
    );
    assert!(lake_i64(&lake, "SELECT count(*) FROM samples") == 0);
    assert_eq!(lake_i64(&lake, "SELECT count(*) FROM gpu_hourly"), before);

    // A retention shorter than an hour is final is refused, by name.
    let bad = storage_config(dir.path(), "[pipeline.retention]\nsignals = \"1h\"\n");
    let out = compact(&bad).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("pipeline.retention.signals"), "{stderr}");
}

#[test]
fn a_running_pipeline_compacts_the_hours_it_finds_final() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = Config::new()
        .kafka(&broker.bootstrap)
        .data_dir(&dir.path().join("data"))
        .raw(
            r#"
[pipeline]
flush_rows = 500
flush_age = "300ms"
rollup_every = "1s"
clock.max_age = "3650d"
"#,
        )
        .write(dir.path().join("gpuwarden.toml"));
    let lake = dir.path().join("data/lake");

    // Three hours of 8 GPUs every 30 s, dated 2026-01-01: the first two are final once the
    // third is read (the watermark passes their end plus the 10-minute lateness).
    let records: Vec<(String, String)> = (0..3 * 120)
        .flat_map(|step| {
            (0..8).map(move |gpu| (format!("GPU-{gpu:04}"), sample(gpu, T0 + step * 30_000)))
        })
        .collect();
    let n = records.len() as i64;
    support::kafka::produce_all(&broker.bootstrap, "gpuwarden.samples", records);

    let (mut pipeline, running) = support::start_pipeline(&config);
    let metrics = support::metrics_address(&running);
    pipeline.wait_for_log("compacted an hour", Duration::from_secs(90));
    eventually(
        "two hours compacted",
        Duration::from_secs(60),
        || match support::metric(&metrics, "gpuwarden_pipeline_compactions_total") {
            Some(hours) if hours >= 2.0 => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let files = files_per_hour(&gpuwarden_pipeline::Lake::open(&lake).unwrap());
    assert_eq!(&files[..2], [1, 1], "{files:?}");
    assert!(
        files[2] > 1,
        "the open hour is left as ingest wrote it: {files:?}"
    );
    assert_eq!(
        lake_i64(
            &lake,
            "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples"
        ),
        n
    );
    assert_eq!(lake_i64(&lake, "SELECT count(*) FROM samples"), n);
    let hour = lake_i64(
        &lake,
        &format!(
            "SELECT count(*) FROM samples WHERE ts_ms >= {T0} AND ts_ms < {}",
            T0 + HOUR_MS
        ),
    );
    assert_eq!(hour, 8 * 120);
    drop(pipeline);
}
