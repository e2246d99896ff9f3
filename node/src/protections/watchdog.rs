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

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuslice_contract::{SliceConfig, SliceKind, StateDir};

use crate::gpu::nvml::{NvmlGpus, ProcessMemory};
use crate::protections::faults::Holding;
use crate::workloads::claims::Claims;

/// How the watchdog acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// How often NVML is read.
    pub interval: Duration,
    /// From the signal to `SIGKILL`; zero kills at once.
    pub grace: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            interval: Duration::from_secs(1),
            grace: Duration::from_secs(5),
        }
    }
}

/// A held software slice the watchdog keeps to its cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watched {
    /// The cap the holder's containers or command were given (a claim's may be below the
    /// slice's memory).
    pub cap: u64,
    pub holding: Holding,
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

/// What the watchdog did about an overrun.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Signalled,
    Killed,
    Failed(String),
}

/// What the watchdog did, for the log, the metrics and the pod's Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub overrun: Overrun,
    pub step: Step,
}

impl Report {
    pub fn text(&self) -> String {
        let o = &self.overrun;
        let what = match &self.step {
            Step::Signalled => "sent SIGTERM to".to_string(),
            Step::Killed => "killed".to_string(),
            Step::Failed(why) => format!("could not stop ({why})"),
        };
        format!(
            "slice {} ({}) holds {} MiB on the GPU, more than its cap of {} MiB: {what} its biggest process, pid {} ({} MiB)",
            o.holding.slice,
            o.holding.holder,
            o.used >> 20,
            o.cap >> 20,
            o.pid,
            o.bytes >> 20,
        )
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
            if used <= w.cap {
                return None;
            }
            // The biggest; of equals, the newest pid.
            let (&pid, &bytes) = pids.iter().max_by_key(|(pid, bytes)| (**bytes, **pid))?;
            Some(Overrun {
                holding: w.holding.clone(),
                cap: w.cap,
                used,
                pid,
                bytes,
            })
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
}

impl Watchdog {
    pub fn new(settings: Settings) -> Watchdog {
        Watchdog {
            settings,
            signalled: BTreeMap::new(),
        }
    }

    /// Acts on this read's overruns: signals a slice's biggest process, kills it once the grace
    /// period has passed and its slice is still over. Processes no longer over are forgotten.
    pub fn act(&mut self, overruns: &[Overrun], now: Instant) -> Vec<Report> {
        self.signalled
            .retain(|pid, _| overruns.iter().any(|o| o.pid == *pid));
        let mut reports = Vec::new();
        for overrun in overruns {
            let report = |step| Report {
                overrun: overrun.clone(),
                step,
            };
            let pid = overrun.pid;
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

/// The software slices held now, each with the cap its holder was given: `gpuslice run`
/// claims get the slice's config, prepared ResourceClaims their claim's config.
pub fn watched(state: &StateDir, claims: &Claims) -> Vec<Watched> {
    let slices = claims.slices();
    let software = |id: &str| {
        slices
            .iter()
            .find(|s| s.id == id && s.kind == SliceKind::Software)
    };
    let mut out: Vec<Watched> = claims
        .held()
        .into_iter()
        .filter(|c| c.resource_claim.is_none())
        .filter_map(|c| {
            let slice = software(&c.slice)?;
            Some(Watched {
                cap: slice.memory_bytes,
                holding: Holding {
                    slice: c.slice.clone(),
                    gpu: slice.gpu,
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
            let Some(config) = crate::kubelet::claim_config(state, &prepared.uid, &device.slice)
                .filter(|c: &SliceConfig| c.kind == SliceKind::Software)
            else {
                continue;
            };
            out.push(Watched {
                cap: config.memory_bytes,
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

/// Reads NVML every `settings.interval` on a thread of its own and acts on overruns; each
/// report goes to `report` (and the log).
pub fn start(
    gpus: NvmlGpus,
    state: StateDir,
    claims: Arc<Claims>,
    settings: Settings,
    report: impl Fn(&Report) + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("memory-watchdog".into())
        .spawn(move || {
            let mut dog = Watchdog::new(settings);
            loop {
                std::thread::sleep(settings.interval);
                let watched = watched(&state, &claims);
                if watched.is_empty() {
                    dog.act(&[], Instant::now());
                    continue;
                }
                let holdings: Vec<Holding> = watched.iter().map(|w| w.holding.clone()).collect();
                let processes = gpus.compute_processes();
                let over = overruns(&watched, &processes, |pid| {
                    crate::protections::faults::owner_of(pid, &holdings)
                });
                for r in dog.act(&over, Instant::now()) {
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
            cap,
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
        let over = overruns(&w, &processes, owner_in(&w));
        let mut dog = Watchdog::new(Settings {
            interval: Duration::from_millis(10),
            grace: Duration::from_secs(3),
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
        let over = overruns(&w, &processes, owner_in(&w));
        let mut dog = Watchdog::new(Settings {
            interval: Duration::from_millis(10),
            grace: Duration::from_secs(2),
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
}
