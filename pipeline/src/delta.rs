//! The lake's Delta tables (docs/src/contributors/lake.md#delta-tables): where each one's transaction log
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

use std::collections::{BTreeMap, BTreeSet, HashMap};
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
use deltalake_core::kernel::{
    Action, Add, MetadataExt as _, Remove, StructField, StructType, Transaction,
};
use deltalake_core::logstore::{LogStoreRef, StorageConfig};
use deltalake_core::operations::vacuum::VacuumMode;
use deltalake_core::protocol::{DeltaOperation, SaveMode};
use deltalake_core::{DeltaTable, DeltaTableError, TableProperty};
use gpuwarden_schema::calendar::civil_from_days;
use gpuwarden_schema::clock::wall_now_ms;
use object_store::ObjectStoreExt as _;
use tokio::sync::Mutex;

use crate::base::is_conflict;
pub use crate::base::DeltaError;
use crate::objects::ObjectLake;

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
    /// commit reads only the log written since the last one. A lock per table: writers of
    /// different tables commit side by side.
    open: Arc<std::sync::Mutex<HashMap<String, Slot>>>,
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

/// How often [`DeltaTables::vacuum`] lists a table for files no commit names, per table.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

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
            open: Arc::default(),
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
                    let root = objects.client();
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
        let slot = self.writer_slot(relative);
        let mut open = slot.lock().await;
        let table = self.writable(&mut open, relative, schema).await?;
        let stored = stored_schema(schema).map_err(self.error(relative))?;
        let prefix = hour.map(|(_, start)| file_prefix(start));
        let now = wall_now_ms();
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
            let name = format!(
                "{}{}.parquet",
                prefix.as_deref().unwrap_or(""),
                uuid::Uuid::new_v4()
            );
            let add = self.put_rows(relative, &stored, name, batch, hour).await?;
            actions.push(Action::Add(add));
        }
        if actions.is_empty() {
            return Ok(table.version().unwrap_or(0));
        }
        let predicate = hour.map(|(column, start)| format!("{column} = '{}'", iso(start)));
        let operation = DeltaOperation::Write {
            mode: SaveMode::Overwrite,
            partition_by: None,
            predicate,
        };
        commit(table, actions, operation)
            .await
            .map_err(self.error(relative))
    }

    /// The writer's slot of the table in `relative`.
    fn writer_slot(&self, relative: &str) -> Slot {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Arc::clone(open.entry(relative.to_string()).or_default())
    }

    /// The table a slot holds, brought up to date, or opened (created with `schema` if nothing
    /// has created it yet).
    async fn writable<'s>(
        &self,
        slot: &'s mut Option<DeltaTable>,
        relative: &str,
        schema: &Schema,
    ) -> Result<&'s mut DeltaTable, DeltaError> {
        match slot {
            Some(table) => table
                .update_incremental(None)
                .await
                .map_err(self.error(relative))?,
            None => *slot = Some(self.open_or_create(relative, schema).await?),
        }
        let table = slot.as_mut().expect("set above");
        self.evolve(table, relative, schema).await?;
        Ok(table)
    }

    /// Adds to the table's schema the columns of `schema` that it lacks, in one commit (a
    /// Delta `ADD COLUMN`), before anything writes rows that have them: a table created by an
    /// earlier gpuwarden takes the columns its records or rows gained since, and its files
    /// written before read as nulls there, to gpuwarden and every Delta reader. A column added
    /// must be nullable (the rows before it have none); one that is not is refused, naming
    /// it. Of two writers adding the same columns at once, one commits and the other finds
    /// them there when it reads the table again.
    async fn evolve(
        &self,
        table: &mut DeltaTable,
        relative: &str,
        schema: &Schema,
    ) -> Result<(), DeltaError> {
        let declared = StructType::try_from_arrow(schema)
            .map_err(|e| DeltaTableError::Generic(format!("the table's schema: {e}")))
            .map_err(self.error(relative))?;
        let mut attempt = 0;
        loop {
            let state = table.snapshot().map_err(self.error(relative))?;
            let stored = state.schema();
            let missing: Vec<StructField> = declared
                .fields()
                .filter(|f| stored.field(f.name()).is_none())
                .cloned()
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if let Some(field) = missing.iter().find(|f| !f.is_nullable()) {
                return Err(self.error(relative)(DeltaTableError::Generic(format!(
                    "column {} is not in the table, and cannot be added: it is not nullable, \
                     and the rows the table holds have no value for it",
                    field.name()
                ))));
            }
            let merged = StructType::try_new(stored.fields().cloned().chain(missing.clone()))
                .map_err(|e| DeltaTableError::Generic(format!("the table's schema: {e}")))
                .map_err(self.error(relative))?;
            let metadata = state
                .metadata()
                .clone()
                .with_schema(&merged)
                .map_err(DeltaTableError::from)
                .map_err(self.error(relative))?;
            let operation = DeltaOperation::AddColumn {
                fields: missing.clone(),
            };
            match commit(table, vec![Action::Metadata(metadata)], operation).await {
                Ok(version) => {
                    tracing::info!(
                        table = relative,
                        version,
                        columns = %missing.iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", "),
                        "added columns to a table"
                    );
                    return Ok(());
                }
                // Another writer changed the table first (likely adding the same columns):
                // read it again and look.
                Err(_) if attempt < 3 => {
                    attempt += 1;
                    table
                        .update_incremental(None)
                        .await
                        .map_err(self.error(relative))?;
                }
                Err(e) => return Err(self.error(relative)(e)),
            }
        }
    }

    /// Appends new rows to the table in `relative` (a raw table: `schema` is how its rows are
    /// stored), in one commit: each of `files` is an hour's rows, put as its own file, named
    /// `<YYYY-MM-DD>T<HH>-<tag>-<uuid>.parquet`.
    ///
    /// With `txn`, the commit is exactly once for a source read in order (a Kafka partition):
    /// it carries a Delta transaction action, app id `txn.app_id` and version `txn.last` (the
    /// source's last offset in it), and of each file's rows, whose offsets (ascending) are in
    /// `offsets`, only those after the version the table already holds for that app id go in.
    /// A concurrent commit for the same app id makes this one fail Delta's conflict check; it
    /// is then filtered again against what landed and retried. So a range read twice, by a
    /// restarted consumer or by two owners of one partition at once, lands once.
    pub async fn append(
        &self,
        relative: &str,
        schema: &Schema,
        tag: &str,
        files: &[NewFile<'_>],
        txn: Option<&AppTxn>,
    ) -> Result<Appended, DeltaError> {
        let slot = self.writer_slot(relative);
        let mut open = slot.lock().await;
        let mut attempt = 0;
        loop {
            let table = self.writable(&mut open, relative, schema).await?;
            let held = match txn {
                Some(txn) => self.held(table, relative, &txn.app_id).await?,
                None => None,
            };
            if let (Some(txn), Some(held)) = (txn, held) {
                if held >= txn.last {
                    return Ok(Appended::AlreadyThere { held });
                }
            }
            let mut adds = Vec::new();
            let mut rows = 0;
            for file in files {
                let skip = match (held, file.offsets) {
                    (Some(held), Some(offsets)) => offsets.partition_point(|o| *o <= held),
                    _ => 0,
                };
                if skip >= file.batch.num_rows() {
                    continue;
                }
                let batch = file.batch.slice(skip, file.batch.num_rows() - skip);
                rows += batch.num_rows();
                adds.push(
                    self.put_batch(relative, data_file_name(file.hour_ms, tag), &batch, None)
                        .await?,
                );
            }
            let mut actions: Vec<Action> = adds.iter().cloned().map(Action::Add).collect();
            actions.extend(txn.map(txn_action));
            if actions.is_empty() {
                return Ok(Appended::Committed {
                    version: table.version().unwrap_or(0),
                    rows: 0,
                    files: 0,
                    bytes: 0,
                });
            }
            let operation = append_operation();
            match commit(table, actions, operation).await {
                Ok(version) => {
                    return Ok(Appended::Committed {
                        version,
                        rows,
                        files: adds.len(),
                        bytes: adds.iter().map(|a| a.size).sum(),
                    })
                }
                Err(e) if txn.is_some() && attempt < 5 && is_conflict(&e) => {
                    // Another commit for the same source landed first: what it holds is
                    // left out on the next try. The files put for this one go.
                    attempt += 1;
                    tracing::info!(table = relative, error = %e, "a concurrent commit of the same source landed first; filtering again");
                    self.delete_uncommitted(table, &adds).await;
                }
                Err(e) => {
                    self.delete_uncommitted(table, &adds).await;
                    return Err(self.error(relative)(e));
                }
            }
        }
    }

    /// Deletes files put for a commit that did not land (best effort: a file no commit names
    /// is never read, and VACUUM removes it).
    async fn delete_uncommitted(&self, table: &DeltaTable, adds: &[Add]) {
        let store = table.log_store().object_store(None);
        for add in adds {
            let _ = store
                .delete(&object_store::path::Path::from(add.path.as_str()))
                .await;
        }
    }

    /// Puts the finished Parquet file `local` (rows of `hour_ms`, encoded with the lake's
    /// settings) in the table's directory, not committed yet, and removes it; returns the
    /// `add` that commits it. In a bucket a file over 16 MiB goes up as a multipart upload.
    pub async fn put_local_file(
        &self,
        relative: &str,
        schema: &Schema,
        local: &Path,
        hour_ms: i64,
        tag: &str,
        data_change: bool,
    ) -> Result<Add, DeltaError> {
        let name = data_file_name(hour_ms, tag);
        let generic = |e: String| self.error(relative)(DeltaTableError::Generic(e));
        let file = std::fs::File::open(local)
            .map_err(|e| generic(format!("opening {}: {e}", local.display())))?;
        let metadata = parquet::file::metadata::ParquetMetaDataReader::new()
            .parse_and_finish(&file)
            .map_err(|e| generic(format!("reading {}: {e}", local.display())))?;
        let stats = stats_of(&metadata, schema);
        let size = file
            .metadata()
            .map_err(|e| generic(format!("reading {}: {e}", local.display())))?
            .len();
        drop(file);
        match &self.root {
            Root::Dir(dir) => {
                let table_dir = dir.join(relative);
                std::fs::create_dir_all(&table_dir)
                    .map_err(|e| generic(format!("creating {}: {e}", table_dir.display())))?;
                let target = table_dir.join(&name);
                if std::fs::rename(local, &target).is_err() {
                    // Another filesystem: copy, then remove.
                    std::fs::copy(local, &target)
                        .map_err(|e| generic(format!("copying to {}: {e}", target.display())))?;
                    let _ = std::fs::remove_file(local);
                }
                self.sync_file(relative, &target)?;
            }
            Root::Bucket(objects) => {
                let key = Path::new(relative).join(&name);
                let (objects, local_owned) = (objects.clone(), local.to_path_buf());
                tokio::task::spawn_blocking(move || objects.put_file(&key, &local_owned))
                    .await
                    .map_err(|e| generic(e.to_string()))?
                    .map_err(|e| generic(e.to_string()))?;
                let _ = std::fs::remove_file(local);
            }
        }
        Ok(add(name, size as i64, stats, data_change))
    }

    /// Sets the version the table in `relative` holds for `app_id` to -1, in a commit of its
    /// own, so that every offset counts as new: for a source whose offsets start again from 0
    /// (a Kafka partition deleted and created again).
    pub async fn forget_txn(
        &self,
        relative: &str,
        schema: &Schema,
        app_id: &str,
    ) -> Result<(), DeltaError> {
        let txn = Transaction::new_with_last_update(app_id, -1, Some(wall_now_ms()));
        self.commit_append(relative, schema, vec![Action::Txn(txn)])
            .await
            .map(|_| ())
    }

    /// Commits `actions` to the table in `relative` (created with `schema` if nothing has) as
    /// an append, through the table's writer.
    async fn commit_append(
        &self,
        relative: &str,
        schema: &Schema,
        actions: Vec<Action>,
    ) -> Result<u64, DeltaError> {
        let slot = self.writer_slot(relative);
        let mut open = slot.lock().await;
        let table = self.writable(&mut open, relative, schema).await?;
        commit(table, actions, append_operation())
            .await
            .map_err(self.error(relative))
    }

    /// Deletes the data file `path` of the table in `relative`, which no commit names.
    pub async fn delete_file(&self, relative: &str, path: &str) -> Result<(), DeltaError> {
        let log_store = self.log_store(relative)?;
        match log_store
            .object_store(None)
            .delete(&object_store::path::Path::from(path))
            .await
        {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(relative)(DeltaTableError::ObjectStore {
                source: e,
            })),
        }
    }

    /// Commits files that are in the table's directory already (`path` relative to it, its
    /// size and Parquet footer) as an append, in one commit: how `gpuwarden lake migrate` moves
    /// the old layout's files into the log where they lie.
    pub async fn adopt(
        &self,
        relative: &str,
        schema: &Schema,
        files: Vec<(String, i64, Arc<parquet::file::metadata::ParquetMetaData>)>,
    ) -> Result<u64, DeltaError> {
        let actions = files
            .into_iter()
            .map(|(path, size, metadata)| {
                Action::Add(add(path, size, stats_of(&metadata, schema), true))
            })
            .collect();
        self.commit_append(relative, schema, actions).await
    }

    /// Encodes `batch` (rows as the table stores them) and puts it as the data file `name` of
    /// the table in `relative`, not committed yet; returns the `add` that commits it. Its
    /// statistics: with `hour` (a rollup table's hour column and the hour's start), the rows and
    /// the hour; without, those of its footer ([`stats_of`]).
    async fn put_batch(
        &self,
        relative: &str,
        name: String,
        batch: &RecordBatch,
        hour: Option<(&str, i64)>,
    ) -> Result<Add, DeltaError> {
        let generic = |e: String| self.error(relative)(DeltaTableError::Generic(e));
        let bytes = bytes::Bytes::from(
            crate::base::encode(batch, Path::new(&name)).map_err(|e| generic(e.to_string()))?,
        );
        let stats = match hour {
            Some(_) => stats(batch, hour),
            None => parquet_stats(&bytes, &batch.schema())
                .map_err(|e| generic(format!("reading back {name}: {e}")))?,
        };
        let size = bytes.len() as i64;
        self.put(relative, &name, bytes).await?;
        Ok(add(name, size, stats, true))
    }

    /// Puts `bytes` as the file `name` of the table in `relative` (creating a directory
    /// lake's table directory). In a directory the file and its directory entry are synced
    /// before this returns, so a commit that names it never outlives it on a machine that loses
    /// power (a PUT's success is durable in a bucket).
    async fn put(&self, relative: &str, name: &str, bytes: bytes::Bytes) -> Result<(), DeltaError> {
        if let Root::Dir(dir) = &self.root {
            let path = dir.join(relative);
            std::fs::create_dir_all(&path)
                .map_err(|e| DeltaTableError::Generic(format!("creating {}: {e}", path.display())))
                .map_err(self.error(relative))?;
        }
        self.log_store(relative)?
            .object_store(None)
            .put(&object_store::path::Path::from(name), bytes.into())
            .await
            .map_err(|e| self.error(relative)(DeltaTableError::ObjectStore { source: e }))?;
        if let Root::Dir(dir) = &self.root {
            self.sync_file(relative, &dir.join(relative).join(name))?;
        }
        Ok(())
    }

    /// Syncs the file `path` of the table in `relative`, a directory lake's, and its directory.
    fn sync_file(&self, relative: &str, path: &Path) -> Result<(), DeltaError> {
        let synced = std::fs::File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("syncing {}: {e}", path.display()))
            .and_then(|()| match path.parent() {
                Some(dir) => crate::base::sync_dir(dir).map_err(|e| e.to_string()),
                None => Ok(()),
            });
        synced
            .map_err(DeltaTableError::Generic)
            .map_err(self.error(relative))
    }

    /// Puts `batch` (a rollup table's rows, conformed to `stored`, its stored schema) as the
    /// data file `name` of the table in `relative`, not committed yet; returns its `add`.
    /// `hour`: as [`DeltaTables::replace`] takes it.
    pub async fn put_rows(
        &self,
        relative: &str,
        stored: &SchemaRef,
        name: String,
        batch: &RecordBatch,
        hour: Option<(&str, i64)>,
    ) -> Result<Add, DeltaError> {
        let batch = conform(stored, batch, &[])
            .map_err(|e| DeltaTableError::Generic(e.to_string()))
            .map_err(self.error(relative))?;
        self.put_batch(relative, name, &batch, hour).await
    }

    /// The bytes of the file `path` of the table in `relative`.
    pub async fn read_file(&self, relative: &str, path: &str) -> Result<bytes::Bytes, DeltaError> {
        let store_error = |e| self.error(relative)(DeltaTableError::ObjectStore { source: e });
        self.log_store(relative)?
            .object_store(None)
            .get(&object_store::path::Path::from(path))
            .await
            .map_err(store_error)?
            .bytes()
            .await
            .map_err(store_error)
    }

    /// Puts `bytes` as the file `path` of the table in `relative`, not committed, unless a
    /// file of their size is there already (put by a move that stopped before its commit).
    pub async fn put_missing(
        &self,
        relative: &str,
        path: &str,
        bytes: bytes::Bytes,
    ) -> Result<(), DeltaError> {
        let there = match &self.root {
            Root::Dir(dir) => dir
                .join(relative)
                .join(path)
                .metadata()
                .ok()
                .map(|m| m.len()),
            Root::Bucket(_) => self
                .log_store(relative)?
                .object_store(None)
                .head(&object_store::path::Path::from(path))
                .await
                .ok()
                .map(|m| m.size),
        };
        if there == Some(bytes.len() as u64) {
            return Ok(());
        }
        self.put(relative, path, bytes).await
    }

    /// The table in `relative` at `as_of` as a move copies it: each file's `add` (with its
    /// statistics) and the version each source (transaction app id) holds. `None` while
    /// nothing created it.
    pub async fn snapshot(
        &self,
        relative: &str,
        as_of: AsOf,
    ) -> Result<Option<TableSnapshot>, DeltaError> {
        let Some(table) = self.load(relative, as_of).await? else {
            return Ok(None);
        };
        let state = table.snapshot().map_err(self.error(relative))?;
        let version = state.version();
        #[allow(deprecated)] // The add, with its statistics, is what a move commits again.
        let adds = state.log_data().iter().map(|f| f.add_action()).collect();
        let txns = self.app_txns(&table, relative, version).await?;
        Ok(Some(TableSnapshot {
            version,
            adds,
            txns,
        }))
    }

    /// Every transaction (app id and version) the table holds at `version`, from its log: the
    /// last checkpoint at or before it, then the commits after. (delta-rs answers one app id at
    /// a time, and a move does not know them all.)
    async fn app_txns(
        &self,
        table: &DeltaTable,
        relative: &str,
        version: u64,
    ) -> Result<std::collections::BTreeMap<String, i64>, DeltaError> {
        use futures::TryStreamExt as _;
        let failed = |e: String| self.error(relative)(DeltaTableError::Generic(e));
        let store = table.log_store().object_store(None);
        let log = object_store::path::Path::from("_delta_log");
        let mut checkpoints: std::collections::BTreeMap<u64, Vec<object_store::path::Path>> =
            std::collections::BTreeMap::new();
        let listed: Vec<_> = store
            .list(Some(&log))
            .try_collect()
            .await
            .map_err(|e| failed(format!("listing the log: {e}")))?;
        for meta in listed {
            let name = meta.location.filename().unwrap_or_default();
            if let Some((v, rest)) = name.split_once(".checkpoint") {
                if let (Ok(v), true) = (v.parse::<u64>(), rest.ends_with(".parquet")) {
                    if v <= version {
                        checkpoints
                            .entry(v)
                            .or_default()
                            .push(meta.location.clone());
                    }
                }
            }
        }
        let mut txns = std::collections::BTreeMap::new();
        let mut from = 0;
        if let Some((v, parts)) = checkpoints.into_iter().next_back() {
            from = v + 1;
            for part in parts {
                let read = match store.get(&part).await {
                    Ok(got) => got.bytes().await,
                    Err(e) => Err(e),
                };
                let bytes = read.map_err(|e| failed(format!("reading {part}: {e}")))?;
                checkpoint_txns(bytes, &mut txns)
                    .map_err(|e| failed(format!("reading {part}: {e}")))?;
            }
        }
        for v in from..=version {
            let Some(actions) = self.commit_actions(table, relative, v).await? else {
                return Err(failed(format!(
                    "commit {v} is missing from the log, and no checkpoint covers it"
                )));
            };
            for action in actions {
                if let Some(txn) = action.get("txn") {
                    if let (Some(app), Some(n)) = (
                        txn.get("appId").and_then(serde_json::Value::as_str),
                        txn.get("version").and_then(serde_json::Value::as_i64),
                    ) {
                        txns.insert(app.to_string(), n);
                    }
                }
            }
        }
        Ok(txns)
    }

    /// The actions of commit `version` of `table` (the table in `relative`), one JSON object
    /// each; `None` when the log no longer has it. A line that is not JSON is an error naming
    /// the commit.
    async fn commit_actions(
        &self,
        table: &DeltaTable,
        relative: &str,
        version: u64,
    ) -> Result<Option<Vec<serde_json::Value>>, DeltaError> {
        let Some(bytes) = table
            .log_store()
            .read_commit_entry(version)
            .await
            .map_err(self.error(relative))?
        else {
            return Ok(None);
        };
        bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|line| {
                serde_json::from_slice(line)
                    .map_err(|e| DeltaTableError::Generic(format!("commit {version}: {e}")))
                    .map_err(self.error(relative))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// The first version of the table in `relative` whose commit carries a transaction of
    /// `app_id`, read from its commits in order; `None` when none does, or the log no longer
    /// reaches back to it.
    pub async fn version_with_txn(
        &self,
        relative: &str,
        app_id: &str,
    ) -> Result<Option<u64>, DeltaError> {
        let Some(table) = self.latest(relative).await? else {
            return Ok(None);
        };
        for version in 0..=table.version().unwrap_or(0) {
            let Some(actions) = self.commit_actions(&table, relative, version).await? else {
                return Ok(None);
            };
            for action in actions {
                if action
                    .get("txn")
                    .and_then(|t| t.get("appId"))
                    .and_then(serde_json::Value::as_str)
                    == Some(app_id)
                {
                    return Ok(Some(version));
                }
            }
        }
        Ok(None)
    }

    /// Commits `adds` (files put with [`DeltaTables::put_missing`] or
    /// [`DeltaTables::put_rows`]) with the transactions `txns` (app id, version) to the table
    /// in `relative`, in one commit: how a move lands a table at its new location.
    pub async fn commit_moved(
        &self,
        relative: &str,
        schema: &Schema,
        adds: Vec<Add>,
        txns: &std::collections::BTreeMap<String, i64>,
    ) -> Result<u64, DeltaError> {
        let mut actions: Vec<Action> = adds.into_iter().map(Action::Add).collect();
        actions.extend(txns.iter().map(|(app, version)| {
            txn_action(&AppTxn {
                app_id: app.clone(),
                last: *version,
            })
        }));
        self.commit_append(relative, schema, actions).await
    }

    /// The version the table in `relative` holds for the source `app_id` (the last offset or
    /// line committed with it), or `None`.
    pub async fn txn_version(
        &self,
        relative: &str,
        app_id: &str,
    ) -> Result<Option<i64>, DeltaError> {
        let Some(table) = self.latest(relative).await? else {
            return Ok(None);
        };
        self.held(&table, relative, app_id).await
    }

    /// The version `table` (as loaded) holds for the source `app_id`.
    async fn held(
        &self,
        table: &DeltaTable,
        relative: &str,
        app_id: &str,
    ) -> Result<Option<i64>, DeltaError> {
        table
            .snapshot()
            .map_err(self.error(relative))?
            .transaction_version(table.log_store().as_ref(), app_id)
            .await
            .map_err(self.error(relative))
    }

    /// Commits `adds` (files put with [`DeltaTables::put_local_file`]) to the table in
    /// `relative` as one append, with the transaction `txn` (app id, version) unless the table
    /// already holds that app id: then nothing is committed, the files are deleted and the
    /// answer is [`Appended::AlreadyThere`]. For inputs named by their content, so that the same
    /// content ingested twice lands once.
    pub async fn commit_adds(
        &self,
        relative: &str,
        schema: &Schema,
        adds: Vec<Add>,
        txn: Option<&AppTxn>,
    ) -> Result<Appended, DeltaError> {
        let slot = self.writer_slot(relative);
        let mut open = slot.lock().await;
        let table = self.writable(&mut open, relative, schema).await?;
        if let Some(txn) = txn {
            let held = self.held(table, relative, &txn.app_id).await?;
            if let Some(held) = held {
                self.delete_uncommitted(table, &adds).await;
                return Ok(Appended::AlreadyThere { held });
            }
        }
        let rows = adds.iter().map(rows_of).sum();
        let files = adds.len();
        let bytes = adds.iter().map(|a| a.size).sum();
        let mut actions: Vec<Action> = adds.iter().cloned().map(Action::Add).collect();
        actions.extend(txn.map(txn_action));
        let operation = append_operation();
        match commit(table, actions, operation).await {
            Ok(version) => Ok(Appended::Committed {
                version,
                rows,
                files,
                bytes,
            }),
            Err(e) => {
                self.delete_uncommitted(table, &adds).await;
                Err(self.error(relative)(e))
            }
        }
    }

    /// The files of the table in `relative` at `as_of` (`None` while nothing created it).
    pub async fn files(
        &self,
        relative: &str,
        as_of: AsOf,
    ) -> Result<Option<TableFiles>, DeltaError> {
        let table = match as_of {
            AsOf::Latest => self.latest(relative).await?,
            named => self.load(relative, named).await?,
        };
        let Some(table) = table else {
            return Ok(None);
        };
        let state = table.snapshot().map_err(self.error(relative))?;
        let files = state
            .log_data()
            .iter()
            .map(|file| {
                let path = file.path().into_owned();
                DataFile {
                    hour_ms: hour_of_file(&path),
                    ts_range: file.stats().as_deref().and_then(ts_range),
                    size: file.size(),
                    rows: file.num_records().map(|n| n as u64),
                    path,
                }
            })
            .collect();
        Ok(Some(TableFiles {
            version: state.version(),
            files,
        }))
    }

    /// The hours whose rows commits after `since` changed (files added with `dataChange`:
    /// new rows, not OPTIMIZE's rewrites), and the latest version, read from the commits
    /// themselves. `None` hours when the log no longer has them all (it keeps 30 days): the
    /// caller must take every hour as changed.
    pub async fn changed_hours(
        &self,
        relative: &str,
        since: Option<u64>,
    ) -> Result<Option<(u64, Option<BTreeSet<i64>>)>, DeltaError> {
        Ok(self
            .changes(relative, since)
            .await?
            .map(|(latest, changes)| (latest, changes.map(|c| c.added.into_keys().collect()))))
    }

    /// [`DeltaTables::changed_hours`], with what the added files' statistics say of each
    /// hour's new rows ([`Span`]), and the hours that lost rows (files removed with
    /// `dataChange`: retention's `DELETE`).
    pub async fn changes(
        &self,
        relative: &str,
        since: Option<u64>,
    ) -> Result<Option<(u64, Option<Changes>)>, DeltaError> {
        let Some(table) = self.latest(relative).await? else {
            return Ok(None);
        };
        let latest = table.version().unwrap_or(0);
        let Some(since) = since else {
            return Ok(Some((latest, None)));
        };
        let mut changes = Changes::default();
        for version in since + 1..=latest {
            let Some(actions) = self.commit_actions(&table, relative, version).await? else {
                return Ok(Some((latest, None)));
            };
            for action in actions {
                let (file, removed) = match (action.get("add"), action.get("remove")) {
                    (Some(add), _) => (add, false),
                    (None, Some(remove)) => (remove, true),
                    (None, None) => continue,
                };
                if file.get("dataChange").and_then(serde_json::Value::as_bool) == Some(false) {
                    continue;
                }
                let Some(hour) = file
                    .get("path")
                    .and_then(serde_json::Value::as_str)
                    .and_then(hour_of_file)
                else {
                    // A file not named by its hour: every hour may have changed.
                    return Ok(Some((latest, None)));
                };
                if removed {
                    changes.removed.insert(hour);
                    continue;
                }
                let span = file
                    .get("stats")
                    .and_then(serde_json::Value::as_str)
                    .and_then(Span::of_stats)
                    .unwrap_or(Span::UNKNOWN);
                changes
                    .added
                    .entry(hour)
                    .and_modify(|s| *s = s.union(span))
                    .or_insert(span);
            }
        }
        Ok(Some((latest, Some(changes))))
    }

    /// Replaces files of the table in `relative` by others holding the same rows (Delta's
    /// OPTIMIZE: removes and adds with `dataChange` false), in one commit. Fails, changing
    /// nothing, when a commit since `read` removed one of `removed` (retention, another
    /// OPTIMIZE); concurrent appends do not conflict.
    pub async fn rewrite(
        &self,
        relative: &str,
        read: u64,
        removed: &[DataFile],
        added: Vec<Add>,
        target_size: i64,
    ) -> Result<u64, DeltaError> {
        let now = wall_now_ms();
        let mut actions: Vec<Action> = removed
            .iter()
            .map(|file| Action::Remove(remove(&file.path, file.size, now, false)))
            .collect();
        actions.extend(added.iter().cloned().map(Action::Add));
        actions.push(maintenance_txn(read, now));
        let operation = DeltaOperation::Optimize {
            predicate: None,
            target_size,
        };
        let table = match self.load(relative, AsOf::Version(read)).await? {
            Some(table) => table,
            None => {
                return Err(self.error(relative)(DeltaTableError::NotATable(
                    relative.into(),
                )))
            }
        };
        match commit(&mut table.clone(), actions, operation).await {
            Ok(version) => Ok(version),
            Err(e) => {
                self.delete_uncommitted(&table, &added).await;
                Err(self.error(relative)(e))
            }
        }
    }

    /// Removes `files` from the table in `relative` (Delta's DELETE of whole files, as read at
    /// version `read`; VACUUM deletes them [`KEEP_REMOVED`] later), in one commit, described by
    /// `predicate`. Returns the version.
    pub async fn remove_files(
        &self,
        relative: &str,
        read: u64,
        files: &[DataFile],
        predicate: &str,
    ) -> Result<u64, DeltaError> {
        let now = wall_now_ms();
        let mut actions: Vec<Action> = files
            .iter()
            .map(|file| Action::Remove(remove(&file.path, file.size, now, true)))
            .collect();
        actions.push(maintenance_txn(read, now));
        let operation = DeltaOperation::Delete {
            predicate: Some(predicate.to_string()),
        };
        let Some(table) = self.load(relative, AsOf::Version(read)).await? else {
            return Err(self.error(relative)(DeltaTableError::NotATable(
                relative.into(),
            )));
        };
        commit(&mut table.clone(), actions, operation)
            .await
            .map_err(self.error(relative))
    }

    /// Registers the data files `paths` of the table in `relative` (as a version's log names
    /// them) as `name` in `ctx`, read as plain Parquet files with `schema`: for a job that knows
    /// which files it wants (an hour's, as their names say) and need not plan over the whole
    /// table. No files make an empty table. A bucket's store must be registered with `ctx`
    /// (`Lake::register_object_store`).
    pub fn register_files(
        &self,
        ctx: &datafusion::prelude::SessionContext,
        name: &str,
        relative: &str,
        paths: &[&str],
        schema: SchemaRef,
    ) -> Result<(), DataFusionError> {
        use datafusion::datasource::file_format::parquet::ParquetFormat;
        use datafusion::datasource::listing::{
            ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
        };
        if paths.is_empty() {
            let empty = datafusion::datasource::MemTable::try_new(schema, vec![vec![]])?;
            ctx.register_table(name, Arc::new(empty))?;
            return Ok(());
        }
        let urls = paths
            .iter()
            .map(|path| ListingTableUrl::parse(self.file_url(relative, path)))
            .collect::<Result<Vec<_>, _>>()?;
        let config = ListingTableConfig::new_with_multi_paths(urls)
            .with_listing_options(
                ListingOptions::new(Arc::new(ParquetFormat::default()))
                    .with_file_extension(".parquet"),
            )
            .with_schema(schema);
        ctx.register_table(name, Arc::new(ListingTable::try_new(config)?))?;
        Ok(())
    }

    /// The URL a session reads the data file `path` of the table in `relative` by (a local
    /// path, or `s3://bucket/key` of a store registered with the session).
    pub fn file_url(&self, relative: &str, path: &str) -> String {
        match &self.root {
            Root::Dir(dir) => dir.join(relative).join(path).display().to_string(),
            Root::Bucket(objects) => format!("{}{path}", objects.dir_url(Path::new(relative))),
        }
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
    /// most once an hour through this handle. With `orphans`, at most once a day it lists the
    /// table instead and also deletes the files no commit names that are older than that
    /// (VACUUM's full mode): files put for a commit that never landed, by a process killed
    /// between the two. `orphans` must be false while the table's directory may hold files of
    /// the layout before Delta that are not migrated yet: no commit names them either. Returns
    /// how many went.
    pub async fn vacuum(&self, relative: &str, orphans: bool) -> Result<usize, DeltaError> {
        let mut vacuumed = self.vacuumed.lock().await;
        let swept = format!("{relative} (orphans)");
        let full = orphans
            && vacuumed
                .get(&swept)
                .is_none_or(|at| at.elapsed() >= SWEEP_EVERY);
        if !full
            && vacuumed
                .get(relative)
                .is_some_and(|at| at.elapsed() < VACUUM_EVERY)
        {
            return Ok(0);
        }
        let Some(table) = self.latest(relative).await? else {
            return Ok(0);
        };
        let mode = if full {
            VacuumMode::Full
        } else {
            VacuumMode::Lite
        };
        let (table, metrics) = table
            .vacuum()
            .with_mode(mode)
            .with_commit_properties(
                CommitProperties::default().with_cleanup_expired_logs(Some(false)),
            )
            .await
            .map_err(self.error(relative))?;
        // The log's commits older than its retention (`delta.logRetentionDuration`, 30 days),
        // up to a checkpoint that stays: commits do not clean the log (see `commit`).
        let expired = deltalake_core::protocol::checkpoints::cleanup_metadata(&table, None)
            .await
            .map_err(self.error(relative))?;
        if expired > 0 {
            tracing::info!(
                table = relative,
                expired,
                "removed expired commits from the Delta log"
            );
        }
        let now = std::time::Instant::now();
        vacuumed.insert(relative.to_string(), now);
        if full {
            vacuumed.insert(swept, now);
        }
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
                pinned: None,
            }),
        )?;
        Ok(())
    }

    /// The table in `relative` as its latest version stands now, as a session's table that
    /// keeps reading that version (`schema`: its declared types), and the version; `None` while
    /// nothing has created it. For a job that reads one table several times and must see the
    /// same rows each time (the rollups).
    pub async fn pinned(
        &self,
        relative: &str,
        schema: &Schema,
    ) -> Result<Option<(u64, Arc<dyn TableProvider>)>, DeltaError> {
        let Some(table) = self.latest(relative).await? else {
            return Ok(None);
        };
        let version = table.version().unwrap_or(0);
        Ok(Some((
            version,
            Arc::new(LiveTable {
                tables: self.clone(),
                relative: relative.to_string(),
                schema: Arc::new(schema.clone()),
                as_of: AsOf::Version(version),
                pinned: Some(table),
            }),
        )))
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
/// `constants`, or null where a nullable column has none (rows written before their table
/// gained it): the rollups' rows as their tables declare them, and a table's rows as Delta
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
                None => match constants.iter().find(|(name, _)| name == field.name()) {
                    Some((_, value)) => value.to_array_of_size(rows)?,
                    None if field.is_nullable() => {
                        arrow_array::new_null_array(field.data_type(), rows)
                    }
                    None => {
                        return Err(DataFusionError::Internal(format!(
                            "column {} has no value",
                            field.name()
                        )))
                    }
                },
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

/// A Delta table as a session's table: each scan plans over the version [`AsOf`] names, the
/// latest one when the query is planned by default; a table nothing has created yet has no
/// rows.
struct LiveTable {
    tables: DeltaTables,
    relative: String,
    schema: SchemaRef,
    as_of: AsOf,
    /// The version read, once loaded for good.
    pinned: Option<DeltaTable>,
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
        let table = match (&self.pinned, as_of) {
            (Some(table), _) => Ok(Some(table.clone())),
            (None, AsOf::Latest) => self.tables.latest(&self.relative).await,
            (None, named) => self.tables.load(&self.relative, named).await,
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
        let stored = state.schema();
        let has = |name: &str| stored.field(name).is_some();
        if self.schema.fields().iter().all(|f| has(f.name())) {
            let mut config = DeltaScanConfig::new().with_schema(Arc::clone(&self.schema));
            config.schema_force_view_types = false;
            let scan = DeltaScanNext::new(state.snapshot().clone(), config)?;
            return scan.scan(session, projection, filters, limit).await;
        }
        // A version from before the table gained some of its columns (written by an earlier
        // gpuwarden, or read as of then): those read as nulls, as they do once it has them.
        let present = Arc::new(Schema::new(
            self.schema
                .fields()
                .iter()
                .filter(|f| has(f.name()))
                .cloned()
                .collect::<Vec<_>>(),
        ));
        let wanted: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        let inner: Vec<usize> = wanted
            .iter()
            .filter_map(|&i| present.index_of(self.schema.field(i).name()).ok())
            .collect();
        // Filters are inexact: DataFusion applies them again above the scan, so those on a
        // column the version lacks are left to it.
        let filters: Vec<Expr> = filters
            .iter()
            .filter(|f| f.column_refs().iter().all(|c| has(&c.name)))
            .cloned()
            .collect();
        let mut config = DeltaScanConfig::new().with_schema(Arc::clone(&present));
        config.schema_force_view_types = false;
        let scan = DeltaScanNext::new(state.snapshot().clone(), config)?;
        let plan = scan.scan(session, Some(&inner), &filters, limit).await?;
        let read = plan.schema();
        let exprs = wanted
            .iter()
            .map(|&i| {
                let field = self.schema.field(i);
                let expr: Arc<dyn datafusion::physical_expr::PhysicalExpr> =
                    match read.index_of(field.name()) {
                        Ok(at) => Arc::new(datafusion::physical_expr::expressions::Column::new(
                            field.name(),
                            at,
                        )),
                        Err(_) => Arc::new(datafusion::physical_expr::expressions::Literal::new(
                            ScalarValue::try_from(field.data_type())?,
                        )),
                    };
                Ok(datafusion::physical_expr::projection::ProjectionExpr {
                    expr,
                    alias: field.name().clone(),
                })
            })
            .collect::<Result<Vec<_>, DataFusionError>>()?;
        Ok(Arc::new(
            datafusion::physical_plan::projection::ProjectionExec::try_new(exprs, plan)?,
        ))
    }
}

/// Runs `future` to its end on the Delta tables' own runtime (two `delta-io` threads), for the
/// lake's synchronous callers: ingest's writer threads, `gpuwarden ingest`.
pub fn block_on<F>(future: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("delta-io")
            .enable_all()
            .build()
            .expect("starting the Delta tables' runtime")
    });
    if tokio::runtime::Handle::try_current().is_err() {
        return runtime.block_on(future);
    }
    // Called from inside another runtime (a test's, say), where blocking on this one is not
    // allowed: wait on a thread of its own.
    std::thread::scope(|scope| {
        scope
            .spawn(|| runtime.block_on(future))
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// An hour's new rows for [`DeltaTables::append`].
pub struct NewFile<'a> {
    /// The hour's start (Unix epoch milliseconds): the file's name begins with it.
    pub hour_ms: i64,
    /// The rows.
    pub batch: &'a RecordBatch,
    /// Each row's offset in its source, ascending; `None` for rows with no offsets.
    pub offsets: Option<&'a [i64]>,
}

/// A source's transaction in a commit: Delta's `txn` action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppTxn {
    /// The source: `<topic>-p<partition>`, or an input and its content.
    pub app_id: String,
    /// The last offset (or line) of the source the commit holds.
    pub last: i64,
}

/// What [`DeltaTables::append`] and [`DeltaTables::commit_adds`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// Committed as this version (with no files when every row was there already).
    Committed {
        /// The version.
        version: u64,
        /// Rows added.
        rows: usize,
        /// Files added.
        files: usize,
        /// Their bytes.
        bytes: i64,
    },
    /// The table already held the source up to `held`, past what this commit would add:
    /// nothing was committed.
    AlreadyThere {
        /// The version the table holds for the source.
        held: i64,
    },
}

/// The data files of a version of a table.
#[derive(Debug, Clone)]
pub struct TableFiles {
    /// The version.
    pub version: u64,
    /// Its files.
    pub files: Vec<DataFile>,
}

/// A data file of a table, as its version's log names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataFile {
    /// Its path, relative to the table's directory.
    pub path: String,
    /// Its size in bytes.
    pub size: i64,
    /// Its rows, when its statistics say.
    pub rows: Option<u64>,
    /// The hour its rows are in, from its name (`<YYYY-MM-DD>T<HH>-…`).
    pub hour_ms: Option<i64>,
    /// The least and greatest `ts_ms` of its rows, when its statistics say (raw tables).
    pub ts_range: Option<(i64, i64)>,
}

/// What commits changed in a raw table, by hour ([`DeltaTables::changes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// The hours with new rows, and what the added files' statistics say of them.
    pub added: BTreeMap<i64, Span>,
    /// The hours that lost rows.
    pub removed: BTreeSet<i64>,
}

/// What the statistics of the files a commit added say of their rows: the least `ts_ms`, and
/// the least `ts_ms - interval_ms` any row can have (the earliest a sample's interval can
/// begin). [`Span::UNKNOWN`] when they do not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The least `ts_ms`.
    pub min_ts: i64,
    /// No row's `ts_ms - interval_ms` is less (`min_ts` less the greatest `interval_ms`;
    /// `min_ts` for a table without intervals).
    pub min_start: i64,
}

impl Span {
    /// Rows that may be of any time.
    pub const UNKNOWN: Span = Span {
        min_ts: i64::MIN,
        min_start: i64::MIN,
    };

    fn union(self, other: Span) -> Span {
        Span {
            min_ts: self.min_ts.min(other.min_ts),
            min_start: self.min_start.min(other.min_start),
        }
    }

    /// The span of an add's statistics (its JSON `stats`).
    fn of_stats(stats: &str) -> Option<Span> {
        let stats: TsStats = serde_json::from_str(stats).ok()?;
        let min_ts = stats.min_values?.ts_ms?;
        let interval = stats.max_values.and_then(|m| m.interval_ms).unwrap_or(0);
        Some(Span {
            min_ts,
            min_start: min_ts.saturating_sub(interval.max(0)),
        })
    }
}

/// The parts of a file's statistics that [`Span`] and [`DataFile::ts_range`] read.
#[derive(serde::Deserialize)]
struct TsStats {
    #[serde(rename = "minValues")]
    min_values: Option<TsValues>,
    #[serde(rename = "maxValues")]
    max_values: Option<TsValues>,
}

#[derive(serde::Deserialize)]
struct TsValues {
    ts_ms: Option<i64>,
    interval_ms: Option<i64>,
}

/// The `ts_ms` range of a file's statistics.
fn ts_range(stats: &str) -> Option<(i64, i64)> {
    let stats: TsStats = serde_json::from_str(stats).ok()?;
    Some((stats.min_values?.ts_ms?, stats.max_values?.ts_ms?))
}

/// A table's latest version as a move copies it ([`DeltaTables::snapshot`]).
#[derive(Debug, Clone)]
pub struct TableSnapshot {
    /// The version.
    pub version: u64,
    /// Each file's `add`, with its statistics.
    pub adds: Vec<Add>,
    /// The version each source (transaction app id) holds.
    pub txns: std::collections::BTreeMap<String, i64>,
}

/// Adds the transactions of a checkpoint (its `txn` column) to `txns`.
fn checkpoint_txns(
    bytes: bytes::Bytes,
    txns: &mut std::collections::BTreeMap<String, i64>,
) -> Result<(), String> {
    use arrow_array::{Array, Int64Array, StringArray, StructArray};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::arrow::ProjectionMask;
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).map_err(|e| e.to_string())?;
    let Some(index) = builder
        .parquet_schema()
        .root_schema()
        .get_fields()
        .iter()
        .position(|f| f.name() == "txn")
    else {
        return Ok(());
    };
    let mask = ProjectionMask::roots(builder.parquet_schema(), [index]);
    for batch in builder
        .with_projection(mask)
        .build()
        .map_err(|e| e.to_string())?
    {
        let batch = batch.map_err(|e| e.to_string())?;
        let Some(txn) = batch.column(0).as_any().downcast_ref::<StructArray>() else {
            return Err("its txn column is not a struct".to_string());
        };
        let (Some(apps), Some(versions)) =
            (txn.column_by_name("appId"), txn.column_by_name("version"))
        else {
            return Err("its txn column lacks appId or version".to_string());
        };
        let apps = cast(apps, &arrow_schema::DataType::Utf8).map_err(|e| e.to_string())?;
        let versions = cast(versions, &arrow_schema::DataType::Int64).map_err(|e| e.to_string())?;
        let apps = apps
            .as_any()
            .downcast_ref::<StringArray>()
            .expect("cast to Utf8");
        let versions = versions
            .as_any()
            .downcast_ref::<Int64Array>()
            .expect("cast to Int64");
        for i in 0..txn.len() {
            if txn.is_valid(i) && apps.is_valid(i) && versions.is_valid(i) {
                txns.insert(apps.value(i).to_string(), versions.value(i));
            }
        }
    }
    Ok(())
}

/// The name a move gives the file `source` (its path in the table it comes from) when it
/// cannot keep it: `<YYYY-MM-DD>T<HH>-migrated-<digest of source>.parquet` for a file of one
/// hour, so that the hour's files are found by name, and the same name each time, so that a
/// move run again finds what it copied.
pub fn moved_name(hour_ms: Option<i64>, source: &str) -> String {
    let digest = xxhash_rust::xxh3::xxh3_64(source.as_bytes());
    format!(
        "{}migrated-{digest:016x}.parquet",
        hour_ms.map(file_prefix).unwrap_or_default()
    )
}

/// The `add` of the Parquet file `bytes` put at `path` of a table stored as `schema`, with
/// statistics from its footer.
pub fn add_of_file(path: String, bytes: &bytes::Bytes, schema: &Schema) -> Result<Add, String> {
    let stats = parquet_stats(bytes, schema).map_err(|e| e.to_string())?;
    Ok(add(path, bytes.len() as i64, stats, true))
}

/// A source's transaction as the action a commit carries.
fn txn_action(txn: &AppTxn) -> Action {
    Action::Txn(Transaction::new_with_last_update(
        &txn.app_id,
        txn.last,
        Some(wall_now_ms()),
    ))
}

/// A commit that adds files (and transactions) without reading the table: a blind append.
fn append_operation() -> DeltaOperation {
    DeltaOperation::Write {
        mode: SaveMode::Append,
        partition_by: None,
        predicate: None,
    }
}

/// Commits `actions` to `table` (as it was read) and brings it up to the new version.
async fn commit(
    table: &mut DeltaTable,
    actions: Vec<Action>,
    operation: DeltaOperation,
) -> Result<u64, DeltaTableError> {
    let state = table.snapshot()?;
    // delta-rs would also clean the log after every commit, listing all of it (with each
    // file's metadata) to find what expired: on a table with a month of minute-by-minute
    // commits, a quarter of a million files per commit. [`DeltaTables::vacuum`] cleans it
    // hourly instead; the checkpoint every hundred commits stays.
    let committed =
        CommitBuilder::from(CommitProperties::default().with_cleanup_expired_logs(Some(false)))
            .with_actions(actions)
            .build(Some(state), table.log_store(), operation)
            .await?;
    let version = committed.version();
    if committed.metrics.new_checkpoint_created {
        // Read again, to start from the checkpoint this commit wrote: the state the commit
        // brings back was read before it.
        table.update_incremental(Some(version)).await?;
    } else {
        // The commit read the log up to itself already: reading it again would list the log
        // once more (on a directory, all of it).
        table.state = Some(committed.snapshot());
    }
    Ok(version as u64)
}

/// The transaction every OPTIMIZE and retention commit of a table carries, so that two of them
/// made from the same version conflict. delta-rs's conflict check does not count a file removed
/// by a commit without `dataChange` (an OPTIMIZE's) as removed twice: without this, a second
/// OPTIMIZE of an hour, made from the version before the first, would land and add the hour's
/// rows again. Two commits with a transaction of the same app id always conflict.
fn maintenance_txn(read: u64, now: i64) -> Action {
    Action::Txn(Transaction::new_with_last_update(
        "gpuwarden-maintenance",
        i64::try_from(read).unwrap_or(i64::MAX).saturating_add(1),
        Some(now),
    ))
}

/// A new data file's name: `<YYYY-MM-DD>T<HH>-<tag>-<uuid>.parquet`.
fn data_file_name(hour_ms: i64, tag: &str) -> String {
    format!(
        "{}{tag}-{}.parquet",
        file_prefix(hour_ms),
        uuid::Uuid::new_v4()
    )
}

/// The hour a data file's name begins with (`2026-12-06T08-…`).
pub fn hour_of_file(path: &str) -> Option<i64> {
    // A file of the layout before Delta, moved into the log where it lay.
    if let Some(rest) = path.strip_prefix("date=") {
        let (date, rest) = rest.split_once('/')?;
        let (hour, _) = rest.strip_prefix("hour=")?.split_once('/')?;
        return crate::base::parse_hour_partition(&format!("date={date}"), &format!("hour={hour}"));
    }
    let name = path.rsplit('/').next()?;
    let (date, rest) = (name.get(..10)?, name.get(10..)?);
    let hour: i64 = rest.strip_prefix('T')?.get(..2)?.parse().ok()?;
    rest.get(3..4).filter(|d| *d == "-")?;
    let mut parts = date.split('-');
    let (y, m, d) = (
        parts.next()?.parse::<i64>().ok()?,
        parts.next()?.parse::<u32>().ok()?,
        parts.next()?.parse::<u32>().ok()?,
    );
    if !(0..24).contains(&hour) || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    Some(gpuwarden_schema::calendar::days_from_civil(y, m, d) * 86_400_000 + hour * 3_600_000)
}

fn add(path: String, size: i64, stats: String, data_change: bool) -> Add {
    Add {
        path,
        partition_values: HashMap::new(),
        size,
        modification_time: wall_now_ms(),
        data_change,
        stats: Some(stats),
        ..Default::default()
    }
}

fn remove(path: &str, size: i64, now: i64, data_change: bool) -> Remove {
    Remove {
        path: path.to_string(),
        data_change,
        deletion_timestamp: Some(now),
        extended_file_metadata: Some(true),
        partition_values: Some(HashMap::new()),
        size: Some(size),
        ..Default::default()
    }
}

/// The rows an add's statistics count.
pub fn rows_of(add: &Add) -> usize {
    add.stats
        .as_deref()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
        .and_then(|v| v.get("numRecords").and_then(serde_json::Value::as_u64))
        .unwrap_or(0) as usize
}

/// The Delta statistics of the Parquet file `bytes`, from its footer.
fn parquet_stats(
    bytes: &bytes::Bytes,
    schema: &Schema,
) -> Result<String, parquet::errors::ParquetError> {
    let metadata = parquet::file::metadata::ParquetMetaDataReader::new().parse_and_finish(bytes)?;
    Ok(stats_of(&metadata, schema))
}

/// A file's Delta statistics from its Parquet footer: its rows, and the exact minimum, maximum
/// and null count of each top-level integer and text column (the time, the GPU, the lease),
/// which readers (gpuwarden, DuckDB, polars, Spark) use to skip the files a filter rules out.
pub(crate) fn stats_of(
    metadata: &parquet::file::metadata::ParquetMetaData,
    schema: &Schema,
) -> String {
    use parquet::file::statistics::Statistics;
    use serde_json::{json, Map, Value};
    let rows: i64 = metadata.row_groups().iter().map(|g| g.num_rows()).sum();
    let (mut min, mut max, mut nulls) = (Map::new(), Map::new(), Map::new());
    for field in schema.fields() {
        let name = field.name();
        let mut lo: Option<Value> = None;
        let mut hi: Option<Value> = None;
        let mut null_count = Some(0u64);
        let mut exact = true;
        for group in metadata.row_groups() {
            let Some(column) = group
                .columns()
                .iter()
                .find(|c| c.column_path().string() == *name)
            else {
                exact = false;
                break;
            };
            let Some(stats) = column.statistics() else {
                exact = false;
                break;
            };
            null_count = null_count.and_then(|n| stats.null_count_opt().map(|m| n + m));
            let (a, b) = match stats {
                Statistics::Int64(s) if s.min_is_exact() && s.max_is_exact() => {
                    (s.min_opt().map(|v| json!(v)), s.max_opt().map(|v| json!(v)))
                }
                Statistics::ByteArray(s)
                    if s.min_is_exact()
                        && s.max_is_exact()
                        && field.data_type() == &arrow_schema::DataType::Utf8 =>
                {
                    (
                        s.min_opt().and_then(|v| v.as_utf8().ok()).map(|v| json!(v)),
                        s.max_opt().and_then(|v| v.as_utf8().ok()).map(|v| json!(v)),
                    )
                }
                _ => {
                    exact = false;
                    break;
                }
            };
            // A row group of nulls only has no bounds, and changes none.
            if let Some(a) = a {
                if lo.as_ref().is_none_or(|l| less(&a, l)) {
                    lo = Some(a);
                }
            }
            if let Some(b) = b {
                if hi.as_ref().is_none_or(|h| less(h, &b)) {
                    hi = Some(b);
                }
            }
        }
        if let Some(n) = null_count.filter(|_| exact || field.data_type().is_primitive()) {
            if exact {
                nulls.insert(name.clone(), json!(n));
            }
        }
        if exact {
            if let (Some(lo), Some(hi)) = (lo, hi) {
                min.insert(name.clone(), lo);
                max.insert(name.clone(), hi);
            }
        }
    }
    json!({ "numRecords": rows, "minValues": min, "maxValues": max, "nullCount": nulls })
        .to_string()
}

/// `a < b` for two statistics of one column (both numbers or both text).
fn less(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    match (a, b) {
        (serde_json::Value::Number(a), serde_json::Value::Number(b)) => {
            a.as_i64().unwrap_or(i64::MIN) < b.as_i64().unwrap_or(i64::MIN)
        }
        (serde_json::Value::String(a), serde_json::Value::String(b)) => a < b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory lake, and the schema of its test tables: one column, `ts_ms`.
    fn one_column_lake() -> (tempfile::TempDir, DeltaTables, Schema) {
        let dir = tempfile::tempdir().unwrap();
        let tables = DeltaTables::in_dir(dir.path());
        let schema = Schema::new(vec![arrow_schema::Field::new(
            "ts_ms",
            arrow_schema::DataType::Int64,
            false,
        )]);
        (dir, tables, schema)
    }

    /// A table created before its rows gained a column takes the column (one `ADD COLUMN`
    /// commit) when the first row that has it is written: its files from before read as
    /// nulls there, as of any version, and a column that is not nullable is refused by name.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_table_gains_the_nullable_columns_its_rows_gained_and_old_files_read_null() {
        let (_dir, tables, old) = one_column_lake();
        let append = |schema: Schema, columns: Vec<ArrayRef>| {
            let tables = tables.clone();
            async move {
                let batch = RecordBatch::try_new(Arc::new(schema.clone()), columns).unwrap();
                let files = [NewFile {
                    hour_ms: 0,
                    batch: &batch,
                    offsets: None,
                }];
                tables.append("t", &schema, "test", &files, None).await
            }
        };
        let ints = |v: Vec<i64>| -> ArrayRef { Arc::new(arrow_array::Int64Array::from(v)) };
        append(old.clone(), vec![ints(vec![1, 2])]).await.unwrap();
        let before = tables.load("t", AsOf::Latest).await.unwrap().unwrap();
        let before = before.version().unwrap();

        let mut fields: Vec<arrow_schema::Field> =
            old.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields.push(arrow_schema::Field::new(
            "sm_active_pct",
            arrow_schema::DataType::Float64,
            true,
        ));
        let new = Schema::new(fields.clone());
        let sm: ArrayRef = Arc::new(arrow_array::Float64Array::from(vec![Some(2.5)]));
        append(new.clone(), vec![ints(vec![3]), Arc::clone(&sm)])
            .await
            .unwrap();
        // Another gpuwarden of the new build finds the column there: no second commit.
        append(new.clone(), vec![ints(vec![4]), sm]).await.unwrap();
        let table = tables.load("t", AsOf::Latest).await.unwrap().unwrap();
        assert_eq!(
            table.version(),
            Some(before + 3),
            "one ADD COLUMN, two appends"
        );
        let stored = table.snapshot().unwrap().schema();
        assert!(stored.field("sm_active_pct").unwrap().is_nullable());

        let read = |as_of: AsOf| {
            let tables = tables.clone();
            let new = new.clone();
            async move {
                let ctx = datafusion::prelude::SessionContext::new();
                tables.register(&ctx, "t", "t", &new, as_of).unwrap();
                let batches = ctx
                    .sql("SELECT ts_ms, sm_active_pct FROM t WHERE sm_active_pct IS NULL OR ts_ms > 0 ORDER BY ts_ms")
                    .await
                    .unwrap()
                    .collect()
                    .await
                    .unwrap();
                datafusion::arrow::util::pretty::pretty_format_batches(&batches)
                    .unwrap()
                    .to_string()
            }
        };
        let latest = read(AsOf::Latest).await;
        for row in [
            "| 1     |               |",
            "| 3     | 2.5           |",
            "| 4     | 2.5           |",
        ] {
            assert!(latest.contains(row), "{row} in\n{latest}");
        }
        // As of before the column: the old rows, the column null; `SELECT *` too.
        let then = read(AsOf::Version(before)).await;
        assert!(then.contains("| 2     |               |"), "{then}");
        assert!(!then.contains("| 3 "), "{then}");
        let ctx = datafusion::prelude::SessionContext::new();
        tables
            .register(&ctx, "t", "t", &new, AsOf::Version(before))
            .unwrap();
        let all = ctx
            .sql("SELECT * FROM t")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(all.iter().map(RecordBatch::num_rows).sum::<usize>(), 2);
        assert_eq!(all[0].schema().fields().len(), 2);

        // A column that is not nullable cannot be added to rows that have no value for it.
        fields.push(arrow_schema::Field::new(
            "required",
            arrow_schema::DataType::Int64,
            false,
        ));
        let err = append(
            Schema::new(fields),
            vec![
                ints(vec![5]),
                Arc::new(arrow_array::Float64Array::from(vec![1.0])),
                ints(vec![1]),
            ],
        )
        .await
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("column required is not in the table"),
            "{err}"
        );
    }

    /// A move carries every transaction a table holds, those in its checkpoint (written every
    /// 100 commits) and those in the commits after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_snapshot_holds_every_transaction_of_the_checkpoint_and_the_commits_after() {
        let (dir, tables, schema) = one_column_lake();
        let mut want = std::collections::BTreeMap::new();
        for i in 0..105_i64 {
            let mut txns = std::collections::BTreeMap::new();
            txns.insert(format!("app-{}", i % 7), i);
            if i == 3 {
                txns.insert("once".to_string(), 3);
            }
            want.extend(txns.clone());
            tables
                .commit_moved("t", &schema, Vec::new(), &txns)
                .await
                .unwrap();
        }
        let log = dir.path().join("t/_delta_log");
        assert!(
            std::fs::read_dir(&log)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().contains(".checkpoint")),
            "a checkpoint was written"
        );
        let snapshot = tables.snapshot("t", AsOf::Latest).await.unwrap().unwrap();
        assert_eq!(snapshot.txns, want);
        assert_eq!(
            tables.txn_version("t", "once").await.unwrap(),
            Some(3),
            "as delta-rs reads it"
        );
    }

    /// Commits leave the log alone; the hourly VACUUM removes the commits older than the log's
    /// retention up to a checkpoint, and the table reads as before. 106 appends through one
    /// handle (a checkpoint at 99 in between) also keep its transactions and rows right.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn vacuum_cleans_the_log_that_commits_leave() {
        let (dir, tables, schema) = one_column_lake();
        let append = |tables: DeltaTables, i: i64| {
            let schema = schema.clone();
            async move {
                let batch = RecordBatch::try_new(
                    Arc::new(schema.clone()),
                    vec![Arc::new(arrow_array::Int64Array::from(vec![i, i + 1]))],
                )
                .unwrap();
                let appended = tables
                    .append(
                        "t",
                        &schema,
                        "test",
                        &[NewFile {
                            hour_ms: 0,
                            batch: &batch,
                            offsets: Some(&[2 * i, 2 * i + 1]),
                        }],
                        Some(&AppTxn {
                            app_id: format!("app-{}", i % 3),
                            last: 2 * i + 1,
                        }),
                    )
                    .await
                    .unwrap();
                assert!(matches!(appended, Appended::Committed { rows: 2, .. }));
            }
        };
        for i in 0..105 {
            append(tables.clone(), i).await;
        }
        let log = dir.path().join("t/_delta_log");
        let first = log.join("00000000000000000000.json");
        let month_ago =
            gpuwarden_schema::clock::wall_now() - std::time::Duration::from_secs(31 * 86_400);
        for entry in std::fs::read_dir(&log).unwrap().flatten() {
            std::fs::File::options()
                .write(true)
                .open(entry.path())
                .unwrap()
                .set_modified(month_ago)
                .unwrap();
        }
        append(tables.clone(), 105).await;
        assert!(first.exists(), "a commit removes no expired commit");

        tables.vacuum("t", false).await.unwrap();
        assert!(!first.exists(), "VACUUM removed the expired commits");
        assert!(!log.join("00000000000000000098.json").exists());
        for kept in [
            "00000000000000000099.checkpoint.parquet",
            "00000000000000000100.json",
        ] {
            assert!(log.join(kept).exists(), "{kept} stays");
        }
        for reader in [tables.clone(), DeltaTables::in_dir(dir.path())] {
            let files = reader.files("t", AsOf::Latest).await.unwrap().unwrap();
            assert_eq!(files.files.len(), 106);
            assert_eq!(files.version, 106);
            for (app, last) in [("app-0", 211), ("app-1", 207), ("app-2", 209)] {
                assert_eq!(reader.txn_version("t", app).await.unwrap(), Some(last));
            }
        }
        append(tables.clone(), 106).await;
    }
}
