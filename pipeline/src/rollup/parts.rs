//! An hour's samples split by GPU into parts on disk, for an hour with too many samples to
//! compute at once (see [`super::Rollup::run`], step 3).
//!
//! Every sample of a GPU lands in the same part (by a fixed hash of `gpu_uuid`), so a part
//! holds whole GPUs: each one's duplicates, intervals and attribution are all in it. The parts
//! are Arrow IPC files (LZ4-compressed), written in one scan of the hour's Parquet files and
//! read back one at a time; the directory is emptied before a split and removed with the
//! [`Spill`], so a crash leaves at most one hour's parts, removed by the next split.

use std::fs::{self, File};
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use arrow_array::{RecordBatch, UInt32Array};
use datafusion::arrow::compute::{concat_batches, take_record_batch};
use datafusion::arrow::ipc::reader::FileReader;
use datafusion::arrow::ipc::writer::{FileWriter, IpcWriteOptions};
use datafusion::arrow::ipc::CompressionType;
use datafusion::common::hash_utils::{create_hashes, RandomState};
use datafusion::prelude::SessionContext;
use futures::StreamExt as _;

use super::RollupError;
use crate::lake::{io, LakeError};

/// Rows gathered for a part before they are written as one IPC batch.
const BATCH_ROWS: usize = 8192;

/// The parts of one hour, on disk until dropped.
pub(super) struct Spill {
    dir: PathBuf,
    files: Vec<PathBuf>,
}

/// Splits the rows of `query` (samples whose first column is `gpu_uuid`) into `parts` parts by
/// GPU, under `dir` (emptied first).
pub(super) async fn split(
    ctx: &SessionContext,
    query: &str,
    parts: usize,
    dir: &Path,
) -> Result<Spill, RollupError> {
    remove(dir)?;
    fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let mut stream = ctx.sql(query).await?.execute_stream().await?;
    let schema = stream.schema();
    let options =
        IpcWriteOptions::default().try_with_compression(Some(CompressionType::LZ4_FRAME))?;
    let mut spill = Spill {
        dir: dir.to_owned(),
        files: Vec::with_capacity(parts),
    };
    let mut writers = Vec::with_capacity(parts);
    for part in 0..parts {
        let path = dir.join(format!("part-{part}.arrow"));
        let file = File::create(&path).map_err(io("creating", &path))?;
        spill.files.push(path);
        writers.push(FileWriter::try_new_with_options(
            BufWriter::new(file),
            &schema,
            options.clone(),
        )?);
    }
    let mut pending: Vec<Vec<RecordBatch>> = vec![Vec::new(); parts];
    let mut pending_rows = vec![0usize; parts];
    let hasher = RandomState::with_seed(0);
    let mut hashes = Vec::new();
    let mut rows: Vec<Vec<u32>> = vec![Vec::new(); parts];
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        hashes.clear();
        hashes.resize(batch.num_rows(), 0);
        create_hashes([batch.column(0)], &hasher, &mut hashes)?;
        for (row, hash) in hashes.iter().enumerate() {
            let row = u32::try_from(row).expect("a batch has fewer than 2^32 rows");
            rows[(*hash % parts as u64) as usize].push(row);
        }
        for (part, part_rows) in rows.iter_mut().enumerate() {
            if part_rows.is_empty() {
                continue;
            }
            // Taken, the part's row list is left empty for the next batch.
            let indices = UInt32Array::from(std::mem::take(part_rows));
            pending[part].push(take_record_batch(&batch, &indices)?);
            pending_rows[part] += indices.len();
            if pending_rows[part] >= BATCH_ROWS {
                let gathered = concat_batches(&schema, &pending[part])?;
                writers[part].write(&gathered)?;
                pending[part].clear();
                pending_rows[part] = 0;
            }
        }
    }
    for (part, mut writer) in writers.into_iter().enumerate() {
        if !pending[part].is_empty() {
            writer.write(&concat_batches(&schema, &pending[part])?)?;
        }
        writer.finish()?;
    }
    Ok(spill)
}

impl Spill {
    /// Part `part`'s samples, a batch at a time.
    pub(super) fn read(
        &self,
        part: usize,
    ) -> Result<FileReader<std::io::BufReader<File>>, RollupError> {
        let path = &self.files[part];
        let file = File::open(path).map_err(io("opening", path))?;
        Ok(FileReader::try_new(std::io::BufReader::new(file), None)?)
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        if let Err(e) = remove(&self.dir) {
            tracing::warn!(error = %e, "cannot remove an hour's rollup parts; the next split does");
        }
    }
}

fn remove(dir: &Path) -> Result<(), LakeError> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("removing", dir)(e)),
        _ => Ok(()),
    }
}
