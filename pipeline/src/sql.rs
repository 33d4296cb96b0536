//! SQL over the lake with DataFusion: every table registered under its DESIGN.md name, each as a
//! listing table with its schema fixed in code. A listing table lists its files at every scan,
//! so files written after the session started (new flushes, new rollups) are visible to the
//! next query without a new session, and an empty table is a table with no rows rather than an
//! error.

use std::path::Path;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;

use crate::buffer::Table;
use crate::lake::Lake;

/// Registers the Parquet files under `dir` (recursively) as `name`, read with `schema`.
/// The directory is created if missing so that the table exists, empty, from the start.
pub fn register_dir(
    ctx: &SessionContext,
    name: &str,
    dir: &Path,
    schema: SchemaRef,
) -> Result<(), DataFusionError> {
    std::fs::create_dir_all(dir)?;
    let url = ListingTableUrl::parse(format!("{}/", dir.display()))?;
    let options =
        ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension(".parquet");
    let config = ListingTableConfig::new(url)
        .with_listing_options(options)
        .with_schema(schema);
    ctx.register_table(name, Arc::new(ListingTable::try_new(config)?))?;
    Ok(())
}

/// A session with the lake's raw tables registered.
pub async fn context(lake: &Lake) -> Result<SessionContext, DataFusionError> {
    let ctx = SessionContext::new();
    for table in Table::ALL {
        register_dir(
            &ctx,
            table.name(),
            &lake.root().join(table.name()),
            table.schema(),
        )?;
    }
    Ok(ctx)
}

/// Runs one query over the lake.
pub async fn query(
    lake: &Lake,
    sql: &str,
) -> Result<(SchemaRef, Vec<RecordBatch>), DataFusionError> {
    let ctx = context(lake).await?;
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
        let sample = gpuwarden_schema::Sample::from_json(
            br#"{"v":1,"ts_ms":1000,"interval_ms":1000,"host":"h","gpu_uuid":"GPU-1","gpu_model":"M","util_gpu_pct":50,"mem_used_bytes":1,"mem_total_bytes":2}"#,
        )
        .unwrap();
        let batch = gpuwarden_schema::Sample::to_record_batch(&[sample]).unwrap();
        let relative = Lake::file_name("samples", 0, "test", 0, 0);
        lake.write(&relative, &batch, "samples", 0).unwrap();
        assert_eq!(count(ctx).await, 1, "the same session sees the new file");
    }
}
