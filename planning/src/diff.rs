//! What a change to the pools does to a cluster: the per-GPU difference between the plan of a
//! base revision and the plan of a head revision against the same inventory at the same instant
//! (`gpuslice plan --against`, for a pull request).

use chrono::{DateTime, Utc};
use gpuslice_api::{GpuPool, Layout, NodeInventory, TimeWindow};
use serde::Serialize;

use crate::cluster::{ClusterPlan, GpuPlan, GpuPlanError, plan_cluster};
use crate::transition::{Blocker, Desired, Op};

/// How a pool differs between the base and the head.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolChange {
    pub pool: String,
    pub change: PoolChangeKind,
    /// Whether the default layout (outside every window) differs.
    pub layout_changed: bool,
    /// Windows only the head declares.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub windows_added: Vec<String>,
    /// Windows only the base declares.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub windows_removed: Vec<String>,
    /// Windows both declare, with another time, days, layout or priorities in the head.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub windows_changed: Vec<String>,
    /// The window open at the instant planned for, in the base and in the head.
    pub window_now: (Option<String>, Option<String>),
    /// When the layout next changes, in the base and in the head.
    pub next_change: (Option<DateTime<Utc>>, Option<DateTime<Utc>>),
    /// Whether the node selector, GPU selector or another setting than the layouts differs.
    pub settings_changed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum PoolChangeKind {
    Added,
    Removed,
    Changed,
}

/// One side (base or head) of a GPU's plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuSide {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub desired: Option<Desired>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<GpuPlanError>,
}

impl GpuSide {
    fn of(plan: &GpuPlan) -> Self {
        GpuSide {
            pool: plan.pool().map(str::to_string),
            window: plan.assigned.as_ref().and_then(|a| a.window.clone()),
            desired: plan.desired.clone(),
            error: plan.error.clone(),
        }
    }
}

/// A GPU whose plan differs between the base and the head.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuChange {
    pub node: String,
    pub index: u32,
    pub model: String,
    pub base: GpuSide,
    pub head: GpuSide,
    /// What the head does to the GPU from its current state (what the agent would do).
    pub ops: Vec<Op>,
    /// Busy instances or slices that the head's layout must take away: the agent drains them
    /// first, per the CheckpointPolicy.
    pub blocked_by: Vec<Blocker>,
}

/// The difference a change makes.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanDiff {
    pub at: DateTime<Utc>,
    pub pools: Vec<PoolChange>,
    pub gpus: Vec<GpuChange>,
    /// GPUs planned on both sides, changed or not.
    pub gpus_planned: usize,
}

impl PlanDiff {
    /// Whether applying the head would have to drain running work.
    pub fn blocks_on_running_work(&self) -> bool {
        self.gpus.iter().any(|g| !g.blocked_by.is_empty())
    }

    /// Whether the head cannot be planned on some GPU (errors the base did not have).
    pub fn head_errors(&self) -> impl Iterator<Item = &GpuChange> {
        self.gpus.iter().filter(|g| g.head.error.is_some())
    }
}

/// Plans the inventory against the base pools and the head pools at `at` and keeps what differs.
pub fn diff(
    base: &[GpuPool],
    head: &[GpuPool],
    nodes: &[NodeInventory],
    at: DateTime<Utc>,
) -> PlanDiff {
    let base_plan = plan_cluster(base, nodes, at);
    let head_plan = plan_cluster(head, nodes, at);
    PlanDiff {
        at,
        pools: pool_changes(base, head, &base_plan, &head_plan),
        gpus_planned: head_plan.nodes.iter().map(|n| n.gpus.len()).sum(),
        gpus: gpu_changes(&base_plan, &head_plan),
    }
}

fn name(pool: &GpuPool) -> &str {
    pool.metadata.name.as_deref().unwrap_or_default()
}

fn pool_changes(
    base: &[GpuPool],
    head: &[GpuPool],
    base_plan: &ClusterPlan,
    head_plan: &ClusterPlan,
) -> Vec<PoolChange> {
    let timing = |plan: &ClusterPlan, pool: &str| {
        plan.pools
            .iter()
            .find(|t| t.pool == pool)
            .map(|t| (t.window.clone(), t.next_change))
            .unwrap_or_default()
    };
    let mut names: Vec<&str> = base.iter().chain(head).map(name).collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .filter_map(|pool| {
            let old = base.iter().find(|p| name(p) == pool);
            let new = head.iter().find(|p| name(p) == pool);
            let (old_now, old_next) = timing(base_plan, pool);
            let (new_now, new_next) = timing(head_plan, pool);
            let windows = |p: Option<&GpuPool>| -> Vec<TimeWindow> {
                p.map(|p| p.spec.windows.clone()).unwrap_or_default()
            };
            let (old_windows, new_windows) = (windows(old), windows(new));
            let find = |ws: &[TimeWindow], n: &str| ws.iter().find(|w| w.name == n).cloned();
            let added = new_windows
                .iter()
                .filter(|w| find(&old_windows, &w.name).is_none())
                .map(|w| w.name.clone())
                .collect();
            let removed = old_windows
                .iter()
                .filter(|w| find(&new_windows, &w.name).is_none())
                .map(|w| w.name.clone())
                .collect();
            let changed = new_windows
                .iter()
                .filter(|w| find(&old_windows, &w.name).is_some_and(|o| &o != *w))
                .map(|w| w.name.clone())
                .collect();
            let layout = |p: Option<&GpuPool>| -> Option<Layout> { p.map(|p| p.spec.layout.clone()) };
            let settings = |p: &GpuPool| {
                let mut spec = p.spec.clone();
                spec.windows.clear();
                spec.layout = Layout::default();
                spec
            };
            let change = PoolChange {
                pool: pool.to_string(),
                change: match (old, new) {
                    (None, _) => PoolChangeKind::Added,
                    (_, None) => PoolChangeKind::Removed,
                    _ => PoolChangeKind::Changed,
                },
                layout_changed: old.is_some() && new.is_some() && layout(old) != layout(new),
                windows_added: added,
                windows_removed: removed,
                windows_changed: changed,
                window_now: (old_now, new_now),
                next_change: (old_next, new_next),
                settings_changed: matches!((old, new), (Some(o), Some(n)) if settings(o) != settings(n)),
            };
            let unchanged = change.change == PoolChangeKind::Changed
                && !change.layout_changed
                && !change.settings_changed
                && change.windows_added.is_empty()
                && change.windows_removed.is_empty()
                && change.windows_changed.is_empty();
            (!unchanged).then_some(change)
        })
        .collect()
}

fn gpu_changes(base_plan: &ClusterPlan, head_plan: &ClusterPlan) -> Vec<GpuChange> {
    let mut out = Vec::new();
    for node in &head_plan.nodes {
        let base_node = base_plan.nodes.iter().find(|n| n.node == node.node);
        for gpu in &node.gpus {
            let base_gpu = base_node.and_then(|n| n.gpus.iter().find(|g| g.index == gpu.index));
            let (base, head) = (base_gpu.map(GpuSide::of), GpuSide::of(gpu));
            if base.as_ref() == Some(&head) {
                continue;
            }
            out.push(GpuChange {
                node: node.node.clone(),
                index: gpu.index,
                model: gpu.model.clone(),
                base: base.unwrap_or(GpuSide {
                    pool: None,
                    window: None,
                    desired: None,
                    error: None,
                }),
                head,
                ops: gpu.ops.clone(),
                blocked_by: gpu.blocked_by.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools(yaml: &str) -> Vec<GpuPool> {
        serde_yaml::Deserializer::from_str(yaml)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect()
    }

    const BASE: &str = "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: mig}
spec:
  nodeSelector: {matchLabels: {team: a}}
  layout: {mig: {profiles: {3g.71gb: 2}}}
  windows:
  - {name: night, timeZone: UTC, start: '22:00', end: '06:00', layout: {mig: {preset: whole}}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: soft}
spec:
  nodeSelector: {matchLabels: {team: b}}
  layout: {software: {slices: 4, memory: 30Gi, compute: 25}}
";

    fn nodes() -> Vec<NodeInventory> {
        serde_yaml::from_str(
            "
- name: a
  labels: {team: a}
  gpus:
  - index: 0
    model: NVIDIA H200
    mig:
      enabled: true
      instances:
      - {profile: 3g.71gb, placement: {start: 0, size: 4}, processes: [{pid: 41, name: train}]}
      - {profile: 3g.71gb, placement: {start: 4, size: 4}}
  - {index: 1, model: NVIDIA H200, mig: {enabled: true, instances: [{profile: 3g.71gb, placement: {start: 0, size: 4}}, {profile: 3g.71gb, placement: {start: 4, size: 4}}]}}
- name: b
  labels: {team: b}
  gpus:
  - {index: 0, model: NVIDIA H200}
",
        )
        .unwrap()
    }

    fn noon() -> DateTime<Utc> {
        "2026-12-04T12:00:00Z".parse().unwrap()
    }

    #[test]
    fn an_unchanged_source_changes_nothing() {
        let d = diff(&pools(BASE), &pools(BASE), &nodes(), noon());
        assert!(d.pools.is_empty() && d.gpus.is_empty(), "{d:?}");
        assert_eq!(d.gpus_planned, 3);
        assert!(!d.blocks_on_running_work());
    }

    #[test]
    fn a_recut_lists_each_gpu_and_the_busy_instance_that_blocks_it() {
        let head = BASE.replace("{3g.71gb: 2}", "{1g.18gb: 7}");
        let d = diff(&pools(BASE), &pools(&head), &nodes(), noon());
        assert_eq!(d.pools.len(), 1);
        assert!(d.pools[0].layout_changed && !d.pools[0].settings_changed);
        let recut: Vec<(&str, u32)> = d.gpus.iter().map(|g| (g.node.as_str(), g.index)).collect();
        assert_eq!(recut, [("a", 0), ("a", 1)]);
        // GPU 0 of node a runs pid 41 on the instance at 0: the change waits for it.
        assert!(!d.gpus[0].blocked_by.is_empty());
        assert!(d.gpus[1].blocked_by.is_empty() && !d.gpus[1].ops.is_empty());
        assert!(d.blocks_on_running_work());
    }

    #[test]
    fn window_edits_are_named_and_only_touch_gpus_when_the_layout_in_force_changes() {
        let head = BASE.replace(
            "start: '22:00', end: '06:00'",
            "start: '11:00', end: '13:00'",
        ) + "\n  windows:\n  - {name: lunch, timeZone: UTC, start: '12:30', end: '13:30', layout: {software: {slices: 2, memory: 60Gi, compute: 50}}}\n";
        let d = diff(&pools(BASE), &pools(&head), &nodes(), noon());
        let mig = d.pools.iter().find(|p| p.pool == "mig").unwrap();
        assert_eq!(mig.windows_changed, ["night"]);
        assert_eq!(mig.window_now, (None, Some("night".into())));
        let soft = d.pools.iter().find(|p| p.pool == "soft").unwrap();
        assert_eq!(soft.windows_added, ["lunch"]);
        assert_eq!(soft.next_change.0, None);
        assert_eq!(
            soft.next_change.1,
            Some("2026-12-04T12:30:00Z".parse().unwrap())
        );
        // The night window now covers noon: node a's GPUs become whole; node b is unchanged
        // until 12:30.
        let gpus: Vec<(&str, u32)> = d.gpus.iter().map(|g| (g.node.as_str(), g.index)).collect();
        assert_eq!(gpus, [("a", 0), ("a", 1)]);
        assert_eq!(d.gpus[0].head.window.as_deref(), Some("night"));
    }

    #[test]
    fn a_removed_pool_leaves_its_gpus_without_a_pool_and_a_new_overlap_is_an_error() {
        let head = pools(BASE)
            .into_iter()
            .filter(|p| name(p) == "soft")
            .collect::<Vec<_>>();
        let d = diff(&pools(BASE), &head, &nodes(), noon());
        assert_eq!(d.pools[0].change, PoolChangeKind::Removed);
        assert!(
            d.gpus
                .iter()
                .all(|g| g.head.pool.is_none() && g.node == "a")
        );
        let overlap = BASE.replace("{matchLabels: {team: b}}", "{}");
        let d = diff(&pools(BASE), &pools(&overlap), &nodes(), noon());
        assert!(d.pools[0].settings_changed);
        assert_eq!(d.head_errors().count(), 2, "{:?}", d.gpus);
    }
}
