//! What one ResourceSlice write costs the API server: the agent's way (`Publisher`: a create,
//! then updates of the object it read back) against server-side apply of the same slices, on one
//! private API server and etcd. Two sets of N nodes' slices (8 A100s × 4 software slices by day,
//! 32 devices; × 2 by night, 16), each written by one way only, re-cut day ↔ night in alternating
//! rounds, 64 writes in flight (as the scale benchmarks' simulated agents). Prints the API
//! server's and etcd's CPU seconds per 1,000 writes of each way and their ratio, with PASS/FAIL;
//! exits non-zero on a FAIL.
//!
//!     cargo build --release -p gpuslice-testcluster --bin slice-writes
//!     target/release/slice-writes [--nodes 1000] [--rounds 4]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use gpuslice_api::{GpuAssignment, Layout};
use gpuslice_node::cluster::Publisher;
use gpuslice_node::cluster::dra::{self, NodeRef};
use gpuslice_testcluster::scale::{GPUS, applied, arg, cpu_seconds};
use gpuslice_testcluster::{Components, ControlPlane};
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::api::{Api, Patch, PatchParams};

const IN_FLIGHT: usize = 64;

/// The node's devices in one window: four 20 GiB slices per GPU by day, two 40 GiB by night.
fn devices(node: &str, day: bool) -> Vec<Device> {
    let (window, slices, memory, compute) = if day {
        ("day", 4, "20Gi", 25)
    } else {
        ("night", 2, "40Gi", 50)
    };
    let gpus: Vec<GpuAssignment> = (0..GPUS)
        .map(|index| {
            serde_json::from_value(serde_json::json!({
                "index": index, "pool": "shared-a100", "window": window,
                "layout": Layout::software(slices, memory, compute),
            }))
            .expect("an assignment")
        })
        .collect();
    dra::devices(&applied(node, &gpus), &gpus, &|_, _| Some(Vec::new()))
}

/// The way a set of slices is written.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    /// The agent's `Publisher`.
    Update,
    /// One server-side apply per slice (the agent's field manager, forced).
    Apply,
}

struct Set {
    way: Way,
    nodes: Vec<String>,
    publishers: Vec<tokio::sync::Mutex<Publisher>>,
}

impl Set {
    fn new(client: &kube::Client, way: Way, prefix: &str, count: usize) -> Set {
        let nodes: Vec<String> = (0..count).map(|i| format!("{prefix}-{i:04}")).collect();
        let publishers = nodes
            .iter()
            .map(|n| tokio::sync::Mutex::new(Publisher::new(client.clone(), n)))
            .collect();
        Set {
            way,
            nodes,
            publishers,
        }
    }

    /// Every node's slices written as `day` or night; how long it took.
    async fn write(&self, client: &kube::Client, day: bool, generation: i64) -> Duration {
        let start = Instant::now();
        let api: Api<ResourceSlice> = Api::all(client.clone());
        futures::stream::iter(self.nodes.iter().zip(&self.publishers))
            .map(|(node, publisher)| {
                let api = api.clone();
                async move {
                    let devices = devices(node, day);
                    match self.way {
                        Way::Update => publisher.lock().await.publish(devices).await,
                        Way::Apply => {
                            let owner = NodeRef {
                                name: node.clone(),
                                uid: format!("uid-{node}"),
                            };
                            let params = PatchParams::apply("gpuslice-agent").force();
                            for slice in
                                dra::resource_slices(&owner, "gpuslice-agent", &devices, generation)
                            {
                                let name = slice.metadata.name.clone().unwrap_or_default();
                                api.patch(&name, &params, &Patch::Apply(&slice))
                                    .await
                                    .expect("a server-side apply");
                            }
                        }
                    }
                }
            })
            .buffer_unordered(IN_FLIGHT)
            .collect::<Vec<()>>()
            .await;
        start.elapsed()
    }
}

/// How many of the nodes' slices hold exactly their `day` (or night) devices.
async fn published(client: &kube::Client, set: &Set, day: bool) -> usize {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let slices = api
        .list(&Default::default())
        .await
        .expect("the ResourceSlices");
    set.nodes
        .iter()
        .filter(|node| {
            let want = devices(node, day);
            slices.items.iter().any(|s| {
                s.spec.node_name.as_ref() == Some(node) && s.spec.devices.as_ref() == Some(&want)
            })
        })
        .count()
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let nodes: usize = arg("--nodes").map_or(Ok(1000), |n| n.parse())?;
    let rounds: usize = arg("--rounds").map_or(Ok(4), |n| n.parse())?;
    let cluster = ControlPlane::start(Components::default())
        .await?
        .ok_or("no control-plane binaries: run tests/controlplane/build.sh")?;
    let client = cluster.client().await?;
    // The Publisher names its Nodes as owners, so they exist (no kubelet, nothing runs there).
    for prefix in ["update", "apply"] {
        futures::stream::iter(0..nodes)
            .map(|i| {
                let cluster = &cluster;
                async move {
                    cluster
                        .create_node(&format!("{prefix}-{i:04}"), &[], &[])
                        .await
                        .expect("a node");
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<()>>()
            .await;
    }
    let sets = [
        Set::new(&client, Way::Update, "update", nodes),
        Set::new(&client, Way::Apply, "apply", nodes),
    ];
    // Created by day, not measured: the rounds below re-cut existing slices, as a window does.
    for set in &sets {
        set.write(&client, true, 1).await;
    }
    let apiserver = cluster.pid("kube-apiserver").ok_or("no API server")?;
    let etcd = cluster.pid("etcd").ok_or("no etcd")?;
    // Per way: API server CPU-s, etcd CPU-s, wall s, writes.
    let mut spent = [(0.0, 0.0, 0.0, 0usize); 2];
    let mut correct = true;
    for round in 0..rounds {
        let day = round % 2 == 1;
        // Alternating which way goes first, so neither always meets a fresher heap.
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let set = &sets[i];
            let (a, e) = (cpu_seconds(apiserver), cpu_seconds(etcd));
            let wall = set.write(&client, day, round as i64 + 2).await;
            let total = &mut spent[i];
            total.0 += cpu_seconds(apiserver) - a;
            total.1 += cpu_seconds(etcd) - e;
            total.2 += wall.as_secs_f64();
            total.3 += set.nodes.len();
            correct &= published(&client, set, day).await == nodes;
        }
    }
    let per_thousand = |(cpu, _, _, writes): (f64, f64, f64, usize)| cpu * 1000.0 / writes as f64;
    let (update, apply) = (spent[0], spent[1]);
    let ratio = per_thousand(update) / per_thousand(apply);
    println!(
        "ResourceSlice writes: {nodes} nodes per way × {rounds} re-cuts (32 ↔ 16 devices), {IN_FLIGHT} in flight"
    );
    println!(
        "{:<40} {:>12} {:>12} {:>10}",
        "", "update", "apply", "target"
    );
    for (what, u, a) in [
        (
            "API server CPU-s per 1,000 writes",
            per_thousand(update),
            per_thousand(apply),
        ),
        (
            "etcd CPU-s per 1,000 writes",
            update.1 * 1000.0 / update.3 as f64,
            apply.1 * 1000.0 / apply.3 as f64,
        ),
        (
            "wall s per 1,000 writes",
            update.2 * 1000.0 / update.3 as f64,
            apply.2 * 1000.0 / apply.3 as f64,
        ),
    ] {
        println!("{what:<40} {u:>12.2} {a:>12.2}");
    }
    let cheaper = ratio < 1.0;
    println!(
        "{:<40} {:>25.2} {:>10}  {}",
        "API server CPU, update / apply",
        ratio,
        "< 1",
        if cheaper { "PASS" } else { "FAIL" }
    );
    println!(
        "{:<40} {:>25} {:>10}  {}",
        "every round published as written",
        if correct { "yes" } else { "no" },
        "yes",
        if correct { "PASS" } else { "FAIL" }
    );
    Ok(if cheaper && correct {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
