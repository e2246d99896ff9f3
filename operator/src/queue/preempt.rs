//! Preemption: which running pods' slices a pool's waiting pods take back, and the follow-up on
//! each preemption asked for (reported when its node's agent leaves it unread, then given up).

use std::collections::{BTreeMap, BTreeSet};

use gpuslice_planning::queue::{self, FreeDevice, Preempt, Reason, Running, Share, Waiting};
use kube::ResourceExt as _;

use super::cluster::{GIVE_UP_AFTER, PoolPass};
use super::messages::humantime;

/// How long the slices of a node whose agent let a preemption be given up are not taken again.
const REST_AFTER_GIVING_UP: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

/// Where a preemption stands with the agent that must carry it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// The agent has read the GpuNode that asks for it, or has had less than the timeout.
    OnTime,
    /// Unread past the timeout; `first` the first pass that finds it so.
    Overdue { first: bool },
    /// Unread past [`GIVE_UP_AFTER`] timeouts: dropped, and the node's slices left alone a while.
    GivenUp,
}

/// The preemptions the queue asked for: since when, which were reported overdue, and the nodes
/// whose agent let one be given up (until when their slices are not taken again: another victim
/// there would wait for the same agent). Kept in memory: a new leader starts the clocks again,
/// which retries them.
#[derive(Debug, Default)]
pub(super) struct FollowUp {
    asked: BTreeMap<String, chrono::DateTime<chrono::Utc>>,
    reported: BTreeSet<String>,
    given_up: BTreeMap<String, chrono::DateTime<chrono::Utc>>,
}

impl FollowUp {
    /// Whether a preemption on `node` was given up lately: its claims are no victims for now.
    fn resting(&self, node: &str, wall: chrono::DateTime<chrono::Utc>) -> bool {
        self.given_up.get(node).is_some_and(|until| *until > wall)
    }

    /// Where the preemption of `claim` stands, `read` saying whether its node's agent has
    /// read the GpuNode's current spec (it acts on a preemption in the pass that reads it).
    fn judge(
        &mut self,
        claim: &str,
        node: &str,
        read: bool,
        wall: chrono::DateTime<chrono::Utc>,
        timeout: std::time::Duration,
    ) -> Standing {
        let since = *self.asked.entry(claim.to_string()).or_insert(wall);
        let timeout = chrono::TimeDelta::from_std(timeout).unwrap_or(chrono::TimeDelta::MAX);
        let unread = wall - since;
        if read || unread < timeout {
            return Standing::OnTime;
        }
        if unread >= timeout * GIVE_UP_AFTER as i32 {
            self.asked.remove(claim);
            self.reported.remove(claim);
            self.given_up
                .insert(node.to_string(), wall + REST_AFTER_GIVING_UP);
            return Standing::GivenUp;
        }
        Standing::Overdue {
            first: self.reported.insert(claim.to_string()),
        }
    }

    /// Forgets the preemptions no longer asked for, and rests that are over.
    pub(super) fn keep_only(
        &mut self,
        asked: &BTreeSet<String>,
        wall: chrono::DateTime<chrono::Utc>,
    ) {
        self.asked.retain(|c, _| asked.contains(c));
        self.reported.retain(|c| asked.contains(c));
        self.given_up.retain(|_, until| *until > wall);
    }

    /// Keeps of the pool's `preempted` those still asked for: one its node's agent leaves unread
    /// past the timeout is reported on the pool (once) and kept, one unread past
    /// [`GIVE_UP_AFTER`] timeouts is reported and dropped. Returns the claims overdue.
    pub(super) fn review(
        &mut self,
        at: &PoolPass,
        preempted: &mut Vec<Preempt>,
        stalled: &mut Vec<(String, &'static str, String)>,
    ) -> BTreeSet<String> {
        let (wall, agent_timeout) = (at.pass.wall, at.pass.agent_timeout);
        let mut overdue = BTreeSet::new();
        preempted.retain(|p| {
            let read = at.pass.agents.read.get(&p.node).copied().unwrap_or(false);
            match self.judge(&p.claim, &p.node, read, wall, agent_timeout) {
                Standing::OnTime => true,
                Standing::Overdue { first } => {
                    if first {
                        stalled.push((
                            at.name.clone(),
                            "PreemptionOverdue",
                            format!(
                                "the agent of node {} has not read, for {}, the preemption of ResourceClaim {} for pod {}: is gpuslice's agent running there? Still asked; given up after {}",
                                p.node,
                                humantime(agent_timeout),
                                p.claim,
                                p.for_pod,
                                humantime(agent_timeout * GIVE_UP_AFTER)
                            ),
                        ));
                    }
                    overdue.insert(p.claim.clone());
                    true
                }
                Standing::GivenUp => {
                    stalled.push((
                        at.name.clone(),
                        "PreemptionGivenUp",
                        format!(
                            "gave up taking back the slice of ResourceClaim {} on node {} for pod {}: its agent did not read the request within {}; the pod waits for another slice, and no slice of node {} is taken back for {} minutes",
                            p.claim,
                            p.node,
                            p.for_pod,
                            humantime(agent_timeout * GIVE_UP_AFTER),
                            p.node,
                            REST_AFTER_GIVING_UP.num_minutes()
                        ),
                    ));
                    false
                }
            }
        });
        overdue
    }
}

impl PoolPass<'_> {
    /// The running pods whose slices the pool's pods that `wait` because no free slice fits
    /// them take back ([`queue::preempt`]).
    pub(super) fn preempt(
        &self,
        follow_up: &FollowUp,
        waiting: &[Waiting],
        wait: &[(String, usize, Reason)],
        free: &[FreeDevice],
        shares: &BTreeMap<String, Share>,
    ) -> Vec<Preempt> {
        let unfit: Vec<&Waiting> = wait
            .iter()
            // Taking a slice back helps neither a pod of an unknown policy nor one whose
            // slices are free but whose nodes lack its CPU or memory.
            .filter(|(_, _, r)| matches!(r, Reason::NoSliceFits | Reason::WindowChangeAhead))
            .filter_map(|(k, _, _)| waiting.iter().find(|w| w.key() == *k))
            .collect();
        let running = self.running(follow_up);
        tracing::debug!(?running, "candidates for preemption");
        queue::preempt(
            self.scheduling.policy,
            &unfit,
            &self.needs,
            free,
            &running,
            shares,
        )
    }

    /// The pool's slices held by running pods that may be taken back: untainted, on no node
    /// resting after a preemption given up; each with its priority and the work it would lose.
    fn running(&self, follow_up: &FollowUp) -> Vec<Running> {
        let (pass, now, wall) = (self.pass, self.pass.now, self.pass.wall);
        pass.held
            .iter()
            .filter(|h| h.pool == self.name && !h.tainted)
            .filter(|h| !follow_up.resting(&h.device.node, wall))
            .map(|h| {
                let policy = h
                    .policy
                    .as_ref()
                    .and_then(|p| pass.policies.iter().find(|x| x.name_any() == *p));
                let since = pass.agents.checkpoints.get(&h.claim).copied().or(h.created);
                Running {
                    claim: h.claim.clone(),
                    namespace: h.namespace.clone(),
                    device: h.device.clone(),
                    priority: policy.map_or(0, |p| {
                        queue::priority_in_force(
                            self.pool,
                            &p.name_any(),
                            &p.spec.priority,
                            now,
                            &pass.classes,
                        )
                    }),
                    // A claim whose policy is unknown is no victim.
                    preemptible: policy.is_some_and(|p| p.spec.preemptible),
                    loss_seconds: since.map_or(f64::MAX, |t| {
                        queue::work_lost(t, pass.agents.idle_since.get(&h.claim).copied(), wall)
                    }),
                    max_loss_seconds: gpuslice_planning::shaping::max_loss_of(
                        policy.map(|p| &**p),
                        Some(self.pool),
                        |name| {
                            pass.checkpoints
                                .iter()
                                .find(|c| c.metadata.name.as_deref() == Some(name))
                                .map(|c| &c.spec)
                        },
                    ),
                    taken_for: pass.agents.under_way.get(&h.claim).cloned(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{FollowUp, Standing};

    #[test]
    fn an_unread_preemption_is_reported_once_then_given_up_and_its_node_rested() {
        let t0: chrono::DateTime<chrono::Utc> = "2026-12-06T10:00:00Z".parse().unwrap();
        let at = |s: i64| t0 + chrono::TimeDelta::seconds(s);
        let timeout = std::time::Duration::from_secs(60);
        let mut follow = FollowUp::default();
        let mut judge = |read: bool, s: i64| follow.judge("ml/c", "n1", read, at(s), timeout);
        assert_eq!(judge(false, 0), Standing::OnTime);
        assert_eq!(judge(false, 59), Standing::OnTime);
        assert_eq!(judge(false, 60), Standing::Overdue { first: true });
        assert_eq!(judge(false, 120), Standing::Overdue { first: false });
        // Read by the agent: it acts (drains, or asks the eviction) whatever the age.
        assert_eq!(judge(true, 200), Standing::OnTime);
        assert_eq!(judge(false, 300), Standing::GivenUp);
        assert!(follow.resting("n1", at(300 + 599)));
        assert!(!follow.resting("n2", at(300)));
        assert!(!follow.resting("n1", at(300 + 600)));
        // Asked again later: a new clock.
        assert_eq!(
            follow.judge("ml/c", "n1", false, at(301), timeout),
            Standing::OnTime
        );
        // No longer asked: forgotten; rests that are over go too.
        follow.keep_only(&Default::default(), at(1000));
        assert!(follow.asked.is_empty() && follow.given_up.is_empty());
    }
}
