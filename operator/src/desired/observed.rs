//! The cluster as the operator read it: what [`super::desired`] is built from.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::{
    CheckpointPolicy, GpuAssignment, GpuNodeSpec, GpuPool, GpuSlicePolicy, NodeInventory,
};

/// What the agent of a node reported, and what it has applied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeReport {
    /// The node's labels (from the Node) and GPUs (from its agent).
    pub inventory: NodeInventory,
    /// `GpuNode.metadata.generation` and `status.appliedGeneration`.
    pub generation: Option<i64>,
    pub applied_generation: Option<i64>,
    /// `status.appliedSwitch`: the staged switch whose layouts the GPUs match, if they do.
    pub applied_switch: Option<DateTime<Utc>>,
    /// The agent's Blocked condition message, when a transition waits for busy instances.
    pub blocked: Option<String>,
    /// `GpuNode.spec.gpus` as written last: a GPU that cannot be planned now keeps it.
    pub assigned: Vec<GpuAssignment>,
}

/// One device allocated to a workload, from a ResourceClaim's allocation.
pub use gpuslice_planning::shaping::Allocated;

/// The cluster as the operator read it.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub pools: Vec<GpuPool>,
    pub policies: Vec<GpuSlicePolicy>,
    /// Every gpuslice device allocated now.
    pub allocated: Vec<Allocated>,
    /// The CheckpointPolicies that exist, by name.
    pub checkpoints: BTreeMap<String, CheckpointPolicy>,
    /// Policy → namespace → its pods waiting in the queue for checkpoint storage whose claim
    /// does not exist in that namespace.
    pub storage_missing: BTreeMap<String, BTreeMap<String, u32>>,
    pub nodes: Vec<NodeReport>,
    /// Policy name → pods naming it that wait in the queue.
    pub waiting: BTreeMap<String, u32>,
    /// Pool → what the Prometheus its elastic set names expects (absent until first read).
    pub prometheus: BTreeMap<String, gpuslice_planning::shaping::Prometheus>,
}

/// What a node's GPUs are to have at `at`, without what is staged for later.
pub(super) fn in_force(gpus: &[GpuAssignment], at: DateTime<Utc>) -> Vec<GpuAssignment> {
    gpus.iter()
        .map(|g| GpuAssignment {
            recut_at: None,
            next: None,
            ..g.in_force(at)
        })
        .collect()
}

/// Whether the node's spec staged a switch that has come by `at` and its agent has not reported
/// the GPUs switched yet.
pub(super) fn switch_pending(report: &NodeReport, at: DateTime<Utc>) -> bool {
    let staged = GpuNodeSpec {
        gpus: report.assigned.clone(),
        ..GpuNodeSpec::default()
    };
    staged
        .last_switch(at)
        .is_some_and(|due| report.applied_switch.is_none_or(|done| done < due))
}
