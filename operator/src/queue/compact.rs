//! Compaction from the queue's side: each compacting pool's round stepped
//! ([`crate::compaction`]) and its moves, GPUs being emptied and record put into the [`Plan`].

use std::collections::{BTreeMap, BTreeSet};

use gpuslice_api::GpuPool;
use kube::ResourceExt as _;

use super::cluster::{Held, Pass, admitted_to};
use super::{POLICY_LABEL, Plan, Queue};
use crate::compaction::{Holder, Slice};

/// The holder of each slice, by (node, device).
type Holders<'a> = BTreeMap<(&'a str, &'a str), &'a Held>;

impl Queue {
    /// Compaction rounds (`crate::compaction`): the moves as preemptions for no pod, the GPUs
    /// being emptied, the rounds to record.
    pub(super) fn compact(&mut self, plan: &mut Plan, pass: &Pass) {
        let claims: BTreeSet<String> = pass.held.iter().map(|h| h.claim.clone()).collect();
        let holder_of: Holders = pass
            .held
            .iter()
            .map(|h| ((h.device.node.as_str(), h.device.device.as_str()), h))
            .collect();
        for pool in &pass.pools {
            let name = pool.name_any();
            if !pool.spec.compaction.as_ref().is_some_and(|c| c.enabled) {
                continue;
            }
            let slices = || slices(pass, &holder_of, pool);
            let quiet = quiet(plan, pass, &name);
            let step = self.rounds.step(pool, slices, &claims, quiet, pass.now);
            for (node, moves) in step.preemptions {
                plan.compacting.entry(node.clone()).or_default();
                plan.preemptions.entry(node).or_default().extend(moves);
            }
            for (node, gpu) in step.compacting {
                plan.preemptions.entry(node.clone()).or_default();
                plan.compacting.entry(node).or_default().push(gpu);
            }
            if let Some(round) = step.record {
                plan.compaction.insert(name.clone(), round);
            }
        }
    }
}

/// The pool's software slices as compaction plans with them: free or not, and who holds each
/// (the memory its policy needs, whether it may be moved).
fn slices(pass: &Pass, holder_of: &Holders, pool: &GpuPool) -> Vec<Slice> {
    let name = pool.name_any();
    pass.devices
        .iter()
        .filter(|(_, p)| p.pool == name && p.software)
        .map(|(key, p)| {
            let holder = holder_of
                .get(&(p.device.node.as_str(), p.device.device.as_str()))
                .map(|h| {
                    let policy = h
                        .policy
                        .as_ref()
                        .and_then(|x| pass.policies.iter().find(|q| q.name_any() == *x));
                    Holder {
                        claim: h.claim.clone(),
                        size: policy.map_or(p.device.memory_bytes, |q| {
                            crate::classes::memory_limit(q, &pass.pool_list)
                        }),
                        movable: policy.is_some_and(|q| {
                            q.spec.preemptible
                                && (q.spec.checkpoint_policy.is_some()
                                    || pool.spec.checkpoint_policy.is_some())
                        }) && !h.tainted
                            && !pass.agents.under_way.contains_key(&h.claim),
                    }
                });
            Slice {
                node: p.device.node.clone(),
                gpu: p.device.gpu,
                memory_bytes: p.device.memory_bytes,
                free: !p.tainted && !pass.allocated.contains(key),
                holder,
            }
        })
        .collect()
}

/// Quiet: nothing of the pool `name` admitted this pass or admitted and not bound yet.
fn quiet(plan: &Plan, pass: &Pass, name: &str) -> bool {
    let pool_of_policy = |policy: &str| {
        pass.policies
            .iter()
            .find(|p| p.name_any() == policy)
            .map(|p| p.spec.pool.clone())
    };
    !plan.admitted_pool.values().any(|p| *p == name)
        && !pass.pods.iter().any(|p| {
            admitted_to(p).is_some()
                && p.labels()
                    .get(POLICY_LABEL)
                    .and_then(|policy| pool_of_policy(policy))
                    .is_some_and(|p| p == name)
        })
}
