//! Software slice tables in the agent's state directory (default `/run/gpuslice`): one JSON file
//! per GPU, `gpu-<index>.slices.json`, replaced atomically so the shim and `gpuslice run` never
//! read half a table. Each slice: id, GPU UUID, memory cap, compute share.

use std::path::{Path, PathBuf};

use gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{GpuInventory, SoftwareSliceState};
use gpuslice_planning::transition::SliceTable;
use serde::{Deserialize, Serialize};

/// Why a slice table cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a slice table: {source}")]
    Corrupt {
        path: String,
        source: serde_json::Error,
    },
}

/// One slice as written to the table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceEntry {
    pub id: String,
    pub gpu_uuid: String,
    pub memory_bytes: u64,
    pub compute_percent: u32,
}

fn table_path(state: &Path, gpu: u32) -> PathBuf {
    state.join(format!("gpu-{gpu}.slices.json"))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SliceError + '_ {
    move |source| SliceError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The slices configured on a GPU (none when it has no table).
pub fn read(state: &Path, gpu: u32) -> Result<Vec<SoftwareSliceState>, SliceError> {
    let path = table_path(state, gpu);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(&path)(e)),
    };
    let entries: Vec<SliceEntry> =
        serde_json::from_slice(&text).map_err(|source| SliceError::Corrupt {
            path: path.display().to_string(),
            source,
        })?;
    Ok(entries
        .into_iter()
        .map(|e| SoftwareSliceState {
            id: e.id,
            memory: Quantity(format_bytes(e.memory_bytes)),
            compute: e.compute_percent,
            processes: Vec::new(),
        })
        .collect())
}

/// Replaces a GPU's slice table.
pub fn write(state: &Path, gpu: &GpuInventory, table: &SliceTable) -> Result<(), SliceError> {
    std::fs::create_dir_all(state).map_err(io(state))?;
    let uuid = gpu.uuid.clone().unwrap_or_default();
    let entries: Vec<SliceEntry> = (0..table.slices)
        .map(|s| SliceEntry {
            id: format!("gpu{}-s{s}", gpu.index),
            gpu_uuid: uuid.clone(),
            memory_bytes: table.memory,
            compute_percent: table.compute,
        })
        .collect();
    let path = table_path(state, gpu.index);
    let tmp = tempfile::NamedTempFile::new_in(state).map_err(io(state))?;
    serde_json::to_writer_pretty(&tmp, &entries).map_err(|e| io(&path)(e.into()))?;
    tmp.persist(&path).map_err(|e| io(&path)(e.error))?;
    Ok(())
}

/// Removes a GPU's slice table.
pub fn clear(state: &Path, gpu: u32) -> Result<(), SliceError> {
    let path = table_path(state, gpu);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&path)(e)),
        _ => Ok(()),
    }
}
