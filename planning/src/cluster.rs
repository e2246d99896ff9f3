//! Planning a whole cluster: which pool each GPU of each node belongs to, the layout active at an
//! instant, the transition each GPU needs, and when each pool next changes.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use gpuslice_api::{Assignment, GpuInventory, GpuPool, GpuSelector, Layout, NodeInventory};
use serde::Serialize;

use crate::catalog;
use crate::transition::{self, Blocker, Desired, GpuState, Op};
use crate::windows::{Recurrence, active_at};

/// Whether a label selector selects a set of labels (Kubernetes semantics; an empty selector
/// selects everything).
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_match = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let expressions_match = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        let value = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            _ => false,
        }
    });
    labels_match && expressions_match
}

/// Whether a GPU selector picks a GPU: it must match every list that is set.
pub fn picks(selector: Option<&GpuSelector>, gpu: &GpuInventory) -> bool {
    let Some(s) = selector else { return true };
    let canonical = |name: &str| {
        catalog::model(name).map_or_else(
            |_| name.to_ascii_lowercase(),
            |m| m.name.to_ascii_lowercase(),
        )
    };
    let gpu_model = canonical(&gpu.model);
    (s.models.is_empty() || s.models.iter().any(|m| canonical(m) == gpu_model))
        && (s.indices.is_empty() || s.indices.contains(&gpu.index))
        && (s.uuids.is_empty() || gpu.uuid.as_ref().is_some_and(|u| s.uuids.contains(u)))
}

/// The layout of a pool at an instant.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolTiming {
    pub pool: String,
    /// The open window, `None` for the default layout.
    pub window: Option<String>,
    /// When the layout next changes (a window opens or closes).
    pub next_change: Option<DateTime<Utc>>,
}

/// Which window of a pool is open at `at`, and when that changes. Windows that cannot be read
/// (validate reports them) are ignored.
pub fn pool_timing(pool: &GpuPool, at: DateTime<Utc>) -> (Option<usize>, PoolTiming) {
    let (indices, recurrences): (Vec<usize>, Vec<Recurrence>) = pool
        .spec
        .windows
        .iter()
        .enumerate()
        .filter_map(|(i, w)| Recurrence::of_window(w).ok().map(|r| (i, r)))
        .unzip();
    let (active, next_change) = active_at(&recurrences, at);
    let window = active.map(|a| indices[a]);
    let timing = PoolTiming {
        pool: pool.metadata.name.clone().unwrap_or_default(),
        window: window.map(|w| pool.spec.windows[w].name.clone()),
        next_change,
    };
    (window, timing)
}

/// Why a GPU cannot be planned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GpuPlanError {
    #[error(
        "GPU {gpu} is selected by pools {}: pools that share a node must select disjoint GPUs (gpuSelector indices or UUIDs)",
        pools.join(" and ")
    )]
    PoolsOverlap { gpu: u32, pools: Vec<String> },
    /// The pool's layout does not fit the GPU (its model lacks the profiles, …).
    #[error("{message}")]
    Layout { pool: String, message: String },
}

impl GpuPlanError {
    /// The pools the error is about.
    pub fn pools(&self) -> Vec<&str> {
        match self {
            GpuPlanError::PoolsOverlap { pools, .. } => pools.iter().map(String::as_str).collect(),
            GpuPlanError::Layout { pool, .. } => vec![pool.as_str()],
        }
    }
}

impl Serialize for GpuPlanError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The plan of one GPU: which pool it belongs to and everything the node needs to act on that.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuPlan {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    pub model: String,
    /// The pool the GPU belongs to, if any, with the layout in force now (its open window's,
    /// or its default) as declared, the time slice and the CheckpointPolicy.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub assigned: Option<Assignment>,
    /// The layout that should be in force now, resolved for the GPU's model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub desired: Option<Desired>,
    pub ops: Vec<Op>,
    pub blocked_by: Vec<Blocker>,
    /// Why the GPU cannot be planned (two pools claim it, its model lacks the profiles…).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<GpuPlanError>,
}

impl GpuPlan {
    /// The pool the GPU belongs to, if any.
    pub fn pool(&self) -> Option<&str> {
        self.assigned.as_ref().map(|a| a.pool.as_str())
    }

    /// The pool's CheckpointPolicy, if it names one.
    pub fn checkpoint_policy(&self) -> Option<&str> {
        self.assigned.as_ref()?.checkpoint_policy.as_deref()
    }
}

/// The plan of one node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodePlan {
    pub node: String,
    pub gpus: Vec<GpuPlan>,
}

/// The plan of a cluster at an instant.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPlan {
    pub at: DateTime<Utc>,
    pub pools: Vec<PoolTiming>,
    pub nodes: Vec<NodePlan>,
}

/// Plans every GPU of every node against the pools.
pub fn plan_cluster(pools: &[GpuPool], nodes: &[NodeInventory], at: DateTime<Utc>) -> ClusterPlan {
    let timings: Vec<(Option<usize>, PoolTiming)> =
        pools.iter().map(|p| pool_timing(p, at)).collect();
    let nodes = nodes
        .iter()
        .map(|node| {
            let on_node: Vec<usize> = (0..pools.len())
                .filter(|&i| selects(&pools[i].spec.node_selector, &node.labels))
                .collect();
            let gpus = node
                .gpus
                .iter()
                .map(|gpu| {
                    let claiming: Vec<usize> = on_node
                        .iter()
                        .copied()
                        .filter(|&i| picks(pools[i].spec.gpu_selector.as_ref(), gpu))
                        .collect();
                    plan_gpu(pools, &timings, &claiming, gpu)
                })
                .collect();
            NodePlan {
                node: node.name.clone(),
                gpus,
            }
        })
        .collect();
    ClusterPlan {
        at,
        pools: timings.into_iter().map(|(_, t)| t).collect(),
        nodes,
    }
}

impl GpuPlan {
    /// `gpu` with nothing planned for it yet.
    fn unassigned(gpu: &GpuInventory) -> GpuPlan {
        GpuPlan {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            model: gpu.model.clone(),
            assigned: None,
            desired: None,
            ops: Vec::new(),
            blocked_by: Vec::new(),
            error: None,
        }
    }
}

fn plan_gpu(
    pools: &[GpuPool],
    timings: &[(Option<usize>, PoolTiming)],
    claiming: &[usize],
    gpu: &GpuInventory,
) -> GpuPlan {
    let mut out = GpuPlan::unassigned(gpu);
    let &[pool_index] = claiming else {
        if claiming.len() > 1 {
            let mut pools: Vec<String> = claiming
                .iter()
                .map(|&i| timings[i].1.pool.clone())
                .collect();
            pools.sort();
            out.error = Some(GpuPlanError::PoolsOverlap {
                gpu: gpu.index,
                pools,
            });
        }
        return out;
    };
    let pool = &pools[pool_index];
    let (window, timing) = &timings[pool_index];
    let layout = window.map_or(&pool.spec.layout, |w| &pool.spec.windows[w].layout);
    plan_assigned(
        gpu,
        Assignment {
            pool: timing.pool.clone(),
            window: timing.window.clone(),
            layout: layout.clone(),
            time_slice: pool.spec.time_slice,
            checkpoint_policy: pool.spec.checkpoint_policy.clone(),
            shape: None,
        },
    )
}

/// Plans one GPU of a pool: the layout resolved for its model and the transition from its state.
pub fn plan_assigned(gpu: &GpuInventory, assignment: Assignment) -> GpuPlan {
    let mut out = GpuPlan::unassigned(gpu);
    let model = catalog::model(&gpu.model).ok();
    if let Some(message) = software_overflow(&assignment.layout, model, gpu) {
        out.error = Some(GpuPlanError::Layout {
            pool: assignment.pool.clone(),
            message,
        });
        out.assigned = Some(assignment);
        return out;
    }
    let result = Desired::of(&assignment.layout, model, &gpu.model).and_then(|desired| {
        let p = transition::plan(model, &GpuState::from_inventory(gpu), &desired)?;
        Ok((desired, p))
    });
    match result {
        Ok((desired, p)) => {
            out.desired = Some(desired);
            out.ops = p.ops;
            out.blocked_by = p.blocked_by;
        }
        Err(e) => {
            out.error = Some(GpuPlanError::Layout {
                pool: assignment.pool.clone(),
                message: e.to_string(),
            })
        }
    }
    out.assigned = Some(assignment);
    out
}

/// Why software slices cannot be cut on a GPU: together they would cap more memory than it has
/// (the catalog's figure for its model, as `validate` checks, else what NVML reported).
fn software_overflow(
    layout: &Layout,
    model: Option<&catalog::GpuModel>,
    gpu: &GpuInventory,
) -> Option<String> {
    let (gpuslice_api::LayoutKind::Software(s) | gpuslice_api::LayoutKind::Mps(s)) =
        layout.kind()?
    else {
        return None;
    };
    let memory = s.memory.bytes().ok()?;
    let capacity = model.map(|m| m.memory_bytes()).or_else(|| {
        gpu.memory
            .as_ref()
            .and_then(|m| gpuslice_api::bytes_of(&m.0).ok())
    })?;
    let total = memory.saturating_mul(u64::from(s.slices));
    (total > capacity).then(|| {
        use gpuslice_api::format_bytes;
        format!(
            "{} slices × {} = {} exceed the {} of GPU {} ({}); use fewer or smaller slices",
            s.slices,
            format_bytes(memory),
            format_bytes(total),
            format_bytes(capacity),
            gpu.index,
            gpu.model
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_selectors_follow_kubernetes_semantics() {
        let l = labels(&[("pool", "a"), ("zone", "z1")]);
        assert!(selects(&LabelSelector::default(), &l));
        let by_label = LabelSelector {
            match_labels: Some(labels(&[("pool", "a")])),
            ..Default::default()
        };
        assert!(selects(&by_label, &l));
        let expr = |op: &str, values: &[&str]| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "zone".into(),
                operator: op.into(),
                values: Some(values.iter().map(|v| v.to_string()).collect()),
            }]),
            ..Default::default()
        };
        assert!(selects(&expr("In", &["z1", "z2"]), &l));
        assert!(!selects(&expr("NotIn", &["z1"]), &l));
        assert!(selects(&expr("Exists", &[]), &l));
        assert!(!selects(&expr("DoesNotExist", &[]), &l));
    }

    #[test]
    fn gpu_selectors_match_models_by_catalog_name_and_alias() {
        let gpu = GpuInventory {
            index: 3,
            model: "NVIDIA H200".into(),
            uuid: Some("GPU-1".into()),
            ..Default::default()
        };
        assert!(picks(None, &gpu));
        assert!(picks(
            Some(&GpuSelector {
                models: vec!["h200".into()],
                ..Default::default()
            }),
            &gpu
        ));
        assert!(!picks(
            Some(&GpuSelector {
                models: vec!["A30".into()],
                ..Default::default()
            }),
            &gpu
        ));
        assert!(picks(
            Some(&GpuSelector {
                indices: vec![3],
                uuids: vec!["GPU-1".into()],
                ..Default::default()
            }),
            &gpu
        ));
        assert!(!picks(
            Some(&GpuSelector {
                indices: vec![0],
                ..Default::default()
            }),
            &gpu
        ));
    }

    #[test]
    fn software_slices_that_together_exceed_the_gpu_are_an_error_naming_the_sizes() {
        let layout: Layout =
            serde_yaml::from_str("software: {slices: 2, memory: 60Gi, compute: 50}").unwrap();
        let gpu = GpuInventory {
            index: 0,
            model: "NVIDIA A100-SXM4-80GB".into(),
            ..Default::default()
        };
        let assignment = Assignment {
            pool: "shared".into(),
            window: None,
            layout,
            time_slice: None,
            checkpoint_policy: None,
            shape: None,
        };
        let plan = plan_assigned(&gpu, assignment.clone());
        let error = plan.error.expect("an error").to_string();
        assert_eq!(
            error,
            "2 slices × 60Gi = 120Gi exceed the 80Gi of GPU 0 (NVIDIA A100-SXM4-80GB); use fewer or smaller slices"
        );
        assert!(plan.ops.is_empty());
        let fits: Layout =
            serde_yaml::from_str("software: {slices: 2, memory: 40Gi, compute: 50}").unwrap();
        assert!(
            plan_assigned(
                &gpu,
                Assignment {
                    layout: fits,
                    ..assignment
                }
            )
            .error
            .is_none()
        );
    }
}
