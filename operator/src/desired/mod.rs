//! The operator's pure core: from the cluster as read (pools, checkpoint policies, nodes with the
//! GPUs their agents reported) to what should be written — each node's `GpuNode.spec` and each
//! pool's status. No I/O: the controller reads, calls [`desired`], and applies.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use gpuslice_api::{
    GpuAssignment, GpuNodeSpec, GpuPoolStatus, GpuSlicePolicyStatus, Layout, NextAssignment,
    NodeInventory,
};
use gpuslice_planning::cluster::{ClusterPlan, GpuPlan, NodePlan, plan_cluster};
use gpuslice_planning::shaping::{Shaped, ShapedGpu};
use k8s_openapi::api::resource::v1::DeviceClass;

mod elastic;
mod events;
mod observed;
mod status;

pub use events::{PoolEvent, events};
use observed::in_force;
pub use observed::{Allocated, NodeReport, Observed};
use status::{checkpoint_status, policy_status, pool_status};

/// What should be written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DesiredState {
    /// Node name → the desired `GpuNode.spec` (only nodes whose agent reported GPUs).
    pub node_specs: BTreeMap<String, GpuNodeSpec>,
    /// Pool name → its status (conditions without transition times; the controller keeps those).
    pub pool_status: BTreeMap<String, GpuPoolStatus>,
    /// GpuSlicePolicy name → its status.
    pub policy_status: BTreeMap<String, GpuSlicePolicyStatus>,
    /// CheckpointPolicy name → its status.
    pub checkpoint_status: BTreeMap<String, gpuslice_api::CheckpointPolicyStatus>,
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

/// Builds the desired state at `at`.
pub fn desired(observed: &Observed, at: DateTime<Utc>) -> DesiredState {
    let inventories: Vec<NodeInventory> =
        observed.nodes.iter().map(|n| n.inventory.clone()).collect();
    let mut plan = plan_cluster(&observed.pools, &inventories, at);
    let shaped = elastic::shape(observed, &mut plan, at);
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
    for (name, checkpoint) in &observed.checkpoints {
        let status = checkpoint_status(observed, checkpoint);
        out.checkpoint_status.insert(name.clone(), status);
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

#[cfg(test)]
mod tests {
    use super::*;
    use gpuslice_api::GpuPool;

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

    #[test]
    fn a_checkpoint_policy_says_whose_work_it_drains_and_which_namespaces_lack_its_claim() {
        let checkpoint = |name: &str, storage: &str| -> gpuslice_api::CheckpointPolicy {
            serde_yaml::from_str(&format!(
                "apiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {{name: {name}, generation: 2}}\nspec: {{gracePeriod: 1m{storage}}}"
            ))
            .unwrap()
        };
        let policy = |name: &str, ckpt: &str| -> gpuslice_api::GpuSlicePolicy {
            serde_yaml::from_str(&format!(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {{name: {name}}}\nspec: {{pool: soft, memory: 8Gi{ckpt}}}"
            ))
            .unwrap()
        };
        let soft = SOFT.replace("spec:\n", "spec:\n  checkpointPolicy: pooled\n");
        let mut observed = Observed {
            pools: vec![pool(&soft)],
            policies: vec![
                policy("trainer", ", checkpointPolicy: kept"),
                policy("notebook", ""),
            ],
            checkpoints: [
                checkpoint(
                    "kept",
                    ", storage: {persistentVolumeClaim: ckpt, mountPath: /ckpt}",
                ),
                checkpoint("pooled", ""),
                checkpoint("spare", ""),
            ]
            .into_iter()
            .map(|c| (c.metadata.name.clone().unwrap(), c))
            .collect(),
            ..Observed::default()
        };
        let ready = |out: &DesiredState, name: &str| {
            let c = &out.checkpoint_status[name].conditions[0];
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let out = desired(&observed, at("2026-12-02T10:00:00Z"));
        assert_eq!(
            ready(&out, "kept"),
            (
                "True".into(),
                "InUse".into(),
                "drains the workloads of policies trainer".into()
            )
        );
        assert_eq!(
            ready(&out, "pooled").2,
            "drains the workloads of policies notebook and on the GPUs of pools soft"
        );
        assert_eq!(ready(&out, "spare").1, "Unused");
        assert_eq!(out.checkpoint_status["spare"].observed_generation, Some(2));
        // Trainers wait in two namespaces for the claim: not Ready, and where to create it.
        observed.storage_missing = [(
            "trainer".to_string(),
            [("ml".to_string(), 2), ("nlp".to_string(), 1)].into(),
        )]
        .into();
        let out = desired(&observed, at("2026-12-02T10:00:00Z"));
        assert_eq!(
            ready(&out, "kept"),
            (
                "False".into(),
                "StorageClaimMissing".into(),
                "spec.storage.persistentVolumeClaim: PersistentVolumeClaim \"ckpt\" does not exist in namespace(s) ml, nlp, where 3 pod(s) wait for it: create it there".into()
            )
        );
    }
}
