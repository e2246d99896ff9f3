//! The operator's I/O: watch pools, checkpoint policies, Nodes and GpuNodes into local caches;
//! on any change (and at the next window boundary) rebuild the desired state with
//! [`crate::desired`] and apply what differs — each node's `GpuNode.spec` and each pool's status —
//! with server-side apply under one field manager. A failed write is logged and retried on the
//! next pass; one bad object never stops the others.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use gpuslice_api::dra;
use gpuslice_api::{
    CheckpointPolicy, GpuNode, GpuPool, GpuPoolStatus, GpuSlicePolicy, NodeInventory,
};
use gpuslice_runtime::clock::Clock;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, Resource, ResourceExt as _};
use tokio::sync::Notify;

use crate::admission::allowed_namespaces;
use crate::desired::{Allocated, NodeReport, Observed, desired};
use crate::election::Leadership;
use crate::published::PublishedSlice;
use gpuslice_runtime::apply_body;
use gpuslice_runtime::conditions::keep_transition_times;
use gpuslice_runtime::telemetry::Telemetry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::Instrument as _;

/// GpuNode writes in flight at once.
const WRITES_IN_FLIGHT: usize = 32;

pub use crate::MANAGER;

/// Why the operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("watching {kind}: the caches never filled ({message})")]
    Cache { kind: &'static str, message: String },
}

fn cache<K>(api: Api<K>, config: watcher::Config, changed: Arc<Notify>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    trimmed_cache(api, config, changed, |_| {})
}

/// A cache that keeps only what the operator reads of each object (`trim` drops the rest): at
/// 1,000 nodes and 10,000 pods the whole objects are most of the operator's memory.
fn trimmed_cache<K>(
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
fn trim_slice(slice: &mut PublishedSlice) {
    slice.metadata.labels = None;
    slice.metadata.annotations = None;
    slice.metadata.owner_references = None;
}

/// Of a ResourceClaim, the operator reads its requests' names and classes and which devices were
/// allocated for which request; the selectors, the allocation's node selector (one per claim),
/// the devices' status and the consumers are dropped.
fn trim_claim(claim: &mut ResourceClaim) {
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

/// The operator's metrics.
#[derive(Clone)]
pub struct Metrics {
    reconciles: Counter,
    errors: Counter,
    duration: Histogram,
    pool_nodes: Family<PoolLabel, Gauge>,
    pool_gpus: Family<PoolLabel, Gauge>,
    pool_slices: Family<PoolLabel, Gauge>,
    pool_allocated: Family<PoolLabel, Gauge>,
    pool_condition: Family<ConditionLabel, Gauge>,
    pool_window: Family<WindowLabel, Gauge>,
    policy_allocated: Family<PolicyLabel, Gauge>,
    policy_waiting: Family<PolicyLabel, Gauge>,
    queue: crate::queue::QueueMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabel {
    pool: String,
    /// `Ready`, `Progressing` or `Degraded`.
    condition: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WindowLabel {
    pool: String,
    /// The window in force, `default` outside every window.
    window: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabel {
    policy: String,
    pool: String,
    /// The policy's `class` (training, inference, interactive; empty when it names none).
    class: String,
}

impl Metrics {
    /// Metrics registered under `gpuslice_`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            reconciles: Counter::default(),
            errors: Counter::default(),
            duration: Histogram::new(gpuslice_runtime::duration_buckets()),
            pool_nodes: Family::default(),
            pool_gpus: Family::default(),
            pool_slices: Family::default(),
            pool_allocated: Family::default(),
            pool_condition: Family::default(),
            pool_window: Family::default(),
            policy_allocated: Family::default(),
            policy_waiting: Family::default(),
            queue: crate::queue::QueueMetrics::register(registry),
        };
        let r = registry.sub_registry_with_prefix("gpuslice");
        r.register(
            "operator_reconciles",
            "Reconcile passes",
            m.reconciles.clone(),
        );
        r.register(
            "operator_reconcile_errors",
            "Writes that failed (retried on the next pass)",
            m.errors.clone(),
        );
        r.register(
            "operator_reconcile_duration_seconds",
            "Time of one reconcile pass, writes included",
            m.duration.clone(),
        );
        r.register("pool_nodes", "Nodes a pool selects", m.pool_nodes.clone());
        r.register("pool_gpus", "GPUs in a pool", m.pool_gpus.clone());
        r.register("pool_slices", "Slices in a pool", m.pool_slices.clone());
        r.register(
            "pool_slices_allocated",
            "Slices of a pool allocated to pods (ResourceClaims)",
            m.pool_allocated.clone(),
        );
        r.register(
            "pool_condition",
            "1 while the pool's condition is True, else 0 (Ready, Progressing: nodes converging or a transition blocked, Degraded)",
            m.pool_condition.clone(),
        );
        r.register(
            "pool_window",
            "1 for the window in force in each pool (window=\"default\" outside every window)",
            m.pool_window.clone(),
        );
        r.register(
            "policy_slices_allocated",
            "Slices allocated to pods through a policy's DeviceClass",
            m.policy_allocated.clone(),
        );
        r.register(
            "policy_pods_waiting",
            "Pods naming a policy that wait at the queue's gate",
            m.policy_waiting.clone(),
        );
        m
    }

    /// Sets the per-pool and per-policy gauges from the statuses a pass wants.
    fn record_state(
        &self,
        want: &crate::desired::DesiredState,
        pool_and_class: &BTreeMap<String, (String, String)>,
    ) {
        for family in [
            &self.pool_nodes,
            &self.pool_gpus,
            &self.pool_slices,
            &self.pool_allocated,
        ] {
            family.clear();
        }
        self.pool_condition.clear();
        self.pool_window.clear();
        self.policy_allocated.clear();
        self.policy_waiting.clear();
        for (pool, status) in &want.pool_status {
            let label = PoolLabel { pool: pool.clone() };
            for (family, value) in [
                (&self.pool_nodes, status.nodes),
                (&self.pool_gpus, status.gpus),
                (&self.pool_slices, status.slices.total),
                (&self.pool_allocated, status.slices.allocated),
            ] {
                family.get_or_create(&label).set(i64::from(value));
            }
            for c in &status.conditions {
                self.pool_condition
                    .get_or_create(&ConditionLabel {
                        pool: pool.clone(),
                        condition: c.type_.clone(),
                    })
                    .set(i64::from(c.status == "True"));
            }
            self.pool_window
                .get_or_create(&WindowLabel {
                    pool: pool.clone(),
                    window: status
                        .active_window
                        .clone()
                        .unwrap_or_else(|| gpuslice_api::DEFAULT_WINDOW.into()),
                })
                .set(1);
        }
        for (policy, status) in &want.policy_status {
            let (pool, class) = pool_and_class.get(policy).cloned().unwrap_or_default();
            let label = PolicyLabel {
                policy: policy.clone(),
                pool,
                class,
            };
            self.policy_allocated
                .get_or_create(&label)
                .set(i64::from(status.allocated));
            self.policy_waiting
                .get_or_create(&label)
                .set(i64::from(status.waiting));
        }
    }
}

/// With nothing to wake it, the loop still passes this often.
const IDLE_PASS: Duration = Duration::from_secs(300);
/// Passes this long after a window boundary, so the clock is surely past it.
const BOUNDARY_MARGIN: Duration = Duration::from_millis(50);
/// A follower (not the leader) looks this often whether it leads now.
const FOLLOWER_PASS: Duration = Duration::from_secs(1);
/// A burst of changes settles this long before the pass it triggers.
const SETTLE: Duration = Duration::from_millis(100);

/// The ConfigMap the chart's ValidatingAdmissionPolicy reads its parameters from.
#[derive(Clone, Debug)]
pub struct AdmissionParams {
    pub namespace: String,
    pub name: String,
}

/// Runs the operator until the process ends.
pub async fn run(
    client: Client,
    clock: Clock,
    metrics: Metrics,
    telemetry: Option<Telemetry>,
    leadership: Leadership,
    admission: Option<AdmissionParams>,
    agent_timeout: std::time::Duration,
) -> Result<(), OperatorError> {
    let changed = Arc::new(Notify::new());
    let stores = Stores::watch(&client, admission.is_some(), &changed).await?;
    // The admission queue: pods that name a policy, and the caches above. A change of such a pod
    // wakes the queue, and this loop too (the policies count their waiting pods).
    let queue_changed = Arc::new(Notify::new());
    let pods = watch_pods(&client, &queue_changed, &changed).await?;
    // A policy's priority may name a PriorityClass: the queue orders by its value.
    let priority_classes = cache(
        Api::<PriorityClass>::all(client.clone()),
        watcher::Config::default(),
        queue_changed.clone(),
    );
    priority_classes
        .wait_until_ready()
        .await
        .map_err(|e| OperatorError::Cache {
            kind: "PriorityClass",
            message: e.to_string(),
        })?;
    tokio::spawn(crate::evictions::run(
        client.clone(),
        leadership.clone(),
        stores.gpu_nodes.clone(),
    ));
    tokio::spawn(crate::queue::run(
        client.clone(),
        clock,
        leadership.clone(),
        crate::queue::Caches {
            pods: pods.clone(),
            pools: stores.pools.clone(),
            policies: stores.policies.clone(),
            slices: stores.slices.clone(),
            claims: stores.claims.clone(),
            gpu_nodes: stores.gpu_nodes.clone(),
            priority_classes,
        },
        queue_changed,
        metrics.queue.clone(),
        agent_timeout,
    ));
    let writer = Writer {
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        ),
        client,
    };
    let mut reconciler = Reconciler {
        stores,
        pods,
        writer,
        clock,
        leadership,
        metrics,
        telemetry,
        admission,
        params_written: None,
        catch_up: None,
    };
    loop {
        let started = std::time::Instant::now();
        let span = tracing::info_span!("reconcile", leader = reconciler.leadership.is_leader());
        let want = reconciler.pass(started).instrument(span).await;
        reconciler.wait(&want, started, &changed).await;
    }
}

/// The caches the controller reconciles from; a change of any wakes its loop.
struct Stores {
    pools: Store<GpuPool>,
    checkpoints: Store<CheckpointPolicy>,
    policies: Store<GpuSlicePolicy>,
    nodes: Store<Node>,
    gpu_nodes: Store<GpuNode>,
    classes: Store<DeviceClass>,
    slices: Store<PublishedSlice>,
    claims: Store<ResourceClaim>,
    /// Only with admission parameters to write: which namespaces each policy's selector matches.
    namespaces: Option<Store<Namespace>>,
}

impl Stores {
    /// Starts the watches (the Namespaces' only when `admission` parameters are written) and
    /// waits until every cache has filled.
    async fn watch(
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
        // Of a Node, only its name and labels are read (which pools select it).
        let nodes = trimmed_cache(
            Api::<Node>::all(client.clone()),
            all(),
            changed.clone(),
            |n| {
                n.spec = None;
                n.status = None;
                n.metadata.annotations = None;
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
            namespaces
                .wait_until_ready()
                .await
                .map_err(|e| OperatorError::Cache {
                    kind: "Namespace",
                    message: e.to_string(),
                })?;
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
async fn watch_pods(
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
    {
        let (queue_changed, changed) = (queue_changed.clone(), changed.clone());
        tokio::spawn(async move {
            loop {
                pods_changed.notified().await;
                queue_changed.notify_one();
                changed.notify_one();
            }
        });
    }
    pods.wait_until_ready()
        .await
        .map_err(|e| OperatorError::Cache {
            kind: "Pod",
            message: e.to_string(),
        })?;
    Ok(pods)
}

/// The reconcile loop's state: what it reads, writes and reports with, the admission
/// parameters written last, and when specs are due to be caught up.
struct Reconciler {
    stores: Stores,
    pods: Store<Pod>,
    writer: Writer,
    clock: Clock,
    leadership: Leadership,
    metrics: Metrics,
    telemetry: Option<Telemetry>,
    admission: Option<AdmissionParams>,
    /// The admission parameters as last written (none while not the leader).
    params_written: Option<BTreeMap<String, String>>,
    /// When the specs that agents switched away from by themselves are due to be caught up.
    catch_up: Option<chrono::DateTime<chrono::Utc>>,
}

impl Reconciler {
    /// One reconcile pass (`started` at that instant): read the caches, build the desired
    /// state, write what differs (only the leader), and record the pass's metrics.
    async fn pass(&mut self, started: std::time::Instant) -> crate::desired::DesiredState {
        let observed = self.observed();
        let now = self.clock.now();
        let want = desired(&observed, now);
        // Only the leader writes; the others keep their caches warm to take over at once.
        let failed = if self.leadership.is_leader() {
            self.write(&want, &observed, now).await
        } else {
            self.params_written = None;
            self.catch_up = None;
            0
        };
        self.record(&want, failed, started);
        want
    }

    /// The cluster as the caches have it.
    fn observed(&self) -> Observed {
        let stores = &self.stores;
        let mut observed = observe(
            &stores.pools,
            &stores.checkpoints,
            &stores.nodes,
            &stores.gpu_nodes,
        );
        observed.policies = stores
            .policies
            .state()
            .iter()
            .map(|p| (**p).clone())
            .collect();
        observed.allocated = allocated(&stores.slices, &stores.claims);
        observed.waiting = crate::queue::waiting_by_policy(&self.pods);
        observed
    }

    /// Writes what differs from `want`: GpuNode specs and pool status, policy status,
    /// DeviceClasses, the admission parameters. Returns how many writes failed.
    async fn write(
        &mut self,
        want: &crate::desired::DesiredState,
        observed: &Observed,
        now: chrono::DateTime<chrono::Utc>,
    ) -> u64 {
        let stores = &self.stores;
        let (failed, due) = self
            .writer
            .apply(want, &stores.pools, &stores.gpu_nodes, now)
            .await;
        self.catch_up = due;
        let mut failed = failed
            + self.writer.apply_policies(want, &stores.policies).await
            + self.writer.apply_classes(want, &stores.classes).await;
        if let (Some(params), Some(namespaces)) = (&self.admission, &stores.namespaces) {
            let labelled: Vec<(String, BTreeMap<String, String>)> = namespaces
                .state()
                .iter()
                .map(|n| (n.name_any(), n.labels().clone()))
                .collect();
            let mut allowed = allowed_namespaces(&observed.policies, &labelled);
            allowed.extend(crate::admission::host_requests(&observed.policies));
            allowed.extend(crate::admission::non_root_policies(
                &observed.policies,
                &observed.pools,
            ));
            if self.params_written.as_ref() != Some(&allowed) {
                match self.writer.apply_admission_params(params, &allowed).await {
                    Ok(()) => self.params_written = Some(allowed),
                    Err(e) => {
                        tracing::warn!(
                            "ConfigMap {}/{}: writing admission parameters: {e}",
                            params.namespace,
                            params.name
                        );
                        failed += 1;
                    }
                }
            }
        }
        failed
    }

    /// Records a pass `started` then, with `failed` writes, and the state it wants.
    fn record(
        &self,
        want: &crate::desired::DesiredState,
        failed: u64,
        started: std::time::Instant,
    ) {
        let metrics = &self.metrics;
        metrics.reconciles.inc();
        metrics.errors.inc_by(failed);
        metrics.duration.observe(started.elapsed().as_secs_f64());
        let pool_and_class: BTreeMap<String, (String, String)> = self
            .stores
            .policies
            .state()
            .iter()
            .map(|p| {
                let class = p.spec.class.map(|c| c.as_str().to_string());
                (
                    p.name_any(),
                    (p.spec.pool.clone(), class.unwrap_or_default()),
                )
            })
            .collect();
        metrics.record_state(want, &pool_and_class);
        if let Some(t) = &self.telemetry {
            t.pass_done();
        }
    }

    /// Waits for the next pass: a change (a burst settles first), or the next window boundary
    /// or catch-up (a follower looks again soon whether it leads now).
    async fn wait(
        &self,
        want: &crate::desired::DesiredState,
        started: std::time::Instant,
        changed: &Notify,
    ) {
        // Wake on a change (a burst settles first) or at the next window boundary.
        tracing::debug!("pass took {:.2} s", started.elapsed().as_secs_f64());
        let until_boundary = want
            .next_change
            .into_iter()
            .chain(self.catch_up)
            .min()
            .map_or(IDLE_PASS, |t| self.clock.until(t) + BOUNDARY_MARGIN);
        let until_boundary = if self.leadership.is_leader() {
            until_boundary
        } else {
            until_boundary.min(FOLLOWER_PASS)
        };
        // Under a stream of changes (thousands of claims being allocated) a pass waits at least
        // as long as the last one took, so the operator never spends more than half its time
        // reconciling.
        let settle = SETTLE.max(started.elapsed());
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(settle).await,
            _ = tokio::time::sleep(until_boundary) => {}
        }
    }
}

fn observe(
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
        checkpoint_policies: checkpoints.state().iter().map(|c| c.name_any()).collect(),
        nodes: reports,
        waiting: BTreeMap::new(),
    }
}

/// Every gpuslice device allocated in a ResourceClaim, with the GpuPool its agent published it
/// in and the policy whose class the request named.
fn allocated(slices: &Store<PublishedSlice>, claims: &Store<ResourceClaim>) -> Vec<Allocated> {
    let mut pool_of: std::collections::HashMap<(&str, &str), Option<&str>> =
        std::collections::HashMap::new();
    let slices = slices.state();
    for slice in &slices {
        for device in &slice.spec.devices {
            pool_of.insert(
                (slice.spec.pool.name.as_str(), device.name.as_str()),
                device.pool(),
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
            out.push(Allocated {
                pool: pool_of
                    .get(&(result.pool.as_str(), result.device.as_str()))
                    .copied()
                    .flatten()
                    .map(str::to_string),
                policy,
            });
        }
    }
    out
}

struct Writer {
    client: Client,
    recorder: Recorder,
}

impl Writer {
    async fn apply(
        &self,
        want: &crate::desired::DesiredState,
        pools: &Store<GpuPool>,
        gpu_nodes: &Store<GpuNode>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> (u64, Option<chrono::DateTime<chrono::Utc>>) {
        let mut failed = 0;
        let params = PatchParams::apply(MANAGER).force();
        let gpu_node_api: Api<GpuNode> = Api::all(self.client.clone());
        let mut catch_up: Option<chrono::DateTime<chrono::Utc>> = None;
        // Nodes are independent: write their layouts a few at a time, not one after another.
        let writes = want.node_specs.iter().filter_map(|(name, spec)| {
            let current = gpu_nodes.get(&reflector::ObjectRef::new(name));
            // The preemptions are the queue's to write.
            if current.as_ref().is_some_and(|c| {
                c.spec.gpus == spec.gpus && c.spec.source_revision == spec.source_revision
            }) {
                return None;
            }
            // The agent switched by itself at the boundary: its own writes go first.
            if let Some(due) = current
                .as_ref()
                .and_then(|c| crate::desired::catch_up_due(&c.spec, spec, now))
                .filter(|due| *due > now)
            {
                catch_up = Some(catch_up.map_or(due, |c| c.min(due)));
                return None;
            }
            // A node that leaves every pool: server-side apply of an empty spec would drop the
            // (required) spec altogether, which the API server refuses; clear the list instead.
            let patch = if spec.gpus.is_empty() && spec.source_revision.is_none() {
                Patch::Merge(serde_json::json!({"spec": {"gpus": null}}))
            } else {
                Patch::Apply(apply_body("GpuNode", name, "spec", spec))
            };
            let (api, params) = (&gpu_node_api, &params);
            let merge_params = PatchParams {
                field_manager: Some(MANAGER.to_string()),
                ..PatchParams::default()
            };
            Some(async move {
                let params = match patch {
                    Patch::Merge(_) => &merge_params,
                    _ => params,
                };
                match api.patch(name, params, &patch).await {
                    Ok(_) => 0,
                    Err(e) => {
                        tracing::warn!("GpuNode/{name}: writing the desired layout: {e}");
                        1
                    }
                }
            })
        });
        let started = std::time::Instant::now();
        let (written, node_failures) = futures::stream::iter(writes)
            .buffer_unordered(WRITES_IN_FLIGHT)
            .fold((0u64, 0u64), |(n, sum), f| async move { (n + 1, sum + f) })
            .await;
        if written > 0 {
            tracing::info!(
                "wrote {written} GpuNode layouts in {:.2} s ({node_failures} failed)",
                started.elapsed().as_secs_f64()
            );
        }
        failed += node_failures;
        let pool_api: Api<GpuPool> = Api::all(self.client.clone());
        for (name, status) in &want.pool_status {
            let current = pools.get(&reflector::ObjectRef::new(name));
            let old = current
                .as_ref()
                .and_then(|p| p.status.clone())
                .unwrap_or_default();
            let status = with_transition_times(status, &old);
            // The namespaces' use and the compaction round are the queue's to write (their own
            // field managers).
            let unchanged = GpuPoolStatus {
                fair_share: old.fair_share.clone(),
                compaction: old.compaction.clone(),
                ..status.clone()
            } == old;
            if unchanged {
                continue;
            }
            if let Some(pool) = &current {
                for e in crate::desired::events(pool.status.as_ref(), &status) {
                    let event = Event {
                        type_: if e.warning {
                            EventType::Warning
                        } else {
                            EventType::Normal
                        },
                        reason: e.reason.into(),
                        note: Some(e.note.chars().take(1000).collect()),
                        action: "Reconcile".into(),
                        secondary: None,
                    };
                    if let Err(err) = self.recorder.publish(&event, &pool.object_ref(&())).await {
                        tracing::warn!("GpuPool/{name}: recording an event: {err}");
                    }
                }
            }
            let patch = apply_body("GpuPool", name, "status", &status);
            if let Err(e) = pool_api
                .patch_status(name, &params, &Patch::Apply(&patch))
                .await
            {
                tracing::warn!("GpuPool/{name}: writing status: {e}");
                failed += 1;
            }
        }
        (failed, catch_up)
    }
}

impl Writer {
    async fn apply_policies(
        &self,
        want: &crate::desired::DesiredState,
        policies: &Store<GpuSlicePolicy>,
    ) -> u64 {
        let api: Api<GpuSlicePolicy> = Api::all(self.client.clone());
        let params = PatchParams::apply(MANAGER).force();
        let mut failed = 0;
        for (name, status) in &want.policy_status {
            let old = policies
                .get(&reflector::ObjectRef::new(name))
                .and_then(|p| p.status.clone())
                .unwrap_or_default();
            let mut status = status.clone();
            keep_transition_times(&mut status.conditions, &old.conditions);
            if status == old {
                continue;
            }
            let patch = apply_body("GpuSlicePolicy", name, "status", &status);
            if let Err(e) = api.patch_status(name, &params, &Patch::Apply(&patch)).await {
                tracing::warn!("GpuSlicePolicy/{name}: writing status: {e}");
                failed += 1;
            }
        }
        failed
    }
}

impl Writer {
    /// Writes the admission parameters: policy name → the namespaces that may use it, and each
    /// policy's host CPU and memory requests.
    async fn apply_admission_params(
        &self,
        params: &AdmissionParams,
        allowed: &BTreeMap<String, String>,
    ) -> Result<(), kube::Error> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &params.namespace);
        let object = serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": params.name, "labels": {dra::MANAGED_BY_LABEL: MANAGER}},
            "data": allowed,
        });
        api.patch(
            &params.name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&object),
        )
        .await
        .map(|_| ())
    }

    /// Writes each policy's DeviceClass where it differs, and deletes the classes (ours, by
    /// label) whose policy is gone.
    async fn apply_classes(
        &self,
        want: &crate::desired::DesiredState,
        classes: &Store<DeviceClass>,
    ) -> u64 {
        let api: Api<DeviceClass> = Api::all(self.client.clone());
        let params = PatchParams::apply(MANAGER).force();
        let mut failed = 0;
        for (name, class) in &want.device_classes {
            let current = classes.get(&reflector::ObjectRef::new(name));
            if current.as_ref().is_some_and(|c| {
                c.spec == class.spec
                    && c.metadata.labels == class.metadata.labels
                    && c.metadata.owner_references == class.metadata.owner_references
            }) {
                continue;
            }
            if let Err(e) = api.patch(name, &params, &Patch::Apply(class)).await {
                tracing::warn!("DeviceClass/{name}: writing it: {e}");
                failed += 1;
            }
        }
        for stale in classes.state() {
            let name = stale.name_any();
            if want.device_classes.contains_key(&name) {
                continue;
            }
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => tracing::info!("DeviceClass/{name}: deleted, its policy is gone"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    tracing::warn!("DeviceClass/{name}: deleting it: {e}");
                    failed += 1;
                }
            }
        }
        failed
    }
}

/// `status` with each condition's transition time kept from `old` while its status stays, and
/// now when the status changed (Kubernetes API conventions).
fn with_transition_times(status: &GpuPoolStatus, old: &GpuPoolStatus) -> GpuPoolStatus {
    let mut out = status.clone();
    keep_transition_times(&mut out.conditions, &old.conditions);
    out
}
