//! Standalone mode: the pools come from a folder or Git repository (the last good config stays in
//! force when a commit is bad), the plan from the planning core, and each pass goes to the
//! caller (printed by `gpuslice agent`). Passes run every interval, at each window boundary,
//! sooner while a transition waits for busy processes, and at once when an XID error or a GPU
//! reset comes in: pools with `faultIsolation` get the in-cluster agent's XID handling
//! (`crate::protections::faults`), told in the log, with resets said by root through the socket
//! (`gpuslice gpu-reset`). Pools with an elastic set in force have their GPUs shaped by the
//! demand of the `gpuslice run` line (see [`Shapes`]).

use std::path::PathBuf;
use std::time::Duration;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::{ElasticStatus, GpuAssignment, GpuPool, GpuSlicePolicy, NodeInventory};
use gpuslice_contract::StateDir;
use gpuslice_contract::slice::{SliceConfig, SliceKind};
use gpuslice_planning::cluster::{ClusterPlan, plan_cluster};
use gpuslice_planning::shaping::{Allocated, NodeNow, Seen, set_in_force};
use gpuslice_runtime::clock::Clock;
use gpuslice_source::SourceSpec;
use gpuslice_source::last_good::Source;

use crate::gpu::nvml::NvmlGpus;
use crate::pass::{Agent, Intent, Pass, PassError};
use crate::protections::faults::{self, Inbox, Quarantines};

/// While a transition waits for processes, look again at least this often.
const BLOCKED_RETRY: Duration = Duration::from_secs(5);
/// The shortest sleep between passes: a boundary just passed is picked up by the next pass.
const MIN_SLEEP: Duration = Duration::from_millis(200);

/// Why the standalone agent cannot run.
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    #[error(transparent)]
    Nvml(#[from] crate::gpu::nvml::NvmlError),
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Faults(#[from] faults::FaultError),
}

/// What the agent runs on and how.
pub struct Options {
    pub source: SourceSpec,
    /// This node's name and labels (GPUs come from NVML).
    pub node: NodeInventory,
    /// The NVML library to load; the system's when `None`.
    pub library: Option<PathBuf>,
    pub state: StateDir,
    pub apply: bool,
    pub once: bool,
    /// Plan for this instant instead of the clock's (single passes).
    pub at: Option<DateTime<Utc>>,
    pub interval: Duration,
    pub clock: Clock,
    /// Where the kernel's XID records are read (which process caused an error).
    pub kernel_log: PathBuf,
    /// The memory watchdog's pace (a service only).
    pub watchdog: crate::protections::watchdog::Settings,
    /// Where `/var/lib/gpuslice/cache`, the pools' dataset caches' root, is.
    pub cache_root: PathBuf,
    /// NVIDIA's MPS control tool, which runs GPUs' MPS daemons (`mps` layouts).
    pub mps_control: PathBuf,
}

/// The slices held now, as the elastic decision reads them: the claims board, and which held
/// slices have been idle since when.
struct Held<'a> {
    claims: &'a crate::workloads::claims::Claims,
    idle_since: BTreeMap<String, DateTime<Utc>>,
}

/// Runs the agent: one pass with `once`, else passes forever. Each pass goes to `emit`; the
/// result of the last one is returned.
pub fn run(options: &Options, mut emit: impl FnMut(&Pass)) -> Result<Pass, StandaloneError> {
    let gpus = NvmlGpus::open(options.library.as_deref())?;
    let inbox = Inbox::default();
    let mut agent = Agent::new(gpus, &options.node, options.state.clone(), options.apply)
        .with_faults(inbox.clone())
        .with_cache_root(options.cache_root.clone())
        .with_mps_control(options.mps_control.clone());
    if !options.once {
        agent = agent.with_watchdog(
            NvmlGpus::open(options.library.as_deref())?,
            options.watchdog,
        );
    }
    let mut source = Source::new(options.source.clone(), &options.state.source());
    let mut quarantines = Quarantines::load(&options.state)?;
    let mut shapes = Shapes::load(&options.state);
    if !options.once {
        agent.serve_socket()?;
        agent.start_watchdog(|_| {});
        watch_faults(options, &inbox);
    }
    loop {
        let now = options.at.unwrap_or_else(|| options.clock.now());
        let (config, status) = source.refresh(now);
        let config = config.unwrap_or_default();
        let gpus_out = quarantines.gpus_out();
        let claims = agent.claims();
        let idle_since = agent.idle_since(&claims.held(), now);
        let mut look_again = None;
        let mut pass = agent.pass(now, |node| {
            let mut plan = plan_cluster(&config.pools, std::slice::from_ref(node), now);
            let held = Held {
                claims: &claims,
                idle_since,
            };
            look_again = shapes.shape(&config, node, &mut plan, &held, &options.state, now);
            Intent {
                plan,
                config: config.clone(),
                problems: Vec::new(),
                preemptions: Vec::new(),
                gpus_out,
            }
        })?;
        if !options.once {
            shapes.save(&options.state);
        }
        pass.source = status;
        for overdue in &pass.overdue {
            tracing::warn!("{}", overdue.text(now));
        }
        let took_out = if options.once {
            false
        } else {
            isolate_faults(&agent, &pass, &config, &mut quarantines, &inbox, now)
        };
        emit(&pass);
        if options.once {
            return Ok(pass);
        }
        // A GPU just taken out starts draining at once.
        let wake = if took_out {
            MIN_SLEEP
        } else {
            let staged = look_again.map_or(Duration::MAX, |t| options.clock.until(t));
            next_wake(&pass, options).min(staged.max(MIN_SLEEP))
        };
        sleep_unless_faults(wake, &inbox);
    }
}

/// Starts the XID watchers: NVML events (on a handle of their own) and the kernel log.
fn watch_faults(options: &Options, inbox: &Inbox) {
    match faults::follow_kernel_log(&options.kernel_log, inbox.clone()) {
        Ok(_) => tracing::info!("reading XID records from {}", options.kernel_log.display()),
        Err(e) => tracing::warn!(
            "XIDs cannot be traced to processes ({e}): a software slice is quarantined only when it is the only one held on its GPU"
        ),
    }
    let delivered = inbox.clone();
    match NvmlGpus::open(options.library.as_deref())
        .and_then(|gpus| gpus.watch_xids(move |seen| delivered.xid(seen)))
    {
        Ok(_) => tracing::info!("watching XID errors"),
        Err(e) => tracing::warn!("XID errors are not watched: {e}"),
    }
}

/// Acts on the XIDs and resets that came in (for pools with `faultIsolation`), says what it
/// did in the log, keeps the quarantines, and closes quarantined slices to `gpuslice run`.
/// Whether a GPU was taken out of service.
fn isolate_faults(
    agent: &Agent,
    pass: &Pass,
    config: &gpuslice_source::last_good::Config,
    quarantines: &mut Quarantines,
    inbox: &Inbox,
    now: DateTime<Utc>,
) -> bool {
    let before = quarantines.list.clone();
    let isolating: Vec<&str> = config
        .pools
        .iter()
        .filter(|p| p.spec.fault_isolation.as_ref().is_some_and(|f| f.enabled))
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    let isolating_gpu = |gpu: u32| {
        pass.plan
            .nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .find(|g| g.index == gpu)
            .and_then(|g| g.pool())
            .is_some_and(|pool| isolating.contains(&pool))
    };
    let notices = faults::isolate(
        &mut quarantines.list,
        &inbox.take(std::time::Instant::now()),
        &pass.inventory,
        &pass.holdings(),
        &isolating_gpu,
        &inbox.take_resets(),
        now,
    );
    for notice in &notices {
        match notice.text(&pass.node) {
            (true, text) => tracing::warn!("{text}"),
            (false, text) => tracing::info!("{text}"),
        }
    }
    if quarantines.list != before
        && let Err(e) = quarantines.save()
    {
        tracing::error!("keeping the quarantines: {e}");
    }
    let closed = crate::gpu::slices::configs(&pass.inventory)
        .into_iter()
        .filter(|c| !quarantines.taints(c.gpu, &c.id).is_empty())
        .map(|c| c.id)
        .collect();
    agent.close_slices(closed);
    notices
        .iter()
        .any(|n| matches!(n, faults::Notice::GpuOut(_)))
}

/// Sleeps for `wake`, or until an XID or a GPU reset is ready to handle.
fn sleep_unless_faults(wake: Duration, inbox: &Inbox) {
    let until = std::time::Instant::now() + wake;
    loop {
        let now = std::time::Instant::now();
        if now >= until || inbox.ready(now) {
            return;
        }
        std::thread::sleep((until - now).min(MIN_SLEEP));
    }
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
    wake.max(MIN_SLEEP)
}

/// The elastic sets on this node, as the operator keeps them in a cluster (each GPU's shape and
/// staged re-cut in `GpuNode.spec`, the forecast in the pool's status), kept in
/// `<state>/elastic.json` so that a restarted agent keeps its shapes, their minDwell and what
/// it learned. The demand is the `gpuslice run` line: commands holding slices and waiting, per
/// policy they named.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Shapes {
    /// What each GPU of an elastic pool was given, with any re-cut staged.
    gpus: Vec<GpuAssignment>,
    /// Pool → its elastic status as last decided.
    pools: BTreeMap<String, ElasticStatus>,
}

impl Shapes {
    /// The last state kept; none when there is none or it cannot be read (said in the log: the
    /// GPUs then start again from the shape their layout matches, without minDwell).
    fn load(state: &StateDir) -> Shapes {
        let path = state.elastic();
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!(
                    "{}: not an elastic state file ({e}); starting afresh",
                    path.display()
                );
                Shapes::default()
            }),
            Err(_) => Shapes::default(),
        }
    }

    /// Keeps the state (replaced whole, so a crash leaves the old or the new one).
    fn save(&self, state: &StateDir) {
        let path = state.elastic();
        let write = || -> std::io::Result<()> {
            let dir = path.parent().unwrap_or(std::path::Path::new("."));
            let tmp = tempfile::NamedTempFile::new_in(dir)?;
            serde_json::to_writer_pretty(&tmp, self)?;
            tmp.persist(&path).map_err(|e| e.error)?;
            Ok(())
        };
        if let Err(e) = write() {
            tracing::warn!("{}: keeping the elastic state: {e}", path.display());
        }
    }

    /// Shapes the GPUs of `node` in `plan` by the demand on `claims` at `now`, tells the claims
    /// board which slices a re-cut could give, and says each new re-cut in the log. Returns when
    /// to look again (a staged switch, a held-back re-cut).
    fn shape(
        &mut self,
        config: &gpuslice_source::last_good::Config,
        node: &NodeInventory,
        plan: &mut ClusterPlan,
        held: &Held,
        state: &StateDir,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let claims = held.claims;
        let pools: Vec<GpuPool> = config
            .pools
            .iter()
            .map(|p| {
                let mut p = p.clone();
                let name = p.metadata.name.clone().unwrap_or_default();
                p.status = self.pools.get(&name).map(|e| gpuslice_api::GpuPoolStatus {
                    elastic: Some(e.clone()),
                    ..Default::default()
                });
                p
            })
            .collect();
        let policies: Vec<GpuSlicePolicy> = config
            .policies
            .iter()
            .map(|(name, spec)| GpuSlicePolicy::new(name, spec.clone()))
            .collect();
        let gpu_of: BTreeMap<String, u32> =
            claims.slices().into_iter().map(|s| (s.id, s.gpu)).collect();
        let pool_of = |gpu: u32| {
            plan.nodes
                .iter()
                .flat_map(|n| &n.gpus)
                .find(|g| g.index == gpu)
                .and_then(|g| g.pool().map(str::to_string))
        };
        let allocated: Vec<Allocated> = claims
            .held()
            .into_iter()
            .map(|c| {
                let gpu = gpu_of.get(&c.slice).copied();
                let last_checkpoint = std::fs::metadata(state.checkpoint_done(&c.slice))
                    .and_then(|m| m.modified())
                    .ok()
                    .map(DateTime::<Utc>::from);
                let pool = gpu.and_then(pool_of);
                let max_loss = gpuslice_planning::shaping::max_loss_of(
                    policies
                        .iter()
                        .find(|p| p.metadata.name.as_deref() == c.policy.as_deref()),
                    pools
                        .iter()
                        .find(|p| p.metadata.name.as_deref() == pool.as_deref()),
                    |name| config.checkpoints.get(name),
                );
                Allocated {
                    pool,
                    policy: c.policy,
                    node: node.name.clone(),
                    gpu,
                    last_checkpoint,
                    idle_since: held.idle_since.get(&c.slice).copied(),
                    max_loss,
                }
            })
            .collect();
        let waiting = claims.waiting_by_policy();
        let shaped = gpuslice_planning::shaping::shape(
            &Seen {
                pools: &pools,
                policies: &policies,
                nodes: &[NodeNow {
                    inventory: node,
                    assigned: &self.gpus,
                }],
                allocated: &allocated,
                waiting: &waiting,
                // The standalone agent reads no Prometheus: the line and the learned forecast.
                prometheus: &BTreeMap::new(),
            },
            plan,
            now,
        );
        claims.set_possible(possible_slices(&pools, plan));
        for (pool, status) in &shaped.status {
            let old = self.pools.get(pool).and_then(|e| e.last_recut.as_ref());
            if let Some(recut) = &status.last_recut
                && old != Some(recut)
            {
                tracing::info!("pool {pool}: elastic re-cut: {}", recut.reason);
            }
        }
        self.pools = shaped.status;
        self.gpus = shaped
            .gpus
            .into_iter()
            .map(|((_, index), g)| GpuAssignment {
                index,
                uuid: node
                    .gpus
                    .iter()
                    .find(|x| x.index == index)
                    .and_then(|x| x.uuid.clone()),
                assigned: g.now,
                recut_at: g.next.as_ref().map(|n| n.at.clone()),
                next: g.next,
            })
            .collect();
        shaped.next_look
    }
}

/// The slices each GPU of a pool with an elastic set in force could be cut into (one of each
/// size per shape is enough to tell whether a request could ever fit).
fn possible_slices(pools: &[GpuPool], plan: &ClusterPlan) -> Vec<SliceConfig> {
    let mut out = Vec::new();
    for (pool, timing) in pools.iter().zip(&plan.pools) {
        let Some(set) = set_in_force(pool, timing.window.as_deref()) else {
            continue;
        };
        for g in plan.nodes.iter().flat_map(|n| &n.gpus) {
            if g.pool() != pool.metadata.name.as_deref() {
                continue;
            }
            let model = gpuslice_planning::catalog::model(&g.model).ok();
            let memory = model.map_or(0, |m| m.memory_bytes());
            for shape in &set.shapes {
                let slots =
                    gpuslice_planning::elastic::slots(&shape.layout, model, &g.model, memory);
                for slot in slots.into_iter().flatten() {
                    out.push(SliceConfig {
                        id: String::new(),
                        kind: SliceKind::Software,
                        gpu: g.index,
                        device_uuid: String::new(),
                        device_minor: None,
                        memory_bytes: slot.memory,
                        compute_percent: slot.compute,
                    });
                }
            }
        }
    }
    out.sort_by_key(|s| (s.gpu, s.memory_bytes, s.compute_percent));
    out.dedup_by_key(|s| (s.gpu, s.memory_bytes, s.compute_percent));
    out
}
