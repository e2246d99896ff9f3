//! Checks of each GpuSlicePolicy against its pool (fits, count, host resources) and of the
//! workloads whose CheckpointPolicy mounts storage.

use std::collections::BTreeMap;

use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{CheckpointPolicy, GpuPool, GpuSlicePolicy, Layout, LayoutKind};

use super::pool::{
    check_checkpoint_reference, elastic_fits, layouts, mig_candidates, selected_models,
};
use super::{Findings, Located, Repo, WorkloadRef};
use crate::catalog::GpuModel;
use crate::mig;
use crate::transition::mps_slice_of_instance;

/// A workload whose policy's CheckpointPolicy (its own, else its pool's) mounts storage: it may
/// not declare the volume admission adds, and the claim should exist in its namespace.
pub(super) fn check_checkpoint_storage(
    repo: &Repo,
    w: &WorkloadRef,
    policy: &GpuSlicePolicy,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    out: &mut Findings,
) {
    let pools = repo.pools.iter().map(|p| &p.object);
    let Some(name) = policy.spec.checkpoint_policy_in(pools) else {
        return;
    };
    let Some(claim) = checkpoints
        .get(name)
        .and_then(|c| c.spec.storage.as_ref()?.persistent_volume_claim.as_ref())
    else {
        return;
    };
    if let Some(path) = &w.checkpoint_volume {
        out.error(
            w.doc,
            path,
            format!(
                "{} declares the volume {} itself: admission adds it from CheckpointPolicy {name:?}'s storage (claim {claim:?}), and the API server would refuse pods with both; remove it (the claim is mounted at spec.storage.mountPath, told as GPUSLICE_CHECKPOINT_DIR)",
                w.display,
                gpuslice_api::CHECKPOINT_VOLUME
            ),
        );
    }
    let declared = repo
        .volume_claims
        .iter()
        .any(|(ns, c)| *ns == w.namespace && c == claim);
    if !declared {
        out.warn(
            w.doc,
            &w.path,
            format!(
                "{}'s pods get PersistentVolumeClaim {claim:?} of namespace {} (CheckpointPolicy {name:?}'s storage), which this repository does not declare: create it there (here or in the cluster), or the queue holds the pods (reason CheckpointStorageMissing)",
                w.display, w.namespace
            ),
        );
    }
}

/// A policy's `count` and `topology` against its pool: several software slices cannot be capped
/// in one container, and a topology constrains only several slices.
fn check_count(
    doc: usize,
    spec: &gpuslice_api::GpuSlicePolicySpec,
    pool: &GpuPool,
    out: &mut Findings,
) {
    if spec.count > 1 {
        let software: Vec<String> = layouts(pool)
            .into_iter()
            .filter(|(_, _, layout)| {
                layout.software.is_some()
                    || layout.mps.is_some()
                    || layout.mig.as_ref().is_some_and(|m| m.mps.is_some())
            })
            .map(|(_, what, _)| what)
            .collect();
        if !software.is_empty() {
            out.error(
                doc,
                "spec.count",
                format!(
                    "count {} on pool {:?}, which gives software slices in {}: a container is capped to one software or MPS slice, so its pods would never start; set count to 1, or use a pool of whole GPUs (exclusive) or MIG instances without mps",
                    spec.count,
                    spec.pool,
                    software.join(" and ")
                ),
            );
        }
    } else if spec.topology.is_some() {
        out.warn(
            doc,
            "spec.topology",
            "it constrains where a pod's slices are relative to each other, and with count 1 there is one: it has no effect; remove it, or raise count".to_string(),
        );
    }
}

pub(super) fn check_policy(
    policy: &Located<GpuSlicePolicy>,
    pools: &BTreeMap<&str, &Located<GpuPool>>,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    out: &mut Findings,
) {
    let doc = policy.doc;
    let spec = &policy.object.spec;
    check_checkpoint_reference(doc, spec.checkpoint_policy.as_deref(), checkpoints, out);
    check_host(doc, spec.host.as_ref(), out);
    let Some(pool) = pools.get(spec.pool.as_str()) else {
        out.error(
            doc,
            "spec.pool",
            format!("GpuPool {:?} is not defined in this repository", spec.pool),
        );
        return;
    };
    check_count(doc, spec, &pool.object, out);
    let Ok(memory) = spec.memory.bytes() else {
        return;
    };
    let headroom = pool.object.spec.headroom_bytes();
    let demand = Demand {
        memory,
        headroom,
        need: memory.saturating_add(headroom),
        limit: spec.compute.as_ref().map(|c| c.limit),
    };
    let (need, limit) = (demand.need, demand.limit);
    let models = selected_models(&pool.object).known;
    let mut fits = Vec::new();
    let mut misfits = Vec::new();
    for (_, what, layout) in layouts(&pool.object) {
        let why_not = why_not_fits(layout, &what, &models, &demand);
        match why_not {
            None => fits.push(what),
            Some(reason) => misfits.push((what, reason)),
        }
    }
    let (elastic_fit, shapes) = elastic_fits(&pool.object, need, limit.unwrap_or(0));
    if !shapes.is_empty() && elastic_fit.is_empty() {
        out.error(
            doc,
            "spec.memory",
            format!(
                "no shape of pool {:?}'s elastic set ({}) holds {} (memory + memoryHeadroom){}: add a shape with a larger slice or lower the policy's memory",
                spec.pool,
                shapes.join(", "),
                format_bytes(need),
                limit.map(|l| format!(" at a {l}% compute limit")).unwrap_or_default()
            ),
        );
    }
    if fits.is_empty() && elastic_fit.is_empty() {
        for (_, (path, message)) in misfits {
            out.error(
                doc,
                path,
                format!("no slice of pool {:?} fits: {message}", spec.pool),
            );
        }
    } else {
        for (what, (path, message)) in misfits {
            let text = if elastic_fit.is_empty() {
                format!(
                    "cannot run during {what} of pool {:?}: {message}",
                    spec.pool
                )
            } else {
                format!(
                    "{what} of pool {:?} does not hold it ({message}); it runs once the elastic set re-cuts a GPU to {}",
                    spec.pool,
                    elastic_fit.join(" or ")
                )
            };
            out.warn(doc, path, text);
        }
    }
}

/// What a policy asks of a slice: its memory, the pool's headroom, both together, and its
/// compute limit.
struct Demand {
    memory: u64,
    headroom: u64,
    need: u64,
    limit: Option<u32>,
}

/// Why no slice of `layout` (`what` names it; `models` are the pool's GPUs) holds `demand`:
/// the field to change and the reason, or `None` where it fits.
fn why_not_fits(
    layout: &Layout,
    what: &str,
    models: &[&'static GpuModel],
    demand: &Demand,
) -> Option<(&'static str, String)> {
    let Demand {
        memory,
        headroom,
        need,
        limit,
    } = *demand;
    match layout.kind() {
        Some(LayoutKind::Software(s) | LayoutKind::Mps(s)) => {
            let slice = s.memory.bytes().unwrap_or(0);
            if need > slice {
                Some((
                    "spec.memory",
                    format!(
                        "{} + memoryHeadroom {} = {} does not fit the {} slices of {what}",
                        format_bytes(memory),
                        format_bytes(headroom),
                        format_bytes(need),
                        format_bytes(slice)
                    ),
                ))
            } else {
                limit.filter(|&l| l > s.compute).map(|limit| {
                    (
                        "spec.compute.limit",
                        format!(
                            "compute limit {limit}% exceeds the {}% share of each slice of {what} (guarantees on one GPU could then add up to more than 100%)",
                            s.compute
                        ),
                    )
                })
            }
        }
        Some(LayoutKind::Mig(m)) => {
            let candidates = mig_candidates(models);
            let largest = candidates
                .iter()
                .filter_map(|model| {
                    let counts = mig::requested_profiles(model, m).ok()?;
                    counts
                        .keys()
                        .filter_map(|p| model.profile(p))
                        .map(|p| match &m.mps {
                            Some(mps) => mps_slice_of_instance(p.memory_bytes(), mps.slices).0,
                            None => p.memory_bytes(),
                        })
                        .max()
                })
                .max();
            let slice = if m.mps.is_some() {
                "MPS slice of a MIG instance"
            } else {
                "MIG instance"
            };
            match largest {
                Some(largest) if need > largest => Some((
                    "spec.memory",
                    format!(
                        "{} + memoryHeadroom {} = {} does not fit the largest {slice} of {what} ({})",
                        format_bytes(memory),
                        format_bytes(headroom),
                        format_bytes(need),
                        format_bytes(largest)
                    ),
                )),
                _ => None,
            }
        }
        Some(LayoutKind::Exclusive) => models
            .iter()
            .map(|m| m.memory_bytes())
            .min()
            .filter(|&gpu| need > gpu)
            .map(|gpu| {
                (
                    "spec.memory",
                    format!(
                        "{} + memoryHeadroom exceeds a whole GPU ({}) in {what}",
                        format_bytes(memory),
                        format_bytes(gpu)
                    ),
                )
            }),
        None => None,
    }
}

/// A policy's host limits (`spec.host`): the CPU and memory quantities parse.
fn check_host(doc: usize, host: Option<&gpuslice_api::HostResources>, out: &mut Findings) {
    let Some(host) = host else {
        return;
    };
    if let Some(cpu) = &host.cpu
        && let Err(e) = gpuslice_api::millicores_of(&cpu.0)
    {
        out.error(doc, "spec.host.cpu", e.to_string());
    }
    if let Some(memory) = &host.memory
        && let Err(e) = memory.bytes()
    {
        out.error(doc, "spec.host.memory", e.to_string());
    }
}
