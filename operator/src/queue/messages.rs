//! What a waiting pod is told: the reason and message of its `gpuslice.io/Queued` condition
//! (its place in the pool's queue, why it waits), and the wording they share.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpuslice_api::SchedulingPolicy;
use gpuslice_planning::queue::{Preempt, Reason, Share, Waiting};

use super::cluster::{GIVE_UP_AFTER, PoolPass};
use super::{POLICY_LABEL, RUN_TIME_ANNOTATION};

/// Pods further back than this are told only that they wait, so that each admission does not
/// rewrite every waiting pod's condition.
const EXACT_PLACES: usize = 100;

/// What the pods still waiting in a pool are told, once its admissions and preemptions are
/// decided.
pub(super) struct Telling<'a> {
    pub(super) at: &'a PoolPass<'a>,
    pub(super) waiting: &'a [Waiting],
    pub(super) shares: &'a BTreeMap<String, Share>,
    /// The slices taken back for waiting pods.
    pub(super) preempted: &'a [Preempt],
    /// The claims whose preemption its node's agent leaves unread past the timeout.
    pub(super) overdue: &'a BTreeSet<String>,
    /// How many pods wait.
    pub(super) total: usize,
}

impl Telling<'_> {
    /// The `pod`'s condition, (pod, reason, message): its `place` in the queue, and why it
    /// waits.
    pub(super) fn condition(
        &self,
        pod: String,
        place: usize,
        reason: Reason,
    ) -> (String, String, String) {
        let (total, pool_name) = (self.total, &self.at.name);
        let (reason, why) = self.why(&pod, place, reason);
        let message = if place <= EXACT_PLACES {
            format!(
                "{} of {total} waiting in the queue of pool {pool_name}: {why}",
                ordinal(place)
            )
        } else {
            format!("more than {EXACT_PLACES} ahead in the queue of pool {pool_name}: {why}")
        };
        (pod, reason.to_string(), message)
    }

    /// Why the pod at `place` waits: its condition's reason, and the explanation.
    fn why(&self, pod: &str, place: usize, reason: Reason) -> (&'static str, String) {
        let pool_name = &self.at.name;
        let taking = self.preempted.iter().find(|p| p.for_pod == pod);
        let asking = self.waiting.iter().find(|w| w.key() == pod);
        let policy = asking.map(|w| w.policy.clone()).unwrap_or_default();
        let wanted = match asking {
            Some(w) if w.count > 1 => format!(
                "no {} free slices of pool {pool_name} that fit policy {policy} are on one {}",
                w.count,
                if w.nvlink { "NVLink domain" } else { "node" }
            ),
            _ => format!("no free slice of pool {pool_name} fits policy {policy}"),
        };
        match (reason, taking) {
            (Reason::NoSliceFits | Reason::WindowChangeAhead, Some(p)) => (
                "Preempting",
                format!(
                    "taking back the slice of ResourceClaim {} ({}): {}",
                    p.claim,
                    p.reason,
                    self.taking_back(p)
                ),
            ),
            (Reason::NoSliceFits, None) => (
                "NoSliceFits",
                format!(
                    "{wanted}{}",
                    // Beyond the exact places it would rewrite every pod at each
                    // admission.
                    if place <= EXACT_PLACES {
                        standing(
                            self.at.scheduling.policy,
                            self.shares,
                            self.waiting,
                            pod_namespace(pod),
                        )
                    } else {
                        String::new()
                    }
                ),
            ),
            (Reason::WindowChangeAhead, None) => (
                "WindowChangeAhead",
                format!(
                    "every free slice of pool {pool_name} that fits policy {policy} is re-cut by a window change before the pod's expected run time ({RUN_TIME_ANNOTATION}) ends"
                ),
            ),
            (Reason::NoRoom, _) => {
                let (cpu, memory) = asking.map_or((0, 0), |w| (w.cpu_milli, w.memory_mib));
                (
                    "NoRoom",
                    format!(
                        "free slices of pool {pool_name} fit policy {policy}, but no node that has them has the {cpu}m CPU and {memory}Mi memory the pod requests free: lower the pod's requests, or free room on those nodes"
                    ),
                )
            }
            (Reason::UnknownPolicy, _) => (
                "UnknownPolicy",
                format!(
                    "GpuSlicePolicy {policy} does not exist: create it, or change the pod's label {POLICY_LABEL}"
                ),
            ),
        }
    }

    /// Where taking back the slice `p` stands: what its agent says of the drain, or that its
    /// node's agent was asked (and has not read it, when overdue).
    fn taking_back(&self, p: &Preempt) -> String {
        let agent_timeout = self.at.pass.agent_timeout;
        match self.at.pass.agents.draining.get(&p.claim) {
            Some(d) => d.clone(),
            None if self.overdue.contains(&p.claim) => format!(
                "asked the agent of node {}, which has not read it for over {} (is it running?); given up after {}",
                p.node,
                humantime(agent_timeout),
                humantime(agent_timeout * GIVE_UP_AFTER)
            ),
            None => "asked its node's agent".to_string(),
        }
    }
}

/// A duration as `kubectl` and the CRDs write them (`1m0s`).
pub(super) fn humantime(d: Duration) -> String {
    gpuslice_api::Duration::from(d).to_string()
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, r) if r != 11 => "st",
        (2, r) if r != 12 => "nd",
        (3, r) if r != 13 => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

fn pod_namespace(key: &str) -> &str {
    key.split_once('/').map_or("", |(ns, _)| ns)
}

/// Under fair share, where the pod's namespace stands: what decides its turn when a slice frees.
fn standing(
    policy: SchedulingPolicy,
    shares: &BTreeMap<String, Share>,
    waiting: &[Waiting],
    namespace: &str,
) -> String {
    // Fair share decides something only between namespaces that hold or want slices.
    let contenders: BTreeSet<&str> = shares
        .iter()
        .filter(|(_, s)| s.holding > 0)
        .map(|(ns, _)| ns.as_str())
        .chain(waiting.iter().map(|w| w.namespace.as_str()))
        .collect();
    if !matches!(
        policy,
        SchedulingPolicy::Fair | SchedulingPolicy::PriorityFair
    ) || contenders.len() < 2
    {
        return String::new();
    }
    let Some(share) = shares.get(namespace) else {
        return String::new();
    };
    format!(
        "; by fair share, namespace {namespace} holds {} slice(s) at weight {} (the namespace holding the fewest per weight goes first)",
        share.holding, share.weight
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn places_read_as_ordinals() {
        let got: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101]
            .map(super::ordinal)
            .into();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"
            ]
        );
    }
}
