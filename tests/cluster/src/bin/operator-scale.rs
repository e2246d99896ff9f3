//! The operator at scale, on a private control plane: N kwok nodes × 8 H200 GPUs whose agents
//! are simulated in this process (each reports its GPUs, and reports the spec's generation as
//! applied as soon as it sees a layout). Measures the time from applying a pool to every node
//! reporting the new layout, and the operator's peak memory. Prints a table; exits non-zero on
//! FAIL (targets: under 10 s and under 150 MiB at 1,000 nodes).
//!
//!     cargo build --release && cargo run --release -p gpuslice-testcluster --bin operator-scale -- \
//!         --gpuslice target/release/gpuslice [--nodes 1000]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use gpuslice_testcluster::scale::{arg, peak_memory_mib};
use gpuslice_testcluster::{Components, ControlPlane};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpuslice =
        PathBuf::from(arg("--gpuslice").unwrap_or_else(|| "target/release/gpuslice".into()));
    let count: usize = arg("--nodes").map_or(Ok(1000), |n| n.parse())?;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cluster = ControlPlane::start(Components::default())
        .await?
        .ok_or("no control-plane binaries: run tests/controlplane/build.sh")?;
    let client = cluster.client().await?;
    gpuslice_testcluster::install_crds(&client, &root.join("crds")).await?;
    let gpu_nodes: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("gpuslice.io", "v1alpha1", "GpuNode"),
            "gpunodes",
        ),
    );
    let agent = PatchParams::apply("simulated-agent").force();
    let gpus: Vec<serde_json::Value> = (0..8)
        .map(|i| serde_json::json!({"index": i, "model": "NVIDIA H200"}))
        .collect();

    let setup = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let (cluster, gpu_nodes, agent, gpus) = (&cluster, gpu_nodes.clone(), agent.clone(), gpus.clone());
            async move {
                let name = format!("scale-{i:04}");
                cluster
                    .create_node(&name, &[("gpuslice.io/pool", "h200-mig")], &[])
                    .await
                    .unwrap();
                let object = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": name}, "spec": {}});
                gpu_nodes.patch(&name, &agent, &Patch::Apply(&object)).await.unwrap();
                let status = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": name}, "status": {"inventory": {"name": name, "gpus": gpus}}});
                gpu_nodes.patch_status(&name, &agent, &Patch::Apply(&status)).await.unwrap();
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
    eprintln!(
        "{count} nodes with reported GPUs in {:.1} s",
        setup.elapsed().as_secs_f64()
    );

    let mut operator = Command::new(&gpuslice)
        .arg("operator")
        .env("KUBECONFIG", cluster.kubeconfig_path())
        .env("GPUSLICE_CLOCK_START", "2026-12-02T09:00:00Z")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    // The simulated agents: report a spec with a layout as applied.
    let agents = {
        let gpu_nodes = gpu_nodes.clone();
        let agent = agent.clone();
        tokio::spawn(async move {
            let stream = kube::runtime::watcher(gpu_nodes.clone(), Default::default());
            futures::pin_mut!(stream);
            while let Some(Ok(event)) = stream.next().await {
                let objects: Vec<DynamicObject> = match event {
                    kube::runtime::watcher::Event::Apply(o)
                    | kube::runtime::watcher::Event::InitApply(o) => vec![o],
                    _ => continue,
                };
                for o in objects {
                    let has_layout = o.data["spec"]["gpus"]
                        .as_array()
                        .is_some_and(|g| !g.is_empty());
                    let generation = o.metadata.generation;
                    let applied = o.data["status"]["appliedGeneration"].as_i64();
                    if has_layout && applied != generation {
                        let name = o.metadata.name.clone().unwrap_or_default();
                        let status = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": name}, "status": {"inventory": o.data["status"]["inventory"], "appliedGeneration": generation}});
                        let (gpu_nodes, agent) = (gpu_nodes.clone(), agent.clone());
                        tokio::spawn(async move {
                            let _ = gpu_nodes
                                .patch_status(&name, &agent, &Patch::Apply(&status))
                                .await;
                        });
                    }
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;

    let pool: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("examples/gitops/pools/h200-mig.yaml"))?
            .replace("  checkpointPolicy: standard\n", ""),
    )?;
    let pools: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("gpuslice.io", "v1alpha1", "GpuPool"),
            "gpupools",
        ),
    );
    let start = Instant::now();
    pools
        .patch(
            "h200-mig",
            &PatchParams::apply("scale").force(),
            &Patch::Apply(&pool),
        )
        .await?;
    let (mut layouts_at, mut ready_at) = (None, None);
    while start.elapsed() < Duration::from_secs(120) && ready_at.is_none() {
        if layouts_at.is_none() {
            let list = gpu_nodes.list(&Default::default()).await?;
            let with = list
                .items
                .iter()
                .filter(|o| {
                    o.data["spec"]["gpus"]
                        .as_array()
                        .is_some_and(|g| g.len() == 8)
                })
                .count();
            if with == count {
                layouts_at = Some(start.elapsed());
            }
        }
        let p = pools.get("h200-mig").await?;
        let ready = p.data["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
        if ready {
            ready_at = Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let memory = peak_memory_mib(operator.id());
    let _ = operator.kill();
    agents.abort();
    let secs = |d: Option<Duration>| d.map_or(f64::INFINITY, |d| d.as_secs_f64());
    let rows = [
        ("every node has its layout (s)", secs(layouts_at), 10.0),
        ("every node applied, pool Ready (s)", secs(ready_at), 10.0),
        ("operator peak memory (MiB)", memory, 150.0),
    ];
    println!("operator at {count} nodes × 8 GPUs");
    let mut failed = false;
    for (what, value, target) in rows {
        let ok = value <= target;
        failed |= !ok;
        println!(
            "{what:<38} {value:>8.2} {:>8}  {}",
            format!("≤ {target}"),
            if ok { "PASS" } else { "FAIL" }
        );
    }
    if failed {
        std::process::exit(1);
    }
    Ok(())
}
