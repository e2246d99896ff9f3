//! The pods a pass asks the operator to evict besides those its drains name: preemption victims
//! never prepared here, pods whose claims were allocated on slices since re-cut, and pods the
//! watchdog found using a pool's GPU past every slice.

use kube::Client;
use kube::api::Api;

use crate::pass::Eviction;

/// The pods of preemption victims whose claim was never prepared on this node (a pod whose
/// container has not started, an image still pulling, or no kubelet at all): nothing runs on the
/// slice and nothing could checkpoint, so they are asked to be evicted at once rather than
/// waited on.
pub(super) async fn unprepared_victims(
    client: &Client,
    preemptions: &[gpuslice_api::Preemption],
    prepared: &[crate::workloads::claims::Claim],
) -> Vec<Eviction> {
    use gpuslice_api::k8s_openapi::api::resource::v1::ResourceClaim;
    let mut out = Vec::new();
    for preemption in preemptions {
        let claim = preemption.resource_claim.as_str();
        if prepared
            .iter()
            .any(|c| c.resource_claim.as_deref() == Some(claim))
        {
            continue;
        }
        let Some((namespace, name)) = claim.split_once('/') else {
            continue;
        };
        let found = Api::<ResourceClaim>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await;
        let reserved = match found {
            Ok(found) => found
                .and_then(|c| c.status?.reserved_for)
                .unwrap_or_default(),
            Err(e) => {
                tracing::warn!("ResourceClaim {claim} (a preemption's victim): {e}");
                continue;
            }
        };
        for holder in reserved.iter().filter(|r| r.resource == "pods") {
            out.push(Eviction {
                pod: format!("{namespace}/{}", holder.name),
                uid: holder.uid.clone(),
                note: format!(
                    "{}; its slice was never prepared on this node, so nothing ran there to checkpoint",
                    preemption.reason
                ),
                cause: if preemption.for_pod.is_empty() {
                    "compaction"
                } else {
                    "preemption"
                },
                checkpoint: "none",
            });
        }
    }
    out
}

/// The DRA device names of the slices in `before` that `after` no longer has as they were (gone,
/// or cut to another size): a claim allocated on one of them refers to a slice that is not there.
pub(super) fn recut_devices(
    before: &[gpuslice_contract::slice::SliceConfig],
    after: &[gpuslice_contract::slice::SliceConfig],
) -> std::collections::BTreeSet<String> {
    before
        .iter()
        .filter(|old| !after.contains(old))
        .map(|old| gpuslice_api::dra::device_name(&old.id))
        .collect()
}

/// The pods whose claims were allocated on slices of this node that a pass re-cut before the
/// claim was prepared (no kubelet had started them, or none runs there): nothing ran on the old
/// slice and nothing could checkpoint, and preparing the claim would fail or give the pod a slice
/// of another size, so they are asked to be evicted at once and their controllers make new pods.
/// Such claims are remembered by UID in `stale` (the new slices may reuse the device names) and
/// asked for on every pass until they are gone.
pub(super) async fn stale_allocations(
    client: &Client,
    node: &str,
    recut: &std::collections::BTreeSet<String>,
    prepared: &[crate::workloads::claims::Claim],
    stale: &mut std::collections::BTreeSet<String>,
) -> Vec<Eviction> {
    use gpuslice_api::k8s_openapi::api::resource::v1::ResourceClaim;
    if recut.is_empty() && stale.is_empty() {
        return Vec::new();
    }
    let claims = match Api::<ResourceClaim>::all(client.clone())
        .list(&Default::default())
        .await
    {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!("listing ResourceClaims (allocated on re-cut slices): {e}");
            return Vec::new();
        }
    };
    let mut still = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for claim in claims {
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let key = format!(
            "{namespace}/{}",
            claim.metadata.name.clone().unwrap_or_default()
        );
        let Some(status) = claim.status else { continue };
        let on_recut = status
            .allocation
            .and_then(|a| a.devices)
            .map(|d| d.results)
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .filter(|r| r.driver == gpuslice_api::dra::DRIVER && r.pool == node)
            .find(|r| recut.contains(&r.device))
            .map(|r| r.device);
        let is_prepared = prepared
            .iter()
            .any(|c| c.resource_claim.as_deref() == Some(key.as_str()));
        if is_prepared || !(stale.contains(&uid) || on_recut.is_some()) {
            continue;
        }
        still.insert(uid);
        let device = on_recut.map_or_else(String::new, |d| format!(" {d}"));
        for holder in status
            .reserved_for
            .unwrap_or_default()
            .iter()
            .filter(|r| r.resource == "pods")
        {
            out.push(Eviction {
                pod: format!("{namespace}/{}", holder.name),
                uid: holder.uid.clone(),
                note: format!(
                    "its slice{device} on {node} was re-cut for a new layout before it was prepared; nothing ran there to checkpoint"
                ),
                cause: "window",
                checkpoint: "none",
            });
        }
    }
    *stale = still;
    out
}

/// Pods whose processes the watchdog stopped for using a pool's GPU past every slice (by UID,
/// from their cgroups): asked to be evicted while any of their processes still runs here, so
/// that a container restarted by its pod does not take the GPU again. The operator finds each
/// among the node's pods by its UID (the agent may not read pods).
#[derive(Clone, Default)]
pub(super) struct StrayPods(
    std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Eviction>>>,
);

impl StrayPods {
    /// Takes a watchdog report: a stray process of a pod that the watchdog stops.
    pub(super) fn take(&self, report: &crate::protections::watchdog::Report) {
        use crate::protections::watchdog::{Finding, Step};
        let Finding::Stray(stray) = &report.finding else {
            return;
        };
        let Some(uid) = &stray.pod else {
            return;
        };
        if report.step == Step::Reported {
            return;
        }
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(uid.clone())
            .or_insert_with(|| Eviction {
                pod: String::new(),
                uid: uid.clone(),
                note: report.text(),
                cause: "stray",
                checkpoint: "none",
            });
    }

    /// The pods still asked for: those with a process on the node.
    pub(super) fn still_running(&self) -> Vec<Eviction> {
        let mut strays = self.0.lock().unwrap_or_else(|p| p.into_inner());
        strays.retain(|uid, _| {
            !crate::workloads::process::of_pods(std::slice::from_ref(uid)).is_empty()
        });
        strays.values().cloned().collect()
    }
}

/// Counts and logs the pods this pass asks the operator to evict (in the GpuNode's status), each
/// once while it is asked for.
pub(super) fn ask_evictions(
    metrics: &super::Metrics,
    evictions: &[Eviction],
    asked: &mut std::collections::BTreeSet<String>,
) {
    // A stray's pod is known by its UID only.
    let key = |e: &Eviction| {
        if e.pod.is_empty() {
            format!("with UID {}", e.uid)
        } else {
            e.pod.clone()
        }
    };
    asked.retain(|p| evictions.iter().any(|e| key(e) == *p));
    for eviction in evictions {
        if asked.insert(key(eviction)) {
            tracing::info!(
                "asking the operator to evict pod {}: {}",
                key(eviction),
                eviction.note
            );
            metrics.count_eviction(eviction);
        }
    }
}
