//! Converging a node's GPUs: from what NVML and the slice tables show (read once by the pass), run
//! each GPU's transition step by step and read the node back once to confirm.

use gpuslice_api::{GpuInventory, NodeInventory};
use gpuslice_contract::StateDir;
use gpuslice_contract::slice::{gpu_slice_id, mig_slice_id};
use gpuslice_planning::catalog;
use gpuslice_planning::cluster::{GpuPlan, GpuPlanError};
use gpuslice_planning::transition::{self, Blocker, Desired, GpuState, Op};
use serde::Serialize;

use crate::gpu::nvml::{NvmlError, NvmlGpus};
use crate::gpu::slices;

/// Why the node cannot be read or its slice tables kept.
#[derive(Debug, thiserror::Error)]
pub enum ConvergeError {
    #[error(transparent)]
    Nvml(#[from] NvmlError),
    #[error(transparent)]
    Slices(#[from] slices::SliceError),
    #[error("GPU {gpu}: {message}")]
    Model { gpu: u32, message: String },
}

/// What one pass did to one GPU.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuOutcome {
    pub index: u32,
    pub desired: Desired,
    /// Operations run (or, without `apply`, that would run).
    pub ops: Vec<Op>,
    /// Busy instances or slices that block the transition; nothing was changed.
    pub blocked_by: Vec<Blocker>,
    /// The processes on what blocks, with the slice each runs on.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub blocking: Vec<BlockingProcess>,
    /// GPU instances given the compute instance an interrupted earlier run did not create.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub completed: Vec<gpuslice_api::Placement>,
    /// Whether the GPU now has the desired layout (confirmed by reading it back).
    pub converged: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A process that holds a busy instance or GPU a transition needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockingProcess {
    pub pid: u32,
    /// The slice it runs on (see [`slices`] for ids).
    pub slice: String,
}

fn blocking_processes(gpu: &GpuInventory, blockers: &[Blocker]) -> Vec<BlockingProcess> {
    let mut out = Vec::new();
    let instances = gpu
        .mig
        .as_ref()
        .map(|m| m.instances.as_slice())
        .unwrap_or(&[]);
    for blocker in blockers {
        match blocker {
            Blocker::Instance {
                profile, placement, ..
            } => {
                for i in instances
                    .iter()
                    .filter(|i| i.placement == *placement && i.profile == *profile)
                {
                    // On its MPS slices, by slice (so a claim's pod is drained as a pod), then
                    // any other process on the instance.
                    let on_slices = slice_processes(&i.slices, |_| true);
                    let slice = mig_slice_id(gpu.index, i.placement.start, &i.profile);
                    let rest: Vec<BlockingProcess> = i
                        .processes
                        .iter()
                        .filter(|p| !on_slices.iter().any(|s| s.pid == p.pid))
                        .map(|p| BlockingProcess {
                            pid: p.pid,
                            slice: slice.clone(),
                        })
                        .collect();
                    out.extend(on_slices);
                    out.extend(rest);
                }
            }
            Blocker::Gpu => out.extend(gpu.processes.iter().map(|p| BlockingProcess {
                pid: p.pid,
                slice: gpu_slice_id(gpu.index),
            })),
            Blocker::Slices { ids } => {
                out.extend(slice_processes(&gpu.slices, |id| ids.contains(id)));
                for i in instances {
                    out.extend(slice_processes(&i.slices, |id| ids.contains(id)));
                }
            }
        }
    }
    out.sort_by_key(|p| p.pid);
    out.dedup();
    out
}

/// The processes on those of `slices` whose id `which` keeps, each with its slice.
fn slice_processes(
    slices: &[gpuslice_api::SoftwareSliceState],
    which: impl Fn(&String) -> bool,
) -> Vec<BlockingProcess> {
    slices
        .iter()
        .filter(|s| which(&s.id))
        .flat_map(|s| {
            s.processes.iter().map(|p| BlockingProcess {
                pid: p.pid,
                slice: s.id.clone(),
            })
        })
        .collect()
}

/// A slice held by a workload (a claim), which makes it busy even before the workload touches
/// the GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub slice: String,
    pub pid: u32,
}

/// The node as NVML and the slice tables show it, with held slices marked busy.
pub fn read_node(
    gpus: &NvmlGpus,
    node: &str,
    state: &StateDir,
    held: &[Held],
) -> Result<NodeInventory, ConvergeError> {
    let mut inventory = gpus.inventory(node)?;
    // The MPS servers of the agent's own daemons hold no slice: they make nothing busy.
    let pids = inventory.gpus.iter().flat_map(|g| {
        g.processes
            .iter()
            .chain(
                g.mig
                    .iter()
                    .flat_map(|m| &m.instances)
                    .flat_map(|i| &i.processes),
            )
            .map(|p| p.pid)
    });
    let servers = crate::gpu::mps::servers_among(state, pids.collect::<Vec<_>>());
    for gpu in &mut inventory.gpus {
        gpu.processes.retain(|p| !servers.contains(&p.pid));
        for i in gpu.mig.iter_mut().flat_map(|m| &mut m.instances) {
            i.processes.retain(|p| !servers.contains(&p.pid));
        }
    }
    for gpu in &mut inventory.gpus {
        slices::read_into(state, gpu)?;
        for h in held {
            let process = gpuslice_api::GpuProcess {
                pid: h.pid,
                memory: None,
                name: Some(format!("claim on {}", h.slice)),
            };
            if h.slice == gpu_slice_id(gpu.index) {
                gpu.processes.push(process);
            } else if let Some(s) = gpu
                .slices
                .iter_mut()
                .chain(
                    gpu.mig
                        .iter_mut()
                        .flat_map(|m| &mut m.instances)
                        .flat_map(|i| &mut i.slices),
                )
                .find(|s| s.id == h.slice)
            {
                s.processes.push(process);
            } else if let Some(i) = gpu.mig.as_mut().and_then(|m| {
                m.instances
                    .iter_mut()
                    .find(|i| mig_slice_id(gpu.index, i.placement.start, &i.profile) == h.slice)
            }) {
                i.processes.push(process);
            }
        }
    }
    Ok(inventory)
}

/// Runs each planned GPU's transition (planned from `before`, the node as this pass read it)
/// when `apply` is set and nothing blocks, then reads the node back once, publishes the slice
/// directories and says which GPUs now match. Returns the outcomes and the node after.
pub fn converge(
    gpus: &NvmlGpus,
    before: &NodeInventory,
    state: &StateDir,
    plans: &[GpuPlan],
    held: &[Held],
    apply: bool,
) -> Result<(Vec<GpuOutcome>, NodeInventory), ConvergeError> {
    let mut outcomes: Vec<GpuOutcome> = plans
        .iter()
        .filter(|plan| plan.error.is_none())
        .filter_map(|plan| {
            Some(converge_gpu(
                gpus,
                before,
                state,
                plan,
                plan.desired.as_ref()?,
                apply,
            ))
        })
        .collect();
    let after = read_node(gpus, &before.name, state, held)?;
    if apply {
        let configs = slices::configs(&after);
        slices::sync_dirs(state, &configs)?;
        slices::reclaim_ledgers(state, &configs);
    }
    for outcome in &mut outcomes {
        if let Some(gpu) = after.gpus.iter().find(|g| g.index == outcome.index) {
            outcome.converged = transition::satisfies(
                catalog::model(&gpu.model).ok(),
                &GpuState::from_inventory(gpu),
                &outcome.desired,
            );
        }
    }
    Ok((outcomes, after))
}

/// Writes the MPS slice tables of the instances GPU `gpu` (as read before) has once `ops` ran.
fn write_instance_slices(
    state: &StateDir,
    gpu: &GpuInventory,
    ops: &[Op],
    slices: u32,
) -> Result<(), ConvergeError> {
    let model = catalog::model(&gpu.model).map_err(|e| ConvergeError::Model {
        gpu: gpu.index,
        message: e.to_string(),
    })?;
    let mut instances: Vec<(String, gpuslice_api::Placement)> = gpu
        .mig
        .iter()
        .flat_map(|m| &m.instances)
        .map(|i| (i.profile.clone(), i.placement))
        .collect();
    for op in ops {
        match op {
            Op::DestroyInstance { placement, .. } => instances.retain(|(_, p)| p != placement),
            Op::CreateInstance { profile, placement } => {
                instances.push((profile.clone(), *placement))
            }
            _ => {}
        }
    }
    Ok(slices::write_instances(
        state, gpu, model, &instances, slices,
    )?)
}

/// Converges the node to explicit layouts, outside any pool: one read, each GPU planned from
/// it, [`converge`]. What tests and the reconcile benchmark drive.
pub fn converge_to(
    gpus: &NvmlGpus,
    node: &str,
    state: &StateDir,
    desired: &[(u32, Desired)],
    held: &[Held],
    apply: bool,
) -> Result<Vec<GpuOutcome>, ConvergeError> {
    let before = read_node(gpus, node, state, held)?;
    let plans: Vec<GpuPlan> = desired
        .iter()
        .map(|(index, want)| {
            let gpu = before.gpus.iter().find(|g| g.index == *index);
            let planned = gpu.map(|gpu| {
                transition::plan(
                    catalog::model(&gpu.model).ok(),
                    &GpuState::from_inventory(gpu),
                    want,
                )
            });
            let (ops, blocked_by, error) = match planned {
                Some(Ok(p)) => (p.ops, p.blocked_by, None),
                Some(Err(e)) => (
                    Vec::new(),
                    Vec::new(),
                    Some(GpuPlanError::Layout {
                        pool: String::new(),
                        message: e.to_string(),
                    }),
                ),
                None => (Vec::new(), Vec::new(), None),
            };
            GpuPlan {
                index: *index,
                uuid: gpu.and_then(|g| g.uuid.clone()),
                model: gpu.map(|g| g.model.clone()).unwrap_or_default(),
                assigned: None,
                desired: Some(want.clone()),
                ops,
                blocked_by,
                error,
            }
        })
        .collect();
    let errors: Vec<GpuOutcome> = plans
        .iter()
        .filter_map(|p| {
            Some(GpuOutcome {
                index: p.index,
                desired: p.desired.clone()?,
                ops: Vec::new(),
                blocked_by: Vec::new(),
                blocking: Vec::new(),
                completed: Vec::new(),
                converged: false,
                error: Some(p.error.as_ref()?.to_string()),
            })
        })
        .collect();
    let (mut outcomes, _) = converge(gpus, &before, state, &plans, held, apply)?;
    outcomes.extend(errors);
    outcomes.sort_by_key(|o| o.index);
    Ok(outcomes)
}

fn converge_gpu(
    gpus: &NvmlGpus,
    before: &NodeInventory,
    state: &StateDir,
    plan: &GpuPlan,
    want: &Desired,
    apply: bool,
) -> GpuOutcome {
    let index = plan.index;
    let mut outcome = GpuOutcome {
        index,
        desired: want.clone(),
        ops: Vec::new(),
        blocked_by: Vec::new(),
        blocking: Vec::new(),
        completed: Vec::new(),
        converged: false,
        error: None,
    };
    let Some(gpu) = before.gpus.iter().find(|g| g.index == index) else {
        outcome.error = Some(format!("the node has no GPU {index}"));
        return outcome;
    };
    // Slices MPS cannot share are never cut: their workloads would hold no share at all.
    if let Desired::Software(table) = want
        && table.mps
        && let Some(why) = crate::gpu::mps::too_old(gpu)
    {
        outcome.error = Some(why);
        return outcome;
    }
    if apply && gpu.mig.as_ref().is_some_and(|m| !m.instances.is_empty()) {
        match gpus.complete_instances(gpu.index) {
            Ok(done) => outcome.completed = done,
            Err(e) => {
                outcome.error = Some(e.to_string());
                return outcome;
            }
        }
    }
    outcome.ops = plan.ops.clone();
    outcome.blocking = blocking_processes(gpu, &plan.blocked_by);
    outcome.blocked_by = plan.blocked_by.clone();
    if !apply || !outcome.blocked_by.is_empty() {
        return outcome;
    }
    for op in &outcome.ops {
        let done = match op {
            Op::WriteSlices { table } => {
                slices::write(state, gpu, table).map_err(ConvergeError::from)
            }
            Op::ClearSlices => slices::clear(state, gpu.index).map_err(ConvergeError::from),
            Op::WriteInstanceSlices { slices: n } => {
                write_instance_slices(state, gpu, &outcome.ops, *n)
            }
            other => gpus.apply(gpu.index, other).map_err(ConvergeError::from),
        };
        if let Err(e) = done {
            // Stop this GPU at the failed step; the next pass plans from what is there.
            outcome.error = Some(format!("{op}: {e}"));
            break;
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What blocks a change of an instance cut into MPS slices is named by slice, so that a
    /// claim's pod is drained as a pod: its held slice, and the instance's processes on it.
    #[test]
    fn processes_on_an_instances_mps_slices_are_named_by_their_slice() {
        let gpu: GpuInventory = serde_yaml::from_str(
            "
index: 0
model: NVIDIA A100-SXM4-80GB
mig:
  enabled: true
  instances:
  - profile: 7g.80gb
    placement: {start: 0, size: 8}
    uuid: MIG-a
    processes: [{pid: 41}, {pid: 42}]
    slices:
    - {id: gpu0-mig0-7g.80gb-s0, memory: 39Gi, compute: 50, mps: true, processes: [{pid: 41}]}
    - {id: gpu0-mig0-7g.80gb-s1, memory: 39Gi, compute: 50, mps: true}
",
        )
        .unwrap();
        let on_slice = BlockingProcess {
            pid: 41,
            slice: "gpu0-mig0-7g.80gb-s0".into(),
        };
        assert_eq!(
            blocking_processes(
                &gpu,
                &[Blocker::Slices {
                    ids: vec!["gpu0-mig0-7g.80gb-s0".into()]
                }]
            ),
            std::slice::from_ref(&on_slice)
        );
        let instance = Blocker::Instance {
            profile: "7g.80gb".into(),
            placement: gpuslice_api::Placement { start: 0, size: 8 },
            uuid: Some("MIG-a".into()),
        };
        assert_eq!(
            blocking_processes(&gpu, &[instance]),
            [
                on_slice,
                BlockingProcess {
                    pid: 42,
                    slice: "gpu0-mig0-7g.80gb".into()
                }
            ]
        );
    }
}
