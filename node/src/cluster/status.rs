//! What the agent reports in `GpuNode.status` after a pass: the plan of the GPUs the spec names,
//! the inventory, the claims, and the `Ready`, `Blocked`, `DriverSupported`, `Quarantined` and
//! `IoLimited` conditions.

use std::collections::BTreeMap;

use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use gpuslice_api::{DriverMinimum, GpuNodeStatus, NodeInventory};
use gpuslice_planning::cluster::{GpuPlan, plan_assigned};
use gpuslice_planning::driver;
use gpuslice_runtime::conditions::{condition, keep_transition_times};

use crate::pass::Pass;
use crate::protections::faults::Quarantine;

/// The plan of each GPU the spec names, from the node as this pass read it; and what the spec
/// asks that cannot be done.
pub(super) fn plan_spec(
    node: &NodeInventory,
    spec: &gpuslice_api::GpuNodeSpec,
) -> (Vec<GpuPlan>, Vec<String>) {
    let mut plans = Vec::new();
    let mut problems = Vec::new();
    for assignment in &spec.gpus {
        let Some(gpu) = node.gpus.iter().find(|g| g.index == assignment.index) else {
            problems.push(format!(
                "GPU {}: this node has no such GPU",
                assignment.index
            ));
            continue;
        };
        if let (Some(want), Some(have)) = (&assignment.uuid, &gpu.uuid)
            && want != have
        {
            problems.push(format!(
                "GPU {}: the spec is for {want} but the GPU is {have}; not applied",
                assignment.index
            ));
            continue;
        }
        let plan = plan_assigned(gpu, assignment.assigned.clone());
        if let Some(e) = &plan.error {
            problems.push(format!("GPU {}: {e}", assignment.index));
        }
        plans.push(plan);
    }
    (plans, problems)
}

/// Each pool of this node's GPUs whose software slices the node's driver cannot serve, with
/// what it falls short of (see [`gpuslice_planning::driver`]); and the `DriverSupported`
/// condition saying so. A node in no pool is checked against the shim alone.
pub(super) fn driver_check(
    inventory: &NodeInventory,
    assignments: &[gpuslice_api::GpuAssignment],
    minimums: &BTreeMap<String, DriverMinimum>,
    generation: Option<i64>,
) -> (BTreeMap<String, driver::Shortfall>, Condition) {
    let found = inventory.driver.as_ref();
    let pools: std::collections::BTreeSet<&str> = assignments
        .iter()
        .map(|a| a.assigned.pool.as_str())
        .collect();
    let mut short = BTreeMap::new();
    for pool in &pools {
        let minimum = minimums.get(*pool).map(|m| (*pool, m));
        if let Err(e) = driver::check(found, minimum) {
            short.insert(pool.to_string(), e);
        }
    }
    let shim = driver::check(found, None);
    let supported = short.is_empty() && shim.is_ok();
    let message = if supported {
        let found = found.map_or_else(String::new, |d| {
            format!("driver {} (CUDA {})", d.version, d.cuda)
        });
        format!(
            "{found} meets the gpuslice shim's minimum (driver {}, CUDA {}) and its pools'",
            driver::SHIM_MIN_DRIVER,
            driver::SHIM_MIN_CUDA
        )
    } else {
        let mut texts: Vec<String> = short
            .iter()
            .map(|(pool, e)| format!("pool {pool}: {e}"))
            .collect();
        if texts.is_empty()
            && let Err(e) = &shim
        {
            texts.push(e.to_string());
        }
        texts.join("; ")
    };
    let reason = if supported {
        "Supported"
    } else if found.is_none() {
        "DriverUnknown"
    } else {
        "DriverTooOld"
    };
    (
        short,
        condition("DriverSupported", supported, reason, message, generation),
    )
}

/// The `Quarantined` condition: what XID errors took out of service, and how each comes back.
pub(super) fn quarantine_condition(
    list: &[Quarantine],
    node: &str,
    generation: Option<i64>,
) -> Condition {
    let described: Vec<String> = list.iter().map(|q| q.describe(node)).collect();
    condition(
        "Quarantined",
        !list.is_empty(),
        if list.is_empty() {
            "NoFaults"
        } else {
            "XidFault"
        },
        described.join("; "),
        generation,
    )
}

/// The `IoLimited` condition: whether the pools of this node that limit I/O per slice get it.
pub(super) fn io_condition(
    io: Result<&crate::protections::iolimit::Cgroups, &str>,
    assignments: &[gpuslice_api::GpuAssignment],
    bandwidths: &BTreeMap<String, u64>,
    generation: Option<i64>,
) -> Condition {
    let mut asking: Vec<String> = assignments
        .iter()
        .filter_map(|a| {
            let limit = bandwidths.get(&a.assigned.pool)?;
            Some(format!(
                "pool {}: {}/s",
                a.assigned.pool,
                gpuslice_api::quantity::format_bytes(*limit)
            ))
        })
        .collect();
    asking.sort();
    asking.dedup();
    if asking.is_empty() {
        return condition(
            "IoLimited",
            true,
            "NoLimits",
            "no pool of this node limits I/O per slice".into(),
            generation,
        );
    }
    match io {
        Ok(io) => {
            let disks: Vec<String> = io.disks.iter().map(ToString::to_string).collect();
            condition(
                "IoLimited",
                true,
                "Applied",
                format!(
                    "each slice's workload is held to {} on disks {} ({})",
                    asking.join(", "),
                    disks.join(", "),
                    io.kind()
                ),
                generation,
            )
        }
        Err(why) => condition(
            "IoLimited",
            false,
            "NoIoController",
            format!("{} asked, not applied: {why}", asking.join(", ")),
            generation,
        ),
    }
}

/// The status to report after a pass.
pub(super) fn status(
    pass: &Pass,
    generation: Option<i64>,
    switched: Option<chrono::DateTime<chrono::Utc>>,
    previous: Option<&GpuNodeStatus>,
    driver_supported: Condition,
    quarantined: Condition,
    io_limited: Condition,
) -> GpuNodeStatus {
    let blocked = blocked_gpus(pass);
    let failed: Vec<String> = pass
        .outcomes
        .iter()
        .filter_map(|o| o.error.as_ref().map(|e| format!("GPU {}: {e}", o.index)))
        .chain(pass.problems.iter().cloned())
        .chain(pass.drain_errors.iter().cloned())
        .collect();
    let converged = pass.converged();
    let mut conditions = vec![
        condition(
            "Ready",
            converged,
            if converged {
                "Applied"
            } else if !failed.is_empty() {
                "Failed"
            } else {
                "Progressing"
            },
            failed.join("; "),
            generation,
        ),
        condition(
            "Blocked",
            !blocked.is_empty(),
            if blocked.is_empty() {
                "NothingBusy"
            } else {
                "BusyInstances"
            },
            blocked.join("; "),
            generation,
        ),
        driver_supported,
        quarantined,
        io_limited,
    ];
    keep_transition_times(
        &mut conditions,
        previous.map(|p| p.conditions.as_slice()).unwrap_or(&[]),
    );
    let claims = slice_claims(pass);
    GpuNodeStatus {
        claims,
        evictions: pass
            .evictions
            .iter()
            .map(|e| gpuslice_api::EvictionRequest {
                pod: e.pod.clone(),
                uid: e.uid.clone(),
                cause: e.cause.to_string(),
                checkpoint: e.checkpoint.to_string(),
                message: e.note.clone(),
            })
            .collect(),
        inventory: Some(pass.inventory.clone()),
        gpu_count: u32::try_from(pass.inventory.gpus.len()).ok(),
        applied_generation: if converged {
            generation
        } else {
            previous.and_then(|p| p.applied_generation)
        },
        applied_switch: if converged {
            switched.and_then(gpuslice_api::time_of)
        } else {
            previous.and_then(|p| p.applied_switch.clone())
        },
        conditions,
    }
}

/// Each GPU whose change waits for busy slices: what it waits for, and who holds them.
fn blocked_gpus(pass: &Pass) -> Vec<String> {
    pass.outcomes
        .iter()
        .filter(|o| !o.blocked_by.is_empty())
        .map(|o| {
            let what: Vec<String> = o.blocked_by.iter().map(ToString::to_string).collect();
            let pids: Vec<String> = o
                .blocking
                .iter()
                .map(|b| {
                    let why = pass
                        .draining
                        .iter()
                        .find(|w| w.pid == b.pid && w.slice == b.slice)
                        .map(|w| format!(": {}", w.reason))
                        .unwrap_or_default();
                    if b.pid == 0 {
                        format!("a pod's ResourceClaim on {}{why}", b.slice)
                    } else {
                        format!("pid {} on {}{why}", b.pid, b.slice)
                    }
                })
                .collect();
            format!("GPU {}: {} ({})", o.index, what.join(", "), pids.join("; "))
        })
        .collect()
}

/// The claims the node holds now, as the status lists them.
fn slice_claims(pass: &Pass) -> Vec<gpuslice_api::SliceClaim> {
    let mut claims: Vec<gpuslice_api::SliceClaim> = pass
        .claims
        .iter()
        .map(|c| gpuslice_api::SliceClaim {
            slice: c.slice.clone(),
            resource_claim: c.resource_claim.clone(),
            pods: c.pod_names.clone(),
            pid: c
                .resource_claim
                .is_none()
                .then(|| c.workload.unwrap_or(c.client)),
            policy: c.policy.clone(),
            last_checkpoint: pass
                .checkpoints
                .get(&c.slice)
                .and_then(|t| gpuslice_api::time_of(*t)),
            idle_since: pass
                .idle_since
                .get(&c.slice)
                .and_then(|t| gpuslice_api::time_of(*t)),
            draining: c.resource_claim.as_ref().and_then(|_| {
                pass.draining
                    .iter()
                    .find(|w| w.pid == 0 && w.slice == c.slice)
                    .map(|w| w.reason.clone())
            }),
        })
        .collect();
    claims.dedup();
    claims
}
