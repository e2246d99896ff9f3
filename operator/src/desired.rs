//! The operator's pure core: from the cluster as read (pools, checkpoint policies, nodes with the
//! GPUs their agents reported) to what should be written — each node's `GpuNode.spec` and each
//! pool's status. No I/O: the controller reads, calls [`desired`], and applies.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use gpuslice_api::{
    GpuAssignment, GpuNodeSpec, GpuPool, GpuPoolStatus, GpuSlicePolicy, GpuSlicePolicyStatus,
    Layout, NextAssignment, NodeInventory, SliceCounts,
};
use gpuslice_planning::cluster::{ClusterPlan, GpuPlan, NodePlan, PoolTiming, plan_cluster};
use gpuslice_planning::transition::Desired;
use gpuslice_runtime::conditions::condition;

use gpuslice_planning::shaping::{Shaped, ShapedGpu};
use k8s_openapi::api::resource::v1::DeviceClass;

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
    /// Names of the CheckpointPolicies that exist.
    pub checkpoint_policies: BTreeSet<String>,
    pub nodes: Vec<NodeReport>,
    /// Policy name → pods naming it that wait in the queue.
    pub waiting: BTreeMap<String, u32>,
    /// Pool → what the Prometheus its elastic set names expects (absent until first read).
    pub prometheus: BTreeMap<String, gpuslice_planning::shaping::Prometheus>,
}

/// What should be written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DesiredState {
    /// Node name → the desired `GpuNode.spec` (only nodes whose agent reported GPUs).
    pub node_specs: BTreeMap<String, GpuNodeSpec>,
    /// Pool name → its status (conditions without transition times; the controller keeps those).
    pub pool_status: BTreeMap<String, GpuPoolStatus>,
    /// GpuSlicePolicy name → its status.
    pub policy_status: BTreeMap<String, GpuSlicePolicyStatus>,
    /// DeviceClass name → the class of a policy.
    pub device_classes: BTreeMap<String, DeviceClass>,
    /// When a window opens or closes next: reconcile again then.
    pub next_change: Option<DateTime<Utc>>,
}

/// How long after a staged switch the operator writes the layout the agents switched to
/// themselves: the boundary's writes (each agent's ResourceSlices and status) go first, and the
/// spec catches up once they are done.
pub const CATCH_UP_AFTER: chrono::TimeDelta = chrono::TimeDelta::seconds(20);

/// When writing `desired` over `current` only catches the spec up with a switch its agent made
/// by itself at a staged `next` (the GPUs in force at `at` are already the desired ones): the
/// time to write it; `None` when the write changes what is in force and is due now.
pub fn catch_up_due(
    current: &GpuNodeSpec,
    desired: &GpuNodeSpec,
    at: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    let switched = current.last_switch(at)?;
    (in_force(&current.gpus, at) == in_force(&desired.gpus, at)
        && current.source_revision == desired.source_revision)
        .then_some(switched + CATCH_UP_AFTER)
}

/// What a node's GPUs are to have at `at`, without what is staged for later.
fn in_force(gpus: &[GpuAssignment], at: DateTime<Utc>) -> Vec<GpuAssignment> {
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
fn switch_pending(report: &NodeReport, at: DateTime<Utc>) -> bool {
    let staged = GpuNodeSpec {
        gpus: report.assigned.clone(),
        ..GpuNodeSpec::default()
    };
    staged
        .last_switch(at)
        .is_some_and(|due| report.applied_switch.is_none_or(|done| done < due))
}

/// Builds the desired state at `at`.
pub fn desired(observed: &Observed, at: DateTime<Utc>) -> DesiredState {
    let inventories: Vec<NodeInventory> =
        observed.nodes.iter().map(|n| n.inventory.clone()).collect();
    let mut plan = plan_cluster(&observed.pools, &inventories, at);
    let shaped = crate::elastic::shape(observed, &mut plan, at);
    let mut out = DesiredState {
        next_change: plan
            .pools
            .iter()
            .filter_map(|p| p.next_change)
            .chain(shaped.next_look)
            .min(),
        device_classes: crate::classes::device_classes(
            &observed.policies,
            &observed.pools,
            crate::MANAGER,
        ),
        ..DesiredState::default()
    };
    let later = Later::plan(observed, &inventories, &plan);
    for (position, node) in plan.nodes.iter().enumerate() {
        out.node_specs.insert(
            node.node.clone(),
            GpuNodeSpec {
                gpus: node_gpus(observed, &later, &shaped, position, node, at),
                source_revision: None,
                // The queue's, under its own field manager.
                preemptions: Vec::new(),
                compacting: Vec::new(),
            },
        );
    }
    for (pool, timing) in observed.pools.iter().zip(&plan.pools) {
        let name = pool.metadata.name.clone().unwrap_or_default();
        let mut status = pool_status(observed, &plan, &out.node_specs, pool, timing, at);
        status.elastic = shaped.status.get(&name).cloned();
        out.pool_status.insert(name, status);
    }
    for policy in &observed.policies {
        let name = policy.metadata.name.clone().unwrap_or_default();
        let status = policy_status(observed, &plan, policy);
        out.policy_status.insert(name, status);
    }
    out
}

/// Each pool's next window change, and the plan at each such time (one per distinct
/// boundary), to tell which GPUs a pool's own next change re-cuts and what it gives them.
struct Later<'a> {
    /// Pool name → its next window change.
    pool_next: BTreeMap<&'a str, DateTime<Utc>>,
    /// The cluster's plan at each of those times.
    plans: BTreeMap<DateTime<Utc>, ClusterPlan>,
}

impl<'a> Later<'a> {
    /// Plans the cluster at each pool's next window change of `plan`.
    fn plan(
        observed: &Observed,
        inventories: &[NodeInventory],
        plan: &'a ClusterPlan,
    ) -> Later<'a> {
        let pool_next: BTreeMap<&str, DateTime<Utc>> = plan
            .pools
            .iter()
            .filter_map(|p| Some((p.pool.as_str(), p.next_change?)))
            .collect();
        let plans: BTreeMap<DateTime<Utc>, ClusterPlan> = pool_next
            .values()
            .copied()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(|t| (t, plan_cluster(&observed.pools, inventories, t)))
            .collect();
        Later { pool_next, plans }
    }

    /// When the pool of `g` (a GPU of `node`, at `position` in the plan) next changes, and the
    /// GPU as the plan then has it.
    fn gpu(
        &self,
        position: usize,
        node: &NodePlan,
        g: &GpuPlan,
    ) -> (Option<&DateTime<Utc>>, Option<&GpuPlan>) {
        // The plans are of the same inventories, in the same order.
        let later_node = |at: &DateTime<Utc>| {
            self.plans
                .get(at)
                .and_then(|l| l.nodes.get(position))
                .filter(|n| n.node == node.node)
        };
        let next_at = g.pool().and_then(|p| self.pool_next.get(p));
        let then = next_at
            .and_then(later_node)
            .and_then(|n| n.gpus.iter().find(|x| x.index == g.index));
        (next_at, then)
    }
}

/// The GPUs a planned `node` (at `position` in the plan) is to have, as its spec lists them.
fn node_gpus(
    observed: &Observed,
    later: &Later,
    shaped: &Shaped,
    position: usize,
    node: &NodePlan,
    at: DateTime<Utc>,
) -> Vec<GpuAssignment> {
    let assigned = observed
        .nodes
        .iter()
        .find(|n| n.inventory.name == node.node)
        .map(|n| n.assigned.as_slice())
        .unwrap_or_default();
    node.gpus
        .iter()
        .filter_map(|g| {
            // A GPU that cannot be planned now (pools overlap, a layout it cannot hold)
            // keeps the layout it was last given: the last good state stays in force, and
            // the pool says what is wrong.
            if g.error.is_some() {
                return assigned
                    .iter()
                    .find(|a| a.index == g.index)
                    .map(|a| a.in_force(at));
            }
            let (next_at, then) = later.gpu(position, node, g);
            match shaped.gpus.get(&(node.node.clone(), g.index)) {
                Some(s) if s.next.is_some() || elastic_then(observed, then) => {
                    Some(elastic_assignment(g, s))
                }
                _ => gpu_assignment(g, next_at, then),
            }
        })
        .collect()
}

/// The assignment of a planned GPU `g` (none outside every pool): what it has now, when its
/// pool's next change (`next_at`) re-cuts it, and what it gets `then`, staged ahead.
fn gpu_assignment(
    g: &GpuPlan,
    next_at: Option<&DateTime<Utc>>,
    then: Option<&GpuPlan>,
) -> Option<GpuAssignment> {
    let recut = then.is_some_and(|x| layout_and_pool(x) != layout_and_pool(g));
    // Staged ahead, so that the agents switch at the boundary by themselves.
    let next = then
        .filter(|x| x.error.is_none() && x.assigned != g.assigned)
        .and_then(|x| {
            Some(NextAssignment {
                at: gpuslice_api::time_of(*next_at?)?,
                assigned: x.assigned.clone()?,
            })
        });
    Some(GpuAssignment {
        index: g.index,
        uuid: g.uuid.clone(),
        assigned: g.assigned.clone()?,
        recut_at: next_at
            .filter(|_| recut)
            .and_then(|t| gpuslice_api::time_of(*t)),
        next,
    })
}

/// Whether the GPU as planned `then` (at its pool's next window change) is under an elastic
/// set: that set shapes it after the change, so nothing is staged for the change itself.
fn elastic_then(observed: &Observed, then: Option<&GpuPlan>) -> bool {
    let Some(assigned) = then.and_then(|t| t.assigned.as_ref()) else {
        return false;
    };
    observed
        .pools
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(assigned.pool.as_str()))
        .is_some_and(|p| {
            gpuslice_planning::shaping::set_in_force(p, assigned.window.as_deref()).is_some()
        })
}

/// The assignment of a GPU an elastic set shapes: its shape now, and a re-cut staged.
fn elastic_assignment(g: &GpuPlan, s: &ShapedGpu) -> GpuAssignment {
    GpuAssignment {
        index: g.index,
        uuid: g.uuid.clone(),
        assigned: s.now.clone(),
        recut_at: s.next.as_ref().map(|n| n.at.clone()),
        next: s.next.clone(),
    }
}

/// The layout a planned GPU is given, and its pool (none outside every pool).
fn layout_and_pool(g: &GpuPlan) -> Option<(&Layout, &str)> {
    g.assigned.as_ref().map(|a| (&a.layout, a.pool.as_str()))
}

/// The status of `pool` (`timing`: its window in force and next change), the nodes' specs
/// as this pass writes them.
fn pool_status(
    observed: &Observed,
    plan: &ClusterPlan,
    node_specs: &BTreeMap<String, GpuNodeSpec>,
    pool: &GpuPool,
    timing: &PoolTiming,
    at: DateTime<Utc>,
) -> GpuPoolStatus {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let generation = pool.metadata.generation;
    let problems = pool_problems(observed, plan, pool, &name);
    let held = Footprint::of(observed, plan, node_specs, &name, at);
    let outdated = driver_outdated(observed, pool, &name, &held.nodes);
    let mut conditions = pool_conditions(&problems, &outdated, &held, generation);
    if let Some(source) = crate::signals::prometheus_of(pool, at) {
        conditions.push(prometheus_condition(
            source,
            observed.prometheus.get(&name),
            generation,
        ));
    }
    let allocated = observed
        .allocated
        .iter()
        .filter(|a| a.pool.as_deref() == Some(name.as_str()))
        .count() as u32;
    GpuPoolStatus {
        conditions,
        observed_generation: generation,
        active_window: Some(
            timing
                .window
                .clone()
                .unwrap_or_else(|| gpuslice_api::DEFAULT_WINDOW.into()),
        ),
        next_transition: timing.next_change.and_then(gpuslice_api::time_of),
        nodes: held.nodes.len() as u32,
        gpus: held.gpus,
        slices: SliceCounts {
            total: held.slices,
            allocated,
            free: held.slices.saturating_sub(allocated),
        },
        driver_outdated: outdated.len() as u32,
        fair_share: None,
        compaction: None,
        elastic: None,
    }
}

/// `ElasticSignal`: whether the Prometheus the pool's elastic set names answered, and what it
/// expects; while it does not, the other signals stay in force.
fn prometheus_condition(
    source: &gpuslice_api::ElasticPrometheus,
    answer: Option<&gpuslice_planning::shaping::Prometheus>,
    generation: Option<i64>,
) -> Condition {
    let fallback = "the queue and the learned forecast stay in force";
    match answer {
        Some(Ok(expected)) => {
            let listed: Vec<String> = expected.iter().map(|(p, n)| format!("{p} {n}")).collect();
            condition(
                "ElasticSignal",
                true,
                "PrometheusRead",
                format!(
                    "Prometheus {} expects {}",
                    source.url,
                    if listed.is_empty() {
                        "no pods of any policy (no sample carries a `policy` label)".to_string()
                    } else {
                        listed.join(", ")
                    }
                ),
                generation,
            )
        }
        Some(Err(why)) => condition(
            "ElasticSignal",
            false,
            "PrometheusUnavailable",
            format!("{why}; {fallback}"),
            generation,
        ),
        None => condition(
            "ElasticSignal",
            false,
            "PrometheusNotReadYet",
            format!("Prometheus {} not read yet; {fallback}", source.url),
            generation,
        ),
    }
}

/// What is wrong with the pool `name`: a CheckpointPolicy it names that does not exist, and
/// the GPUs that cannot be planned for it (sorted, each once).
fn pool_problems(
    observed: &Observed,
    plan: &ClusterPlan,
    pool: &GpuPool,
    name: &str,
) -> Vec<String> {
    let mut problems: Vec<String> = Vec::new();
    if let Some(cp) = &pool.spec.checkpoint_policy
        && !observed.checkpoint_policies.contains(cp)
    {
        problems.push(format!(
            "spec.checkpointPolicy: CheckpointPolicy {cp:?} does not exist; create it or remove the reference"
        ));
    }
    for node in &plan.nodes {
        for g in &node.gpus {
            let claimed = g.pool() == Some(name);
            if let Some(e) = &g.error
                && (claimed || e.pools().contains(&name))
            {
                problems.push(format!("node {} GPU {}: {e}", node.node, g.index));
            }
        }
    }
    problems.sort();
    problems.dedup();
    problems
}

/// What a pool holds in the plan, and where its nodes stand with the layout.
struct Footprint {
    /// The nodes with a GPU of the pool.
    nodes: BTreeSet<String>,
    gpus: u32,
    slices: u32,
    /// The nodes whose agent has not applied what they are to have now.
    waiting: Vec<String>,
    /// `node: why` of the nodes whose transition waits for busy instances.
    blocked: Vec<String>,
}

impl Footprint {
    /// The GPUs of the pool `name` in the plan, and where their nodes' agents stand with the
    /// specs this pass writes (`node_specs`).
    fn of(
        observed: &Observed,
        plan: &ClusterPlan,
        node_specs: &BTreeMap<String, GpuNodeSpec>,
        name: &str,
        at: DateTime<Utc>,
    ) -> Footprint {
        let mut held = Footprint {
            nodes: BTreeSet::new(),
            gpus: 0,
            slices: 0,
            waiting: Vec::new(),
            blocked: Vec::new(),
        };
        for node in &plan.nodes {
            let report = observed
                .nodes
                .iter()
                .find(|n| n.inventory.name == node.node);
            for g in node.gpus.iter().filter(|g| g.pool() == Some(name)) {
                held.nodes.insert(node.node.clone());
                held.gpus += 1;
                held.slices += match &g.desired {
                    Some(Desired::Mig(counts)) => counts.values().sum(),
                    Some(Desired::Software(table)) => table.slices,
                    Some(Desired::Exclusive) => 1,
                    None => 0,
                };
            }
            if held.nodes.contains(&node.node)
                && let Some(r) = report
            {
                // The spec this pass writes changes what the node is to have now: its agent
                // has not applied that, whatever generation it reported.
                let respecified = node_specs
                    .get(&node.node)
                    .is_some_and(|spec| in_force(&spec.gpus, at) != in_force(&r.assigned, at));
                if let Some(b) = &r.blocked {
                    held.blocked.push(format!("{}: {b}", node.node));
                } else if respecified
                    || r.applied_generation.is_none()
                    || r.applied_generation < r.generation
                    || switch_pending(r, at)
                {
                    held.waiting.push(node.node.clone());
                }
            }
        }
        held
    }
}

/// The pool's `nodes` whose reported driver falls short of the pool's minimum, each with why.
fn driver_outdated(
    observed: &Observed,
    pool: &GpuPool,
    name: &str,
    nodes: &BTreeSet<String>,
) -> Vec<String> {
    // The agents enforce it (DriverSupported on each GpuNode); the pool counts the nodes
    // whose reported driver falls short.
    let minimum = pool.spec.driver.as_ref().map(|m| (name, m));
    observed
        .nodes
        .iter()
        .filter(|n| nodes.contains(&n.inventory.name))
        .filter_map(|n| {
            let found = n.inventory.driver.as_ref()?;
            let short = gpuslice_planning::driver::check(Some(found), minimum).err()?;
            Some(format!("node {}: {short}", n.inventory.name))
        })
        .collect()
}

/// The pool's Degraded, Progressing and Ready conditions, from its `problems`, its nodes whose
/// driver is `outdated`, and what it `held`.
fn pool_conditions(
    problems: &[String],
    outdated: &[String],
    held: &Footprint,
    generation: Option<i64>,
) -> Vec<Condition> {
    let (nodes, waiting, blocked) = (&held.nodes, &held.waiting, &held.blocked);
    let mut conditions = Vec::new();
    let degraded = !problems.is_empty() || !outdated.is_empty();
    conditions.push(condition(
        "Degraded",
        degraded,
        if !problems.is_empty() {
            "InvalidConfiguration"
        } else if degraded {
            "DriverOutdated"
        } else {
            "AsExpected"
        },
        problems
            .iter()
            .chain(outdated)
            .cloned()
            .collect::<Vec<_>>()
            .join("; "),
        generation,
    ));
    let progressing = !waiting.is_empty() || !blocked.is_empty();
    let (reason, message) = if !blocked.is_empty() {
        (
            "Blocked",
            format!(
                "waiting for busy instances to drain: {}",
                blocked.join("; ")
            ),
        )
    } else if !waiting.is_empty() {
        (
            "Applying",
            format!(
                "waiting for {} node(s) to apply the layout: {}",
                waiting.len(),
                waiting.join(", ")
            ),
        )
    } else {
        ("Converged", String::new())
    };
    conditions.push(condition(
        "Progressing",
        progressing,
        reason,
        message,
        generation,
    ));
    let ready = problems.is_empty() && !progressing && !nodes.is_empty();
    let (reason, message) = if !problems.is_empty() {
        (
            "InvalidConfiguration",
            "see the Degraded condition".to_string(),
        )
    } else if nodes.is_empty() {
        (
            "NoNodes",
            "no node with reported GPUs matches spec.nodeSelector and spec.gpuSelector".to_string(),
        )
    } else if progressing {
        ("Progressing", "see the Progressing condition".to_string())
    } else {
        (
            "Converged",
            format!(
                "{} GPUs on {} nodes have the layout",
                held.gpus,
                nodes.len()
            ),
        )
    };
    conditions.push(condition("Ready", ready, reason, message, generation));
    conditions
}

/// The status of `policy`: whether it can be used now, its slices allocated, its pods waiting.
fn policy_status(
    observed: &Observed,
    plan: &ClusterPlan,
    policy: &GpuSlicePolicy,
) -> GpuSlicePolicyStatus {
    let name = policy.metadata.name.clone().unwrap_or_default();
    let (ready, reason, message) = policy_ready(observed, plan, policy);
    let allocated = observed
        .allocated
        .iter()
        .filter(|a| a.policy.as_deref() == Some(name.as_str()))
        .count() as u32;
    let waiting = observed.waiting.get(&name).copied().unwrap_or(0);
    GpuSlicePolicyStatus {
        conditions: vec![condition(
            "Ready",
            ready,
            reason,
            message,
            policy.metadata.generation,
        )],
        observed_generation: policy.metadata.generation,
        waiting,
        allocated,
    }
}

/// Whether a policy can be used now: its pool and checkpoint policy exist and one of the pool's
/// slices (in the layout in force) holds its memory plus the pool's headroom and its compute limit.
fn policy_ready(
    observed: &Observed,
    plan: &ClusterPlan,
    policy: &GpuSlicePolicy,
) -> (bool, &'static str, String) {
    let spec = &policy.spec;
    let Some(pool) = observed
        .pools
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(spec.pool.as_str()))
    else {
        return (
            false,
            "PoolNotFound",
            format!(
                "spec.pool: GpuPool {:?} does not exist; create it or name another pool",
                spec.pool
            ),
        );
    };
    if let Some(cp) = &spec.checkpoint_policy
        && !observed.checkpoint_policies.contains(cp)
    {
        return (
            false,
            "CheckpointPolicyNotFound",
            format!("spec.checkpointPolicy: CheckpointPolicy {cp:?} does not exist"),
        );
    }
    let headroom = pool.spec.headroom_bytes();
    let request = gpuslice_api::bytes_of(&spec.memory.0).unwrap_or(u64::MAX);
    let limit = spec.compute.as_ref().map(|c| c.limit);
    let mut gpus = 0;
    for node in &plan.nodes {
        let inventory = observed
            .nodes
            .iter()
            .find(|n| n.inventory.name == node.node);
        for g in node
            .gpus
            .iter()
            .filter(|g| g.pool() == Some(spec.pool.as_str()))
        {
            gpus += 1;
            let Some(desired) = &g.desired else { continue };
            let memory = inventory
                .and_then(|n| n.inventory.gpus.iter().find(|x| x.index == g.index))
                .and_then(|x| x.memory.as_ref())
                .and_then(|m| gpuslice_api::bytes_of(&m.0).ok());
            let model = gpuslice_planning::catalog::model(&g.model).ok();
            if let Some(choice) = gpuslice_planning::fit::smallest_fitting(
                desired, model, memory, request, headroom, limit,
            ) {
                return (
                    true,
                    "SliceFits",
                    format!("fits {choice:?} on {} GPU {}", node.node, g.index),
                );
            }
        }
    }
    if gpus == 0 {
        (
            false,
            "NoGpus",
            format!("GpuPool {:?} has no GPUs yet", spec.pool),
        )
    } else {
        (
            false,
            "NoSliceFits",
            format!(
                "no slice of GpuPool {:?} holds spec.memory {} + memoryHeadroom{}; ask for less or change the pool's layout",
                spec.pool,
                spec.memory.0,
                limit
                    .map(|l| format!(" with {l}% compute"))
                    .unwrap_or_default()
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(yaml: &str) -> GpuPool {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn node(name: &str, labels: &[(&str, &str)], applied: bool) -> NodeReport {
        let mut inventory: NodeInventory = serde_yaml::from_str(&format!(
            "name: {name}\ngpus:\n- {{index: 0, model: NVIDIA H200}}\n- {{index: 1, model: NVIDIA H200}}\n"
        ))
        .unwrap();
        inventory.labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        NodeReport {
            inventory,
            generation: Some(2),
            applied_generation: applied.then_some(2),
            applied_switch: None,
            blocked: None,
            assigned: Vec::new(),
        }
    }

    const MIG: &str = "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: mig, generation: 3}\nspec:\n  nodeSelector: {matchLabels: {team: a}}\n  layout: {mig: {profiles: {3g.71gb: 2}}}\n  windows:\n  - {name: night, timeZone: UTC, days: [Mon, Tue, Wed, Thu, Fri, Sat, Sun], start: \"22:00\", end: \"06:00\", layout: {mig: {preset: whole}}}\n";
    const SOFT: &str = "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: soft}\nspec:\n  nodeSelector: {matchLabels: {team: b}}\n  layout: {software: {slices: 4, memory: 30Gi, compute: 25}}\n";

    fn at(text: &str) -> DateTime<Utc> {
        text.parse().unwrap()
    }

    #[test]
    fn a_gpu_that_cannot_be_planned_keeps_the_layout_it_was_last_given() {
        let noon = at("2026-12-02T12:00:00Z");
        let good = Observed {
            pools: vec![pool(SOFT)],
            nodes: vec![node("b", &[("team", "b")], true)],
            ..Observed::default()
        };
        let last_good = desired(&good, noon).node_specs["b"].gpus.clone();
        assert_eq!(last_good.len(), 2);
        // Two H200s cannot hold 4 × 60 GiB each; the node also matches a second pool that
        // claims the same GPUs.
        let mut broken = good.clone();
        broken.pools = vec![pool(&SOFT.replace("memory: 30Gi", "memory: 60Gi"))];
        broken.nodes[0].assigned = last_good.clone();
        let out = desired(&broken, noon);
        assert_eq!(out.node_specs["b"].gpus, last_good);
        let degraded = out.pool_status["soft"]
            .conditions
            .iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap();
        assert_eq!(degraded.status, "True");
        assert!(
            degraded.message.contains("4 slices × 60Gi"),
            "{}",
            degraded.message
        );
        let mut overlap = good.clone();
        overlap
            .pools
            .push(pool(&SOFT.replace("name: soft", "name: other")));
        overlap.nodes[0].assigned = last_good.clone();
        assert_eq!(desired(&overlap, noon).node_specs["b"].gpus, last_good);
        // A node never given a layout gets none for such a GPU.
        overlap.nodes[0].assigned.clear();
        assert!(desired(&overlap, noon).node_specs["b"].gpus.is_empty());
    }

    #[test]
    fn each_node_gets_the_layout_in_force_and_pools_count_what_they_hold() {
        let mut observed = Observed {
            pools: vec![pool(MIG), pool(SOFT)],
            nodes: vec![
                node("a", &[("team", "a")], true),
                node("b", &[("team", "b")], false),
            ],
            ..Observed::default()
        };
        // Node a reported its spec applied, but the spec it holds is last night's: the pass that
        // writes the day's layout does not call the pool ready (Argo CD would see it Healthy
        // before the agent re-cut anything).
        let ten = at("2026-12-02T10:00:00Z");
        let night = desired(&observed, at("2026-12-02T23:00:00Z"));
        observed.nodes[0].assigned = night.node_specs["a"].gpus.clone();
        let ready = |s: &GpuPoolStatus| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .unwrap()
                .status
                .clone()
        };
        assert_eq!(ready(&desired(&observed, ten).pool_status["mig"]), "False");
        // Once it holds the day's spec and reports it applied, the pool is ready.
        observed.nodes[0].assigned = desired(&observed, ten).node_specs["a"].gpus.clone();
        let day = desired(&observed, ten);
        let a = &day.node_specs["a"].gpus;
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].assigned.window, None);
        assert!(
            a[0].assigned
                .layout
                .mig
                .as_ref()
                .unwrap()
                .profiles
                .contains_key("3g.71gb")
        );
        assert_eq!(day.next_change, Some(at("2026-12-02T22:00:00Z")));
        let mig = &day.pool_status["mig"];
        assert_eq!((mig.nodes, mig.gpus, mig.slices.total), (1, 2, 4));
        assert_eq!(mig.observed_generation, Some(3));
        assert_eq!(ready(mig), "True");
        let soft = &day.pool_status["soft"];
        assert_eq!(ready(soft), "False", "node b has not applied yet");
        assert!(
            soft.conditions
                .iter()
                .any(|c| c.reason == "Applying" && c.message.contains('b'))
        );

        let night = desired(&observed, at("2026-12-02T23:00:00Z"));
        assert_eq!(
            night.node_specs["a"].gpus[0].assigned.window.as_deref(),
            Some("night")
        );
        assert_eq!(
            night.pool_status["mig"].active_window.as_deref(),
            Some("night")
        );
    }

    #[test]
    fn the_next_windows_layout_is_staged_ahead_and_the_spec_caught_up_after_the_agents() {
        let observed = Observed {
            pools: vec![pool(MIG), pool(SOFT)],
            nodes: vec![
                node("a", &[("team", "a")], true),
                node("b", &[("team", "b")], true),
            ],
            ..Observed::default()
        };
        let boundary = at("2026-12-02T22:00:00Z");
        let day = desired(&observed, at("2026-12-02T21:00:00Z"));
        let staged = &day.node_specs["a"];
        let next = staged.gpus[0]
            .next
            .as_ref()
            .expect("the night layout staged");
        assert_eq!(gpuslice_api::chrono_of(&next.at), Some(boundary));
        assert_eq!(next.assigned.window.as_deref(), Some("night"));
        assert_eq!(
            next.assigned.layout.mig.as_ref().unwrap().preset,
            Some(gpuslice_api::MigPreset::Whole)
        );
        assert_eq!(
            staged.next_switch(at("2026-12-02T21:00:00Z")),
            Some(boundary)
        );
        // A pool without windows never changes: nothing staged.
        assert!(day.node_specs["b"].gpus.iter().all(|g| g.next.is_none()));
        // Each GPU is staged for its own pool's next change, not the cluster's first one.
        let late = MIG
            .replace("name: mig", "name: late")
            .replace("team: a", "team: b")
            .replace("start: \"22:00\"", "start: \"23:00\"");
        let both = desired(
            &Observed {
                pools: vec![pool(MIG), pool(&late)],
                ..observed.clone()
            },
            at("2026-12-02T21:00:00Z"),
        );
        let staged_at = |node: &str| {
            both.node_specs[node].gpus[0]
                .next
                .as_ref()
                .and_then(|n| gpuslice_api::chrono_of(&n.at))
        };
        assert_eq!(staged_at("a"), Some(boundary));
        assert_eq!(staged_at("b"), Some(at("2026-12-02T23:00:00Z")));
        assert_eq!(
            both.node_specs["b"].gpus[0]
                .recut_at
                .as_ref()
                .and_then(gpuslice_api::chrono_of),
            Some(at("2026-12-02T23:00:00Z"))
        );

        // On the agent's clock the night layout is in force from the boundary, before any write.
        let before = staged.in_force(at("2026-12-02T21:59:59Z"));
        assert_eq!(before.gpus[0].assigned.window, None);
        let after = staged.in_force(boundary);
        assert_eq!(after.gpus[0].assigned.window.as_deref(), Some("night"));
        assert_eq!(after.gpus[0].assigned.layout, next.assigned.layout);
        assert_eq!(staged.next_switch(boundary), None);

        // At the boundary the operator's new spec only catches up: due 20 s later. The spec
        // from before the boundary, or a change of what is in force, is due at once.
        let night = desired(&observed, boundary);
        let caught_up = &night.node_specs["a"];
        assert_ne!(caught_up, staged);
        assert_eq!(
            catch_up_due(staged, caught_up, boundary),
            Some(boundary + CATCH_UP_AFTER)
        );
        assert_eq!(
            catch_up_due(staged, caught_up, at("2026-12-02T21:59:59Z")),
            None
        );
        let changed = desired(
            &Observed {
                pools: vec![pool(
                    &MIG.replace("preset: whole", "profiles: {1g.18gb: 7}"),
                )],
                ..observed.clone()
            },
            boundary,
        );
        assert_eq!(
            catch_up_due(staged, &changed.node_specs["a"], boundary),
            None
        );
    }

    #[test]
    fn a_gpu_claimed_by_two_pools_degrades_both_and_gets_no_layout() {
        let other = MIG.replace("name: mig", "name: other");
        let observed = Observed {
            pools: vec![pool(MIG), pool(&other)],
            nodes: vec![node("a", &[("team", "a")], true)],
            ..Observed::default()
        };
        let out = desired(&observed, at("2026-12-02T10:00:00Z"));
        assert!(
            out.node_specs["a"].gpus.is_empty(),
            "nothing changes on a contested GPU"
        );
        for name in ["mig", "other"] {
            let degraded = out.pool_status[name]
                .conditions
                .iter()
                .find(|c| c.type_ == "Degraded")
                .unwrap();
            assert_eq!(degraded.status, "True", "{name}");
            assert!(
                degraded
                    .message
                    .contains("pools that share a node must select disjoint GPUs"),
                "{}",
                degraded.message
            );
        }
    }
}

/// Something worth an Event on a pool: (warning?, reason, note).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

fn find<'a>(status: &'a GpuPoolStatus, kind: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == kind)
}

/// The window a status says is in force; a status written before `default` was spelt out says
/// nothing for the default layout.
fn window_in_force(status: &GpuPoolStatus) -> &str {
    status
        .active_window
        .as_deref()
        .unwrap_or(gpuslice_api::DEFAULT_WINDOW)
}

/// The events a status change deserves: a window opening or closing, a pool turning invalid,
/// a transition getting blocked. Nothing on the first status of a pool but its problems.
pub fn events(old: Option<&GpuPoolStatus>, new: &GpuPoolStatus) -> Vec<PoolEvent> {
    let mut out = Vec::new();
    if let Some(old) = old
        && old.observed_generation.is_some()
        && window_in_force(old) != window_in_force(new)
    {
        out.push(PoolEvent {
            warning: false,
            reason: "WindowChanged",
            note: format!(
                "{} is in force now; re-slicing {} GPUs on {} nodes",
                match new.active_window.as_deref() {
                    None | Some(gpuslice_api::DEFAULT_WINDOW) => "the default layout".to_string(),
                    Some(w) => format!("window {w}"),
                },
                new.gpus,
                new.nodes
            ),
        });
    }
    let was = |kind: &str, reason: Option<&str>| {
        old.and_then(|o| find(o, kind))
            .is_some_and(|c| c.status == "True" && reason.is_none_or(|r| c.reason == r))
    };
    if let Some(c) = find(new, "Degraded")
        && c.status == "True"
        && (!was("Degraded", None)
            || old.and_then(|o| find(o, "Degraded")).map(|o| &o.message) != Some(&c.message))
    {
        out.push(PoolEvent {
            warning: true,
            reason: if c.reason == "DriverOutdated" {
                "DriverOutdated"
            } else {
                "InvalidConfiguration"
            },
            note: c.message.clone(),
        });
    }
    let last_recut = |s: &GpuPoolStatus| s.elastic.as_ref().and_then(|e| e.last_recut.clone());
    if let Some(recut) = last_recut(new)
        && old.and_then(last_recut).as_ref() != Some(&recut)
    {
        out.push(PoolEvent {
            warning: false,
            reason: "ElasticRecut",
            note: recut.reason,
        });
    }
    if let Some(c) = find(new, "Progressing")
        && c.status == "True"
        && c.reason == "Blocked"
        && !was("Progressing", Some("Blocked"))
    {
        out.push(PoolEvent {
            warning: true,
            reason: "Blocked",
            note: c.message.clone(),
        });
    }
    out
}

#[cfg(test)]
mod event_tests {
    use super::*;

    fn status(window: Option<&str>, degraded: Option<&str>, blocked: bool) -> GpuPoolStatus {
        GpuPoolStatus {
            observed_generation: Some(1),
            active_window: window.map(str::to_string),
            conditions: vec![
                condition(
                    "Degraded",
                    degraded.is_some(),
                    "X",
                    degraded.unwrap_or("").into(),
                    Some(1),
                ),
                condition(
                    "Progressing",
                    blocked,
                    if blocked { "Blocked" } else { "Converged" },
                    "busy".into(),
                    Some(1),
                ),
            ],
            ..GpuPoolStatus::default()
        }
    }

    #[test]
    fn events_mark_window_changes_new_problems_and_new_blocks_once() {
        let day = status(None, None, false);
        assert!(events(None, &day).is_empty());
        assert!(events(Some(&day), &day).is_empty(), "nothing changed");
        let night = status(Some("night"), None, false);
        assert_eq!(events(Some(&day), &night)[0].reason, "WindowChanged");
        let blocked = status(Some("night"), None, true);
        assert_eq!(events(Some(&night), &blocked)[0].reason, "Blocked");
        assert!(events(Some(&blocked), &blocked).is_empty(), "once");
        let broken = status(None, Some("bad profile"), false);
        assert_eq!(events(None, &broken)[0].note, "bad profile");
        assert!(events(Some(&broken), &broken).is_empty());
    }
}
