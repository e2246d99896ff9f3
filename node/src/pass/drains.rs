//! What blocks a pass's transitions, and the drains that take it back as each workload's
//! CheckpointPolicy says.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_source::last_good::Config;

use super::{Agent, Eviction, Pass, PassError};
use crate::workloads::claims::Claim;
use crate::workloads::drain::{self, Action, Blocked, Drains, Holder};

impl Agent {
    /// Warns or stops what blocks this pass's transitions — processes, and pods through their
    /// prepared claims — each as its CheckpointPolicy says: its workload's policy's, else its
    /// GPU's pool's. Preempted pods' slices drain the same way. Evictions are left in the pass
    /// for the cluster loop.
    pub(super) fn drain(
        &self,
        pass: &mut Pass,
        config: &Config,
        intent: &Taking<'_>,
        now: DateTime<Utc>,
    ) -> Result<(), PassError> {
        let blocking = self.blocking(pass, config, intent);
        let mut drains = Drains::load(&self.state)?;
        if blocking.is_empty() && drains.records.is_empty() {
            return Ok(());
        }
        let (actions, waiting) = drain::decide(&blocking, &mut drains.records, now, |slice| {
            drain::checkpoint_done(&self.state, slice)
        });
        // Record before acting: a crash after a signal must not signal again or restart the grace.
        drains.save()?;
        self.carry_out(pass, &actions, &blocking);
        pass.draining = waiting;
        Ok(())
    }

    /// What must be drained, and why: busy slices a re-cut needs, every workload on a GPU out
    /// of service, and preempted pods' slices; each with its CheckpointPolicy.
    fn blocking(&self, pass: &Pass, config: &Config, intent: &Taking<'_>) -> Vec<Blocked> {
        let claims = self.socket.claims.held();
        let slice_gpus = crate::gpu::slices::configs(&pass.inventory);
        let policy_of =
            |claim: Option<&Claim>, slice: &str| checkpoint_policy(pass, config, claim, slice);
        let pod_holder = |c: &Claim| Holder::Pod {
            claim: c.resource_claim.clone().unwrap_or_default(),
            pods: c.pod_names.clone(),
            uids: c.pods.clone(),
        };
        let mut blocking: Vec<Blocked> = pass
            .outcomes
            .iter()
            .flat_map(|o| &o.blocking)
            .filter_map(|b| {
                let claim = claims.iter().find(|c| c.slice == b.slice);
                let holder = if b.pid == 0 {
                    // A pod's prepared claim; gone from the board means just unprepared.
                    pod_holder(claim.filter(|c| c.resource_claim.is_some())?)
                } else {
                    Holder::Process(b.pid)
                };
                Some(Blocked {
                    holder,
                    slice: b.slice.clone(),
                    policy: policy_of(claim, &b.slice),
                    cause: drain::Cause::Recut,
                })
            })
            .collect();
        // Every workload on a GPU out of service (whatever else wanted its slice).
        for claim in &claims {
            let gpu = slice_gpus
                .iter()
                .find(|c| c.id == claim.slice)
                .map(|c| c.gpu);
            let Some((&gpu, what)) = gpu.and_then(|g| intent.gpus_out.get_key_value(&g)) else {
                continue;
            };
            blocking.retain(|b| b.slice != claim.slice);
            blocking.push(Blocked {
                holder: if claim.resource_claim.is_some() {
                    pod_holder(claim)
                } else {
                    Holder::Process(claim.workload.unwrap_or(claim.client))
                },
                slice: claim.slice.clone(),
                policy: policy_of(Some(claim), &claim.slice),
                cause: drain::Cause::Fault {
                    gpu,
                    what: what.clone(),
                },
            });
        }
        // Preempted pods' slices (a slice a window change also needs drains once, as preempted).
        for taken in intent.preemptions {
            let Some(claim) = claims
                .iter()
                .find(|c| c.resource_claim.as_deref() == Some(taken.resource_claim.as_str()))
            else {
                continue;
            };
            if blocking
                .iter()
                .any(|b| b.slice == claim.slice && matches!(b.cause, drain::Cause::Fault { .. }))
            {
                continue;
            }
            blocking.retain(|b| b.slice != claim.slice);
            blocking.push(Blocked {
                holder: pod_holder(claim),
                slice: claim.slice.clone(),
                policy: policy_of(Some(claim), &claim.slice),
                // A preemption for no pod is compaction's move.
                cause: if taken.for_pod.is_empty() {
                    drain::Cause::Compaction {
                        reason: taken.reason.clone(),
                    }
                } else {
                    drain::Cause::Preempted(drain::Taken {
                        for_pod: taken.for_pod.clone(),
                        reason: taken.reason.clone(),
                    })
                },
            });
        }
        blocking
    }

    /// Carries out the drain's decisions: evictions go to the pass (the cluster asks for them),
    /// signals and kills are sent here.
    fn carry_out(&self, pass: &mut Pass, actions: &[Action], blocking: &[Blocked]) {
        pass.drain_errors.clear();
        let slice_of = |pid: u32| {
            blocking
                .iter()
                .find(|b| b.holder == Holder::Process(pid))
                .map(|b| b.slice.clone())
                .unwrap_or_default()
        };
        for action in actions {
            match action {
                Action::Evict {
                    pods,
                    note,
                    cause,
                    checkpoint,
                } => {
                    for pod in pods {
                        let uid = blocking
                            .iter()
                            .find_map(|b| match &b.holder {
                                Holder::Pod { pods, uids, .. } => pods
                                    .iter()
                                    .position(|p| p == pod)
                                    .and_then(|i| uids.get(i).cloned()),
                                Holder::Process(_) => None,
                            })
                            .unwrap_or_default();
                        pass.evictions.push(Eviction {
                            pod: pod.clone(),
                            uid,
                            note: note.clone(),
                            cause,
                            checkpoint,
                        });
                    }
                }
                _ => {
                    tracing::info!(?action, "drain");
                    pass.drain_errors
                        .extend(drain::execute(&self.state, action, slice_of));
                }
            }
        }
    }
}

/// What the source takes back besides what transitions need.
pub(super) struct Taking<'a> {
    pub(super) preemptions: &'a [gpuslice_api::Preemption],
    pub(super) gpus_out: &'a BTreeMap<u32, String>,
}

/// The CheckpointPolicy of a held slice: its workload's policy's, else its GPU's pool's.
pub(super) fn checkpoint_policy(
    pass: &Pass,
    config: &Config,
    claim: Option<&Claim>,
    slice: &str,
) -> Option<drain::DrainPolicy> {
    let workload_policy = claim
        .and_then(|c| c.policy.as_ref())
        .and_then(|p| config.policies.get(p))
        .and_then(|p| p.checkpoint_policy.as_deref());
    let gpu = crate::gpu::slices::configs(&pass.inventory)
        .into_iter()
        .find(|c| c.id == slice)
        .map(|c| c.gpu);
    let pool_policy = pass
        .plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .find(|g| Some(g.index) == gpu)
        .and_then(|g| g.checkpoint_policy());
    drain::policy_for(workload_policy, pool_policy, &config.checkpoints)
}
