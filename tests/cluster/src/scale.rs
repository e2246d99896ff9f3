//! What the scale benchmarks share: their command line, the operator they start, simulated
//! agents of A100 nodes (reporting GPUs and publishing devices with the agent's own code), and
//! removing their pods.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use gpuslice_api::{GpuNode, GpuNodeStatus, NodeInventory};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::watcher;

use crate::{ControlPlane, KillOnDrop};

/// GPUs per simulated node.
pub const GPUS: u32 = 8;
const MODEL: &str = "NVIDIA A100-SXM4-80GB";

/// The value after `name` on the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A process's peak resident memory (VmHWM), MiB.
pub fn peak_memory_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// `gpuslice operator` against the cluster, on a clock started at `clock`.
pub fn operator(
    gpuslice: &Path,
    cluster: &ControlPlane,
    clock: &str,
) -> std::io::Result<KillOnDrop> {
    // GPUSLICE_BENCH_OPERATOR_LOG=FILE keeps the operator's log (appended), to see where a
    // benchmark's time goes.
    let log = match std::env::var_os("GPUSLICE_BENCH_OPERATOR_LOG") {
        Some(path) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => Stdio::null(),
    };
    Command::new(gpuslice)
        .arg("operator")
        .env("KUBECONFIG", cluster.kubeconfig_path())
        .env("GPUSLICE_CLOCK_START", clock)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(KillOnDrop)
}

/// The node's GPUs as its agent reports them.
pub fn inventory(node: &str) -> NodeInventory {
    serde_json::from_value(serde_json::json!({
        "name": node,
        "gpus": (0..GPUS).map(|i| serde_json::json!({
            "index": i, "model": MODEL, "uuid": format!("GPU-{node}-{i}"),
        })).collect::<Vec<_>>(),
    }))
    .expect("an inventory")
}

/// The inventory with the spec's software layouts in force, as the agent reads it back after
/// applying them.
pub fn applied(node: &GpuNode) -> NodeInventory {
    let name = node.metadata.name.clone().unwrap_or_default();
    let mut inventory = inventory(&name);
    for gpu in &mut inventory.gpus {
        let Some(software) = node
            .spec
            .gpus
            .iter()
            .find(|a| a.index == gpu.index)
            .and_then(|a| a.layout.software.as_ref())
        else {
            continue;
        };
        gpu.slices = (0..software.slices)
            .map(|s| gpuslice_api::SoftwareSliceState {
                id: gpuslice_contract::slice::software_slice_id(gpu.index, s),
                memory: k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                    software.memory.0.clone(),
                ),
                compute: software.compute,
                processes: Vec::new(),
            })
            .collect();
    }
    inventory
}

/// One simulated agent per node: each GpuNode change is published (at most `parallel` at once,
/// as the API server would otherwise refuse some) and reported applied.
pub fn simulated_agents(client: kube::Client, parallel: usize) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<GpuNode> = Api::all(client.clone());
        let publishers: Arc<std::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<_>>>>> =
            Arc::default();
        let limit = Arc::new(tokio::sync::Semaphore::new(parallel));
        let stream = watcher(api.clone(), watcher::Config::default());
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            let node = match event {
                Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n)) => n,
                _ => continue,
            };
            let applied_generation = node.status.as_ref().and_then(|s| s.applied_generation);
            if node.spec.gpus.is_empty() || applied_generation == node.metadata.generation {
                continue;
            }
            let name = node.metadata.name.clone().unwrap_or_default();
            let publisher = publishers
                .lock()
                .expect("not poisoned")
                .entry(name.clone())
                .or_insert_with(|| {
                    Arc::new(tokio::sync::Mutex::new(
                        gpuslice_node::cluster::Publisher::new(client.clone(), &name),
                    ))
                })
                .clone();
            let (api, limit) = (api.clone(), limit.clone());
            tokio::spawn(async move {
                let _turn = limit.acquire().await;
                let inventory = applied(&node);
                let devices = gpuslice_node::dra::devices(&inventory, &node.spec.gpus, &|_, _| {
                    Some(Vec::new())
                });
                publisher.lock().await.publish(devices).await;
                let status = GpuNodeStatus {
                    inventory: Some(inventory),
                    applied_generation: node.metadata.generation,
                    ..Default::default()
                };
                let patch = serde_json::json!({
                    "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
                    "metadata": {"name": name}, "status": status,
                });
                let _ = api
                    .patch_status(
                        &name,
                        &PatchParams::apply("gpuslice-agent").force(),
                        &Patch::Apply(&patch),
                    )
                    .await;
            });
        }
    })
}

/// Deletes the pods labelled `bench=<label>` at once and waits until they are gone.
pub async fn remove(client: &kube::Client, label: &str) -> Result<(), kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let selector = ListParams::default().labels(&format!("bench={label}"));
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    // Thousands of pods outlast one request's timeout: ask again until none is left.
    loop {
        if let Err(e) = pods.delete_collection(&now, &selector).await {
            eprintln!("deleting pods {label}: {e} (asking again)");
        }
        match pods.list_metadata(&selector.clone().limit(1)).await {
            Ok(list) if list.items.is_empty() => return Ok(()),
            Ok(_) => {}
            Err(e) => eprintln!("listing pods {label}: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
