//! How the GPUs of a pool are cut up: hardware MIG partitions, software slices, or whole GPUs.

use std::collections::BTreeMap;

use crate::quantity::Size;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The layout of every selected GPU. Set exactly one of `mig`, `software`, `mps` or `exclusive`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.mig) ? 1 : 0) + (has(self.software) ? 1 : 0) + (has(self.mps) ? 1 : 0) + (has(self.exclusive) ? 1 : 0) == 1").message("set exactly one of mig, software, mps or exclusive"))]
pub struct Layout {
    /// Hardware partitions (Multi-Instance GPU) on MIG-capable models (A100, A30, H100, H200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigLayout>,
    /// Software slices: each GPU is shared by `slices` workloads, each capped at `memory` and `compute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub software: Option<SoftwareLayout>,
    /// Software slices whose workloads share the GPU through CUDA MPS (Multi-Process Service):
    /// the agent runs one MPS control daemon per GPU, and each slice's processes run at the same
    /// time as their neighbours' on `compute` percent of the GPU's SMs
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) instead of taking turns, which keeps an inference
    /// server's latency low beside a busy neighbour. Memory is capped per slice as for
    /// `software`. MPS needs a Volta or newer GPU; one client's GPU fault can take down the other
    /// clients of the same GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<SoftwareLayout>,
    /// Whole GPUs, one workload per GPU, MIG disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclusive: Option<ExclusiveLayout>,
}

/// Which of the four layout kinds a [`Layout`] holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LayoutKind<'a> {
    Mig(&'a MigLayout),
    Software(&'a SoftwareLayout),
    Mps(&'a SoftwareLayout),
    Exclusive,
}

impl Layout {
    /// The single kind this layout holds, or `None` when it sets none or several.
    pub fn kind(&self) -> Option<LayoutKind<'_>> {
        match (&self.mig, &self.software, &self.mps, &self.exclusive) {
            (Some(m), None, None, None) => Some(LayoutKind::Mig(m)),
            (None, Some(s), None, None) => Some(LayoutKind::Software(s)),
            (None, None, Some(s), None) => Some(LayoutKind::Mps(s)),
            (None, None, None, Some(_)) => Some(LayoutKind::Exclusive),
            _ => None,
        }
    }

    pub fn software(slices: u32, memory: &str, compute: u32) -> Layout {
        Layout {
            software: Some(SoftwareLayout {
                slices,
                memory: Size::new(memory),
                compute,
            }),
            ..Layout::default()
        }
    }

    pub fn mig_profiles<'a>(profiles: impl IntoIterator<Item = (&'a str, u32)>) -> Layout {
        Layout {
            mig: Some(MigLayout {
                profiles: profiles
                    .into_iter()
                    .map(|(p, n)| (p.to_string(), n))
                    .collect(),
                preset: None,
                mps: None,
            }),
            ..Layout::default()
        }
    }
}

/// A MIG layout for each GPU: either explicit profile counts or a named preset.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.profiles) && size(self.profiles) > 0) != has(self.preset)").message("set either profiles or preset, not both and not neither"))]
pub struct MigLayout {
    /// GPU-instance profile name → how many instances of it on each GPU, for example
    /// `{"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}`. Names are those `nvidia-smi mig -lgip` prints
    /// for the pool's GPU model; gpuslice chooses the placements.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 8))]
    #[x_kube(validation = Rule::new("self.all(p, self[p] >= 1)").message("each profile count must be at least 1; remove profiles you do not want"))]
    pub profiles: BTreeMap<String, u32>,
    /// A named layout that adapts to each GPU model: `all-1g` (as many 1g instances as fit),
    /// `balanced` (one 3g, one 2g and two 1g; on A30 one 2g and two 1g) or `whole` (one full-GPU instance).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<MigPreset>,
    /// CUDA MPS inside every instance: the agent runs one MPS control daemon per instance, and
    /// each instance is shared by `slices` workloads that run side by side, each on an equal
    /// share of the instance's SMs and memory (memory capped per slice as for `software`).
    /// Without it each instance is one slice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MigMps>,
}

/// How every MIG instance of a layout is shared through CUDA MPS.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MigMps {
    /// MPS slices per instance (2–48): each gets `1/slices` of the instance's SMs and memory.
    #[schemars(range(min = 2, max = 48))]
    pub slices: u32,
}

/// Named MIG layouts that gpuslice expands per GPU model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MigPreset {
    #[serde(rename = "all-1g")]
    All1g,
    #[serde(rename = "balanced")]
    Balanced,
    #[serde(rename = "whole")]
    Whole,
}

/// Software slices of each GPU. Each slice's `memory` is its whole cap, the CUDA context and
/// `memoryHeadroom` included, so `slices × memory` must fit the GPU's memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.slices * self.compute <= 100").message("slices × compute must be at most 100: the compute shares of one GPU's slices cannot add up to more than the whole GPU"))]
pub struct SoftwareLayout {
    /// Number of slices per GPU (1–64).
    #[schemars(range(min = 1, max = 64))]
    pub slices: u32,
    /// Memory cap of each slice, for example `20Gi`.
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("memory must be a positive quantity such as 20Gi"))]
    pub memory: Size,
    /// Compute share of each slice, in percent of the GPU's time (1–100).
    #[schemars(range(min = 1, max = 100))]
    pub compute: u32,
}

/// Whole GPUs: no slicing, one workload per GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExclusiveLayout {}
