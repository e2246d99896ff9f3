//! `gpuslice plan`: what every GPU of an inventory should look like now, the operations that get
//! it there, and when each pool changes next; with `--against`, what a change to the pools does
//! (for a pull request).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use gpuslice_api::{GpuNode, NodeInventory, SliceClaim};
use gpuslice_contract::slice::{gpu_slice_id, mig_slice_id};
use gpuslice_planning::cluster::ClusterPlan;
use gpuslice_planning::diff::{GpuChange, GpuSide, PlanDiff, PoolChangeKind};
use gpuslice_planning::transition::Blocker;

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

/// The nodes to plan, and who holds their slices when the inventory came from a cluster.
#[derive(Debug, Default)]
pub struct Inventory {
    pub nodes: Vec<NodeInventory>,
    /// Node name → the slices held there (`GpuNode.status.claims`).
    pub claims: BTreeMap<String, Vec<SliceClaim>>,
    /// Node name → what the operator last gave its GPUs (`GpuNode.spec.gpus`).
    pub assigned: BTreeMap<String, Vec<gpuslice_api::GpuAssignment>>,
}

/// Reads a node (NodeInventory), a YAML list of them, or GpuNodes as
/// `kubectl get gpunodes -o yaml` prints them (their reported inventory and claims).
pub fn parse_inventory(file: &str, text: &str) -> Result<Inventory, InventoryError> {
    let invalid = |path: String, message: String| InventoryError::Invalid {
        file: file.to_string(),
        path,
        message,
    };
    let value: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| invalid(".".into(), e.to_string()))?;
    let by_path = |prefix: &str, e: serde_path_to_error::Error<serde_yaml::Error>| {
        invalid(format!("{prefix}{}", e.path()), e.into_inner().to_string())
    };
    let kind = |v: &serde_yaml::Value| v.get("kind").and_then(|k| k.as_str()).map(str::to_string);
    let (items, prefix): (Vec<serde_yaml::Value>, &str) = match (&value, kind(&value).as_deref()) {
        (serde_yaml::Value::Sequence(items), _) => (items.clone(), ""),
        (_, Some("List" | "GpuNodeList")) => (
            value
                .get("items")
                .and_then(|i| i.as_sequence())
                .cloned()
                .unwrap_or_default(),
            "items",
        ),
        _ => (vec![value], "single"),
    };
    let mut out = Inventory::default();
    for (i, item) in items.into_iter().enumerate() {
        let at = match prefix {
            "single" => String::new(),
            _ => format!("{prefix}[{i}]."),
        };
        if kind(&item).as_deref() == Some("GpuNode") {
            let node: GpuNode =
                serde_path_to_error::deserialize(item).map_err(|e| by_path(&at, e))?;
            let name = node.metadata.name.clone().unwrap_or_default();
            let status = node.status.unwrap_or_default();
            let Some(mut inventory) = status.inventory else {
                return Err(invalid(
                    format!("{at}status.inventory"),
                    format!(
                        "GpuNode {name} has no inventory yet: its agent has not reported; wait for it or leave the node out"
                    ),
                ));
            };
            inventory.name = name.clone();
            out.assigned.insert(name.clone(), node.spec.gpus);
            out.claims.insert(name, status.claims);
            out.nodes.push(inventory);
        } else {
            let node: NodeInventory =
                serde_path_to_error::deserialize(item).map_err(|e| by_path(&at, e))?;
            out.nodes.push(node);
        }
    }
    Ok(out)
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
            if let Some(assigned) = &g.assigned {
                let _ = write!(out, "  pool {}", assigned.pool);
                if let Some(w) = &assigned.window {
                    let _ = write!(out, " ({w})");
                }
            }
            if let Some(d) = &g.desired {
                let _ = write!(out, "  → {d}");
            }
            let status = if let Some(e) = &g.error {
                errors += 1;
                format!("ERROR: {e}")
            } else if g.assigned.is_none() {
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

/// Who runs on the slices that block a GPU's change: the pods of a ResourceClaim or the
/// `gpuslice run` process (from the GpuNode's claims), else the processes the inventory lists.
pub fn blocking_workloads(change: &GpuChange, inventory: &Inventory) -> Vec<String> {
    let node = inventory.nodes.iter().find(|n| n.name == change.node);
    let gpu = node.and_then(|n| n.gpus.iter().find(|g| g.index == change.index));
    let claims = inventory
        .claims
        .get(&change.node)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut out = Vec::new();
    for blocker in &change.blocked_by {
        let (slices, processes): (Vec<String>, Vec<&gpuslice_api::GpuProcess>) = match blocker {
            Blocker::Instance {
                profile, placement, ..
            } => (
                vec![mig_slice_id(change.index, placement.start, profile)],
                gpu.and_then(|g| g.mig.as_ref())
                    .into_iter()
                    .flat_map(|m| &m.instances)
                    .filter(|i| i.placement == *placement)
                    .flat_map(|i| &i.processes)
                    .collect(),
            ),
            Blocker::Slices { ids } => (
                ids.clone(),
                gpu.into_iter()
                    .flat_map(|g| &g.slices)
                    .filter(|s| ids.contains(&s.id))
                    .flat_map(|s| &s.processes)
                    .collect(),
            ),
            Blocker::Gpu => (
                vec![gpu_slice_id(change.index)],
                gpu.into_iter().flat_map(|g| &g.processes).collect(),
            ),
        };
        let held: Vec<&SliceClaim> = claims
            .iter()
            .filter(|c| slices.contains(&c.slice))
            .collect();
        if held.is_empty() {
            out.extend(processes.iter().map(|p| match &p.name {
                Some(name) => format!("pid {} ({name})", p.pid),
                None => format!("pid {}", p.pid),
            }));
        }
        for c in held {
            let who = if !c.pods.is_empty() {
                format!("pod {}", c.pods.join(", pod "))
            } else if let Some(claim) = &c.resource_claim {
                format!("ResourceClaim {claim}")
            } else {
                format!("pid {}", c.pid.unwrap_or_default())
            };
            let policy = c
                .policy
                .as_ref()
                .map(|p| format!(", policy {p}"))
                .unwrap_or_default();
            out.push(format!("{who} on {}{policy}", c.slice));
        }
    }
    out.dedup();
    out
}

fn side(s: &GpuSide) -> String {
    if let Some(e) = &s.error {
        return format!("ERROR: {e}");
    }
    let Some(pool) = &s.pool else {
        return "no pool".to_string();
    };
    let window = s
        .window
        .as_ref()
        .map(|w| format!(" ({w})"))
        .unwrap_or_default();
    match &s.desired {
        Some(d) => format!("{pool}{window}: {d}"),
        None => format!("{pool}{window}"),
    }
}

fn time(t: &Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map_or_else(
        || "no change ahead".to_string(),
        |t| t.format("%Y-%m-%d %H:%M UTC").to_string(),
    )
}

fn window_now(w: &Option<String>) -> String {
    w.as_ref()
        .map_or_else(|| "default layout".to_string(), |w| format!("window {w:?}"))
}

/// One line per pool change: added/removed, layout, windows, the layout in force now.
fn pool_lines(diff: &PlanDiff) -> Vec<String> {
    diff.pools
        .iter()
        .map(|p| {
            let mut what = Vec::new();
            match p.change {
                PoolChangeKind::Added => what.push("added".to_string()),
                PoolChangeKind::Removed => what.push("removed".to_string()),
                PoolChangeKind::Changed => {}
            }
            if p.layout_changed {
                what.push("default layout changed".into());
            }
            if p.settings_changed {
                what.push("selectors or settings changed".into());
            }
            for (label, names) in [
                ("window added", &p.windows_added),
                ("window removed", &p.windows_removed),
                ("window changed", &p.windows_changed),
            ] {
                if !names.is_empty() {
                    what.push(format!("{label}: {}", names.join(", ")));
                }
            }
            if p.window_now.0 != p.window_now.1 {
                what.push(format!(
                    "in force now: {} → {}",
                    window_now(&p.window_now.0),
                    window_now(&p.window_now.1)
                ));
            }
            if p.next_change.0 != p.next_change.1 {
                what.push(format!(
                    "next change: {} → {}",
                    time(&p.next_change.0),
                    time(&p.next_change.1)
                ));
            }
            format!("pool {}: {}", p.pool, what.join("; "))
        })
        .collect()
}

fn summary(diff: &PlanDiff) -> String {
    let blocked = diff
        .gpus
        .iter()
        .filter(|g| !g.blocked_by.is_empty())
        .count();
    let errors = diff.head_errors().count();
    format!(
        "{} of {} GPUs change, {blocked} of them blocked by running work, {errors} with errors",
        diff.gpus.len(),
        diff.gpus_planned
    )
}

/// What a change does, for people at a terminal.
pub fn render_diff(diff: &PlanDiff, inventory: &Inventory, base: &str, head: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan {head} against {base} at {}",
        diff.at.format("%Y-%m-%d %H:%M UTC")
    );
    for line in pool_lines(diff) {
        let _ = writeln!(out, "{line}");
    }
    if diff.pools.is_empty() {
        let _ = writeln!(out, "no pool changes");
    }
    for g in &diff.gpus {
        let _ = writeln!(
            out,
            "\nnode {} GPU {} {}: {} → {}",
            g.node,
            g.index,
            g.model,
            side(&g.base),
            side(&g.head)
        );
        if !g.blocked_by.is_empty() {
            let what: Vec<String> = g.blocked_by.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                out,
                "  BLOCKED by {}: drained per the CheckpointPolicy first",
                what.join(", ")
            );
            for w in blocking_workloads(g, inventory) {
                let _ = writeln!(out, "    - {w}");
            }
        }
        for op in &g.ops {
            let _ = writeln!(out, "  - {op}");
        }
    }
    let _ = writeln!(out, "\n{}", summary(diff));
    out
}

/// What a change does, as Markdown for a pull-request comment.
pub fn render_diff_markdown(
    diff: &PlanDiff,
    inventory: &Inventory,
    base: &str,
    head: &str,
) -> String {
    let cell = |s: &str| s.replace('|', "\\|").replace('\n', " ");
    let mut out = String::new();
    let verdict = if diff.head_errors().next().is_some() {
        "❌ cannot be planned"
    } else if diff.blocks_on_running_work() {
        "⚠️ waits for running work to drain"
    } else if diff.gpus.is_empty() {
        "✅ changes no GPU now"
    } else {
        "✅ applies without draining"
    };
    let _ = writeln!(
        out,
        "### gpuslice plan: `{}` against `{}` — {verdict}\n",
        cell(head),
        cell(base)
    );
    let _ = writeln!(
        out,
        "Planned at {}. {}.\n",
        diff.at.format("%Y-%m-%d %H:%M UTC"),
        summary(diff)
    );
    if !diff.pools.is_empty() {
        let _ = writeln!(out, "**Pools**\n");
        for line in pool_lines(diff) {
            let _ = writeln!(out, "- {}", cell(&line));
        }
        let _ = writeln!(out);
    }
    if !diff.gpus.is_empty() {
        let _ = writeln!(
            out,
            "| Node | GPU | Before | After | Operations | Blocked by |\n|---|---|---|---|---|---|"
        );
        for g in &diff.gpus {
            let mut blocked: Vec<String> = g.blocked_by.iter().map(ToString::to_string).collect();
            blocked.extend(blocking_workloads(g, inventory));
            let _ = writeln!(
                out,
                "| {} | {} {} | {} | {} | {} | {} |",
                cell(&g.node),
                g.index,
                cell(&g.model),
                cell(&side(&g.base)),
                cell(&side(&g.head)),
                g.ops.len(),
                cell(&blocked.join("<br>"))
            );
        }
    }
    out
}

/// What compaction would do in one pool.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolCompaction {
    pub pool: String,
    pub threshold: f64,
    /// `node/gpu` freed, in order.
    pub freed: Vec<String>,
    /// `claim: node/gpu → node/gpu`.
    pub moves: Vec<String>,
    /// Node → fragmentation before and after, percent.
    pub fragmentation: BTreeMap<String, (f64, f64)>,
    pub kept: Vec<String>,
}

/// The compaction plan of each pool with `spec.compaction`: its GPUs cut into software slices
/// (as `plan` lays them out now), held as the GpuNodes' claims say; a claim may move when its
/// policy is preemptible and has a CheckpointPolicy (its own or the pool's). MIG instances and
/// whole GPUs are not compacted.
pub fn compaction(
    pools: &[gpuslice_api::GpuPool],
    policies: &[gpuslice_api::GpuSlicePolicy],
    plan: &ClusterPlan,
    inventory: &Inventory,
) -> Vec<PoolCompaction> {
    use gpuslice_planning::compaction::{Capacity, GpuState, Workload};
    use gpuslice_planning::transition::Desired;
    let mut out = Vec::new();
    for pool in pools {
        let Some(settings) = &pool.spec.compaction else {
            continue;
        };
        let name = pool.metadata.name.clone().unwrap_or_default();
        let threshold = settings.fragmentation_threshold.unwrap_or(0.3);
        let headroom = pool.spec.headroom_bytes();
        let mut gpus = Vec::new();
        for node in &plan.nodes {
            let claims = inventory.claims.get(&node.node);
            for gpu in node.gpus.iter().filter(|g| g.pool() == Some(name.as_str())) {
                let Some(Desired::Software(table)) = &gpu.desired else {
                    continue;
                };
                let prefix = format!("gpu{}-s", gpu.index);
                let workloads: Vec<Workload> = claims
                    .into_iter()
                    .flatten()
                    .filter(|c| c.slice.starts_with(&prefix))
                    .map(|c| {
                        let policy = c.policy.as_ref().and_then(|p| {
                            policies
                                .iter()
                                .find(|q| q.metadata.name.as_deref() == Some(p.as_str()))
                        });
                        let size = policy
                            .and_then(|p| gpuslice_api::bytes_of(&p.spec.memory.0).ok())
                            .map_or(table.memory, |m| m + headroom);
                        let movable = policy.is_some_and(|p| {
                            p.spec.preemptible
                                && (p.spec.checkpoint_policy.is_some()
                                    || pool.spec.checkpoint_policy.is_some())
                        });
                        Workload {
                            id: c
                                .resource_claim
                                .clone()
                                .or(c.pid.map(|p| format!("pid {p}")))
                                .unwrap_or_else(|| c.slice.clone()),
                            size,
                            movable,
                        }
                    })
                    .collect();
                gpus.push(GpuState {
                    node: node.node.clone(),
                    gpu: gpu.index,
                    capacity: Capacity::Slices {
                        size: table.memory,
                        total: table.slices,
                        free: table.slices.saturating_sub(workloads.len() as u32),
                    },
                    workloads,
                });
            }
        }
        let planned = gpuslice_planning::compaction::plan(&gpus, threshold);
        let at = |(node, gpu): &(String, u32)| format!("{node}/gpu{gpu}");
        out.push(PoolCompaction {
            pool: name,
            threshold,
            freed: planned.freed.iter().map(at).collect(),
            moves: planned
                .moves
                .iter()
                .map(|m| format!("{}: {} → {}", m.workload, at(&m.from), at(&m.to)))
                .collect(),
            fragmentation: planned
                .fragmentation
                .into_iter()
                .map(|(n, (a, b))| (n, (100.0 * a, 100.0 * b)))
                .collect(),
            kept: planned.kept,
        });
    }
    out
}

/// Compaction plans as text.
pub fn render_compaction(plans: &[PoolCompaction]) -> String {
    let mut out = String::new();
    if plans.is_empty() {
        out.push_str("no pool sets spec.compaction\n");
    }
    for p in plans {
        out.push_str(&format!(
            "pool {} (threshold {:.0} %): {} GPUs freed by {} moves\n",
            p.pool,
            100.0 * p.threshold,
            p.freed.len(),
            p.moves.len()
        ));
        for (node, (before, after)) in &p.fragmentation {
            out.push_str(&format!(
                "  node {node}: fragmentation {before:.0} % → {after:.0} %\n"
            ));
        }
        for m in &p.moves {
            out.push_str(&format!("  move {m}\n"));
        }
        for k in &p.kept {
            out.push_str(&format!("  keep {k}\n"));
        }
    }
    out
}

/// What a repository declares, as the elastic plan reads it.
pub struct Declared<'a> {
    pub pools: &'a [gpuslice_api::GpuPool],
    pub policies: &'a [gpuslice_api::GpuSlicePolicy],
    pub checkpoints: &'a [gpuslice_api::CheckpointPolicy],
}

/// What the elastic sets in force would do now: each pool's decision (and the re-cuts it
/// stages) from the GPUs as the inventory has them (their shapes from the GpuNodes' spec, their
/// work from the GpuNodes' claims) and the pods said to wait per policy. Pools read from Git
/// carry no learned forecast: only the demand given counts.
pub fn elastic(
    declared: &Declared,
    inventory: &Inventory,
    waiting: &BTreeMap<String, u32>,
    at: chrono::DateTime<chrono::Utc>,
) -> ElasticPlan {
    use gpuslice_operator::desired::{Allocated, NodeReport, Observed};
    let Declared {
        pools, policies, ..
    } = *declared;
    let plan = gpuslice_planning::cluster::plan_cluster(pools, &inventory.nodes, at);
    let pool_of = |node: &str, gpu: u32| {
        plan.nodes
            .iter()
            .find(|n| n.node == node)
            .and_then(|n| n.gpus.iter().find(|g| g.index == gpu))
            .and_then(|g| g.pool().map(str::to_string))
    };
    let mut allocated = Vec::new();
    for (node, claims) in &inventory.claims {
        for claim in claims {
            let gpu = gpu_of_slice(&claim.slice);
            let pool = gpu.and_then(|g| pool_of(node, g));
            allocated.push(Allocated {
                policy: claim.policy.clone(),
                node: node.clone(),
                gpu,
                last_checkpoint: claim
                    .last_checkpoint
                    .as_ref()
                    .and_then(gpuslice_api::chrono_of),
                idle_since: claim.idle_since.as_ref().and_then(gpuslice_api::chrono_of),
                max_loss: gpuslice_planning::shaping::max_loss_of(
                    policies
                        .iter()
                        .find(|p| p.metadata.name.is_some() && p.metadata.name == claim.policy),
                    pool.as_deref().and_then(|name| {
                        pools
                            .iter()
                            .find(|p| p.metadata.name.as_deref() == Some(name))
                    }),
                    |name| {
                        declared
                            .checkpoints
                            .iter()
                            .find(|c| c.metadata.name.as_deref() == Some(name))
                            .map(|c| &c.spec)
                    },
                ),
                pool,
            });
        }
    }
    let observed = Observed {
        pools: pools.to_vec(),
        policies: policies.to_vec(),
        allocated,
        nodes: inventory
            .nodes
            .iter()
            .map(|n| NodeReport {
                inventory: n.clone(),
                assigned: inventory.assigned.get(&n.name).cloned().unwrap_or_default(),
                ..NodeReport::default()
            })
            .collect(),
        waiting: waiting.clone(),
        ..Observed::default()
    };
    let state = gpuslice_operator::desired::desired(&observed, at);
    let mut out = ElasticPlan::default();
    for (pool, status) in state.pool_status {
        if let Some(mut e) = status.elastic {
            // Nothing learned from Git: the empty forecast would only be noise.
            e.forecast = None;
            out.pools.insert(pool, e);
        }
    }
    for (node, spec) in state.node_specs {
        for g in spec.gpus {
            let Some(next) = g.next.filter(|n| n.assigned.shape.is_some()) else {
                continue;
            };
            out.recuts.push(ElasticRecut {
                pool: next.assigned.pool.clone(),
                gpu: format!("{node}/gpu{}", g.index),
                from: g.assigned.shape.map(|s| s.name),
                to: next.assigned.shape.map(|s| s.name).unwrap_or_default(),
                at: gpuslice_api::chrono_of(&next.at),
            });
        }
    }
    out
}

/// The GPU index a slice id names (`gpu2`, `gpu2-s1`, `gpu2-mig4-1g.18gb`).
fn gpu_of_slice(slice: &str) -> Option<u32> {
    let rest = slice.strip_prefix("gpu")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// What `gpuslice plan --elastic` shows.
#[derive(Debug, Default, serde::Serialize)]
pub struct ElasticPlan {
    /// Pool → where its elastic set stands and what it decides.
    pub pools: BTreeMap<String, gpuslice_api::ElasticStatus>,
    /// The re-cuts it would stage now.
    pub recuts: Vec<ElasticRecut>,
}

/// A GPU the elastic decision re-cuts.
#[derive(Debug, serde::Serialize)]
pub struct ElasticRecut {
    pub pool: String,
    /// `node/gpuN`.
    pub gpu: String,
    /// Its shape now (none while its layout is none of the set's).
    pub from: Option<String>,
    pub to: String,
    /// When it switches.
    pub at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The elastic plan for people.
pub fn render_elastic(plan: &ElasticPlan) -> String {
    let mut out = String::new();
    if plan.pools.is_empty() {
        out.push_str("no pool has an elastic set in force at this time\n");
    }
    for (pool, e) in &plan.pools {
        let shapes: Vec<String> = e.shapes.iter().map(|(s, n)| format!("{s} {n}")).collect();
        let _ = writeln!(
            out,
            "pool {pool}: GPUs per shape: {}",
            if shapes.is_empty() {
                "none yet".to_string()
            } else {
                shapes.join(", ")
            }
        );
        let _ = writeln!(out, "  decision: {}", e.decision);
        for w in &e.waiting_for {
            let _ = writeln!(out, "  waiting for: {w}");
        }
        for r in plan.recuts.iter().filter(|r| &r.pool == pool) {
            let _ = writeln!(
                out,
                "  {}: {} → {} at {}",
                r.gpu,
                r.from.as_deref().unwrap_or("(outside the set)"),
                r.to,
                r.at.map_or_else(String::new, |t| t
                    .format("%Y-%m-%d %H:%M:%S UTC")
                    .to_string())
            );
        }
    }
    out
}
