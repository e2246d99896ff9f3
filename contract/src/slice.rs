//! A slice's read-only config, `<state>/slices/<id>/config`: which device it is and what the shim
//! enforces. The agent writes it (mode 0444); the shim, `gpuslice run` and the agent's socket read
//! it.
//!
//! Slice ids: `gpu<i>-s<n>` for software slices, `gpu<i>-mig<start>-<profile>` for MIG instances
//! (stable while the instance keeps its placement), `gpu<i>` for a whole GPU.

use serde::{Deserialize, Serialize};

/// What kind of slice a config describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum SliceKind {
    /// A memory cap and a compute share on a GPU, enforced by the shim and the agent's arbiter.
    Software,
    /// A software slice of a GPU shared through CUDA MPS: the shim caps its memory, the MPS
    /// server its share of the SMs (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`); its processes run at
    /// the same time as their neighbours', so the arbiter gives it no turns.
    Mps,
    /// A MIG instance (hardware isolation).
    Mig,
    /// A whole GPU.
    Exclusive,
}

impl SliceKind {
    /// A slice of a GPU other workloads share, whose memory the shim caps and the agent's
    /// watchdog guards (software and MPS slices).
    pub fn shares_gpu(self) -> bool {
        matches!(self, SliceKind::Software | SliceKind::Mps)
    }
}

/// A slice's config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceConfig {
    pub id: String,
    pub kind: SliceKind,
    /// GPU index on the node.
    pub gpu: u32,
    /// The device the workload sees: the GPU's UUID, or the MIG device's.
    pub device_uuid: String,
    /// The minor number of the GPU's device node (`/dev/nvidia<minor>`), as NVML reports it;
    /// not the index, which is only NVML's enumeration order. Absent when NVML did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_minor: Option<u32>,
    /// Memory cap in bytes (the whole device for MIG and exclusive slices).
    pub memory_bytes: u64,
    /// Compute share in percent of the device.
    pub compute_percent: u32,
}

/// The id of software slice `n` of GPU `gpu`.
pub fn software_slice_id(gpu: u32, n: u32) -> String {
    format!("gpu{gpu}-s{n}")
}

/// The id of the slice a MIG instance is.
pub fn mig_slice_id(gpu: u32, start: u32, profile: &str) -> String {
    format!("gpu{gpu}-mig{start}-{profile}")
}

/// The id of MPS slice `n` of the MIG instance whose slice id is `instance`.
pub fn instance_slice_id(instance: &str, n: u32) -> String {
    format!("{instance}-s{n}")
}

/// The device an MPS slice shares with its neighbours, as a slice id: the whole GPU's
/// (`gpu0` for `gpu0-s1`) or the MIG instance's (`gpu0-mig4-3g.40gb` for `gpu0-mig4-3g.40gb-s1`).
/// Its MPS daemon's folders are named after it.
pub fn mps_device_of(slice: &str) -> &str {
    slice
        .rsplit_once("-s")
        .filter(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .map_or(slice, |(device, _)| device)
}

/// The id of a whole GPU used as one slice.
pub fn gpu_slice_id(gpu: u32) -> String {
    format!("gpu{gpu}")
}
