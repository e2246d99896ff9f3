//! What the scale benchmarks share: their command line, the operator they start, simulated
//! agents of A100 nodes (reporting GPUs and publishing devices with the agent's own code), and
//! removing their pods.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use gpuslice_api::{GpuAssignment, GpuNode, GpuNodeStatus, NodeInventory};
use gpuslice_node::cluster::Publisher;
pub use gpuslice_runtime::clock::Clock;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
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

/// CPU time (user + system) a process has used so far, seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    // SAFETY: sysconf only reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // After the command name (which may hold spaces), utime and stime are the 12th and
            // 13th fields.
            let rest = s.rsplit_once(')')?.1;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            Some(fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?)
        })
        .map_or(f64::NAN, |t| t / ticks)
}

/// A clock that reads `start` (RFC 3339) now, as `GPUSLICE_CLOCK_START` makes the operator's.
pub fn clock_at(start: &str) -> Clock {
    Clock::starting_at(start.parse().expect("an RFC 3339 instant"))
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

/// The inventory with `gpus`' software layouts in force, as the agent reads it back after
/// applying them.
pub fn applied(node: &str, gpus: &[GpuAssignment]) -> NodeInventory {
    let mut inventory = inventory(node);
    for gpu in &mut inventory.gpus {
        let Some(software) = gpus
            .iter()
            .find(|a| a.index == gpu.index)
            .and_then(|a| a.assigned.layout.software.as_ref())
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
                mps: false,
                processes: Vec::new(),
            })
            .collect();
    }
    inventory
}

/// One simulated agent per node, on `clock` (the operator's; the benchmark may move it): what
/// each GpuNode's spec puts in force — at once, or at a staged switch when the agent's clock
/// reaches it — is published (at most `parallel` nodes at once, as the API server would
/// otherwise refuse some) and reported applied, as the real agent does.
pub fn simulated_agents(
    client: kube::Client,
    parallel: usize,
    mut clock: tokio::sync::watch::Receiver<Clock>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<GpuNode> = Api::all(client.clone());
        let mut publishers: BTreeMap<String, Arc<tokio::sync::Mutex<Publisher>>> = BTreeMap::new();
        // Each node's spec as last seen, and the (generation, GPUs in force) last handled.
        let mut seen: BTreeMap<String, GpuNode> = BTreeMap::new();
        let mut handled: BTreeMap<String, (Option<i64>, Vec<GpuAssignment>)> = BTreeMap::new();
        let limit = Arc::new(tokio::sync::Semaphore::new(parallel));
        let stream = watcher(api.clone(), watcher::Config::default());
        futures::pin_mut!(stream);
        loop {
            let now = clock.borrow().now();
            let switch = seen.values().filter_map(|n| n.spec.next_switch(now)).min();
            let until = switch.map_or(Duration::from_secs(3600), |at| clock.borrow().until(at));
            // A changed GpuNode is looked at alone; a switch due (or a moved clock), all of them.
            let changed: Option<String> = tokio::select! {
                event = stream.next() => match event {
                    Some(Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n))) => {
                        let name = n.metadata.name.clone().unwrap_or_default();
                        seen.insert(name.clone(), n);
                        Some(name)
                    }
                    Some(_) => continue,
                    None => return,
                },
                _ = tokio::time::sleep(until) => None,
                moved = clock.changed() => {
                    if moved.is_err() {
                        return;
                    }
                    None
                }
            };
            let now = clock.borrow().now();
            let nodes = seen
                .iter()
                .filter(|(name, _)| changed.as_ref().is_none_or(|c| c == *name));
            for (name, node) in nodes {
                let in_force = node.spec.in_force(now).gpus;
                let key = (node.metadata.generation, in_force);
                if key.1.is_empty() || handled.get(name) == Some(&key) {
                    continue;
                }
                handled.insert(name.clone(), key.clone());
                let publisher = publishers
                    .entry(name.clone())
                    .or_insert_with(|| {
                        Arc::new(tokio::sync::Mutex::new(Publisher::new(
                            client.clone(),
                            name,
                        )))
                    })
                    .clone();
                let (api, limit, name) = (api.clone(), limit.clone(), name.clone());
                let reported = node.status.clone().unwrap_or_default();
                let switched = node.spec.last_switch(now).and_then(gpuslice_api::time_of);
                tokio::spawn(async move {
                    let _turn = limit.acquire().await;
                    let (generation, gpus) = key;
                    let inventory = applied(&name, &gpus);
                    let devices =
                        gpuslice_node::cluster::dra::devices(&inventory, &gpus, &|_, _| {
                            Some(Vec::new())
                        });
                    publisher.lock().await.publish(devices).await;
                    let status = GpuNodeStatus {
                        inventory: Some(inventory),
                        applied_generation: generation,
                        applied_switch: switched,
                        ..Default::default()
                    };
                    // As the real agent: no write when the status says it already, and after
                    // a staged switch none until the operator's catch-up (the agent's fallback
                    // 40 s later is not simulated: the catch-up comes at 20 s).
                    let unchanged = status.inventory == reported.inventory
                        && status.applied_switch == reported.applied_switch;
                    let switched_only = status.applied_switch.is_some();
                    if status.applied_generation == reported.applied_generation
                        && (unchanged || switched_only)
                    {
                        return;
                    }
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

/// A private control plane with every component (the scheduler and controller-manager at
/// `api_qps`), its client, and the CRDs in `root/crds` installed.
pub async fn start_cluster(
    root: &Path,
    api_qps: u32,
) -> Result<(ControlPlane, kube::Client), Box<dyn std::error::Error>> {
    let cluster = ControlPlane::start(crate::Components {
        api_qps: Some(api_qps),
        ..crate::Components::all()
    })
    .await?
    .ok_or("no control-plane binaries: run tests/controlplane/build.sh")?;
    let client = cluster.client().await?;
    crate::install_crds(&client, &root.join("crds")).await?;
    Ok((cluster, client))
}

/// `count` kwok nodes `a100-NNNN` with `labels` and extended resources `capacity`, each with the
/// GpuNode and inventory its agent would report (32 nodes at once).
pub async fn create_gpu_nodes(
    cluster: &ControlPlane,
    client: &kube::Client,
    count: usize,
    labels: &[(&str, &str)],
    capacity: &[(&str, &str)],
) {
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    let agent = PatchParams::apply("gpuslice-agent").force();
    futures::stream::iter(0..count)
        .map(|i| {
            let (gpu_nodes, agent) = (gpu_nodes.clone(), agent.clone());
            async move {
                let name = format!("a100-{i:04}");
                cluster
                    .create_node(&name, labels, capacity)
                    .await
                    .expect("a node");
                let object = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": name}, "spec": {}});
                gpu_nodes
                    .patch(&name, &agent, &Patch::Apply(&object))
                    .await
                    .expect("a GpuNode");
                let status = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": name}, "status": {"inventory": inventory(&name)}});
                gpu_nodes
                    .patch_status(&name, &agent, &Patch::Apply(&status))
                    .await
                    .expect("its inventory");
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

/// Creates `pods` (32 at once), each asked again until it is created or already exists.
pub async fn create_pods(api: &Api<Pod>, pods: impl Iterator<Item = Pod>) {
    futures::stream::iter(pods)
        .map(|pod| {
            let api = api.clone();
            async move {
                while let Err(e) = api.create(&PostParams::default(), &pod).await {
                    if matches!(&e, kube::Error::Api(s) if s.code == 409) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

/// The (pool, device) of every allocation result of the ResourceClaims in `default`.
pub async fn allocated_devices(
    client: &kube::Client,
) -> Result<Vec<(String, String)>, kube::Error> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    Ok(claims
        .list(&ListParams::default())
        .await?
        .into_iter()
        .flat_map(|c| {
            c.status
                .and_then(|s| s.allocation)
                .and_then(|a| a.devices)
                .and_then(|d| d.results)
                .unwrap_or_default()
        })
        .map(|r| (r.pool, r.device))
        .collect())
}
