//! What a pass writes: each node's `GpuNode.spec`, each pool's and policy's status, the DeviceClasses
//! and the admission parameters, with server-side apply under one field manager.

use std::collections::BTreeMap;

use futures::StreamExt as _;
use gpuslice_api::dra;
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use gpuslice_api::{CheckpointPolicy, GpuNode, GpuPool, GpuPoolStatus, GpuSlicePolicy};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{self, Store};
use kube::{Client, Resource, ResourceExt as _};

use gpuslice_runtime::apply_body;
use gpuslice_runtime::conditions::keep_transition_times;

use super::{AdmissionParams, MANAGER, WRITES_IN_FLIGHT};

pub(super) struct Writer {
    pub(super) client: Client,
    pub(super) recorder: Recorder,
}

impl Writer {
    pub(super) async fn apply(
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
    /// Writes the policies' and the CheckpointPolicies' status where it changed. Returns how
    /// many writes failed.
    pub(super) async fn apply_policies(
        &self,
        want: &crate::desired::DesiredState,
        policies: &Store<GpuSlicePolicy>,
        checkpoints: &Store<CheckpointPolicy>,
    ) -> u64 {
        self.apply_status(
            &want.policy_status,
            policies,
            |p| p.status.clone(),
            |s| &mut s.conditions,
        )
        .await
            + self
                .apply_status(
                    &want.checkpoint_status,
                    checkpoints,
                    |c| c.status.clone(),
                    |s| &mut s.conditions,
                )
                .await
    }

    /// Writes each object's `status` of `statuses` that differs from the cached one's (`current`),
    /// keeping its conditions' (`conditions`) transition times.
    async fn apply_status<K, S>(
        &self,
        statuses: &BTreeMap<String, S>,
        cached: &Store<K>,
        current: impl Fn(&K) -> Option<S>,
        conditions: impl Fn(&mut S) -> &mut Vec<Condition>,
    ) -> u64
    where
        K: Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        S: Clone + Default + PartialEq + serde::Serialize,
    {
        let api: Api<K> = Api::all(self.client.clone());
        let kind = K::kind(&());
        let params = PatchParams::apply(MANAGER).force();
        let mut failed = 0;
        for (name, status) in statuses {
            let mut old = cached
                .get(&reflector::ObjectRef::new(name))
                .and_then(|o| current(&o))
                .unwrap_or_default();
            let mut status = status.clone();
            keep_transition_times(conditions(&mut status), conditions(&mut old));
            if status == old {
                continue;
            }
            let patch = apply_body(&kind, name, "status", &status);
            if let Err(e) = api.patch_status(name, &params, &Patch::Apply(&patch)).await {
                tracing::warn!("{kind}/{name}: writing status: {e}");
                failed += 1;
            }
        }
        failed
    }
}

impl Writer {
    /// Writes the admission parameters: policy name → the namespaces that may use it, and each
    /// policy's host CPU and memory requests.
    pub(super) async fn apply_admission_params(
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
    pub(super) async fn apply_classes(
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
pub(super) fn with_transition_times(status: &GpuPoolStatus, old: &GpuPoolStatus) -> GpuPoolStatus {
    let mut out = status.clone();
    keep_transition_times(&mut out.conditions, &old.conditions);
    out
}
