//! A directory of the lake's Parquet files as a DataFusion table. Both the SQL session over the
//! whole lake ([`crate::sql`]) and the jobs that read a few of its tables on their own (the
//! rollups, the month-to-date spend of the signals loop) register tables this way, so it sits
//! below all of them and knows none.

use std::path::Path;
use std::sync::Arc;

use arrow_schema::SchemaRef;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;

/// Registers the Parquet files under every one of `dirs` (which must exist) as one table; no
/// directories at all make an empty table.
pub fn register_dirs(
    ctx: &SessionContext,
    name: &str,
    dirs: &[std::path::PathBuf],
    schema: SchemaRef,
) -> Result<(), DataFusionError> {
    if dirs.is_empty() {
        let empty = datafusion::datasource::MemTable::try_new(schema, vec![vec![]])?;
        ctx.register_table(name, Arc::new(empty))?;
        return Ok(());
    }
    let urls: Vec<String> = dirs
        .iter()
        .map(|dir| format!("{}/", dir.display()))
        .collect();
    register_urls(ctx, name, &urls, schema)
}

/// Registers the Parquet files under every one of `urls` (directories, ending with `/`: local
/// paths or URLs of a store registered with `ctx`, such as `s3://bucket/prefix/samples/`) as
/// one table. A prefix with no objects is an empty table.
pub fn register_urls(
    ctx: &SessionContext,
    name: &str,
    urls: &[String],
    schema: SchemaRef,
) -> Result<(), DataFusionError> {
    let urls = urls
        .iter()
        .map(ListingTableUrl::parse)
        .collect::<Result<Vec<_>, _>>()?;
    let options =
        ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension(".parquet");
    let config = ListingTableConfig::new_with_multi_paths(urls)
        .with_listing_options(options)
        .with_schema(schema);
    ctx.register_table(name, Arc::new(ListingTable::try_new(config)?))?;
    Ok(())
}

/// Registers the Parquet files under `dir` (recursively) as `name`, read with `schema`.
/// The directory is created if missing so that the table exists, empty, from the start.
pub fn register_dir(
    ctx: &SessionContext,
    name: &str,
    dir: &Path,
    schema: SchemaRef,
) -> Result<(), DataFusionError> {
    std::fs::create_dir_all(dir)?;
    register_dirs(ctx, name, &[dir.to_path_buf()], schema)
}
