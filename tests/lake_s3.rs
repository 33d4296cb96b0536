//! The lake in an S3 bucket (docs/src/contributors/object-storage.md), against the tests'
//! S3 server (s3s-fs): the lake's operations as one contract run on a directory and on a bucket,
//! `gpuwarden ingest`, `sql`, `rollup` and `compact` reaching the bucket through the standard AWS
//! environment and answering as on a directory, retention on a bucket, a role's lease object
//! taken, renewed, handed over, taken over and raced for, a Delta table's hour replaced in one
//! commit and raced for, and a long query reading right while compaction replaces its files.

mod support;

use std::path::Path;
use std::time::Duration;

use datafusion::arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use gpuwarden_pipeline::bucket_lock::{BucketLock, Held};
use gpuwarden_pipeline::delta::AsOf;
use gpuwarden_pipeline::delta::{block_on, AppTxn, Appended, NewFile};
use gpuwarden_pipeline::lake::Role;
use gpuwarden_pipeline::Lake;
use support::rollups::{gpuwarden_with as gpuwarden, ok};
use support::s3::S3Server;

const HOUR: i64 = 3_600_000;
/// 2026-01-01T00:00:00Z.
const T0: i64 = 1_767_225_600_000;

/// `rows` samples of `hour` (GPU `i` at its start), as ingest buffers them.
fn samples(rows: i64, hour: i64) -> RecordBatch {
    use gpuwarden_schema::Record as _;
    let rows: Vec<gpuwarden_schema::Sample> = (0..rows)
        .map(|i| {
            gpuwarden_schema::Sample::from_json(
                format!(
                    r#"{{"v":1,"ts_ms":{hour},"interval_ms":5000,"host":"h","gpu_uuid":"GPU-{i}","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}}"#
                )
                .as_bytes(),
            )
            .unwrap()
        })
        .collect();
    gpuwarden_schema::Sample::to_record_batch(&rows).unwrap()
}

/// `SELECT count(*)` of `table`, through gpuwarden's session at `as_of`.
fn count_as_of(lake: &Lake, table: &str, as_of: AsOf) -> i64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let batches = runtime.block_on(async {
        let ctx = gpuwarden_pipeline::sql::context_as_of(lake, as_of)
            .await
            .unwrap();
        ctx.sql(&format!("SELECT count(*) FROM {table}"))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap()
    });
    batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap()
        .value(0)
}

fn count(lake: &Lake, table: &str) -> i64 {
    count_as_of(lake, table, AsOf::Latest)
}

/// Appends `batch` (rows of `hour` with `offsets`) to its table as source `source` would, its
/// last offset `last`.
fn append(
    lake: &Lake,
    table: &str,
    source: &str,
    batch: &RecordBatch,
    hour: i64,
    offsets: &[i64],
    last: i64,
) -> Appended {
    block_on(lake.delta().append(
        table,
        &batch.schema(),
        source,
        &[NewFile {
            hour_ms: hour,
            batch,
            offsets: Some(offsets),
        }],
        Some(&AppTxn {
            app_id: source.to_string(),
            last,
        }),
    ))
    .unwrap()
}

/// A signal row, as ingest buffers it.
fn signal_rows() -> RecordBatch {
    use gpuwarden_schema::Record as _;
    let signal = gpuwarden_schema::Signal::from_json(
        format!(r#"{{"v":1,"ts_ms":{T0},"kind":"team_spend","window_ms":60000,"team":"a","month_to_date_usd":1.5,"burn_usd_per_hour":0.5}}"#).as_bytes(),
    )
    .unwrap();
    gpuwarden_schema::Signal::to_record_batch(&[signal]).unwrap()
}

/// What every lake does, wherever it is: `exists` says whether a file (relative to the lake's
/// root) is in the lake, looked at from outside it.
fn lake_contract(lake: &Lake, exists: &dyn Fn(&Path) -> bool) {
    // A flush of offsets 10..=19 with rows of two hours, committed hour by hour.
    let offsets: Vec<i64> = (10..20).collect();
    let first = append(
        lake,
        "samples",
        "t-p0",
        &samples(3, T0),
        T0,
        &offsets[..3],
        19,
    );
    assert!(
        matches!(
            first,
            Appended::Committed {
                rows: 3,
                files: 1,
                ..
            }
        ),
        "{first:?}"
    );
    // The table holds the source up to 19 now: a second commit of the same range adds nothing.
    let again = append(
        lake,
        "samples",
        "t-p0",
        &samples(4, T0 + HOUR),
        T0 + HOUR,
        &offsets[3..7],
        19,
    );
    assert_eq!(again, Appended::AlreadyThere { held: 19 });
    assert_eq!(count(lake, "samples"), 3);
    let files = block_on(lake.delta().files("samples", AsOf::Latest))
        .unwrap()
        .unwrap();
    assert_eq!(files.files.len(), 1);
    let file = &files.files[0];
    assert_eq!((file.hour_ms, file.rows), (Some(T0), Some(3)));
    assert!(
        file.path.starts_with("2026-01-01T00-t-p0-"),
        "{}",
        file.path
    );
    assert!(
        exists(&Path::new("samples").join(&file.path)),
        "{}",
        file.path
    );
    assert_eq!(
        block_on(lake.delta().txn_version("samples", "t-p0")).unwrap(),
        Some(19)
    );

    // A replay with other boundaries (a new owner read from an older committed offset): only
    // the rows after 19 land.
    let replayed = append(
        lake,
        "samples",
        "t-p0",
        &samples(6, T0 + HOUR),
        T0 + HOUR,
        &[16, 17, 18, 19, 20, 21],
        21,
    );
    assert!(
        matches!(replayed, Appended::Committed { rows: 2, .. }),
        "{replayed:?}"
    );
    assert_eq!(count(lake, "samples"), 5);

    // Two owners of one partition commit the same range at once: the log lets one in, and the
    // other, checked against it, adds nothing.
    let both: Vec<i64> = (22..30).collect();
    let batch = samples(8, T0 + HOUR);
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| append(lake, "samples", "t-p0", &batch, T0 + HOUR, &both, 29));
        }
    });
    assert_eq!(count(lake, "samples"), 13, "the range once");
    // A partition deleted and created again numbers from 0 again: its offsets are forgotten,
    // and its new records land.
    block_on(lake.delta().forget_txn("samples", &batch.schema(), "t-p0")).unwrap();
    assert_eq!(
        block_on(lake.delta().txn_version("samples", "t-p0")).unwrap(),
        Some(-1)
    );
    let renumbered = append(
        lake,
        "samples",
        "t-p0",
        &samples(2, T0 + HOUR),
        T0 + HOUR,
        &[0, 1],
        1,
    );
    assert!(
        matches!(renumbered, Appended::Committed { rows: 2, .. }),
        "{renumbered:?}"
    );
    assert_eq!(count(lake, "samples"), 15);
    // Another source is another transaction, another table another log.
    append(lake, "signals", "u-p1", &signal_rows(), T0, &[0], 0);
    assert_eq!(count(lake, "signals"), 1);

    // The hours commits added rows to, for the rollups.
    let (latest, hours) = block_on(lake.delta().changed_hours("samples", Some(0)))
        .unwrap()
        .unwrap();
    assert_eq!(
        hours.unwrap().into_iter().collect::<Vec<_>>(),
        [T0, T0 + HOUR]
    );
    let (_, none) = block_on(lake.delta().changed_hours("samples", Some(latest)))
        .unwrap()
        .unwrap();
    assert!(none.unwrap().is_empty());

    // Files a commit removes stay for the versions that name them.
    let files = block_on(lake.delta().files("samples", AsOf::Latest))
        .unwrap()
        .unwrap();
    block_on(
        lake.delta()
            .remove_files("samples", files.version, &files.files, "true"),
    )
    .unwrap();
    assert_eq!(count(lake, "samples"), 0);
    assert!(files
        .files
        .iter()
        .all(|f| exists(&Path::new("samples").join(&f.path))));
    assert_eq!(
        count_as_of(lake, "samples", AsOf::Version(files.version)),
        15,
        "as of the version before the removal"
    );
}

#[test]
fn the_lake_keeps_its_contract_in_a_directory_and_in_an_s3_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let local = Lake::open(dir.path().join("lake")).unwrap();
    let root = local.root().to_path_buf();
    lake_contract(&local, &|file| root.join(file).is_file());
    assert!(local.try_lock(Role::Rollups).unwrap().is_some());

    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let config_file = dir.path().join("s3.toml");
    std::fs::write(
        &config_file,
        server.storage_config(&dir.path().join("data"), "fleet/lake"),
    )
    .unwrap();
    let config = gpuwarden_schema::config::load(&config_file).unwrap_or_else(|e| panic!("{e}"));
    let bucket = Lake::from_config(&config).unwrap();
    assert_eq!(bucket.location(), "s3://lake/fleet/lake");
    lake_contract(&bucket, &|file| {
        server
            .object_path(&format!("fleet/lake/{}", file.display()))
            .is_file()
    });
    // Outside the prefix nothing was written.
    let keys = server.keys("");
    assert!(
        keys.iter().all(|k| k.starts_with("fleet/lake/")),
        "{keys:?}"
    );

    // A role on a bucket is its lease object: one holder, renewed while held, released when
    // dropped so that the next taker need not wait for it to expire.
    let held = bucket
        .try_lock(Role::Rollups)
        .unwrap()
        .expect("a free role");
    assert_eq!(held.path(), Path::new("_leases/rollups.json"));
    assert!(server
        .object_path("fleet/lake/_leases/rollups.json")
        .is_file());
    assert!(bucket.try_lock(Role::Rollups).unwrap().is_none(), "held");
    assert!(
        bucket.try_lock(Role::Compaction).unwrap().is_some(),
        "another role"
    );
    held.check("rolling up").unwrap();
    drop(held);
    assert!(
        bucket.try_lock(Role::Rollups).unwrap().is_some(),
        "released"
    );
}

/// A file encoded locally goes up whole: one PUT when small, a multipart upload of 16 MiB parts
/// when larger (an ingest file holds up to 4 Mi rows), and either way the object is the file.
#[test]
fn files_are_uploaded_whole_in_one_put_or_in_parts() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let config_file = dir.path().join("s3.toml");
    std::fs::write(
        &config_file,
        server.storage_config(&dir.path().join("data"), "gw"),
    )
    .unwrap();
    let config = gpuwarden_schema::config::load(&config_file).unwrap_or_else(|e| panic!("{e}"));
    let lake = Lake::from_config(&config).unwrap();
    let objects = lake.objects().expect("a lake in a bucket");
    for (name, size) in [("small", 100_000), ("large", 2 * 16 * 1024 * 1024 + 12_345)] {
        let bytes: Vec<u8> = (0..size).map(|i: usize| (i * 131 % 251) as u8).collect();
        let local = dir.path().join(name);
        std::fs::write(&local, &bytes).unwrap();
        let relative = Path::new("samples").join(format!("{name}.parquet"));
        assert_eq!(objects.put_file(&relative, &local).unwrap(), size as u64);
        let stored =
            std::fs::read(server.object_path(&format!("gw/samples/{name}.parquet"))).unwrap();
        assert!(stored == bytes, "{name}: the object is the file");
    }
}

fn sample(gpu: usize, ts_ms: i64) -> String {
    serde_json::json!({
        "v": 1, "ts_ms": ts_ms, "interval_ms": 5000, "host": format!("node-{}", gpu / 4),
        "gpu_uuid": format!("GPU-{gpu:04}"), "gpu_model": "NVIDIA A100-SXM4-80GB",
        "util_gpu_pct": (gpu * 7 % 100) as f64, "mem_used_bytes": 1u64 << 30,
        "mem_total_bytes": 85899345920u64
    })
    .to_string()
}

/// `storage.lake = "s3://…"` and nothing else: the endpoint, region and credentials come from
/// the standard AWS environment variables, as on a machine with an instance role they come from
/// it. `gpuwarden sql` answers from the bucket what it answers from a directory.
#[test]
fn ingest_and_sql_reach_a_bucket_through_the_aws_environment() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let data = dir.path().join("data");
    let s3_config = dir.path().join("s3.toml");
    std::fs::write(
        &s3_config,
        format!(
            "[storage]\ndata_dir = \"{}\"\nlake = \"s3://lake/gw\"\n",
            data.display()
        ),
    )
    .unwrap();
    let dir_config = dir.path().join("dir.toml");
    std::fs::write(
        &dir_config,
        format!("[storage]\ndata_dir = \"{}\"\n", data.display()),
    )
    .unwrap();
    let input = dir.path().join("samples.jsonl");
    let lines: Vec<String> = (0..3 * 720)
        .map(|i| sample(i % 12, T0 + (i / 12) as i64 * 60_000))
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let env = server.env();

    for config in [&s3_config, &dir_config] {
        let config = config.to_str().unwrap();
        let ingest = [
            "ingest",
            "--config",
            config,
            "--samples",
            input.to_str().unwrap(),
        ];
        let out = ok(gpuwarden(&ingest, &env));
        assert!(
            out.contains("2160 samples records read, 2160 written"),
            "{out}"
        );
        // Twice: the same files again, nothing counted twice.
        ok(gpuwarden(&ingest, &env));
    }
    let keys = server.keys("gw");
    let data = |keys: &[String]| -> Vec<String> {
        keys.iter()
            .filter(|k| k.starts_with("gw/samples/") && !k.contains("/_delta_log/"))
            .cloned()
            .collect()
    };
    assert_eq!(data(&keys).len(), 3, "one file per hour: {keys:?}");
    assert!(
        keys.contains(&"gw/samples/_delta_log/00000000000000000001.json".to_string()),
        "committed to the table's log: {keys:?}"
    );

    let query = "SELECT date_trunc('hour', to_timestamp_millis(ts_ms)) AS hour, count(*) AS n, \
                 count(DISTINCT gpu_uuid) AS gpus, round(avg(util_gpu_pct), 3) AS util \
                 FROM samples GROUP BY 1 ORDER BY 1";
    let from_bucket = ok(gpuwarden(
        &[
            "sql",
            "--config",
            s3_config.to_str().unwrap(),
            "--format",
            "csv",
            query,
        ],
        &env,
    ));
    let from_dir = ok(gpuwarden(
        &[
            "sql",
            "--config",
            dir_config.to_str().unwrap(),
            "--format",
            "csv",
            query,
        ],
        &[],
    ));
    assert_eq!(from_bucket, from_dir);
    assert_eq!(from_bucket.lines().count(), 4, "{from_bucket}");
    assert!(
        from_bucket.lines().nth(1).unwrap().contains(",720,12,"),
        "{from_bucket}"
    );
    // Tables nothing has written yet are empty, not errors.
    let empty = ok(gpuwarden(
        &[
            "sql",
            "--config",
            s3_config.to_str().unwrap(),
            "--format",
            "csv",
            "SELECT (SELECT count(*) FROM team_hourly) + (SELECT count(*) FROM leases) AS n",
        ],
        &env,
    ));
    assert_eq!(empty, "n\n0\n");

    // Rolled up and then compacted, by the same commands, the bucket answers as the directory.
    let rollups = "SELECT CAST(hour AS VARCHAR) AS hour, gpu_model, \
                   round(observed_gpu_hours, 6) AS observed, round(cost_usd, 6) AS cost \
                   FROM team_hourly ORDER BY 1, 2";
    let answers = |config: &Path, env: &[(&'static str, String)]| -> (String, String) {
        let c = config.to_str().unwrap();
        let sql = |q: &str| {
            ok(gpuwarden(
                &["sql", "--config", c, "--format", "csv", q],
                env,
            ))
        };
        (sql(rollups), sql(query))
    };
    for (config, env) in [(&s3_config, &env[..]), (&dir_config, &[][..])] {
        // The samples are of 2026-01-01, and --watermark is years later.
        let mut text = std::fs::read_to_string(config).unwrap();
        text.push_str("\n[pipeline.retention]\nsamples = \"forever\"\n");
        std::fs::write(config, text).unwrap();
        let c = config.to_str().unwrap();
        let rolled = ok(gpuwarden(&["rollup", "--config", c], env));
        assert!(rolled.contains("hours rolled up: 4"), "{rolled}");
        let before = answers(config, env);
        let compacted = ok(gpuwarden(
            &[
                "compact",
                "--config",
                c,
                "--watermark",
                "2030-01-01T00:00:00Z",
            ],
            env,
        ));
        assert!(compacted.contains("hours compacted: 3;"), "{compacted}");
        assert_eq!(answers(config, env), before, "compaction changed no answer");
    }
    let (bucket_rollups, bucket_samples) = answers(&s3_config, &env);
    assert_eq!(
        (bucket_rollups.clone(), bucket_samples),
        answers(&dir_config, &[])
    );
    assert_eq!(bucket_rollups.lines().count(), 5, "{bucket_rollups}");
    let keys = server.keys("gw");
    assert!(
        keys.iter()
            .any(|k| k.starts_with("gw/samples/2026-01-01T00-optimized-")),
        "{keys:?}"
    );
    assert!(
        keys.contains(&"gw/_leases/rollups.json".to_string()),
        "{keys:?}"
    );

    // Retention on a bucket: with samples kept a day, the watermark years later deletes every
    // hour of them (a Delta DELETE; VACUUM deletes the files 30 days later); the rollups stay.
    let mut text = std::fs::read_to_string(&s3_config).unwrap();
    text = text.replace("samples = \"forever\"", "samples = \"1d\"");
    std::fs::write(&s3_config, text).unwrap();
    let c = s3_config.to_str().unwrap();
    let expired = ok(gpuwarden(
        &[
            "compact",
            "--config",
            c,
            "--watermark",
            "2030-01-01T00:00:00Z",
        ],
        &env,
    ));
    assert!(
        expired.contains("retention: samples: 3 hours deleted (3 files,"),
        "{expired}"
    );
    let sql = |q: &str| {
        ok(gpuwarden(
            &["sql", "--config", c, "--format", "csv", q],
            &env,
        ))
    };
    assert_eq!(sql("SELECT count(*) AS n FROM samples"), "n\n0\n");
    assert_eq!(sql(rollups), bucket_rollups, "the rollups stay");
    assert!(
        !data(&server.keys("gw")).is_empty(),
        "the files stay for as-of reads of the versions before the deletion"
    );
}

fn object_lake(server: &S3Server) -> gpuwarden_pipeline::objects::ObjectLake {
    use support::s3::{ACCESS_KEY, REGION, SECRET_KEY};
    let s3 = gpuwarden_schema::config::S3Config {
        endpoint: Some(server.endpoint.clone()),
        region: Some(REGION.to_string()),
        access_key_id: Some(ACCESS_KEY.to_string()),
        secret_access_key: Some(SECRET_KEY.to_string()),
        allow_http: Some(true),
        ..Default::default()
    };
    gpuwarden_pipeline::objects::ObjectLake::s3(&server.bucket, "fleet/lake", &s3).unwrap()
}

/// A role's lease, one holder after another: taken, refused to a second taker while it lasts,
/// renewed, taken over once it expired, after which the deposed holder's renewal and release
/// are refused; released, and taken again at once.
#[test]
fn a_lease_is_taken_renewed_taken_over_after_expiry_and_released() {
    const TTL: Duration = Duration::from_millis(1_500);
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let (a_lake, b_lake) = (object_lake(&server), object_lake(&server));

    let mut a = BucketLock::try_take(&a_lake, "rollups", "a", TTL)
        .unwrap()
        .expect("a free lease is taken");
    assert_eq!((a.holder(), a.generation()), ("a", 1));
    assert!(a.remaining() > Duration::ZERO && a.remaining() <= TTL);
    assert_eq!(
        server.keys("fleet/lake/_leases"),
        ["fleet/lake/_leases/rollups.json"]
    );
    assert!(
        BucketLock::try_take(&b_lake, "rollups", "b", TTL)
            .unwrap()
            .is_none(),
        "taken while a's lease lasts"
    );
    // Another role is another lease.
    let signals = BucketLock::try_take(&b_lake, "signals", "b", TTL)
        .unwrap()
        .expect("another role's lease is free");

    // a renews in time: b is still refused after a's first expiry would have passed.
    std::thread::sleep(TTL / 2);
    assert_eq!(a.renew().unwrap(), Held::Kept);
    std::thread::sleep(TTL * 2 / 3);
    assert!(
        BucketLock::try_take(&b_lake, "rollups", "b", TTL)
            .unwrap()
            .is_none(),
        "a renewed lease lasts from its renewal"
    );

    // a stops renewing (stuck, or cut off); once its lease has expired, b takes it over.
    std::thread::sleep(TTL);
    assert_eq!(a.remaining(), Duration::ZERO, "a counts its lease as ended");
    let b = BucketLock::try_take(&b_lake, "rollups", "b", TTL)
        .unwrap()
        .expect("an expired lease is taken over");
    assert_eq!((b.holder(), b.generation()), ("b", 2));
    // a learns it was deposed at its next write, and writes nothing over b's lease.
    assert_eq!(a.renew().unwrap(), Held::Deposed);
    assert_eq!(a.remaining(), Duration::ZERO);
    assert_eq!(a.release().unwrap(), Held::Deposed);
    assert!(
        BucketLock::try_take(&a_lake, "rollups", "a", TTL)
            .unwrap()
            .is_none(),
        "b's lease stands after a's refused writes"
    );

    // b releases: the next taker need not wait for the expiry.
    assert_eq!(b.release().unwrap(), Held::Kept);
    let again = BucketLock::try_take(&a_lake, "rollups", "a", TTL)
        .unwrap()
        .expect("a released lease is taken at once");
    assert_eq!(again.generation(), 3);
    assert_eq!(again.release().unwrap(), Held::Kept);
    assert_eq!(signals.release().unwrap(), Held::Kept);
}

/// A lease handed over: refused to anyone else, taken up by the holder it names alone, a new
/// generation; and a deposed holder's handover refused.
#[test]
fn a_lease_is_handed_over_to_the_holder_it_names() {
    const TTL: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let (a_lake, b_lake, c_lake) = (
        object_lake(&server),
        object_lake(&server),
        object_lake(&server),
    );

    let a = BucketLock::try_take(&a_lake, "compaction", "a", TTL)
        .unwrap()
        .expect("a free lease is taken");
    assert_eq!(a.hand_over("b").unwrap(), Held::Kept);
    assert!(
        BucketLock::try_take(&c_lake, "compaction", "c", TTL)
            .unwrap()
            .is_none(),
        "a lease handed over is not free"
    );
    assert!(
        BucketLock::adopt(&c_lake, "compaction", "c", TTL)
            .unwrap()
            .is_none(),
        "handed to b, not to c"
    );
    let mut b = BucketLock::adopt(&b_lake, "compaction", "b", TTL)
        .unwrap()
        .expect("b takes up the lease handed to it");
    assert_eq!((b.holder(), b.generation()), ("b", 2));
    assert!(b.remaining() > Duration::ZERO);
    assert_eq!(b.renew().unwrap(), Held::Kept);
    assert_eq!(b.release().unwrap(), Held::Kept);

    // A holder deposed after its lease expired cannot hand the role on.
    let short = Duration::from_millis(300);
    let a = BucketLock::try_take(&a_lake, "compaction", "a", short)
        .unwrap()
        .expect("a released lease is taken");
    std::thread::sleep(short + Duration::from_millis(100));
    let c = BucketLock::try_take(&c_lake, "compaction", "c", TTL)
        .unwrap()
        .expect("an expired lease is taken over");
    assert_eq!(c.generation(), 4);
    assert_eq!(a.hand_over("b").unwrap(), Held::Deposed);
    assert!(
        BucketLock::adopt(&b_lake, "compaction", "b", TTL)
            .unwrap()
            .is_none(),
        "c holds it, handed to nobody"
    );
    assert_eq!(c.release().unwrap(), Held::Kept);
}

/// Takers racing, truly concurrently and each through a client of its own, for one lease:
/// exactly one wins each round, whether the lease is free (a create-only PUT) or released (a
/// conditional replacement of the object, as for an expired one), and the object names the
/// winner. The lease lasts long enough that no taker slowed by a loaded machine can outlast it
/// and rightly take it over as a second winner.
#[test]
fn of_concurrent_takers_of_a_lease_exactly_one_wins() {
    const TAKERS: usize = 8;
    const ROUNDS: usize = 20;
    const TTL: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let lakes: Vec<_> = (0..TAKERS).map(|_| object_lake(&server)).collect();
    let race = |role: &str| -> Vec<BucketLock> {
        let barrier = std::sync::Barrier::new(TAKERS);
        std::thread::scope(|scope| {
            let tries: Vec<_> = lakes
                .iter()
                .enumerate()
                .map(|(i, lake)| {
                    let barrier = &barrier;
                    scope.spawn(move || {
                        barrier.wait();
                        BucketLock::try_take(lake, role, &format!("taker-{i}"), TTL).unwrap()
                    })
                })
                .collect();
            tries
                .into_iter()
                .filter_map(|t| t.join().unwrap())
                .collect()
        })
    };
    let holder_in_store = |role: &str| -> String {
        let body: serde_json::Value = serde_json::from_slice(
            &std::fs::read(server.object_path(&format!("fleet/lake/_leases/{role}.json"))).unwrap(),
        )
        .unwrap();
        body["holder"].as_str().unwrap().to_string()
    };
    // Never two winners. No winner at all is what a taker's win looks like when its client
    // retried the PUT after the store had written it (a 5xx or a timeout on a loaded machine):
    // the retry is refused and the taker answers that it lost (`ObjectLake::put_if`); the store
    // then names a taker that holds nothing, and the role is free again once the lease expires.
    // That is allowed, seldom: at most a quarter of the races.
    let mut lost = 0;
    for round in 0..ROUNDS {
        let role = format!("role-{round}");
        let free = race(&role);
        assert!(free.len() <= 1, "round {round}, free lease: {free:?}");
        let Some(won) = free.into_iter().next() else {
            assert!(
                holder_in_store(&role).starts_with("taker-"),
                "round {round}"
            );
            lost += 1;
            continue;
        };
        assert_eq!(holder_in_store(&role), won.holder(), "round {round}");

        assert_eq!(won.release().unwrap(), Held::Kept);
        let released = race(&role);
        assert!(
            released.len() <= 1,
            "round {round}, released lease: {released:?}"
        );
        let Some(won) = released.first() else {
            // A taker's replacement did land: the generation moved on.
            let body: serde_json::Value = serde_json::from_slice(
                &std::fs::read(server.object_path(&format!("fleet/lake/_leases/{role}.json")))
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(body["generation"], 2, "round {round}: {body}");
            lost += 1;
            continue;
        };
        assert_eq!(won.generation(), 2, "round {round}");
        assert_eq!(holder_in_store(&role), won.holder(), "round {round}");
    }
    println!(
        "{lost} of {} races won and lost to a client retry",
        2 * ROUNDS
    );
    assert!(
        lost <= ROUNDS / 2,
        "{lost} of {} races had no winner",
        2 * ROUNDS
    );
}

/// Rows of a test table with one set of rows per hour, as the rollup tables have: `hour`, `id`.
fn hour_rows(hour: i64, rows: usize) -> RecordBatch {
    use datafusion::arrow::array::TimestampMillisecondArray;
    RecordBatch::try_from_iter([
        (
            "hour",
            std::sync::Arc::new(
                TimestampMillisecondArray::from(vec![hour; rows]).with_timezone("UTC"),
            ) as ArrayRef,
        ),
        (
            "id",
            std::sync::Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("row-{i}")),
            )) as _,
        ),
    ])
    .unwrap()
}

/// Rows of the Delta table `relative` of `lake`, read at `as_of`.
fn delta_rows(lake: &Lake, relative: &str, as_of: AsOf) -> usize {
    let schema = hour_rows(T0, 0).schema();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let ctx = datafusion::prelude::SessionContext::new();
        lake.delta()
            .register(&ctx, "t", relative, &schema, as_of)
            .unwrap();
        ctx.table("t").await.unwrap().count().await.unwrap()
    })
}

/// A rollup table in a bucket is a Delta table: an hour is replaced in one commit, which a
/// reader sees whole or not at all; no object is ever written twice (a query reads a file's
/// footer and its columns in separate requests); and the versions the log keeps read as they
/// were, for as-of queries.
#[test]
fn an_hour_of_a_delta_table_in_a_bucket_is_replaced_in_one_commit_and_old_versions_read() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let lake = server.lake("fleet", &dir.path().join("staging"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let table = "rollups/test_hourly";
    let schema = hour_rows(T0, 0).schema();
    let replace = |hour: i64, rows: usize| -> u64 {
        let batch = hour_rows(hour, rows);
        runtime
            .block_on(lake.delta().replace(
                table,
                &schema,
                Some(("hour", hour)),
                (rows > 0).then_some(&batch),
            ))
            .unwrap()
    };
    assert_eq!(delta_rows(&lake, table, AsOf::Latest), 0, "no table yet");
    let first = replace(T0, 3);
    assert_eq!(delta_rows(&lake, table, AsOf::Latest), 3);
    let second = replace(T0, 5);
    assert_eq!(second, first + 1, "one commit");
    assert_eq!(
        delta_rows(&lake, table, AsOf::Latest),
        5,
        "the hour replaced, not added to"
    );
    replace(T0 + HOUR, 2);
    assert_eq!(delta_rows(&lake, table, AsOf::Latest), 7);
    // A filter on the hour skips the other hour's file by its statistics, and keeps its own.
    let in_hour = |hour: i64| -> usize {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let ctx = datafusion::prelude::SessionContext::new();
                lake.delta()
                    .register(&ctx, "t", table, &schema, AsOf::Latest)
                    .unwrap();
                let query = format!(
                    r#"SELECT * FROM t WHERE hour = arrow_cast({hour}, 'Timestamp(ms, "UTC")')"#
                );
                ctx.sql(&query).await.unwrap().count().await.unwrap()
            })
    };
    assert_eq!(
        (in_hour(T0), in_hour(T0 + HOUR), in_hour(T0 + 2 * HOUR)),
        (5, 2, 0)
    );
    assert_eq!(delta_rows(&lake, table, AsOf::Version(first)), 3);
    assert_eq!(delta_rows(&lake, table, AsOf::Version(second)), 5);
    let emptied = replace(T0, 0);
    assert_eq!(
        delta_rows(&lake, table, AsOf::Latest),
        2,
        "the hour removed"
    );
    assert_eq!(delta_rows(&lake, table, AsOf::Version(emptied - 1)), 7);

    let keys = server.keys("fleet/rollups/test_hourly/");
    let files: Vec<&String> = keys.iter().filter(|k| k.ends_with(".parquet")).collect();
    assert_eq!(
        files.len(),
        3,
        "a new object per write, kept for old versions: {keys:?}"
    );
    assert!(
        files.iter().all(|k| k.contains("/2026-01-01T0")),
        "an hour's files are named by it: {files:?}"
    );
    assert!(
        keys.iter()
            .any(|k| k.ends_with(&format!("_delta_log/{emptied:020}.json"))),
        "{keys:?}"
    );
}

/// Two pipelines that replace the same hour at once (a rollups role holder and one that took
/// the role over from it) coordinate through the log's create-only commits on the tests' S3
/// server: of two commits of one version one lands, the other finds that its hour's file was
/// removed under it and fails, so the hour holds one writer's rows, never both.
#[test]
fn concurrent_replacements_of_an_hour_in_a_bucket_leave_one_writers_rows() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let first = server.lake("fleet", &dir.path().join("a"));
    let second = server.lake("fleet", &dir.path().join("b"));
    let table = "rollups/test_hourly";
    let schema = hour_rows(T0, 0).schema();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let seed = hour_rows(T0, 1);
    runtime
        .block_on(
            first
                .delta()
                .replace(table, &schema, Some(("hour", T0)), Some(&seed)),
        )
        .unwrap();
    // Both handles have read the table before the races, as pipelines that have run a while.
    let second_seed = hour_rows(T0 + HOUR, 1);
    runtime
        .block_on(second.delta().replace(
            table,
            &schema,
            Some(("hour", T0 + HOUR)),
            Some(&second_seed),
        ))
        .unwrap();
    let mut refused = 0;
    for round in 0..10 {
        let (a, b) = (hour_rows(T0, 3), hour_rows(T0, 5));
        let (x, y) = runtime.block_on(async {
            tokio::join!(
                first
                    .delta()
                    .replace(table, &schema, Some(("hour", T0)), Some(&a)),
                second
                    .delta()
                    .replace(table, &schema, Some(("hour", T0)), Some(&b)),
            )
        });
        refused += usize::from(x.is_err()) + usize::from(y.is_err());
        assert!(x.is_ok() || y.is_ok(), "round {round}: no writer landed");
        let rows = delta_rows(&first, table, AsOf::Latest) - 1;
        // Both landed (one after the other): the later version's rows.
        let expected = match (&x, &y) {
            (Ok(vx), Ok(vy)) if vx > vy => 3,
            (Ok(_), Err(_)) => 3,
            _ => 5,
        };
        assert_eq!(rows, expected, "round {round}: {x:?} {y:?}");
    }
    println!("{refused} of 20 concurrent replacements were refused by the log");
}

#[test]
fn a_long_query_over_a_bucket_reads_correctly_while_compaction_replaces_its_files() {
    use futures::StreamExt as _;
    use gpuwarden_schema::Record as _;
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let lake = server.lake("fleet", &dir.path().join("staging"));
    let (files, per_file) = (12_i64, 4_000_i64);
    for f in 0..files {
        let rows: Vec<gpuwarden_schema::Sample> = (0..per_file)
            .map(|i| {
                let gpu = f * per_file + i;
                gpuwarden_schema::Sample::from_json(
                    format!(
                        r#"{{"v":1,"ts_ms":{},"interval_ms":5000,"host":"h","gpu_uuid":"GPU-{gpu}","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}}"#,
                        T0 + i % 720 * 5_000
                    )
                    .as_bytes(),
                )
                .unwrap()
            })
            .collect();
        let batch = gpuwarden_schema::Sample::to_record_batch(&rows).unwrap();
        let offsets: Vec<i64> = (f * per_file..(f + 1) * per_file).collect();
        append(
            &lake,
            "samples",
            "gpuwarden.samples-p0",
            &batch,
            T0,
            &offsets,
            (f + 1) * per_file - 1,
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ctx = runtime
        .block_on(gpuwarden_pipeline::sql::context(&lake))
        .unwrap();
    let mut stream = runtime
        .block_on(async {
            ctx.sql("SELECT gpu_uuid, ts_ms FROM samples")
                .await?
                .execute_stream()
                .await
        })
        .unwrap();
    let first = runtime.block_on(stream.next()).unwrap().unwrap();
    let mut rows = first.num_rows() as i64;
    assert!(
        rows < files * per_file,
        "the query has more to read: {rows}"
    );

    // The compaction runs to its end while the query is between batches.
    let compactor = gpuwarden_pipeline::Compactor::new(
        lake.clone(),
        gpuwarden_pipeline::CompactOptions {
            retention: Vec::new(),
            ..gpuwarden_pipeline::CompactOptions::default()
        },
    );
    let done = runtime
        .block_on(compactor.run(Some(T0 + 3 * HOUR)))
        .unwrap();
    assert_eq!(done.compacted.hours, 1);
    assert_eq!(done.compacted.files_in, files as usize);
    let after = block_on(lake.delta().files("samples", AsOf::Latest))
        .unwrap()
        .unwrap();
    assert!(
        after.files.iter().all(|f| f.path.contains("-optimized-")),
        "the latest version names the outputs only: {:?}",
        after.files
    );
    assert!(
        server
            .keys("fleet/samples")
            .iter()
            .any(|k| k.contains("gpuwarden.samples-p0")),
        "the inputs stay in the bucket for the versions that name them"
    );

    while let Some(batch) = runtime.block_on(stream.next()) {
        rows += batch
            .unwrap_or_else(|e| panic!("the query failed after the compaction: {e}"))
            .num_rows() as i64;
    }
    assert_eq!(rows, files * per_file, "every row once");
    // A new query reads the compacted file alone, to the same rows.
    let count = runtime
        .block_on(async {
            ctx.sql("SELECT count(DISTINCT gpu_uuid) FROM samples")
                .await?
                .collect()
                .await
        })
        .unwrap();
    let count = count[0]
        .column(0)
        .as_any()
        .downcast_ref::<Int64Array>()
        .unwrap()
        .value(0);
    assert_eq!(count, files * per_file);
}
