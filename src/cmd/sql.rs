//! `gpuwarden sql`: one query over the lake, printed as a table, CSV or JSON lines.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use gpuwarden_pipeline::delta::AsOf;
use gpuwarden_pipeline::governor::{self, Governor, GovernorOptions};
use gpuwarden_pipeline::sql;
use gpuwarden_schema::config;

/// Run SQL over the lake.
///
/// Every table of the lake is registered under its name, empty ones too. Raw: samples,
/// lease_events, signals, actions, quarantine. Rollups (see `gpuwarden rollup`): gpu_hourly,
/// lease_hourly, team_hourly, focus_costs (FOCUS 1.2), leases (one row per lease, its current
/// state), and the view lease_usage. SHOW TABLES, DESCRIBE <table> and information_schema
/// (tables, columns) list them. The dialect is DataFusion's, close to PostgreSQL's; FOCUS
/// columns are case-sensitive: SELECT "BilledCost" FROM focus_costs.
///
/// The query runs under the limits of [pipeline.sql_limits] (statement_timeout, query_memory),
/// as it would through the SQL endpoint: past its timeout it is canceled, and past its memory
/// it spills what it can to disk and fails if it still needs more. --timeout and --memory
/// override them.
/// Examples:
///   gpuwarden sql -c gw.toml "SELECT gpu_model, avg(util_gpu_pct) FROM samples GROUP BY 1"
///   gpuwarden sql -c gw.toml "SELECT team, sum(cost_usd) FROM team_hourly GROUP BY team"
///   gpuwarden sql -c gw.toml --format csv -f query.sql > out.csv
///   gpuwarden sql -c gw.toml --as-of 2026-12-03T00:00:00Z -f queries/invoice.sql
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The config file (for storage.lake or storage.data_dir).
    #[arg(long, short, value_name = "FILE", env = "GPUWARDEN_CONFIG")]
    config: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Read the query from this file ("-" for standard input) instead of the command line.
    #[arg(long, short, value_name = "FILE", conflicts_with = "query")]
    file: Option<String>,
    /// Cancel the query after this long ("30s", "10m"; "0s" for no limit). Default:
    /// pipeline.sql_limits.statement_timeout.
    #[arg(long, value_name = "DURATION", value_parser = config::parse_duration)]
    timeout: Option<std::time::Duration>,
    /// Memory the query may hold ("512MiB", "4GiB"). Default: pipeline.sql_limits.query_memory.
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size)]
    memory: Option<u64>,
    /// Read the tables as they stood at a time ("2026-12-03T00:00:00Z": each one's last commit
    /// at or before it) or at a version of their Delta logs (a number, "42": for a query of one
    /// table), to reproduce an invoice after late data restated its hours. Versions reach back
    /// 30 days (the files commits removed are kept that long).
    #[arg(long, value_name = "TIME|VERSION", value_parser = AsOf::parse)]
    as_of: Option<AsOf>,
    /// The query. It may start with a `--` comment, as files of queries/ do.
    #[arg(
        value_name = "QUERY",
        required_unless_present = "file",
        allow_hyphen_values = true
    )]
    query: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    /// An aligned table for people.
    Table,
    /// CSV with a header line (alone when there are no rows); lists and structs as the table
    /// writes them (`[GPU-1, GPU-2]`).
    Csv,
    /// One JSON object per row (nothing when there are no rows).
    Json,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let query = match (&args.query, &args.file) {
        (Some(q), _) => q.clone(),
        (None, Some(f)) if f == "-" => std::io::read_to_string(std::io::stdin())
            .context("reading the query from standard input")?,
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading {f}"))?,
        (None, None) => unreachable!("clap requires a query or a file"),
    };
    let lake = super::open_lake(&config, "sql")?;
    let limits = &config.pipeline.sql_limits;
    let mut options = GovernorOptions::from_config(limits, &[]);
    if let Some(timeout) = args.timeout {
        options.defaults.statement_timeout = (!timeout.is_zero()).then_some(timeout);
        options.defaults_set_by = "--timeout".to_string();
    }
    if let Some(memory) = args.memory {
        options.defaults.query_memory = usize::try_from(memory).unwrap_or(usize::MAX);
    }
    let governor = Governor::new(options).context("starting the query threads")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (schema, batches) = runtime
        .block_on(async {
            let ctx = sql::context_with_config(
                &lake,
                &config,
                &governor,
                args.as_of.unwrap_or(AsOf::Latest),
            )
            .await?;
            sql::run(&ctx, &query).await
        })
        .map_err(|e| match governor::sqlstate(&e) {
            Some((code, message)) => anyhow::anyhow!("{message} (SQLSTATE {code})"),
            None => anyhow::Error::new(e),
        })
        .context("running the query")?;
    // Which version of each table the answer comes from (a FOCUS export records it):
    // `--as-of <version>` answers the same for a query of that table.
    for (table, version) in lake.delta().versions_read() {
        let name = table.rsplit('/').next().unwrap_or(&table);
        eprintln!("read {name} at version {version} of its Delta log");
    }
    let mut out = std::io::stdout().lock();
    match args.format {
        Format::Table => {
            use std::io::Write as _;
            if batches.iter().all(|b| b.num_rows() == 0) {
                let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                writeln!(out, "({}) 0 rows", names.join(", "))?;
            } else {
                writeln!(out, "{}", pretty_format_batches(&batches)?)?;
            }
        }
        Format::Csv => {
            // The header even for no rows, as psql --csv and DuckDB print it: whatever reads
            // the output finds its columns either way.
            let empty = [RecordBatch::new_empty(Arc::clone(&schema))];
            let batches = if batches.is_empty() {
                &empty[..]
            } else {
                &batches[..]
            };
            let mut writer = datafusion::arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(out);
            for batch in batches {
                writer.write(&nested_as_text(batch)?)?;
            }
        }
        // JSON lines: one object per row, so no rows is no line.
        Format::Json => {
            let mut writer = datafusion::arrow::json::LineDelimitedWriter::new(out);
            for batch in &batches {
                writer.write(batch)?;
            }
            writer.finish()?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `batch` with its nested columns (lists such as `leases.gpu_uuids`, structs, maps), which
/// CSV cannot hold, written as the text the table format shows (`[GPU-1, GPU-2]`).
fn nested_as_text(
    batch: &RecordBatch,
) -> Result<RecordBatch, datafusion::arrow::error::ArrowError> {
    use datafusion::arrow::array::{Array, ArrayRef, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
    if !batch.columns().iter().any(|c| c.data_type().is_nested()) {
        return Ok(batch.clone());
    }
    let mut fields = Vec::with_capacity(batch.num_columns());
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(batch.num_columns());
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        if column.data_type().is_nested() {
            let formatter = ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())?;
            let text: StringArray = (0..column.len())
                .map(|i| column.is_valid(i).then(|| formatter.value(i).to_string()))
                .collect();
            fields.push(Field::new(field.name(), DataType::Utf8, true));
            columns.push(Arc::new(text));
        } else {
            fields.push(field.as_ref().clone());
            columns.push(Arc::clone(column));
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
}
