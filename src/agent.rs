//! `gpuslice agent` in standalone mode: read the pools from a folder or Git, find what this
//! node's GPUs should look like now, and converge them through NVML (the system's, or the emulated
//! one with `--emulate`). Without `--apply` it only says what it would do. Without `--once` it
//! keeps doing so: every interval, at each window boundary, and sooner while a transition waits
//! for busy processes, which it drains as their CheckpointPolicy says.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpuslice_api::NodeInventory;
use gpuslice_node::{GpuOutcome, Held, NvmlGpus};
use gpuslice_planning::clock::Clock;
use gpuslice_planning::cluster::{ClusterPlan, plan_cluster};
use gpuslice_planning::transition::Desired;
use gpuslice_source::SourceSpec;

use crate::claims::{Claim, Claims};
use crate::drain::{self, DrainPolicy, Drains, Waiting};
use crate::standalone::{Config, Source, SourceStatus};

/// Why the agent cannot run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Node(#[from] gpuslice_node::AgentError),
    #[error(transparent)]
    Nvml(#[from] gpuslice_node::NvmlError),
    #[error(transparent)]
    Drain(#[from] drain::DrainError),
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
    pub source: SourceStatus,
    pub plan: ClusterPlan,
    pub outcomes: Vec<GpuOutcome>,
    /// Processes a blocked transition waits for, and what the agent did about them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub draining: Vec<Waiting>,
    /// Signals that could not be sent.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub drain_errors: Vec<String>,
    /// Slices held through `gpuslice run`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<Claim>,
}

impl Pass {
    /// Whether the pass left something wrong: a bad source, a failed GPU, a layout not reached.
    pub fn failed(&self) -> bool {
        !self.source.ok()
            || self.outcomes.iter().any(|o| {
                o.error.is_some() || (self.applied && o.blocked_by.is_empty() && !o.converged)
            })
    }

    fn blocked(&self) -> bool {
        self.outcomes.iter().any(|o| !o.blocked_by.is_empty())
    }
}

/// One pass: plan every GPU of this node against the pools and, with `apply`, converge.
#[allow(clippy::too_many_arguments)] // one pass needs all of it
pub fn run_once(
    gpus: &NvmlGpus,
    node_name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    pools: &[gpuslice_api::GpuPool],
    state_dir: &Path,
    held: &[Held],
    at: DateTime<Utc>,
    apply: bool,
) -> Result<Pass, AgentError> {
    let mut inventory = gpuslice_node::read_node(gpus, node_name, state_dir, held)?;
    inventory.labels = labels.clone();
    let plan = plan_cluster(pools, std::slice::from_ref(&inventory), at);
    let desired: Vec<(u32, Desired)> = plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .filter_map(|g| Some((g.index, g.desired.clone()?)))
        .collect();
    let outcomes = gpuslice_node::converge(gpus, node_name, state_dir, &desired, held, apply)?;
    Ok(Pass {
        node: node_name.to_string(),
        applied: apply,
        revision: None,
        source: SourceStatus::default(),
        plan,
        outcomes,
        draining: Vec::new(),
        drain_errors: Vec::new(),
        claims: Vec::new(),
    })
}

/// Warns or stops the processes that block this pass's transitions, as the checkpoint policy of
/// each GPU's pool says.
fn drain(
    pass: &mut Pass,
    config: &Config,
    state: &Path,
    now: DateTime<Utc>,
) -> Result<(), AgentError> {
    let policy_of_gpu = |index: u32| -> Option<DrainPolicy> {
        let pool_name = pass
            .plan
            .nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .find(|g| g.index == index)?
            .pool
            .as_deref()?;
        let pool = config
            .pools
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(pool_name))?;
        let name = pool.spec.checkpoint_policy.as_deref()?;
        Some(DrainPolicy::new(name, config.checkpoints.get(name)?))
    };
    let blocking: Vec<_> = pass
        .outcomes
        .iter()
        .flat_map(|o| {
            o.blocking
                .iter()
                .map(|b| (b.clone(), policy_of_gpu(o.index)))
        })
        .collect();
    let mut drains = Drains::load(state)?;
    if blocking.is_empty() && drains.records.is_empty() {
        return Ok(());
    }
    let (actions, waiting) = drain::decide(&blocking, &mut drains.records, now, |slice| {
        drain::checkpoint_done(state, slice)
    });
    // Record before acting: a crash after a signal must not signal again or restart the grace.
    drains.save()?;
    let slice_of = |pid: u32| {
        blocking
            .iter()
            .find(|(b, _)| b.pid == pid)
            .map(|(b, _)| b.slice.clone())
            .unwrap_or_default()
    };
    pass.drain_errors = actions
        .into_iter()
        .filter_map(|a| drain::execute(state, a, slice_of))
        .collect();
    pass.draining = waiting;
    Ok(())
}

/// What the agent runs on and how.
pub struct Options {
    pub source: SourceSpec,
    /// This node's name and labels (GPUs come from NVML).
    pub node: NodeInventory,
    /// The NVML library to load; the system's when `None`.
    pub library: Option<PathBuf>,
    pub state: PathBuf,
    pub apply: bool,
    pub once: bool,
    /// Plan for this instant instead of the clock's (single passes).
    pub at: Option<DateTime<Utc>>,
    pub interval: Duration,
    pub clock: Clock,
}

/// While a transition waits for processes, look again at least this often.
const BLOCKED_RETRY: Duration = Duration::from_secs(5);

/// Runs the agent: one pass with `once`, else passes forever. Each pass goes to `emit`; the
/// result of the last one is returned.
pub fn run(options: &Options, mut emit: impl FnMut(&Pass)) -> Result<Pass, AgentError> {
    let gpus = NvmlGpus::open(options.library.as_deref())?;
    let mut source = Source::new(options.source.clone(), &options.state);
    let claims = Arc::new(Claims::default());
    if !options.once {
        serve_claims(&claims, &options.state)?;
    }
    loop {
        let now = options.at.unwrap_or_else(|| options.clock.now());
        let (config, status) = source.refresh(now);
        let config = config.unwrap_or_default();
        let held: Vec<Held> = claims
            .held()
            .into_iter()
            .map(|c| Held {
                pid: c.workload.unwrap_or(c.client),
                slice: c.slice,
            })
            .collect();
        let mut pass = run_once(
            &gpus,
            &options.node.name,
            &options.node.labels,
            &config.pools,
            &options.state,
            &held,
            now,
            options.apply,
        )?;
        pass.revision = config.revision.clone();
        pass.source = status;
        if options.apply {
            drain(&mut pass, &config, &options.state, now)?;
        }
        let slices = crate::claims::slices_in(&options.state);
        let needs = crate::claims::needs(&config);
        claims.update(slices.clone(), needs.clone());
        pass.claims = claims.held();
        claims.compute().set(&crate::compute::shares(
            &slices,
            &pass.claims,
            &needs,
            &time_slices(&pass, &config.pools),
        ));
        emit(&pass);
        if options.once {
            return Ok(pass);
        }
        std::thread::sleep(next_wake(&pass, options));
    }
}

/// Each GPU's minimum compute slice: its pool's `timeSlice`.
fn time_slices(pass: &Pass, pools: &[gpuslice_api::GpuPool]) -> BTreeMap<u32, Duration> {
    pass.plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .filter_map(|gpu| {
            let pool = pools
                .iter()
                .find(|p| p.metadata.name.as_ref() == gpu.pool.as_ref())?;
            let slice = pool.spec.time_slice.as_ref()?;
            Some((gpu.index, Duration::from(*slice)))
        })
        .collect()
}

/// The socket `gpuslice run` talks to: `<state>/agent.sock`, open to every local user (the
/// agent tells callers apart by their credentials).
pub(crate) fn serve_claims(claims: &Arc<Claims>, state: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = state.join("agent.sock");
    let setup = |e: std::io::Error| AgentError::Setup(format!("{}: {e}", path.display()));
    std::fs::create_dir_all(state).map_err(setup)?;
    // A socket left by an earlier agent would refuse the bind.
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).map_err(setup)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(setup)?;
    let claims = Arc::clone(claims);
    let state = state.to_path_buf();
    std::thread::spawn(move || claims.serve(listener, state));
    Ok(())
}

/// Sleep until the interval ends, a window boundary comes, or (while blocked) the next retry
/// or grace deadline.
fn next_wake(pass: &Pass, options: &Options) -> Duration {
    let mut wake = options.interval;
    for change in pass.plan.pools.iter().filter_map(|p| p.next_change) {
        wake = wake.min(options.clock.until(change));
    }
    if pass.blocked() {
        wake = wake.min(BLOCKED_RETRY);
        for until in pass.draining.iter().filter_map(|w| w.until) {
            wake = wake.min(options.clock.until(until));
        }
    }
    // Never spin: a boundary just passed is picked up by the next pass.
    wake.max(Duration::from_millis(200))
}

/// The pass for people: each GPU's layout now, what was (or would be) done, the next change.
pub fn render(pass: &Pass) -> String {
    let mut out = format!(
        "node {} at {}{}\n",
        pass.node,
        pass.plan.at.format("%Y-%m-%d %H:%M UTC"),
        pass.revision
            .as_ref()
            .map(|r| format!(" (source commit {})", &r[..r.len().min(12)]))
            .unwrap_or_default()
    );
    out.push_str(&render_body(pass));
    out
}

/// The pass without its time line, to tell whether anything changed since the last one shown.
pub fn render_body(pass: &Pass) -> String {
    let mut out = String::new();
    if let Some(w) = &pass.source.warning {
        let _ = writeln!(out, "source: WARNING: {w}");
    }
    if !pass.source.ok() {
        let rejected = pass
            .source
            .rejected
            .as_ref()
            .map(|r| format!(" commit {}", &r[..r.len().min(12)]))
            .unwrap_or_default();
        let _ = writeln!(out, "source{rejected} REJECTED:");
        for p in &pass.source.problems {
            let _ = writeln!(out, "  {p}");
        }
        let _ = writeln!(
            out,
            "{}",
            if pass.source.in_force {
                "keeping the last good config"
            } else {
                "no good config yet: nothing changed"
            }
        );
    }
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
        for b in &o.blocking {
            let what = pass.draining.iter().find(|w| w.pid == b.pid).map_or_else(
                || "waiting for it to exit".to_string(),
                |w| w.reason.clone(),
            );
            let _ = writeln!(out, "      pid {} on {}: {what}", b.pid, b.slice);
        }
    }
    for e in &pass.drain_errors {
        let _ = writeln!(out, "  drain: ERROR: {e}");
    }
    out
}
