//! SQL over the lake with DataFusion: every table registered under its name in
//! docs/src/contributors/pipeline.md#sql-tables (raw tables, rollups, and the `lease_usage` and `clock_skew`
//! views), each a Delta table read with its schema fixed in code, at the version the session
//! asks for ([`AsOf`]; by default the latest commit when a query is planned, so that commits
//! made after the session started are visible to its next query). A table nothing has created
//! yet is a table with no rows rather than an error.

use std::sync::Arc;

use arrow_array::{Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::prelude::{SessionConfig, SessionContext};
use gpuwarden_schema::arrow::{string_list_type, string_lists};
use gpuwarden_schema::config::Config;

use crate::buffer::Table;
use crate::delta::AsOf;
use crate::governor::Governor;
use crate::lake::Lake;
use crate::rollup::RollupTable;

/// `lease_usage`: one row per lease, its identity and its measures over every hour
/// (`{idle_measure}`: `tables::COMBINED_IDLE_MEASURE`).
const LEASE_USAGE: &str = r#"CREATE VIEW lease_usage AS
SELECT l.lease_id, l.team, l."user", l.project, l.workload, l.substrate, l.gpu_model,
       l.gpu_count, l.granted_at, l.released_at, l.release_reason,
       COALESCE(sum(h.allocated_gpu_hours), 0.0) AS allocated_gpu_hours,
       COALESCE(sum(h.observed_gpu_hours), 0.0) AS observed_gpu_hours,
       COALESCE(sum(h.busy_gpu_hours), 0.0) AS busy_gpu_hours,
       COALESCE(sum(h.idle_gpu_hours), 0.0) AS idle_gpu_hours,
       CASE WHEN sum(h.observed_gpu_hours) > 0
            THEN 100.0 * sum(h.busy_gpu_hours) / sum(h.observed_gpu_hours) END AS utilization_pct,
       COALESCE(sum(h.cost_usd), 0.0) AS cost_usd,
       COALESCE(sum(h.idle_cost_usd), 0.0) AS idle_cost_usd,
       COALESCE(sum(h.energy_kwh), 0.0) AS energy_kwh,
       COALESCE(sum(h.sm_active_gpu_hours), 0.0) AS sm_active_gpu_hours,
       COALESCE(sum(h.gpm_observed_gpu_hours), 0.0) AS gpm_observed_gpu_hours,
       {idle_measure} AS idle_measure,
       COALESCE(sum(h.energy_cost_usd), 0.0) AS energy_cost_usd,
       sum(h.co2e_kg) AS co2e_kg
FROM leases l LEFT JOIN lease_hourly h ON h.lease_id = l.lease_id
GROUP BY l.lease_id, l.team, l."user", l.project, l.workload, l.substrate, l.gpu_model,
         l.gpu_count, l.granted_at, l.released_at, l.release_reason"#;

/// `clock_skew`: one row per host whose clock was found wrong (its samples' time out of
/// `pipeline.clock`'s bounds), from the `clock_skew` signals: when it was first and last
/// reported, its latest skew (positive: ahead), and how many reports there were.
const CLOCK_SKEW: &str = r#"CREATE VIEW clock_skew AS
SELECT host,
       arrow_cast(min(ts_ms), 'Timestamp(ms, "UTC")') AS first_seen,
       arrow_cast(max(ts_ms), 'Timestamp(ms, "UTC")') AS last_seen,
       CAST(last_value(skew_ms ORDER BY ts_ms) AS DOUBLE) / 1000.0 AS skew_s,
       count(*) AS reports
FROM signals WHERE kind = 'clock_skew'
GROUP BY host"#;

/// A session with every table of the lake registered: the raw tables, the rollups
/// (`rollups/<table>/`) and the views over them. Its queries run where they are polled, without
/// limits: it is for the pipeline's own queries; what people submit goes through
/// [`context_with_config`].
pub async fn context(lake: &Lake) -> Result<SessionContext, DataFusionError> {
    register_lake(
        SessionContext::new_with_config(session_config()),
        lake,
        AsOf::Latest,
    )
    .await
}

/// [`context`] with every table read at `as_of`.
pub async fn context_as_of(lake: &Lake, as_of: AsOf) -> Result<SessionContext, DataFusionError> {
    register_lake(
        SessionContext::new_with_config(session_config()),
        lake,
        as_of,
    )
    .await
}

/// What every session over the lake is configured with: `information_schema` (`tables`,
/// `columns`, `views`, `df_settings`, …), where people and tools look for the tables and their
/// columns, and which `SHOW TABLES` and `SHOW COLUMNS` read; and the catalog named as the
/// database clients connect to (`postgres://…/gpuwarden`), which `current_database()`,
/// `pg_database` and `table_catalog` give back.
fn session_config() -> SessionConfig {
    SessionConfig::new()
        .with_information_schema(true)
        .with_default_catalog_and_schema(CATALOG, "public")
}

/// The name of the sessions' one catalog.
const CATALOG: &str = "gpuwarden";

async fn register_lake(
    ctx: SessionContext,
    lake: &Lake,
    as_of: AsOf,
) -> Result<SessionContext, DataFusionError> {
    for table in Table::ALL {
        lake.delta()
            .register(&ctx, table.name(), table.name(), &table.schema(), as_of)?;
    }
    for table in RollupTable::ALL {
        lake.delta()
            .register(&ctx, table.name(), &table.dir(), &table.schema(), as_of)?;
    }
    // A lease's rows agree on the measure that judged them idle, or it is `mixed`.
    let lease_usage = LEASE_USAGE.replace(
        "{idle_measure}",
        crate::rollup::tables::COMBINED_IDLE_MEASURE,
    );
    ctx.sql(&lease_usage).await?;
    ctx.sql(CLOCK_SKEW).await?;
    Ok(ctx)
}

fn millis(duration: Option<std::time::Duration>) -> Option<i64> {
    duration.map(gpuwarden_schema::clock::duration_ms)
}

/// Registers what the lake does not hold but FinOps questions need, from the configuration:
/// `teams` (`team, members, gpu_quota, monthly_budget_usd, allowed_models`) and `workloads`
/// (`workload, min_gpus, max_gpus, max_duration_ms, idle_timeout_ms, warn_before_ms, on_idle,
/// target_util_pct, substrates`; a limit the config leaves unset is null). They are the
/// config the process started with.
pub fn register_config(ctx: &SessionContext, config: &Config) -> Result<(), DataFusionError> {
    let teams = Arc::new(Schema::new(vec![
        Field::new("team", DataType::Utf8, false),
        Field::new("members", string_list_type(), false),
        Field::new("gpu_quota", DataType::Int64, false),
        Field::new("monthly_budget_usd", DataType::Float64, false),
        Field::new("allowed_models", string_list_type(), false),
    ]));
    let t = &config.teams;
    let batch = RecordBatch::try_new(
        teams.clone(),
        vec![
            Arc::new(StringArray::from_iter_values(t.iter().map(|t| &t.name))),
            string_lists(t.iter().map(|t| t.members.as_slice())),
            Arc::new(Int64Array::from_iter_values(
                t.iter().map(|t| i64::from(t.gpu_quota)),
            )),
            Arc::new(Float64Array::from_iter_values(
                t.iter().map(|t| t.monthly_budget_usd),
            )),
            string_lists(t.iter().map(|t| t.allowed_models.as_slice())),
        ],
    )?;
    ctx.register_table(
        "teams",
        Arc::new(MemTable::try_new(teams, vec![vec![batch]])?),
    )?;

    let workloads = Arc::new(Schema::new(vec![
        Field::new("workload", DataType::Utf8, false),
        Field::new("min_gpus", DataType::Int64, true),
        Field::new("max_gpus", DataType::Int64, true),
        Field::new("max_duration_ms", DataType::Int64, true),
        Field::new("idle_timeout_ms", DataType::Int64, true),
        Field::new("warn_before_ms", DataType::Int64, true),
        Field::new("on_idle", DataType::Utf8, false),
        Field::new("target_util_pct", DataType::Float64, true),
        Field::new("substrates", string_list_type(), false),
    ]));
    let w: Vec<_> = config.workloads.iter().collect();
    let batch = RecordBatch::try_new(
        workloads.clone(),
        vec![
            Arc::new(StringArray::from_iter_values(
                w.iter().map(|(k, _)| k.as_str()),
            )),
            Arc::new(Int64Array::from_iter(
                w.iter().map(|(_, p)| p.min_gpus.map(i64::from)),
            )),
            Arc::new(Int64Array::from_iter(
                w.iter().map(|(_, p)| p.max_gpus.map(i64::from)),
            )),
            Arc::new(Int64Array::from_iter(
                w.iter().map(|(_, p)| millis(p.max_duration)),
            )),
            Arc::new(Int64Array::from_iter(
                w.iter().map(|(_, p)| millis(p.idle_timeout)),
            )),
            Arc::new(Int64Array::from_iter(
                w.iter().map(|(_, p)| millis(p.warn_before)),
            )),
            Arc::new(StringArray::from_iter_values(
                w.iter().map(|(_, p)| p.on_idle.as_str()),
            )),
            Arc::new(Float64Array::from_iter(
                w.iter().map(|(_, p)| p.target_util_pct),
            )),
            string_lists(w.iter().map(|(_, p)| p.substrates.as_slice())),
        ],
    )?;
    ctx.register_table(
        "workloads",
        Arc::new(MemTable::try_new(workloads, vec![vec![batch]])?),
    )?;
    Ok(())
}

/// A session over the lake and the configuration's `teams` and `workloads`, whose queries
/// `governor` runs: what `gpuwarden sql` and the SQL endpoint serve. The rollup tables are
/// read at `as_of` ([`AsOf::Latest`]: as each query finds them).
pub async fn context_with_config(
    lake: &Lake,
    config: &Config,
    governor: &Arc<Governor>,
    as_of: AsOf,
) -> Result<SessionContext, DataFusionError> {
    let ctx = register_lake(governor.context(session_config()), lake, as_of).await?;
    register_config(&ctx, config)?;
    Ok(ctx)
}

/// Runs one query over the lake.
pub async fn query(
    lake: &Lake,
    sql: &str,
) -> Result<(SchemaRef, Vec<RecordBatch>), DataFusionError> {
    run(&context(lake).await?, sql).await
}

/// Runs one query in a session.
pub async fn run(
    ctx: &SessionContext,
    sql: &str,
) -> Result<(SchemaRef, Vec<RecordBatch>), DataFusionError> {
    let frame = ctx.sql(sql).await?;
    let schema: SchemaRef = Arc::new(frame.schema().as_arrow().clone());
    let batches = frame.collect().await?;
    Ok((schema, batches))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Int64Array;

    #[tokio::test]
    async fn a_table_without_files_is_empty_and_sees_files_written_later() {
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let ctx = context(&lake).await.unwrap();
        let count = |ctx: SessionContext| async move {
            let batches = ctx
                .sql("SELECT count(*) FROM samples")
                .await
                .unwrap()
                .collect()
                .await
                .unwrap();
            batches[0]
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .value(0)
        };
        assert_eq!(count(ctx.clone()).await, 0);
        use gpuwarden_schema::Record as _;
        let batch = {
            let sample = gpuwarden_schema::Sample::from_json(
                br#"{"v":1,"ts_ms":1000,"interval_ms":1000,"host":"h","gpu_uuid":"GPU-1","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}"#,
            )
            .unwrap();
            gpuwarden_schema::Sample::to_record_batch(&[sample]).unwrap()
        };
        append(&lake, &batch).await;
        assert_eq!(
            count(ctx.clone()).await,
            1,
            "the same session sees the new commit"
        );
        append(&lake, &batch).await;
        assert_eq!(count(ctx).await, 2, "and the next one");
    }

    async fn append(lake: &Lake, batch: &RecordBatch) {
        let table = Table::Samples;
        lake.delta()
            .append(
                table.name(),
                &table.schema(),
                "test",
                &[crate::delta::NewFile {
                    hour_ms: 0,
                    batch,
                    offsets: None,
                }],
                None,
            )
            .await
            .unwrap();
    }

    /// A query over files that commits remove while it runs reads the version it planned
    /// over: no error, and one of the versions' counts, never a torn read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queries_read_whole_versions_of_files_removed_under_them() {
        use gpuwarden_schema::Record as _;
        let dir = tempfile::tempdir().unwrap();
        let lake = Lake::open(dir.path()).unwrap();
        let samples = |n: usize| {
            let rows: Vec<_> = (0..n)
                .map(|i| {
                    gpuwarden_schema::Sample::from_json(
                        format!(
                            r#"{{"v":1,"ts_ms":{i},"interval_ms":1000,"host":"h","gpu_uuid":"GPU-{i}","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}}"#
                        )
                        .as_bytes(),
                    )
                    .unwrap()
                })
                .collect();
            gpuwarden_schema::Sample::to_record_batch(&rows).unwrap()
        };
        let (small, large) = (samples(3), samples(5_000));
        append(&lake, &small).await;
        let writer = {
            let lake = lake.clone();
            tokio::spawn(async move {
                for i in 0..60 {
                    if i % 2 == 0 {
                        let files = lake
                            .delta()
                            .files("samples", AsOf::Latest)
                            .await
                            .unwrap()
                            .unwrap();
                        lake.delta()
                            .remove_files("samples", files.version, &files.files, "true")
                            .await
                            .unwrap();
                    } else {
                        append(&lake, if i % 4 == 1 { &large } else { &small }).await;
                    }
                }
            })
        };
        let ctx = context(&lake).await.unwrap();
        let mut seen = std::collections::BTreeSet::new();
        while !writer.is_finished() {
            let batches = ctx
                .sql("SELECT count(*), sum(interval_ms) FROM samples")
                .await
                .unwrap()
                .collect()
                .await
                .unwrap_or_else(|e| panic!("a query over removed files failed: {e}"));
            let count = batches[0]
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .value(0);
            assert!([0, 3, 5_000].contains(&count), "a torn read: {count} rows");
            seen.insert(count);
        }
        writer.await.unwrap();
        assert!(seen.len() > 1, "the queries saw only {seen:?}");
    }
}
