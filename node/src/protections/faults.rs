//! Fault isolation (`GpuPool.spec.faultIsolation`). XID errors come from NVML's event sets
//! ([`crate::gpu::nvml::NvmlGpus::watch_xids`]); the process that caused one comes from the kernel's
//! record of it (`NVRM: Xid (PCI:0000:3b:00): 31, pid=1234, …`, read from `/dev/kmsg`), as
//! NVML's event does not name it. [`gpuslice_planning::xid`] says what each XID does:
//! quarantine the slice whose workload caused it, or take the whole GPU out of service (its
//! workloads drained by their CheckpointPolicy). Quarantines are kept in the state directory so
//! they survive a restart. A slice's ends when the workload that faulted releases it; a GPU's
//! when someone says it was reset (`gpuslice.io/gpu-reset` on the GpuNode).

use std::collections::VecDeque;
use std::io::{BufRead as _, BufReader, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use gpuslice_api::k8s_openapi::api::resource::v1::DeviceTaint;
use gpuslice_api::{NodeInventory, Placement};
use gpuslice_contract::StateDir;
use gpuslice_contract::slice::mig_slice_id;
use gpuslice_planning::xid::{XidAction, rule_for};
use serde::{Deserialize, Serialize};

/// How long an XID waits for the kernel's record of it (which names the process) before it is
/// handled without one.
pub const KERNEL_WAIT: Duration = Duration::from_secs(2);
/// Kernel records older than this match no XID.
const KERNEL_KEEP: Duration = Duration::from_secs(60);

/// Why quarantines cannot be read or kept.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a quarantine list ({source}); move it away to start afresh")]
    Corrupt {
        path: String,
        source: serde_json::Error,
    },
}

/// A PCI address (domain, bus, device), as NVML (`00000000:3B:00.0`) and the kernel's XID lines
/// (`0000:3b:00`) write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciAddress {
    domain: u32,
    bus: u32,
    device: u32,
}

impl PciAddress {
    pub fn parse(text: &str) -> Option<PciAddress> {
        let mut parts = text.trim().split(':');
        let hex = |part: Option<&str>| u32::from_str_radix(part?, 16).ok();
        let domain = hex(parts.next())?;
        let bus = hex(parts.next())?;
        let device = hex(parts.next()?.split('.').next())?;
        parts.next().is_none().then_some(PciAddress {
            domain,
            bus,
            device,
        })
    }
}

/// An XID as NVML reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XidSeen {
    pub gpu: u32,
    pub code: u64,
    /// The MIG instance it happened in, when NVML names one.
    pub instance: Option<Placement>,
    /// The GPU's PCI address, to find the kernel's record.
    pub bus: Option<PciAddress>,
}

/// The kernel's record of an XID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelXid {
    pub bus: PciAddress,
    pub code: u64,
    /// The process it names, when it names one.
    pub pid: Option<u32>,
}

/// Reads an NVRM XID line (with or without `/dev/kmsg`'s `6,1234,5678,-;` prefix).
pub fn parse_kernel_line(line: &str) -> Option<KernelXid> {
    const MARK: &str = "NVRM: Xid (PCI:";
    let rest = &line[line.find(MARK)? + MARK.len()..];
    let (address, rest) = rest.split_once("):")?;
    let rest = rest.trim_start();
    let digits = rest.split(|c: char| !c.is_ascii_digit()).next()?;
    Some(KernelXid {
        bus: PciAddress::parse(address)?,
        code: digits.parse().ok()?,
        pid: rest
            .split(',')
            .find_map(|field| field.trim().strip_prefix("pid="))
            .and_then(|pid| pid.parse().ok()),
    })
}

#[derive(Debug, Default)]
struct Received {
    xids: Vec<(Instant, XidSeen)>,
    kernel: VecDeque<(Instant, KernelXid)>,
    resets: Vec<String>,
}

/// What the watcher threads received and the agent's loop has not handled yet; the loop wakes
/// when something comes.
#[derive(Clone, Debug, Default)]
pub struct Inbox {
    received: Arc<Mutex<Received>>,
    wake: Arc<tokio::sync::Notify>,
}

impl Inbox {
    fn received(&self) -> std::sync::MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn xid(&self, seen: XidSeen) {
        self.received().xids.push((Instant::now(), seen));
        self.wake.notify_one();
    }

    pub fn kernel(&self, record: KernelXid) {
        self.received().kernel.push_back((Instant::now(), record));
        self.wake.notify_one();
    }

    /// Root said these GPUs were reset (the socket's `gpuReset`; the value as the GpuNode
    /// annotation takes it).
    pub fn reset(&self, gpus: String) {
        self.received().resets.push(gpus);
        self.wake.notify_one();
    }

    /// The resets said since the last call.
    pub fn take_resets(&self) -> Vec<String> {
        std::mem::take(&mut self.received().resets)
    }

    /// Whether a reset, or an XID that [`Inbox::take`] would give now, waits to be handled.
    pub fn ready(&self, now: Instant) -> bool {
        let received = self.received();
        !received.resets.is_empty()
            || received
                .xids
                .iter()
                .any(|(at, seen)| ready(seen, *at, &received.kernel, now).is_some())
    }

    /// Resolves when something was received since the last call.
    pub async fn changed(&self) {
        self.wake.notified().await;
    }

    /// The XIDs ready to handle, each with the process the kernel named: once its record is
    /// in, or [`KERNEL_WAIT`] after it came without one; at once when no process is needed
    /// (NVML named the MIG instance, or the XID quarantines no slice).
    pub fn take(&self, now: Instant) -> Vec<(XidSeen, Option<u32>)> {
        let mut received = self.received();
        let Received { xids, kernel, .. } = &mut *received;
        kernel.retain(|(at, _)| now.saturating_duration_since(*at) < KERNEL_KEEP);
        let mut out = Vec::new();
        xids.retain(|(at, seen)| match ready(seen, *at, kernel, now) {
            Some(Some(i)) => {
                let pid = kernel.remove(i).and_then(|(_, k)| k.pid);
                out.push((seen.clone(), pid));
                false
            }
            Some(None) => {
                out.push((seen.clone(), None));
                false
            }
            None => true,
        });
        out
    }

    /// How long until a waiting XID is handled without its kernel record.
    pub fn next_due(&self, now: Instant) -> Option<Duration> {
        self.received()
            .xids
            .iter()
            .map(|(at, _)| (*at + KERNEL_WAIT).saturating_duration_since(now))
            .min()
    }
}

/// Whether an XID seen at `at` can be handled now: `Some(Some(i))` with the kernel's record
/// `i` of it; `Some(None)` without one (none is needed, or it was waited for long enough);
/// `None` while its record may still come. Only a slice's error without its MIG instance needs
/// the process named.
fn ready(
    seen: &XidSeen,
    at: Instant,
    kernel: &VecDeque<(Instant, KernelXid)>,
    now: Instant,
) -> Option<Option<usize>> {
    if let Some(i) = kernel
        .iter()
        .position(|(_, k)| Some(k.bus) == seen.bus && k.code == seen.code)
    {
        return Some(Some(i));
    }
    let needs_pid =
        seen.instance.is_none() && rule_for(seen.code).action == XidAction::QuarantineSlice;
    (!needs_pid || now.saturating_duration_since(at) >= KERNEL_WAIT).then_some(None)
}

/// Follows the kernel log at `path` (`/dev/kmsg`, or a file a test writes) from its end, on a
/// thread of its own, handing XID records to `inbox`. Fails when it cannot be opened.
pub fn follow_kernel_log(
    path: &Path,
    inbox: Inbox,
) -> Result<std::thread::JoinHandle<()>, FaultError> {
    let io = |source| FaultError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    // Only what comes from now on: older records were handled (or not watched) before.
    file.seek(SeekFrom::End(0)).map_err(io)?;
    let shown = path.display().to_string();
    Ok(std::thread::spawn(move || {
        let mut reader = BufReader::new(file);
        let mut line = String::new();
        loop {
            match reader.read_line(&mut line) {
                // The end of a plain file: more may be appended.
                Ok(0) => std::thread::sleep(Duration::from_millis(100)),
                Ok(_) if !line.ends_with('\n') => {}
                Ok(_) => {
                    if let Some(record) = parse_kernel_line(&line) {
                        inbox.kernel(record);
                    }
                    line.clear();
                }
                // /dev/kmsg: records were overwritten before we read them.
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::PIPE.raw_os_error()) => {
                    line.clear();
                }
                Err(e) => {
                    tracing::warn!("reading the kernel log {shown}: {e}");
                    line.clear();
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    }))
}

/// A slice or GPU taken out of service after an XID.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Quarantine {
    pub gpu: u32,
    /// The slice; `None`: the whole GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<String>,
    pub xid: u64,
    pub meaning: String,
    pub at: DateTime<Utc>,
    /// Who held the slice when it faulted (`pod claim ns/name`, `pid 123`); the quarantine
    /// ends when they no longer do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// The process the kernel named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl Quarantine {
    /// `XID 31 (GPU memory page fault)`.
    pub fn what(&self) -> String {
        format!("XID {} ({})", self.xid, self.meaning)
    }

    /// The device taint of what it covers.
    pub fn taint(&self) -> DeviceTaint {
        DeviceTaint {
            key: gpuslice_api::dra::XID_TAINT.to_string(),
            value: Some(self.xid.to_string()),
            effect: "NoSchedule".to_string(),
            time_added: None,
        }
    }

    /// What it is and how it ends, for the GpuNode's `Quarantined` condition.
    pub fn describe(&self, node: &str) -> String {
        let at = self.at.format("%Y-%m-%dT%H:%M:%SZ");
        match &self.slice {
            None => format!(
                "GPU {gpu} out of service after {what} at {at}: its workloads are drained; reset it (nvidia-smi -r -i {gpu}), then kubectl annotate gpunode {node} {key}={gpu}",
                gpu = self.gpu,
                what = self.what(),
                key = gpuslice_api::dra::GPU_RESET_ANNOTATION,
            ),
            Some(slice) => format!(
                "slice {slice} quarantined after {what}{by} at {at}: it takes no new work until {until}",
                what = self.what(),
                by = self
                    .pid
                    .map(|p| format!(" from pid {p}"))
                    .unwrap_or_default(),
                until = self.holder.as_deref().map_or_else(
                    || "nothing runs on it".to_string(),
                    |h| format!("{h} releases it")
                ),
            ),
        }
    }
}

/// The quarantines in force, as kept in the state directory.
pub struct Quarantines {
    path: PathBuf,
    pub list: Vec<Quarantine>,
}

impl Quarantines {
    pub fn load(state: &StateDir) -> Result<Quarantines, FaultError> {
        let path = state.quarantines();
        let list = match std::fs::read(&path) {
            Ok(text) => serde_json::from_slice(&text).map_err(|source| FaultError::Corrupt {
                path: path.display().to_string(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(FaultError::Io {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        Ok(Quarantines { path, list })
    }

    pub fn save(&self) -> Result<(), FaultError> {
        let io = |source| FaultError::Io {
            path: self.path.display().to_string(),
            source,
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io)?;
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
        serde_json::to_writer_pretty(&tmp, &self.list).map_err(|e| io(e.into()))?;
        tmp.persist(&self.path).map_err(|e| io(e.error))?;
        Ok(())
    }

    /// The taints of a slice: its GPU's quarantine, else its own.
    pub fn taints(&self, gpu: u32, slice: &str) -> Vec<DeviceTaint> {
        let gpu_wide = self.list.iter().find(|q| q.gpu == gpu && q.slice.is_none());
        let own = self.list.iter().find(|q| q.slice.as_deref() == Some(slice));
        gpu_wide
            .or(own)
            .map(Quarantine::taint)
            .into_iter()
            .collect()
    }

    /// GPUs out of service → what took them out, for their workloads' drain.
    pub fn gpus_out(&self) -> std::collections::BTreeMap<u32, String> {
        self.list
            .iter()
            .filter(|q| q.slice.is_none())
            .map(|q| (q.gpu, q.what()))
            .collect()
    }
}

/// A held slice, as fault isolation sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub slice: String,
    pub gpu: u32,
    /// `pod claim ns/name` or `pid 123`.
    pub holder: String,
    /// The `gpuslice run` process and its workload (none for a pod's claim).
    pub pids: Vec<u32>,
    /// The claim's pods: UIDs and `namespace/name`.
    pub pod_uids: Vec<String>,
    pub pods: Vec<String>,
}

/// What fault isolation did, for the loop to tell (Events, logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// A slice was quarantined; its pods are told.
    SliceQuarantined {
        quarantine: Quarantine,
        pods: Vec<String>,
        uids: Vec<String>,
    },
    /// A GPU was taken out of service.
    GpuOut(Quarantine),
    Lifted {
        quarantine: Quarantine,
        why: String,
    },
    /// An XID that should quarantine a slice, but no slice can be named.
    Unattributed {
        gpu: u32,
        what: String,
        why: String,
    },
    /// Counted only: the pool does not isolate faults, or the table says so.
    Counted {
        gpu: u32,
        what: String,
        why: String,
    },
    /// A reset annotation that names no GPUs: nothing was lifted.
    BadReset {
        value: String,
        why: String,
    },
}

/// The process `pid` or one of its ancestors is a holder's `gpuslice run` or workload, or it
/// runs in a holder's pod: that holder (index in `held`).
pub fn owner_of(pid: u32, held: &[Holding]) -> Option<usize> {
    let ancestry = crate::workloads::process::ancestry(pid);
    if let Some(i) = held
        .iter()
        .position(|h| h.pids.iter().any(|p| ancestry.contains(p)))
    {
        return Some(i);
    }
    let pod = crate::workloads::process::pod_of(pid)?;
    held.iter().position(|h| h.pod_uids.contains(&pod))
}

/// Acts on `events` (each with the pid the kernel named): per the XID table, for GPUs whose
/// pool isolates faults (`isolating`). `owner` finds the holder a pid belongs to.
pub fn handle(
    quarantines: &mut Vec<Quarantine>,
    events: &[(XidSeen, Option<u32>)],
    node: &NodeInventory,
    held: &[Holding],
    isolating: &dyn Fn(u32) -> bool,
    owner: &dyn Fn(u32, &[Holding]) -> Option<usize>,
    now: DateTime<Utc>,
) -> Vec<Notice> {
    let mut notices = Vec::new();
    for (seen, pid) in events {
        let rule = rule_for(seen.code);
        let what = format!("XID {} ({})", seen.code, rule.meaning);
        let gpu = seen.gpu;
        if !isolating(gpu) {
            notices.push(Notice::Counted {
                gpu,
                what,
                why: "its pool does not isolate faults (spec.faultIsolation)".into(),
            });
            continue;
        }
        let quarantine = |slice: Option<String>, holder: Option<String>| Quarantine {
            gpu,
            slice,
            xid: seen.code,
            meaning: rule.meaning.to_string(),
            at: now,
            holder,
            pid: *pid,
        };
        match rule.action {
            XidAction::Count => notices.push(Notice::Counted {
                gpu,
                what,
                why: "the XID table only counts it".into(),
            }),
            XidAction::DrainGpu => {
                if !quarantines
                    .iter()
                    .any(|q| q.gpu == gpu && q.slice.is_none())
                {
                    let q = quarantine(None, None);
                    quarantines.push(q.clone());
                    notices.push(Notice::GpuOut(q));
                }
            }
            XidAction::QuarantineSlice => {
                let on_gpu: Vec<&Holding> = held.iter().filter(|h| h.gpu == gpu).collect();
                // The MIG instance NVML named, else the holder of the process the kernel named,
                // else the one slice of the GPU that is held.
                let slice = match (seen.instance, pid) {
                    (Some(placement), _) => node
                        .gpus
                        .iter()
                        .find(|g| g.index == gpu)
                        .and_then(|g| g.mig.as_ref())
                        .and_then(|m| {
                            m.instances
                                .iter()
                                .find(|i| i.placement.start == placement.start)
                        })
                        .map(|i| mig_slice_id(gpu, i.placement.start, &i.profile))
                        .ok_or_else(|| {
                            format!(
                                "GPU {gpu} has no MIG instance at memory slice {}",
                                placement.start
                            )
                        }),
                    (None, Some(pid)) => owner(*pid, held)
                        .map(|i| held[i].slice.clone())
                        .filter(|s| on_gpu.iter().any(|h| h.slice == *s))
                        .ok_or_else(|| format!("pid {pid} holds no slice of GPU {gpu}")),
                    (None, None) => match on_gpu.as_slice() {
                        [one] => Ok(one.slice.clone()),
                        [] => Err(format!("no slice of GPU {gpu} is held")),
                        _ => Err(format!(
                            "{} slices of GPU {gpu} are held and the kernel log named no process",
                            on_gpu.len()
                        )),
                    },
                };
                let slice = match slice {
                    Ok(slice) => slice,
                    Err(why) => {
                        notices.push(Notice::Unattributed { gpu, what, why });
                        continue;
                    }
                };
                if quarantines
                    .iter()
                    .any(|q| q.slice.as_deref() == Some(slice.as_str()))
                {
                    continue;
                }
                let holding = on_gpu.iter().find(|h| h.slice == slice);
                let q = quarantine(Some(slice), holding.map(|h| h.holder.clone()));
                quarantines.push(q.clone());
                notices.push(Notice::SliceQuarantined {
                    quarantine: q,
                    pods: holding.map(|h| h.pods.clone()).unwrap_or_default(),
                    uids: holding.map(|h| h.pod_uids.clone()).unwrap_or_default(),
                });
            }
        }
    }
    notices
}

/// Lifts the quarantines of slices whose faulting workload released them (or, for one no
/// workload held, on which nothing runs any more: `busy` says whether a slice has processes).
pub fn lift_released(
    quarantines: &mut Vec<Quarantine>,
    held: &[Holding],
    busy: &dyn Fn(&str) -> bool,
) -> Vec<Notice> {
    let mut notices = Vec::new();
    quarantines.retain(|q| {
        let Some(slice) = &q.slice else {
            return true;
        };
        let still = match &q.holder {
            Some(holder) => held
                .iter()
                .any(|h| h.slice == *slice && h.holder == *holder),
            None => busy(slice) || held.iter().any(|h| h.slice == *slice),
        };
        if !still {
            notices.push(Notice::Lifted {
                quarantine: q.clone(),
                why: match &q.holder {
                    Some(holder) => format!("{holder} released it"),
                    None => "nothing runs on it any more".into(),
                },
            });
        }
        still
    });
    notices
}

/// The GPUs an annotation value names: `1`, `0,3`, `all` (every GPU of `node`).
pub fn parse_reset(value: &str, node: &NodeInventory) -> Result<Vec<u32>, String> {
    if value.trim() == "all" {
        return Ok(node.gpus.iter().map(|g| g.index).collect());
    }
    value
        .split(',')
        .map(|part| {
            let part = part.trim();
            part.parse::<u32>().map_err(|_| {
                format!("{part:?} is not a GPU index (write GPU indices such as 1 or 0,3, or all)")
            })
        })
        .collect()
}

/// Lifts every quarantine on `gpus` (they were reset).
pub fn reset(quarantines: &mut Vec<Quarantine>, gpus: &[u32]) -> Vec<Notice> {
    let mut notices = Vec::new();
    quarantines.retain(|q| {
        let lifted = gpus.contains(&q.gpu);
        if lifted {
            notices.push(Notice::Lifted {
                quarantine: q.clone(),
                why: format!("GPU {} was reset", q.gpu),
            });
        }
        !lifted
    });
    notices
}

/// One round of fault isolation: the XIDs ready (`events`) handled by the table, quarantines
/// whose faulting workload let go lifted, and the GPU resets said (the GpuNode annotation in a
/// cluster, root's `gpuslice gpu-reset` through the socket) applied.
pub fn isolate(
    quarantines: &mut Vec<Quarantine>,
    events: &[(XidSeen, Option<u32>)],
    node: &NodeInventory,
    held: &[Holding],
    isolating: &dyn Fn(u32) -> bool,
    resets: &[String],
    now: DateTime<Utc>,
) -> Vec<Notice> {
    let mut notices = handle(quarantines, events, node, held, isolating, &owner_of, now);
    notices.extend(lift_released(quarantines, held, &|slice| {
        slice_busy(node, slice)
    }));
    for value in resets {
        match parse_reset(value, node) {
            Ok(gpus) => notices.extend(reset(quarantines, &gpus)),
            Err(why) => notices.push(Notice::BadReset {
                value: value.clone(),
                why,
            }),
        }
    }
    notices
}

/// Whether a process runs on a slice, as NVML and the claims show the node.
fn slice_busy(node: &NodeInventory, slice: &str) -> bool {
    node.gpus.iter().any(|g| {
        g.slices
            .iter()
            .any(|s| s.id == slice && !s.processes.is_empty())
            || g.mig.iter().flat_map(|m| &m.instances).any(|i| {
                gpuslice_contract::slice::mig_slice_id(g.index, i.placement.start, &i.profile)
                    == slice
                    && !i.processes.is_empty()
            })
    })
}

impl Notice {
    /// What the agent says of it (its log; the GpuNode's Event in a cluster), and whether it
    /// is a warning.
    pub fn text(&self, node: &str) -> (bool, String) {
        match self {
            Notice::SliceQuarantined { quarantine, .. } | Notice::GpuOut(quarantine) => {
                (true, quarantine.describe(node))
            }
            Notice::Lifted { quarantine, why } => {
                let what = match &quarantine.slice {
                    Some(slice) => format!("slice {slice}"),
                    None => format!("GPU {}", quarantine.gpu),
                };
                (
                    false,
                    format!("{what} back in service ({why}) after {}", quarantine.what()),
                )
            }
            Notice::Unattributed { gpu, what, why } => (
                true,
                format!("{what} on GPU {gpu}: no slice quarantined: {why}"),
            ),
            Notice::Counted { gpu, what, why } => {
                (false, format!("{what} on GPU {gpu} counted only: {why}"))
            }
            Notice::BadReset { value, why } => {
                (true, format!("GPU reset {value:?}: {why}; nothing lifted"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_lines_give_the_gpu_the_xid_and_the_process() {
        let kmsg = "4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 31, pid=2314, name=python3, Ch 00000008, intr 10000000. MMU Fault";
        assert_eq!(
            parse_kernel_line(kmsg),
            Some(KernelXid {
                bus: PciAddress::parse("00000000:3B:00.0").unwrap(),
                code: 31,
                pid: Some(2314),
            })
        );
        let no_pid = "[ 12.5] NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.";
        assert_eq!(
            parse_kernel_line(no_pid).map(|k| (k.code, k.pid)),
            Some((79, None))
        );
        let unknown = "NVRM: Xid (PCI:0000:01:00): 13, pid='<unknown>', name=<unknown>, Graphics";
        assert_eq!(parse_kernel_line(unknown).map(|k| k.pid), Some(None));
        assert_eq!(parse_kernel_line("usb 1-1: new device"), None);
        assert_ne!(
            PciAddress::parse("0000:3b:00"),
            PciAddress::parse("0000:3c:00")
        );
    }

    #[test]
    fn an_xid_waits_briefly_for_its_kernel_record() {
        let inbox = Inbox::default();
        let bus = PciAddress::parse("0000:3b:00");
        let seen = XidSeen {
            gpu: 0,
            code: 31,
            instance: None,
            bus,
        };
        inbox.xid(XidSeen {
            code: 79,
            ..seen.clone()
        });
        assert_eq!(
            inbox.take(Instant::now()).len(),
            1,
            "XID 79 names no process"
        );
        inbox.xid(seen.clone());
        let start = Instant::now();
        assert!(inbox.take(start).is_empty(), "waits for the kernel record");
        inbox.kernel(KernelXid {
            bus: bus.unwrap(),
            code: 31,
            pid: Some(7),
        });
        assert_eq!(inbox.take(Instant::now()), vec![(seen.clone(), Some(7))]);
        inbox.xid(seen.clone());
        assert_eq!(
            inbox.take(Instant::now() + KERNEL_WAIT),
            vec![(seen, None)],
            "handled without one in the end"
        );
    }

    fn node() -> NodeInventory {
        serde_yaml::from_str(
            r#"
name: n1
gpus:
- {index: 0, model: NVIDIA A100-SXM4-80GB}
- index: 1
  model: NVIDIA H200
  mig:
    enabled: true
    instances:
    - {profile: 1g.18gb, placement: {start: 0, size: 1}}
    - {profile: 3g.71gb, placement: {start: 4, size: 4}}
"#,
        )
        .unwrap()
    }

    fn run_holding(slice: &str, gpu: u32, pid: u32) -> Holding {
        Holding {
            slice: slice.into(),
            gpu,
            holder: format!("pid {pid}"),
            pids: vec![pid],
            pod_uids: Vec::new(),
            pods: Vec::new(),
        }
    }

    fn by_pid(pid: u32, held: &[Holding]) -> Option<usize> {
        held.iter().position(|h| h.pids.contains(&pid))
    }

    fn xid(gpu: u32, code: u64, instance: Option<u32>) -> XidSeen {
        XidSeen {
            gpu,
            code,
            instance: instance.map(|start| Placement { start, size: 1 }),
            bus: None,
        }
    }

    #[test]
    fn each_xid_does_what_the_table_says() {
        let node = node();
        let held = vec![
            run_holding("gpu0-s0", 0, 100),
            run_holding("gpu0-s1", 0, 200),
            run_holding("gpu1-mig4-3g.71gb", 1, 300),
        ];
        let now = "2026-12-04T20:00:00Z".parse().unwrap();
        // (XID, its instance, the pid the kernel named) → what is quarantined.
        type Case = (u32, u64, Option<u32>, Option<u32>, &'static str);
        let cases: &[Case] = &[
            (0, 31, None, Some(200), "slice gpu0-s1"),
            (0, 13, None, Some(100), "slice gpu0-s0"),
            (0, 43, None, None, "unattributed"),
            (0, 31, None, Some(999), "unattributed"),
            (1, 94, Some(4), None, "slice gpu1-mig4-3g.71gb"),
            (1, 13, Some(0), None, "slice gpu1-mig0-1g.18gb"),
            (1, 13, None, None, "slice gpu1-mig4-3g.71gb"),
            (0, 45, None, Some(100), "counted"),
            (0, 92, None, None, "counted"),
            (0, 4242, None, None, "counted"),
            (0, 79, None, None, "GPU 0"),
            (1, 95, Some(4), None, "GPU 1"),
            (1, 48, None, None, "GPU 1"),
        ];
        for &(gpu, code, instance, pid, want) in cases {
            let mut list = Vec::new();
            let notices = handle(
                &mut list,
                &[(xid(gpu, code, instance), pid)],
                &node,
                &held,
                &|_| true,
                &by_pid,
                now,
            );
            let got = match notices.as_slice() {
                [Notice::SliceQuarantined { quarantine, .. }] => {
                    format!("slice {}", quarantine.slice.clone().unwrap())
                }
                [Notice::GpuOut(q)] => format!("GPU {}", q.gpu),
                [Notice::Unattributed { .. }] => "unattributed".into(),
                [Notice::Counted { .. }] => "counted".into(),
                other => format!("{other:?}"),
            };
            assert_eq!(
                got, want,
                "XID {code} on GPU {gpu} ({instance:?}, pid {pid:?})"
            );
            assert_eq!(
                list.len(),
                usize::from(want.starts_with("slice") || want.starts_with("GPU"))
            );
        }
    }

    #[test]
    fn a_pool_without_fault_isolation_only_counts() {
        let mut list = Vec::new();
        let notices = handle(
            &mut list,
            &[(xid(0, 79, None), None)],
            &node(),
            &[],
            &|_| false,
            &by_pid,
            Utc::now(),
        );
        assert!(matches!(notices.as_slice(), [Notice::Counted { .. }]));
        assert!(list.is_empty());
    }

    #[test]
    fn a_slice_comes_back_when_its_workload_lets_go_and_a_gpu_when_it_was_reset() {
        let node = node();
        let held = vec![
            run_holding("gpu0-s0", 0, 100),
            run_holding("gpu0-s1", 0, 200),
        ];
        let mut list = Vec::new();
        let now = Utc::now();
        handle(
            &mut list,
            &[(xid(0, 31, None), Some(100)), (xid(1, 79, None), None)],
            &node,
            &held,
            &|_| true,
            &by_pid,
            now,
        );
        assert_eq!(list.len(), 2);
        let quarantines = Quarantines {
            path: PathBuf::new(),
            list: list.clone(),
        };
        assert_eq!(
            quarantines.taints(0, "gpu0-s0")[0].value.as_deref(),
            Some("31")
        );
        assert!(quarantines.taints(0, "gpu0-s1").is_empty(), "its neighbour");
        assert_eq!(
            quarantines.taints(1, "gpu1-mig0-1g.18gb")[0]
                .value
                .as_deref(),
            Some("79")
        );
        assert!(lift_released(&mut list, &held, &|_| false).is_empty());
        // The same slice held by another workload later is not the one that faulted.
        let next = vec![run_holding("gpu0-s0", 0, 101)];
        let lifted = lift_released(&mut list, &next, &|_| false);
        assert!(
            matches!(&lifted[..], [Notice::Lifted { why, .. }] if why == "pid 100 released it")
        );
        assert_eq!(list.len(), 1, "the GPU stays out until it is reset");
        assert_eq!(parse_reset("all", &node), Ok(vec![0, 1]));
        assert!(
            parse_reset("gpu1", &node)
                .unwrap_err()
                .contains("not a GPU index")
        );
        assert_eq!(reset(&mut list, &[1]).len(), 1);
        assert!(list.is_empty());
    }
}
