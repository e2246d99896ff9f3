//! `CheckpointPolicy`: how a workload is asked to save its state before its slice is taken.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use kube::core::Duration;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How workloads checkpoint, and how they are warned before preemption or re-slicing: the signal
/// to send, how long to wait, and whether a workload that cannot checkpoint may be stopped at all.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[kube(
    group = "gpuslice.io",
    version = "v1alpha1",
    kind = "CheckpointPolicy",
    plural = "checkpointpolicies",
    shortname = "ckpt",
    category = "gpuslice",
    status = "CheckpointPolicyStatus",
    printcolumn = r#"{"name":"Signal","type":"string","jsonPath":".spec.signal"}"#,
    printcolumn = r#"{"name":"Grace","type":"string","jsonPath":".spec.gracePeriod"}"#,
    printcolumn = r#"{"name":"Required","type":"boolean","jsonPath":".spec.required"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.maxLoss) || !has(self.interval) || duration(self.maxLoss) >= duration(self.interval)").message("maxLoss must be at least interval: a workload that checkpoints every interval can lose up to one interval of work"))]
pub struct CheckpointPolicySpec {
    /// How often workloads are expected to checkpoint (Go duration, for example `5m`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("interval must be positive"))]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub interval: Option<Duration>,
    /// Signal sent to the workload's processes before preemption or re-slicing. Default `SIGUSR1`.
    #[serde(default)]
    pub signal: Signal,
    /// How long to wait for the checkpoint-done marker after the signal before the slice is taken (Go duration).
    #[x_kube(validation = Rule::new("duration(self) >= duration('0s') && duration(self) <= duration('24h')").message("gracePeriod must be between 0s and 24h"))]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub grace_period: Duration,
    /// When true a workload is never stopped: the transition waits until it exits or checkpoints.
    #[serde(default)]
    pub required: bool,
    /// Most work a workload should lose to a preemption or an elastic re-cut (Go duration); at
    /// least `interval`. Work is the GPU work since its last checkpoint; a workload past its
    /// maxLoss is taken only when no other that fits is within its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(crate::time::DURATION_PATTERN), length(max = 32))]
    pub max_loss: Option<Duration>,
    /// Where checkpoints are written, so that they outlive the pod: the chart's admission mounts
    /// the claim into every container of a pod whose policy uses this CheckpointPolicy and tells
    /// it the path (`GPUSLICE_CHECKPOINT_DIR`); the queue holds a pod until the claim exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<CheckpointStorage>,
}

/// A signal a workload can catch to checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Signal {
    #[default]
    #[serde(rename = "SIGUSR1")]
    Usr1,
    #[serde(rename = "SIGUSR2")]
    Usr2,
    #[serde(rename = "SIGTERM")]
    Term,
    #[serde(rename = "SIGINT")]
    Int,
    #[serde(rename = "SIGHUP")]
    Hup,
}

impl Signal {
    /// Its name, as the API spells it (`SIGUSR1`).
    pub fn name(self) -> &'static str {
        match self {
            Signal::Usr1 => "SIGUSR1",
            Signal::Usr2 => "SIGUSR2",
            Signal::Term => "SIGTERM",
            Signal::Int => "SIGINT",
            Signal::Hup => "SIGHUP",
        }
    }

    /// The signal number on Linux.
    pub fn number(self) -> i32 {
        match self {
            Signal::Usr1 => 10,
            Signal::Usr2 => 12,
            Signal::Term => 15,
            Signal::Int => 2,
            Signal::Hup => 1,
        }
    }
}

/// Storage mounted into workloads for their checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointStorage {
    /// Name of a PersistentVolumeClaim in the workload's namespace. Without one nothing is
    /// mounted: the pod mounts a volume at `mountPath` itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<String>,
    /// Absolute path at which the storage is mounted in the workload's containers.
    #[schemars(length(max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("mountPath must be absolute"))]
    pub mount_path: String,
}

/// What the operator resolved for the checkpoint policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointPolicyStatus {
    /// `Ready`: `InUse` (the policies and pools whose workloads it drains), `Unused`, or not
    /// Ready with `StorageClaimMissing` (the namespaces where pods wait for its storage claim).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
