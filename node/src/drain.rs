//! Draining busy slices (both modes), as the CheckpointPolicy says: send its signal to the
//! processes on what a transition needs, wait for their checkpoint-done marker or the grace
//! period, then stop them; with `required: true` never stop them, only wait until they exit or
//! checkpoint. Without a policy nothing is signalled: the transition waits for them to exit.
//! The policy is the workload's (its GpuSlicePolicy's `checkpointPolicy`), else its pool's.
//!
//! What was signalled when is kept in `<state>/drains.json`, so a restarted agent neither
//! signals twice nor restarts the grace period.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use gpuslice_api::{CheckpointPolicySpec, Signal};
use gpuslice_contract::StateDir;
use serde::{Deserialize, Serialize};

use crate::converge::BlockingProcess;

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
}

impl DrainPolicy {
    pub fn new(name: &str, spec: &CheckpointPolicySpec) -> DrainPolicy {
        let grace: std::time::Duration = spec.grace_period.into();
        DrainPolicy {
            name: name.to_string(),
            signal: spec.signal,
            grace: chrono::TimeDelta::from_std(grace).unwrap_or(chrono::TimeDelta::MAX),
            required: spec.required,
        }
    }
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
}

/// Something to do to a process now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "action")]
pub enum Action {
    /// Warn it with the policy's signal.
    Signal { pid: u32, signal: Signal },
    /// Stop it (SIGKILL): it checkpointed, or its grace period ran out.
    Stop { pid: u32 },
}

/// A process the transition is waiting for, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Waiting {
    pub pid: u32,
    pub slice: String,
    pub reason: String,
    /// When the agent will act on it next (end of its grace period), if it will.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<DateTime<Utc>>,
}

/// Decides what to do to each blocking process. `policy_for` gives the policy of the pool the
/// process's GPU belongs to; `checkpointed` says whether a slice's checkpoint-done marker exists.
/// Records of processes no longer blocking are dropped.
pub fn decide(
    blocking: &[(BlockingProcess, Option<DrainPolicy>)],
    records: &mut BTreeMap<u32, Record>,
    now: DateTime<Utc>,
    checkpointed: impl Fn(&str) -> bool,
) -> (Vec<Action>, Vec<Waiting>) {
    records.retain(|pid, _| blocking.iter().any(|(b, _)| b.pid == *pid));
    let mut actions = Vec::new();
    let mut waiting = Vec::new();
    for (process, policy) in blocking {
        let wait = |reason: String, until: Option<DateTime<Utc>>| Waiting {
            pid: process.pid,
            slice: process.slice.clone(),
            reason,
            until,
        };
        // A pod's prepared ResourceClaim, not a process: it ends when the kubelet unprepares it.
        if process.pid == 0 {
            waiting.push(wait(
                "held by a pod's ResourceClaim: waiting for the pod to end".into(),
                None,
            ));
            continue;
        }
        let Some(policy) = policy else {
            waiting.push(wait(
                "no checkpoint policy: waiting for it to exit".into(),
                None,
            ));
            continue;
        };
        let Some(record) = records.get_mut(&process.pid) else {
            actions.push(Action::Signal {
                pid: process.pid,
                signal: policy.signal,
            });
            records.insert(
                process.pid,
                Record {
                    slice: process.slice.clone(),
                    policy: policy.name.clone(),
                    signaled_at: now,
                    stopped_at: None,
                },
            );
            let until = now + policy.grace;
            waiting.push(wait(
                format!(
                    "sent {} ({}): waiting for its checkpoint",
                    signal_name(policy.signal),
                    policy.name
                ),
                Some(until),
            ));
            continue;
        };
        if record.stopped_at.is_some() {
            waiting.push(wait("stopped: waiting for it to exit".into(), None));
            continue;
        }
        let deadline = record.signaled_at + policy.grace;
        let done = checkpointed(&process.slice);
        if done || (now >= deadline && !policy.required) {
            actions.push(Action::Stop { pid: process.pid });
            record.stopped_at = Some(now);
            let why = if done {
                "checkpointed"
            } else {
                "grace period over"
            };
            waiting.push(wait(
                format!("{why}: stopped, waiting for it to exit"),
                None,
            ));
        } else if now >= deadline {
            waiting.push(wait(
                format!(
                    "{} requires a checkpoint: waiting for it to exit or checkpoint",
                    policy.name
                ),
                None,
            ));
        } else {
            waiting.push(wait(
                format!(
                    "sent {} ({}): waiting for its checkpoint",
                    signal_name(policy.signal),
                    policy.name
                ),
                Some(deadline),
            ));
        }
    }
    (actions, waiting)
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
    pub records: BTreeMap<u32, Record>,
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

/// Carries out an action. A marker left from an earlier checkpoint is removed before the
/// signal, so only a checkpoint made after it counts. Returns what went wrong, for the report.
pub fn execute(
    state: &StateDir,
    action: Action,
    slice_of: impl Fn(u32) -> String,
) -> Option<String> {
    use rustix::process::{Pid, Signal as Sig, kill_process};
    let (pid, signal) = match action {
        Action::Signal { pid, signal } => {
            let _ = std::fs::remove_file(state.checkpoint_done(&slice_of(pid)));
            let sig = match signal {
                Signal::Usr1 => Sig::USR1,
                Signal::Usr2 => Sig::USR2,
                Signal::Term => Sig::TERM,
                Signal::Int => Sig::INT,
                Signal::Hup => Sig::HUP,
            };
            (pid, sig)
        }
        Action::Stop { pid } => (pid, Sig::KILL),
    };
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
        })
    }

    fn busy(pid: u32, policy: Option<DrainPolicy>) -> Vec<(BlockingProcess, Option<DrainPolicy>)> {
        vec![(
            BlockingProcess {
                pid,
                slice: "gpu0-mig0-3g.71gb".into(),
            },
            policy,
        )]
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
        assert!(w[0].reason.contains("grace period over"));
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
        assert!(records.contains_key(&8));
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
