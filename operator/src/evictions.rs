//! The evictions agents ask for (`GpuNode.status.evictions`): the operator carries them out
//! through the Eviction API (disruption budgets and grace periods apply) once it has checked that
//! the pod runs on the asking agent's node. Agents hold no eviction right of their own, so an
//! agent, compromised or wrong, reaches no pod beyond its node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuslice_api::{EvictionRequest, GpuNode};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, EvictParams, ListParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt as _};

use crate::MANAGER;
use crate::election::Leadership;

/// How often the agents' requests are looked at.
const PACE: Duration = Duration::from_millis(500);
/// How soon a request still standing (its pod not gone, a budget refused it) is tried again.
const RETRY: Duration = Duration::from_secs(5);

/// What to do with one request, from the pod as the API server has it.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    Evict,
    /// No such pod, or a new pod under the old name: nothing to do.
    Gone,
    /// Already being deleted.
    Terminating,
    /// Not the asking node's pod: never evicted for it.
    Refuse(String),
}

/// Decides a request of the agent of `node` against the pod (`None`: not found).
pub fn verdict(node: &str, request: &EvictionRequest, pod: Option<&Pod>) -> Verdict {
    let Some(pod) = pod else {
        return Verdict::Gone;
    };
    if !request.uid.is_empty() && pod.metadata.uid.as_deref() != Some(request.uid.as_str()) {
        return Verdict::Gone;
    }
    let runs_on = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if runs_on != Some(node) {
        return Verdict::Refuse(format!(
            "the agent of GpuNode {node} asked to evict pod {}, which runs on {}: refused (an agent may only have its own node's pods evicted)",
            request.pod,
            runs_on.map_or("no node".to_string(), |n| format!("node {n}"))
        ));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Verdict::Terminating;
    }
    Verdict::Evict
}

/// The reason of the Event an evicted pod gets, by the request's cause.
fn reason(cause: &str) -> &'static str {
    match cause {
        "preemption" => "Preempted",
        "compaction" => "Compacted",
        "fault" => "GpuFault",
        "stray" => "GpuProcessWithoutSlice",
        _ => "Resliced",
    }
}

/// Carries out the agents' requests while this operator leads, until the process ends.
pub async fn run(client: Client, leadership: Leadership, gpu_nodes: Store<GpuNode>) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    // (node, pod, uid) → when it was last tried, and whether a refusal was said.
    let mut tried: BTreeMap<(String, String, String), (Instant, bool)> = BTreeMap::new();
    loop {
        tokio::time::sleep(PACE).await;
        if !leadership.is_leader() {
            continue;
        }
        let wanted: Vec<(String, EvictionRequest)> = gpu_nodes
            .state()
            .iter()
            .flat_map(|n| {
                let node = n.name_any();
                n.status
                    .iter()
                    .flat_map(|s| s.evictions.clone())
                    .map(move |e| (node.clone(), e))
            })
            .collect();
        tried.retain(|(node, pod, uid), _| {
            wanted
                .iter()
                .any(|(n, e)| n == node && e.pod == *pod && e.uid == *uid)
        });
        for (node, request) in wanted {
            let key = (node.clone(), request.pod.clone(), request.uid.clone());
            let said = match tried.get(&key) {
                Some((at, _)) if at.elapsed() < RETRY => continue,
                Some((_, said)) => *said,
                None => false,
            };
            let refused = evict(&client, &recorder, &node, &request, said).await;
            tried.insert(key, (Instant::now(), said || refused));
        }
    }
}

/// The pod (`namespace/name`) with this UID among the pods bound to `node`: an agent names the
/// pod of a stray process by its cgroup's UID only.
async fn pod_by_uid(client: &Client, node: &str, uid: &str) -> Option<String> {
    if uid.is_empty() {
        return None;
    }
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let pods = Api::<Pod>::all(client.clone())
        .list_metadata(&on_node)
        .await
        .inspect_err(|e| tracing::warn!("listing the pods of node {node}: {e}"))
        .ok()?;
    let pod = pods
        .items
        .into_iter()
        .find(|p| p.metadata.uid.as_deref() == Some(uid))?;
    Some(format!(
        "{}/{}",
        pod.metadata.namespace?, pod.metadata.name?
    ))
}

/// Evicts one requested pod if it is the node's; says a refusal (once: `said`). Returns whether
/// it was refused.
async fn evict(
    client: &Client,
    recorder: &Recorder,
    node: &str,
    request: &EvictionRequest,
    said: bool,
) -> bool {
    let named = match request.pod.as_str() {
        "" => pod_by_uid(client, node, &request.uid).await,
        pod => Some(pod.to_string()),
    };
    let Some(named) = named else {
        return false;
    };
    let request = &EvictionRequest {
        pod: named,
        ..request.clone()
    };
    let Some((namespace, name)) = request.pod.split_once('/') else {
        return false;
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = match pods.get_opt(name).await {
        Ok(pod) => pod,
        Err(e) => {
            tracing::warn!("pod {}: {e}", request.pod);
            return false;
        }
    };
    let regarding = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: pod.as_ref().and_then(|p| p.metadata.uid.clone()),
        ..ObjectReference::default()
    };
    match verdict(node, request, pod.as_ref()) {
        Verdict::Gone | Verdict::Terminating => false,
        Verdict::Refuse(why) => {
            if !said {
                tracing::warn!("{why}");
            }
            true
        }
        Verdict::Evict => match pods.evict(name, &EvictParams::default()).await {
            Ok(_) => {
                tracing::info!(
                    "evicted pod {} for node {node}: {}",
                    request.pod,
                    request.message
                );
                let event = Event {
                    type_: EventType::Warning,
                    reason: reason(&request.cause).into(),
                    note: Some(format!("evicted by gpuslice: {}", request.message)),
                    action: "Evict".into(),
                    secondary: None,
                };
                if let Err(e) = recorder.publish(&event, &regarding).await {
                    tracing::warn!("pod {}: recording the eviction: {e}", request.pod);
                }
                false
            }
            Err(kube::Error::Api(e)) if e.code == 404 => false,
            Err(e) => {
                // A disruption budget (429) or anything else: tried again while it is asked for.
                if !said {
                    tracing::warn!("evicting pod {} for node {node}: {e}", request.pod);
                    let event = Event {
                        type_: EventType::Warning,
                        reason: "EvictionRefused".into(),
                        note: Some(format!(
                            "gpuslice needs this pod's slice back ({}) and will try again: {e}",
                            request.message
                        )),
                        action: "Evict".into(),
                        secondary: None,
                    };
                    if let Err(e) = recorder.publish(&event, &regarding).await {
                        tracing::warn!("pod {}: recording the refusal: {e}", request.pod);
                    }
                }
                true
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(node: Option<&str>, uid: &str, deleting: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "trainer",
                "namespace": "ml",
                "uid": uid,
                "deletionTimestamp": deleting.then_some("2026-12-06T10:00:00Z"),
            },
            "spec": {"containers": [], "nodeName": node},
        }))
        .unwrap()
    }

    fn request(uid: &str) -> EvictionRequest {
        EvictionRequest {
            pod: "ml/trainer".into(),
            uid: uid.into(),
            cause: "preemption".into(),
            checkpoint: "taken".into(),
            message: "preempted".into(),
        }
    }

    #[test]
    fn only_the_asking_nodes_own_pod_is_evicted() {
        let on_a = pod(Some("gpu-a"), "u1", false);
        assert_eq!(
            verdict("gpu-a", &request("u1"), Some(&on_a)),
            Verdict::Evict
        );
        assert_eq!(verdict("gpu-a", &request(""), Some(&on_a)), Verdict::Evict);
        // The agent of another node, or a pod not yet bound.
        let Verdict::Refuse(why) = verdict("gpu-b", &request("u1"), Some(&on_a)) else {
            panic!("evicted for another node");
        };
        assert!(why.contains("runs on node gpu-a"), "{why}");
        assert!(matches!(
            verdict("gpu-a", &request("u1"), Some(&pod(None, "u1", false))),
            Verdict::Refuse(_)
        ));
        // A pod made again under the name, one gone, one already going.
        assert_eq!(verdict("gpu-a", &request("u0"), Some(&on_a)), Verdict::Gone);
        assert_eq!(verdict("gpu-a", &request("u1"), None), Verdict::Gone);
        assert_eq!(
            verdict(
                "gpu-a",
                &request("u1"),
                Some(&pod(Some("gpu-a"), "u1", true))
            ),
            Verdict::Terminating
        );
    }
}
