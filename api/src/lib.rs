//! The gpuslice API: the custom resources a platform team writes in Git (`GpuPool`,
//! `GpuSlicePolicy`, `CheckpointPolicy`), the per-node object the operator and the agent share
//! (`GpuNode`), and the [`NodeInventory`] that describes a node everywhere.
//!
//! Doc comments on fields become the schema descriptions users read in `kubectl explain`; the
//! schema carries the validation Kubernetes can do itself (ranges, patterns, enums, CEL rules).
//! [`admission`] runs that same schema locally so `gpuslice validate` and the API server agree.

pub mod admission;
pub mod checkpoint;
pub mod crd;
pub mod dra;
pub mod layout;
pub mod node;
pub mod policy;
pub mod pool;
pub mod quantity;
pub mod time;

pub use k8s_openapi;
pub use kube::core::Duration;

pub use checkpoint::{
    CheckpointPolicy, CheckpointPolicySpec, CheckpointPolicyStatus, CheckpointStorage, Signal,
};
pub use layout::{
    ExclusiveLayout, Layout, LayoutKind, MigLayout, MigMps, MigPreset, SoftwareLayout,
};
pub use node::{
    AssignedShape, Assignment, DriverVersions, EvictionRequest, GpuAssignment, GpuInventory,
    GpuNode, GpuNodeSpec, GpuNodeStatus, GpuProcess, MigInstance, MigState, NextAssignment,
    NodeInventory, Placement, Preemption, SliceClaim, SoftwareSliceState,
};
pub use policy::{
    ComputeShare, GpuSlicePolicy, GpuSlicePolicySpec, GpuSlicePolicyStatus, HostResources,
    Topology, WorkloadClass,
};
pub use pool::{
    CACHE_ROOT, Compaction, CompactionMove, CompactionStatus, DriverMinimum, Elastic, ElasticDrain,
    ElasticForecast, ElasticPrometheus, ElasticRecut, ElasticShape, ElasticStatus, FairShareStatus,
    FaultIsolation, GpuPool, GpuPoolSpec, GpuPoolStatus, GpuSelector, IoLimits, LocalCache,
    NamespaceUsage, Scheduling, SchedulingPolicy, SliceCounts, TimeWindow, cache_folder,
};
pub use quantity::{QuantityError, Size, bytes_of, format_bytes, millicores_of};
pub use time::{ClockTime, DailyWindow, Weekday, chrono_of, time_of};

/// The API group of every gpuslice kind.
pub const GROUP: &str = "gpuslice.io";
/// The served and stored version.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` as written in YAML.
pub const API_VERSION: &str = "gpuslice.io/v1alpha1";
/// The label a workload's pod template carries to name its `GpuSlicePolicy`.
pub const POLICY_LABEL: &str = "gpuslice.io/policy";
/// The pod volume the chart's admission adds for a CheckpointPolicy's `storage` (a pod may not
/// declare a volume of that name itself: the API server refuses the merged volume).
pub const CHECKPOINT_VOLUME: &str = "gpuslice-checkpoints";

/// `GpuPool.status.activeWindow` while no window is open (a name no window may take).
pub const DEFAULT_WINDOW: &str = "default";

/// The kinds this crate defines, as written in `kind:`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Kind {
    GpuPool,
    GpuSlicePolicy,
    CheckpointPolicy,
    GpuNode,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::GpuPool,
        Kind::GpuSlicePolicy,
        Kind::CheckpointPolicy,
        Kind::GpuNode,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::GpuPool => "GpuPool",
            Kind::GpuSlicePolicy => "GpuSlicePolicy",
            Kind::CheckpointPolicy => "CheckpointPolicy",
            Kind::GpuNode => "GpuNode",
        }
    }

    pub fn from_kind(kind: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == kind)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
