//! `gpuslice agent` in standalone mode: read the pools from a folder or Git, find what this
//! node's GPUs should look like now, and converge them through NVML (the system's, or the emulated
//! one with `--emulate`). Without `--apply` it only says what it would do.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use gpuslice_api::NodeInventory;
use gpuslice_node::{GpuOutcome, NvmlGpus};
use gpuslice_planning::cluster::{ClusterPlan, plan_cluster};
use gpuslice_planning::transition::Desired;

/// Why the agent cannot run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Node(#[from] gpuslice_node::AgentError),
    #[error(transparent)]
    Nvml(#[from] gpuslice_node::NvmlError),
}

/// Where the emulated `libnvidia-ml` is: next to the running `gpuslice`, as cargo builds it.
pub fn emulator_library() -> Result<PathBuf, AgentError> {
    let exe = std::env::current_exe()
        .map_err(|e| AgentError::Setup(format!("locating gpuslice: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    [dir.join("libnvidia_ml.so"), dir.join("deps/libnvidia_ml.so")]
        .into_iter()
        .find(|p| p.exists())
        .ok_or_else(|| AgentError::Setup(format!("the NVML emulator (libnvidia_ml.so) is not next to {}: build the workspace with cargo build", exe.display())))
}

/// Seeds (or reuses) the emulated machine's state file for an inventory, and points the
/// emulated NVML at it. The state persists between runs, as hardware would.
pub fn prepare_emulator(state_dir: &Path, node: &NodeInventory) -> Result<PathBuf, AgentError> {
    std::fs::create_dir_all(state_dir)
        .map_err(|e| AgentError::Setup(format!("{}: {e}", state_dir.display())))?;
    let path = state_dir.join(format!("emulated-{}.json", node.name));
    if gpuslice_emulator::Store::open(&path).is_err() {
        let machine = gpuslice_emulator::Machine::from_inventory(node)
            .map_err(|e| AgentError::Setup(format!("emulated node {}: {e}", node.name)))?;
        gpuslice_emulator::Store::create(&path, &machine)
            .map_err(|e| AgentError::Setup(e.to_string()))?;
    }
    // SAFETY: called from main before any other thread exists; the emulated NVML reads it at init.
    unsafe { std::env::set_var("GPUSLICE_EMULATOR_STATE", &path) };
    Ok(path)
}

/// The result of one pass.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pass {
    pub node: String,
    pub applied: bool,
    pub revision: Option<String>,
    pub plan: ClusterPlan,
    pub outcomes: Vec<GpuOutcome>,
}

/// One pass: plan every GPU of this node against the pools and, with `apply`, converge.
pub fn run_once(
    gpus: &NvmlGpus,
    node_name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    pools: &[gpuslice_api::GpuPool],
    state_dir: &Path,
    at: DateTime<Utc>,
    apply: bool,
) -> Result<Pass, AgentError> {
    let mut inventory = gpuslice_node::read_node(gpus, node_name, state_dir)?;
    inventory.labels = labels.clone();
    let plan = plan_cluster(pools, std::slice::from_ref(&inventory), at);
    let desired: Vec<(u32, Desired)> = plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .filter_map(|g| Some((g.index, g.desired.clone()?)))
        .collect();
    let outcomes = gpuslice_node::converge(gpus, node_name, state_dir, &desired, apply)?;
    Ok(Pass {
        node: node_name.to_string(),
        applied: apply,
        revision: None,
        plan,
        outcomes,
    })
}

/// The pass for people: each GPU's layout now, what was (or would be) done, the next change.
pub fn render(pass: &Pass) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node {} at {}{}",
        pass.node,
        pass.plan.at.format("%Y-%m-%d %H:%M UTC"),
        pass.revision
            .as_ref()
            .map(|r| format!(" (source {r})"))
            .unwrap_or_default()
    );
    let used: Vec<&str> = pass
        .plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .filter_map(|g| g.pool.as_deref())
        .collect();
    for p in pass
        .plan
        .pools
        .iter()
        .filter(|p| used.contains(&p.pool.as_str()))
    {
        let layout = p
            .window
            .as_ref()
            .map_or_else(|| "default layout".to_string(), |w| format!("window {w:?}"));
        let next = p.next_change.map_or_else(
            || "no change ahead".to_string(),
            |t| format!("next change {}", t.format("%Y-%m-%d %H:%M UTC")),
        );
        let _ = writeln!(out, "pool {}: {layout}, {next}", p.pool);
    }
    for g in pass.plan.nodes.iter().flat_map(|n| &n.gpus) {
        let _ = write!(out, "  GPU {} {}", g.index, g.model);
        let Some(pool) = &g.pool else {
            let _ = writeln!(out, ": {}", g.error.as_deref().unwrap_or("not in any pool"));
            continue;
        };
        let _ = write!(
            out,
            "  pool {pool}{}",
            g.window
                .as_ref()
                .map(|w| format!(" ({w})"))
                .unwrap_or_default()
        );
        let Some(o) = pass.outcomes.iter().find(|o| o.index == g.index) else {
            let _ = writeln!(
                out,
                ": ERROR: {}",
                g.error.as_deref().unwrap_or("no layout")
            );
            continue;
        };
        let status = if let Some(e) = &o.error {
            format!("ERROR: {e}")
        } else if !o.blocked_by.is_empty() {
            let names: Vec<String> = o.blocked_by.iter().map(ToString::to_string).collect();
            format!(
                "BLOCKED by {}: waiting for them to exit or checkpoint",
                names.join(", ")
            )
        } else if o.ops.is_empty() {
            "up to date".to_string()
        } else if pass.applied {
            format!(
                "{} operation{} applied, {}",
                o.ops.len(),
                if o.ops.len() == 1 { "" } else { "s" },
                if o.converged {
                    "confirmed"
                } else {
                    "NOT confirmed"
                }
            )
        } else {
            format!(
                "{} operation{} to apply (run with --apply)",
                o.ops.len(),
                if o.ops.len() == 1 { "" } else { "s" }
            )
        };
        let _ = writeln!(out, "  → {}: {status}", o.desired);
        for op in &o.ops {
            let _ = writeln!(out, "      - {op}");
        }
    }
    out
}
