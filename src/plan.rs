//! `gpuslice plan`: what every GPU of an inventory should look like now, the operations that get
//! it there, and when each pool changes next.

use std::fmt::Write as _;

use gpuslice_api::NodeInventory;
use gpuslice_planning::cluster::ClusterPlan;

/// Why an inventory file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("{file}: {path}: {message}")]
    Invalid {
        file: String,
        path: String,
        message: String,
    },
}

/// Reads a YAML list of nodes, or a single node.
pub fn parse_inventory(file: &str, text: &str) -> Result<Vec<NodeInventory>, InventoryError> {
    let invalid = |path: String, message: String| InventoryError::Invalid {
        file: file.to_string(),
        path,
        message,
    };
    let value: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| invalid(".".into(), e.to_string()))?;
    let by_path = |e: serde_path_to_error::Error<serde_yaml::Error>| {
        invalid(e.path().to_string(), e.into_inner().to_string())
    };
    if value.is_sequence() {
        serde_path_to_error::deserialize(value).map_err(by_path)
    } else {
        serde_path_to_error::deserialize(value)
            .map(|node| vec![node])
            .map_err(by_path)
    }
}

/// The plan for people.
pub fn render(plan: &ClusterPlan) -> String {
    let mut out = String::new();
    let when = |t: &Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or_else(
            || "with no change ahead".to_string(),
            |t| format!("until {}", t.format("%Y-%m-%d %H:%M UTC")),
        )
    };
    let _ = writeln!(out, "plan at {}", plan.at.format("%Y-%m-%d %H:%M UTC"));
    for p in &plan.pools {
        let layout = p
            .window
            .as_ref()
            .map_or_else(|| "default layout".to_string(), |w| format!("window {w:?}"));
        let _ = writeln!(out, "pool {}: {layout} {}", p.pool, when(&p.next_change));
    }
    let (mut gpus, mut changing, mut blocked, mut errors) = (0, 0, 0, 0);
    for node in &plan.nodes {
        let _ = writeln!(out, "\nnode {}", node.node);
        for g in &node.gpus {
            gpus += 1;
            let _ = write!(out, "  GPU {} {}", g.index, g.model);
            if let Some(pool) = &g.pool {
                let _ = write!(out, "  pool {pool}");
                if let Some(w) = &g.window {
                    let _ = write!(out, " ({w})");
                }
            }
            if let Some(d) = &g.desired {
                let _ = write!(out, "  → {d}");
            }
            let status = if let Some(e) = &g.error {
                errors += 1;
                format!("ERROR: {e}")
            } else if g.pool.is_none() {
                "not in any pool".to_string()
            } else if g.ops.is_empty() {
                "up to date".to_string()
            } else if !g.blocked_by.is_empty() {
                blocked += 1;
                let names: Vec<String> = g.blocked_by.iter().map(ToString::to_string).collect();
                format!(
                    "BLOCKED by {}: drained per the CheckpointPolicy first",
                    names.join(", ")
                )
            } else {
                changing += 1;
                format!(
                    "{} operation{}",
                    g.ops.len(),
                    if g.ops.len() == 1 { "" } else { "s" }
                )
            };
            let _ = writeln!(out, ": {status}");
            for op in &g.ops {
                let _ = writeln!(out, "      - {op}");
            }
        }
    }
    let _ = writeln!(
        out,
        "\n{gpus} GPUs: {changing} to change, {blocked} blocked, {errors} with errors"
    );
    out
}

/// Whether any GPU could not be planned.
pub fn has_errors(plan: &ClusterPlan) -> bool {
    plan.nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .any(|g| g.error.is_some())
}
