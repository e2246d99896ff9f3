//! `gpuslice agent --kube`: the node agent of a cluster, fed by its `GpuNode` instead of Git. It
//! applies `GpuNode.spec` (written by the operator) to the GPUs through NVML and reports back in
//! `GpuNode.status`: the inventory, the generation it applied, and `Ready` / `Blocked` conditions.
//! It owns the status under its own field manager and states all of it in every apply.

use std::time::Duration;

use futures::StreamExt as _;
use gpuslice_api::{GpuNode, GpuNodeStatus};
use gpuslice_node::{GpuOutcome, NvmlGpus};
use gpuslice_operator::desired::{condition, keep_transition_times};
use gpuslice_planning::catalog;
use gpuslice_planning::transition::Desired;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// The field manager of what the agent writes.
pub const MANAGER: &str = "gpuslice-agent";

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum InClusterError {
    #[error("GpuNode/{node}: {source}")]
    Kube { node: String, source: kube::Error },
    #[error(transparent)]
    Node(#[from] gpuslice_node::AgentError),
    #[error(transparent)]
    Nvml(#[from] gpuslice_node::NvmlError),
    #[error("{0}")]
    Socket(String),
}

/// What one pass decided for each GPU the spec names: its desired layout, or why there is none.
fn desired_from_spec(
    node: &gpuslice_api::NodeInventory,
    spec: &gpuslice_api::GpuNodeSpec,
) -> (Vec<(u32, Desired)>, Vec<String>) {
    let mut desired = Vec::new();
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
        match Desired::of(
            &assignment.layout,
            catalog::model(&gpu.model).ok(),
            &gpu.model,
        ) {
            Ok(d) => desired.push((assignment.index, d)),
            Err(e) => problems.push(format!("GPU {}: {e}", assignment.index)),
        }
    }
    (desired, problems)
}

/// The status to report after a pass.
fn status(
    inventory: gpuslice_api::NodeInventory,
    generation: Option<i64>,
    previous: Option<&GpuNodeStatus>,
    outcomes: &[GpuOutcome],
    problems: &[String],
) -> GpuNodeStatus {
    let blocked: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.blocked_by.is_empty())
        .map(|o| {
            let what: Vec<String> = o.blocked_by.iter().map(ToString::to_string).collect();
            let pids: Vec<String> = o.blocking.iter().map(|b| b.pid.to_string()).collect();
            format!(
                "GPU {}: {} (pids {})",
                o.index,
                what.join(", "),
                pids.join(", ")
            )
        })
        .collect();
    let failed: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.error.as_ref().map(|e| format!("GPU {}: {e}", o.index)))
        .chain(problems.iter().cloned())
        .collect();
    let converged = blocked.is_empty() && failed.is_empty() && outcomes.iter().all(|o| o.converged);
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
    ];
    keep_transition_times(
        &mut conditions,
        previous.map(|p| p.conditions.as_slice()).unwrap_or(&[]),
    );
    GpuNodeStatus {
        inventory: Some(inventory),
        applied_generation: if converged {
            generation
        } else {
            previous.and_then(|p| p.applied_generation)
        },
        conditions,
    }
}

/// The agent's metrics.
#[derive(Clone)]
pub struct Metrics {
    passes: Counter,
    errors: Counter,
    operations: Counter,
    blocked_seconds: Counter<f64, AtomicU64>,
    duration: Histogram,
}

impl Metrics {
    /// Metrics registered under `gpuslice_agent_`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            passes: Counter::default(),
            errors: Counter::default(),
            operations: Counter::default(),
            blocked_seconds: Counter::default(),
            duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
        };
        let r = registry.sub_registry_with_prefix("gpuslice_agent");
        r.register("passes", "Reconcile passes", m.passes.clone());
        r.register(
            "errors",
            "GPUs a pass could not bring to their layout",
            m.errors.clone(),
        );
        r.register(
            "operations",
            "MIG and slice-table operations applied",
            m.operations.clone(),
        );
        r.register(
            "blocked_seconds",
            "Time transitions spent waiting for busy instances",
            m.blocked_seconds.clone(),
        );
        r.register(
            "pass_duration_seconds",
            "Time of one pass, NVML changes included",
            m.duration.clone(),
        );
        m
    }
}

/// Runs the agent for `node` until the process ends: a pass whenever its GpuNode changes, and
/// every `interval` (processes come and go, blocked transitions retry).
pub async fn run(
    client: Client,
    gpus: &NvmlGpus,
    node: &str,
    state: &std::path::Path,
    interval: Duration,
    metrics: Metrics,
    telemetry: Option<gpuslice_operator::telemetry::Telemetry>,
) -> Result<(), InClusterError> {
    let api: Api<GpuNode> = Api::all(client);
    let kube_err = |source| InClusterError::Kube {
        node: node.to_string(),
        source,
    };
    let params = PatchParams::apply(MANAGER).force();
    // The object must exist (with an empty spec, which the operator fills) before its status.
    let existing = api.get_opt(node).await.map_err(kube_err)?;
    if existing.is_none() {
        let object = serde_json::json!({
            "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
            "metadata": {"name": node}, "spec": {},
        });
        api.patch(node, &params, &Patch::Apply(&object))
            .await
            .map_err(kube_err)?;
    }
    let changes = watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={node}")),
    );
    futures::pin_mut!(changes);
    let mut blocked_since: Option<std::time::Instant> = None;
    // Compute arbitration for the shims of this node's workloads, on the agent's socket.
    let claims = std::sync::Arc::new(crate::claims::Claims::default());
    crate::agent::serve_claims(&claims, state)
        .map_err(|e| InClusterError::Socket(e.to_string()))?;
    loop {
        let started = std::time::Instant::now();
        let current = api.get(node).await.map_err(kube_err)?;
        let inventory = gpuslice_node::read_node(gpus, node, state, &[])?;
        let (desired, problems) = desired_from_spec(&inventory, &current.spec);
        let outcomes = gpuslice_node::converge(gpus, node, state, &desired, &[], true)?;
        let after = gpuslice_node::read_node(gpus, node, state, &[])?;
        let time_slices = current
            .spec
            .gpus
            .iter()
            .filter_map(|g| Some((g.index, std::time::Duration::from(g.time_slice?))))
            .collect();
        claims.compute().set(&crate::compute::shares(
            &crate::claims::slices_in(state),
            &[],
            &std::collections::BTreeMap::new(),
            &time_slices,
        ));
        metrics.passes.inc();
        metrics
            .errors
            .inc_by(outcomes.iter().filter(|o| o.error.is_some()).count() as u64);
        metrics.operations.inc_by(
            outcomes
                .iter()
                .filter(|o| o.blocked_by.is_empty())
                .map(|o| o.ops.len() as u64)
                .sum(),
        );
        let blocked = outcomes.iter().any(|o| !o.blocked_by.is_empty());
        if let Some(since) = blocked_since {
            metrics
                .blocked_seconds
                .inc_by(since.elapsed().as_secs_f64());
        }
        blocked_since = blocked.then(std::time::Instant::now);
        metrics.duration.observe(started.elapsed().as_secs_f64());
        if let Some(t) = &telemetry {
            t.pass_done();
        }
        let report = status(
            after,
            current.metadata.generation,
            current.status.as_ref(),
            &outcomes,
            &problems,
        );
        if current.status.as_ref() != Some(&report) {
            let patch = serde_json::json!({
                "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
                "metadata": {"name": node}, "status": report,
            });
            if let Err(e) = api.patch_status(node, &params, &Patch::Apply(&patch)).await {
                eprintln!("gpuslice agent: GpuNode/{node}: reporting status: {e}");
            }
        }
        // Our own status write comes back as a change too; that pass finds nothing to do.
        let _ = tokio::time::timeout(interval, changes.next()).await;
    }
}
