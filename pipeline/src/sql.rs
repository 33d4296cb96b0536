//! SQL over the lake with DataFusion: every raw table registered under its DESIGN.md name
//! (`samples`, `lease_events`, `signals`, `actions`, `quarantine`), whether or not it has files
//! yet, so a query never fails because a table is still empty.

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use datafusion::datasource::MemTable;
use datafusion::error::DataFusionError;
use datafusion::prelude::{ParquetReadOptions, SessionContext};

use crate::buffer::Table;
use crate::lake::Lake;

fn has_parquet(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            let path = e.path();
            if path.is_dir() {
                has_parquet(&path)
            } else {
                path.extension().is_some_and(|x| x == "parquet")
            }
        })
}

/// A session with the lake's raw tables registered.
pub async fn context(lake: &Lake) -> Result<SessionContext, DataFusionError> {
    let ctx = SessionContext::new();
    for table in Table::ALL {
        let dir = lake.root().join(table.name());
        if has_parquet(&dir) {
            ctx.register_parquet(
                table.name(),
                format!("{}/", dir.display()),
                ParquetReadOptions::default(),
            )
            .await?;
        } else {
            let empty = MemTable::try_new(table.schema(), vec![vec![]])?;
            ctx.register_table(table.name(), Arc::new(empty))?;
        }
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
