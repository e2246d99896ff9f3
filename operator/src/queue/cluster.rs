//! What one pass of the queue reads from the caches: the devices published and allocated, who
//! holds what, the agents' word on preemptions, and the pods admitted but not bound yet.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpuslice_api::{GpuNode, GpuPool, GpuSlicePolicy, Scheduling, dra};
use gpuslice_planning::placement::WHOLE;
use gpuslice_planning::queue::{FreeDevice, Need, Room};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt as _;
use kube::runtime::reflector::Store;

use super::{Caches, gated};
use crate::published::PublishedSlice;

/// A published device of a GpuPool.
pub(super) struct Published {
    pub(super) pool: String,
    pub(super) device: FreeDevice,
    pub(super) tainted: bool,
    pub(super) software: bool,
    pub(super) mig: bool,
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
    // GPUs the elastic set re-cuts shortly: nothing new is admitted onto them (their agent
    // taints their devices too, but the queue must not race it).
    let mut reshaping: BTreeSet<(String, i64)> = BTreeSet::new();
    for node in gpu_nodes.state() {
        for gpu in node.spec.gpus.iter().map(|g| g.in_force(now)) {
            let key = (node.name_any(), i64::from(gpu.index));
            if gpu
                .next
                .as_ref()
                .is_some_and(|n| n.assigned.shape.is_some())
            {
                reshaping.insert(key.clone());
            }
            if let Some(at) = gpu.recut_at.as_ref().and_then(gpuslice_api::chrono_of) {
                recut_at.insert(key, at);
            }
        }
    }
    // Each GPU's memory, for the share of it a MIG instance is.
    let mut gpu_memory: BTreeMap<(String, i64), u64> = BTreeMap::new();
    for node in gpu_nodes.state() {
        for gpu in node
            .status
            .iter()
            .flat_map(|s| s.inventory.iter())
            .flat_map(|i| i.gpus.iter())
        {
            let memory = gpu
                .memory
                .as_ref()
                .and_then(|m| gpuslice_api::bytes_of(&m.0).ok())
                .or_else(|| {
                    gpuslice_planning::catalog::model(&gpu.model)
                        .ok()
                        .map(|m| m.memory_bytes())
                });
            if let Some(memory) = memory {
                gpu_memory.insert((node.name_any(), i64::from(gpu.index)), memory);
            }
        }
    }
    // Distinct devices: a republished ResourceSlice may list a device twice for a while.
    let mut software_on_gpu: BTreeMap<(String, i64), BTreeSet<String>> = BTreeMap::new();
    let mut out: BTreeMap<(String, String), (Published, i64)> = BTreeMap::new();
    for slice in slices.state() {
        let node = slice.spec.node_name.clone().unwrap_or_default();
        for device in &slice.spec.devices {
            let gpu = device.gpu_index().unwrap_or(-1);
            let software = device.is_software();
            if software {
                software_on_gpu
                    .entry((node.clone(), gpu))
                    .or_default()
                    .insert(device.name.clone());
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
                            // A whole GPU; a MIG instance by its memory (below, with a
                            // software slice's).
                            share: WHOLE,
                            recut_at: recut_at.get(&(node.clone(), gpu)).copied(),
                            nvlink_domain: device.nvlink_domain().map(str::to_string),
                        },
                        tainted: device.is_tainted() || reshaping.contains(&(node.clone(), gpu)),
                        software,
                        mig: device.is_mig(),
                    },
                    gpu,
                ),
            );
        }
    }
    out.into_iter()
        .map(|(key, (mut p, gpu))| {
            let at = (p.device.node.clone(), gpu);
            if p.software {
                let slices = software_on_gpu.get(&at).map_or(1, BTreeSet::len).max(1);
                p.device.share = WHOLE / u32::try_from(slices).unwrap_or(WHOLE);
            } else if p.mig
                && let Some(&memory) = gpu_memory.get(&at).filter(|m| **m > 0)
            {
                let share =
                    u128::from(p.device.memory_bytes) * u128::from(WHOLE) / u128::from(memory);
                p.device.share = u32::try_from(share).unwrap_or(WHOLE).clamp(1, WHOLE);
            }
            (key, p)
        })
        .collect()
}

/// The free devices of each pool: untainted, not allocated.
pub(super) fn free_devices(
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
pub(super) struct Held {
    /// `namespace/name` of the claim.
    pub(super) claim: String,
    pub(super) namespace: String,
    pub(super) pool: String,
    pub(super) device: FreeDevice,
    pub(super) tainted: bool,
    /// The policy of its DeviceClass (`<policy>.gpuslice.io`).
    pub(super) policy: Option<String>,
    pub(super) created: Option<chrono::DateTime<chrono::Utc>>,
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
pub(super) fn admitted_to(pod: &Pod) -> Option<String> {
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

/// A preemption its node's agent leaves unread this many times the operator's `--agent-timeout`
/// (after which the waiting pod and the pool are told) is given up.
pub(super) const GIVE_UP_AFTER: u32 = 5;

/// Preemptions under way, and what the agents say of each claim (from the GpuNodes).
#[derive(Default)]
pub(super) struct Agents {
    /// Claim → (pod, reason) of the preemption under way that takes it back.
    pub(super) under_way: BTreeMap<String, (String, String)>,
    /// Claim → when its workload last wrote a checkpoint.
    pub(super) checkpoints: BTreeMap<String, chrono::DateTime<chrono::Utc>>,
    /// Claim → since when its workload has not computed (software slices its agent times).
    pub(super) idle_since: BTreeMap<String, chrono::DateTime<chrono::Utc>>,
    /// Claim → what its agent says of its drain.
    pub(super) draining: BTreeMap<String, String>,
    /// Whether each node's agent has read its GpuNode's current spec (its Ready condition's
    /// observedGeneration).
    pub(super) read: BTreeMap<String, bool>,
}

impl Agents {
    /// What the GpuNodes' specs and their agents' statuses say.
    fn of(gpu_nodes: &[Arc<GpuNode>]) -> Agents {
        let mut agents = Agents {
            read: gpu_nodes
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
                .collect(),
            ..Agents::default()
        };
        for node in gpu_nodes {
            for p in &node.spec.preemptions {
                agents.under_way.insert(
                    p.resource_claim.clone(),
                    (p.for_pod.clone(), p.reason.clone()),
                );
            }
            for c in node.status.iter().flat_map(|s| &s.claims) {
                let Some(claim) = &c.resource_claim else {
                    continue;
                };
                if let Some(t) = c.last_checkpoint.as_ref().and_then(gpuslice_api::chrono_of) {
                    agents.checkpoints.insert(claim.clone(), t);
                }
                if let Some(t) = c.idle_since.as_ref().and_then(gpuslice_api::chrono_of) {
                    agents.idle_since.insert(claim.clone(), t);
                }
                if let Some(d) = &c.draining {
                    agents.draining.insert(claim.clone(), d.clone());
                }
            }
        }
        agents
    }
}

/// One pass's read of the caches (no I/O), shared by each pool's planning and by compaction.
pub(super) struct Pass {
    pub(super) pools: Vec<Arc<GpuPool>>,
    pub(super) policies: Vec<Arc<GpuSlicePolicy>>,
    pub(super) checkpoints: Vec<Arc<gpuslice_api::CheckpointPolicy>>,
    /// The pools as values, as policies' memory limits are computed from.
    pub(super) pool_list: Vec<GpuPool>,
    /// Every gpuslice device published, by (ResourceSlice pool, device name).
    pub(super) devices: BTreeMap<(String, String), Published>,
    /// The devices allocated.
    pub(super) allocated: DeviceKeys,
    /// Slices held per (GpuPool, namespace).
    pub(super) holding: Holdings,
    /// Who holds which slice.
    pub(super) held: Vec<Held>,
    pub(super) gpu_nodes: Vec<Arc<GpuNode>>,
    /// PriorityClass name → its value.
    pub(super) classes: BTreeMap<String, i64>,
    pub(super) agents: Agents,
    /// The pods that name a policy.
    pub(super) pods: Vec<Arc<Pod>>,
    /// Each node's CPU and memory free ([`super::room`]).
    pub(super) rooms: BTreeMap<String, Room>,
    /// Per GpuPool, per node, the pool's GPUs there (free or not).
    pub(super) pool_gpus: BTreeMap<String, BTreeMap<String, u32>>,
    /// The PersistentVolumeClaims that exist (looked up, never copied: there may be many).
    pub(super) volume_claims: Store<k8s_openapi::api::core::v1::PersistentVolumeClaim>,
    /// The operator's clock (windows, usage).
    pub(super) now: chrono::DateTime<chrono::Utc>,
    /// The real time (the API server's and the agents' timestamps).
    pub(super) wall: chrono::DateTime<chrono::Utc>,
    /// The operator's `--agent-timeout`.
    pub(super) agent_timeout: std::time::Duration,
}

impl Pass {
    /// Reads the caches: pools, policies, devices published and allocated, GpuNodes,
    /// PriorityClasses, then the pods.
    pub(super) fn read(
        caches: &Caches,
        now: chrono::DateTime<chrono::Utc>,
        wall: chrono::DateTime<chrono::Utc>,
        agent_timeout: std::time::Duration,
    ) -> Pass {
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
        let agents = Agents::of(&gpu_nodes);
        let pods = caches.pods.state();
        let rooms = super::room::rooms(&caches.nodes, &caches.bound_pods, &pods);
        let mut gpus: BTreeMap<String, BTreeMap<String, BTreeSet<u32>>> = BTreeMap::new();
        for p in devices.values() {
            gpus.entry(p.pool.clone())
                .or_default()
                .entry(p.device.node.clone())
                .or_default()
                .insert(p.device.gpu);
        }
        let pool_gpus = gpus
            .into_iter()
            .map(|(pool, nodes)| {
                let counts = nodes
                    .into_iter()
                    .map(|(node, set)| (node, u32::try_from(set.len()).unwrap_or(u32::MAX)))
                    .collect();
                (pool, counts)
            })
            .collect();
        let volume_claims = caches.volume_claims.clone();
        Pass {
            pools,
            policies,
            checkpoints: caches.checkpoints.state(),
            pool_list,
            devices,
            allocated,
            holding,
            held,
            gpu_nodes,
            classes,
            agents,
            pods,
            rooms,
            pool_gpus,
            volume_claims,
            now,
            wall,
            agent_timeout,
        }
    }

    /// What a pod of `policy` needs of a slice.
    pub(super) fn need(&self, policy: &GpuSlicePolicy) -> Need {
        Need {
            memory_bytes: crate::classes::memory_limit(policy, &self.pool_list),
            compute: policy.spec.compute.as_ref().map_or(0, |c| c.limit),
        }
    }
}

/// One pool's planning this pass: the pass, the pool, and what each of its steps reads.
pub(super) struct PoolPass<'a> {
    pub(super) pass: &'a Pass,
    pub(super) pool: &'a GpuPool,
    pub(super) name: String,
    /// The pool's scheduling (the defaults where it declares none).
    pub(super) scheduling: Scheduling,
    /// Policy name → what a pod of it needs, for the pool's policies.
    pub(super) needs: BTreeMap<String, Need>,
}

impl<'a> PoolPass<'a> {
    /// The pool's planning this pass: its name, its scheduling, its policies' needs.
    pub(super) fn new(pass: &'a Pass, pool: &'a GpuPool) -> PoolPass<'a> {
        let name = pool.name_any();
        let scheduling = pool.spec.scheduling.clone().unwrap_or_default();
        let needs: BTreeMap<String, Need> = pass
            .policies
            .iter()
            .filter(|p| p.spec.pool == name)
            .map(|p| (p.name_any(), pass.need(p)))
            .collect();
        PoolPass {
            pass,
            pool,
            name,
            scheduling,
            needs,
        }
    }
}
