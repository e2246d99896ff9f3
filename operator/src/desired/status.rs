//! Each pool's and each policy's status: what the pool holds, where its nodes stand with its
//! layout, its conditions, and whether a policy can be used now.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use gpuslice_api::{
    CheckpointPolicy, CheckpointPolicyStatus, GpuNodeSpec, GpuPool, GpuPoolStatus, GpuSlicePolicy,
    GpuSlicePolicyStatus, SliceCounts,
};
use gpuslice_planning::cluster::{ClusterPlan, GpuPlan, PoolTiming};
use gpuslice_planning::transition::Desired;
use gpuslice_runtime::conditions::condition;

use super::observed::{Observed, in_force, switch_pending};

/// The status of `pool` (`timing`: its window in force and next change), the nodes' specs
/// as this pass writes them.
pub(super) fn pool_status(
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
        && !observed.checkpoints.contains_key(cp)
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
                    Some(Desired::MigMps { profiles, slices }) => {
                        profiles.values().sum::<u32>() * slices
                    }
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
pub(super) fn policy_status(
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

/// The status of CheckpointPolicy `checkpoint`: whose workloads it drains (the policies that
/// name it, else whose pool does, and those pools), and, when its storage claim does not exist
/// in namespaces where pods wait for it, that (not Ready).
pub(super) fn checkpoint_status(
    observed: &Observed,
    checkpoint: &CheckpointPolicy,
) -> CheckpointPolicyStatus {
    let name = checkpoint.metadata.name.as_deref().unwrap_or_default();
    let policies: Vec<&str> = observed
        .policies
        .iter()
        .filter(|p| p.spec.checkpoint_policy_in(&observed.pools) == Some(name))
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    let pools: Vec<&str> = observed
        .pools
        .iter()
        .filter(|p| p.spec.checkpoint_policy.as_deref() == Some(name))
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    let mut missing: BTreeMap<&str, u32> = BTreeMap::new();
    for (namespace, pods) in policies
        .iter()
        .filter_map(|p| observed.storage_missing.get(*p))
        .flatten()
    {
        *missing.entry(namespace).or_default() += pods;
    }
    let (ready, reason, message) = if !missing.is_empty() {
        let claim = checkpoint
            .spec
            .storage
            .as_ref()
            .and_then(|s| s.persistent_volume_claim.as_deref())
            .unwrap_or_default();
        let waiting: u32 = missing.values().sum();
        let namespaces: Vec<&str> = missing.into_keys().collect();
        (
            false,
            "StorageClaimMissing",
            format!(
                "spec.storage.persistentVolumeClaim: PersistentVolumeClaim {claim:?} does not exist in namespace(s) {}, where {waiting} pod(s) wait for it: create it there",
                few(&namespaces)
            ),
        )
    } else if policies.is_empty() && pools.is_empty() {
        (
            true,
            "Unused",
            "no GpuSlicePolicy or GpuPool names it".to_string(),
        )
    } else {
        let mut whose = Vec::new();
        if !policies.is_empty() {
            whose.push(format!("of policies {}", few(&policies)));
        }
        if !pools.is_empty() {
            whose.push(format!("on the GPUs of pools {}", few(&pools)));
        }
        (
            true,
            "InUse",
            format!("drains the workloads {}", whose.join(" and ")),
        )
    };
    CheckpointPolicyStatus {
        conditions: vec![condition(
            "Ready",
            ready,
            reason,
            message,
            checkpoint.metadata.generation,
        )],
        observed_generation: checkpoint.metadata.generation,
    }
}

/// Up to ten names, comma-separated, then how many more.
fn few(names: &[&str]) -> String {
    const SHOWN: usize = 10;
    let mut out = names[..names.len().min(SHOWN)].join(", ");
    if names.len() > SHOWN {
        out.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    out
}

/// The GPUs of `pool` in the plan: node, plan, and the memory their agents report.
fn pool_gpus<'p>(
    observed: &Observed,
    plan: &'p ClusterPlan,
    pool: &str,
) -> Vec<(&'p str, &'p GpuPlan, Option<u64>)> {
    plan.nodes
        .iter()
        .flat_map(|node| {
            let inventory = observed
                .nodes
                .iter()
                .find(|n| n.inventory.name == node.node);
            node.gpus
                .iter()
                .filter(move |g| g.pool() == Some(pool))
                .map(move |g| {
                    let memory = inventory
                        .and_then(|n| n.inventory.gpus.iter().find(|x| x.index == g.index))
                        .and_then(|x| x.memory.as_ref())
                        .and_then(|m| gpuslice_api::bytes_of(&m.0).ok());
                    (node.node.as_str(), g, memory)
                })
        })
        .collect()
}

/// For a policy of several slices per pod: not ready when no node of its pool (no NVLink domain
/// of one, with `topology: nvlink`) has that many slices that hold it in the layouts in force
/// (what a pod of it would wait for forever); the most any has, to say how far off it is.
fn too_few_together(
    observed: &Observed,
    gpus: &[(&str, &GpuPlan, Option<u64>)],
    spec: &gpuslice_api::GpuSlicePolicySpec,
    headroom: u64,
) -> Option<(bool, &'static str, String)> {
    if spec.count <= 1 {
        return None;
    }
    let nvlink = spec.topology == Some(gpuslice_api::Topology::Nvlink);
    let request = gpuslice_api::bytes_of(&spec.memory.0).unwrap_or(u64::MAX);
    let limit = spec.compute.as_ref().map(|c| c.limit);
    let mut together: BTreeMap<(&str, Option<u32>), u32> = BTreeMap::new();
    for (node, g, memory) in gpus {
        let Some(desired) = &g.desired else {
            continue;
        };
        let domain = if nvlink {
            let peers = observed
                .nodes
                .iter()
                .find(|n| n.inventory.name == *node)
                .and_then(|n| n.inventory.gpus.iter().find(|x| x.index == g.index))
                .map(|x| x.nvlink_peers.clone())
                .unwrap_or_default();
            // The domain is named by its lowest-indexed GPU; a GPU without peers has none.
            match peers.iter().chain([&g.index]).min() {
                Some(&lowest) if !peers.is_empty() => Some(lowest),
                _ => continue,
            }
        } else {
            None
        };
        let model = gpuslice_planning::catalog::model(&g.model).ok();
        *together.entry((node, domain)).or_default() += gpuslice_planning::fit::fitting_slices(
            desired, model, *memory, request, headroom, limit,
        );
    }
    let most = together.iter().max_by_key(|(_, n)| **n);
    if most.is_some_and(|(_, n)| *n >= spec.count) {
        return None;
    }
    let within = if nvlink {
        "NVLink domain of a node"
    } else {
        "node"
    };
    let best = most.map_or("none has any".to_string(), |((node, _), n)| {
        format!("the most is {n}, on {node}")
    });
    Some((
        false,
        if nvlink {
            "NoNvlinkDomainHoldsCount"
        } else {
            "NoNodeHoldsCount"
        },
        format!(
            "spec.count: no {within} of GpuPool {:?} has {} slices that hold spec.memory {} + memoryHeadroom ({best}), so its pods would wait forever; lower spec.count{} or give the pool such nodes",
            spec.pool,
            spec.count,
            spec.memory.0,
            if nvlink { ", drop spec.topology" } else { "" }
        ),
    ))
}

/// Whether a policy can be used now: its pool and checkpoint policy exist and one of the pool's
/// slices (in the layout in force, or in a shape of the elastic set in force) holds its memory
/// plus the pool's headroom and its compute limit.
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
        && !observed.checkpoints.contains_key(cp)
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
    let gpus = pool_gpus(observed, plan, &spec.pool);
    let fits = |desired: &Desired, g: &GpuPlan, memory| {
        let model = gpuslice_planning::catalog::model(&g.model).ok();
        gpuslice_planning::fit::smallest_fitting(desired, model, memory, request, headroom, limit)
    };
    for (node, g, memory) in &gpus {
        if let Some(choice) = g.desired.as_ref().and_then(|d| fits(d, g, *memory)) {
            if let Some(short) = too_few_together(observed, &gpus, spec, headroom) {
                return short;
            }
            return (
                true,
                "SliceFits",
                format!("fits {choice:?} on {node} GPU {}", g.index),
            );
        }
    }
    // No GPU has such a slice now, but a shape of the elastic set in force does: the pool
    // re-cuts a GPU to it when a pod of this policy waits.
    let window = plan
        .pools
        .iter()
        .find(|t| t.pool == spec.pool)
        .and_then(|t| t.window.as_deref());
    let shapes = gpuslice_planning::shaping::set_in_force(pool, window)
        .map(|set| set.shapes.as_slice())
        .unwrap_or_default();
    for shape in shapes {
        for (node, g, memory) in &gpus {
            let model = gpuslice_planning::catalog::model(&g.model).ok();
            let Ok(desired) = Desired::of(&shape.layout, model, &g.model) else {
                continue;
            };
            if let Some(choice) = fits(&desired, g, *memory) {
                return (
                    true,
                    "ShapeFits",
                    format!(
                        "fits {choice:?} of elastic shape {:?} on {node} GPU {}: the pool re-cuts a GPU to it when a pod of this policy waits",
                        shape.name, g.index
                    ),
                );
            }
        }
    }
    if gpus.is_empty() {
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
