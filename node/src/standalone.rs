//! Standalone mode: the pools come from a folder or Git repository (the last good config stays in
//! force when a commit is bad), the plan from the planning core, and each pass goes to the
//! caller (printed by `gpuslice agent`). Passes run every interval, at each window boundary, and
//! sooner while a transition waits for busy processes.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpuslice_api::NodeInventory;
use gpuslice_contract::StateDir;
use gpuslice_planning::clock::Clock;
use gpuslice_planning::cluster::plan_cluster;
use gpuslice_source::SourceSpec;
use gpuslice_source::last_good::Source;

use crate::nvml::NvmlGpus;
use crate::pass::{Agent, Intent, Pass, PassError};

/// While a transition waits for processes, look again at least this often.
const BLOCKED_RETRY: Duration = Duration::from_secs(5);
/// The shortest sleep between passes: a boundary just passed is picked up by the next pass.
const MIN_SLEEP: Duration = Duration::from_millis(200);

/// Why the standalone agent cannot run.
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    #[error(transparent)]
    Nvml(#[from] crate::nvml::NvmlError),
    #[error(transparent)]
    Pass(#[from] PassError),
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
}

/// Runs the agent: one pass with `once`, else passes forever. Each pass goes to `emit`; the
/// result of the last one is returned.
pub fn run(options: &Options, mut emit: impl FnMut(&Pass)) -> Result<Pass, StandaloneError> {
    let gpus = NvmlGpus::open(options.library.as_deref())?;
    let agent = Agent::new(gpus, &options.node, options.state.clone(), options.apply);
    let mut source = Source::new(options.source.clone(), &options.state.source());
    if !options.once {
        agent.serve_socket()?;
    }
    loop {
        let now = options.at.unwrap_or_else(|| options.clock.now());
        let (config, status) = source.refresh(now);
        let config = config.unwrap_or_default();
        let mut pass = agent.pass(now, |node| Intent {
            plan: plan_cluster(&config.pools, std::slice::from_ref(node), now),
            config: config.clone(),
            problems: Vec::new(),
            preemptions: Vec::new(),
            gpus_out: std::collections::BTreeMap::new(),
        })?;
        pass.source = status;
        emit(&pass);
        if options.once {
            return Ok(pass);
        }
        std::thread::sleep(next_wake(&pass, options));
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
