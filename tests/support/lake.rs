//! The lake as a test sees it: samples loaded with `gpuwarden ingest`, one number read back with
//! DataFusion (independently of the SQL endpoint), and the files under a directory.

use std::path::Path;
use std::process::Command;

/// Writes `lines` (JSON samples) to `file` and loads them into the lake of `config` with
/// `gpuwarden ingest`.
pub fn ingest_samples(config: &Path, file: &Path, lines: &str) {
    std::fs::write(file, lines).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["ingest", "--config", config.to_str().unwrap(), "--samples"])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `query` with DataFusion over the raw tables of a lake; returns the first column of the
/// first row as i64.
pub fn lake_i64(lake: &Path, query: &str) -> i64 {
    try_lake_i64(lake, query).unwrap_or_else(|e| panic!("{query}: {e}"))
}

/// [`lake_i64`], or the error (e.g. a table whose files are being replaced right now).
pub fn try_lake_i64(lake: &Path, query: &str) -> Result<i64, String> {
    let lake = gpuwarden_pipeline::Lake::open(lake).map_err(|e| e.to_string())?;
    query_i64(&lake, query)
}

/// [`lake_i64`] over the lake that the config file `config` names (a directory or a bucket).
pub fn config_lake_i64(config: &Path, query: &str) -> i64 {
    try_config_lake_i64(config, query).unwrap_or_else(|e| panic!("{query}: {e}"))
}

/// [`config_lake_i64`], or the error.
pub fn try_config_lake_i64(config: &Path, query: &str) -> Result<i64, String> {
    let config = gpuwarden_schema::config::load(config).unwrap_or_else(|e| panic!("{e}"));
    let lake = gpuwarden_pipeline::Lake::from_config(&config).map_err(|e| e.to_string())?;
    query_i64(&lake, query)
}

fn query_i64(lake: &gpuwarden_pipeline::Lake, query: &str) -> Result<i64, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_, batches) = runtime
        .block_on(gpuwarden_pipeline::sql::query(lake, query))
        .map_err(|e| e.to_string())?;
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Err("no rows".into());
    };
    let column = datafusion::arrow::compute::cast(
        batch.column(0),
        &datafusion::arrow::datatypes::DataType::Int64,
    )
    .map_err(|e| e.to_string())?;
    Ok(
        datafusion::arrow::array::AsArray::as_primitive::<datafusion::arrow::datatypes::Int64Type>(
            &column,
        )
        .value(0),
    )
}

/// The files under a directory, at any depth (none when it does not exist).
pub fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Counts the Parquet files under a directory, recursively.
pub fn parquet_files(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                parquet_files(&p)
            } else {
                usize::from(p.extension().is_some_and(|x| x == "parquet"))
            }
        })
        .sum()
}
