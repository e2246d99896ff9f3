//! Workloads through DRA at scale, on a private control plane (API server, scheduler,
//! controller-manager, etcd, kwok): N kwok nodes × 8 A100s in pool shared-a100 (four software
//! slices each by day, two at night), the real operator, and one simulated agent per node in this
//! process. A simulated agent does what the real one does in the cluster minus the GPUs: it
//! reports its GPUs, and on each GpuNode change builds its devices and publishes them with the
//! agent's own code (`gpuslice_node::cluster::dra::devices`, `gpuslice_node::cluster::Publisher`), then
//! reports the spec as applied.
//!
//! Measures: the time for every agent to publish its devices once the pool is applied; the time
//! for kube-scheduler to place P pods that each ask for a slice by the `notebook` policy's
//! extended resource (through DRA), and the same P pods asking for a plain extended resource the
//! nodes advertise (a device plugin's way, the baseline); the API server's peak memory; and a
//! window change: from the 20:00 boundary to every node re-cut and republished. Prints a table
//! with PASS/FAIL; exits non-zero on a FAIL.
//!
//!     cargo build --release && cargo run --release -p gpuslice-testcluster --bin dra-scale -- \
//!         --gpuslice target/release/gpuslice [--nodes 1000] [--pods 10000] [--api-qps 500]
//!
//! The scheduler and the controller-manager run with `--kube-api-qps` 500 (burst 1000), as large
//! clusters set them: at their defaults (50 and 20) a DRA pod's three writes (its claim, the
//! claim's allocation, the binding) against the baseline's one would measure the client-side
//! rate limit, not the scheduler.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use gpuslice_api::GpuNode;
use gpuslice_testcluster::ControlPlane;
use gpuslice_testcluster::scale::{
    GPUS, allocated_devices, arg, clock_at, cpu_seconds, create_gpu_nodes, create_pods, operator,
    peak_memory_mib, remove, simulated_agents, start_cluster,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};

/// Objects kept from one watch (with the task that feeds them): listing 1,000 ResourceSlices
/// every quarter second would itself load the API server that the measurement is about.
fn watched<K>(api: Api<K>) -> (Store<K>, tokio::task::JoinHandle<()>)
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    let task = tokio::spawn(async move {
        futures::pin_mut!(stream);
        while stream.next().await.is_some() {}
    });
    (reader, task)
}

/// Every device of our driver: its memory capacity, counted.
fn devices_by_memory(slices: &Store<ResourceSlice>) -> BTreeMap<String, usize> {
    let mut count = BTreeMap::new();
    for s in slices.state() {
        for d in s.spec.devices.iter().flatten() {
            let memory = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|c| c.value.0.clone())
                .unwrap_or_default();
            *count.entry(memory).or_default() += 1;
        }
    }
    count
}

/// Waits until `want` devices of `memory` are published (and no others); the time it took.
async fn wait_for_devices(
    slices: &Store<ResourceSlice>,
    memory: &str,
    want: usize,
    since: Instant,
    limit: Duration,
) -> Option<Duration> {
    while since.elapsed() < limit {
        let count = devices_by_memory(slices);
        if count.len() == 1 && count.get(memory) == Some(&want) {
            return Some(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Waits until every GpuNode's spec lays its GPUs out in slices of `memory` (the operator wrote
/// them all); the time it took.
async fn wait_for_specs(
    reader: &Store<GpuNode>,
    memory: &str,
    nodes: usize,
    since: Instant,
    limit: Duration,
) -> Option<Duration> {
    let want = gpuslice_api::bytes_of(memory).ok();
    let mut done = None;
    while since.elapsed() < limit {
        let laid_out = reader
            .state()
            .iter()
            .filter(|n| {
                !n.spec.gpus.is_empty()
                    && n.spec.gpus.iter().all(|g| {
                        g.assigned
                            .layout
                            .software
                            .as_ref()
                            .is_some_and(|t| gpuslice_api::bytes_of(&t.memory.0).ok() == want)
                    })
            })
            .count();
        if laid_out == nodes {
            done = Some(since.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done
}

/// Creates `count` pods labelled `bench=<label>` asking for `resource`, and waits until all are
/// bound; the time from the first create to the last bind.
async fn place(
    client: &kube::Client,
    label: &str,
    resource: &str,
    count: usize,
    limit: Duration,
) -> Option<Duration> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let selector = format!("bench={label}");
    let bound = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let watch = {
        let (pods, selector, bound) = (pods.clone(), selector.clone(), bound.clone());
        tokio::spawn(async move {
            let stream = watcher(pods, watcher::Config::default().labels(&selector));
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                if let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = event
                    && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                {
                    bound
                        .lock()
                        .expect("not poisoned")
                        .insert(p.metadata.name.unwrap_or_default());
                }
            }
        })
    };
    let start = Instant::now();
    let created = (0..count).map(|i| {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{label}-{i:05}"), "labels": {"bench": label}},
            "spec": {
                "containers": [{"name": "main", "image": "example.com/notebook:1",
                    "resources": {"limits": {resource: "1"}}}],
                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            }
        }))
        .expect("a pod")
    });
    create_pods(&pods, created).await;
    let mut done = None;
    while start.elapsed() < limit {
        if bound.lock().expect("not poisoned").len() >= count {
            done = Some(start.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    watch.abort();
    done
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let gpuslice =
        PathBuf::from(arg("--gpuslice").unwrap_or_else(|| "target/release/gpuslice".into()));
    let nodes: usize = arg("--nodes").map_or(Ok(1000), |n| n.parse())?;
    let pod_count: usize = arg("--pods").map_or(Ok(10_000), |n| n.parse())?;
    let devices_by_day = nodes * GPUS as usize * 4;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let qps: u32 = arg("--api-qps").map_or(Ok(500), |n| n.parse())?;
    let (cluster, client) = start_cluster(&root, qps).await?;

    // The nodes, with a plain extended resource for the baseline, and their agents' GpuNodes.
    let setup = Instant::now();
    create_gpu_nodes(
        &cluster,
        &client,
        nodes,
        &[("gpuslice.io/pool", "shared-a100")],
        &[("example.com/slice", "32")],
    )
    .await;
    eprintln!(
        "{nodes} nodes with their GPUs in {:.1} s",
        setup.elapsed().as_secs_f64()
    );

    // 17:00 in Shanghai: four 20 GiB slices per GPU.
    let mut operator_process = operator(&gpuslice, &cluster, "2026-12-02T09:00:00Z")?;
    // The agents' clocks follow the operator's (the window change below moves both).
    let (agents_clock, clock) = tokio::sync::watch::channel(clock_at("2026-12-02T09:00:00Z"));
    let agents = simulated_agents(client.clone(), 64, clock);
    let (slices, _slices_watch) = watched(Api::<ResourceSlice>::all(client.clone()));
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await?;
    let start = Instant::now();
    for file in [
        "examples/gitops/policies/checkpoint-standard.yaml",
        "examples/gitops/pools/shared-a100.yaml",
        "examples/gitops/policies/notebook.yaml",
    ] {
        let doc: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(root.join(file))?)?;
        gpuslice_testcluster::apply_document(&client, &discovery, &doc, false)
            .await
            .ok_or("unknown kind")??;
    }
    let published = wait_for_devices(
        &slices,
        "20Gi",
        devices_by_day,
        start,
        Duration::from_secs(300),
    )
    .await;
    eprintln!("published: {published:?}");
    let classes: Api<DeviceClass> = Api::all(client.clone());
    while classes.get_opt("notebook.gpuslice.io").await?.is_none() {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let limit = Duration::from_secs(1200);
    let baseline = place(&client, "plain", "example.com/slice", pod_count, limit).await;
    eprintln!("baseline: {baseline:?}");
    remove(&client, "plain").await?;
    let dra = place(&client, "dra", "gpuslice.io/notebook", pod_count, limit).await;
    eprintln!("dra: {dra:?}");
    // No device given twice.
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let allocated = allocated_devices(&client).await?;
    let results = allocated.len();
    let given: BTreeSet<_> = allocated.into_iter().collect();
    let apiserver_memory = cluster
        .pid("kube-apiserver")
        .map_or(f64::NAN, peak_memory_mib);

    // The window change: the pods gone, a fresh operator 10 s before 20:00 in Shanghai (its first
    // passes change nothing), then two 40 GiB slices per GPU everywhere.
    remove(&client, "dra").await?;
    // And their claims, which kube-controller-manager deletes after them: the window change is
    // measured on a quiet cluster, not against the last phase's clean-up.
    let quiet = Instant::now();
    while !claims
        .list_metadata(&ListParams::default().limit(1))
        .await?
        .items
        .is_empty()
    {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("claims gone {:?} after the pods", quiet.elapsed());
    drop(operator_process);
    // Its lease goes with it, so that the new one leads at once (a failover is not measured).
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    leases
        .delete("gpuslice-operator", &DeleteParams::default())
        .await?;
    operator_process = operator(&gpuslice, &cluster, "2026-12-02T11:59:50Z")?;
    let _ = agents_clock.send(clock_at("2026-12-02T11:59:50Z"));
    let boundary = Instant::now() + Duration::from_secs(10);
    // Watched from before the boundary: listing 1,000 GpuNodes after it would load the API
    // server during the very change measured.
    let (gpu_node_store, gpu_node_watch) = watched(Api::<GpuNode>::all(client.clone()));
    tokio::time::sleep_until(boundary.into()).await;
    // Who spends the two cores while the nodes switch: CPU seconds from the boundary until every
    // node is republished.
    let components = [
        "kube-apiserver",
        "etcd",
        "kube-scheduler",
        "kube-controller-manager",
        "kwok",
    ];
    let operator_pid = operator_process.0.id();
    let cpu_now = |cluster: &ControlPlane| -> Vec<f64> {
        components
            .iter()
            .map(|c| cluster.pid(c).map_or(f64::NAN, cpu_seconds))
            .chain([cpu_seconds(operator_pid), cpu_seconds(std::process::id())])
            .collect()
    };
    let cpu_at_boundary = cpu_now(&cluster);
    // GPUSLICE_BENCH_APISERVER_PROFILE=FILE: the API server's CPU profile over the 12 s after the
    // boundary (pprof; read it with `go tool pprof -top FILE`).
    let profile = std::env::var_os("GPUSLICE_BENCH_APISERVER_PROFILE").map(|file| {
        let d = cluster.dir();
        std::process::Command::new("curl")
            .args(["-sS", "--cacert"])
            .arg(d.join("ca.crt"))
            .arg("--cert")
            .arg(d.join("admin.crt"))
            .arg("--key")
            .arg(d.join("admin.key"))
            .arg("-o")
            .arg(file)
            .arg(format!(
                "{}/debug/pprof/profile?seconds=12",
                cluster.server()
            ))
            .spawn()
    });
    let (specs, recut) = tokio::join!(
        wait_for_specs(
            &gpu_node_store,
            "40Gi",
            nodes,
            boundary,
            Duration::from_secs(120)
        ),
        async {
            let recut = wait_for_devices(
                &slices,
                "40Gi",
                devices_by_day / 2,
                boundary,
                Duration::from_secs(120),
            )
            .await;
            let spent: Vec<String> = cpu_now(&cluster)
                .iter()
                .zip(&cpu_at_boundary)
                .zip(components.iter().chain(&["operator", "this benchmark"]))
                .map(|((after, before), who)| format!("{who} {:.1}", after - before))
                .collect();
            eprintln!(
                "window change: CPU seconds until republished: {}",
                spent.join(", ")
            );
            recut
        }
    );
    eprintln!("window change: every GpuNode spec written after {specs:?}");
    gpu_node_watch.abort();
    if let Some(Ok(mut curl)) = profile {
        let _ = curl.wait();
    }
    let operator_memory = peak_memory_mib(operator_process.0.id());
    drop(operator_process);
    agents.abort();

    let secs = |d: Option<Duration>| d.map_or(f64::INFINITY, |d| d.as_secs_f64());
    let ratio = secs(dra) / secs(baseline);
    println!(
        "workloads through DRA: {nodes} nodes × {GPUS} A100 × 4 software slices ({devices_by_day} devices), {pod_count} pods, scheduler at {qps} QPS"
    );
    println!("{:<58} {:>10} {:>10}", "", "measured", "target");
    let rows: [(&str, f64, Option<f64>); 8] = [
        (
            "every agent published its devices (s)",
            secs(published),
            Some(60.0),
        ),
        (
            "pods placed, plain extended resource (s)",
            secs(baseline),
            None,
        ),
        ("pods placed through DRA (s)", secs(dra), None),
        ("DRA / plain", ratio, Some(5.0)),
        (
            "API server peak memory (MiB)",
            apiserver_memory,
            Some(4096.0),
        ),
        (
            "window change: boundary → every GpuNode spec caught up (s)",
            secs(specs),
            None,
        ),
        (
            "window change: boundary → all re-cut, republished (s)",
            secs(recut),
            Some(10.0),
        ),
        (
            "operator peak memory after the window change (MiB)",
            operator_memory,
            Some(150.0),
        ),
    ];
    let mut failed = false;
    for (what, value, target) in rows {
        let verdict = match target {
            Some(t) if value <= t => "PASS",
            Some(_) => {
                failed = true;
                "FAIL"
            }
            None => "",
        };
        let target = target.map(|t| format!("≤ {t}")).unwrap_or_default();
        println!("{what:<58} {value:>10.2} {target:>10}  {verdict}");
    }
    let unique = given.len() == results && results == pod_count;
    println!(
        "{:<58} {:>10} {:>10}  {}",
        "devices allocated, each to one pod",
        format!("{}/{}", given.len(), results),
        pod_count,
        if unique { "PASS" } else { "FAIL" }
    );
    failed |= !unique;
    // Returned, not exited: the control plane's folder and processes go on drop.
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
