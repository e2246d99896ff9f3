//! The agent's one pass, the same in both modes: read the GPUs once, let the source say what they
//! should be (planned once, from that read), converge, read back once, drain what blocks, publish
//! the slice directories, and hand the slices, claims and compute shares to the socket. A mode is
//! only a source of [`Intent`] and a sink for the [`Pass`] (see [`crate::standalone`],
//! [`crate::cluster`]).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpuslice_api::NodeInventory;
use gpuslice_contract::StateDir;
use gpuslice_planning::cluster::ClusterPlan;
use gpuslice_source::last_good::{Config, SourceStatus};
use serde::Serialize;

use crate::gpu::converge::{ConvergeError, GpuOutcome, Held, converge, read_node};
use crate::gpu::nvml::NvmlGpus;
use crate::workloads::claims::Claim;
use crate::workloads::compute::GpuShares;
use crate::workloads::drain::{DrainError, Waiting};
use crate::workloads::socket::{self, SocketError};

mod drains;
use drains::{Taking, checkpoint_policy};
mod serve;

/// Why a pass could not run at all (a GPU that fails is an outcome, not an error).
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error(transparent)]
    Converge(#[from] ConvergeError),
    #[error(transparent)]
    Drain(#[from] DrainError),
    #[error(transparent)]
    Socket(#[from] SocketError),
}

/// What a source wants of this node now.
#[derive(Clone, Debug)]
pub struct Intent {
    /// This node's GPUs planned from the pass's read: pool, layout, time slice, checkpoint
    /// policy and transition of each; and, standalone, when each pool changes next.
    pub plan: ClusterPlan,
    /// The policies claims may name and the checkpoint policies drains follow.
    pub config: Config,
    /// What the source asked for that cannot be done (a GPU the node lacks, another UUID).
    pub problems: Vec<String>,
    /// Pods' slices to take back for waiting pods (the operator's queue; none standalone).
    pub preemptions: Vec<gpuslice_api::Preemption>,
    /// GPUs taken out of service after an XID (index → the XID and its meaning): every
    /// workload on them is drained.
    pub gpus_out: BTreeMap<u32, String>,
}

/// A pod to evict, and what to tell it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Eviction {
    /// `namespace/name`; empty when only the UID is known (a stray process's pod).
    pub pod: String,
    pub uid: String,
    /// Why, and whether it checkpointed.
    pub note: String,
    /// `window`, `preemption`, `compaction`, `fault` or `stray`.
    pub cause: &'static str,
    /// `taken`, `grace_over` or `none`.
    pub checkpoint: &'static str,
}

/// The result of one pass.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pass {
    pub node: String,
    pub applied: bool,
    pub revision: Option<String>,
    pub source: SourceStatus,
    pub plan: ClusterPlan,
    pub outcomes: Vec<GpuOutcome>,
    /// What the source asked for that cannot be done.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// Processes a blocked transition waits for, and what the agent did about them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub draining: Vec<Waiting>,
    /// Signals that could not be sent.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub drain_errors: Vec<String>,
    /// Pods (`namespace/name`) whose slices a transition or a preemption needs, to evict now,
    /// each with what to tell it (why, and whether it checkpointed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub evictions: Vec<Eviction>,
    /// When each held slice's workload last wrote its checkpoint-done marker.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub checkpoints: BTreeMap<String, DateTime<Utc>>,
    /// Workloads newly past their CheckpointPolicy's interval (by half again).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub overdue: Vec<crate::workloads::interval::Overdue>,
    /// Held software slices whose processes have not computed for a while, since when.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub idle_since: BTreeMap<String, DateTime<Utc>>,
    /// Slices held through the agent's socket.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<Claim>,
    /// The node as read back at the end of the pass.
    #[serde(skip)]
    pub inventory: NodeInventory,
    /// What the arbiters were given: each GPU's software slices with their shares.
    #[serde(skip)]
    pub shares: BTreeMap<u32, GpuShares>,
    /// Each GPU with MPS slices: whether its MPS control daemon runs (as this pass left it).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub mps_daemons: BTreeMap<u32, bool>,
}

/// How long a slice's processes must not have held the GPU before its status says it is idle:
/// long enough that a workload between two kernels is not idle, and that its GpuNode status
/// changes when it stops computing, not on every pass.
pub const IDLE_AFTER: Duration = Duration::from_secs(60);

impl Pass {
    /// The held slices of the pass, as fault isolation sees them.
    pub fn holdings(&self) -> Vec<crate::protections::faults::Holding> {
        let configs = crate::gpu::slices::configs(&self.inventory);
        self.claims
            .iter()
            .filter_map(|c| {
                let gpu = configs.iter().find(|s| s.id == c.slice)?.gpu;
                let (holder, pids) = match &c.resource_claim {
                    Some(claim) => (format!("pod claim {claim}"), Vec::new()),
                    None => (
                        format!("gpuslice run pid {}", c.client),
                        std::iter::once(c.client).chain(c.workload).collect(),
                    ),
                };
                Some(crate::protections::faults::Holding {
                    slice: c.slice.clone(),
                    gpu,
                    holder,
                    pids,
                    pod_uids: c.pods.clone(),
                    pods: c.pod_names.clone(),
                })
            })
            .collect()
    }

    /// Whether the pass left something wrong: a bad source, a failed GPU, a layout not reached.
    pub fn failed(&self) -> bool {
        !self.source.ok()
            || !self.problems.is_empty()
            || self.outcomes.iter().any(|o| {
                o.error.is_some() || (self.applied && o.blocked_by.is_empty() && !o.converged)
            })
    }

    /// Whether a transition waits for busy slices.
    pub fn blocked(&self) -> bool {
        self.outcomes.iter().any(|o| !o.blocked_by.is_empty())
    }

    /// Whether every planned GPU has its layout and nothing went wrong.
    pub fn converged(&self) -> bool {
        !self.failed() && !self.blocked() && self.outcomes.iter().all(|o| o.converged)
    }
}

/// The node agent: its GPUs, its state directory, and what its socket serves.
pub struct Agent {
    gpus: NvmlGpus,
    node: String,
    labels: BTreeMap<String, String>,
    state: StateDir,
    apply: bool,
    socket: socket::Node,
    /// The node's cgroup I/O controller, or why it has none.
    io: Result<crate::protections::iolimit::Cgroups, String>,
    /// Its cpu, cpuset and memory controllers, when it has them.
    host: Option<crate::protections::hostlimit::HostCgroups>,
    /// Whether the log said once that I/O limits cannot be applied.
    io_warned: std::sync::atomic::AtomicBool,
    /// The memory watchdog's NVML handle and settings, until it starts.
    watchdog: std::sync::Mutex<Option<(NvmlGpus, crate::protections::watchdog::Settings)>>,
    /// Slice → when (monotonic ns) it last held its GPU, and that time on the agent's clock as
    /// first reported: the report stays the same while the slice stays idle.
    idle_seen: std::sync::Mutex<BTreeMap<String, (u64, DateTime<Utc>)>>,
    /// Which held workloads have missed their checkpoint interval (and were told).
    intervals: std::sync::Mutex<crate::workloads::interval::IntervalWatch>,
    /// The MPS control daemons of GPUs with an `mps` layout.
    mps: crate::gpu::mps::MpsDaemons,
}

impl Agent {
    /// An agent for `node` (name and labels; GPUs come from NVML). Without `apply` it only says
    /// what it would do.
    pub fn new(gpus: NvmlGpus, node: &NodeInventory, state: StateDir, apply: bool) -> Agent {
        Agent {
            gpus,
            node: node.name.clone(),
            labels: node.labels.clone(),
            state,
            apply,
            socket: socket::Node::default(),
            io: crate::protections::iolimit::Cgroups::detect(
                std::path::Path::new("/sys/fs/cgroup"),
                std::path::Path::new("/sys/block"),
            )
            .map_err(|e| e.to_string()),
            host: crate::protections::hostlimit::HostCgroups::detect(std::path::Path::new(
                "/sys/fs/cgroup",
            ))
            .inspect_err(|e| tracing::info!("{e}"))
            .ok(),
            io_warned: std::sync::atomic::AtomicBool::new(false),
            watchdog: std::sync::Mutex::new(None),
            idle_seen: std::sync::Mutex::default(),
            intervals: std::sync::Mutex::default(),
            mps: crate::gpu::mps::MpsDaemons::default(),
        }
    }

    /// Runs GPUs' MPS control daemons with the control tool at `control`.
    pub fn with_mps_control(mut self, control: std::path::PathBuf) -> Self {
        self.mps = crate::gpu::mps::MpsDaemons::new(control);
        self
    }

    /// Keeps held software slices to their caps with a memory watchdog on `gpus` (a handle of
    /// its own), once [`Agent::start_watchdog`] is called.
    pub fn with_watchdog(
        self,
        gpus: NvmlGpus,
        settings: crate::protections::watchdog::Settings,
    ) -> Self {
        *self.watchdog.lock().unwrap_or_else(|p| p.into_inner()) = Some((gpus, settings));
        self
    }

    /// Starts the memory watchdog given with [`Agent::with_watchdog`] (once); each thing it does
    /// goes to `report`.
    pub fn start_watchdog(
        &self,
        report: impl Fn(&crate::protections::watchdog::Report) + Send + 'static,
    ) {
        let Some((gpus, settings)) = self
            .watchdog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return;
        };
        match crate::protections::watchdog::start(
            gpus,
            self.state.clone(),
            self.socket.claims.clone(),
            self.socket.compute.clone(),
            settings,
            report,
        ) {
            Ok(()) => tracing::info!(
                "memory watchdog: reading NVML every {:?}, SIGKILL {:?} after SIGTERM",
                settings.interval,
                settings.grace
            ),
            Err(e) => tracing::error!("the memory watchdog could not start: {e}"),
        }
    }

    /// Takes GPU resets said on the socket into `inbox` (where the XID watchers deliver), so
    /// that the loop handling faults sees them. Before the socket is served.
    pub fn with_faults(mut self, inbox: crate::protections::faults::Inbox) -> Self {
        self.socket.faults = inbox;
        self
    }

    /// Keeps the pools' dataset caches under `root`, which stands for `/var/lib/gpuslice/cache`
    /// (pools name folders there). Before the socket is served.
    pub fn with_cache_root(mut self, root: std::path::PathBuf) -> Self {
        self.socket.caches = std::sync::Arc::new(crate::protections::cache::Caches::under(root));
        self
    }

    /// Closes these slices to new `gpuslice run` claims (the others are open).
    pub fn close_slices(&self, closed: std::collections::BTreeSet<String>) {
        self.socket.claims.set_closed(closed);
    }

    /// The dataset caches of the node's pools.
    pub fn caches(&self) -> std::sync::Arc<crate::protections::cache::Caches> {
        self.socket.caches.clone()
    }

    /// The node's slice claims (`gpuslice run`'s, and the prepared ResourceClaims').
    pub fn claims(&self) -> std::sync::Arc<crate::workloads::claims::Claims> {
        self.socket.claims.clone()
    }

    /// The node's cgroup I/O controller, or why it has none.
    pub fn io(&self) -> Result<&crate::protections::iolimit::Cgroups, &str> {
        self.io.as_ref().map_err(String::as_str)
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// The agent's state directory (the node contract).
    pub fn state(&self) -> &StateDir {
        &self.state
    }

    /// What monitoring reads of every GPU now (NVML).
    pub fn telemetry(&self) -> Vec<crate::gpu::nvml::GpuTelemetry> {
        self.gpus.telemetry()
    }

    /// What each software slice has had of its GPU's time until now, per GPU, and how often
    /// each GPU changed hands.
    pub fn compute_usage(
        &self,
    ) -> BTreeMap<u32, (BTreeMap<String, crate::workloads::arbiter::Usage>, u64)> {
        self.socket.compute.usage()
    }

    /// The held software slices (of `claims`) whose processes have not held the GPU for
    /// [`IDLE_AFTER`] or more, each with when they last did on the agent's clock (`now`).
    pub fn idle_since(
        &self,
        claims: &[Claim],
        now: DateTime<Utc>,
    ) -> BTreeMap<String, DateTime<Utc>> {
        let usage = self.socket.compute.usage();
        let mono = crate::workloads::compute::now_ns();
        let mut seen = self.idle_seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut idle = BTreeMap::new();
        for (slice, usage) in usage.into_values().flat_map(|(slices, _)| slices) {
            let Some(held) = usage.last_held else {
                continue;
            };
            let ago = Duration::from_nanos(mono.saturating_sub(held));
            if ago < IDLE_AFTER || !claims.iter().any(|c| c.slice == slice) {
                continue;
            }
            let since = match seen.get(&slice) {
                Some((was, since)) if *was == held => *since,
                _ => now - chrono::TimeDelta::from_std(ago).unwrap_or(chrono::TimeDelta::MAX),
            };
            seen.insert(slice.clone(), (held, since));
            idle.insert(slice, since);
        }
        seen.retain(|slice, _| idle.contains_key(slice));
        idle
    }

    /// Serves claims and compute shares on `<state>/socket/agent.sock` from now on.
    pub fn serve_socket(&self) -> Result<(), PassError> {
        Ok(self.socket.serve(&self.state)?)
    }

    /// The pass. `intent` is the source: given the node as read, what it should be.
    pub fn pass(
        &self,
        now: DateTime<Utc>,
        intent: impl FnOnce(&NodeInventory) -> Intent,
    ) -> Result<Pass, PassError> {
        let span = tracing::info_span!("pass", node = %self.node);
        let _entered = span.enter();
        let held = self.held();
        let mut before = read_node(&self.gpus, &self.node, &self.state, &held)?;
        before.labels = self.labels.clone();
        let intent = intent(&before);
        let mut plans: Vec<_> = intent
            .plan
            .nodes
            .iter()
            .flat_map(|n| n.gpus.iter().cloned())
            .collect();
        let refused = if self.apply {
            self.mps.ready_for(&self.state, &before, &mut plans)
        } else {
            BTreeMap::new()
        };
        let (mut outcomes, mut after) =
            converge(&self.gpus, &before, &self.state, &plans, &held, self.apply)?;
        after.labels = self.labels.clone();
        let mut mps_daemons = BTreeMap::new();
        if self.apply {
            let failed = self.mps.keep(&self.state, &after);
            // GPUs with MPS slices, and those refused them for want of a daemon.
            mps_daemons = after
                .gpus
                .iter()
                .filter(|g| {
                    g.slices.first().is_some_and(|s| s.mps)
                        || g.mig
                            .iter()
                            .flat_map(|m| &m.instances)
                            .any(|i| !i.slices.is_empty())
                })
                .map(|g| (g.index, !failed.contains_key(&g.index)))
                .chain(refused.keys().map(|gpu| (*gpu, false)))
                .collect();
            for (gpu, why) in refused.into_iter().chain(failed) {
                if let Some(o) = outcomes.iter_mut().find(|o| o.index == gpu) {
                    o.error = Some(format!("MPS control daemon: {why}"));
                    o.converged = false;
                }
            }
        }
        let mut pass = Pass {
            node: self.node.clone(),
            applied: self.apply,
            revision: intent.config.revision.clone(),
            source: SourceStatus::default(),
            plan: intent.plan,
            outcomes,
            problems: intent.problems,
            draining: Vec::new(),
            drain_errors: Vec::new(),
            evictions: Vec::new(),
            checkpoints: BTreeMap::new(),
            idle_since: BTreeMap::new(),
            overdue: Vec::new(),
            claims: Vec::new(),
            inventory: after,
            shares: BTreeMap::new(),
            mps_daemons,
        };
        if self.apply {
            let taken = Taking {
                preemptions: &intent.preemptions,
                gpus_out: &intent.gpus_out,
            };
            self.drain(&mut pass, &intent.config, &taken, now)?;
        }
        self.serve_slices(&mut pass, &intent.config, now);
        self.log_outcomes(&pass.outcomes);
        Ok(pass)
    }

    /// Logs what happened to each GPU: an error, a transition that waits, operations applied.
    fn log_outcomes(&self, outcomes: &[GpuOutcome]) {
        for o in outcomes {
            if let Some(e) = &o.error {
                tracing::warn!(gpu = o.index, "{e}");
            } else if !o.blocked_by.is_empty() {
                tracing::info!(gpu = o.index, blocked_by = ?o.blocked_by, "transition waits");
            } else if self.apply && !o.ops.is_empty() {
                tracing::info!(
                    gpu = o.index,
                    ops = o.ops.len(),
                    converged = o.converged,
                    "applied"
                );
            }
        }
    }

    /// The claims held now, as processes that make their slices busy; a prepared
    /// ResourceClaim's pods are not processes the agent signals (pid 0: drains wait for the
    /// kubelet to unprepare it).
    fn held(&self) -> Vec<Held> {
        self.socket
            .claims
            .held()
            .into_iter()
            .chain(self.pinned())
            .map(|c| Held {
                pid: if c.resource_claim.is_some() {
                    0
                } else {
                    c.workload.unwrap_or(c.client)
                },
                slice: c.slice,
            })
            .collect()
    }

    /// The slices the kubelet had prepared for ResourceClaims (recorded in the state
    /// directory, so they hold across agent restarts).
    fn pinned(&self) -> Vec<Claim> {
        crate::kubelet::prepared(&self.state)
            .into_iter()
            .flat_map(|p| {
                p.devices.into_iter().map(move |d| Claim {
                    slice: d.slice,
                    client: 0,
                    workload: None,
                    policy: p.policy.clone(),
                    resource_claim: Some(format!("{}/{}", p.namespace, p.name)),
                    pods: p.pods.clone(),
                    pod_names: p.pod_names.clone(),
                })
            })
            .collect()
    }
}
