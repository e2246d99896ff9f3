//! The node plane: reads the node's GPUs through NVML, plans each GPU's transition with the
//! planning core, applies it step by step, and re-reads to confirm. Software slice tables are
//! written to the agent's state directory (see [`slices`]), of which the agent is the only writer.

pub mod nvml;
pub mod slices;

use std::path::Path;

use gpuslice_api::NodeInventory;
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
    /// Whether the GPU now has the desired layout (confirmed by reading it back).
    pub converged: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The node as NVML and the slice tables show it.
pub fn read_node(gpus: &NvmlGpus, node: &str, state: &Path) -> Result<NodeInventory, AgentError> {
    let mut inventory = gpus.inventory(node)?;
    for gpu in &mut inventory.gpus {
        gpu.slices = slices::read(state, gpu.index)?;
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
    apply: bool,
) -> Result<Vec<GpuOutcome>, AgentError> {
    let before = read_node(gpus, node, state)?;
    let mut outcomes = Vec::new();
    for (index, want) in desired {
        let Some(gpu) = before.gpus.iter().find(|g| g.index == *index) else {
            outcomes.push(GpuOutcome {
                index: *index,
                desired: want.clone(),
                ops: Vec::new(),
                blocked_by: Vec::new(),
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
            converged: false,
            error: None,
        };
        match transition::plan(model, &GpuState::from_inventory(gpu), want) {
            Err(e) => outcome.error = Some(e.to_string()),
            Ok(plan) => {
                outcome.ops = plan.ops;
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
    let after = read_node(gpus, node, state)?;
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
