//! The operator's I/O: watch pools, checkpoint policies, Nodes and GpuNodes into local caches;
//! on any change (and at the next window boundary) rebuild the desired state with
//! [`crate::desired`] and apply what differs — each node's `GpuNode.spec` and each pool's status —
//! with server-side apply under one field manager. A failed write is logged and retried on the
//! next pass; one bad object never stops the others.
//!
//! This file holds the loop; the caches it reads, its metrics and its writes are beside it.

mod caches;
mod metrics;
mod write;

pub use metrics::Metrics;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuslice_runtime::clock::Clock;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::Api;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, ResourceExt as _};
use tokio::sync::Notify;

use gpuslice_runtime::telemetry::Telemetry;
use tracing::Instrument as _;

use crate::admission::allowed_namespaces;
use crate::desired::{Observed, desired};
use crate::election::Leadership;
use caches::{
    Stores, allocated, cache, fan_out, filled, observe, trimmed_cache, watch_bound_pods,
    watch_pods, with_max_loss,
};
use write::Writer;

/// GpuNode writes in flight at once.
const WRITES_IN_FLIGHT: usize = 32;

pub use crate::MANAGER;

/// Why the operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("watching {kind}: the caches never filled ({message})")]
    Cache { kind: &'static str, message: String },
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
    let bound_pods = watch_bound_pods(&client).await?;
    // A policy's priority may name a PriorityClass: the queue orders by its value.
    let priority_classes = cache(
        Api::<PriorityClass>::all(client.clone()),
        watcher::Config::default(),
        queue_changed.clone(),
    );
    filled(&priority_classes, "PriorityClass").await?;
    // The queue holds a pod whose checkpoint storage claim does not exist (it would never bind);
    // the CheckpointPolicy's status says so.
    let claims_changed = Arc::new(Notify::new());
    fan_out(
        claims_changed.clone(),
        [queue_changed.clone(), changed.clone()],
    );
    let volume_claims = trimmed_cache(
        Api::<PersistentVolumeClaim>::all(client.clone()),
        watcher::Config::default(),
        claims_changed,
        |c| {
            c.spec = None;
            c.status = None;
            c.metadata.annotations = None;
            c.metadata.labels = None;
        },
    );
    filled(&volume_claims, "PersistentVolumeClaim").await?;
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
            checkpoints: stores.checkpoints.clone(),
            slices: stores.slices.clone(),
            claims: stores.claims.clone(),
            gpu_nodes: stores.gpu_nodes.clone(),
            priority_classes,
            volume_claims: volume_claims.clone(),
            nodes: stores.nodes.clone(),
            bound_pods,
        },
        queue_changed,
        metrics.queue.clone(),
        agent_timeout,
    ));
    // What the elastic sets' Prometheus servers expect, read beside the loop (a slow server
    // never holds a pass up).
    let signals = crate::signals::Signals::default();
    tokio::spawn(crate::signals::run(
        stores.pools.clone(),
        clock,
        signals.clone(),
        changed.clone(),
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
        volume_claims,
        writer,
        clock,
        leadership,
        metrics,
        telemetry,
        admission,
        params_written: None,
        catch_up: None,
        signals,
    };
    loop {
        let started = std::time::Instant::now();
        let span = tracing::info_span!("reconcile", leader = reconciler.leadership.is_leader());
        let want = reconciler.pass(started).instrument(span).await;
        reconciler.wait(&want, started, &changed).await;
    }
}

/// The reconcile loop's state: what it reads, writes and reports with, the admission
/// parameters written last, and when specs are due to be caught up.
struct Reconciler {
    stores: Stores,
    pods: Store<Pod>,
    /// The PersistentVolumeClaims (names only): checkpoint storage pods wait for.
    volume_claims: Store<PersistentVolumeClaim>,
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
    /// What the elastic sets' Prometheus servers answered last.
    signals: crate::signals::Signals,
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
        observed.allocated = allocated(&stores.slices, &stores.claims, &stores.gpu_nodes);
        with_max_loss(
            &mut observed.allocated,
            &observed.policies,
            &observed.pools,
            &stores.checkpoints,
        );
        let at_the_gate = crate::queue::at_the_gate(&self.pods, &self.volume_claims);
        observed.waiting = at_the_gate.waiting;
        observed.storage_missing = at_the_gate.storage_missing;
        observed.prometheus = self.signals.read();
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
            + self
                .writer
                .apply_policies(want, &stores.policies, &stores.checkpoints)
                .await
            + self.writer.apply_classes(want, &stores.classes).await;
        if let (Some(params), Some(namespaces)) = (&self.admission, &stores.namespaces) {
            let labelled: Vec<(String, BTreeMap<String, String>)> = namespaces
                .state()
                .iter()
                .map(|n| (n.name_any(), n.labels().clone()))
                .collect();
            let mut allowed = allowed_namespaces(&observed.policies, &labelled);
            allowed.extend(crate::admission::host_requests(&observed.policies));
            allowed.extend(crate::admission::slice_asks(&observed.policies));
            allowed.extend(crate::admission::non_root_policies(
                &observed.policies,
                &observed.pools,
            ));
            let checkpoints = stores.checkpoints.state();
            allowed.extend(crate::admission::checkpoint_storage(
                &observed.policies,
                &observed.pools,
                &checkpoints.iter().map(|c| &**c).collect::<Vec<_>>(),
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
