//! The admission queue in front of kube-scheduler. Pods that name a policy by the label
//! `gpuslice.io/policy` are created with the scheduling gate `gpuslice.io/queue` (the chart's
//! MutatingAdmissionPolicy adds it); kube-scheduler leaves them alone until the gate is gone.
//!
//! Each pass, per pool: read (gated pods, the pool's free devices, what each namespace holds)
//! → decide (`gpuslice_planning::queue`: order by the pool's scheduling policy, admit while a free
//! slice fits, pick the node with our placement engine) → apply: an admitted pod gets its node
//! affinity narrowed to that node and its gate removed (kube-scheduler then binds it and
//! allocates the slice); a waiting pod carries the condition `gpuslice.io/Queued` with its place
//! in the queue and why it waits.
//!
//! Where the pool allows preemption, pods that still wait may take back running pods' slices
//! (`queue::preempt`): the choices go to `GpuNode.spec.preemptions` under this module's own field
//! manager, and the node's agent drains those slices as their CheckpointPolicy says.
//!
//! Namespaces' decayed use goes to each pool's `status.fairShare` every few seconds (under this
//! module's field manager); a restarted or new leader starts from it. Queue order otherwise
//! depends only on the pods and what they hold, so a restart loses no place.
//!
//! This file owns the queue's public face (its names, [`Caches`], [`Queue`], [`Plan`]) and one
//! pass's planning step by step; each step lives in the file of its concern beside it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpuslice_api::{FairShareStatus, GpuNode, GpuPool, GpuSlicePolicy, Preemption};
use gpuslice_planning::queue::{EnginePlacer, FreeDevice, Nodes};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::ResourceExt as _;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::published::PublishedSlice;

mod api;
mod cluster;
mod compact;
mod messages;
mod metrics;
mod pool;
mod preempt;
mod room;
mod run;
mod share;

pub use metrics::QueueMetrics;
pub use room::trim_bound_pod;
pub use run::run;

use cluster::{Pass, admitted_to};
use preempt::FollowUp;

/// The scheduling gate of pods waiting in the queue.
pub const GATE: &str = "gpuslice.io/queue";
/// The pod condition that says where a pod stands in the queue.
pub const CONDITION: &str = "gpuslice.io/Queued";
/// The reason a pod whose `gpuslice.io/expected-run-time` is unreadable waits (also an Event).
pub const INVALID_RUN_TIME: &str = "InvalidExpectedRunTime";
/// The reason a pod whose checkpoint storage claim does not exist waits (also an Event).
pub const STORAGE_MISSING: &str = "CheckpointStorageMissing";
/// The label that names a pod's policy.
pub const POLICY_LABEL: &str = "gpuslice.io/policy";

/// The queue's view of the cluster, shared with the controller's caches.
pub struct Caches {
    pub pods: Store<Pod>,
    pub pools: Store<GpuPool>,
    pub policies: Store<GpuSlicePolicy>,
    /// For the `maxLoss` of a victim's CheckpointPolicy.
    pub checkpoints: Store<gpuslice_api::CheckpointPolicy>,
    pub slices: Store<PublishedSlice>,
    pub claims: Store<ResourceClaim>,
    pub gpu_nodes: Store<GpuNode>,
    pub priority_classes: Store<PriorityClass>,
    /// The PersistentVolumeClaims (names only): a pod's checkpoint storage must exist.
    pub volume_claims: Store<PersistentVolumeClaim>,
    /// The Nodes (their allocatable CPU and memory).
    pub nodes: Store<Node>,
    /// Every pod bound to a node and not finished (its CPU and memory requests).
    pub bound_pods: Store<Pod>,
}

/// The field manager of the preemptions the queue writes into `GpuNode.spec`.
pub const MANAGER: &str = "gpuslice-queue";

/// What the gated pods wait for, per policy: how many wait at the gate, and per namespace how
/// many wait for checkpoint storage whose claim does not exist there (the queue holds those).
#[derive(Default)]
pub struct GateCounts {
    pub waiting: BTreeMap<String, u32>,
    pub storage_missing: BTreeMap<String, BTreeMap<String, u32>>,
}

/// The gated pods counted, in one walk over the pods.
pub fn at_the_gate(pods: &Store<Pod>, volume_claims: &Store<PersistentVolumeClaim>) -> GateCounts {
    let mut out = GateCounts::default();
    for pod in pods.state().iter().filter(|p| gated(p)) {
        let Some(policy) = pod.labels().get(POLICY_LABEL) else {
            continue;
        };
        *out.waiting.entry(policy.clone()).or_default() += 1;
        let Some(claim) = checkpoint_claim(pod) else {
            continue;
        };
        let namespace = pod.namespace().unwrap_or_default();
        if volume_claims
            .get(&ObjectRef::new(claim).within(&namespace))
            .is_none()
        {
            *out.storage_missing
                .entry(policy.clone())
                .or_default()
                .entry(namespace)
                .or_default() += 1;
        }
    }
    out
}

/// Drops what the queue never reads of a cached pod: its status, its containers but their names
/// and gpuslice.io limits, and its volumes but the checkpoint storage's (it reads labels,
/// annotations, creation time, gates, node name, affinity, the slices asked for and that
/// volume's claim).
pub fn trim_pod(pod: &mut Pod) {
    pod.status = None;
    if let Some(spec) = &mut pod.spec {
        // Of its containers, only how many slices each asks for and its CPU and memory
        // requests (the node it goes to must have them free).
        let slices_only = |c: &mut k8s_openapi::api::core::v1::Container| {
            let requests = room::cpu_and_memory_requests(c);
            let limits = c
                .resources
                .take()
                .and_then(|r| r.limits)
                .map(|l| {
                    l.into_iter()
                        .filter(|(k, _)| k.starts_with("gpuslice.io/"))
                        .collect::<BTreeMap<_, _>>()
                })
                .filter(|l| !l.is_empty());
            *c = k8s_openapi::api::core::v1::Container {
                name: std::mem::take(&mut c.name),
                restart_policy: c.restart_policy.take(),
                resources: (limits.is_some() || requests.is_some()).then(|| {
                    k8s_openapi::api::core::v1::ResourceRequirements {
                        limits,
                        requests,
                        ..Default::default()
                    }
                }),
                ..Default::default()
            };
        };
        spec.containers.iter_mut().for_each(slices_only);
        spec.init_containers
            .iter_mut()
            .flatten()
            .for_each(slices_only);
        if let Some(volumes) = &mut spec.volumes {
            volumes.retain(|v| v.name == gpuslice_api::CHECKPOINT_VOLUME);
        }
        spec.tolerations = None;
    }
}

/// The PersistentVolumeClaim the pod's checkpoints are stored in (the chart's admission adds it
/// for a policy whose CheckpointPolicy has `storage`).
fn checkpoint_claim(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()?
        .volumes
        .as_ref()?
        .iter()
        .find(|v| v.name == gpuslice_api::CHECKPOINT_VOLUME)?
        .persistent_volume_claim
        .as_ref()
        .map(|c| c.claim_name.as_str())
}

/// How long a pod means to run once admitted (`gpuslice.io/expected-run-time`, a duration such
/// as `90m` or `2h`): the queue does not put it on a slice a window change re-cuts before then.
pub const RUN_TIME_ANNOTATION: &str = "gpuslice.io/expected-run-time";

fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == GATE))
}

/// The queue's state between passes.
#[derive(Default)]
pub struct Queue {
    placer: EnginePlacer,
    /// The preemptions asked for, and whether their nodes' agents act on them.
    follow_up: FollowUp,
    /// Decayed slice-seconds per (pool, namespace).
    usage: BTreeMap<(String, String), f64>,
    last: Option<chrono::DateTime<chrono::Utc>>,
    /// What each waiting pod was last told, so that an unchanged condition is not written again.
    told: BTreeMap<String, (String, String)>,
    /// The ResourceClaimTemplates written lately.
    templates: run::Templates,
    /// Pools' compaction rounds.
    rounds: crate::compaction::Rounds,
}

/// What one pass writes.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// Pod (`namespace/name`) → node.
    pub admit: Vec<(String, String)>,
    /// Pod → (reason, message) of its `gpuslice.io/Queued` condition.
    pub tell: Vec<(String, String, String)>,
    /// GpuNode → the preemptions it should carry (empty: none any more).
    pub preemptions: BTreeMap<String, Vec<Preemption>>,
    /// GpuNode → the GPUs compaction is emptying there (empty: none any more).
    pub compacting: BTreeMap<String, Vec<u32>>,
    /// Pool → its compaction round to record in its status.
    pub compaction: BTreeMap<String, gpuslice_api::CompactionStatus>,
    /// Pods waiting per (pool, namespace).
    pub waiting: BTreeMap<(String, String), i64>,
    /// The pool of each pod admitted.
    pub admitted_pool: BTreeMap<String, String>,
    /// Pool → namespaces' use to record in its status (when the recorded one is stale).
    pub fair_share: BTreeMap<String, FairShareStatus>,
    /// Pool → its fragmentation (percent of its free slice memory).
    pub fragmentation: BTreeMap<String, f64>,
    /// (pool, reason, message) of a Warning Event on the pool: a preemption its node's agent has
    /// not acted on (`PreemptionOverdue`) or that was given up (`PreemptionGivenUp`).
    pub stalled: Vec<(String, &'static str, String)>,
}

impl Plan {
    /// An empty plan that clears what the GpuNodes carry of the queue's (their preemptions and
    /// the GPUs being compacted): the pools' planning and compaction state again what still holds.
    fn clearing(gpu_nodes: &[Arc<GpuNode>]) -> Plan {
        let mut plan = Plan::default();
        for node in gpu_nodes {
            if !node.spec.preemptions.is_empty() || !node.spec.compacting.is_empty() {
                plan.preemptions.insert(node.name_any(), Vec::new());
                plan.compacting.insert(node.name_any(), Vec::new());
            }
        }
        plan
    }
}

impl Queue {
    /// Decides one pass from the caches (no I/O). `now` is the operator's clock (windows, usage);
    /// `wall` the real time, which the API server's and the agents' timestamps (claims created,
    /// checkpoints written) are on, so that work lost is measured on their clock.
    pub fn plan(
        &mut self,
        caches: &Caches,
        now: chrono::DateTime<chrono::Utc>,
        wall: chrono::DateTime<chrono::Utc>,
        agent_timeout: std::time::Duration,
    ) -> Plan {
        let pass = Pass::read(caches, now, wall, agent_timeout);
        let mut plan = Plan::clearing(&pass.gpu_nodes);
        if self.last.is_none() {
            self.usage = share::recorded_usage(&pass.pools, wall);
        }
        let mut free = self.free(&pass);
        let elapsed = self
            .last
            .map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0);
        self.last = Some(now);
        let mut asked_now = BTreeSet::new();
        // The nodes' rooms are shared by the pools: what one admits leaves less for the next.
        let mut nodes = Nodes {
            rooms: pass.rooms.clone(),
            gpus: BTreeMap::new(),
        };
        for pool in &pass.pools {
            asked_now
                .extend(self.plan_pool(&pass, pool, elapsed, &mut free, &mut nodes, &mut plan));
        }
        self.compact(&mut plan, &pass);
        self.follow_up.keep_only(&asked_now, wall);
        plan.tell.retain(|(pod, reason, message)| {
            self.told.get(pod) != Some(&(reason.clone(), message.clone()))
        });
        plan
    }

    /// The free devices of each pool this pass: untainted, not allocated, not on a GPU compaction
    /// is emptying, and not spoken for by a pod admitted earlier and not bound yet.
    fn free(&self, pass: &Pass) -> BTreeMap<String, Vec<FreeDevice>> {
        let mut free = cluster::free_devices(&pass.devices, &pass.allocated);
        // Nothing is admitted onto GPUs that compaction is emptying.
        for pool in &pass.pools {
            let freeing = self.rounds.freeing(pool);
            if let Some(devices) = free.get_mut(&pool.name_any()) {
                devices.retain(|d| !freeing.contains(&(d.node.clone(), d.gpu)));
            }
        }
        // Admitted in an earlier pass and not bound yet: their devices are spoken for.
        for pod in &pass.pods {
            let (Some(node), Some(policy)) =
                (admitted_to(pod), pod.labels().get(POLICY_LABEL).cloned())
            else {
                continue;
            };
            let Some(p) = pass.policies.iter().find(|p| p.name_any() == policy) else {
                continue;
            };
            let need = pass.need(p);
            if let Some(devices) = free.get_mut(&p.spec.pool) {
                let count = pool::slices_asked(pod, &policy).unwrap_or(p.spec.count);
                let nvlink = p.spec.topology == Some(gpuslice_api::Topology::Nvlink);
                gpuslice_planning::queue::take(devices, &node, |d| need.fits(d), count, nvlink);
            }
        }
        free
    }
}
