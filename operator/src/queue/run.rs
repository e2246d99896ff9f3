//! The queue's loop: while leader, each pass plans from the caches and carries the plan out in a
//! fixed order (metrics, admissions, preemptions, pool status, Events, pod conditions).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use gpuslice_api::Preemption;
use gpuslice_runtime::clock::Clock;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt as _};
use tokio::sync::Notify;

use super::{
    Caches, INVALID_RUN_TIME, MANAGER, POLICY_LABEL, Plan, Queue, QueueMetrics, STORAGE_MISSING,
    api, gated,
};
use crate::election::Leadership;

/// A pass at least this often (usage accrues; devices come and go).
const PASS_EVERY: Duration = Duration::from_secs(2);

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
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    let writer = Writer {
        client,
        recorder,
        caches,
        metrics,
    };
    loop {
        if leadership.is_leader() {
            let wall = chrono::Utc::now();
            let plan = queue.plan(&writer.caches, clock.now(), wall, agent_timeout);
            writer.metrics.record_plan(&plan);
            writer.claim_templates(&mut queue.templates).await;
            writer.admit(&plan, &mut queue.told, wall).await;
            writer.take_back(&plan).await;
            writer.record(&plan).await;
            writer.warn(&plan).await;
            writer.tell(plan.tell, &mut queue.told).await;
            writer.forget(&mut queue.told);
        }
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(Duration::from_millis(100)).await,
            _ = tokio::time::sleep(PASS_EVERY) => {}
        }
    }
}

/// How long a written ResourceClaimTemplate is taken to still be there.
const REWRITE_TEMPLATES_EVERY: Duration = Duration::from_secs(60);

/// The ResourceClaimTemplates written since `since`: (namespace, policy, its uid, count).
pub(super) struct Templates {
    written: BTreeSet<(String, String, String, u32)>,
    since: std::time::Instant,
}

impl Default for Templates {
    fn default() -> Self {
        Templates {
            written: BTreeSet::new(),
            since: std::time::Instant::now(),
        }
    }
}

/// What each waiting pod (`namespace/name`) was last told: (reason, message).
type Told = BTreeMap<String, (String, String)>;

/// What carries a pass's plan out: the client and Event recorder, the caches (to find the
/// objects the plan names), the metrics.
struct Writer {
    client: Client,
    recorder: Recorder,
    caches: Caches,
    metrics: QueueMetrics,
}

impl Writer {
    /// The cached pod `namespace/name`.
    fn pod(&self, key: &str) -> Option<Arc<Pod>> {
        let (namespace, name) = key.split_once('/')?;
        self.caches
            .pods
            .get(&ObjectRef::new(name).within(namespace))
    }

    /// Admits the plan's pods (those still cached): each admitted is no longer told anything,
    /// and how long it waited is observed.
    async fn admit(&self, plan: &Plan, told: &mut Told, wall: chrono::DateTime<chrono::Utc>) {
        for (key, node) in &plan.admit {
            let Some(pod) = self.pod(key) else { continue };
            match api::admit(&self.client, &pod, node).await {
                Ok(()) => {
                    tracing::info!("admitted pod {key} onto node {node}");
                    told.remove(key);
                    let created = pod
                        .creation_timestamp()
                        .and_then(|t| gpuslice_api::chrono_of(&t))
                        .unwrap_or(wall);
                    self.metrics.admitted(
                        plan.admitted_pool.get(key).cloned().unwrap_or_default(),
                        pod.namespace().unwrap_or_default(),
                        (wall - created).num_milliseconds().max(0) as f64 / 1000.0,
                    );
                }
                Err(e) => tracing::warn!("pod {key}: admitting it: {e}"),
            }
        }
    }

    /// States each node's preemptions and the GPUs compaction empties there, where they
    /// changed; each preemption newly asked for is counted and logged.
    async fn take_back(&self, plan: &Plan) {
        for (node, preemptions) in &plan.preemptions {
            let current = self.caches.gpu_nodes.get(&ObjectRef::new(node));
            let (before, compacting_before) = current
                .map(|c| (c.spec.preemptions.clone(), c.spec.compacting.clone()))
                .unwrap_or_default();
            let mut compacting = plan.compacting.get(node).cloned().unwrap_or_default();
            compacting.sort_unstable();
            compacting.dedup();
            if before == *preemptions && compacting_before == compacting {
                continue;
            }
            match api::take_back(&self.client, node, preemptions, &compacting).await {
                Ok(()) => {
                    for p in preemptions
                        .iter()
                        .filter(|p| !before.contains(p) && !p.for_pod.is_empty())
                    {
                        self.preempted(node, p);
                    }
                }
                Err(e) => tracing::warn!("GpuNode/{node}: writing preemptions: {e}"),
            }
        }
    }

    /// Counts a preemption newly asked for on `node` (by the pool of the pod it is for, and
    /// why), and logs it.
    fn preempted(&self, node: &str, p: &Preemption) {
        let pool = self
            .pod(&p.for_pod)
            .and_then(|x| x.labels().get(POLICY_LABEL).cloned())
            .and_then(|policy| {
                self.caches
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
        self.metrics.preempted(pool, reason);
        tracing::info!(
            "taking back the slice of {} on node {node} for pod {}: {}",
            p.resource_claim,
            p.for_pod,
            p.reason
        );
    }

    /// Writes the ResourceClaimTemplate of each policy with a `topology` into the namespaces of
    /// its waiting pods (admission gave them a claim from it): before their gate is lifted, so
    /// their claims exist when kube-scheduler looks. `templates` remembers what was applied,
    /// and forgets it now and then, so that a template deleted by hand comes back.
    async fn claim_templates(&self, templates: &mut Templates) {
        if templates.since.elapsed() > REWRITE_TEMPLATES_EVERY {
            *templates = Templates::default();
        }
        let written = &mut templates.written;
        let policies: BTreeMap<String, Arc<gpuslice_api::GpuSlicePolicy>> = self
            .caches
            .policies
            .state()
            .into_iter()
            .filter(|p| p.spec.topology.is_some())
            .map(|p| (p.name_any(), p))
            .collect();
        if policies.is_empty() {
            return;
        }
        for pod in self.caches.pods.state().iter().filter(|p| gated(p)) {
            let Some(policy) = pod.labels().get(POLICY_LABEL).and_then(|n| policies.get(n)) else {
                continue;
            };
            let namespace = pod.namespace().unwrap_or_default();
            // A policy made again under its name has another uid (and its old template went
            // with the old one); one of another count needs its template replaced.
            let key = (
                namespace.clone(),
                policy.name_any(),
                policy.uid().unwrap_or_default(),
                policy.spec.count,
            );
            if written.contains(&key) {
                continue;
            }
            let Some(template) = crate::classes::claim_template(policy, &namespace, MANAGER) else {
                continue;
            };
            match api::apply_claim_template(&self.client, &template).await {
                Ok(()) => {
                    written.insert(key);
                }
                Err(e) => tracing::warn!(
                    "ResourceClaimTemplate {namespace}/{}: writing it for policy {}: {e}",
                    template.name_any(),
                    policy.name_any()
                ),
            }
        }
    }

    /// Records the pools' compaction rounds, then the namespaces' use of each pool.
    async fn record(&self, plan: &Plan) {
        for (pool, round) in &plan.compaction {
            if let Err(e) = api::record_compaction(&self.client, pool, round).await {
                tracing::warn!("GpuPool/{pool}: recording its compaction: {e}");
            }
        }
        for (pool, fair_share) in &plan.fair_share {
            if let Err(e) = api::record_fair_share(&self.client, pool, fair_share).await {
                tracing::warn!("GpuPool/{pool}: recording namespaces' use: {e}");
            }
        }
    }

    /// Logs each stalled preemption, and records it as a Warning Event on its pool.
    async fn warn(&self, plan: &Plan) {
        for (pool, reason, note) in &plan.stalled {
            tracing::warn!("GpuPool/{pool}: {note}");
            let Some(object) = self.caches.pools.get(&ObjectRef::new(pool)) else {
                continue;
            };
            let on = kube::Resource::object_ref(&*object, &());
            self.warning(&on, reason, note, "Preempt").await;
        }
    }

    /// Writes the waiting pods' conditions, remembering what each was told. A pod held until
    /// its owner fixes it also gets a Warning Event, once each time it is told something new.
    async fn tell(&self, tell: Vec<(String, String, String)>, told: &mut Told) {
        for (key, reason, message) in tell {
            let Some((namespace, name)) = key.split_once('/') else {
                continue;
            };
            match api::tell(&self.client, namespace, name, &reason, &message).await {
                Ok(()) => {
                    // After the condition is written: a failed write tells again next pass,
                    // which would repeat the Event.
                    if [INVALID_RUN_TIME, STORAGE_MISSING].contains(&reason.as_str()) {
                        self.warn_pod(&key, &reason, &message).await;
                    }
                    told.insert(key, (reason, message));
                }
                Err(e) => tracing::debug!("pod {key}: its queue condition: {e}"),
            }
        }
    }

    /// Records a Warning Event on the cached pod `key`.
    async fn warn_pod(&self, key: &str, reason: &str, note: &str) {
        if let Some(pod) = self.pod(key) {
            let on = kube::Resource::object_ref(&*pod, &());
            self.warning(&on, reason, note, "Queue").await;
        }
    }

    /// Records a Warning Event `reason` on `on`; a failure is logged.
    async fn warning(&self, on: &ObjectReference, reason: &str, note: &str, action: &str) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note.into()),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, on).await {
            tracing::warn!(
                "{}/{}: recording an Event: {e}",
                on.kind.as_deref().unwrap_or_default(),
                on.name.as_deref().unwrap_or_default()
            );
        }
    }

    /// Forgets what was told to pods that no longer wait at the gate.
    fn forget(&self, told: &mut Told) {
        let waiting: BTreeSet<String> = self
            .caches
            .pods
            .state()
            .iter()
            .filter(|p| gated(p))
            .map(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()))
            .collect();
        told.retain(|k, _| waiting.contains(k));
    }
}
