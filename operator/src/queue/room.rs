//! The nodes' CPU and memory as the placement engine counts them: each Node's allocatable
//! (`status.allocatable`), less what the pods bound there request and what the pods the queue
//! sent there (not bound yet) request. A pod narrowed to a node without that room would never
//! bind, so the queue sends none there.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpuslice_planning::queue::Room;
use k8s_openapi::api::core::v1::{Container, Node, Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt as _;
use kube::runtime::reflector::Store;

use super::cluster::admitted_to;

const MIB: u64 = 1 << 20;

fn millicores(q: Option<&Quantity>) -> u64 {
    q.and_then(|q| gpuslice_api::millicores_of(&q.0).ok())
        .unwrap_or(0)
}

fn mebibytes(q: Option<&Quantity>) -> u64 {
    q.and_then(|q| gpuslice_api::bytes_of(&q.0).ok())
        .map_or(0, |b| b.div_ceil(MIB))
}

/// CPU millicores and memory MiB a container requests.
fn requested(c: &Container) -> (u64, u64) {
    let requests = c.resources.as_ref().and_then(|r| r.requests.as_ref());
    (
        millicores(requests.and_then(|r| r.get("cpu"))),
        mebibytes(requests.and_then(|r| r.get("memory"))),
    )
}

/// What a pod takes of its node's CPU (millicores) and memory (MiB), as kube-scheduler counts
/// it: its containers' and native sidecars' (init containers with `restartPolicy: Always`)
/// requests summed, or an init container's with the sidecars started before it where that is
/// more, plus the pod's overhead.
pub fn requests(pod: &Pod) -> (u64, u64) {
    let Some(spec) = &pod.spec else {
        return (0, 0);
    };
    let add =
        |(c, m): (u64, u64), (dc, dm): (u64, u64)| (c.saturating_add(dc), m.saturating_add(dm));
    let mut sidecars = (0u64, 0u64);
    let mut init_peak = (0u64, 0u64);
    for init in spec.init_containers.iter().flatten() {
        if init.restart_policy.as_deref() == Some("Always") {
            sidecars = add(sidecars, requested(init));
        } else {
            let (c, m) = add(sidecars, requested(init));
            init_peak = (init_peak.0.max(c), init_peak.1.max(m));
        }
    }
    let running = spec.containers.iter().map(requested).fold(sidecars, add);
    let overhead = spec.overhead.as_ref();
    add(
        (running.0.max(init_peak.0), running.1.max(init_peak.1)),
        (
            millicores(overhead.and_then(|o| o.get("cpu"))),
            mebibytes(overhead.and_then(|o| o.get("memory"))),
        ),
    )
}

/// A container's CPU and memory requests, none when it requests neither.
pub fn cpu_and_memory_requests(c: &Container) -> Option<BTreeMap<String, Quantity>> {
    let requests: BTreeMap<String, Quantity> = c
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .iter()
        .filter(|(k, _)| *k == "cpu" || *k == "memory")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (!requests.is_empty()).then_some(requests)
}

/// Drops what the rooms never read of a pod bound to a node: all but its name, node,
/// containers' CPU and memory requests and overhead.
pub fn trim_bound_pod(pod: &mut Pod) {
    pod.metadata.labels = None;
    pod.metadata.annotations = None;
    pod.metadata.owner_references = None;
    pod.status = None;
    if let Some(spec) = pod.spec.take() {
        let strip = |c: Container| Container {
            resources: cpu_and_memory_requests(&c).map(|requests| ResourceRequirements {
                requests: Some(requests),
                ..Default::default()
            }),
            name: c.name,
            restart_policy: c.restart_policy,
            ..Default::default()
        };
        pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: spec.node_name,
            overhead: spec.overhead,
            containers: spec.containers.into_iter().map(strip).collect(),
            init_containers: spec
                .init_containers
                .map(|i| i.into_iter().map(strip).collect()),
            ..Default::default()
        });
    }
}

/// Each Node's room: allocatable less the requests of `bound` pods (every non-terminal pod
/// with a node) and of the `queued` pods the queue sent to it that are not bound yet.
pub(super) fn rooms(
    nodes: &Store<Node>,
    bound: &Store<Pod>,
    queued: &[Arc<Pod>],
) -> BTreeMap<String, Room> {
    let mut out: BTreeMap<String, Room> = BTreeMap::new();
    // A resource the Node does not state (or states unreadably) does not limit it.
    let unlimited = u64::MAX / 4;
    for node in nodes.state() {
        let Some(allocatable) = node.status.as_ref().and_then(|s| s.allocatable.as_ref()) else {
            continue;
        };
        let cpu = allocatable
            .get("cpu")
            .and_then(|q| gpuslice_api::millicores_of(&q.0).ok());
        let memory = allocatable
            .get("memory")
            .and_then(|q| gpuslice_api::bytes_of(&q.0).ok())
            .map(|b| b / MIB);
        out.insert(
            node.name_any(),
            Room::empty(cpu.unwrap_or(unlimited), memory.unwrap_or(unlimited)),
        );
    }
    let mut counted: BTreeSet<(String, String)> = BTreeSet::new();
    let mut take = |pod: &Pod, node: &str| {
        let key = (pod.namespace().unwrap_or_default(), pod.name_any());
        if !counted.insert(key) {
            return;
        }
        if let Some(room) = out.get_mut(node) {
            let (cpu, memory) = requests(pod);
            room.cpu_free_milli = room.cpu_free_milli.saturating_sub(cpu);
            room.memory_free_mib = room.memory_free_mib.saturating_sub(memory);
        }
    };
    for pod in bound.state() {
        if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
            take(&pod, &node);
        }
    }
    for pod in queued {
        if let Some(node) = admitted_to(pod) {
            take(pod, &node);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_takes_its_containers_and_sidecars_or_its_largest_init_step() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "initContainers": [
                    {"name": "mesh", "restartPolicy": "Always",
                     "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
                    {"name": "fetch", "resources": {"requests": {"cpu": "3", "memory": "128Mi"}}}
                ],
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "700m", "memory": "1Gi"}}},
                    {"name": "b", "resources": {"requests": {"cpu": "940m"}}}
                ],
                "overhead": {"cpu": "10m", "memory": "8Mi"}
            }
        }))
        .unwrap();
        // CPU: the init step (3000m + the sidecar's 100m) beats 700 + 940 + 100; memory: the
        // containers and the sidecar (1024 + 64) beat the init step (128 + 64); then overhead.
        assert_eq!(requests(&pod), (3110, 1096));
        let mut trimmed = pod.clone();
        trim_bound_pod(&mut trimmed);
        assert_eq!(requests(&trimmed), requests(&pod));
    }
}
