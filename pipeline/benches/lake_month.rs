//! Benchmark: a simulated stretch of a fleet's samples as the pipeline leaves them in the lake
//! at steady state (one commit per partition and minute, each adding that minute's file: what
//! `flush_age = 1m` commits when traffic is steady), compacted (OPTIMIZE) hour by hour as each
//! becomes final, as the pipeline's compaction does (`LAKE_MONTH_COMPACT=end`: once, at the
//! end, with the queries timed before it too); three
//! representative queries over raw samples timed on each, and the time to open the table (read
//! its log) after those commits. Run with `bench/lake-month.sh`, which times the same queries in
//! DuckDB's `delta_scan` of the same table.
//!
//! `lake_month <dir> <gpus> <days>`: writes `<dir>/lake` with `DeltaTables::append` (ingest's
//! commit, with each partition's offsets as its transaction), prints one JSON line per phase on
//! stdout. With `LAKE_MONTH_REUSE=1`, a lake already in `<dir>` (from a run with the same
//! arguments) is kept and only queried, after a compaction that has nothing left to do.

use std::time::Instant;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use gpuwarden_pipeline::compact::CompactOptions;
use gpuwarden_pipeline::delta::{block_on, AppTxn, AsOf, NewFile};
use gpuwarden_pipeline::{Compactor, Lake, Table};
use std::sync::Arc;

const T0: i64 = 1_764_547_200_000; // 2025-12-01T00:00:00Z
const STEP_MS: i64 = 5_000;
const PARTITIONS: usize = 6;
const HOUR_MS: i64 = 3_600_000;

/// The three queries, also run by bench/lake-month.sh in DuckDB (`{last_day}` and `{gpu}`
/// filled in by both).
pub const QUERIES: [(&str, &str); 3] = [
    (
        "util by model (full scan)",
        "SELECT gpu_model, avg(util_gpu_pct) FROM samples GROUP BY 1 ORDER BY 1",
    ),
    (
        "one GPU's last day",
        "SELECT count(*), avg(util_gpu_pct) FROM samples WHERE gpu_uuid = '{gpu}' AND ts_ms >= {last_day}",
    ),
    (
        "idle samples per host, last day, top 10",
        "SELECT host, count(*) FILTER (WHERE util_gpu_pct < 5) AS idle FROM samples WHERE ts_ms >= {last_day} GROUP BY host ORDER BY idle DESC, host LIMIT 10",
    ),
];

fn batch(gpus: &[usize], minute_ms: i64) -> RecordBatch {
    let n = gpus.len() * 12;
    let mut ts = Vec::with_capacity(n);
    let mut host = Vec::with_capacity(n);
    let mut uuid = Vec::with_capacity(n);
    let mut model = Vec::with_capacity(n);
    let mut util = Vec::with_capacity(n);
    let mut mem = Vec::with_capacity(n);
    let mut power = Vec::with_capacity(n);
    let mut temp = Vec::with_capacity(n);
    let mut energy = Vec::with_capacity(n);
    let mut lease = Vec::with_capacity(n);
    for step in 0..12 {
        let t = minute_ms + step * STEP_MS;
        for &g in gpus {
            // A GPU is busy for hours, then idle for hours: a phase per GPU, some noise.
            let phase = (t / HOUR_MS + g as i64 * 7) % 10;
            let noise = ((t / STEP_MS) as usize * 31 + g * 17) % 23;
            let u = if phase < 6 {
                60.0 + noise as f64
            } else {
                (noise % 3) as f64
            };
            ts.push(t);
            host.push(format!("node-{:04}", g / 8));
            uuid.push(format!("GPU-{g:08x}-0000-4000-8000-{g:012x}"));
            model.push(if g % 3 == 0 {
                "NVIDIA H100 80GB HBM3"
            } else {
                "NVIDIA A100-SXM4-80GB"
            });
            util.push(u);
            mem.push(((u as i64) << 28) + (noise as i64) * 1_048_576);
            power.push(80.0 + u * 5.0 + noise as f64 * 0.25);
            temp.push(35.0 + u * 0.4);
            energy.push((t - T0) / 10 + g as i64);
            lease.push((phase < 6).then(|| format!("l-{:05}", g / 4)));
        }
    }
    let schema = Table::Samples.schema();
    let col = |name: &str| -> ArrayRef {
        match name {
            "v" => Arc::new(Int64Array::from(vec![1; n])),
            "ts_ms" => Arc::new(Int64Array::from(ts.clone())),
            "interval_ms" => Arc::new(Int64Array::from(vec![STEP_MS; n])),
            "host" => Arc::new(StringArray::from(host.clone())),
            "gpu_uuid" => Arc::new(StringArray::from(uuid.clone())),
            "gpu_model" => Arc::new(StringArray::from(model.clone())),
            "util_gpu_pct" => Arc::new(Float64Array::from(util.clone())),
            "mem_used_bytes" => Arc::new(Int64Array::from(mem.clone())),
            "mem_total_bytes" => Arc::new(Int64Array::from(vec![85_520_809_984; n])),
            "gpu_index" => Arc::new(Int64Array::from(
                (0..n)
                    .map(|i| Some((gpus[i % gpus.len()] % 8) as i64))
                    .collect::<Vec<_>>(),
            )),
            "power_w" => Arc::new(Float64Array::from(
                power.iter().copied().map(Some).collect::<Vec<_>>(),
            )),
            "power_limit_w" => Arc::new(Float64Array::from(vec![Some(700.0); n])),
            "energy_mj" => Arc::new(Int64Array::from(
                energy.iter().copied().map(Some).collect::<Vec<_>>(),
            )),
            "temp_c" => Arc::new(Float64Array::from(
                temp.iter().copied().map(Some).collect::<Vec<_>>(),
            )),
            "lease_id" => Arc::new(StringArray::from(lease.clone())),
            other => {
                arrow_array::new_null_array(schema.field_with_name(other).unwrap().data_type(), n)
            }
        }
    };
    let columns: Vec<ArrayRef> = schema.fields().iter().map(|f| col(f.name())).collect();
    RecordBatch::try_new(schema.clone(), columns).unwrap()
}

/// The files of the samples table's latest version, their bytes, the version, and how long
/// opening the table (reading its log from scratch, as a new reader does) took.
fn table_stats(lake: &Lake) -> (u64, u64, u64, f64) {
    let started = Instant::now();
    let files = block_on(lake.delta().load("samples", AsOf::Latest))
        .unwrap()
        .map(|table| table.version().unwrap_or(0));
    let open_s = started.elapsed().as_secs_f64();
    let Some(version) = files else {
        return (0, 0, 0, open_s);
    };
    let files = block_on(lake.delta().files("samples", AsOf::Latest))
        .unwrap()
        .unwrap();
    let bytes = files.files.iter().map(|f| f.size.max(0) as u64).sum();
    (files.files.len() as u64, bytes, version, open_s)
}

/// Each query `runs` times in a new session (`sql::query`, as `gpuwarden sql` runs it) and,
/// when `runs` > 1, `runs` times in one held session (as the SQL endpoint runs a connection's queries, and as
/// the DuckDB half keeps its connection: file footers read once); the best and the median of
/// each are reported.
fn queries(
    runtime: &tokio::runtime::Runtime,
    lake: &Lake,
    phase: &str,
    runs: usize,
    last_day: i64,
    gpu: &str,
) {
    let held = runtime
        .block_on(gpuwarden_pipeline::sql::context(lake))
        .unwrap();
    for (name, sql) in QUERIES {
        let sql = sql
            .replace("{last_day}", &last_day.to_string())
            .replace("{gpu}", gpu);
        let time = |held: Option<&datafusion::prelude::SessionContext>| {
            let mut times = Vec::new();
            let mut rows = 0;
            for _ in 0..runs {
                let started = Instant::now();
                let (_, batches) = match held {
                    Some(ctx) => runtime.block_on(gpuwarden_pipeline::sql::run(ctx, &sql)),
                    None => runtime.block_on(gpuwarden_pipeline::sql::query(lake, &sql)),
                }
                .unwrap();
                times.push(started.elapsed().as_secs_f64());
                rows = batches.iter().map(|b| b.num_rows()).sum::<usize>();
            }
            times.sort_by(f64::total_cmp);
            (times[0], times[runs / 2], rows)
        };
        let (best, median, rows) = time(None);
        // Not before compaction, where one run takes minutes.
        let held_times = (runs > 1).then(|| time(Some(&held)));
        println!(
            "{}",
            serde_json::json!({"phase": phase, "query": name, "sql": sql, "best_s": best, "median_s": median,
                "held_session_best_s": held_times.map(|t| t.0),
                "held_session_median_s": held_times.map(|t| t.1), "rows": rows})
        );
    }
}

/// The engine's own floor: the same queries in a plain DataFusion session (its defaults, none of
/// gpuwarden's schema, Delta log or governor), over `paths` (DuckDB's file of the same rows, or
/// the files of the compacted table's latest version); best and median of `runs` in one held
/// session.
fn bare_datafusion(
    runtime: &tokio::runtime::Runtime,
    label: &str,
    paths: &[String],
    runs: usize,
    last_day: i64,
    gpu: &str,
) {
    use datafusion::datasource::listing::{
        ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
    };
    let ctx = datafusion::prelude::SessionContext::new();
    let urls = paths
        .iter()
        .map(ListingTableUrl::parse)
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let options = ListingOptions::new(Arc::new(
        datafusion::datasource::file_format::parquet::ParquetFormat::default(),
    ))
    .with_file_extension(".parquet");
    let config = runtime
        .block_on(
            ListingTableConfig::new_with_multi_paths(urls)
                .with_listing_options(options)
                .infer_schema(&ctx.state()),
        )
        .unwrap();
    ctx.register_table("samples", Arc::new(ListingTable::try_new(config).unwrap()))
        .unwrap();
    for (name, sql) in QUERIES {
        let sql = sql
            .replace("{last_day}", &last_day.to_string())
            .replace("{gpu}", gpu);
        let mut times = Vec::new();
        for _ in 0..runs {
            let started = Instant::now();
            runtime
                .block_on(gpuwarden_pipeline::sql::run(&ctx, &sql))
                .unwrap();
            times.push(started.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{}",
            serde_json::json!({"phase": label, "query": name, "best_s": times[0], "median_s": times[runs / 2]})
        );
    }
}

fn main() {
    // `cargo nextest run --all-targets` lists every bench target's tests: it has none.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench`; the script passes the three values after `--`.
    let values: Vec<&String> = args
        .iter()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let (dir, gpus, days) = match values.as_slice() {
        [dir, gpus, days] => (
            std::path::PathBuf::from(dir),
            gpus.parse::<usize>().expect("gpus"),
            days.parse::<i64>().expect("days"),
        ),
        _ => {
            eprintln!("usage: lake_month <dir> <gpus> <days>");
            std::process::exit(2);
        }
    };
    let last_day = T0 + (days - 1) * 24 * HOUR_MS;
    let gpu = format!("GPU-{:08x}-0000-4000-8000-{:012x}", 42, 42);
    if std::env::var("LAKE_MONTH_BARE").is_ok_and(|v| v == "1") {
        // Run by the script after DuckDB wrote its file: the engine's floor on both files.
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let duck = dir.join("duck.parquet");
        let lake = Lake::open(dir.join("lake")).unwrap();
        let files: Vec<String> = block_on(lake.delta().files("samples", AsOf::Latest))
            .unwrap()
            .unwrap()
            .files
            .iter()
            .map(|f| lake.delta().file_url("samples", &f.path))
            .collect();
        bare_datafusion(
            &runtime,
            "bare datafusion, duckdb's file",
            &[duck.display().to_string()],
            3,
            last_day,
            &gpu,
        );
        bare_datafusion(
            &runtime,
            "bare datafusion, compacted lake",
            &files,
            3,
            last_day,
            &gpu,
        );
        return;
    }
    let lake = Lake::open(dir.join("lake")).unwrap();
    let by_partition: Vec<Vec<usize>> = (0..PARTITIONS)
        .map(|p| (0..gpus).filter(|g| g % PARTITIONS == p).collect())
        .collect();
    let hours = days * 24;
    let reuse = std::env::var("LAKE_MONTH_REUSE").is_ok_and(|v| v == "1")
        && lake.root().join("samples/_delta_log").is_dir();
    // OPTIMIZE each hour once it is final, as the pipeline does (the default), or once at the
    // end (`LAKE_MONTH_COMPACT=end`: the queries are timed before it too).
    let hourly = std::env::var("LAKE_MONTH_COMPACT").map_or(true, |v| v != "end");
    let mut compacted_files_in = 0;
    let started = Instant::now();
    let mut offsets = [0i64; PARTITIONS];
    for hour in (0..hours).filter(|_| !reuse) {
        let hour_ms = T0 + hour * HOUR_MS;
        for minute in 0..60 {
            let minute_ms = hour_ms + minute * 60_000;
            for (p, gpus) in by_partition.iter().enumerate() {
                if gpus.is_empty() {
                    continue;
                }
                let batch = batch(gpus, minute_ms);
                offsets[p] += batch.num_rows() as i64;
                let source = format!("gpuwarden.samples-p{p}");
                block_on(lake.delta().append(
                    "samples",
                    &Table::Samples.schema(),
                    &source,
                    &[NewFile {
                        hour_ms,
                        batch: &batch,
                        offsets: None,
                    }],
                    Some(&AppTxn {
                        app_id: format!("{source}@bench"),
                        last: offsets[p] - 1,
                    }),
                ))
                .unwrap();
            }
        }
        if hourly {
            // The hours final by the end of this one, as the pipeline's compaction takes them.
            let done = block_on(
                Compactor::new(lake.clone(), CompactOptions::default())
                    .run(Some(hour_ms + HOUR_MS)),
            )
            .unwrap();
            compacted_files_in += done.compacted.files_in;
        }
        if hour % 24 == 23 {
            let (_, _, version, open_s) = table_stats(&lake);
            eprintln!(
                "wrote day {} of {days} ({:.0} s; commits {version}, table opened in {open_s:.3} s)",
                hour / 24 + 1,
                started.elapsed().as_secs_f64()
            );
            println!(
                "{}",
                serde_json::json!({"phase": "day written", "day": hour / 24 + 1,
                    "elapsed_s": started.elapsed().as_secs_f64(), "commits": version,
                    "open_table_s": open_s})
            );
        }
    }
    let rows = offsets.iter().sum::<i64>();
    let write_s = started.elapsed().as_secs_f64();
    let (files, bytes, version, open_s) = table_stats(&lake);
    println!(
        "{}",
        serde_json::json!({"phase": if reuse { "reused" } else { "written" }, "gpus": gpus, "days": days, "rows": rows, "hours": hours,
            "files": files, "files_per_hour": files as f64 / hours as f64, "bytes": bytes,
            "commits": version, "open_table_s": open_s, "write_s": write_s})
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if !reuse && !hourly && std::env::var("LAKE_MONTH_SKIP_BEFORE").is_err() {
        // Once: over thousands of small files a query takes minutes.
        queries(&runtime, &lake, "before compaction", 1, last_day, &gpu);
    }

    let started = Instant::now();
    let done = runtime
        .block_on(
            Compactor::new(lake.clone(), CompactOptions::default())
                .run(Some(T0 + (hours + 1) * HOUR_MS)),
        )
        .unwrap();
    let compact_s = started.elapsed().as_secs_f64();
    let (files, bytes, version, open_s) = table_stats(&lake);
    println!(
        "{}",
        serde_json::json!({"phase": "compacted", "hours": done.compacted.hours,
            "files_in": done.compacted.files_in + compacted_files_in,
            "files_out": done.compacted.files_out, "rows": done.compacted.rows, "files": files,
            "files_per_hour": files as f64 / hours as f64, "bytes": bytes,
            "commits": version, "open_table_s": open_s, "compact_s": compact_s})
    );
    queries(&runtime, &lake, "after compaction", 3, last_day, &gpu);
}
