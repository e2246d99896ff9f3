//! The operator's local caches: what it watches, trimmed to what it reads, and the read of them
//! each pass starts from.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt as _;
use gpuslice_api::dra;
use gpuslice_api::{CheckpointPolicy, GpuNode, GpuPool, GpuSlicePolicy, NodeInventory};
use k8s_openapi::api::core::v1::{Namespace, Node, NodeStatus, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, Resource, ResourceExt as _};
use tokio::sync::Notify;

use crate::desired::{Allocated, NodeReport, Observed};
use crate::published::PublishedSlice;

use super::{MANAGER, OperatorError};

pub(super) fn cache<K>(api: Api<K>, config: watcher::Config, changed: Arc<Notify>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    trimmed_cache(api, config, changed, |_| {})
}

/// A cache that keeps only what the operator reads of each object (`trim` drops the rest): at
/// 1,000 nodes and 10,000 pods the whole objects are most of the operator's memory.
pub(super) fn trimmed_cache<K>(
    api: Api<K>,
    config: watcher::Config,
    changed: Arc<Notify>,
    trim: fn(&mut K),
) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, config)
        .default_backoff()
        // Nothing here reads managed fields; at 10,000 claims they are most of the memory.
        .modify(move |o| {
            o.managed_fields_mut().clear();
            trim(o);
        })
        .reflect(writer)
        .touched_objects();
    tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let Err(e) = event {
                tracing::warn!("watch error: {e}");
            }
            changed.notify_one();
        }
    });
    reader
}

/// Of a ResourceSlice's metadata the operator reads nothing but its name (the spec's fields it
/// reads are all [`PublishedSlice`] parses).
pub(super) fn trim_slice(slice: &mut PublishedSlice) {
    slice.metadata.labels = None;
    slice.metadata.annotations = None;
    slice.metadata.owner_references = None;
}

/// Of a ResourceClaim, the operator reads its requests' names and classes and which devices were
/// allocated for which request; the selectors, the allocation's node selector (one per claim),
/// the devices' status and the consumers are dropped.
pub(super) fn trim_claim(claim: &mut ResourceClaim) {
    claim.metadata.annotations = None;
    if let Some(devices) = &mut claim.spec.devices {
        devices.constraints = None;
        devices.config = None;
        for request in devices.requests.iter_mut().flatten() {
            if let Some(exactly) = &mut request.exactly {
                exactly.selectors = None;
            }
            for sub in request.first_available.iter_mut().flatten() {
                sub.selectors = None;
            }
        }
    }
    if let Some(status) = &mut claim.status {
        status.devices = None;
        status.reserved_for = None;
        if let Some(allocation) = &mut status.allocation {
            allocation.node_selector = None;
            if let Some(devices) = &mut allocation.devices {
                devices.config = None;
            }
        }
    }
}

/// The caches the controller reconciles from; a change of any wakes its loop.
pub(super) struct Stores {
    pub(super) pools: Store<GpuPool>,
    pub(super) checkpoints: Store<CheckpointPolicy>,
    pub(super) policies: Store<GpuSlicePolicy>,
    pub(super) nodes: Store<Node>,
    pub(super) gpu_nodes: Store<GpuNode>,
    pub(super) classes: Store<DeviceClass>,
    pub(super) slices: Store<PublishedSlice>,
    pub(super) claims: Store<ResourceClaim>,
    /// Only with admission parameters to write: which namespaces each policy's selector matches.
    pub(super) namespaces: Option<Store<Namespace>>,
}

impl Stores {
    /// Starts the watches (the Namespaces' only when `admission` parameters are written) and
    /// waits until every cache has filled.
    pub(super) async fn watch(
        client: &Client,
        admission: bool,
        changed: &Arc<Notify>,
    ) -> Result<Stores, OperatorError> {
        let all = watcher::Config::default;
        let pools = cache(Api::<GpuPool>::all(client.clone()), all(), changed.clone());
        let checkpoints = cache(
            Api::<CheckpointPolicy>::all(client.clone()),
            all(),
            changed.clone(),
        );
        let policies = cache(
            Api::<GpuSlicePolicy>::all(client.clone()),
            all(),
            changed.clone(),
        );
        // Of a Node, only its name, labels (which pools select it) and allocatable CPU and
        // memory (the queue's room on it) are read.
        let nodes = trimmed_cache(
            Api::<Node>::all(client.clone()),
            all(),
            changed.clone(),
            |n| {
                n.spec = None;
                n.metadata.annotations = None;
                let allocatable = n.status.take().and_then(|s| s.allocatable).map(|a| {
                    a.into_iter()
                        .filter(|(k, _)| k == "cpu" || k == "memory")
                        .collect()
                });
                n.status = allocatable.map(|allocatable| NodeStatus {
                    allocatable: Some(allocatable),
                    ..Default::default()
                });
            },
        );
        let gpu_nodes = cache(Api::<GpuNode>::all(client.clone()), all(), changed.clone());
        let classes = cache(
            Api::<DeviceClass>::all(client.clone()),
            all().labels(&format!("{}={MANAGER}", dra::MANAGED_BY_LABEL)),
            changed.clone(),
        );
        let slices = trimmed_cache(
            Api::<PublishedSlice>::all(client.clone()),
            all().fields(&format!("spec.driver={}", dra::DRIVER)),
            changed.clone(),
            trim_slice,
        );
        let claims = trimmed_cache(
            Api::<ResourceClaim>::all(client.clone()),
            all(),
            changed.clone(),
            trim_claim,
        );
        let namespaces = admission.then(|| {
            cache(
                Api::<Namespace>::all(client.clone()),
                all(),
                changed.clone(),
            )
        });
        if let Some(namespaces) = &namespaces {
            filled(namespaces, "Namespace").await?;
        }
        for (kind, ready) in [
            ("GpuPool", pools.wait_until_ready().await),
            ("CheckpointPolicy", checkpoints.wait_until_ready().await),
            ("GpuSlicePolicy", policies.wait_until_ready().await),
            ("Node", nodes.wait_until_ready().await),
            ("GpuNode", gpu_nodes.wait_until_ready().await),
            ("DeviceClass", classes.wait_until_ready().await),
            ("ResourceSlice", slices.wait_until_ready().await),
            ("ResourceClaim", claims.wait_until_ready().await),
        ] {
            ready.map_err(|e| OperatorError::Cache {
                kind,
                message: e.to_string(),
            })?;
        }
        Ok(Stores {
            pools,
            checkpoints,
            policies,
            nodes,
            gpu_nodes,
            classes,
            slices,
            claims,
            namespaces,
        })
    }
}

/// Watches the pods that name a policy (`queue_changed` and `changed` both notified of a change)
/// and waits until the cache has filled.
pub(super) async fn watch_pods(
    client: &Client,
    queue_changed: &Arc<Notify>,
    changed: &Arc<Notify>,
) -> Result<Store<Pod>, OperatorError> {
    let pods_changed = Arc::new(Notify::new());
    let pods = trimmed_cache(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels(crate::queue::POLICY_LABEL),
        pods_changed.clone(),
        crate::queue::trim_pod,
    );
    fan_out(pods_changed, [queue_changed.clone(), changed.clone()]);
    filled(&pods, "Pod").await?;
    Ok(pods)
}

/// Watches every pod bound to a node and not finished, for the CPU and memory it requests (the
/// queue's room on each node; it reads them each pass, so their changes wake nothing), and
/// waits until the cache has filled.
pub(super) async fn watch_bound_pods(client: &Client) -> Result<Store<Pod>, OperatorError> {
    let pods = trimmed_cache(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default()
            .fields("spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"),
        Arc::new(Notify::new()),
        crate::queue::trim_bound_pod,
    );
    filled(&pods, "Pod").await?;
    Ok(pods)
}

/// Wakes each of `to` whenever `from` is notified.
pub(super) fn fan_out<const N: usize>(from: Arc<Notify>, to: [Arc<Notify>; N]) {
    tokio::spawn(async move {
        loop {
            from.notified().await;
            for t in &to {
                t.notify_one();
            }
        }
    });
}

/// Waits until the cache of `kind` has filled.
pub(super) async fn filled<K>(store: &Store<K>, kind: &'static str) -> Result<(), OperatorError>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store
        .wait_until_ready()
        .await
        .map_err(|e| OperatorError::Cache {
            kind,
            message: e.to_string(),
        })
}

pub(super) fn observe(
    pools: &Store<GpuPool>,
    checkpoints: &Store<CheckpointPolicy>,
    nodes: &Store<Node>,
    gpu_nodes: &Store<GpuNode>,
) -> Observed {
    let mut pools: Vec<GpuPool> = pools.state().iter().map(|p| (**p).clone()).collect();
    pools.sort_by_key(|p| p.name_any());
    let mut reports = Vec::new();
    for node in nodes.state() {
        let name = node.name_any();
        let Some(gpu_node) = gpu_nodes.get(&reflector::ObjectRef::new(&name)) else {
            continue;
        };
        let Some(status) = &gpu_node.status else {
            continue;
        };
        let Some(reported) = &status.inventory else {
            continue;
        };
        let inventory = NodeInventory {
            name: name.clone(),
            labels: node.labels().clone().into_iter().collect(),
            ..reported.clone()
        };
        let blocked = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Blocked" && c.status == "True")
            .map(|c| c.message.clone());
        reports.push(NodeReport {
            inventory,
            generation: gpu_node.metadata.generation,
            applied_generation: status.applied_generation,
            applied_switch: status
                .applied_switch
                .as_ref()
                .and_then(gpuslice_api::chrono_of),
            blocked,
            assigned: gpu_node.spec.gpus.clone(),
        });
    }
    reports.sort_by(|a, b| a.inventory.name.cmp(&b.inventory.name));
    Observed {
        pools,
        policies: Vec::new(),
        allocated: Vec::new(),
        checkpoints: checkpoints
            .state()
            .iter()
            .map(|c| (c.name_any(), (**c).clone()))
            .collect(),
        storage_missing: BTreeMap::new(),
        nodes: reports,
        waiting: BTreeMap::new(),
        prometheus: BTreeMap::new(),
    }
}

/// Every gpuslice device allocated in a ResourceClaim, with the GpuPool its agent published it
/// in and the policy whose class the request named.
pub(super) fn allocated(
    slices: &Store<PublishedSlice>,
    claims: &Store<ResourceClaim>,
    gpu_nodes: &Store<GpuNode>,
) -> Vec<Allocated> {
    // `namespace/name` of a claim → when its workload last checkpointed and since when it has
    // been idle, as its agent says.
    type Times = (
        Option<chrono::DateTime<chrono::Utc>>,
        Option<chrono::DateTime<chrono::Utc>>,
    );
    let nodes = gpu_nodes.state();
    let reported: std::collections::HashMap<&str, Times> = nodes
        .iter()
        .flat_map(|n| n.status.iter().flat_map(|s| &s.claims))
        .filter_map(|c| {
            let chrono = |t: &Option<_>| t.as_ref().and_then(gpuslice_api::chrono_of);
            Some((
                c.resource_claim.as_deref()?,
                (chrono(&c.last_checkpoint), chrono(&c.idle_since)),
            ))
        })
        .collect();
    // (ResourceSlice pool, device) → the device's GpuPool and GPU index.
    type PoolAndGpu<'a> = (Option<&'a str>, Option<u32>);
    let mut published: std::collections::HashMap<(&str, &str), PoolAndGpu> =
        std::collections::HashMap::new();
    let slices = slices.state();
    for slice in &slices {
        for device in &slice.spec.devices {
            let gpu = device.gpu_index().and_then(|i| u32::try_from(i).ok());
            published.insert(
                (slice.spec.pool.name.as_str(), device.name.as_str()),
                (device.pool(), gpu),
            );
        }
    }
    let mut out = Vec::new();
    for claim in claims.state() {
        let Some(results) = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
        else {
            continue;
        };
        for result in results.iter().filter(|r| r.driver == dra::DRIVER) {
            // `request`, or `request/subrequest` for one of `firstAvailable`.
            let (top, sub) = match result.request.split_once('/') {
                Some((top, sub)) => (top, Some(sub)),
                None => (result.request.as_str(), None),
            };
            let request = claim
                .spec
                .devices
                .as_ref()
                .and_then(|d| d.requests.as_ref())
                .and_then(|r| r.iter().find(|r| r.name == top));
            let class = match sub {
                None => request
                    .and_then(|r| r.exactly.as_ref())
                    .map(|e| e.device_class_name.as_str()),
                Some(sub) => request
                    .and_then(|r| r.first_available.as_ref())
                    .and_then(|f| f.iter().find(|s| s.name == sub))
                    .map(|s| s.device_class_name.as_str()),
            };
            let policy = class
                .and_then(|c| c.strip_suffix(&format!(".{}", dra::DRIVER)))
                .map(str::to_string);
            let (pool, gpu) = published
                .get(&(result.pool.as_str(), result.device.as_str()))
                .copied()
                .unwrap_or_default();
            let key = format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
            let (last_checkpoint, idle_since) =
                reported.get(key.as_str()).copied().unwrap_or_default();
            out.push(Allocated {
                pool: pool.map(str::to_string),
                policy,
                node: result.pool.clone(),
                gpu,
                last_checkpoint,
                idle_since,
                // From the policies and pools: see `with_max_loss`.
                max_loss: None,
            });
        }
    }
    out
}

/// Each allocated device's `maxLoss`: its policy's CheckpointPolicy's, else its pool's.
pub(super) fn with_max_loss(
    allocated: &mut [Allocated],
    policies: &[GpuSlicePolicy],
    pools: &[GpuPool],
    checkpoints: &Store<CheckpointPolicy>,
) {
    let checkpoints = checkpoints.state();
    for a in allocated {
        let named = |name: &Option<String>, meta: &kube::core::ObjectMeta| {
            name.is_some() && meta.name == *name
        };
        a.max_loss = gpuslice_planning::shaping::max_loss_of(
            policies.iter().find(|p| named(&a.policy, &p.metadata)),
            pools.iter().find(|p| named(&a.pool, &p.metadata)),
            |name| {
                checkpoints
                    .iter()
                    .find(|c| c.metadata.name.as_deref() == Some(name))
                    .map(|c| &c.spec)
            },
        );
    }
}
