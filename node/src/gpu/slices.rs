//! Slices in the agent's state directory (layout: `gpuslice_contract::paths`), of which the agent
//! is the only writer:
//! - software slice tables, one JSON file per GPU, `gpu-<index>.slices.json`, replaced atomically
//!   so the shim and `gpuslice run` never read half a table (each slice: id, GPU UUID, memory cap,
//!   compute share);
//! - one directory per slice of any kind, `slices/<id>/`, holding its read-only `config` (what the
//!   shim enforces and `gpuslice run` hands out), its memory ledger `memory` (see
//!   `gpuslice_shm`), and, written by the workload, `checkpoint-done`.

use std::path::Path;

use gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{GpuInventory, NodeInventory, SoftwareSliceState};
use gpuslice_contract::StateDir;
use gpuslice_contract::slice::{gpu_slice_id, instance_slice_id, mig_slice_id, software_slice_id};
pub use gpuslice_contract::{SliceConfig, SliceKind};
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
    /// The GPU's slices share it through CUDA MPS.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mps: bool,
    /// The MIG instance (its slice id) whose MPS slice this is; none for a whole GPU's slice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SliceError + '_ {
    move |source| SliceError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The slices configured on a GPU (none when it has no table): the whole GPU's, and the MPS
/// slices of each MIG instance (by the instance's slice id).
pub fn read(
    state: &StateDir,
    gpu: u32,
) -> Result<Vec<(Option<String>, SoftwareSliceState)>, SliceError> {
    let path = state.slice_table(gpu);
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
        .map(|e| {
            let slice = SoftwareSliceState {
                id: e.id,
                memory: Quantity(format_bytes(e.memory_bytes)),
                compute: e.compute_percent,
                mps: e.mps,
                processes: Vec::new(),
            };
            (e.instance, slice)
        })
        .collect())
}

/// Reads GPU `gpu`'s slice tables into its inventory entry: its own slices, and each MIG
/// instance's MPS slices (those of an instance that is gone are dropped).
pub fn read_into(state: &StateDir, gpu: &mut GpuInventory) -> Result<(), SliceError> {
    let mut instances: Vec<(String, &mut gpuslice_api::MigInstance)> = gpu
        .mig
        .iter_mut()
        .flat_map(|m| &mut m.instances)
        .map(|i| (mig_slice_id(gpu.index, i.placement.start, &i.profile), i))
        .collect();
    gpu.slices.clear();
    for (instance, slice) in read(state, gpu.index)? {
        match instance {
            None => gpu.slices.push(slice),
            Some(id) => {
                if let Some((_, i)) = instances.iter_mut().find(|(own, _)| *own == id) {
                    i.slices.push(slice);
                }
            }
        }
    }
    Ok(())
}

fn write_entries(state: &StateDir, gpu: u32, entries: &[SliceEntry]) -> Result<(), SliceError> {
    let root = state.root();
    std::fs::create_dir_all(root).map_err(io(root))?;
    let path = state.slice_table(gpu);
    let tmp = tempfile::NamedTempFile::new_in(root).map_err(io(root))?;
    serde_json::to_writer_pretty(&tmp, entries).map_err(|e| io(&path)(e.into()))?;
    tmp.persist(&path).map_err(|e| io(&path)(e.error))?;
    Ok(())
}

/// Replaces a GPU's slice table.
pub fn write(state: &StateDir, gpu: &GpuInventory, table: &SliceTable) -> Result<(), SliceError> {
    let uuid = gpu.uuid.clone().unwrap_or_default();
    let entries: Vec<SliceEntry> = (0..table.slices)
        .map(|s| SliceEntry {
            id: software_slice_id(gpu.index, s),
            gpu_uuid: uuid.clone(),
            memory_bytes: table.memory,
            compute_percent: table.compute,
            mps: table.mps,
            instance: None,
        })
        .collect();
    write_entries(state, gpu.index, &entries)
}

/// Replaces a GPU's slice table with `slices` MPS slices in each of `instances` (profile and
/// placement, as the GPU has them once its transition ran), each an equal share of its
/// instance's memory and SMs; `model` gives the profiles' memory.
pub fn write_instances(
    state: &StateDir,
    gpu: &GpuInventory,
    model: &gpuslice_planning::catalog::GpuModel,
    instances: &[(String, gpuslice_api::Placement)],
    slices: u32,
) -> Result<(), SliceError> {
    let uuid = gpu.uuid.clone().unwrap_or_default();
    let mut entries = Vec::new();
    for (profile, placement) in instances {
        let instance = mig_slice_id(gpu.index, placement.start, profile);
        let memory = model.profile(profile).map_or(0, |p| p.memory_bytes());
        let (memory_bytes, compute_percent) =
            gpuslice_planning::transition::mps_slice_of_instance(memory, slices);
        entries.extend((0..slices).map(|s| SliceEntry {
            id: instance_slice_id(&instance, s),
            gpu_uuid: uuid.clone(),
            memory_bytes,
            compute_percent,
            mps: true,
            instance: Some(instance.clone()),
        }));
    }
    write_entries(state, gpu.index, &entries)
}

/// Removes a GPU's slice table.
pub fn clear(state: &StateDir, gpu: u32) -> Result<(), SliceError> {
    let path = state.slice_table(gpu);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&path)(e)),
        _ => Ok(()),
    }
}

/// Every slice the node has now: software slices, MIG instances, and GPUs with neither.
pub fn configs(node: &NodeInventory) -> Vec<SliceConfig> {
    let mut out = Vec::new();
    for gpu in &node.gpus {
        let gpu_uuid = gpu.uuid.clone().unwrap_or_default();
        // NVML's figure, else the catalog's for the model (as NodeInventory documents).
        let gpu_memory = gpu
            .memory
            .as_ref()
            .and_then(|q| gpuslice_api::bytes_of(&q.0).ok())
            .or_else(|| {
                gpuslice_planning::catalog::model(&gpu.model)
                    .ok()
                    .map(|m| m.memory_bytes())
            })
            .unwrap_or(0);
        let instances = gpu
            .mig
            .as_ref()
            .map(|m| m.instances.as_slice())
            .unwrap_or(&[]);
        if !gpu.slices.is_empty() {
            out.extend(gpu.slices.iter().map(|s| SliceConfig {
                id: s.id.clone(),
                kind: if s.mps {
                    SliceKind::Mps
                } else {
                    SliceKind::Software
                },
                gpu: gpu.index,
                device_minor: gpu.minor,
                device_uuid: gpu_uuid.clone(),
                memory_bytes: gpuslice_api::bytes_of(&s.memory.0).unwrap_or(0),
                compute_percent: s.compute,
            }));
        } else if gpu.mig.as_ref().is_some_and(|m| m.enabled) {
            let model = gpuslice_planning::catalog::model(&gpu.model).ok();
            // An instance with MPS slices is those slices, on the instance's MIG device.
            out.extend(instances.iter().flat_map(|i| {
                i.slices.iter().filter_map(|s| {
                    Some(SliceConfig {
                        id: s.id.clone(),
                        kind: SliceKind::Mps,
                        gpu: gpu.index,
                        device_minor: gpu.minor,
                        device_uuid: i.uuid.clone()?,
                        memory_bytes: gpuslice_api::bytes_of(&s.memory.0).unwrap_or(0),
                        compute_percent: s.compute,
                    })
                })
            }));
            out.extend(
                instances
                    .iter()
                    .filter(|i| i.slices.is_empty())
                    .filter_map(|i| {
                        Some(SliceConfig {
                            id: mig_slice_id(gpu.index, i.placement.start, &i.profile),
                            kind: SliceKind::Mig,
                            gpu: gpu.index,
                            device_minor: gpu.minor,
                            // Without its UUID a workload could not be pointed at the instance.
                            device_uuid: i.uuid.clone()?,
                            memory_bytes: model
                                .and_then(|m| m.profile(&i.profile))
                                .map_or(0, |p| p.memory_bytes()),
                            compute_percent: 100,
                        })
                    }),
            );
        } else {
            out.push(SliceConfig {
                id: gpu_slice_id(gpu.index),
                kind: SliceKind::Exclusive,
                gpu: gpu.index,
                device_minor: gpu.minor,
                device_uuid: gpu_uuid,
                memory_bytes: gpu_memory,
                compute_percent: 100,
            });
        }
    }
    out
}

/// Makes `<state>/slices/` hold exactly one directory per slice, each with its read-only
/// `config`. A slice that is gone loses its directory; one that stays keeps what its workload
/// wrote there.
pub fn sync_dirs(state: &StateDir, slices: &[SliceConfig]) -> Result<(), SliceError> {
    use std::os::unix::fs::PermissionsExt as _;
    let root = state.slices();
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    for slice in slices {
        let dir = state.slice(&slice.id);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        // The workload writes here (its checkpoint marker) whatever its user; like /tmp, sticky:
        // what the agent put here (config, ledger) no other user may remove or rename.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777))
            .map_err(io(&dir))?;
        // The slice's memory ledger: every process of the workload maps it read-write (it can
        // only spoil its own slice's accounting; its limits come from the read-only config and
        // the watchdog holds them). The directory is the workload's to write: whatever it put
        // in the ledger's place (a link, a file of its own) is replaced, never followed.
        let ledger = state.slice_ledger(&slice.id);
        let ours = std::fs::symlink_metadata(&ledger).ok().map(|m| {
            use std::os::unix::fs::MetadataExt as _;
            m.file_type().is_file() && m.uid() == rustix::process::geteuid().as_raw()
        });
        if ours == Some(false) {
            tracing::warn!(
                "{}: not the agent's ledger (a link or another user's file); replaced",
                ledger.display()
            );
            std::fs::remove_file(&ledger)
                .or_else(|_| std::fs::remove_dir_all(&ledger))
                .map_err(io(&ledger))?;
        }
        if ours != Some(true) {
            gpuslice_shm::Ledger::open(&ledger).map_err(|e| SliceError::Io {
                path: ledger.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
            std::fs::set_permissions(&ledger, std::fs::Permissions::from_mode(0o666))
                .map_err(io(&ledger))?;
        }
        let path = state.slice_config(&slice.id);
        let text = serde_json::to_vec_pretty(slice).map_err(|e| io(&path)(e.into()))?;
        if std::fs::read(&path).ok().as_deref() == Some(text.as_slice()) {
            continue;
        }
        let tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io(&dir))?;
        std::fs::write(tmp.path(), &text).map_err(io(&path))?;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o444))
            .map_err(io(&path))?;
        tmp.persist(&path).map_err(|e| io(&path)(e.error))?;
    }
    let entries = std::fs::read_dir(&root).map_err(io(&root))?;
    for entry in entries {
        let entry = entry.map_err(io(&root))?;
        let name = entry.file_name();
        if !slices.iter().any(|s| *s.id == *name) {
            std::fs::remove_dir_all(entry.path()).map_err(io(&entry.path()))?;
        }
    }
    Ok(())
}

/// Frees the ledger rows of processes that are gone whatever pid namespace they ran in (a
/// container of a pod that ended, say): the processes themselves only judge their own
/// namespace's. Reads the host's processes only when some row is of another namespace.
pub fn reclaim_ledgers(state: &StateDir, slices: &[SliceConfig]) {
    let own = gpuslice_shm::pid_namespace("self");
    let ledgers: Vec<gpuslice_shm::Ledger> = slices
        .iter()
        .filter(|s| s.kind.shares_gpu())
        .filter_map(|s| gpuslice_shm::Ledger::open(&state.slice_ledger(&s.id)).ok())
        .filter(|l| {
            l.rows()
                .iter()
                .any(|(p, _, _)| p.pidns != 0 && Some(p.pidns) != own)
        })
        .collect();
    if ledgers.is_empty() {
        return;
    }
    let host = gpuslice_shm::HostProcesses::read();
    for ledger in ledgers {
        ledger.reclaim(|p| host.alive(p));
    }
}

/// A workload takes the slice: its memory high-water mark starts from what the slice holds now
/// (the slice's ledger, which its containers or `gpuslice run` processes charge, outlives them).
pub fn new_workload(state: &StateDir, id: &str) {
    let path = state.slice_ledger(id);
    if path.exists()
        && let Ok(ledger) = gpuslice_shm::Ledger::open(&path)
    {
        ledger.reset_peak();
    }
}

/// Reads one slice's config.
pub fn read_config(state: &StateDir, id: &str) -> Result<SliceConfig, SliceError> {
    let path = state.slice_config(id);
    let text = std::fs::read(&path).map_err(io(&path))?;
    serde_json::from_slice(&text).map_err(|source| SliceError::Corrupt {
        path: path.display().to_string(),
        source,
    })
}

/// The slices whose configs the agent has written.
pub fn published(state: &StateDir) -> Vec<SliceConfig> {
    let Ok(entries) = std::fs::read_dir(state.slices()) else {
        return Vec::new();
    };
    let mut out: Vec<SliceConfig> = entries
        .flatten()
        .filter_map(|e| read_config(state, &e.file_name().to_string_lossy()).ok())
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_whole_gpu_without_nvmls_memory_has_the_catalogs() {
        let node: gpuslice_api::NodeInventory = serde_yaml::from_str(
            "name: n\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB}\n- {index: 1, model: NVIDIA A100-SXM4-80GB, memory: 40Gi}\n",
        )
        .unwrap();
        let catalog = gpuslice_planning::catalog::model("NVIDIA A100-SXM4-80GB")
            .unwrap()
            .memory_bytes();
        let memory: Vec<u64> = super::configs(&node)
            .iter()
            .map(|c| c.memory_bytes)
            .collect();
        assert_eq!(memory, [catalog, 40 << 30]);
    }
}
