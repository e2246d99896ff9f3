//! `GpuSlicePolicy`: what a workload asks for, referenced by name from its pod template label.

use crate::quantity::Size;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// A named request for a slice of a pool's GPUs. Workloads use it by carrying the label
/// `gpuslice.io/policy: <name>` on their pod template.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[kube(
    group = "gpuslice.io",
    version = "v1alpha1",
    kind = "GpuSlicePolicy",
    plural = "gpuslicepolicies",
    shortname = "gsp",
    category = "gpuslice",
    status = "GpuSlicePolicyStatus",
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".spec.pool"}"#,
    printcolumn = r#"{"name":"Class","type":"string","jsonPath":".spec.class","priority":1}"#,
    printcolumn = r#"{"name":"Memory","type":"string","jsonPath":".spec.memory"}"#,
    printcolumn = r#"{"name":"Limit","type":"integer","jsonPath":".spec.compute.limit"}"#,
    printcolumn = r#"{"name":"Guarantee","type":"integer","jsonPath":".spec.compute.guarantee"}"#,
    printcolumn = r#"{"name":"Priority","type":"string","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Allocated","type":"integer","jsonPath":".status.allocated"}"#,
    printcolumn = r#"{"name":"Waiting","type":"integer","jsonPath":".status.waiting"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuSlicePolicySpec {
    /// Name of the `GpuPool` whose slices this policy uses.
    #[schemars(length(min = 1))]
    pub pool: String,
    /// GPU memory the workload needs. It is placed on the smallest slice whose memory holds this
    /// plus the pool's `memoryHeadroom`.
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("memory must be a positive quantity such as 18Gi"))]
    pub memory: Size,
    /// Compute share in percent of a GPU: a cap, and optionally a guarantee under contention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<ComputeShare>,
    /// Number of slices each workload (pod) gets, all on one node: the queue admits a pod only
    /// when that many fitting slices are free on one node (never some of them). In a cluster a
    /// labelled pod's first container gets `gpuslice.io/<policy>: <count>`. Default 1.
    /// More than one needs a pool whose slices are whole GPUs or MIG instances: a container
    /// is capped to one software slice.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub count: u32,
    /// Where a pod's `count` slices must be: `nvlink` keeps them on GPUs of one NVLink domain
    /// (device attribute `gpuslice.io/nvlinkDomain`), so a pod is never given a PCIe-only set.
    /// Omitted: any GPUs of one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
    /// `low`, `normal` or `high`, or the name of a PriorityClass. Default `normal`.
    #[serde(default = "normal")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$') && self.size() <= 253").message("priority must be low, normal, high or a PriorityClass name (lowercase DNS name)"))]
    pub priority: String,
    /// Whether higher-priority work may preempt this workload (after its checkpoint signal). Default true.
    #[serde(default = "yes")]
    pub preemptible: bool,
    /// Name of the `CheckpointPolicy` for this workload; the pool's applies when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_policy: Option<String>,
    /// Namespaces whose workloads may use this policy; every namespace when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// What kind of work uses this policy: `training`, `inference` or `interactive`. It becomes
    /// the `class` label of the policy's and its slices' metrics, so that dashboards can put
    /// training beside inference; it changes no placement, limit or priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<WorkloadClass>,
    /// Host CPU and memory that come with each slice. In a cluster they become the requests
    /// of the pod's first container at admission (unless it requests CPU or memory itself);
    /// a `gpuslice run` command is held to them in a cgroup (CPU time by CFS quota, whole cores
    /// also as a cpuset of their own; memory as a hard limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostResources>,
}

/// Host CPU and memory per slice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostResources {
    /// CPU, as Kubernetes writes it (`4`, `500m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("cpu must be a positive quantity such as 4 or 500m"))]
    pub cpu: Option<Size>,
    /// Memory (`64Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))").message("memory must be a positive quantity such as 64Gi"))]
    pub memory: Option<Size>,
}

/// A placement constraint on a pod's slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// All on GPUs joined by NVLink (one NVLink domain).
    Nvlink,
}

/// The kind of work a policy is for (a metrics label only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadClass {
    Training,
    Inference,
    Interactive,
}

impl WorkloadClass {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadClass::Training => "training",
            WorkloadClass::Inference => "inference",
            WorkloadClass::Interactive => "interactive",
        }
    }
}

impl GpuSlicePolicySpec {
    /// The CheckpointPolicy that drains its workloads: its own, else its pool's (`pools` may
    /// hold any pools; the one named `spec.pool` is used).
    pub fn checkpoint_policy_in<'a>(
        &'a self,
        pools: impl IntoIterator<Item = &'a crate::GpuPool>,
    ) -> Option<&'a str> {
        self.checkpoint_policy.as_deref().or_else(|| {
            pools
                .into_iter()
                .find(|p| p.metadata.name.as_deref() == Some(self.pool.as_str()))?
                .spec
                .checkpoint_policy
                .as_deref()
        })
    }
}

fn one() -> u32 {
    1
}
fn normal() -> String {
    "normal".to_string()
}
fn yes() -> bool {
    true
}

/// A compute share, in percent of one GPU's time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.guarantee) || self.guarantee <= self.limit").message("guarantee must not exceed limit"))]
pub struct ComputeShare {
    /// Cap: the workload never gets more than this share, even on an idle GPU (1–100).
    #[schemars(range(min = 1, max = 100))]
    pub limit: u32,
    /// Floor: the share the workload gets whenever it has work queued and the GPU is contended (0–100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub guarantee: Option<u32>,
}

/// What the operator resolved for the policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSlicePolicyStatus {
    /// `Ready` (the pool and checkpoint policy exist and a slice fits) with a reason and message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Slices allocated now to workloads that use this policy (through its DeviceClass).
    #[serde(default)]
    pub allocated: u32,
    /// Pods naming this policy that wait in the operator's queue (scheduling gate
    /// `gpuslice.io/queue`); each says where it stands in its condition `gpuslice.io/Queued`.
    #[serde(default)]
    pub waiting: u32,
}
