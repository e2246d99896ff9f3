//! One pool's part of a pass ([`Queue::plan_pool`]): its waiting pods, their order and the
//! admission decision, the pool's fragmentation, and what each step adds to the [`Plan`].

use std::collections::BTreeMap;

use gpuslice_api::{GpuPool, Preemption};
use gpuslice_planning::queue::{self, Decision, FreeDevice, Need, Nodes, Waiting};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;

use super::cluster::{Pass, PoolPass};
use super::messages::Telling;
use super::{
    INVALID_RUN_TIME, POLICY_LABEL, Plan, Queue, RUN_TIME_ANNOTATION, STORAGE_MISSING,
    checkpoint_claim, gated,
};

impl Queue {
    /// Plans one pool: tells the pods whose annotation is unreadable, decays and records the
    /// namespaces' use, measures the pool's fragmentation, admits what fits, takes slices back
    /// where the pool allows preemption, and tells the pods left why they wait. Returns the
    /// claims whose preemption it asks for.
    pub(super) fn plan_pool(
        &mut self,
        pass: &Pass,
        pool: &GpuPool,
        elapsed: f64,
        free: &mut BTreeMap<String, Vec<FreeDevice>>,
        nodes: &mut Nodes,
        plan: &mut Plan,
    ) -> Vec<String> {
        let at = PoolPass::new(pass, pool);
        let (waiting, held) = at.waiting();
        plan.tell.extend(held);
        let shares = at.shares(&mut self.usage, &waiting, elapsed);
        if let Some(fair_share) = at.fair_share(&shares) {
            plan.fair_share.insert(at.name.clone(), fair_share);
        }
        plan.fragmentation.insert(
            at.name.clone(),
            at.fragmentation(&waiting, free.get(&at.name).map_or(&[], Vec::as_slice)),
        );
        if waiting.is_empty() {
            return Vec::new();
        }
        let order = queue::order(at.scheduling.policy, &waiting, &shares);
        let devices = free.remove(&at.name).unwrap_or_default();
        nodes.gpus = pass.pool_gpus.get(&at.name).cloned().unwrap_or_default();
        let Decision { admit, wait, left } = queue::decide(
            &waiting,
            &order,
            &at.needs,
            &devices,
            nodes,
            &mut self.placer,
        );
        at.admitted(plan, &waiting, admit);
        // Pods no free slice fits may take one back from running pods.
        let mut preempted = if at.scheduling.preemption {
            at.preempt(&self.follow_up, &waiting, &wait, &left, &shares)
        } else {
            Vec::new()
        };
        // Preemptions the node's agent leaves unread are reported, then given up.
        let overdue = self
            .follow_up
            .review(&at, &mut preempted, &mut plan.stalled);
        for p in &preempted {
            plan.preemptions
                .entry(p.node.clone())
                .or_default()
                .push(Preemption {
                    resource_claim: p.claim.clone(),
                    for_pod: p.for_pod.clone(),
                    reason: p.reason.clone(),
                });
        }
        let telling = Telling {
            at: &at,
            waiting: &waiting,
            shares: &shares,
            preempted: &preempted,
            overdue: &overdue,
            total: wait.len(),
        };
        for (pod, place, reason) in wait {
            plan.tell.push(telling.condition(pod, place, reason));
        }
        preempted.into_iter().map(|p| p.claim).collect()
    }
}

impl PoolPass<'_> {
    /// The pool's gated pods, and apart the pods (`namespace/name`) held out of line until
    /// their owner fixes them, each with the reason and message to tell it: an unreadable expected
    /// run time, checkpoint storage that does not exist.
    fn waiting(&self) -> (Vec<Waiting>, Vec<(String, String, String)>) {
        let (pass, now) = (self.pass, self.pass.now);
        let mut held: Vec<(String, String, String)> = Vec::new();
        let waiting: Vec<Waiting> = pass
            .pods
            .iter()
            .filter(|p| gated(p))
            .filter_map(|p| {
                let policy = p.labels().get(POLICY_LABEL)?.clone();
                let spec = pass.policies.iter().find(|x| x.name_any() == policy);
                // A pod whose policy is unknown waits in no pool's queue but the first's,
                // so that it is told why.
                if spec.map_or(self.name != pass.pools[0].name_any(), |s| {
                    s.spec.pool != self.name
                }) {
                    return None;
                }
                let key = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
                let runs_until = match expected_run_time(p) {
                    Ok(run_time) => run_time.map(|d| now + d),
                    Err(message) => {
                        // It waits, out of line, until its annotation is fixed.
                        held.push((key, INVALID_RUN_TIME.into(), message));
                        return None;
                    }
                };
                let namespace = p.namespace().unwrap_or_default();
                if let Some(claim) = checkpoint_claim(p)
                    && pass
                        .volume_claims
                        .get(&kube::runtime::reflector::ObjectRef::new(claim).within(&namespace))
                        .is_none()
                {
                    // kube-scheduler would never bind it: it waits until the claim exists.
                    let of = spec
                        .and_then(|s| s.spec.checkpoint_policy_in(&pass.pool_list))
                        .map_or(String::new(), |c| format!(" of CheckpointPolicy {c}"));
                    held.push((
                        key,
                        STORAGE_MISSING.into(),
                        format!(
                            "PersistentVolumeClaim {namespace}/{claim} (the checkpoint storage{of}, policy {policy}) does not exist: create it in namespace {namespace}; the pod waits until then"
                        ),
                    ));
                    return None;
                }
                let count =
                    slices_asked(p, &policy).unwrap_or_else(|| spec.map_or(1, |s| s.spec.count));
                let (cpu_milli, memory_mib) = super::room::requests(p);
                Some(Waiting {
                    namespace,
                    name: p.name_any(),
                    priority: spec.map_or(0, |s| {
                        queue::priority_in_force(
                            self.pool,
                            &policy,
                            &s.spec.priority,
                            now,
                            &pass.classes,
                        )
                    }),
                    policy,
                    created: p
                        .creation_timestamp()
                        .and_then(|t| gpuslice_api::chrono_of(&t))
                        .unwrap_or(now),
                    runs_until,
                    count,
                    nvlink: spec.is_some_and(|s| {
                        s.spec.topology == Some(gpuslice_api::Topology::Nvlink)
                    }),
                    cpu_milli,
                    memory_mib,
                })
            })
            .collect();
        (waiting, held)
    }

    /// The pool's fragmentation over its `free` devices, its policies weighed by their demand:
    /// the slices each holds and its pods waiting (each policy counts once when the pool has no
    /// demand yet).
    fn fragmentation(&self, waiting: &[Waiting], free: &[FreeDevice]) -> f64 {
        let mix: Vec<(Need, f64)> = self
            .needs
            .iter()
            .map(|(policy, need)| {
                let demand = self
                    .pass
                    .held
                    .iter()
                    .filter(|h| h.pool == self.name && h.policy.as_ref() == Some(policy))
                    .count()
                    + waiting.iter().filter(|w| w.policy == *policy).count();
                (*need, demand as f64)
            })
            .collect();
        let no_demand = mix.iter().all(|(_, d)| *d == 0.0);
        let mix: Vec<(Need, f64)> = mix
            .into_iter()
            .map(|(need, d)| (need, if no_demand { 1.0 } else { d }))
            .collect();
        queue::fragmentation(free, &mix)
    }

    /// Counts the pool's waiting pods per namespace, less those admitted, and adds the
    /// admissions to the plan.
    fn admitted(&self, plan: &mut Plan, waiting: &[Waiting], admit: Vec<(String, String)>) {
        for w in waiting {
            *plan
                .waiting
                .entry((self.name.clone(), w.namespace.clone()))
                .or_default() += 1;
        }
        for (pod, _) in &admit {
            plan.admitted_pool.insert(pod.clone(), self.name.clone());
            if let Some((pool, namespace)) = waiting
                .iter()
                .find(|w| w.key() == *pod)
                .map(|w| (self.name.clone(), w.namespace.clone()))
                && let Some(n) = plan.waiting.get_mut(&(pool, namespace))
            {
                *n -= 1;
            }
        }
        plan.admit.extend(admit);
    }
}

/// The pod's declared expected run time, if any; a message naming the fix if unreadable.
fn expected_run_time(pod: &Pod) -> Result<Option<chrono::Duration>, String> {
    let Some(value) = pod.annotations().get(RUN_TIME_ANNOTATION) else {
        return Ok(None);
    };
    let refused = || {
        format!(
            "annotation {RUN_TIME_ANNOTATION}: {value:?} is not a positive duration such as 90m or 2h: fix it, or remove it; the pod waits until then"
        )
    };
    let declared: kube::core::Duration = value.parse().map_err(|_| refused())?;
    let duration = std::time::Duration::from(declared);
    if declared.is_negative() || duration.is_zero() {
        return Err(refused());
    }
    chrono::Duration::from_std(duration)
        .map(Some)
        .map_err(|_| refused())
}

/// The slices of `policy` a pod's containers ask for (`gpuslice.io/<policy>` limits; an init
/// container's are given back before the next starts, so the most any one asks counts beside
/// the sum of the others): none when it asks by label or claim only.
pub(super) fn slices_asked(pod: &k8s_openapi::api::core::v1::Pod, policy: &str) -> Option<u32> {
    let spec = pod.spec.as_ref()?;
    let resource = format!("gpuslice.io/{policy}");
    let asked = |c: &k8s_openapi::api::core::v1::Container| -> Option<u32> {
        let q = c.resources.as_ref()?.limits.as_ref()?.get(&resource)?;
        q.0.parse().ok()
    };
    let running: Option<u32> = spec
        .containers
        .iter()
        .filter_map(asked)
        .reduce(|a, b| a.saturating_add(b));
    let init: Option<u32> = spec
        .init_containers
        .iter()
        .flatten()
        .filter_map(asked)
        .max();
    match (running, init) {
        (None, None) => None,
        (r, i) => Some(r.unwrap_or(0).max(i.unwrap_or(0))),
    }
}
