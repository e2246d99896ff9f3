//! The memory watchdog: the guarantee behind the shim. The shim refuses allocations past a
//! software slice's cap inside the workload's processes, but a workload can bypass it (a static
//! binary, raw ioctls, root rewriting its own memory ledger). The agent therefore reads what the
//! driver itself says each process holds (NVML `nvmlDeviceGetComputeRunningProcesses`), adds it
//! up per held slice, and stops a slice's biggest process while the slice holds more than its
//! cap: the signal first (`SIGTERM`), `SIGKILL` after the grace period. Signals go through a
//! pidfd opened when the overrun is seen, so a pid reused in the meantime is never hit.
//!
//! Which slice a process belongs to is the agent's own knowledge (its claims: the `gpuslice run`
//! process tree, the pods a prepared ResourceClaim is reserved for, by their cgroups), never
//! something the workload writes. A process's memory counts against its slice on every GPU it
//! has memory on: a workload that reaches another GPU is over its cap there.
//!
//! **Compute** has the same second line: the shim asks the agent's arbiter for GPU time around
//! kernel launches, and a workload that launches without it gets time the arbiter never gave.
//! NVML's per-process SM utilisation (`nvmlDeviceGetProcessUtilization`), added up per held
//! software slice, shows it: a slice above its arbiter's limit by more than
//! [`COMPUTE_MARGIN`] points on [`COMPUTE_SIGHTINGS`] reads in a row has its busiest process
//! stopped the same way.
//!
//! The same reads find **stray processes**: a process on a pool's GPU that holds no slice of
//! that GPU got it past every slice (a pod whose image or `envFrom` sets
//! `NVIDIA_VISIBLE_DEVICES=all`, which admission cannot see, under a runtime that honours it; a
//! host user running outside `gpuslice run`). Seen on two reads in a row, it is stopped the same
//! way (or only reported, as the agent is told). GPUs in no pool are not watched.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuslice_contract::{SliceConfig, SliceKind, StateDir};

use crate::gpu::nvml::{NvmlGpus, ProcessMemory, ProcessUse};
use crate::protections::faults::Holding;
use crate::workloads::claims::Claims;
use crate::workloads::compute::Compute;

/// How far (percentage points of the GPU's time) a slice's measured use may pass its limit: the
/// arbiter hands out whole time slices, so a governed slice's use over one sample period may
/// stand a little above its limit.
pub const COMPUTE_MARGIN: u32 = 10;
/// Reads in a row a slice must be found over its limit (one period may catch a burst).
pub const COMPUTE_SIGHTINGS: u32 = 3;
/// Reads in a row a stray must be found: a process caught between its pod's claim being
/// prepared and the record being read is not one.
pub const STRAY_SIGHTINGS: u32 = 2;

/// How the watchdog acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// How often NVML is read.
    pub interval: Duration,
    /// From the signal to `SIGKILL`; zero kills at once.
    pub grace: Duration,
    /// What it does about stray processes.
    pub strays: StrayAction,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            interval: Duration::from_secs(1),
            grace: Duration::from_secs(5),
            strays: StrayAction::Stop,
        }
    }
}

/// What the watchdog does about a process on a pool's GPU that holds no slice of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrayAction {
    /// SIGTERM, then SIGKILL after the grace period, as for an overrun.
    Stop,
    /// Only tell it (log, metric, Event), once per process.
    Report,
}

/// A held slice, and the cap the watchdog keeps it to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watched {
    /// For software slices, the cap the holder's containers or command were given (a claim's
    /// may be below the slice's memory); MIG instances and whole GPUs have none to keep.
    pub cap: Option<u64>,
    /// On an MPS slice, the share of the SMs its holder was given (%).
    pub mps_share: Option<u32>,
    pub holding: Holding,
}

/// A process on a pool's GPU that holds no slice of that GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stray {
    pub gpu: u32,
    pub pid: u32,
    /// What NVML says it holds there (0 when it does not say).
    pub bytes: u64,
    /// The UID of the pod it runs in, when it runs in one.
    pub pod: Option<String>,
}

/// A software slice using more of the GPU's time than its arbiter's limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputeOverrun {
    pub holding: Holding,
    /// The arbiter's limit (%).
    pub limit: u32,
    /// What its processes used (% of the GPU's SM time).
    pub used: u32,
    /// Its busiest process and its use.
    pub pid: u32,
    pub percent: u32,
}

/// What the watchdog found on one read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    Overrun(Overrun),
    Compute(ComputeOverrun),
    Stray(Stray),
}

impl Finding {
    /// The process acted on.
    pub fn pid(&self) -> u32 {
        match self {
            Finding::Overrun(o) => o.pid,
            Finding::Compute(c) => c.pid,
            Finding::Stray(s) => s.pid,
        }
    }

    /// The GPU it was found on.
    pub fn gpu(&self) -> u32 {
        match self {
            Finding::Overrun(o) => o.holding.gpu,
            Finding::Compute(c) => c.holding.gpu,
            Finding::Stray(s) => s.gpu,
        }
    }

    /// What kind of finding, the GPU and the process: the same key on reads in a row.
    fn key(&self) -> (u8, u32, u32) {
        let kind = match self {
            Finding::Overrun(_) => 0,
            Finding::Compute(_) => 1,
            Finding::Stray(_) => 2,
        };
        (kind, self.gpu(), self.pid())
    }

    /// Reads in a row it must be found before the watchdog acts.
    fn sightings(&self) -> u32 {
        match self {
            Finding::Overrun(_) => 1,
            Finding::Compute(_) => COMPUTE_SIGHTINGS,
            Finding::Stray(_) => STRAY_SIGHTINGS,
        }
    }
}

/// A slice holding more than its cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overrun {
    pub holding: Holding,
    pub cap: u64,
    pub used: u64,
    /// Its biggest process and what it holds.
    pub pid: u32,
    pub bytes: u64,
}

/// What the watchdog did about a finding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Signalled,
    Killed,
    /// Told only ([`StrayAction::Report`]).
    Reported,
    Failed(String),
}

impl Step {
    /// The step as a metric's label value.
    pub fn label(&self) -> &'static str {
        match self {
            Step::Signalled => "signalled",
            Step::Killed => "killed",
            Step::Reported => "reported",
            Step::Failed(_) => "failed",
        }
    }
}

/// What the watchdog did, for the log, the metrics and the pod's Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub finding: Finding,
    pub step: Step,
}

impl Report {
    pub fn text(&self) -> String {
        // What was done to the process named after it.
        let what = match &self.step {
            Step::Signalled => "sent SIGTERM to".to_string(),
            Step::Killed => "killed".to_string(),
            Step::Reported => "left running (--stray-processes report)".to_string(),
            Step::Failed(why) => format!("could not stop ({why})"),
        };
        match &self.finding {
            Finding::Overrun(o) => format!(
                "slice {} ({}) holds {} MiB on the GPU, more than its cap of {} MiB: {what} its biggest process, pid {} ({} MiB)",
                o.holding.slice,
                o.holding.holder,
                o.used >> 20,
                o.cap >> 20,
                o.pid,
                o.bytes >> 20,
            ),
            Finding::Compute(c) => format!(
                "slice {} ({}) used {}% of the GPU's time, past its compute limit of {}% (kernels launched around the shim): {what} its busiest process, pid {} ({}%)",
                c.holding.slice, c.holding.holder, c.used, c.limit, c.pid, c.percent,
            ),
            Finding::Stray(s) => format!(
                "GPU {} is used by a process that holds no slice of it: {what} pid {} ({}, {} MiB); a workload gets a GPU through its slice only (do not set NVIDIA_VISIBLE_DEVICES in its image, env or envFrom)",
                s.gpu,
                s.pid,
                s.pod
                    .as_ref()
                    .map_or("not in a pod".to_string(), |uid| format!("pod {uid}")),
                s.bytes >> 20,
            ),
        }
    }
}

/// The watched slices over their caps, each with its biggest process. `owner` tells which
/// holding a pid belongs to.
pub fn overruns(
    watched: &[Watched],
    processes: &[ProcessMemory],
    owner: impl Fn(u32) -> Option<usize>,
) -> Vec<Overrun> {
    // Per watched slice: bytes per pid (a process may hold memory on several GPUs).
    let mut per_slice: BTreeMap<usize, BTreeMap<u32, u64>> = BTreeMap::new();
    for p in processes.iter().filter(|p| p.bytes > 0) {
        if let Some(i) = owner(p.pid).filter(|&i| i < watched.len()) {
            *per_slice.entry(i).or_default().entry(p.pid).or_default() += p.bytes;
        }
    }
    per_slice
        .into_iter()
        .filter_map(|(i, pids)| {
            let used: u64 = pids.values().sum();
            let w = &watched[i];
            let cap = w.cap?;
            if used <= cap {
                return None;
            }
            // The biggest; of equals, the newest pid.
            let (&pid, &bytes) = pids.iter().max_by_key(|(pid, bytes)| (**bytes, **pid))?;
            Some(Overrun {
                holding: w.holding.clone(),
                cap,
                used,
                pid,
                bytes,
            })
        })
        .collect()
}

/// The watched software slices whose processes used more of their GPU's time than their limit
/// (`limits`, the arbiters', by slice) plus [`COMPUTE_MARGIN`], each with its busiest process.
/// `owner` tells which holding a pid belongs to; only use on the slice's own GPU counts (a
/// process on another GPU is a stray there).
pub fn compute_overruns(
    watched: &[Watched],
    uses: &[ProcessUse],
    owner: impl Fn(u32) -> Option<usize>,
    limits: &BTreeMap<String, u32>,
) -> Vec<ComputeOverrun> {
    let mut per_slice: BTreeMap<usize, BTreeMap<u32, u32>> = BTreeMap::new();
    for u in uses.iter().filter(|u| u.sm_percent > 0) {
        if let Some(i) = owner(u.pid).filter(|&i| i < watched.len())
            && watched[i].holding.gpu == u.gpu
        {
            *per_slice.entry(i).or_default().entry(u.pid).or_default() += u.sm_percent;
        }
    }
    per_slice
        .into_iter()
        .filter_map(|(i, pids)| {
            let w = &watched[i];
            w.cap?;
            let limit = *limits.get(&w.holding.slice)?;
            let used: u32 = pids.values().sum();
            if limit >= 100 || used <= limit + COMPUTE_MARGIN {
                return None;
            }
            let (&pid, &percent) = pids.iter().max_by_key(|(pid, p)| (**p, **pid))?;
            Some(ComputeOverrun {
                holding: w.holding.clone(),
                limit,
                used,
                pid,
                percent,
            })
        })
        .collect()
}

/// The processes on the GPUs in `pools` that hold no slice of the GPU they are on: `holds(pid,
/// gpu)` tells whether the process belongs to a holder of a slice of that GPU. `spared` (the
/// agent itself) are never strays, nor are pids 0 and 1.
pub fn strays(
    processes: &[ProcessMemory],
    pools: &BTreeSet<u32>,
    holds: impl Fn(u32, u32) -> bool,
    spared: &[u32],
) -> Vec<Stray> {
    let mut seen = BTreeSet::new();
    processes
        .iter()
        .filter(|p| pools.contains(&p.gpu) && p.pid > 1 && !spared.contains(&p.pid))
        .filter(|p| seen.insert((p.gpu, p.pid)))
        .filter(|p| !holds(p.pid, p.gpu))
        .map(|p| Stray {
            gpu: p.gpu,
            pid: p.pid,
            bytes: p.bytes,
            pod: crate::workloads::process::pod_of(p.pid),
        })
        .collect()
}

/// A process signalled and not yet gone.
struct Signalled {
    at: Instant,
    pidfd: OwnedFd,
}

/// The watchdog's memory between reads: whom it signalled when.
pub struct Watchdog {
    settings: Settings,
    signalled: BTreeMap<u32, Signalled>,
    /// How many reads in a row each finding (by [`Finding::key`]) was found.
    seen: BTreeMap<(u8, u32, u32), u32>,
    /// Strays told once ([`StrayAction::Report`]) and still there.
    reported: BTreeSet<u32>,
}

impl Watchdog {
    pub fn new(settings: Settings) -> Watchdog {
        Watchdog {
            settings,
            signalled: BTreeMap::new(),
            seen: BTreeMap::new(),
            reported: BTreeSet::new(),
        }
    }

    /// Acts on this read's findings once each was found on enough reads in a row
    /// ([`Finding::sightings`]): signals the process, kills it once the grace period has passed
    /// and it is still found. Processes no longer found are forgotten.
    pub fn act(&mut self, found: &[Finding], now: Instant) -> Vec<Report> {
        let seen: BTreeMap<(u8, u32, u32), u32> = found
            .iter()
            .map(|f| (f.key(), self.seen.get(&f.key()).copied().unwrap_or(0) + 1))
            .collect();
        let due: Vec<&Finding> = found
            .iter()
            .filter(|f| seen[&f.key()] >= f.sightings())
            .collect();
        self.seen = seen;
        self.signalled
            .retain(|pid, _| due.iter().any(|f| f.pid() == *pid));
        self.reported
            .retain(|pid| due.iter().any(|f| f.pid() == *pid));
        let mut reports = Vec::new();
        for finding in due {
            let report = |step| Report {
                finding: finding.clone(),
                step,
            };
            let pid = finding.pid();
            if matches!(finding, Finding::Stray(_)) && self.settings.strays == StrayAction::Report {
                if self.reported.insert(pid) {
                    reports.push(report(Step::Reported));
                }
                continue;
            }
            if pid <= 1 || pid == std::process::id() {
                reports.push(report(Step::Failed(format!("refused to signal pid {pid}"))));
                continue;
            }
            match self.signalled.get(&pid) {
                Some(s) if now.duration_since(s.at) >= self.settings.grace => {
                    let step = match send(&s.pidfd, rustix::process::Signal::KILL) {
                        Ok(()) => Step::Killed,
                        Err(e) => Step::Failed(format!("SIGKILL to pid {pid}: {e}")),
                    };
                    self.signalled.remove(&pid);
                    reports.push(report(step));
                }
                Some(_) => {}
                None => {
                    let Some(target) = i32::try_from(pid)
                        .ok()
                        .and_then(rustix::process::Pid::from_raw)
                    else {
                        continue;
                    };
                    let pidfd = match rustix::process::pidfd_open(
                        target,
                        rustix::process::PidfdFlags::empty(),
                    ) {
                        Ok(fd) => fd,
                        // Gone already: the next read shows whether the slice is back under.
                        Err(rustix::io::Errno::SRCH) => continue,
                        Err(e) => {
                            reports.push(report(Step::Failed(format!("pidfd of pid {pid}: {e}"))));
                            continue;
                        }
                    };
                    let (signal, step) = if self.settings.grace.is_zero() {
                        (rustix::process::Signal::KILL, Step::Killed)
                    } else {
                        (rustix::process::Signal::TERM, Step::Signalled)
                    };
                    match send(&pidfd, signal) {
                        Ok(()) => {
                            if step == Step::Signalled {
                                self.signalled.insert(pid, Signalled { at: now, pidfd });
                            }
                            reports.push(report(step));
                        }
                        Err(e) => {
                            reports.push(report(Step::Failed(format!("signalling pid {pid}: {e}"))))
                        }
                    }
                }
            }
        }
        reports
    }
}

fn send(pidfd: &OwnedFd, signal: rustix::process::Signal) -> rustix::io::Result<()> {
    rustix::process::pidfd_send_signal(pidfd, signal)
}

/// The slices held now, software slices each with the cap its holder was given: `gpuslice run`
/// claims get the slice's config, prepared ResourceClaims their claim's config (read from the
/// kubelet plugin's records, which are written before the pod's containers start).
pub fn watched(state: &StateDir, claims: &Claims) -> Vec<Watched> {
    let slices = claims.slices();
    let slice = |id: &str| slices.iter().find(|s| s.id == id);
    let software_cap =
        |config: &SliceConfig| config.kind.shares_gpu().then_some(config.memory_bytes);
    let mps_share =
        |config: &SliceConfig| (config.kind == SliceKind::Mps).then_some(config.compute_percent);
    let mut out: Vec<Watched> = claims
        .held()
        .into_iter()
        .filter(|c| c.resource_claim.is_none())
        .filter_map(|c| {
            let config = slice(&c.slice)?;
            Some(Watched {
                cap: software_cap(config),
                // What `gpuslice run` was told: its policy's limit where lower.
                mps_share: mps_share(config).map(|_| claims.mps_share(config, c.policy.as_deref())),
                holding: Holding {
                    slice: c.slice.clone(),
                    gpu: config.gpu,
                    holder: format!("gpuslice run pid {}", c.client),
                    pids: std::iter::once(c.client).chain(c.workload).collect(),
                    pod_uids: Vec::new(),
                    pods: Vec::new(),
                },
            })
        })
        .collect();
    for prepared in crate::kubelet::prepared(state) {
        for device in &prepared.devices {
            let config = crate::kubelet::claim_config(state, &prepared.uid, &device.slice)
                .or_else(|| slice(&device.slice).cloned());
            let Some(config) = config else {
                continue;
            };
            out.push(Watched {
                cap: software_cap(&config),
                mps_share: mps_share(&config),
                holding: Holding {
                    slice: device.slice.clone(),
                    gpu: config.gpu,
                    holder: format!("pod claim {}/{}", prepared.namespace, prepared.name),
                    pids: Vec::new(),
                    pod_uids: prepared.pods.clone(),
                    pods: prepared.pod_names.clone(),
                },
            });
        }
    }
    out
}

/// Each held slice's compute limit: the arbiter's for a time-sliced one, the SM share its
/// holder was given on an MPS one (a client that leaves MPS runs past it).
fn limits(watched: &[Watched], compute: &Compute) -> BTreeMap<String, u32> {
    let mut limits = compute.limits();
    for w in watched {
        if let Some(share) = w.mps_share {
            limits.insert(w.holding.slice.clone(), share);
        }
    }
    limits
}

/// What one read of NVML finds: slices over their caps, and (unless the watchdog ignores them)
/// processes on a pool's GPU that hold no slice of it.
fn find(
    gpus: &NvmlGpus,
    state: &StateDir,
    claims: &Claims,
    compute: &Compute,
    since: &mut BTreeMap<u32, u64>,
) -> Vec<Finding> {
    let pools: BTreeSet<u32> = claims.slices().iter().map(|s| s.gpu).collect();
    if pools.is_empty() {
        return Vec::new();
    }
    let watched = watched(state, claims);
    let holdings: Vec<Holding> = watched.iter().map(|w| w.holding.clone()).collect();
    let processes = gpus.compute_processes();
    let owner = |pid| crate::protections::faults::owner_of(pid, &holdings);
    let mut found: Vec<Finding> = overruns(&watched, &processes, owner)
        .into_iter()
        .map(Finding::Overrun)
        .collect();
    // Per-process use matters only where a software slice is held.
    let software: BTreeSet<u32> = watched
        .iter()
        .filter(|w| w.cap.is_some())
        .map(|w| w.holding.gpu)
        .collect();
    let uses = gpus.process_utilization(&software, since);
    found.extend(
        compute_overruns(&watched, &uses, owner, &limits(&watched, compute))
            .into_iter()
            .map(Finding::Compute),
    );
    let holds = |pid, gpu| {
        let on_gpu: Vec<Holding> = holdings.iter().filter(|h| h.gpu == gpu).cloned().collect();
        crate::protections::faults::owner_of(pid, &on_gpu).is_some()
    };
    // The agent, and the MPS servers its daemons started: each holds a GPU's MPS clients'
    // context, no slice of its own.
    let mut spared = vec![std::process::id()];
    spared.extend(crate::gpu::mps::servers_among(
        state,
        processes.iter().map(|p| p.pid),
    ));
    found.extend(
        strays(&processes, &pools, holds, &spared)
            .into_iter()
            .map(Finding::Stray),
    );
    found
}

/// Reads NVML every `settings.interval` on a thread of its own and acts on what it finds; each
/// report goes to `report` (and the log).
pub fn start(
    gpus: NvmlGpus,
    state: StateDir,
    claims: Arc<Claims>,
    compute: Arc<Compute>,
    settings: Settings,
    report: impl Fn(&Report) + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("memory-watchdog".into())
        .spawn(move || {
            let mut dog = Watchdog::new(settings);
            let mut since = BTreeMap::new();
            loop {
                std::thread::sleep(settings.interval);
                let found = find(&gpus, &state, &claims, &compute, &mut since);
                for r in dog.act(&found, Instant::now()) {
                    tracing::warn!("{}", r.text());
                    report(&r);
                }
            }
        })
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn watched(slice: &str, gpu: u32, cap: u64, pids: &[u32]) -> Watched {
        Watched {
            cap: Some(cap),
            mps_share: None,
            holding: Holding {
                slice: slice.into(),
                gpu,
                holder: format!("gpuslice run pid {}", pids[0]),
                pids: pids.to_vec(),
                pod_uids: Vec::new(),
                pods: Vec::new(),
            },
        }
    }

    fn found(overruns: Vec<Overrun>) -> Vec<Finding> {
        overruns.into_iter().map(Finding::Overrun).collect()
    }

    fn owner_in(watched: &[Watched]) -> impl Fn(u32) -> Option<usize> + '_ {
        |pid| watched.iter().position(|w| w.holding.pids.contains(&pid))
    }

    #[test]
    fn a_slice_over_its_cap_across_processes_and_gpus_names_its_biggest_process() {
        let w = [
            watched("gpu0-s0", 0, 8 * GIB, &[10, 11, 12]),
            watched("gpu0-s1", 0, 8 * GIB, &[20]),
        ];
        let processes = [
            ProcessMemory {
                gpu: 0,
                pid: 11,
                bytes: 5 * GIB,
            },
            ProcessMemory {
                gpu: 0,
                pid: 12,
                bytes: 2 * GIB,
            },
            // The same workload on a GPU that is not its slice's counts too.
            ProcessMemory {
                gpu: 1,
                pid: 12,
                bytes: 4 * GIB,
            },
            // Within its cap.
            ProcessMemory {
                gpu: 0,
                pid: 20,
                bytes: 8 * GIB,
            },
            // Nobody's.
            ProcessMemory {
                gpu: 0,
                pid: 99,
                bytes: 70 * GIB,
            },
        ];
        let over = overruns(&w, &processes, owner_in(&w));
        assert_eq!(over.len(), 1, "{over:?}");
        assert_eq!(over[0].holding.slice, "gpu0-s0");
        assert_eq!(over[0].used, 11 * GIB);
        assert_eq!((over[0].pid, over[0].bytes), (12, 6 * GIB));
    }

    #[test]
    fn an_overrun_is_signalled_then_killed_after_the_grace_period_and_forgotten_once_under() {
        // A real process to signal: it ignores nothing, so SIGTERM ends it; the watchdog is
        // asked about it as a slice's biggest process.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let w = [watched("gpu0-s0", 0, GIB, &[child.id()])];
        let processes = [ProcessMemory {
            gpu: 0,
            pid: child.id(),
            bytes: 2 * GIB,
        }];
        let over = found(overruns(&w, &processes, owner_in(&w)));
        let mut dog = Watchdog::new(Settings {
            interval: Duration::from_millis(10),
            grace: Duration::from_secs(3),
            strays: StrayAction::Stop,
        });
        let t0 = Instant::now();
        let first = dog.act(&over, t0);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].step, Step::Signalled, "{}", first[0].text());
        assert!(first[0].text().contains("more than its cap of 1024 MiB"));
        // Within the grace period nothing more is done.
        assert!(dog.act(&over, t0 + Duration::from_secs(1)).is_empty());
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(15), "ended by SIGTERM");
        // Back under: forgotten.
        assert!(dog.act(&[], t0 + Duration::from_secs(2)).is_empty());
        assert!(dog.signalled.is_empty());
    }

    #[test]
    fn a_process_that_ignores_the_signal_is_killed_once_the_grace_period_is_over() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; while :; do sleep 0.1; done"])
            .spawn()
            .unwrap();
        // Let the shell install its trap.
        std::thread::sleep(Duration::from_millis(200));
        let w = [watched("gpu0-s0", 0, GIB, &[child.id()])];
        let processes = [ProcessMemory {
            gpu: 0,
            pid: child.id(),
            bytes: 2 * GIB,
        }];
        let over = found(overruns(&w, &processes, owner_in(&w)));
        let mut dog = Watchdog::new(Settings {
            interval: Duration::from_millis(10),
            grace: Duration::from_secs(2),
            strays: StrayAction::Stop,
        });
        let t0 = Instant::now();
        assert_eq!(dog.act(&over, t0)[0].step, Step::Signalled);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(child.try_wait().unwrap(), None, "SIGTERM was ignored");
        let later = dog.act(&over, t0 + Duration::from_secs(2));
        assert_eq!(later[0].step, Step::Killed, "{}", later[0].text());
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(child.wait().unwrap().signal(), Some(9), "ended by SIGKILL");
    }

    #[test]
    fn a_process_on_a_pools_gpu_that_holds_no_slice_of_it_is_a_stray() {
        let pools = BTreeSet::from([0, 1]);
        let process = |gpu, pid, bytes| ProcessMemory { gpu, pid, bytes };
        let processes = [
            // Holds a slice of GPU 0.
            process(0, 10, GIB),
            // Holds a slice of GPU 0 and reaches GPU 1 too: a stray there.
            process(1, 10, GIB),
            // Nobody's, on a pool's GPU (memory NVML does not report counts as 0).
            process(0, 99, 0),
            // Nobody's, on a GPU in no pool: not watched.
            process(2, 98, GIB),
            // The agent itself, and init.
            process(0, 4242, GIB),
            process(0, 1, GIB),
        ];
        let holds = |pid, gpu| pid == 10 && gpu == 0;
        let found: Vec<(u32, u32)> = strays(&processes, &pools, holds, &[4242])
            .iter()
            .map(|s| (s.gpu, s.pid))
            .collect();
        assert_eq!(found, vec![(1, 10), (0, 99)]);
    }

    #[test]
    fn a_stray_is_stopped_on_its_second_sighting_or_only_told_once_when_reporting() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let stray = vec![Finding::Stray(Stray {
            gpu: 0,
            pid: child.id(),
            bytes: GIB,
            pod: None,
        })];
        let settings = |strays| Settings {
            interval: Duration::from_millis(10),
            grace: Duration::from_secs(3),
            strays,
        };
        let t0 = Instant::now();
        let mut told = Watchdog::new(settings(StrayAction::Report));
        assert!(told.act(&stray, t0).is_empty(), "first sighting");
        let reports = told.act(&stray, t0 + Duration::from_secs(1));
        assert_eq!(reports.len(), 1);
        assert_eq!(reports[0].step, Step::Reported);
        assert!(
            reports[0].text().contains("holds no slice of it"),
            "{}",
            reports[0].text()
        );
        assert!(told.act(&stray, t0 + Duration::from_secs(2)).is_empty());
        assert_eq!(child.try_wait().unwrap(), None, "reported, not stopped");

        let mut dog = Watchdog::new(settings(StrayAction::Stop));
        assert!(dog.act(&stray, t0).is_empty(), "first sighting");
        // Gone from one read: seen again later, it starts over.
        assert!(dog.act(&[], t0 + Duration::from_secs(1)).is_empty());
        assert!(dog.act(&stray, t0 + Duration::from_secs(2)).is_empty());
        let reports = dog.act(&stray, t0 + Duration::from_secs(3));
        assert_eq!(reports[0].step, Step::Signalled, "{}", reports[0].text());
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(child.wait().unwrap().signal(), Some(15), "ended by SIGTERM");
    }

    #[test]
    fn a_slice_past_its_compute_limit_on_its_own_gpu_names_its_busiest_process() {
        let mut w = vec![
            watched("gpu0-s0", 0, 8 * GIB, &[10, 11]),
            watched("gpu0-s1", 0, 8 * GIB, &[20]),
            watched("gpu0-s2", 0, 8 * GIB, &[30]),
        ];
        // A MIG instance: the hardware keeps its share.
        w[2].cap = None;
        let limits = BTreeMap::from([
            ("gpu0-s0".to_string(), 25),
            ("gpu0-s1".to_string(), 25),
            ("gpu0-s2".to_string(), 25),
        ]);
        let used = |gpu, pid, sm_percent| ProcessUse {
            gpu,
            pid,
            sm_percent,
        };
        let uses = [
            used(0, 10, 30),
            used(0, 11, 50),
            // Within the margin.
            used(0, 20, 25 + COMPUTE_MARGIN),
            used(0, 30, 90),
            // Another GPU's use is not the slice's (a stray there).
            used(1, 20, 90),
        ];
        let over = compute_overruns(&w, &uses, owner_in(&w), &limits);
        assert_eq!(over.len(), 1, "{over:?}");
        assert_eq!(over[0].holding.slice, "gpu0-s0");
        assert_eq!((over[0].used, over[0].pid, over[0].percent), (80, 11, 50));
        let text = Report {
            finding: Finding::Compute(over[0].clone()),
            step: Step::Signalled,
        }
        .text();
        assert!(
            text.contains("used 80% of the GPU's time, past its compute limit of 25%"),
            "{text}"
        );
    }

    #[test]
    fn a_compute_overrun_is_acted_on_only_once_seen_on_reads_in_a_row() {
        let finding = |pid| {
            Finding::Compute(ComputeOverrun {
                holding: watched("gpu0-s0", 0, GIB, &[pid]).holding,
                limit: 25,
                used: 90,
                pid,
                percent: 90,
            })
        };
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let found = [finding(child.id())];
        let mut dog = Watchdog::new(Settings {
            interval: Duration::from_millis(10),
            grace: Duration::from_secs(3),
            strays: StrayAction::Stop,
        });
        let t0 = Instant::now();
        for read in 1..COMPUTE_SIGHTINGS {
            assert!(dog.act(&found, t0).is_empty(), "read {read}");
        }
        // A read under the limit starts the count again.
        assert!(dog.act(&[], t0).is_empty());
        for _ in 1..COMPUTE_SIGHTINGS {
            assert!(dog.act(&found, t0).is_empty());
        }
        let reports = dog.act(&found, t0);
        assert_eq!(reports[0].step, Step::Signalled, "{}", reports[0].text());
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(child.wait().unwrap().signal(), Some(15), "ended by SIGTERM");
    }
}
