//! Draining busy slices (both modes), as the CheckpointPolicy says: send its signal to the
//! processes on what a transition needs, wait for their checkpoint-done marker or the grace
//! period, then stop them; with `required: true` never stop them, only wait until they exit or
//! checkpoint. Without a policy nothing is signalled: the transition waits for them to exit.
//! The policy is the workload's (its GpuSlicePolicy's `checkpointPolicy`), else its pool's.
//!
//! A pod's slice (a prepared ResourceClaim) drains the same way, except that the signal goes to
//! every process of the claim's pods (found by the pod UID in their cgroup) and, where a process
//! would be stopped, the pods are evicted through the Eviction API: the kubelet then stops them
//! with their own termination grace, their controllers make new ones, and the slice is free once
//! the kubelet unprepares the claim. A pod's slice without a checkpoint policy is evicted at once:
//! a window declared in Git is due, and a pod is a thing Kubernetes may reschedule.
//!
//! What was signalled when is kept in `<state>/drains.json`, so a restarted agent neither
//! signals twice nor restarts the grace period.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use gpuslice_api::{CheckpointPolicySpec, Signal};
use gpuslice_contract::StateDir;
use serde::{Deserialize, Serialize};

/// Why drain records cannot be kept.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a drain record file: {source}")]
    Corrupt {
        path: String,
        source: serde_json::Error,
    },
}

/// The checkpoint policy a drain follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainPolicy {
    pub name: String,
    pub signal: Signal,
    pub grace: chrono::TimeDelta,
    pub required: bool,
    /// How often the workload should checkpoint by itself.
    pub interval: Option<std::time::Duration>,
}

impl DrainPolicy {
    pub fn new(name: &str, spec: &CheckpointPolicySpec) -> DrainPolicy {
        let grace: std::time::Duration = spec.grace_period.into();
        DrainPolicy {
            name: name.to_string(),
            signal: spec.signal,
            grace: chrono::TimeDelta::from_std(grace).unwrap_or(chrono::TimeDelta::MAX),
            required: spec.required,
            interval: spec.interval.map(std::time::Duration::from),
        }
    }
}

/// The key of a process's record in `drains.json`.
fn process_key(pid: u32) -> String {
    pid.to_string()
}

/// The key of a pod claim's record (never a number, so never a process's key).
fn claim_key(claim: &str) -> String {
    format!("claim:{claim}")
}

/// What holds a busy slice a transition needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    Process(u32),
    /// A ResourceClaim the kubelet prepared: `namespace/name`, its pods (`namespace/name`) and
    /// their UIDs.
    Pod {
        claim: String,
        pods: Vec<String>,
        uids: Vec<String>,
    },
}

/// A busy slice in the way, what holds it, and the policy that drains it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    pub holder: Holder,
    pub slice: String,
    pub policy: Option<DrainPolicy>,
    /// Why the slice is taken.
    pub cause: Cause,
}

/// Why a slice is taken from its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    /// A window change re-cuts it.
    Recut,
    /// The operator's queue takes it for a waiting pod.
    Preempted(Taken),
    /// Compaction moves its workload to free its GPU (`reason`: which GPU, of which pool).
    Compaction { reason: String },
    /// Its GPU reported an error that takes the whole GPU out of service (`what`: the XID and
    /// its meaning).
    Fault { gpu: u32, what: String },
}

impl Cause {
    /// As the evictions metric labels it.
    pub fn label(&self) -> &'static str {
        match self {
            Cause::Recut => "window",
            Cause::Preempted(_) => "preemption",
            Cause::Compaction { .. } => "compaction",
            Cause::Fault { .. } => "fault",
        }
    }
}

/// A slice the operator's queue takes back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taken {
    /// The waiting pod it is for (`namespace/name`).
    pub for_pod: String,
    /// Why, in words.
    pub reason: String,
}

/// A process the agent has warned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub slice: String,
    pub policy: String,
    pub signaled_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<DateTime<Utc>>,
    /// Why it was stopped (`checkpoint taken`, `no checkpoint: …`), once it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
}

/// Something to do now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "action")]
pub enum Action {
    /// Warn it with the policy's signal.
    Signal { pid: u32, signal: Signal },
    /// Stop it (SIGKILL): it checkpointed, or its grace period ran out.
    Stop { pid: u32 },
    /// Warn every process of these pods (by UID) on `slice`.
    SignalPods {
        uids: Vec<String>,
        slice: String,
        signal: Signal,
    },
    /// Evict these pods (`namespace/name`); asked again each pass until they are gone, as a
    /// disruption budget may refuse it for a while. `note` says why and whether the workload
    /// checkpointed (the Event on each pod); `cause` is [`Cause::label`].
    Evict {
        pods: Vec<String>,
        note: String,
        cause: &'static str,
        checkpoint: &'static str,
    },
}

/// A process or pod claim the transition is waiting for, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Waiting {
    /// 0 for a pod's claim.
    pub pid: u32,
    pub slice: String,
    pub reason: String,
    /// When the agent will act on it next (end of its grace period), if it will.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<DateTime<Utc>>,
}

/// The outcome of a drain whose workload checkpointed.
const CHECKPOINT_TAKEN: &str = "checkpoint taken";
/// The outcome of a pod drained without a CheckpointPolicy.
const NO_POLICY: &str = "no checkpoint policy, no checkpoint taken";

/// Decides what to do to each holder of a blocking slice. `checkpointed` says whether a
/// slice's checkpoint-done marker exists. Records of holders no longer blocking are dropped.
pub fn decide(
    blocking: &[Blocked],
    records: &mut BTreeMap<String, Record>,
    now: DateTime<Utc>,
    checkpointed: impl Fn(&str) -> bool,
) -> (Vec<Action>, Vec<Waiting>) {
    let key = |b: &Blocked| match &b.holder {
        Holder::Process(pid) => process_key(*pid),
        Holder::Pod { claim, .. } => claim_key(claim),
    };
    records.retain(|k, _| blocking.iter().any(|b| key(b) == *k));
    let mut actions = Vec::new();
    let mut waiting = Vec::new();
    for blocked in blocking {
        let (pid, whom) = match &blocked.holder {
            Holder::Process(pid) => (*pid, String::new()),
            Holder::Pod { pods, .. } => (0, format!(" to pod {}", pods.join(", "))),
        };
        let mut wait = |reason: String, until: Option<DateTime<Utc>>| {
            waiting.push(Waiting {
                pid,
                slice: blocked.slice.clone(),
                reason,
                until,
            })
        };
        let stop = |outcome: &str| stop_action(blocked, outcome);
        let is_pod = pid == 0;
        let stopped = if is_pod { "evicted" } else { "stopped" };
        let Some(policy) = &blocked.policy else {
            if is_pod {
                let outcome = NO_POLICY;
                records.entry(key(blocked)).or_insert(Record {
                    slice: blocked.slice.clone(),
                    policy: String::new(),
                    signaled_at: now,
                    stopped_at: Some(now),
                    outcome: Some(outcome.into()),
                });
                actions.push(stop(outcome));
                wait(
                    "no checkpoint policy: evicted, waiting for the pod to end".into(),
                    None,
                );
            } else {
                wait("no checkpoint policy: waiting for it to exit".into(), None);
            }
            continue;
        };
        let sent = |record_policy: &str| {
            format!(
                "sent {}{whom} ({record_policy}): waiting for its checkpoint",
                signal_name(policy.signal)
            )
        };
        let Some(record) = records.get_mut(&key(blocked)) else {
            actions.push(match &blocked.holder {
                Holder::Process(pid) => Action::Signal {
                    pid: *pid,
                    signal: policy.signal,
                },
                Holder::Pod { uids, .. } => Action::SignalPods {
                    uids: uids.clone(),
                    slice: blocked.slice.clone(),
                    signal: policy.signal,
                },
            });
            records.insert(
                key(blocked),
                Record {
                    slice: blocked.slice.clone(),
                    policy: policy.name.clone(),
                    signaled_at: now,
                    stopped_at: None,
                    outcome: None,
                },
            );
            wait(sent(&policy.name), Some(now + policy.grace));
            continue;
        };
        if record.stopped_at.is_some() {
            if is_pod {
                actions.push(stop(record.outcome.as_deref().unwrap_or("stopped")));
            }
            wait(format!("{stopped}: waiting for it to end"), None);
            continue;
        }
        let deadline = record.signaled_at + policy.grace;
        let done = checkpointed(&blocked.slice);
        if done || (now >= deadline && !policy.required) {
            let outcome = if done {
                CHECKPOINT_TAKEN.to_string()
            } else {
                format!(
                    "no checkpoint within the grace period of {}",
                    humantime_secs(policy.grace)
                )
            };
            actions.push(stop(&outcome));
            record.stopped_at = Some(now);
            record.outcome = Some(outcome);
            let why = if done {
                "checkpointed"
            } else {
                "grace period over"
            };
            wait(format!("{why}: {stopped}, waiting for it to end"), None);
        } else if now >= deadline {
            wait(
                format!(
                    "{} requires a checkpoint: waiting for it to end or checkpoint",
                    policy.name
                ),
                None,
            );
        } else {
            wait(sent(&policy.name), Some(deadline));
        }
    }
    (actions, waiting)
}

/// What ends the holder's use of the slice: SIGKILL for a process, eviction for pods (with a
/// note that says why, and whether the checkpoint was taken).
fn stop_action(blocked: &Blocked, outcome: &str) -> Action {
    match &blocked.holder {
        Holder::Process(pid) => Action::Stop { pid: *pid },
        Holder::Pod { pods, .. } => Action::Evict {
            pods: pods.clone(),
            note: match &blocked.cause {
                Cause::Preempted(taken) => format!(
                    "preempted for pod {} ({}): {outcome}",
                    taken.for_pod, taken.reason
                ),
                Cause::Compaction { reason } => {
                    format!("moved by {reason}, to run on another GPU: {outcome}")
                }
                Cause::Recut => format!(
                    "its slice {} is re-cut for a window change: {outcome}",
                    blocked.slice
                ),
                Cause::Fault { gpu, what } => {
                    format!("its GPU {gpu} reported {what}: {outcome}")
                }
            },
            cause: blocked.cause.label(),
            checkpoint: if outcome == CHECKPOINT_TAKEN {
                "taken"
            } else if outcome == NO_POLICY {
                "none"
            } else {
                "grace_over"
            },
        },
    }
}

/// A grace period as people write it (`90s`, `5m`).
fn humantime_secs(d: chrono::TimeDelta) -> String {
    let s = d.num_seconds();
    if s % 3600 == 0 && s > 0 {
        format!("{}h", s / 3600)
    } else if s % 60 == 0 && s > 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

pub fn signal_name(signal: Signal) -> &'static str {
    match signal {
        Signal::Usr1 => "SIGUSR1",
        Signal::Usr2 => "SIGUSR2",
        Signal::Term => "SIGTERM",
        Signal::Int => "SIGINT",
        Signal::Hup => "SIGHUP",
    }
}

/// The drain records of a state directory.
pub struct Drains {
    path: PathBuf,
    /// By process id, or `claim:<namespace>/<name>` for a pod's claim.
    pub records: BTreeMap<String, Record>,
}

impl Drains {
    pub fn load(state: &StateDir) -> Result<Drains, DrainError> {
        let path = state.drains();
        let records = match std::fs::read(&path) {
            Ok(text) => serde_json::from_slice(&text).map_err(|source| DrainError::Corrupt {
                path: path.display().to_string(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(source) => {
                return Err(DrainError::Io {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        Ok(Drains { path, records })
    }

    pub fn save(&self) -> Result<(), DrainError> {
        let io = |source| DrainError::Io {
            path: self.path.display().to_string(),
            source,
        };
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
        serde_json::to_writer_pretty(&tmp, &self.records).map_err(|e| io(e.into()))?;
        tmp.persist(&self.path).map_err(|e| io(e.error))?;
        Ok(())
    }
}

/// Whether a slice's workload has written its checkpoint-done marker.
pub fn checkpoint_done(state: &StateDir, slice: &str) -> bool {
    state.checkpoint_done(slice).exists()
}

/// Which CheckpointPolicy drains a process: its workload's policy's, else its pool's. `None`
/// when neither names one (or the one named does not exist: validate and the operator report it).
pub fn policy_for(
    workload_policy: Option<&str>,
    pool_policy: Option<&str>,
    checkpoints: &BTreeMap<String, CheckpointPolicySpec>,
) -> Option<DrainPolicy> {
    let name = workload_policy.or(pool_policy)?;
    Some(DrainPolicy::new(name, checkpoints.get(name)?))
}

/// Carries out an action on processes (an eviction is the cluster loop's to do). A marker left
/// from an earlier checkpoint is removed before the signal, so only a checkpoint made after it
/// counts. Returns what went wrong, for the report.
pub fn execute(state: &StateDir, action: &Action, slice_of: impl Fn(u32) -> String) -> Vec<String> {
    use rustix::process::Signal as Sig;
    let sig = |signal: Signal| match signal {
        Signal::Usr1 => Sig::USR1,
        Signal::Usr2 => Sig::USR2,
        Signal::Term => Sig::TERM,
        Signal::Int => Sig::INT,
        Signal::Hup => Sig::HUP,
    };
    match action {
        Action::Signal { pid, signal } => {
            let _ = std::fs::remove_file(state.checkpoint_done(&slice_of(*pid)));
            kill(*pid, sig(*signal)).into_iter().collect()
        }
        Action::Stop { pid } => kill(*pid, Sig::KILL).into_iter().collect(),
        Action::SignalPods {
            uids,
            slice,
            signal,
        } => {
            let _ = std::fs::remove_file(state.checkpoint_done(slice));
            let pids = crate::workloads::process::of_pods(uids);
            if pids.is_empty() {
                return vec![format!(
                    "no process of pod {} is visible to the agent (does it run with hostPID?)",
                    uids.join(", ")
                )];
            }
            pids.into_iter()
                .filter_map(|pid| kill(pid, sig(*signal)))
                .collect()
        }
        Action::Evict { .. } => Vec::new(),
    }
}

fn kill(pid: u32, signal: rustix::process::Signal) -> Option<String> {
    use rustix::process::{Pid, kill_process};
    // Never signal ourselves, init, or (through 0 or a negative number) a process group.
    if pid <= 1 || pid == std::process::id() {
        return Some(format!("refused to signal pid {pid}"));
    }
    let target = i32::try_from(pid).ok().and_then(Pid::from_raw)?;
    kill_process(target, signal)
        .err()
        .map(|e| format!("signalling pid {pid}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(required: bool) -> Option<DrainPolicy> {
        Some(DrainPolicy {
            name: "nightly".into(),
            signal: Signal::Usr1,
            grace: chrono::TimeDelta::seconds(60),
            required,
            interval: None,
        })
    }

    fn busy(pid: u32, policy: Option<DrainPolicy>) -> Vec<Blocked> {
        vec![Blocked {
            holder: Holder::Process(pid),
            slice: "gpu0-mig0-3g.71gb".into(),
            policy,
            cause: Cause::Recut,
        }]
    }

    fn pod(policy: Option<DrainPolicy>) -> Vec<Blocked> {
        vec![Blocked {
            holder: Holder::Pod {
                claim: "ml/train-0-gpu-x7k2p".into(),
                pods: vec!["ml/train-0".into()],
                uids: vec!["1b4c7f9e-3d2a-4e8b-9c1d-5f6a7b8c9d0e".into()],
            },
            slice: "gpu0-s1".into(),
            policy,
            cause: Cause::Recut,
        }]
    }

    #[test]
    fn a_pods_slice_is_signalled_then_evicted_until_the_pod_is_gone() {
        let mut records = BTreeMap::new();
        let (a, w) = decide(&pod(policy(false)), &mut records, at(0), |_| false);
        assert_eq!(
            a,
            vec![Action::SignalPods {
                uids: vec!["1b4c7f9e-3d2a-4e8b-9c1d-5f6a7b8c9d0e".into()],
                slice: "gpu0-s1".into(),
                signal: Signal::Usr1
            }]
        );
        assert_eq!((w[0].pid, w[0].until), (0, Some(at(60))));
        assert!(w[0].reason.contains("to pod ml/train-0"), "{}", w[0].reason);
        let (a, _) = decide(&pod(policy(false)), &mut records, at(10), |_| false);
        assert!(a.is_empty(), "signalled once: {a:?}");
        // The pod wrote its marker: evicted now, and again each pass until it is gone (a
        // disruption budget may refuse the first ones).
        let evict = Action::Evict {
            pods: vec!["ml/train-0".into()],
            note: "its slice gpu0-s1 is re-cut for a window change: checkpoint taken".into(),
            cause: "window",
            checkpoint: "taken",
        };
        let (a, w) = decide(&pod(policy(false)), &mut records, at(20), |_| true);
        assert_eq!(a, vec![evict.clone()]);
        assert!(
            w[0].reason.starts_with("checkpointed: evicted"),
            "{}",
            w[0].reason
        );
        let (a, _) = decide(&pod(policy(false)), &mut records, at(22), |_| true);
        assert_eq!(a, vec![evict]);
        decide(&[], &mut records, at(30), |_| false);
        assert!(records.is_empty(), "the pod is gone, so is its record");
    }

    #[test]
    fn a_pods_slice_without_a_policy_is_evicted_and_a_required_checkpoint_holds_it() {
        let mut records = BTreeMap::new();
        let (a, _) = decide(&pod(None), &mut records, at(0), |_| false);
        assert_eq!(
            a,
            vec![Action::Evict {
                pods: vec!["ml/train-0".into()],
                note: "its slice gpu0-s1 is re-cut for a window change: no checkpoint policy, no checkpoint taken".into(),
                cause: "window",
                checkpoint: "none",
            }]
        );
        let mut records = BTreeMap::new();
        decide(&pod(policy(true)), &mut records, at(0), |_| false);
        let (a, w) = decide(&pod(policy(true)), &mut records, at(3600), |_| false);
        assert!(a.is_empty(), "{a:?}");
        assert!(w[0].reason.contains("requires a checkpoint"));
    }

    #[test]
    fn a_preempted_pod_is_told_for_whom_and_whether_it_checkpointed() {
        let mut preempted = pod(policy(false));
        preempted[0].cause = Cause::Preempted(Taken {
            for_pod: "ml/urgent-0".into(),
            reason: "priority high over low".into(),
        });
        let mut records = BTreeMap::new();
        decide(&preempted, &mut records, at(0), |_| false);
        let (a, _) = decide(&preempted, &mut records, at(61), |_| false);
        let note = "preempted for pod ml/urgent-0 (priority high over low): no checkpoint within the grace period of 1m";
        assert_eq!(
            a,
            vec![Action::Evict {
                pods: vec!["ml/train-0".into()],
                note: note.into(),
                cause: "preemption",
                checkpoint: "grace_over",
            }]
        );
        // Asked again (a budget refused it): the same words, though the marker came since.
        let (a, _) = decide(&preempted, &mut records, at(70), |_| true);
        assert!(
            matches!(&a[0], Action::Evict { note: n, .. } if n == note),
            "{a:?}"
        );
    }

    #[test]
    fn a_pod_on_a_faulted_gpu_is_told_which_error_took_it() {
        let mut faulted = pod(policy(false));
        faulted[0].cause = Cause::Fault {
            gpu: 0,
            what: "XID 79 (GPU has fallen off the bus)".into(),
        };
        let mut records = BTreeMap::new();
        decide(&faulted, &mut records, at(0), |_| false);
        let (a, _) = decide(&faulted, &mut records, at(5), |_| true);
        assert_eq!(
            a,
            vec![Action::Evict {
                pods: vec!["ml/train-0".into()],
                note: "its GPU 0 reported XID 79 (GPU has fallen off the bus): checkpoint taken"
                    .into(),
                cause: "fault",
                checkpoint: "taken",
            }]
        );
    }

    #[test]
    fn records_of_processes_and_pod_claims_never_collide() {
        let mut records = BTreeMap::new();
        let both: Vec<Blocked> = busy(7, policy(false))
            .into_iter()
            .chain(pod(policy(false)))
            .collect();
        decide(&both, &mut records, at(0), |_| false);
        assert_eq!(
            records.keys().cloned().collect::<Vec<_>>(),
            ["7", "claim:ml/train-0-gpu-x7k2p"]
        );
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        "2026-12-02T22:00:00Z".parse::<DateTime<Utc>>().unwrap()
            + chrono::TimeDelta::seconds(seconds)
    }

    #[test]
    fn signal_once_then_stop_after_the_grace_period() {
        let mut records = BTreeMap::new();
        let (a, w) = decide(&busy(7, policy(false)), &mut records, at(0), |_| false);
        assert_eq!(
            a,
            vec![Action::Signal {
                pid: 7,
                signal: Signal::Usr1
            }]
        );
        assert_eq!(w[0].until, Some(at(60)));
        let (a, _) = decide(&busy(7, policy(false)), &mut records, at(30), |_| false);
        assert!(a.is_empty(), "signalled once, grace not over: {a:?}");
        let (a, w) = decide(&busy(7, policy(false)), &mut records, at(60), |_| false);
        assert_eq!(a, vec![Action::Stop { pid: 7 }]);
        assert!(w[0].reason.contains("grace period over: stopped"));
        let (a, _) = decide(&busy(7, policy(false)), &mut records, at(90), |_| false);
        assert!(a.is_empty(), "stopped once");
    }

    #[test]
    fn a_checkpoint_ends_the_wait_early() {
        let mut records = BTreeMap::new();
        decide(&busy(7, policy(true)), &mut records, at(0), |_| false);
        let (a, w) = decide(&busy(7, policy(true)), &mut records, at(5), |_| true);
        assert_eq!(a, vec![Action::Stop { pid: 7 }]);
        assert!(w[0].reason.starts_with("checkpointed"));
    }

    #[test]
    fn required_checkpoints_never_stop_a_workload() {
        let mut records = BTreeMap::new();
        decide(&busy(7, policy(true)), &mut records, at(0), |_| false);
        let (a, w) = decide(&busy(7, policy(true)), &mut records, at(3600), |_| false);
        assert!(a.is_empty());
        assert!(
            w[0].reason.contains("requires a checkpoint"),
            "{}",
            w[0].reason
        );
    }

    #[test]
    fn without_a_policy_nothing_is_signalled_and_gone_processes_are_forgotten() {
        let mut records = BTreeMap::new();
        let (a, w) = decide(&busy(7, None), &mut records, at(0), |_| false);
        assert!(a.is_empty());
        assert!(w[0].reason.contains("no checkpoint policy"));
        decide(&busy(8, policy(false)), &mut records, at(0), |_| false);
        assert!(records.contains_key("8"));
        decide(&[], &mut records, at(1), |_| false);
        assert!(records.is_empty());
    }

    #[test]
    fn the_workloads_checkpoint_policy_wins_over_the_pools() {
        let spec = |signal| CheckpointPolicySpec {
            signal,
            ..serde_json::from_value(serde_json::json!({"gracePeriod": "30s"})).unwrap()
        };
        let checkpoints = BTreeMap::from([
            ("pool-wide".to_string(), spec(Signal::Term)),
            ("careful".to_string(), spec(Signal::Usr1)),
        ]);
        let mine = policy_for(Some("careful"), Some("pool-wide"), &checkpoints).unwrap();
        assert_eq!((mine.name.as_str(), mine.signal), ("careful", Signal::Usr1));
        let pools = policy_for(None, Some("pool-wide"), &checkpoints).unwrap();
        assert_eq!(
            (pools.name.as_str(), pools.signal),
            ("pool-wide", Signal::Term)
        );
        assert_eq!(policy_for(None, None, &checkpoints), None);
        assert_eq!(
            policy_for(Some("missing"), Some("pool-wide"), &checkpoints),
            None
        );
    }
}
