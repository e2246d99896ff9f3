//! Standalone mode: the pools come from a folder or Git repository (the last good config stays in
//! force when a commit is bad), the plan from the planning core, and each pass goes to the
//! caller (printed by `gpuslice agent`). Passes run every interval, at each window boundary,
//! sooner while a transition waits for busy processes, and at once when an XID error or a GPU
//! reset comes in: pools with `faultIsolation` get the in-cluster agent's XID handling
//! (`crate::protections::faults`), told in the log, with resets said by root through the socket
//! (`gpuslice gpu-reset`).

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpuslice_api::NodeInventory;
use gpuslice_contract::StateDir;
use gpuslice_planning::cluster::plan_cluster;
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
}

/// Runs the agent: one pass with `once`, else passes forever. Each pass goes to `emit`; the
/// result of the last one is returned.
pub fn run(options: &Options, mut emit: impl FnMut(&Pass)) -> Result<Pass, StandaloneError> {
    let gpus = NvmlGpus::open(options.library.as_deref())?;
    let inbox = Inbox::default();
    let mut agent = Agent::new(gpus, &options.node, options.state.clone(), options.apply)
        .with_faults(inbox.clone())
        .with_cache_root(options.cache_root.clone());
    if !options.once {
        agent = agent.with_watchdog(
            NvmlGpus::open(options.library.as_deref())?,
            options.watchdog,
        );
    }
    let mut source = Source::new(options.source.clone(), &options.state.source());
    let mut quarantines = Quarantines::load(&options.state)?;
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
        let mut pass = agent.pass(now, |node| Intent {
            plan: plan_cluster(&config.pools, std::slice::from_ref(node), now),
            config: config.clone(),
            problems: Vec::new(),
            preemptions: Vec::new(),
            gpus_out,
        })?;
        pass.source = status;
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
            next_wake(&pass, options)
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
