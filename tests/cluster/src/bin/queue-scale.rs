//! The admission queue at scale, on a private control plane (API server with the chart's
//! admission policies, scheduler, controller-manager, etcd, kwok): N kwok nodes × 8 A100s, GPUs
//! 0–5 whole (pool bench-whole) and GPUs 6–7 each cut into four 20 GiB slices (pool
//! bench-shared), the real operator, and simulated agents (`gpuslice_testcluster::scale`). P pods
//! take the Alibaba trace's GPU pod mix (`openb_pod_list_default.csv`, in creation order, repeated
//! as needed): a pod asking for a fraction of one GPU takes a slice (policy `quarter`), any other a
//! whole GPU (policy `whole`; multi-GPU pods take one). The cluster is sized so every pod fits.
//!
//! The same pods are placed twice: by kube-scheduler alone (each asks for its policy's extended
//! resource, no label, so no gate), then through the queue (the label; the chart's admission
//! policies gate them and the operator admits them onto the node its placement engine picks).
//! Measures the time until every pod is bound each way, the operator's share (until the last gate
//! is lifted), and where the slices landed: GPUs left with nothing allocated (free for a re-cut or
//! a whole-GPU job; higher is better). Prints a table with PASS/FAIL.
//!
//!     cargo build --release -p gpuslice -p gpuslice-testcluster --bin gpuslice --bin queue-scale
//!     target/release/queue-scale --gpuslice target/release/gpuslice --helm HELM \
//!         --trace ../shared/data/alibaba-gpu-v2023/openb_pod_list_default.csv [--nodes 1000] [--pods 10000]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use gpuslice_testcluster::scale::{
    GPUS, allocated_devices, arg, clock_at, create_gpu_nodes, create_pods, operator,
    peak_memory_mib, remove, simulated_agents, start_cluster,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, ListParams};
use kube::runtime::watcher;

/// Whole GPUs (0–5) and GPUs cut into four slices (6–7) per node.
const WHOLE_GPUS: usize = 6;
const SHARED_GPUS: usize = 2;

const POOLS: &str = "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: bench-whole}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: bench}}
  gpuSelector: {indices: [0, 1, 2, 3, 4, 5]}
  layout: {exclusive: {}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: bench-shared}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: bench}}
  gpuSelector: {indices: [6, 7]}
  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: whole}
spec: {pool: bench-whole, memory: 70Gi}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: quarter}
spec: {pool: bench-shared, memory: 16Gi}
";

/// The policy of each of the trace's GPU pods, in creation order.
fn trace_mix(path: &str) -> Result<Vec<&'static str>, Box<dyn std::error::Error>> {
    let mut rows: Vec<(u64, &'static str)> = Vec::new();
    let mut reader = csv_lines(path)?;
    let header = reader.next().ok_or("an empty trace")?;
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .ok_or(format!("{path}: no column {name}"))
    };
    let (num_gpu, gpu_milli, created) = (
        column("num_gpu")?,
        column("gpu_milli")?,
        column("creation_time")?,
    );
    for row in reader {
        let number = |i: usize| row.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let gpus = number(num_gpu);
        if gpus == 0 {
            continue;
        }
        let policy = if gpus == 1 && number(gpu_milli) < 1000 {
            "quarter"
        } else {
            "whole"
        };
        rows.push((number(created), policy));
    }
    rows.sort_by_key(|(t, _)| *t);
    Ok(rows.into_iter().map(|(_, p)| p).collect())
}

/// The trace's rows, split at commas (it quotes nothing).
fn csv_lines(path: &str) -> std::io::Result<impl Iterator<Item = Vec<String>>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .map(|l| l.split(',').map(str::to_string).collect::<Vec<_>>())
        .collect::<Vec<_>>()
        .into_iter())
}

/// Creates the pods (`bench=<label>`), each asking for its policy by label (through the queue)
/// or by its extended resource (kube-scheduler alone); waits until all are bound. Returns the
/// time until the last gate was lifted and until the last pod was bound.
async fn place(
    client: &kube::Client,
    label: &str,
    policies: &[&str],
    queued: bool,
    limit: Duration,
) -> (Option<Duration>, Option<Duration>) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let selector = format!("bench={label}");
    let seen: Arc<Mutex<(BTreeSet<String>, BTreeSet<String>)>> = Arc::default();
    let watch = {
        let (pods, selector, seen) = (pods.clone(), selector.clone(), seen.clone());
        tokio::spawn(async move {
            let stream = watcher(pods, watcher::Config::default().labels(&selector));
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                if let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = event {
                    let spec = p.spec.clone().unwrap_or_default();
                    let name = p.metadata.name.clone().unwrap_or_default();
                    let mut seen = seen.lock().expect("not poisoned");
                    if spec.scheduling_gates.as_ref().is_none_or(|g| g.is_empty()) {
                        seen.0.insert(name.clone());
                    }
                    if spec.node_name.is_some() {
                        seen.1.insert(name);
                    }
                }
            }
        })
    };
    let start = Instant::now();
    let count = policies.len();
    let created = policies.iter().enumerate().map(|(i, policy)| {
        let mut labels = serde_json::json!({"bench": label});
        let mut container = serde_json::json!({"name": "main", "image": "example.com/job:1"});
        if queued {
            labels["gpuslice.io/policy"] = (*policy).into();
        } else {
            container["resources"] =
                serde_json::json!({"limits": {format!("gpuslice.io/{policy}"): "1"}});
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{label}-{i:05}"), "labels": labels},
            "spec": {
                "containers": [container],
                "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
            }
        }))
        .expect("a pod")
    });
    create_pods(&pods, created).await;
    let (mut admitted, mut bound) = (None, None);
    while start.elapsed() < limit {
        let (a, b) = {
            let seen = seen.lock().expect("not poisoned");
            (seen.0.len(), seen.1.len())
        };
        if a >= count && admitted.is_none() {
            admitted = Some(start.elapsed());
        }
        if b >= count {
            bound = Some(start.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    watch.abort();
    (admitted, bound)
}

/// Where the pods landed: (GPUs with nothing allocated, GPUs, devices given, allocations).
async fn landing(client: &kube::Client) -> Result<(usize, usize, usize, usize), kube::Error> {
    // Device (pool, name) → (node, GPU index).
    let mut gpu_of: BTreeMap<(String, String), (String, i64)> = BTreeMap::new();
    for s in Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        let node = s.spec.node_name.clone().unwrap_or_default();
        for d in s.spec.devices.iter().flatten() {
            let gpu = d
                .attributes
                .as_ref()
                .and_then(|a| a.get(gpuslice_api::dra::attribute::GPU_INDEX))
                .and_then(|a| a.int)
                .unwrap_or(-1);
            gpu_of.insert(
                (s.spec.pool.name.clone(), d.name.clone()),
                (node.clone(), gpu),
            );
        }
    }
    let gpus: BTreeSet<&(String, i64)> = gpu_of.values().collect();
    let mut used: BTreeSet<&(String, i64)> = BTreeSet::new();
    let mut given = BTreeSet::new();
    let mut results = 0;
    for key in allocated_devices(client).await? {
        results += 1;
        if let Some(gpu) = gpu_of.get(&key) {
            used.insert(gpu);
        }
        given.insert(key);
    }
    Ok((gpus.len() - used.len(), gpus.len(), given.len(), results))
}

/// What a row of the table must show.
enum Target {
    AtMost(f64),
    AtLeast(f64),
}

fn helm() -> Option<PathBuf> {
    arg("--helm")
        .or_else(|| std::env::var("GPUSLICE_HELM").ok())
        .map(PathBuf::from)
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let gpuslice =
        PathBuf::from(arg("--gpuslice").unwrap_or_else(|| "target/release/gpuslice".into()));
    let nodes: usize = arg("--nodes").map_or(Ok(1000), |n| n.parse())?;
    let pod_count: usize = arg("--pods").map_or(Ok(10_000), |n| n.parse())?;
    let trace = arg("--trace").ok_or("--trace: the Alibaba trace's openb_pod_list_default.csv")?;
    let helm = helm().ok_or("--helm (or GPUSLICE_HELM): a helm binary (tests/helm/build.sh)")?;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mix = trace_mix(&trace)?;
    if mix.is_empty() {
        return Err(format!("{trace}: no GPU pods").into());
    }
    let policies: Vec<&str> = mix.iter().copied().cycle().take(pod_count).collect();
    let wanted: BTreeMap<&str, usize> = policies.iter().fold(BTreeMap::new(), |mut m, p| {
        *m.entry(*p).or_default() += 1;
        m
    });
    eprintln!("pods by policy: {wanted:?}");
    for (policy, capacity) in [
        ("whole", nodes * WHOLE_GPUS),
        ("quarter", nodes * SHARED_GPUS * 4),
    ] {
        let count = wanted.get(policy).copied().unwrap_or(0);
        if count > capacity {
            return Err(format!(
                "{count} pods take policy {policy} but {nodes} nodes have {capacity} such devices: add --nodes"
            )
            .into());
        }
    }

    let (cluster, client) = start_cluster(&root, 500).await?;
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await?;
    // The chart's admission policies that gate labelled pods (and give them their priority).
    let rendered = Command::new(&helm)
        .args(["template", "gs", "--namespace", "gpuslice-system"])
        .arg(root.join("charts/gpuslice"))
        .output()?;
    if !rendered.status.success() {
        return Err(String::from_utf8_lossy(&rendered.stderr).into());
    }
    for doc in serde_yaml::Deserializer::from_slice(&rendered.stdout) {
        let doc: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        let kind = doc["kind"].as_str().unwrap_or_default();
        if kind.starts_with("MutatingAdmissionPolicy") || kind == "PriorityClass" {
            gpuslice_testcluster::apply_document(&client, &discovery, &doc, false)
                .await
                .ok_or("unknown kind")??;
        }
    }

    create_gpu_nodes(
        &cluster,
        &client,
        nodes,
        &[("gpuslice.io/pool", "bench")],
        &[],
    )
    .await;
    let operator_process = operator(&gpuslice, &cluster, "2026-12-02T09:00:00Z")?;
    let (_agents_clock, clock) = tokio::sync::watch::channel(clock_at("2026-12-02T09:00:00Z"));
    let agents = simulated_agents(client.clone(), 64, clock);
    for doc in serde_yaml::Deserializer::from_str(POOLS) {
        let doc: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        gpuslice_testcluster::apply_document(&client, &discovery, &doc, false)
            .await
            .ok_or("unknown kind")??;
    }
    let devices = nodes * (WHOLE_GPUS + SHARED_GPUS * 4);
    let published = Instant::now();
    loop {
        let count: usize = Api::<ResourceSlice>::all(client.clone())
            .list(&ListParams::default())
            .await?
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        let classes = Api::<DeviceClass>::all(client.clone())
            .list(&ListParams::default())
            .await?
            .items
            .len();
        if count == devices && classes == 2 {
            break;
        }
        if published.elapsed() > Duration::from_secs(600) {
            return Err(format!("{count} of {devices} devices published").into());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "{devices} devices on {nodes} nodes in {:.1} s",
        published.elapsed().as_secs_f64()
    );

    let limit = Duration::from_secs(2400);
    let (_, alone) = place(&client, "alone", &policies, false, limit).await;
    let (alone_free, gpus, alone_given, alone_results) = landing(&client).await?;
    eprintln!("kube-scheduler alone: {alone:?}, {alone_free}/{gpus} GPUs untouched");
    remove(&client, "alone").await?;
    let (admitted, queued) = place(&client, "queued", &policies, true, limit).await;
    let (queued_free, _, queued_given, queued_results) = landing(&client).await?;
    eprintln!("queued: admitted {admitted:?}, bound {queued:?}, {queued_free}/{gpus} untouched");
    let operator_memory = peak_memory_mib(operator_process.0.id());
    drop(operator_process);
    agents.abort();

    let secs = |d: Option<Duration>| d.map_or(f64::INFINITY, |d| d.as_secs_f64());
    let percent = |free: usize| 100.0 * free as f64 / gpus.max(1) as f64;
    println!(
        "the admission queue: {nodes} nodes × {GPUS} A100 ({WHOLE_GPUS} whole, {SHARED_GPUS} × 4 slices), {pod_count} pods of the Alibaba trace's GPU mix ({wanted:?})"
    );
    println!("{:<62} {:>10} {:>12}", "", "measured", "target");
    let rows: [(&str, f64, Option<Target>); 6] = [
        (
            "kube-scheduler alone: every pod bound (s)",
            secs(alone),
            None,
        ),
        (
            "through the queue: every gate lifted (s)",
            secs(admitted),
            None,
        ),
        (
            "through the queue: every pod bound (s)",
            secs(queued),
            Some(Target::AtMost(secs(alone) * 2.0)),
        ),
        (
            "GPUs with nothing allocated, kube-scheduler alone (%)",
            percent(alone_free),
            None,
        ),
        (
            "GPUs with nothing allocated, through the queue (%)",
            percent(queued_free),
            Some(Target::AtLeast(percent(alone_free))),
        ),
        (
            "operator peak memory (MiB)",
            operator_memory,
            Some(Target::AtMost(150.0)),
        ),
    ];
    let mut failed = false;
    for (what, value, target) in rows {
        let (target, verdict) = match target {
            Some(target) => {
                let (at_most, t) = match target {
                    Target::AtMost(t) => (true, t),
                    Target::AtLeast(t) => (false, t),
                };
                let pass = if at_most { value <= t } else { value >= t };
                failed |= !pass;
                (
                    format!("{} {t:.1}", if at_most { "≤" } else { "≥" }),
                    if pass { "PASS" } else { "FAIL" },
                )
            }
            None => (String::new(), ""),
        };
        println!("{what:<62} {value:>10.2} {target:>12}  {verdict}");
    }
    for (what, given, results) in [
        ("kube-scheduler alone", alone_given, alone_results),
        ("through the queue", queued_given, queued_results),
    ] {
        let unique = given == results && results == pod_count;
        failed |= !unique;
        println!(
            "{:<62} {:>10} {:>12}  {}",
            format!("devices allocated, each to one pod ({what})"),
            format!("{given}/{results}"),
            pod_count,
            if unique { "PASS" } else { "FAIL" }
        );
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
