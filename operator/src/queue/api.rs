//! The queue's writes to the API server, one object each: a pod admitted, a node's preemptions,
//! a pool's fair share and compaction round, a waiting pod's condition, a policy's
//! ResourceClaimTemplate.

use gpuslice_api::{FairShareStatus, GpuNode, GpuPool, Preemption};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt as _};

use super::{CONDITION, GATE, MANAGER};

/// Sends the admitted pod to `node` and lifts its gate.
pub(super) async fn admit(client: &Client, pod: &Pod, node: &str) -> Result<(), kube::Error> {
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
pub(super) async fn take_back(
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

/// Records the namespaces' use of a pool (its own field manager on the pool's status).
pub(super) async fn record_fair_share(
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
pub(super) async fn record_compaction(
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

pub(super) async fn tell(
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

/// Writes a policy's ResourceClaimTemplate. Its spec cannot change, so one of an older count is
/// replaced (claims made from it keep theirs).
pub(super) async fn apply_claim_template(
    client: &Client,
    template: &ResourceClaimTemplate,
) -> Result<(), kube::Error> {
    let api: Api<ResourceClaimTemplate> =
        Api::namespaced(client.clone(), &template.namespace().unwrap_or_default());
    let name = template.name_any();
    let mut body = serde_json::to_value(template).unwrap_or_default();
    body["apiVersion"] = "resource.k8s.io/v1".into();
    body["kind"] = "ResourceClaimTemplate".into();
    let params = PatchParams::apply(MANAGER).force();
    match api.patch(&name, &params, &Patch::Apply(&body)).await {
        Err(kube::Error::Api(e)) if e.code == 422 => {
            api.delete(&name, &Default::default()).await?;
            api.patch(&name, &params, &Patch::Apply(&body)).await?;
        }
        other => {
            other?;
        }
    }
    Ok(())
}
