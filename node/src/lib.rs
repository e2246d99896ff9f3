//! The node plane: reads the node's GPUs through NVML, plans each GPU's transition with the
//! planning core, applies it step by step, and re-reads to confirm. Software slice tables are
//! written to the agent's state directory (see [`slices`]), of which the agent is the only writer.

pub mod arbiter;
pub mod nvml;
pub mod slices;

use std::path::Path;

use gpuslice_api::{GpuInventory, NodeInventory};
use gpuslice_planning::catalog;
use gpuslice_planning::transition::{self, Blocker, Desired, GpuState, Op};
use serde::Serialize;

pub use nvml::{NvmlError, NvmlGpus};

/// Why a pass could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Nvml(#[from] NvmlError),
    #[error(transparent)]
    Slices(#[from] slices::SliceError),
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
                    let slice = slices::mig_slice_id(gpu.index, i);
                    out.extend(i.processes.iter().map(|p| BlockingProcess {
                        pid: p.pid,
                        slice: slice.clone(),
                    }));
                }
            }
            Blocker::Gpu => out.extend(gpu.processes.iter().map(|p| BlockingProcess {
                pid: p.pid,
                slice: slices::gpu_slice_id(gpu.index),
            })),
            Blocker::Slices { ids } => {
                for s in gpu.slices.iter().filter(|s| ids.contains(&s.id)) {
                    out.extend(s.processes.iter().map(|p| BlockingProcess {
                        pid: p.pid,
                        slice: s.id.clone(),
                    }));
                }
            }
        }
    }
    out.sort_by_key(|p| p.pid);
    out.dedup();
    out
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
    state: &Path,
    held: &[Held],
) -> Result<NodeInventory, AgentError> {
    let mut inventory = gpus.inventory(node)?;
    for gpu in &mut inventory.gpus {
        gpu.slices = slices::read(state, gpu.index)?;
        for h in held {
            let process = gpuslice_api::GpuProcess {
                pid: h.pid,
                memory: None,
                name: Some(format!("claim on {}", h.slice)),
            };
            if h.slice == slices::gpu_slice_id(gpu.index) {
                gpu.processes.push(process);
            } else if let Some(s) = gpu.slices.iter_mut().find(|s| s.id == h.slice) {
                s.processes.push(process);
            } else if let Some(i) = gpu.mig.as_mut().and_then(|m| {
                m.instances
                    .iter_mut()
                    .find(|i| slices::mig_slice_id(gpu.index, i) == h.slice)
            }) {
                i.processes.push(process);
            }
        }
    }
    Ok(inventory)
}

/// One reconcile pass: for each `(GPU index, desired layout)`, plan from what is there now and,
/// when `apply` is set and nothing blocks, run the plan and read the GPU back.
pub fn converge(
    gpus: &NvmlGpus,
    node: &str,
    state: &Path,
    desired: &[(u32, Desired)],
    held: &[Held],
    apply: bool,
) -> Result<Vec<GpuOutcome>, AgentError> {
    let before = read_node(gpus, node, state, held)?;
    let mut outcomes = Vec::new();
    for (index, want) in desired {
        let Some(gpu) = before.gpus.iter().find(|g| g.index == *index) else {
            outcomes.push(GpuOutcome {
                index: *index,
                desired: want.clone(),
                ops: Vec::new(),
                blocked_by: Vec::new(),
                blocking: Vec::new(),
                completed: Vec::new(),
                converged: false,
                error: Some(format!("the node has no GPU {index}")),
            });
            continue;
        };
        let model = catalog::model(&gpu.model).ok();
        let mut outcome = GpuOutcome {
            index: *index,
            desired: want.clone(),
            ops: Vec::new(),
            blocked_by: Vec::new(),
            blocking: Vec::new(),
            completed: Vec::new(),
            converged: false,
            error: None,
        };
        if apply && gpu.mig.as_ref().is_some_and(|m| !m.instances.is_empty()) {
            match gpus.complete_instances(gpu.index) {
                Ok(done) => outcome.completed = done,
                Err(e) => {
                    outcome.error = Some(e.to_string());
                    outcomes.push(outcome);
                    continue;
                }
            }
        }
        match transition::plan(model, &GpuState::from_inventory(gpu), want) {
            Err(e) => outcome.error = Some(e.to_string()),
            Ok(plan) => {
                outcome.ops = plan.ops;
                outcome.blocking = blocking_processes(gpu, &plan.blocked_by);
                outcome.blocked_by = plan.blocked_by;
                if apply && outcome.blocked_by.is_empty() {
                    for op in &outcome.ops {
                        let done = match op {
                            Op::WriteSlices { table } => {
                                slices::write(state, gpu, table).map_err(AgentError::from)
                            }
                            Op::ClearSlices => {
                                slices::clear(state, gpu.index).map_err(AgentError::from)
                            }
                            other => gpus.apply(gpu.index, other).map_err(AgentError::from),
                        };
                        if let Err(e) = done {
                            // Stop this GPU at the failed step; the next pass plans from what is there.
                            outcome.error = Some(format!("{op}: {e}"));
                            break;
                        }
                    }
                }
            }
        }
        outcomes.push(outcome);
    }
    let after = read_node(gpus, node, state, held)?;
    if apply {
        slices::sync_dirs(state, &slices::configs(&after))?;
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
    Ok(outcomes)
}
