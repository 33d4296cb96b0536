//! Benchmark: what the SQL governor costs a query. The same queries over the same in-memory
//! table run in a plain DataFusion session (on the caller's runtime, no checkpoints, no pool)
//! and in a governed one (on the governor's threads, a checkpoint above every operator, a
//! memory pool of its own), alternating, in the same run. Reports each side's median and the
//! ratio governed / plain. Run with `cargo bench -p gpuwarden-pipeline --bench sql_governor`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use datafusion::datasource::MemTable;
use datafusion::prelude::{SessionConfig, SessionContext};
use gpuwarden_pipeline::governor::{Governor, GovernorOptions, Limits};

const ROWS: usize = 4_000_000;
const BATCH: usize = 8_192;
const ROUNDS: usize = 7;

const QUERIES: [(&str, &str); 4] = [
    (
        "group by",
        "SELECT gpu, avg(util), count(*) FROM t GROUP BY gpu ORDER BY gpu LIMIT 3",
    ),
    ("top 10", "SELECT * FROM t ORDER BY util DESC, ts LIMIT 10"),
    (
        "join",
        "SELECT count(*) FROM t JOIN (SELECT DISTINCT gpu, host FROM t WHERE ts < 1000) h \
         ON t.gpu = h.gpu",
    ),
    (
        "filter",
        "SELECT count(*) FROM t WHERE util > 90 AND host LIKE 'h-1%'",
    ),
];

fn table() -> Arc<MemTable> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("ts", DataType::Int64, false),
        Field::new("gpu", DataType::Int64, false),
        Field::new("host", DataType::Utf8, false),
        Field::new("util", DataType::Float64, false),
    ]));
    let batches = (0..ROWS)
        .step_by(BATCH)
        .map(|start| {
            let rows = start..(start + BATCH).min(ROWS);
            let i64s = |f: fn(usize) -> i64| Int64Array::from_iter_values(rows.clone().map(f));
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(i64s(|i| (i / 1_000) as i64)),
                    Arc::new(i64s(|i| (i % 1_000) as i64)),
                    Arc::new(StringArray::from_iter_values(
                        rows.clone().map(|i| format!("h-{}", i % 1_000 / 8)),
                    )),
                    Arc::new(Float64Array::from_iter_values(
                        rows.clone().map(|i| ((i * 7_919) % 10_007) as f64 / 100.07),
                    )),
                ],
            )
            .unwrap()
        })
        .collect();
    Arc::new(MemTable::try_new(schema, vec![batches]).unwrap())
}

async fn time(ctx: &SessionContext, sql: &str) -> Duration {
    let started = Instant::now();
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    assert!(!batches.is_empty());
    started.elapsed()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    // `cargo bench` passes --bench; test runners (which list and run every target) do not.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap();
    let governor = Governor::new(GovernorOptions {
        defaults: Limits {
            statement_timeout: None,
            query_memory: 4 << 30,
            max_queries: 8,
        },
        defaults_set_by: "the benchmark".into(),
        users: HashMap::new(),
        max_queries: 8,
        queue_timeout: Duration::from_secs(60),
        threads,
    })
    .unwrap();
    let table = table();
    let plain = SessionContext::new();
    plain.register_table("t", table.clone()).unwrap();
    let governed = governor.context(SessionConfig::new());
    governed.register_table("t", table).unwrap();
    println!("{ROWS} rows in memory, {threads} threads, {ROUNDS} rounds alternating; medians");
    println!(
        "{:<10} {:>12} {:>12} {:>8}",
        "query", "plain", "governed", "ratio"
    );
    runtime.block_on(async {
        for (name, sql) in QUERIES {
            // Warm both (plans, allocator).
            time(&plain, sql).await;
            time(&governed, sql).await;
            let (mut p, mut g) = (Vec::new(), Vec::new());
            for round in 0..ROUNDS {
                if round % 2 == 0 {
                    p.push(time(&plain, sql).await);
                    g.push(time(&governed, sql).await);
                } else {
                    g.push(time(&governed, sql).await);
                    p.push(time(&plain, sql).await);
                }
            }
            let (p, g) = (median(p), median(g));
            println!(
                "{name:<10} {:>10.1}ms {:>10.1}ms {:>8.3}",
                p.as_secs_f64() * 1e3,
                g.as_secs_f64() * 1e3,
                g.as_secs_f64() / p.as_secs_f64()
            );
        }
    });
}
