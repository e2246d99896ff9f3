//! `GpuNode` (one per Kubernetes node: the layout the operator wants, the state the agent sees)
//! and [`NodeInventory`], the one description of a node and its GPUs used everywhere: the
//! `gpuslice plan --nodes` file, the emulator's seed, the placement engine's input and
//! `GpuNode.status`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use kube::core::Duration;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::layout::Layout;

/// The GPUs of one node: the layout the operator wants on each (spec) and what the node agent
/// observed and applied (status). Named after the node; written by the operator (spec) and the
/// agent (status), each with its own field manager.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpuslice.io",
    version = "v1alpha1",
    kind = "GpuNode",
    plural = "gpunodes",
    shortname = "gnode",
    category = "gpuslice",
    status = "GpuNodeStatus",
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.gpuCount"}"#,
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".metadata.generation","description":"Generation of the layout the operator wants"}"#,
    printcolumn = r#"{"name":"Applied","type":"integer","jsonPath":".status.appliedGeneration","description":"Generation of the layout the agent has applied"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Blocked","type":"string","jsonPath":".status.conditions[?(@.type==\"Blocked\")].message","description":"What keeps the agent from applying the layout (busy slices), if anything"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSpec {
    /// The desired layout of each GPU of the node that belongs to a pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["index"]))]
    pub gpus: Vec<GpuAssignment>,
    /// Git commit (or other revision) of the configuration this desired state came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_revision: Option<String>,
    /// Pods' slices the operator's queue takes back for waiting pods of higher priority or of a
    /// namespace below its fair share. The agent drains each as its CheckpointPolicy says (the
    /// signal, the checkpoint-done marker or the grace period, then the Eviction API). Written
    /// by the queue under its own field manager.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["resourceClaim"]))]
    pub preemptions: Vec<Preemption>,
    /// GPUs (indices) that compaction is emptying: the agent gives each of their devices the
    /// `NoSchedule` device taint `gpuslice.io/compacting`, so that the workloads moved off them
    /// (and any new pod) are placed elsewhere. Written by the queue under its own field manager,
    /// with the moves themselves in `preemptions`; cleared once the moved workloads run again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "set"))]
    pub compacting: Vec<u32>,
}

/// A pod's slice taken back for a waiting pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Preemption {
    /// The ResourceClaim (`namespace/name`) whose slice is taken.
    #[schemars(length(max = 507))]
    pub resource_claim: String,
    /// The waiting pod the slice is for (`namespace/name`); empty when compaction moves the
    /// pod to free its GPU (the pod is evicted and its controller's replacement is placed on
    /// another GPU).
    #[schemars(length(max = 507))]
    pub for_pod: String,
    /// Why, in words (said in the Event on the preempted pod).
    #[schemars(length(max = 1024))]
    pub reason: String,
}

/// What a GPU is given: its pool, the layout the pool's window (or default) declares, and how
/// its slices are shared and drained. The same in `GpuNode.spec` now and in what is staged next.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Assignment {
    /// The pool the GPU belongs to.
    #[schemars(length(max = 253))]
    pub pool: String,
    /// The window whose layout this is; empty for the pool's default layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    /// The layout to apply.
    pub layout: Layout,
    /// Minimum compute time slice for software slices on this GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub time_slice: Option<Duration>,
    /// The pool's CheckpointPolicy: how the agent drains a workload on this GPU whose own
    /// GpuSlicePolicy names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub checkpoint_policy: Option<String>,
    /// The shape of the pool's elastic set this layout is, and since when; absent outside
    /// elastic pools. The operator reads it back to keep each GPU in its shape for `minDwell`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<AssignedShape>,
}

/// The elastic shape a GPU is given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AssignedShape {
    /// Name of the shape in the elastic set in force.
    #[schemars(length(max = 63))]
    pub name: String,
    /// When the GPU was re-cut to it; absent when it had the shape's layout already as the
    /// elastic set came into force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
}

/// The desired layout of one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuAssignment {
    /// GPU index on the node.
    pub index: u32,
    /// GPU UUID, when known; the agent refuses to apply when the GPU at `index` has another UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(flatten)]
    pub assigned: Assignment,
    /// When the pool's next window change gives this GPU another layout. The agent taints the
    /// GPU's DRA devices (`gpuslice.io/recut`, NoSchedule) a lookahead before it, so that no new
    /// pod lands on a slice about to be re-cut. Absent when the next change leaves it as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recut_at: Option<Time>,
    /// The assignment the pool's next window change gives this GPU, written ahead of it: the
    /// agent switches to it on its own clock at `next.at`, so that a window change needs no
    /// write to a thousand GpuNodes at the boundary; the operator catches `spec` up afterwards.
    /// Absent when the next change leaves the GPU as it is (or takes it out of every pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<NextAssignment>,
}

/// What a GPU becomes at the pool's next window change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NextAssignment {
    /// When it takes over (the window boundary).
    pub at: Time,
    #[serde(flatten)]
    pub assigned: Assignment,
}

impl GpuAssignment {
    /// The assignment in force at `at`: the staged `next` once its time has come (with no
    /// re-cut or further change known until the operator writes them), this one before.
    pub fn in_force(&self, at: chrono::DateTime<chrono::Utc>) -> GpuAssignment {
        match &self.next {
            Some(next) if crate::chrono_of(&next.at).is_some_and(|t| t <= at) => GpuAssignment {
                index: self.index,
                uuid: self.uuid.clone(),
                assigned: next.assigned.clone(),
                recut_at: None,
                next: None,
            },
            _ => self.clone(),
        }
    }
}

impl GpuNodeSpec {
    /// The spec with each GPU's assignment in force at `at` (see [`GpuAssignment::in_force`]).
    pub fn in_force(&self, at: chrono::DateTime<chrono::Utc>) -> GpuNodeSpec {
        GpuNodeSpec {
            gpus: self.gpus.iter().map(|g| g.in_force(at)).collect(),
            ..self.clone()
        }
    }

    /// The latest staged switch made by `at` (the assignments in force differ from the spec's
    /// own since then).
    pub fn last_switch(
        &self,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Option<chrono::DateTime<chrono::Utc>> {
        self.gpus
            .iter()
            .filter_map(|g| crate::chrono_of(&g.next.as_ref()?.at))
            .filter(|t| *t <= at)
            .max()
    }

    /// The earliest staged switch still ahead of `at`.
    pub fn next_switch(
        &self,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Option<chrono::DateTime<chrono::Utc>> {
        self.gpus
            .iter()
            .filter_map(|g| crate::chrono_of(&g.next.as_ref()?.at))
            .filter(|t| *t > at)
            .min()
    }
}

/// What the node agent observed and applied.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeStatus {
    /// The node's GPUs as NVML reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inventory: Option<NodeInventory>,
    /// How many GPUs NVML reports (for `kubectl get gpunodes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_count: Option<u32>,
    /// The `metadata.generation` of the spec the GPUs now match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_generation: Option<i64>,
    /// When the GPUs match the layouts staged in `spec.gpus[].next` rather than the spec's own
    /// (the agent switched at a window boundary before the operator wrote the new layouts as
    /// the spec): that boundary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_switch: Option<Time>,
    /// `Ready` and `Blocked` (a transition waits for busy instances), with reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The slices held now: by pods (a ResourceClaim the kubelet had the agent prepare) or by
    /// `gpuslice run` on the node. A held slice is busy: a window change waits for it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024))]
    pub claims: Vec<SliceClaim>,
    /// Pods the agent needs gone to take their slices back (a preemption, a window change, a
    /// compaction or a GPU fault), each once its checkpoint is taken or its grace is over. The
    /// operator evicts them through the Eviction API (their disruption budgets and grace periods
    /// apply) after checking that each runs on this node: agents may not evict pods themselves,
    /// so a compromised one reaches no pod beyond its node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024))]
    pub evictions: Vec<EvictionRequest>,
}

/// A pod the agent asks the operator to evict.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EvictionRequest {
    /// The pod (`namespace/name`); empty when the agent knows only its UID (a process's
    /// cgroup), and the operator finds it among the node's pods.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod: String,
    /// The pod's UID: a pod of the same name made again is not evicted for the old one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// Why: `window`, `preemption`, `compaction`, `fault`, or `stray` (a process of the pod
    /// used a pool's GPU past every slice).
    pub cause: String,
    /// Whether it checkpointed: `taken`, `grace_over` or `none`.
    pub checkpoint: String,
    /// What the pod's Event says.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Who holds a slice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SliceClaim {
    /// The slice id (`gpu0-s1`, `gpu1-mig4-1g.18gb`, `gpu2`).
    pub slice: String,
    /// The ResourceClaim (`namespace/name`), for a pod's slice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claim: Option<String>,
    /// The pods the claim is reserved for (`namespace/name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// The process holding it, for `gpuslice run`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// The GpuSlicePolicy it was asked with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// When the workload last wrote its checkpoint-done marker (what a preemption would lose is
    /// the work since then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<Time>,
    /// Since when the slice's processes have not held the GPU, once that is a minute or more;
    /// absent while they compute. A drain loses at most the GPU work between `lastCheckpoint`
    /// and this: none when the workload has been idle since its last checkpoint. Only software
    /// slices are timed (the agent's compute arbiter); a MIG instance or a whole GPU never
    /// shows it, and counts as computing. (GPU time per slice: the agent's metric
    /// `gpuslice_agent_slice_compute_used_seconds_total`.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since: Option<Time>,
    /// What the agent is doing to take the slice back (a window change or a preemption), when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining: Option<String>,
}

/// A node and its GPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInventory {
    /// Node name.
    pub name: String,
    /// Node labels (what pools select on).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Allocatable CPU of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Quantity>,
    /// Allocatable memory of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    /// The node's NVIDIA driver as NVML reports it (absent where nobody read it, as in a
    /// hand-written inventory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverVersions>,
    /// The node's GPUs.
    #[serde(default)]
    pub gpus: Vec<GpuInventory>,
}

/// The NVIDIA driver of a node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverVersions {
    /// The driver version, for example `550.54.15` (`nvidia-smi`'s "Driver Version").
    #[schemars(length(max = 64))]
    pub version: String,
    /// The newest CUDA version the driver supports, `major.minor`, for example `12.4`
    /// (`nvidia-smi`'s "CUDA Version").
    #[schemars(length(max = 16))]
    pub cuda: String,
}

/// One physical GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuInventory {
    /// Index on the node.
    pub index: u32,
    /// The minor number of the GPU's device node (`/dev/nvidia<minor>`), as NVML reports it;
    /// it need not equal the index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    /// UUID (`GPU-…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Model name as NVML reports it, for example `NVIDIA H200`.
    pub model: String,
    /// Usable memory as NVML reports it; the catalog's figure for the model when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    /// CUDA compute capability (`major.minor`, for example `9.0`), as NVML reports it; absent
    /// when it did not say. An `mps` layout needs 7.0 (Volta) or newer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<String>,
    /// MIG mode and instances; absent when MIG is disabled or unsupported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigState>,
    /// Software slices currently configured on the GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slices: Vec<SoftwareSliceState>,
    /// Processes running on the whole GPU (outside MIG instances).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<GpuProcess>,
    /// The GPUs of the node (indices) this one reaches over NVLink, as NVML's peer-to-peer
    /// status says; empty on a GPU without NVLink. Its slices carry the DRA attribute
    /// `nvlinkDomain` (the UUID of the lowest-indexed GPU it is joined with).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink_peers: Vec<u32>,
}

/// MIG mode of a GPU and its GPU instances.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigState {
    /// Whether MIG mode is enabled.
    pub enabled: bool,
    /// GPU instances, each with its placement.
    #[serde(default)]
    pub instances: Vec<MigInstance>,
}

/// One GPU instance (with its compute instance).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigInstance {
    /// Profile name, for example `3g.71gb`.
    pub profile: String,
    /// Memory slices the instance occupies.
    pub placement: Placement,
    /// MIG device UUID (`MIG-…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Processes using the instance; an instance with processes is busy and is never destroyed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<GpuProcess>,
    /// The instance's MPS slices (layout `mig.mps`); empty when the instance is one slice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slices: Vec<SoftwareSliceState>,
}

/// A MIG placement: the first memory slice and how many it spans.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub struct Placement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

/// A software slice configured on a GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SoftwareSliceState {
    /// Slice id, unique on the node.
    pub id: String,
    /// Memory cap.
    pub memory: Quantity,
    /// Compute share in percent.
    pub compute: u32,
    /// The GPU's slices share it through CUDA MPS (layout `mps`) rather than by taking turns.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mps: bool,
    /// Processes holding the slice; a slice with a claim is busy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<GpuProcess>,
}

/// A process using GPU memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuProcess {
    /// Process id on the node.
    pub pid: u32,
    /// GPU memory the process uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    /// Process name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}
