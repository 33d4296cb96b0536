//! `gpuwarden pipeline` and `gpuwarden ingest` as an operator runs them: a pipeline process
//! killed with SIGKILL mid-run and restarted loses nothing and counts nothing twice; a
//! JSON-lines backfill is idempotent and quarantines what is invalid; one killed and restarted
//! at once reads again within seconds, under the same `group.instance.id`.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use support::process::ok;
use support::s3::S3Server;
use support::{
    config_lake_i64, eventually, lake_i64, parquet_files, start_pipeline, Broker, BrokerKind,
    Config,
};

const T0: i64 = 1_767_225_600_000;

fn sample(gpu: usize, ts_ms: i64) -> String {
    serde_json::json!({
        "v": 1, "ts_ms": ts_ms, "interval_ms": 5000, "host": format!("node-{}", gpu / 8),
        "gpu_uuid": format!("GPU-{gpu:04}"), "gpu_model": "NVIDIA A100-SXM4-80GB",
        "util_gpu_pct": (gpu * 7 % 100) as f64, "mem_used_bytes": 1u64 << 30, "mem_total_bytes": 85899345920u64
    })
    .to_string()
}

/// The pipeline [`config`] writes, reading from the broker at `bootstrap`. A short session
/// timeout lets the restarted pipeline take over the killed one's partitions in seconds instead
/// of the default 45.
fn pipeline_config(dir: &Path, bootstrap: &str) -> Config {
    lake_config(dir).kafka(bootstrap).raw(
        r#"
[kafka.properties]
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
"#,
    )
}

/// A lake under `dir` whose pipeline flushes every 500 rows or 300 ms, and lets through records
/// of any age: they are dated 2026-01-01 and sent now, history on Kafka.
fn lake_config(dir: &Path) -> Config {
    Config::new().data_dir(&dir.join("data")).raw(
        r#"
[pipeline]
flush_rows = 500
flush_age = "300ms"
clock.max_age = "3650d"
"#,
    )
}

fn config(dir: &Path, bootstrap: &str) -> std::path::PathBuf {
    pipeline_config(dir, bootstrap).write(dir.join("gpuwarden.toml"))
}

/// A config with only a data dir under `dir`: enough for `ingest` and `sql`.
fn storage_config(dir: &Path) -> std::path::PathBuf {
    Config::new()
        .data_dir(&dir.join("data"))
        .write(dir.join("c.toml"))
}

support::on_both_brokers!(
    a_pipeline_killed_mid_run_loses_nothing_and_duplicates_nothing,
    killed_mid_run
);
fn killed_mid_run(kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(kind, dir.path());
    let config = config(dir.path(), &broker.bootstrap);
    let lake = dir.path().join("data/lake");

    // 3 partitions x ~1.7 MB: inside the test broker's 5 MB per partition.
    let n: usize = 18_000;
    produce_samples(&broker.bootstrap, 0, n);

    let (first, _) = start_pipeline(&config);
    // Checked every few milliseconds, so that the kill comes while files are being written.
    eventually(
        "two samples files",
        Duration::from_secs(60),
        || match parquet_files(&lake.join("samples")) {
            n if n >= 2 => Ok(()),
            n => Err(format!("{n} files; log:\n{}", first.log.join("\n"))),
        },
    );
    Command::new("kill")
        .args(["-KILL", &first.pid().to_string()])
        .status()
        .unwrap();
    // Reaped, so that the lake is counted as the killed process left it.
    drop(first);
    let at_kill = lake_i64(&lake, "SELECT count(*) FROM samples");
    assert!(
        at_kill < n as i64,
        "killed mid-run: {at_kill} of {n} rows were written"
    );

    let (second, running) = start_pipeline(&config);
    let metrics_address = support::metrics_address(&running);
    eventually(
        "every sample after the restart",
        Duration::from_secs(120),
        || {
            // Recovery may be removing files right now (or have removed all of them): a query
            // that finds none counts as nothing yet.
            let distinct = support::try_lake_i64(
                &lake,
                "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples",
            )
            .unwrap_or(0);
            if distinct == n as i64 {
                Ok(())
            } else {
                Err(format!(
                    "{distinct} of {n} samples; log:\n{}",
                    second.log.join("\n")
                ))
            }
        },
    );
    let (code, metrics) = support::http_get(&metrics_address, "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("gpuwarden_pipeline_records_written_total{table=\"samples\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpuwarden_pipeline_buffered_bytes_limit 536870912"),
        "{metrics}"
    );
    let metrics_file = dir.path().join("pipeline.prom");
    std::fs::write(&metrics_file, &metrics).unwrap();
    let promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&metrics_file).unwrap())
        .output()
        .unwrap();
    assert!(
        promtool.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&promtool.stdout),
        String::from_utf8_lossy(&promtool.stderr)
    );

    let (status, log) = second.terminate(Duration::from_secs(60));
    assert!(
        status.success(),
        "SIGTERM: flush, commit, exit 0: {status:?}\n{}",
        log.join("\n")
    );

    // The dedup rule (docs/src/finops/definitions.md#duplicates): (gpu_uuid, ts_ms) counts once. Every
    // produced sample is there...
    assert_eq!(
        lake_i64(
            &lake,
            "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples"
        ),
        n as i64
    );
    assert_eq!(lake_i64(&lake, "SELECT min(ts_ms) FROM samples"), T0);
    assert_eq!(
        lake_i64(&lake, "SELECT max(ts_ms) FROM samples"),
        T0 + ((n - 1) / 64) as i64 * 5_000
    );
    // ...and the uncommitted flush the kill interrupted was removed, not kept beside its replay.
    assert_eq!(
        lake_i64(&lake, "SELECT count(*) FROM samples"),
        n as i64,
        "no raw duplicates either"
    );
    assert_eq!(
        lake_i64(
            &lake,
            "SELECT count(*) FROM samples WHERE ts_ms IS NULL OR gpu_uuid IS NULL"
        ),
        0
    );
}

/// The pid in a role's lease object (`<host>/<pid>/<start>`), and its generation.
fn role_holder(server: &S3Server, role: &str) -> Option<(u32, u64)> {
    let bytes = std::fs::read(server.object_path(&format!("fleet/_leases/{role}.json"))).ok()?;
    let lease: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let pid = lease["holder"].as_str()?.split('/').nth(1)?.parse().ok()?;
    Some((pid, lease["generation"].as_u64()?))
}

support::on_both_brokers!(
    two_pipelines_share_a_bucket_and_one_killed_leaves_every_record_once,
    two_pipelines_one_killed
);
/// Two pipeline processes (on machines of their own, as far as the lake goes: each its own
/// data dir) in one consumer group share a lake in a bucket. Each writes its partitions'
/// files; one holds the rollups and one the signals publisher, by their lease objects. The one
/// rolling up is killed mid-run: its partitions and its roles move to the other within a bound
/// (the session timeout, 6 s, and `lease_ttl`, 3 s, plus a rollup period), and in the end every
/// sample is in the lake once and rolled up once. On tansu the members are dynamic (see below).
fn two_pipelines_one_killed(kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(kind, dir.path());
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let configs: Vec<std::path::PathBuf> = ["a", "b"]
        .iter()
        .map(|name| {
            let home = dir.path().join(name);
            std::fs::create_dir_all(&home).unwrap();
            // The [storage] of `config` is replaced by the bucket's.
            let mut config = pipeline_config(&home, &broker.bootstrap)
                .raw(&server.storage_config(&home.join("data"), "fleet"))
                .raw("[storage.s3]\nlease_ttl = \"3s\"\n\n[pipeline]\nrollup_every = \"1s\"\n");
            if kind == BrokerKind::Tansu {
                // tansu never removes a static member whose session expired: the killed one
                // would keep its partitions for good (docs/src/operators/kafka-brokers.md). Apache Kafka
                // removes it after session.timeout.ms; on tansu the members are dynamic.
                config = config.raw("[kafka]\nstatic_membership = false\n");
            }
            config.write(home.join("gpuwarden.toml"))
        })
        .collect();
    let lake_files = server.object_path("fleet/samples");
    let distinct = || {
        support::try_config_lake_i64(
            &configs[0],
            "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples",
        )
        .unwrap_or(0)
    };

    // In steps of 64 samples (one per GPU), so that each batch continues the last.
    let mut produced: usize = 8_960;
    produce_samples(&broker.bootstrap, 0, produced);
    let (a, running_a) = start_pipeline(&configs[0]);
    let (b, running_b) = start_pipeline(&configs[1]);
    let mut processes = vec![(a, running_a), (b, running_b)];
    // Both in the group and both writing before the kill: each has written samples.
    let mut last_batch = Instant::now();
    eventually("both pipelines writing", Duration::from_secs(90), || {
        let written: Vec<bool> = processes
            .iter()
            .map(|(_, running)| {
                let (_, metrics) =
                    support::http_get(&support::metrics_address(running), "/metrics");
                metrics.lines().any(|l| {
                    l.starts_with("gpuwarden_pipeline_records_written_total{table=\"samples\"}")
                        && !l.ends_with(" 0")
                })
            })
            .collect();
        if written.iter().all(|w| *w) {
            Ok(())
        } else {
            // More records, now and then, keep both busy until the group has settled on both.
            if last_batch.elapsed() > Duration::from_millis(500) {
                produce_samples(&broker.bootstrap, produced / 64, 640);
                produced += 640;
                last_batch = Instant::now();
            }
            Err(format!("writing: {written:?}"))
        }
    });
    produce_samples(&broker.bootstrap, produced / 64, 8_960);
    produced += 8_960;
    let n = produced;
    let (roller, first_generation) = eventually("a roller", Duration::from_secs(30), || {
        role_holder(&server, "rollups").ok_or_else(|| "no rollups lease yet".to_string())
    });
    assert!(parquet_files(&lake_files) >= 2);
    let victim = processes
        .iter()
        .position(|(p, _)| p.pid() == roller)
        .expect("the roller is one of the two");
    let (killed, _) = processes.remove(victim);
    Command::new("kill")
        .args(["-KILL", &killed.pid().to_string()])
        .status()
        .unwrap();
    drop(killed);
    let killed_at = Instant::now();
    let (survivor, running) = processes.pop().unwrap();

    let moved = eventually(
        "the rollups role moved",
        Duration::from_secs(60),
        || match role_holder(&server, "rollups") {
            Some((pid, generation)) if pid == survivor.pid() => Ok(generation),
            other => Err(format!("held by {other:?}")),
        },
    );
    let took = killed_at.elapsed();
    assert!(moved > first_generation, "a new generation: {moved}");
    println!("the rollups role moved to the survivor {took:?} after the kill");
    eventually(
        "the signals role with the survivor",
        Duration::from_secs(60),
        || match role_holder(&server, "signals") {
            Some((pid, _)) if pid == survivor.pid() => Ok(()),
            other => Err(format!("held by {other:?}")),
        },
    );
    eventually("every sample, once", Duration::from_secs(120), || {
        let seen = distinct();
        if seen == n as i64 {
            Ok(())
        } else {
            Err(format!(
                "{seen} of {n} samples; log:\n{}",
                survivor.log.join("\n")
            ))
        }
    });
    // The survivor rolls up what both wrote: every sample counted once.
    eventually("every sample rolled up", Duration::from_secs(60), || {
        let rolled = support::try_config_lake_i64(
            &configs[1],
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_hourly",
        )
        .unwrap_or(0);
        if rolled == n as i64 {
            Ok(())
        } else {
            Err(format!("{rolled} of {n} samples rolled up"))
        }
    });
    let (code, metrics) = support::http_get(&support::metrics_address(&running), "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("gpuwarden_pipeline_signals_leader 1"),
        "{metrics}"
    );
    let (status, log) = survivor.terminate(Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
    // Released on the way out: the next process need not wait for the lease to expire.
    let lease: serde_json::Value = serde_json::from_slice(
        &std::fs::read(server.object_path("fleet/_leases/rollups.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(lease["expires_at_ms"], 0, "{lease}");
    assert_eq!(
        support::config_lake_i64(&configs[0], "SELECT count(*) FROM samples"),
        n as i64,
        "no raw duplicates either"
    );
}

/// Sends `count` samples of 64 GPUs, the first at `T0 + first * 5 s` (per GPU).
fn produce_samples(bootstrap: &str, first: usize, count: usize) {
    support::kafka::produce_all(
        bootstrap,
        "gpuwarden.samples",
        (first * 64..first * 64 + count).map(|i| {
            let gpu = i % 64;
            (
                format!("GPU-{gpu:04}"),
                sample(gpu, T0 + (i / 64) as i64 * 5_000),
            )
        }),
    );
}

/// A broker that starts again empty (the embedded one of `gpuwarden up`, a restarted `gpuwarden
/// broker`, a topic deleted and created again) numbers its offsets from 0 again: the files of the
/// new records, though they hold the same partitions' same offsets in the same hour, must not
/// replace the files of the records before.
#[test]
fn a_broker_started_again_from_offset_zero_replaces_no_file_of_the_one_before() {
    let dir = tempfile::tempdir().unwrap();
    let lake = dir.path().join("data/lake");
    for round in 0..2 {
        let broker_dir = dir.path().join(format!("broker-{round}"));
        std::fs::create_dir_all(&broker_dir).unwrap();
        let broker = Broker::start(&broker_dir);
        let config = config(dir.path(), &broker.bootstrap);
        // The same keys in the same order, so the same partitions and offsets; other times.
        produce_samples(&broker.bootstrap, round * 10, 640);
        let (pipeline, _) = start_pipeline(&config);
        let want = 640 * (round as i64 + 1);
        eventually(
            "the round's samples",
            Duration::from_secs(60),
            || match distinct_samples(&lake) {
                n if n == want => Ok(()),
                n => Err(format!(
                    "{n} of {want} samples; log:\n{}",
                    pipeline.log.join("\n")
                )),
            },
        );
        let (status, _) = pipeline.terminate(Duration::from_secs(30));
        assert!(status.success(), "{status}");
    }
    assert_eq!(lake_i64(&lake, "SELECT count(*) FROM samples"), 1_280);
}

/// A lake moved (`gpuwarden lake migrate --to`) while its pipeline went on: the old lake's
/// consumer group committed offsets past the version copied. The pipeline of the new lake, in
/// the same group, reads again from after the offsets its tables hold, not from Kafka's: every
/// record is in the new lake once.
#[test]
fn a_lake_moved_while_its_pipeline_went_on_reads_again_from_its_own_offsets() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("broker")).unwrap();
    let broker = Broker::start(&dir.path().join("broker"));
    let old_dir = dir.path().join("old");
    let new_dir = dir.path().join("new");
    std::fs::create_dir_all(&old_dir).unwrap();
    std::fs::create_dir_all(&new_dir).unwrap();
    let old = config(&old_dir, &broker.bootstrap);
    let new = config(&new_dir, &broker.bootstrap);
    let (old_lake, new_lake) = (old_dir.join("data/lake"), new_dir.join("data/lake"));
    let run_until = |config: &Path, lake: &Path, want: i64| {
        let (pipeline, _) = start_pipeline(config);
        eventually(
            "the samples",
            Duration::from_secs(60),
            || match distinct_samples(lake) {
                n if n == want => Ok(()),
                n => Err(format!("{n} of {want}; log:\n{}", pipeline.log.join("\n"))),
            },
        );
        let (status, _) = pipeline.terminate(Duration::from_secs(30));
        assert!(status.success(), "{status}");
    };
    produce_samples(&broker.bootstrap, 0, 640);
    run_until(&old, &old_lake, 640);
    let moved = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["lake", "migrate", "--config", old.to_str().unwrap()])
        .args(["--to", new.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        moved.status.success(),
        "{}",
        String::from_utf8_lossy(&moved.stderr)
    );
    // The old pipeline goes on: Kafka's committed offsets pass what the new lake holds.
    produce_samples(&broker.bootstrap, 10, 640);
    run_until(&old, &old_lake, 1_280);
    run_until(&new, &new_lake, 1_280);
    assert_eq!(lake_i64(&new_lake, "SELECT count(*) FROM samples"), 1_280);
}

/// Distinct samples in the lake; 0 while recovery leaves no file to read.
fn distinct_samples(lake: &Path) -> i64 {
    support::try_lake_i64(
        lake,
        "SELECT count(DISTINCT (gpu_uuid, ts_ms)) FROM samples",
    )
    .unwrap_or(0)
}

support::on_both_brokers!(
    a_pipeline_killed_and_restarted_at_once_reads_again_within_seconds,
    killed_and_restarted_at_once
);
/// The issue's figure: a pipeline SIGKILLed and restarted at once used to read nothing for 47 s,
/// until the group forgot the dead member after librdkafka's 45 s session timeout. Now the
/// restart comes back under the same `group.instance.id` (on Kafka the broker hands it the
/// partitions at once; the mock broker ignores static membership and forgets the dead member
/// after `kafka.session_timeout`, 6 s; tansu takes the returning member back), and a second
/// instance beside it gets another id.
fn killed_and_restarted_at_once(kind: BrokerKind) {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::of(kind, dir.path());
    let config = lake_config(dir.path())
        .kafka(&broker.bootstrap)
        .raw("[kafka]\nsession_timeout = \"6s\"\n")
        .write(dir.path().join("gpuwarden.toml"));
    let lake = dir.path().join("data/lake");
    let (before, after) = (3_200usize, 3_200usize);
    produce_samples(&broker.bootstrap, 0, before);

    let (mut first, _) = start_pipeline(&config);
    let id = first.wait_for_log("ingest running", Duration::from_secs(30))["instance"]
        .as_str()
        .expect("the instance field")
        .to_string();
    eventually(
        "the first samples",
        Duration::from_secs(120),
        || match distinct_samples(&lake) {
            n if n == before as i64 => Ok(()),
            n => Err(format!("{n} of {before}")),
        },
    );
    Command::new("kill")
        .args(["-KILL", &first.pid().to_string()])
        .status()
        .unwrap();
    drop(first);

    let restarted = Instant::now();
    let (mut second, _) = start_pipeline(&config);
    let again = second.wait_for_log("ingest running", Duration::from_secs(30));
    assert_eq!(
        again["instance"],
        id.as_str(),
        "the restart's id is the killed one's"
    );
    second.wait_for_log("consumer group rebalanced", Duration::from_secs(60));
    let assigned = restarted.elapsed();
    produce_samples(&broker.bootstrap, before / 64, after);
    eventually(
        "the samples sent after the restart",
        Duration::from_secs(120),
        || match distinct_samples(&lake) {
            n if n == (before + after) as i64 => Ok(()),
            n => Err(format!("{n} of {}", before + after)),
        },
    );
    let took = restarted.elapsed();
    println!(
        "{kind:?}: restarted at once after SIGKILL: partitions assigned {:.1} s and reading again (samples sent after the restart in the lake) {:.1} s after the restart, kafka.session_timeout 6s",
        assigned.as_secs_f64(),
        took.as_secs_f64()
    );
    // 45 s is what the wait was bound to before: librdkafka's default session timeout. With 6 s
    // the mock broker lets the restart in after two of them (one to join, one to give up on the
    // dead member's sync); anything near 45 s means the setting did not reach the consumer.
    assert!(
        took < Duration::from_secs(45),
        "{took:?} until the restarted pipeline read again"
    );

    // Another instance on this host and data dir, beside the running one, is another member.
    let (mut third, _) = start_pipeline(&config);
    let beside = third.wait_for_log("ingest running", Duration::from_secs(30));
    let beside = beside["instance"].as_str().unwrap();
    assert_ne!(
        beside, id,
        "two running instances never share a group.instance.id"
    );
    let (status, log) = third.terminate(Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));
    let (status, log) = second.terminate(Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{}", log.join("\n"));

    // Exactly once: every sample, none twice, not even as raw rows.
    assert_eq!(distinct_samples(&lake), (before + after) as i64);
    assert_eq!(
        lake_i64(&lake, "SELECT count(*) FROM samples"),
        (before + after) as i64
    );
}

/// Runs `scenario` (given a temp dir and a config) over a lake in a directory.
fn in_a_directory(scenario: fn(&Path, &Path)) {
    let dir = tempfile::tempdir().unwrap();
    scenario(dir.path(), &storage_config(dir.path()));
}

/// Runs `scenario` over a lake under `gpuwarden/` in a bucket of the tests' S3 server (s3s-fs);
/// returns the temp dir and the server, for what the test checks after.
fn in_a_bucket(scenario: fn(&Path, &Path)) -> (tempfile::TempDir, S3Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    scenario(dir.path(), &server.config_file(dir.path(), "gpuwarden"));
    (dir, server)
}

#[test]
fn ingest_backfills_json_lines_idempotently_and_quarantines_bad_lines() {
    in_a_directory(ingest_backfills);
}

/// The same backfill into a lake in an S3 bucket, through the same binary.
#[test]
fn ingest_backfills_into_a_lake_in_s3_as_into_a_directory() {
    let (dir, server) = in_a_bucket(ingest_backfills);
    let keys = server.keys("gpuwarden");
    assert!(
        keys.iter()
            .any(|k| k.starts_with("gpuwarden/samples/2026-01-01T00-file-samples-")),
        "{keys:?}"
    );
    assert!(
        !dir.path().join("data/lake").exists(),
        "nothing of the lake is on local disk"
    );
    let staged = support::files_under(&dir.path().join("data/lake-staging"));
    assert!(staged.is_empty(), "uploaded files are not kept: {staged:?}");
}

/// `gpuwarden ingest` of four files, bad lines included, twice, into the lake `config` names.
fn ingest_backfills(dir: &Path, config: &Path) {
    let input = dir.join("export.jsonl");
    let mut lines: Vec<String> = (0..2_500)
        .map(|i| sample(i % 10, T0 + (i / 10) as i64 * 5_000))
        .collect();
    lines.insert(7, "{\"v\":1,\"ts_ms\":5".to_string());
    lines.insert(
        100,
        sample(3, T0).replace("\"util_gpu_pct\":21.0", "\"util_gpu_pct\":250.0"),
    );
    lines.insert(200, String::new());
    std::fs::write(&input, lines.join("\n")).unwrap();
    let leases = dir.join("leases.jsonl");
    std::fs::write(
        &leases,
        r#"{"v":1,"ts_ms":1767225600000,"event":"granted","lease_id":"l-1","team":"research","user":"alice","project":"p","workload":"training","substrate":"sim","gpu_model":"NVIDIA A100-SXM4-80GB","gpu_count":1,"gpu_uuids":["GPU-0001"]}"#,
    )
    .unwrap();
    // The enforcer's audit trail and the pipeline's signals, as they travel on their topics:
    // one line of each breaks its contract.
    let actions = dir.join("actions.jsonl");
    std::fs::write(
        &actions,
        [
            r#"{"v":1,"ts_ms":1767225600000,"action":"admit","lease_id":"l-1","team":"research","reason":"admitted","policy":null,"driver":"sim","outcome":"ok","detail":"1 GPUs of NVIDIA A100-SXM4-80GB on sim, $2.60/h"}"#,
            r#"{"v":1,"ts_ms":1767229200000,"action":"reclaim","lease_id":"l-1","team":"research","reason":"","policy":null,"driver":"sim","outcome":"ok","detail":"released (idle)"}"#,
            r#"{"v":1,"ts_ms":1767229200000,"action":"reclaim","lease_id":"l-1","team":"research","reason":"idle","policy":null,"driver":"sim","outcome":"ok","detail":"released (idle): idle for 30m"}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let signals = dir.join("signals.jsonl");
    std::fs::write(
        &signals,
        [
            r#"{"v":1,"ts_ms":1767226500000,"window_ms":900000,"kind":"team_spend","team":"research","month_to_date_usd":0.65,"burn_usd_per_hour":2.6}"#,
            r#"{"v":1,"ts_ms":1767226500000,"window_ms":900000,"kind":"lease_utilization","lease_id":"l-1","team":"research","util_pct":140.0,"idle_ms":0,"gpus_active":1,"gpus_total":1,"mem_used_max_bytes":1073741824}"#,
            r#"{"v":1,"ts_ms":1767226500000,"window_ms":900000,"kind":"gpu_unattributed","gpu_uuid":"GPU-0003","host":"node-0","util_pct":21.0}"#,
        ]
        .join("\n"),
    )
    .unwrap();

    let run = || {
        Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args([
                "ingest",
                "--config",
                config.to_str().unwrap(),
                "--samples",
                input.to_str().unwrap(),
                "--lease-events",
                leases.to_str().unwrap(),
                "--actions",
                actions.to_str().unwrap(),
                "--signals",
                signals.to_str().unwrap(),
            ])
            .output()
            .unwrap()
    };
    let stdout = ok(run());
    assert!(
        stdout.contains("2502 samples records read, 2500 written, 2 quarantined"),
        "{stdout}"
    );
    assert!(
        stdout.contains("1 lease_events records read, 1 written, 0 quarantined"),
        "{stdout}"
    );
    assert!(
        stdout.contains("3 actions records read, 2 written, 1 quarantined"),
        "{stdout}"
    );
    assert!(
        stdout.contains("3 signals records read, 2 written, 1 quarantined"),
        "{stdout}"
    );
    assert!(
        stdout.contains("SELECT topic"),
        "points at how to see why: {stdout}"
    );

    assert_eq!(
        config_lake_i64(config, "SELECT count(*) FROM samples"),
        2_500
    );
    assert_eq!(
        config_lake_i64(config, "SELECT count(*) FROM lease_events"),
        1
    );
    assert_eq!(
        config_lake_i64(
            config,
            "SELECT count(*) FROM quarantine WHERE field = 'util_gpu_pct' AND \"offset\" = 101"
        ),
        1,
        "line numbers locate bad lines"
    );
    assert_eq!(config_lake_i64(config, "SELECT count(*) FROM quarantine WHERE reason LIKE 'malformed JSON%' AND \"offset\" = 8"), 1);
    assert_eq!(
        config_lake_i64(
            config,
            "SELECT count(*) FROM actions WHERE action = 'reclaim' AND reason = 'idle' AND lease_id = 'l-1'"
        ),
        1
    );
    assert_eq!(config_lake_i64(config, "SELECT count(*) FROM actions"), 2);
    assert_eq!(
        config_lake_i64(
            config,
            "SELECT count(*) FROM signals WHERE (kind = 'team_spend' AND burn_usd_per_hour = 2.6) \
             OR (kind = 'gpu_unattributed' AND gpu_uuid = 'GPU-0003')"
        ),
        2
    );
    let quarantined = |topic: &str, field: &str, line: i64| {
        config_lake_i64(
            config,
            &format!(
                "SELECT count(*) FROM quarantine WHERE topic = 'file:{}' AND field = '{field}' AND \"offset\" = {line}",
                topic
            ),
        )
    };
    assert_eq!(quarantined(actions.to_str().unwrap(), "reason", 2), 1);
    assert_eq!(quarantined(signals.to_str().unwrap(), "util_pct", 2), 1);

    // The same file again rewrites the same files: nothing is counted twice.
    assert!(run().status.success());
    assert_eq!(
        config_lake_i64(config, "SELECT count(*) FROM samples"),
        2_500
    );
    assert_eq!(config_lake_i64(config, "SELECT count(*) FROM actions"), 2);
    assert_eq!(config_lake_i64(config, "SELECT count(*) FROM signals"), 2);
    assert_eq!(
        config_lake_i64(config, "SELECT count(*) FROM quarantine"),
        4
    );

    // Standard input works too ("-"), through the same decoder and quarantine.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args([
            "ingest",
            "--config",
            config.to_str().unwrap(),
            "--samples",
            "-",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{}", sample(42, T0 + 999_000_000)).unwrap();
        writeln!(stdin, "not json").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("stdin: 2 samples records read, 1 written, 1 quarantined"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(
        config_lake_i64(config, "SELECT count(*) FROM samples"),
        2_501
    );

    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["ingest", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to ingest"));
}

/// Two exports with the same base name and line count for the same hour, and two reads of
/// standard input, each keep their rows: a file is named after what it holds, not only where it
/// came from. The same content ingested again stays idempotent. On a directory and a bucket.
#[test]
fn ingests_of_other_content_under_the_same_name_add_and_the_same_content_replaces() {
    let dir = tempfile::tempdir().unwrap();
    ingests_by_content(dir.path(), &storage_config(dir.path()));
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let config = dir.path().join("s3.toml");
    std::fs::write(
        &config,
        server.storage_config(&dir.path().join("s3-data"), "gpuwarden"),
    )
    .unwrap();
    ingests_by_content(dir.path(), &config);
}

fn ingests_by_content(dir: &Path, config: &Path) {
    let export = |gpu: usize| -> String {
        (0..30)
            .map(|i| sample(gpu, T0 + i * 5_000) + "\n")
            .collect()
    };
    let ingest = |args: &[&str], stdin: Option<&str>| -> String {
        use std::io::Write as _;
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args(["ingest", "--config", config.to_str().unwrap()])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
        drop(input);
        ok(child.wait_with_output().unwrap())
    };
    let gpus = || {
        config_lake_i64(
            config,
            "SELECT count(DISTINCT gpu_uuid) * 1000 + count(*) FROM samples",
        )
    };
    let (a, b) = (dir.join("a"), dir.join("b"));
    for (d, gpu) in [(&a, 1), (&b, 2)] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("late.jsonl"), export(gpu)).unwrap();
    }
    let (a, b) = (a.join("late.jsonl"), b.join("late.jsonl"));

    let out = ingest(&["--samples", a.to_str().unwrap()], None);
    assert!(out.contains("30 written"), "{out}");
    assert_eq!(gpus(), 1_030);
    let out = ingest(&["--samples", b.to_str().unwrap()], None);
    assert!(out.contains("30 written"), "{out}");
    assert_eq!(gpus(), 2_060, "b/late.jsonl adds to a/late.jsonl");
    // The same content again, from either path or from standard input's twin below, replaces.
    ingest(&["--samples", a.to_str().unwrap()], None);
    ingest(&["--samples", b.to_str().unwrap()], None);
    assert_eq!(gpus(), 2_060, "the same files again count once");

    // Two different reads of standard input, each of one GPU's 30 samples.
    let out = ingest(&["--samples", "-"], Some(&export(3)));
    assert!(
        out.contains("stdin: 30 samples records read, 30 written"),
        "{out}"
    );
    ingest(&["--samples", "-"], Some(&export(4)));
    assert_eq!(gpus(), 4_120, "the second read of standard input adds");
    ingest(&["--samples", "-"], Some(&export(3)));
    assert_eq!(gpus(), 4_120, "the same standard input again counts once");
    // Compaction keeps it so: a superseded name is the same content, never other content.
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["compact", "--config", config.to_str().unwrap()])
        .args(["--watermark", "2026-01-02T00:00:00Z"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(gpus(), 4_120, "compaction changes no count");
    ingest(&["--samples", b.to_str().unwrap()], None);
    std::fs::write(&b, export(5)).unwrap();
    ingest(&["--samples", b.to_str().unwrap()], None);
    assert_eq!(
        gpus(),
        5_150,
        "after compaction, the same content is hidden and new content under the old name shows"
    );
}

#[test]
fn sql_queries_the_lake_as_a_table_csv_or_json_lines() {
    in_a_directory(sql_queries);
}

/// The same queries over a lake in an S3 bucket.
#[test]
fn sql_queries_a_lake_in_s3_as_a_directory() {
    let (_dir, _server) = in_a_bucket(sql_queries);
}

/// `gpuwarden sql` in each format before and after an ingest into the lake `config` names.
fn sql_queries(dir: &Path, config: &Path) {
    let sql = |format: &str, query: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args([
                "sql",
                "--config",
                config.to_str().unwrap(),
                "--format",
                format,
                query,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{query}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // Before anything is ingested every table exists, empty.
    assert_eq!(
        sql("table", "SELECT count(*) AS n FROM samples")
            .lines()
            .filter(|l| l.contains("| 0 "))
            .count(),
        1
    );
    assert_eq!(
        sql("table", "SELECT reason FROM quarantine").trim(),
        "(reason) 0 rows"
    );

    let input = dir.join("s.jsonl");
    std::fs::write(
        &input,
        format!("{}\n{}\nnot json\n", sample(1, T0), sample(2, T0 + 5_000)),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args([
            "ingest",
            "--config",
            config.to_str().unwrap(),
            "--samples",
            input.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());

    let csv = sql(
        "csv",
        "SELECT gpu_uuid, ts_ms, util_gpu_pct FROM samples ORDER BY ts_ms",
    );
    assert_eq!(
        csv,
        format!(
            "gpu_uuid,ts_ms,util_gpu_pct\nGPU-0001,{T0},7.0\nGPU-0002,{},14.0\n",
            T0 + 5_000
        )
    );
    let json = sql("json", "SELECT \"offset\", field, reason FROM quarantine");
    let row: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
    assert_eq!(row["offset"], 3);
    assert!(
        row["reason"]
            .as_str()
            .unwrap()
            .starts_with("malformed JSON"),
        "{row}"
    );
    // Lists and structs, which CSV cannot hold, come out as the table shows them.
    assert_eq!(
        sql(
            "csv",
            "SELECT ['GPU-1', 'GPU-2'] AS gpu_uuids, named_struct('a', 1) AS s, CAST(NULL AS INT[]) AS none"
        ),
        "gpu_uuids,s,none\n\"[GPU-1, GPU-2]\",{a: 1},\n"
    );
    // A query on the command line may open with a comment, like the files of queries/.
    assert_eq!(
        sql("csv", "-- how many?\nSELECT count(*) AS n FROM samples"),
        "n\n2\n"
    );
    let table = sql("table", "SELECT count(*) AS samples FROM samples");
    assert!(
        table.contains("| samples |") && table.contains("| 2       |"),
        "{table}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args([
            "sql",
            "--config",
            config.to_str().unwrap(),
            "SELECT nope FROM samples",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("error: running the query"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_running_pipeline_rolls_up_the_open_hour_within_its_rollup_period() {
    let dir = tempfile::tempdir().unwrap();
    let broker = Broker::start(dir.path());
    let config = pipeline_config(dir.path(), &broker.bootstrap)
        .raw("[pipeline]\nrollup_every = \"500ms\"\n")
        .write(dir.path().join("gpuwarden.toml"));
    let lake = dir.path().join("data/lake");

    // 4 GPUs × 60 samples of 5 s; GPU-0001 is held by a lease from T0 on, still running.
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &broker.bootstrap)
        .create()
        .unwrap();
    let grant = r#"{"v":1,"ts_ms":1767225600000,"event":"granted","lease_id":"l-1","team":"research","user":"alice","project":"p","workload":"training","substrate":"sim","gpu_model":"NVIDIA A100-SXM4-80GB","gpu_count":1,"gpu_uuids":["GPU-0001"]}"#;
    producer
        .send(BaseRecord::to("gpuwarden.leases").key("l-1").payload(grant))
        .unwrap();
    for i in 0..240 {
        let payload = sample(i % 4, T0 + (i / 4) as i64 * 5_000);
        producer
            .send(
                BaseRecord::to("gpuwarden.samples")
                    .key("k")
                    .payload(&payload),
            )
            .unwrap();
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    let (pipeline, _) = start_pipeline(&config);
    // research's lease: 60 samples of 5 s, allocated from T0 to the watermark (59 × 5 s); the
    // first sample's interval ends at T0, before the grant, so 59 × 5 s are observed too.
    let query = "SELECT CAST(round(observed_gpu_hours * 3600000) AS BIGINT) * 1000000 \
                 + CAST(round(allocated_gpu_hours * 3600000) AS BIGINT) / 1000 \
                 FROM team_hourly WHERE team = 'research' AND NOT final";
    let expected = 295_000 * 1_000_000 + 295_000 / 1000;
    eventually(
        "research's open hour in team_hourly",
        Duration::from_secs(60),
        || match support::try_lake_i64(&lake, query) {
            Ok(v) if v == expected => Ok(()),
            other => Err(format!(
                "{other:?}; samples: {:?}, lease events: {:?}, team_hourly rows: {:?}",
                support::try_lake_i64(&lake, "SELECT count(*) FROM samples"),
                support::try_lake_i64(&lake, "SELECT count(*) FROM lease_events"),
                support::try_lake_i64(&lake, "SELECT count(*) FROM team_hourly"),
            )),
        },
    );
    assert_eq!(
        lake_i64(
            &lake,
            "SELECT count(*) FROM team_hourly WHERE team = '(unallocated)'"
        ),
        2,
        "the three GPUs no lease holds, and the hour before T0 where every GPU's first interval lies"
    );
    let (status, log) = pipeline.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    assert!(
        log.iter().any(|l| l.contains("rolled up")),
        "the rollup logs its runs; the log:\n{}",
        log.join("\n")
    );
}
