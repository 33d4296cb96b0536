//! The lake's Delta tables (docs/ARCHITECTURE.md#delta-tables): where each one's transaction log
//! is, how gpuwarden commits to it, and how a session reads a version of it.
//!
//! A Delta table is a directory (or a prefix of a bucket) of Parquet files and a log,
//! `_delta_log/<version:020>.json`, whose commits add and remove files. A reader takes the files
//! the latest commit (or the one it names) leaves, so a commit that removes an hour's file and
//! adds its replacement is seen whole or not at all, by gpuwarden and by every other Delta
//! reader (DuckDB's `delta` extension, polars, Spark, Trino). Commits are created with a
//! create-only PUT (`PutMode::Create`: a rename without replace in a directory, `If-None-Match:
//! *` in a bucket), so of two writers of one version exactly one succeeds and the other checks
//! what it read against what landed, and retries or fails.
//!
//! The rollup tables are Delta tables. gpuwarden encodes each file itself (the lake's Parquet
//! settings, `lake::writer_properties`) and commits it with the removal of the files it
//! replaces; an hour's file is named `<YYYY-MM-DD>T<HH>-<uuid>.parquet`, so the files of an hour
//! are found by name, and its statistics carry the hour, so readers skip the others.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{Schema, SchemaRef};
use async_trait::async_trait;
use datafusion::arrow::compute::cast;
use datafusion::catalog::Session;
use datafusion::common::ScalarValue;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::DataFusionError;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::ExecutionPlan;
use deltalake_core::delta_datafusion::{DeltaScanConfig, DeltaScanNext};
use deltalake_core::kernel::engine::arrow_conversion::{TryFromArrow as _, TryFromKernel as _};
use deltalake_core::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake_core::kernel::{Action, Add, Remove, StructType};
use deltalake_core::logstore::{LogStoreRef, StorageConfig};
use deltalake_core::operations::vacuum::VacuumMode;
use deltalake_core::protocol::{DeltaOperation, SaveMode};
use deltalake_core::{DeltaTable, DeltaTableError, TableProperty};
use gpuwarden_schema::calendar::civil_from_days;
use object_store::ObjectStoreExt as _;
use tokio::sync::Mutex;

use crate::store::ObjectLake;

/// A Delta operation of the lake that failed, naming the table.
#[derive(Debug, thiserror::Error)]
#[error("Delta table {table} in {lake}: {source}")]
pub struct DeltaError {
    /// The table's directory, relative to the lake.
    pub table: String,
    /// The lake: its directory or `s3://bucket/prefix`.
    pub lake: String,
    /// What went wrong.
    #[source]
    pub source: Box<DeltaTableError>,
}

/// Where the lake's tables are: a directory, or a prefix of a bucket.
#[derive(Clone)]
enum Root {
    Dir(PathBuf),
    Bucket(ObjectLake),
}

/// A table as its last read loaded it (`None`: not created then), behind its own lock.
type Slot = Arc<Mutex<Option<DeltaTable>>>;

/// The lake's Delta tables. A clone shares the tables it has opened.
#[derive(Clone)]
pub struct DeltaTables {
    root: Root,
    /// The tables written through this handle, by directory: kept between commits, so a
    /// commit reads only the log written since the last one.
    open: Arc<Mutex<HashMap<String, DeltaTable>>>,
    /// When each table was last vacuumed through this handle.
    vacuumed: Arc<Mutex<HashMap<String, std::time::Instant>>>,
    /// Each table as the last read of its latest version through this handle loaded it, so
    /// the next reads only the commits since (in a bucket, a listing of the log after it and
    /// those commits, not the checkpoint and every commit after it again). A lock per table:
    /// one table's update does not hold up reads of another.
    latest: Arc<std::sync::Mutex<HashMap<String, Slot>>>,
    /// The version of each table the scans through this handle last read.
    read: Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>>,
}

impl fmt::Debug for DeltaTables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeltaTables({})", self.display())
    }
}

/// How long a file a commit removed stays for the versions that still name it, so that
/// as-of reads reach back as far as the log does (`delta.logRetentionDuration`, 30 days by
/// default): the tables' `delta.deletedFileRetentionDuration`, set when they are created.
/// [`DeltaTables::vacuum`] deletes removed files older than this.
pub const KEEP_REMOVED: &str = "interval 30 days";

/// How often [`DeltaTables::vacuum`] looks for removed files to delete, per table.
const VACUUM_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

/// Which version of a table a read sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsOf {
    /// The latest commit when the query is planned.
    Latest,
    /// The table as commit `n` left it.
    Version(u64),
    /// The table as it stood at this time (Unix epoch milliseconds): its latest commit made
    /// at or before it.
    Time(i64),
}

impl AsOf {
    /// `latest`, a version of the Delta logs (digits, `42`), or a time (RFC 3339; UTC when it
    /// names no offset, `2026-12-03T00:00:00Z`), as `gpuwarden sql --as-of` and the SQL
    /// endpoint's `SET gpuwarden.as_of` take them.
    pub fn parse(value: &str) -> Result<Self, String> {
        let value = value.trim();
        if value.eq_ignore_ascii_case("latest") {
            return Ok(Self::Latest);
        }
        if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
            return value
                .parse()
                .map(Self::Version)
                .map_err(|e| format!("version {value}: {e}"));
        }
        let time = humantime::parse_rfc3339_weak(value).map_err(|e| {
            format!(
                "{value:?} is neither latest, a version (a number) nor a time like \
                 2026-12-03T00:00:00Z: {e}"
            )
        })?;
        let ms = time
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|_| format!("{value} is before 1970"))?
            .as_millis();
        Ok(Self::Time(i64::try_from(ms).map_err(|e| e.to_string())?))
    }
}

tokio::task_local! {
    /// The `SET gpuwarden.as_of` of the SQL connection a query is planned in.
    static SESSION_AS_OF: std::sync::Mutex<AsOf>;
}

/// Runs `connection` (every query it plans) with an as-of of its own, [`AsOf::Latest`] until
/// [`set_session_as_of`] changes it: what the tables registered at [`AsOf::Latest`] are read at.
pub fn scope_session_as_of<F: std::future::Future>(
    connection: F,
) -> impl std::future::Future<Output = F::Output> {
    SESSION_AS_OF.scope(std::sync::Mutex::new(AsOf::Latest), connection)
}

/// Sets the as-of of the connection [`scope_session_as_of`] runs the caller in; `false`
/// outside one.
pub fn set_session_as_of(as_of: AsOf) -> bool {
    SESSION_AS_OF
        .try_with(|cell| {
            if let Ok(mut current) = cell.lock() {
                *current = as_of;
            }
        })
        .is_ok()
}

fn session_as_of() -> AsOf {
    SESSION_AS_OF
        .try_with(|cell| cell.lock().map_or(AsOf::Latest, |as_of| *as_of))
        .unwrap_or(AsOf::Latest)
}

impl DeltaTables {
    /// The tables of a lake in the directory `root`.
    pub fn in_dir(root: &Path) -> Self {
        Self::new(Root::Dir(root.to_path_buf()))
    }

    /// The tables of a lake in a bucket.
    pub fn in_bucket(objects: ObjectLake) -> Self {
        Self::new(Root::Bucket(objects))
    }

    fn new(root: Root) -> Self {
        Self {
            root,
            open: Arc::new(Mutex::new(HashMap::new())),
            vacuumed: Arc::new(Mutex::new(HashMap::new())),
            latest: Arc::default(),
            read: Arc::default(),
        }
    }

    fn display(&self) -> String {
        match &self.root {
            Root::Dir(dir) => dir.display().to_string(),
            Root::Bucket(objects) => objects.display().to_string(),
        }
    }

    fn error(&self, table: &str) -> impl FnOnce(DeltaTableError) -> DeltaError + '_ {
        let table = table.to_string();
        move |source| DeltaError {
            table,
            lake: self.display(),
            source: Box::new(source),
        }
    }

    /// The log store of the table in `relative` (a directory of the lake; in a directory lake,
    /// one that exists).
    pub fn log_store(&self, relative: &str) -> Result<LogStoreRef, DeltaError> {
        let store = || -> Result<LogStoreRef, DeltaTableError> {
            match &self.root {
                Root::Dir(dir) => {
                    let path = dir.join(relative);
                    let url = url::Url::from_directory_path(&path).map_err(|()| {
                        DeltaTableError::InvalidTableLocation(path.display().to_string())
                    })?;
                    deltalake_core::logstore::logstore_for(&url, StorageConfig::default())
                }
                Root::Bucket(objects) => {
                    let url = url::Url::parse(&objects.dir_url(Path::new(relative)))
                        .map_err(|e| DeltaTableError::InvalidTableLocation(e.to_string()))?;
                    let root = objects.store();
                    let prefixed: Arc<dyn object_store::ObjectStore> =
                        Arc::new(object_store::prefix::PrefixStore::new(
                            Arc::clone(&root),
                            objects.key(Path::new(relative)),
                        ));
                    Ok(deltalake_core::logstore::default_logstore(
                        prefixed,
                        root,
                        &url,
                        &StorageConfig::default(),
                    ))
                }
            }
        };
        store().map_err(self.error(relative))
    }

    /// The table in `relative` at `as_of`, or `None` while nothing has created it.
    pub async fn load(
        &self,
        relative: &str,
        as_of: AsOf,
    ) -> Result<Option<DeltaTable>, DeltaError> {
        if let Root::Dir(dir) = &self.root {
            // Reading creates nothing: no directory, no table.
            if !dir.join(relative).is_dir() {
                return Ok(None);
            }
        }
        let log_store = self.log_store(relative)?;
        if !log_store
            .is_delta_table_location()
            .await
            .map_err(self.error(relative))?
        {
            return Ok(None);
        }
        let mut table = DeltaTable::new(log_store);
        let loaded = match as_of {
            AsOf::Latest => table.load().await,
            AsOf::Version(n) => table.load_version(n).await,
            AsOf::Time(ms) => match chrono::DateTime::from_timestamp_millis(ms) {
                Some(time) => table.load_with_datetime(time).await,
                None => Err(DeltaTableError::Generic(format!("{ms} ms is out of range"))),
            },
        };
        loaded.map_err(self.error(relative))?;
        Ok(Some(table))
    }

    /// The table in `relative` at its latest version, or `None` while nothing has created it;
    /// brought up to date from the last time this handle read it.
    async fn latest(&self, relative: &str) -> Result<Option<DeltaTable>, DeltaError> {
        let slot = {
            let mut latest = self
                .latest
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(latest.entry(relative.to_string()).or_default())
        };
        let mut table = slot.lock().await;
        if let Some(table) = table.as_mut() {
            table
                .update_incremental(None)
                .await
                .map_err(self.error(relative))?;
        } else {
            *table = self.load(relative, AsOf::Latest).await?;
        }
        Ok(table.clone())
    }

    /// The table in `relative`, created with `schema` if nothing has created it yet (by this
    /// process or another: of two creators one writes version 0 and the other loads it).
    async fn open_or_create(
        &self,
        relative: &str,
        schema: &Schema,
    ) -> Result<DeltaTable, DeltaError> {
        if let Some(table) = self.load(relative, AsOf::Latest).await? {
            return Ok(table);
        }
        let columns = StructType::try_from_arrow(schema)
            .map_err(|e| DeltaTableError::Generic(format!("the table's schema: {e}")))
            .map_err(self.error(relative))?;
        if let Root::Dir(dir) = &self.root {
            let path = dir.join(relative);
            std::fs::create_dir_all(&path)
                .map_err(|e| DeltaTableError::Generic(format!("creating {}: {e}", path.display())))
                .map_err(self.error(relative))?;
        }
        let log_store = self.log_store(relative)?;
        let created = DeltaTable::new(Arc::clone(&log_store))
            .create()
            .with_columns(columns.fields().cloned())
            .with_table_name(relative.rsplit('/').next().unwrap_or(relative))
            .with_configuration_property(
                TableProperty::DeletedFileRetentionDuration,
                Some(KEEP_REMOVED),
            )
            .await;
        match created {
            Ok(table) => Ok(table),
            // Another process created it first.
            Err(_) if log_store.is_delta_table_location().await.unwrap_or(false) => self
                .load(relative, AsOf::Latest)
                .await?
                .ok_or_else(|| DeltaTableError::NotATable(relative.to_string()))
                .map_err(self.error(relative)),
            Err(e) => Err(self.error(relative)(e)),
        }
    }

    /// Replaces the rows of one hour of the table in `relative` with `batch` (none when it is
    /// `None` or empty), in one commit: the table's files of that hour are removed and the new
    /// one added. `hour` is the hour's column and its start (Unix epoch milliseconds); `None`
    /// replaces every row. Returns the version committed.
    pub async fn replace(
        &self,
        relative: &str,
        schema: &Schema,
        hour: Option<(&str, i64)>,
        batch: Option<&RecordBatch>,
    ) -> Result<u64, DeltaError> {
        let mut open = self.open.lock().await;
        let mut table = match open.remove(relative) {
            Some(mut table) => {
                table
                    .update_incremental(None)
                    .await
                    .map_err(self.error(relative))?;
                table
            }
            None => self.open_or_create(relative, schema).await?,
        };
        let stored = stored_schema(schema).map_err(self.error(relative))?;
        let prefix = hour.map(|(_, start)| file_prefix(start));
        let now = now_ms();
        let mut actions: Vec<Action> = Vec::new();
        {
            let state = table.snapshot().map_err(self.error(relative))?;
            for file in state.log_data().iter() {
                let path = file.path();
                if prefix.as_ref().is_none_or(|p| path.starts_with(p.as_str())) {
                    actions.push(Action::Remove(Remove {
                        path: path.into_owned(),
                        data_change: true,
                        deletion_timestamp: Some(now),
                        extended_file_metadata: Some(true),
                        partition_values: Some(HashMap::new()),
                        size: Some(file.size()),
                        ..Default::default()
                    }));
                }
            }
        }
        if let Some(batch) = batch.filter(|b| b.num_rows() > 0) {
            let batch = conform(&stored, batch, &[])
                .map_err(|e| DeltaTableError::Generic(e.to_string()))
                .map_err(self.error(relative))?;
            let name = format!(
                "{}{}.parquet",
                prefix.as_deref().unwrap_or(""),
                uuid::Uuid::new_v4()
            );
            let bytes = crate::lake::encode(&batch, Path::new(&name))
                .map_err(|e| DeltaTableError::Generic(e.to_string()))
                .map_err(self.error(relative))?;
            let size = bytes.len() as i64;
            table
                .log_store()
                .object_store(None)
                .put(&object_store::path::Path::from(name.as_str()), bytes.into())
                .await
                .map_err(|e| self.error(relative)(DeltaTableError::ObjectStore { source: e }))?;
            actions.push(Action::Add(Add {
                path: name,
                partition_values: HashMap::new(),
                size,
                modification_time: now,
                data_change: true,
                stats: Some(stats(&batch, hour)),
                ..Default::default()
            }));
        }
        if actions.is_empty() {
            let version = table.version().unwrap_or(0);
            open.insert(relative.to_string(), table);
            return Ok(version);
        }
        let predicate = hour.map(|(column, start)| format!("{column} = '{}'", iso(start)));
        let operation = DeltaOperation::Write {
            mode: SaveMode::Overwrite,
            partition_by: None,
            predicate,
        };
        let state = table.snapshot().map_err(self.error(relative))?;
        let committed = CommitBuilder::from(CommitProperties::default())
            .with_actions(actions)
            .build(Some(state), table.log_store(), operation)
            .await
            .map_err(self.error(relative))?;
        let version = committed.version();
        table
            .update_incremental(Some(version))
            .await
            .map_err(self.error(relative))?;
        open.insert(relative.to_string(), table);
        Ok(version)
    }

    /// The version of each table (by directory) that the last query through this handle read
    /// it at: what a FOCUS export records, so that `gpuwarden sql --as-of <version>` computes it
    /// again.
    pub fn versions_read(&self) -> std::collections::BTreeMap<String, u64> {
        self.read
            .lock()
            .map(|read| read.clone())
            .unwrap_or_default()
    }

    /// Deletes the files of the table in `relative` that commits removed more than
    /// [`KEEP_REMOVED`] ago (Delta's VACUUM, from the log's tombstones: nothing is listed), at
    /// most once an hour through this handle. Returns how many went.
    pub async fn vacuum(&self, relative: &str) -> Result<usize, DeltaError> {
        let mut vacuumed = self.vacuumed.lock().await;
        if vacuumed
            .get(relative)
            .is_some_and(|at| at.elapsed() < VACUUM_EVERY)
        {
            return Ok(0);
        }
        let Some(table) = self.latest(relative).await? else {
            return Ok(0);
        };
        let (_, metrics) = table
            .vacuum()
            .with_mode(VacuumMode::Lite)
            .await
            .map_err(self.error(relative))?;
        vacuumed.insert(relative.to_string(), std::time::Instant::now());
        Ok(metrics.files_deleted.len())
    }

    /// Registers the table in `relative` as `name` in `ctx`, read at `as_of` (with
    /// [`AsOf::Latest`], every query plans over the latest commit) and with `schema`, its
    /// declared types (which its stored ones cast to).
    pub fn register(
        &self,
        ctx: &datafusion::prelude::SessionContext,
        name: &str,
        relative: &str,
        schema: &Schema,
        as_of: AsOf,
    ) -> Result<(), DataFusionError> {
        ctx.register_table(
            name,
            Arc::new(LiveTable {
                tables: self.clone(),
                relative: relative.to_string(),
                schema: Arc::new(schema.clone()),
                as_of,
            }),
        )?;
        Ok(())
    }
}

/// The schema a table's rows have in its files and when read: the table's, as Delta's types
/// give it back (timestamps in microseconds).
pub fn stored_schema(schema: &Schema) -> Result<SchemaRef, DeltaTableError> {
    let columns = StructType::try_from_arrow(schema)
        .map_err(|e| DeltaTableError::Generic(format!("the table's schema: {e}")))?;
    let arrow = Schema::try_from_kernel(&columns)
        .map_err(|e| DeltaTableError::Generic(format!("the table's schema: {e}")))?;
    Ok(Arc::new(arrow))
}

/// `batch`'s columns in `schema`'s order and types, with the columns it lacks filled from
/// `constants`: the rollups' rows as their tables declare them, and a table's rows as Delta
/// stores them.
pub(crate) fn conform(
    schema: &SchemaRef,
    batch: &RecordBatch,
    constants: &[(&str, ScalarValue)],
) -> Result<RecordBatch, DataFusionError> {
    let rows = batch.num_rows();
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            let column: ArrayRef = match batch.column_by_name(field.name()) {
                Some(column) => Arc::clone(column),
                None => constants
                    .iter()
                    .find(|(name, _)| name == field.name())
                    .ok_or_else(|| {
                        DataFusionError::Internal(format!("column {} has no value", field.name()))
                    })?
                    .1
                    .to_array_of_size(rows)?,
            };
            Ok(if column.data_type() == field.data_type() {
                column
            } else {
                cast(&column, field.data_type())?
            })
        })
        .collect::<Result<Vec<_>, DataFusionError>>()?;
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

/// The date and hour of the hour starting at `hour_ms`: `("2026-12-06", 8)`.
fn date_and_hour(hour_ms: i64) -> (String, i64) {
    let (y, m, d) = civil_from_days(hour_ms.div_euclid(86_400_000));
    (
        format!("{y:04}-{m:02}-{d:02}"),
        hour_ms.rem_euclid(86_400_000) / 3_600_000,
    )
}

/// How the names of an hour's files begin: `2026-12-06T08-`.
fn file_prefix(hour_ms: i64) -> String {
    let (date, hour) = date_and_hour(hour_ms);
    format!("{date}T{hour:02}-")
}

/// An hour as Delta writes a timestamp: `2026-12-06T08:00:00.000Z`.
fn iso(hour_ms: i64) -> String {
    let (date, hour) = date_and_hour(hour_ms);
    format!("{date}T{hour:02}:00:00.000Z")
}

/// The file's statistics in the log: its rows, and for an hour's file the hour (every row's),
/// so readers skip the other hours' files.
fn stats(batch: &RecordBatch, hour: Option<(&str, i64)>) -> String {
    let mut stats = serde_json::json!({ "numRecords": batch.num_rows() });
    if let Some((column, start)) = hour {
        let value = iso(start);
        stats["minValues"] = serde_json::json!({ column: value });
        stats["maxValues"] = serde_json::json!({ column: value });
        stats["nullCount"] = serde_json::json!({ column: 0 });
    }
    stats.to_string()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A Delta table as a session's table: each scan plans over the version [`AsOf`] names, the
/// latest one when the query is planned by default; a table nothing has created yet has no
/// rows.
struct LiveTable {
    tables: DeltaTables,
    relative: String,
    schema: SchemaRef,
    as_of: AsOf,
}

impl fmt::Debug for LiveTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LiveTable({}, {:?})", self.relative, self.as_of)
    }
}

#[async_trait]
impl TableProvider for LiveTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>, DataFusionError> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        session: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let external = |e: DeltaError| DataFusionError::External(Box::new(e));
        let as_of = match self.as_of {
            AsOf::Latest => session_as_of(),
            named => named,
        };
        let table = match as_of {
            AsOf::Latest => self.tables.latest(&self.relative).await,
            named => self.tables.load(&self.relative, named).await,
        };
        let Some(table) = table.map_err(external)? else {
            let schema = match projection {
                Some(p) => Arc::new(self.schema.project(p)?),
                None => Arc::clone(&self.schema),
            };
            return Ok(Arc::new(EmptyExec::new(schema)));
        };
        table
            .update_datafusion_session(session)
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        let state = table
            .snapshot()
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        if let Ok(mut read) = self.tables.read.lock() {
            read.insert(self.relative.clone(), state.version());
        }
        // Read as the table is declared (timestamps in milliseconds, plain strings), as every
        // table of the lake is: Delta's own types are microseconds, and DataFusion reads
        // strings as views unless told otherwise.
        let mut config = DeltaScanConfig::new().with_schema(Arc::clone(&self.schema));
        config.schema_force_view_types = false;
        let scan = DeltaScanNext::new(state.snapshot().clone(), config)?;
        scan.scan(session, projection, filters, limit).await
    }
}
