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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use gpuslice_api::{
    FairShareStatus, GpuNode, GpuPool, GpuSlicePolicy, NamespaceUsage, Preemption,
    SchedulingPolicy, dra,
};
use gpuslice_planning::queue::{
    self, Decision, EnginePlacer, FreeDevice, Need, Reason, Running, Share, Waiting,
};
use gpuslice_runtime::clock::Clock;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt as _};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::Notify;

use crate::election::Leadership;
use crate::published::PublishedSlice;

/// The scheduling gate of pods waiting in the queue.
pub const GATE: &str = "gpuslice.io/queue";
/// The pod condition that says where a pod stands in the queue.
pub const CONDITION: &str = "gpuslice.io/Queued";
/// The label that names a pod's policy.
pub const POLICY_LABEL: &str = "gpuslice.io/policy";
/// Pods further back than this are told only that they wait, so that each admission does not
/// rewrite every waiting pod's condition.
const EXACT_PLACES: usize = 100;
/// A pass at least this often (usage accrues; devices come and go).
const PASS_EVERY: Duration = Duration::from_secs(2);
/// Half-life of namespaces' usage when the pool declares none.
const DEFAULT_HALF_LIFE_SECONDS: f64 = 3600.0;

/// The queue's view of the cluster, shared with the controller's caches.
pub struct Caches {
    pub pods: Store<Pod>,
    pub pools: Store<GpuPool>,
    pub policies: Store<GpuSlicePolicy>,
    pub slices: Store<PublishedSlice>,
    pub claims: Store<ResourceClaim>,
    pub gpu_nodes: Store<GpuNode>,
    pub priority_classes: Store<PriorityClass>,
}

/// The field manager of the preemptions the queue writes into `GpuNode.spec`.
pub const MANAGER: &str = "gpuslice-queue";

/// Policy name → pods naming it that wait at the gate.
pub fn waiting_by_policy(pods: &Store<Pod>) -> BTreeMap<String, u32> {
    let mut out: BTreeMap<String, u32> = BTreeMap::new();
    for pod in pods.state().iter().filter(|p| gated(p)) {
        if let Some(policy) = pod.labels().get(POLICY_LABEL) {
            *out.entry(policy.clone()).or_default() += 1;
        }
    }
    out
}

/// Drops what the queue never reads of a cached pod: its status, containers and volumes (it reads
/// labels, annotations, creation time, gates, node name and affinity).
pub fn trim_pod(pod: &mut Pod) {
    pod.status = None;
    if let Some(spec) = &mut pod.spec {
        spec.containers.clear();
        spec.init_containers = None;
        spec.volumes = None;
        spec.tolerations = None;
    }
}

/// How long a pod means to run once admitted (`gpuslice.io/expected-run-time`, a duration such
/// as `90m` or `2h`): the queue does not put it on a slice a window change re-cuts before then.
pub const RUN_TIME_ANNOTATION: &str = "gpuslice.io/expected-run-time";

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

fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == GATE))
}

/// A published device of a GpuPool.
struct Published {
    pool: String,
    device: FreeDevice,
    tainted: bool,
    software: bool,
}

/// Every gpuslice device published, by (ResourceSlice pool, device name).
fn published(
    slices: &Store<PublishedSlice>,
    gpu_nodes: &Store<GpuNode>,
    now: chrono::DateTime<chrono::Utc>,
) -> BTreeMap<(String, String), Published> {
    // When a window change next re-cuts each GPU (the operator's desired layout says; past a
    // staged switch, not known until the operator catches the spec up).
    let mut recut_at: BTreeMap<(String, i64), chrono::DateTime<chrono::Utc>> = BTreeMap::new();
    for node in gpu_nodes.state() {
        for gpu in node.spec.gpus.iter().map(|g| g.in_force(now)) {
            if let Some(at) = gpu.recut_at.as_ref().and_then(gpuslice_api::chrono_of) {
                recut_at.insert((node.name_any(), i64::from(gpu.index)), at);
            }
        }
    }
    let mut software_on_gpu: BTreeMap<(String, i64), u32> = BTreeMap::new();
    let mut out: BTreeMap<(String, String), (Published, i64)> = BTreeMap::new();
    for slice in slices.state() {
        let node = slice.spec.node_name.clone().unwrap_or_default();
        for device in &slice.spec.devices {
            let gpu = device.gpu_index().unwrap_or(-1);
            let software = device.is_software();
            if software {
                *software_on_gpu.entry((node.clone(), gpu)).or_default() += 1;
            }
            let Some(pool) = device.pool().map(str::to_string) else {
                continue;
            };
            out.insert(
                (slice.spec.pool.name.clone(), device.name.clone()),
                (
                    Published {
                        pool,
                        device: FreeDevice {
                            node: node.clone(),
                            gpu: u32::try_from(gpu).unwrap_or(u32::MAX),
                            device: device.name.clone(),
                            memory_bytes: device.memory_bytes(),
                            compute: u32::try_from(device.compute()).unwrap_or(0),
                            slices_on_gpu: 0,
                            recut_at: recut_at.get(&(node.clone(), gpu)).copied(),
                        },
                        tainted: device.is_tainted(),
                        software,
                    },
                    gpu,
                ),
            );
        }
    }
    out.into_iter()
        .map(|(key, (mut p, gpu))| {
            p.device.slices_on_gpu = software_on_gpu
                .get(&(p.device.node.clone(), gpu))
                .copied()
                .unwrap_or(0);
            (key, p)
        })
        .collect()
}

/// The free devices of each pool: untainted, not allocated.
fn free_devices(
    devices: &BTreeMap<(String, String), Published>,
    allocated: &BTreeSet<(String, String)>,
) -> BTreeMap<String, Vec<FreeDevice>> {
    let mut out: BTreeMap<String, Vec<FreeDevice>> = BTreeMap::new();
    for (key, p) in devices {
        if !p.tainted && !allocated.contains(key) {
            out.entry(p.pool.clone())
                .or_default()
                .push(p.device.clone());
        }
    }
    out
}

/// Devices by (ResourceSlice pool, device name).
type DeviceKeys = BTreeSet<(String, String)>;
/// Slices held per (GpuPool, namespace).
type Holdings = BTreeMap<(String, String), u32>;

/// A slice a ResourceClaim holds.
struct Held {
    /// `namespace/name` of the claim.
    claim: String,
    namespace: String,
    pool: String,
    device: FreeDevice,
    tainted: bool,
    /// The policy of its DeviceClass (`<policy>.gpuslice.io`).
    policy: Option<String>,
    created: Option<chrono::DateTime<chrono::Utc>>,
}

/// Each allocated gpuslice device, how many each namespace holds per GpuPool, and who holds
/// what.
fn allocations(
    devices: &BTreeMap<(String, String), Published>,
    claims: &Store<ResourceClaim>,
) -> (DeviceKeys, Holdings, Vec<Held>) {
    let mut taken = BTreeSet::new();
    let mut holding: BTreeMap<(String, String), u32> = BTreeMap::new();
    let mut held = Vec::new();
    for claim in claims.state() {
        let namespace = claim.namespace().unwrap_or_default();
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        for r in results
            .into_iter()
            .flatten()
            .filter(|r| r.driver == dra::DRIVER)
        {
            let key = (r.pool.clone(), r.device.clone());
            if let Some(p) = devices.get(&key) {
                *holding
                    .entry((p.pool.clone(), namespace.clone()))
                    .or_default() += 1;
                let class = claim
                    .spec
                    .devices
                    .as_ref()
                    .and_then(|d| d.requests.as_ref())
                    .into_iter()
                    .flatten()
                    .find(|q| q.name == r.request || r.request.starts_with(&format!("{}/", q.name)))
                    .and_then(|q| q.exactly.as_ref())
                    .map(|e| e.device_class_name.clone());
                held.push(Held {
                    claim: format!("{namespace}/{}", claim.name_any()),
                    namespace: namespace.clone(),
                    pool: p.pool.clone(),
                    device: p.device.clone(),
                    tainted: p.tainted,
                    policy: class.and_then(|c| c.strip_suffix(".gpuslice.io").map(str::to_string)),
                    created: claim
                        .creation_timestamp()
                        .and_then(|t| gpuslice_api::chrono_of(&t)),
                });
            }
            taken.insert(key);
        }
    }
    (taken, holding, held)
}

/// The node an admitted pod was sent to (the node affinity the queue set), while it is not
/// bound yet.
fn admitted_to(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    if spec.node_name.is_some() || gated(pod) {
        return None;
    }
    spec.affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_fields.iter().flatten())
        .find(|f| f.key == "metadata.name" && f.operator == "In")
        .and_then(|f| f.values.as_ref()?.first().cloned())
}

/// The queue's metrics (under `gpuslice_queue_`).
#[derive(Clone)]
pub struct QueueMetrics {
    fragmentation: Family<PoolLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    waiting: Family<PoolNamespace, Gauge>,
    wait: Family<PoolNamespace, Histogram>,
    preemptions: Family<PreemptionLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolNamespace {
    pool: String,
    namespace: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PreemptionLabel {
    pool: String,
    /// `priority` or `fair_share`.
    reason: String,
}

impl QueueMetrics {
    pub fn register(registry: &mut Registry) -> QueueMetrics {
        let m = QueueMetrics {
            fragmentation: Family::default(),
            waiting: Family::default(),
            wait: Family::new_with_constructor(|| {
                Histogram::new([1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0])
            }),
            preemptions: Family::default(),
        };
        registry.sub_registry_with_prefix("gpuslice").register(
            "pool_fragmentation_percent",
            "Free slice memory of a pool that its policies cannot use, weighted by their demand (allocated and waiting pods): the FGD paper's expected fragment on the pool's slices",
            m.fragmentation.clone(),
        );
        let r = registry.sub_registry_with_prefix("gpuslice_queue");
        r.register(
            "waiting_pods",
            "Pods waiting at the gate gpuslice.io/queue, per pool and namespace",
            m.waiting.clone(),
        );
        r.register_with_unit(
            "wait",
            "Time from a pod's creation to its admission by the queue",
            Unit::Seconds,
            m.wait.clone(),
        );
        r.register(
            "preemptions",
            "Slices the queue took back for waiting pods, by why",
            m.preemptions.clone(),
        );
        m
    }
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

/// How often each pool's `status.fairShare` is written: a new leader carries on from it, so at
/// most this much of accounting is lost.
const FAIR_SHARE_EVERY_SECONDS: i64 = 10;

/// The use each pool's status records, decayed to `wall` (a new leader starts from it).
fn recorded_usage(
    pools: &[Arc<GpuPool>],
    wall: chrono::DateTime<chrono::Utc>,
) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for pool in pools {
        let Some(recorded) = pool.status.as_ref().and_then(|s| s.fair_share.as_ref()) else {
            continue;
        };
        let half_life = pool
            .spec
            .scheduling
            .as_ref()
            .and_then(|s| s.half_life)
            .map_or(DEFAULT_HALF_LIFE_SECONDS, |d| {
                std::time::Duration::from(d).as_secs_f64()
            });
        let age = gpuslice_api::chrono_of(&recorded.at).map_or(0.0, |at| {
            (wall - at).num_milliseconds().max(0) as f64 / 1000.0
        });
        for n in &recorded.namespaces {
            out.insert(
                (pool.name_any(), n.namespace.clone()),
                queue::decay(n.slice_seconds.max(0) as f64, 0, age, half_life),
            );
        }
    }
    out
}

/// A preemption its node's agent leaves unread this many times the operator's `--agent-timeout`
/// (after which the waiting pod and the pool are told) is given up.
const GIVE_UP_AFTER: u32 = 5;
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
struct FollowUp {
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
    fn keep_only(&mut self, asked: &BTreeSet<String>, wall: chrono::DateTime<chrono::Utc>) {
        self.asked.retain(|c, _| asked.contains(c));
        self.reported.retain(|c| asked.contains(c));
        self.given_up.retain(|_, until| *until > wall);
    }
}

/// A duration as `kubectl` and the CRDs write them (`1m0s`).
fn humantime(d: Duration) -> String {
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
        let pools: Vec<Arc<GpuPool>> = caches.pools.state();
        let policies: Vec<Arc<GpuSlicePolicy>> = caches.policies.state();
        let pool_list: Vec<GpuPool> = pools.iter().map(|p| (**p).clone()).collect();
        let devices = published(&caches.slices, &caches.gpu_nodes, now);
        let (allocated, holding, held) = allocations(&devices, &caches.claims);
        let gpu_nodes = caches.gpu_nodes.state();
        let classes: BTreeMap<String, i64> = caches
            .priority_classes
            .state()
            .iter()
            .map(|c| (c.name_any(), i64::from(c.value.unwrap_or(0))))
            .collect();
        // Preemptions under way, and what the agents say of each claim.
        let mut under_way: BTreeMap<String, (String, String)> = BTreeMap::new();
        let mut checkpoints: BTreeMap<String, chrono::DateTime<chrono::Utc>> = BTreeMap::new();
        let mut draining: BTreeMap<String, String> = BTreeMap::new();
        let mut plan = Plan::default();
        // Whether each node's agent has read its GpuNode's current spec (its Ready condition's
        // observedGeneration).
        let read: BTreeMap<String, bool> = gpu_nodes
            .iter()
            .map(|node| {
                let seen = node
                    .status
                    .iter()
                    .flat_map(|s| &s.conditions)
                    .find(|c| c.type_ == "Ready")
                    .and_then(|c| c.observed_generation);
                (
                    node.name_any(),
                    seen.is_some() && seen >= node.metadata.generation,
                )
            })
            .collect();
        let mut asked_now = BTreeSet::new();
        for node in &gpu_nodes {
            if !node.spec.preemptions.is_empty() || !node.spec.compacting.is_empty() {
                plan.preemptions.insert(node.name_any(), Vec::new());
                plan.compacting.insert(node.name_any(), Vec::new());
            }
            for p in &node.spec.preemptions {
                under_way.insert(
                    p.resource_claim.clone(),
                    (p.for_pod.clone(), p.reason.clone()),
                );
            }
            for c in node.status.iter().flat_map(|s| &s.claims) {
                let Some(claim) = &c.resource_claim else {
                    continue;
                };
                if let Some(t) = c.last_checkpoint.as_ref().and_then(gpuslice_api::chrono_of) {
                    checkpoints.insert(claim.clone(), t);
                }
                if let Some(d) = &c.draining {
                    draining.insert(claim.clone(), d.clone());
                }
            }
        }
        if self.last.is_none() {
            self.usage = recorded_usage(&pools, wall);
        }
        let mut free = free_devices(&devices, &allocated);
        // Nothing is admitted onto GPUs that compaction is emptying.
        for pool in &pools {
            let freeing = self.rounds.freeing(pool);
            if let Some(devices) = free.get_mut(&pool.name_any()) {
                devices.retain(|d| !freeing.contains(&(d.node.clone(), d.gpu)));
            }
        }
        let elapsed = self
            .last
            .map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0);
        self.last = Some(now);
        let pods = caches.pods.state();
        // Admitted in an earlier pass and not bound yet: their devices are spoken for.
        for pod in &pods {
            let (Some(node), Some(policy)) =
                (admitted_to(pod), pod.labels().get(POLICY_LABEL).cloned())
            else {
                continue;
            };
            let Some(p) = policies.iter().find(|p| p.name_any() == policy) else {
                continue;
            };
            let need = Need {
                memory_bytes: crate::classes::memory_limit(p, &pool_list),
                compute: p.spec.compute.as_ref().map_or(0, |c| c.limit),
            };
            if let Some(devices) = free.get_mut(&p.spec.pool)
                && let Some(i) = devices.iter().position(|d| d.node == node && need.fits(d))
            {
                devices.remove(i);
            }
        }
        for pool in &pools {
            let pool_name = pool.name_any();
            let scheduling = pool.spec.scheduling.clone().unwrap_or_default();
            let half_life = scheduling.half_life.map_or(DEFAULT_HALF_LIFE_SECONDS, |d| {
                std::time::Duration::from(d).as_secs_f64()
            });
            let needs: BTreeMap<String, Need> = policies
                .iter()
                .filter(|p| p.spec.pool == pool_name)
                .map(|p| {
                    (
                        p.name_any(),
                        Need {
                            memory_bytes: crate::classes::memory_limit(p, &pool_list),
                            compute: p.spec.compute.as_ref().map_or(0, |c| c.limit),
                        },
                    )
                })
                .collect();
            let mut unreadable: Vec<(String, String)> = Vec::new();
            let waiting: Vec<Waiting> = pods
                .iter()
                .filter(|p| gated(p))
                .filter_map(|p| {
                    let policy = p.labels().get(POLICY_LABEL)?.clone();
                    let spec = policies.iter().find(|x| x.name_any() == policy);
                    // A pod whose policy is unknown waits in no pool's queue but the first's,
                    // so that it is told why.
                    if spec.map_or(pool_name != pools[0].name_any(), |s| {
                        s.spec.pool != pool_name
                    }) {
                        return None;
                    }
                    let key = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
                    let runs_until = match expected_run_time(p) {
                        Ok(run_time) => run_time.map(|d| now + d),
                        Err(message) => {
                            // It waits, out of line, until its annotation is fixed.
                            unreadable.push((key, message));
                            return None;
                        }
                    };
                    Some(Waiting {
                        namespace: p.namespace().unwrap_or_default(),
                        name: p.name_any(),
                        priority: spec.map_or(0, |s| {
                            queue::priority_in_force(pool, &policy, &s.spec.priority, now, &classes)
                        }),
                        policy,
                        created: p
                            .creation_timestamp()
                            .and_then(|t| gpuslice_api::chrono_of(&t))
                            .unwrap_or(now),
                        runs_until,
                    })
                })
                .collect();
            for (pod, message) in unreadable.drain(..) {
                plan.tell
                    .push((pod, "InvalidExpectedRunTime".into(), message));
            }
            let namespaces: BTreeSet<String> = waiting
                .iter()
                .map(|w| w.namespace.clone())
                .chain(
                    holding
                        .keys()
                        .filter(|(p, _)| *p == pool_name)
                        .map(|(_, ns)| ns.clone()),
                )
                .chain(scheduling.weights.keys().cloned())
                // Past use keeps decaying while a namespace neither holds nor waits.
                .chain(
                    self.usage
                        .keys()
                        .filter(|(p, _)| *p == pool_name)
                        .map(|(_, ns)| ns.clone()),
                )
                .collect();
            let mut shares = BTreeMap::new();
            for ns in namespaces {
                let held = holding
                    .get(&(pool_name.clone(), ns.clone()))
                    .copied()
                    .unwrap_or(0);
                let usage = self
                    .usage
                    .entry((pool_name.clone(), ns.clone()))
                    .or_insert(0.0);
                *usage = queue::decay(*usage, held, elapsed, half_life);
                shares.insert(
                    ns.clone(),
                    Share {
                        weight: f64::from(scheduling.weights.get(&ns).copied().unwrap_or(1)),
                        holding: held,
                        usage: *usage,
                    },
                );
            }
            // Forgotten once it has decayed below a slice-second and the namespace is idle.
            self.usage.retain(|(p, ns), u| {
                *p != pool_name
                    || *u >= 1.0
                    || shares.get(ns).is_some_and(|s: &Share| s.holding > 0)
                    || scheduling.weights.contains_key(ns)
                    || waiting.iter().any(|w| w.namespace == *ns)
            });
            let recorded = pool
                .status
                .as_ref()
                .and_then(|s| s.fair_share.as_ref())
                .and_then(|f| gpuslice_api::chrono_of(&f.at));
            let stale =
                recorded.is_none_or(|at| (wall - at).num_seconds() >= FAIR_SHARE_EVERY_SECONDS);
            if stale
                && !shares.is_empty()
                && let Some(at) = gpuslice_api::time_of(wall)
            {
                plan.fair_share.insert(
                    pool_name.clone(),
                    FairShareStatus {
                        at,
                        namespaces: shares
                            .iter()
                            .map(|(ns, share)| NamespaceUsage {
                                namespace: ns.clone(),
                                slice_seconds: share.usage.round() as i64,
                                holding: share.holding,
                                weight: share.weight as u32,
                            })
                            .collect(),
                    },
                );
            }
            // Demand per policy: the slices it holds and its pods waiting (each policy counts
            // once when the pool has no demand yet).
            let mix: Vec<(Need, f64)> = needs
                .iter()
                .map(|(policy, need)| {
                    let demand = held
                        .iter()
                        .filter(|h| h.pool == pool_name && h.policy.as_ref() == Some(policy))
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
            plan.fragmentation.insert(
                pool_name.clone(),
                queue::fragmentation(free.get(&pool_name).map_or(&[], Vec::as_slice), &mix),
            );
            if waiting.is_empty() {
                continue;
            }
            let order = queue::order(scheduling.policy, &waiting, &shares);
            let devices = free.remove(&pool_name).unwrap_or_default();
            let Decision { admit, wait } =
                queue::decide(&waiting, &order, &needs, &devices, &mut self.placer);
            for w in &waiting {
                *plan
                    .waiting
                    .entry((pool_name.clone(), w.namespace.clone()))
                    .or_default() += 1;
            }
            for (pod, _) in &admit {
                plan.admitted_pool.insert(pod.clone(), pool_name.clone());
                if let Some((pool, namespace)) = waiting
                    .iter()
                    .find(|w| w.key() == *pod)
                    .map(|w| (pool_name.clone(), w.namespace.clone()))
                    && let Some(n) = plan.waiting.get_mut(&(pool, namespace))
                {
                    *n -= 1;
                }
            }
            plan.admit.extend(admit);
            // Pods no free slice fits may take one back from running pods.
            let preempted = if scheduling.preemption {
                let unfit: Vec<&Waiting> = wait
                    .iter()
                    .filter(|(_, _, r)| *r != Reason::UnknownPolicy)
                    .filter_map(|(k, _, _)| waiting.iter().find(|w| w.key() == *k))
                    .collect();
                let running: Vec<Running> = held
                    .iter()
                    .filter(|h| h.pool == pool_name && !h.tainted)
                    .filter(|h| !self.follow_up.resting(&h.device.node, wall))
                    .map(|h| {
                        let policy = h
                            .policy
                            .as_ref()
                            .and_then(|p| policies.iter().find(|x| x.name_any() == *p));
                        let since = checkpoints.get(&h.claim).copied().or(h.created);
                        Running {
                            claim: h.claim.clone(),
                            namespace: h.namespace.clone(),
                            device: h.device.clone(),
                            priority: policy.map_or(0, |p| {
                                queue::priority_in_force(
                                    pool,
                                    &p.name_any(),
                                    &p.spec.priority,
                                    now,
                                    &classes,
                                )
                            }),
                            // A claim whose policy is unknown is no victim.
                            preemptible: policy.is_some_and(|p| p.spec.preemptible),
                            loss_seconds: since.map_or(f64::MAX, |t| {
                                (wall - t).num_milliseconds().max(0) as f64 / 1000.0
                            }),
                            taken_for: under_way.get(&h.claim).cloned(),
                        }
                    })
                    .collect();
                tracing::debug!(?running, "candidates for preemption");
                queue::preempt(scheduling.policy, &unfit, &needs, &running, &shares)
            } else {
                Vec::new()
            };
            // Preemptions the node's agent leaves unread are reported, then given up.
            let mut overdue = BTreeSet::new();
            let mut preempted = preempted;
            preempted.retain(|p| {
                let read = read.get(&p.node).copied().unwrap_or(false);
                match self.follow_up.judge(&p.claim, &p.node, read, wall, agent_timeout) {
                    Standing::OnTime => true,
                    Standing::Overdue { first } => {
                        if first {
                            plan.stalled.push((
                                pool_name.clone(),
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
                        plan.stalled.push((
                            pool_name.clone(),
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
            asked_now.extend(preempted.iter().map(|p| p.claim.clone()));
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
            let total = wait.len();
            for (pod, place, reason) in wait {
                let taking = preempted.iter().find(|p| p.for_pod == pod);
                let policy = waiting
                    .iter()
                    .find(|w| w.key() == pod)
                    .map(|w| w.policy.clone())
                    .unwrap_or_default();
                let (reason, why) = match (reason, taking) {
                    (Reason::NoSliceFits | Reason::WindowChangeAhead, Some(p)) => (
                        "Preempting",
                        format!(
                            "taking back the slice of ResourceClaim {} ({}): {}",
                            p.claim,
                            p.reason,
                            match draining.get(&p.claim) {
                                Some(d) => d.clone(),
                                None if overdue.contains(&p.claim) => format!(
                                    "asked the agent of node {}, which has not read it for over {} (is it running?); given up after {}",
                                    p.node,
                                    humantime(agent_timeout),
                                    humantime(agent_timeout * GIVE_UP_AFTER)
                                ),
                                None => "asked its node's agent".to_string(),
                            }
                        ),
                    ),
                    (Reason::NoSliceFits, None) => (
                        "NoSliceFits",
                        format!(
                            "no free slice of pool {pool_name} fits policy {policy}{}",
                            // Beyond the exact places it would rewrite every pod at each
                            // admission.
                            if place <= EXACT_PLACES {
                                standing(scheduling.policy, &shares, &waiting, pod_namespace(&pod))
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
                    (Reason::UnknownPolicy, _) => (
                        "UnknownPolicy",
                        format!(
                            "GpuSlicePolicy {policy} does not exist: create it, or change the pod's label {POLICY_LABEL}"
                        ),
                    ),
                };
                let message = if place <= EXACT_PLACES {
                    format!(
                        "{} of {total} waiting in the queue of pool {pool_name}: {why}",
                        ordinal(place)
                    )
                } else {
                    format!(
                        "more than {EXACT_PLACES} ahead in the queue of pool {pool_name}: {why}"
                    )
                };
                plan.tell.push((pod, reason.to_string(), message));
            }
        }
        self.compact(
            &mut plan, &pools, &policies, &pool_list, &devices, &allocated, &held, &under_way,
            &pods, now,
        );
        self.follow_up.keep_only(&asked_now, wall);
        plan.tell.retain(|(pod, reason, message)| {
            self.told.get(pod) != Some(&(reason.clone(), message.clone()))
        });
        plan
    }
}

impl Queue {
    /// Compaction rounds (`crate::compaction`): the moves as preemptions for no pod, the GPUs
    /// being emptied, the rounds to record.
    #[allow(clippy::too_many_arguments)]
    fn compact(
        &mut self,
        plan: &mut Plan,
        pools: &[Arc<GpuPool>],
        policies: &[Arc<GpuSlicePolicy>],
        pool_list: &[GpuPool],
        devices: &BTreeMap<(String, String), Published>,
        allocated: &BTreeSet<(String, String)>,
        held: &[Held],
        under_way: &BTreeMap<String, (String, String)>,
        pods: &[Arc<Pod>],
        now: chrono::DateTime<chrono::Utc>,
    ) {
        use crate::compaction::{Holder, Slice};
        let claims: BTreeSet<String> = held.iter().map(|h| h.claim.clone()).collect();
        let holder_of: BTreeMap<(&str, &str), &Held> = held
            .iter()
            .map(|h| ((h.device.node.as_str(), h.device.device.as_str()), h))
            .collect();
        let pool_of_policy = |policy: &str| {
            policies
                .iter()
                .find(|p| p.name_any() == policy)
                .map(|p| p.spec.pool.clone())
        };
        for pool in pools {
            let name = pool.name_any();
            if !pool.spec.compaction.as_ref().is_some_and(|c| c.enabled) {
                continue;
            }
            let slices = || {
                devices
                    .iter()
                    .filter(|(_, p)| p.pool == name && p.software)
                    .map(|(key, p)| {
                        let holder = holder_of
                            .get(&(p.device.node.as_str(), p.device.device.as_str()))
                            .map(|h| {
                                let policy = h
                                    .policy
                                    .as_ref()
                                    .and_then(|x| policies.iter().find(|q| q.name_any() == *x));
                                Holder {
                                    claim: h.claim.clone(),
                                    size: policy.map_or(p.device.memory_bytes, |q| {
                                        crate::classes::memory_limit(q, pool_list)
                                    }),
                                    movable: policy.is_some_and(|q| {
                                        q.spec.preemptible
                                            && (q.spec.checkpoint_policy.is_some()
                                                || pool.spec.checkpoint_policy.is_some())
                                    }) && !h.tainted
                                        && !under_way.contains_key(&h.claim),
                                }
                            });
                        Slice {
                            node: p.device.node.clone(),
                            gpu: p.device.gpu,
                            memory_bytes: p.device.memory_bytes,
                            free: !p.tainted && !allocated.contains(key),
                            holder,
                        }
                    })
                    .collect()
            };
            // Quiet: nothing of the pool admitted this pass or admitted and not bound yet.
            let quiet = !plan.admitted_pool.values().any(|p| *p == name)
                && !pods.iter().any(|p| {
                    admitted_to(p).is_some()
                        && p.labels()
                            .get(POLICY_LABEL)
                            .and_then(|policy| pool_of_policy(policy))
                            .is_some_and(|p| p == name)
                });
            let step = self.rounds.step(pool, slices, &claims, quiet, now);
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

/// Sends the admitted pod to `node` and lifts its gate.
async fn admit(client: &Client, pod: &Pod, node: &str) -> Result<(), kube::Error> {
    let mut node_affinity = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.clone())
        .unwrap_or_default();
    let only_there =
        serde_json::json!({"key": "metadata.name", "operator": "In", "values": [node]});
    let mut terms: Vec<serde_json::Value> = node_affinity
        .required_during_scheduling_ignored_during_execution
        .take()
        .map(|r| {
            r.node_selector_terms
                .into_iter()
                .map(|t| serde_json::to_value(t).unwrap_or_default())
                .collect()
        })
        .unwrap_or_default();
    if terms.is_empty() {
        terms.push(serde_json::json!({}));
    }
    // Every term must now also name the node: a narrowing the API server allows on a gated pod.
    for term in &mut terms {
        let fields = term.as_object_mut().map(|t| {
            t.entry("matchFields")
                .or_insert_with(|| serde_json::json!([]))
        });
        if let Some(serde_json::Value::Array(fields)) = fields {
            fields.push(only_there.clone());
        }
    }
    let patch = serde_json::json!({
        "spec": {
            "schedulingGates": [{"$patch": "delete", "name": GATE}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}},
        }
    });
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
    api.patch(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Strategic(&patch),
    )
    .await?;
    Ok(())
}

/// States the node's preemptions and the GPUs compaction empties there (all of them, under the
/// queue's own field manager).
async fn take_back(
    client: &Client,
    node: &str,
    preemptions: &[Preemption],
    compacting: &[u32],
) -> Result<(), kube::Error> {
    let body = gpuslice_runtime::apply_body(
        "GpuNode",
        node,
        "spec",
        &serde_json::json!({ "preemptions": preemptions, "compacting": compacting }),
    );
    Api::<GpuNode>::all(client.clone())
        .patch(
            node,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
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

/// Records the namespaces' use of a pool (its own field manager on the pool's status).
async fn record_fair_share(
    client: &Client,
    pool: &str,
    fair_share: &FairShareStatus,
) -> Result<(), kube::Error> {
    let body = gpuslice_runtime::apply_body(
        "GpuPool",
        pool,
        "status",
        &serde_json::json!({ "fairShare": fair_share }),
    );
    Api::<GpuPool>::all(client.clone())
        .patch_status(
            pool,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

/// Records a pool's compaction round (its own field manager on the pool's status).
async fn record_compaction(
    client: &Client,
    pool: &str,
    round: &gpuslice_api::CompactionStatus,
) -> Result<(), kube::Error> {
    let body = gpuslice_runtime::apply_body(
        "GpuPool",
        pool,
        "status",
        &serde_json::json!({ "compaction": round }),
    );
    Api::<GpuPool>::all(client.clone())
        .patch_status(
            pool,
            &PatchParams::apply(crate::compaction::MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

async fn tell(
    client: &Client,
    namespace: &str,
    name: &str,
    reason: &str,
    message: &str,
) -> Result<(), kube::Error> {
    let patch = serde_json::json!({
        "status": {"conditions": [{
            "type": CONDITION, "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now()
            ),
        }]}
    });
    Api::<Pod>::namespaced(client.clone(), namespace)
        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await?;
    Ok(())
}

/// Runs the queue until the process ends; only the leader writes.
pub async fn run(
    client: Client,
    clock: Clock,
    leadership: Leadership,
    caches: Caches,
    changed: Arc<Notify>,
    metrics: QueueMetrics,
    agent_timeout: Duration,
) {
    let mut queue = Queue::default();
    let recorder = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    loop {
        if leadership.is_leader() {
            let wall = chrono::Utc::now();
            let plan = queue.plan(&caches, clock.now(), wall, agent_timeout);
            metrics.fragmentation.clear();
            for (pool, percent) in &plan.fragmentation {
                metrics
                    .fragmentation
                    .get_or_create(&PoolLabel { pool: pool.clone() })
                    .set(*percent);
            }
            metrics.waiting.clear();
            for ((pool, namespace), n) in &plan.waiting {
                metrics
                    .waiting
                    .get_or_create(&PoolNamespace {
                        pool: pool.clone(),
                        namespace: namespace.clone(),
                    })
                    .set(*n);
            }
            let find = |key: &str| {
                let (namespace, name) = key.split_once('/')?;
                caches.pods.get(&ObjectRef::new(name).within(namespace))
            };
            for (key, node) in &plan.admit {
                let Some(pod) = find(key) else { continue };
                match admit(&client, &pod, node).await {
                    Ok(()) => {
                        tracing::info!("admitted pod {key} onto node {node}");
                        queue.told.remove(key);
                        let created = pod
                            .creation_timestamp()
                            .and_then(|t| gpuslice_api::chrono_of(&t))
                            .unwrap_or(wall);
                        metrics
                            .wait
                            .get_or_create(&PoolNamespace {
                                pool: plan.admitted_pool.get(key).cloned().unwrap_or_default(),
                                namespace: pod.namespace().unwrap_or_default(),
                            })
                            .observe((wall - created).num_milliseconds().max(0) as f64 / 1000.0);
                    }
                    Err(e) => tracing::warn!("pod {key}: admitting it: {e}"),
                }
            }
            for (node, preemptions) in &plan.preemptions {
                let current = caches.gpu_nodes.get(&ObjectRef::new(node));
                let (before, compacting_before) = current
                    .map(|c| (c.spec.preemptions.clone(), c.spec.compacting.clone()))
                    .unwrap_or_default();
                let mut compacting = plan.compacting.get(node).cloned().unwrap_or_default();
                compacting.sort_unstable();
                compacting.dedup();
                if before == *preemptions && compacting_before == compacting {
                    continue;
                }
                match take_back(&client, node, preemptions, &compacting).await {
                    Ok(()) => {
                        for p in preemptions
                            .iter()
                            .filter(|p| !before.contains(p) && !p.for_pod.is_empty())
                        {
                            let pool = find(&p.for_pod)
                                .and_then(|x| x.labels().get(POLICY_LABEL).cloned())
                                .and_then(|policy| {
                                    caches
                                        .policies
                                        .get(&ObjectRef::new(&policy))
                                        .map(|x| x.spec.pool.clone())
                                })
                                .unwrap_or_default();
                            let reason = if p.reason.starts_with("fair share") {
                                "fair_share"
                            } else {
                                "priority"
                            };
                            metrics
                                .preemptions
                                .get_or_create(&PreemptionLabel {
                                    pool,
                                    reason: reason.into(),
                                })
                                .inc();
                            tracing::info!(
                                "taking back the slice of {} on node {node} for pod {}: {}",
                                p.resource_claim,
                                p.for_pod,
                                p.reason
                            );
                        }
                    }
                    Err(e) => tracing::warn!("GpuNode/{node}: writing preemptions: {e}"),
                }
            }
            for (pool, round) in &plan.compaction {
                if let Err(e) = record_compaction(&client, pool, round).await {
                    tracing::warn!("GpuPool/{pool}: recording its compaction: {e}");
                }
            }
            for (pool, fair_share) in &plan.fair_share {
                if let Err(e) = record_fair_share(&client, pool, fair_share).await {
                    tracing::warn!("GpuPool/{pool}: recording namespaces' use: {e}");
                }
            }
            for (pool, reason, note) in &plan.stalled {
                tracing::warn!("GpuPool/{pool}: {note}");
                let Some(object) = caches.pools.get(&ObjectRef::new(pool)) else {
                    continue;
                };
                let event = kube::runtime::events::Event {
                    type_: kube::runtime::events::EventType::Warning,
                    reason: (*reason).into(),
                    note: Some(note.clone()),
                    action: "Preempt".into(),
                    secondary: None,
                };
                if let Err(e) = recorder
                    .publish(&event, &kube::Resource::object_ref(&*object, &()))
                    .await
                {
                    tracing::warn!("GpuPool/{pool}: recording an Event: {e}");
                }
            }
            for (key, reason, message) in plan.tell {
                let Some((namespace, name)) = key.split_once('/') else {
                    continue;
                };
                match tell(&client, namespace, name, &reason, &message).await {
                    Ok(()) => {
                        queue.told.insert(key, (reason, message));
                    }
                    Err(e) => tracing::debug!("pod {key}: its queue condition: {e}"),
                }
            }
            let waiting: BTreeSet<String> = caches
                .pods
                .state()
                .iter()
                .filter(|p| gated(p))
                .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
                .collect();
            queue.told.retain(|k, _| waiting.contains(k));
        }
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(Duration::from_millis(100)).await,
            _ = tokio::time::sleep(PASS_EVERY) => {}
        }
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
