//! Workloads on slices through Dynamic Resource Allocation, against a real control plane
//! (kube-apiserver, kube-scheduler, kube-controller-manager, etcd, kwok nodes) with the operator
//! and one agent per node on emulated GPUs: the agents publish their slices as devices, the
//! operator writes a DeviceClass per policy, and pods that ask for `gpuslice.io/<policy>` are
//! placed by the real scheduler on fitting slices — never two on one slice; the rest wait.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};

use gpuslice_api::{GpuNode, GpuPool, GpuSlicePolicy};
use gpuslice_node::kubelet::proto;
use gpuslice_node::kubelet::proto::dra::d_r_a_plugin_client::DRAPluginClient as DraPluginClient;
use gpuslice_node::kubelet::proto::registration::registration_client::RegistrationClient;
use gpuslice_testcluster::{Components, ControlPlane, KillOnDrop, eventually};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

/// A pod asking for one slice of `policy` through the extended resource.
fn pod(name: &str, policy: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "dra-test"}},
        "spec": {
            "containers": [{
                "name": "main",
                "image": "example.com/worker:1",
                "resources": {"limits": {format!("gpuslice.io/{policy}"): "1"}}
            }],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }
    }))
    .unwrap()
}

/// Waits until `bound` test pods are bound and `waiting` wait with the scheduler's reason.
async fn settled(
    pods: &Api<Pod>,
    bound: usize,
    waiting: usize,
    what: &str,
) -> (Vec<(String, String)>, Vec<String>) {
    eventually(what, || async move {
        let (b, w) = placement(pods, "app=dra-test").await;
        (b.len() == bound && w.len() == waiting && w.iter().all(|w| !w.ends_with(": ")))
            .then_some((b.clone(), w.clone()))
            .ok_or_else(|| format!("bound {b:?}, waiting {w:?}"))
    })
    .await
}

/// Each bound pod's node and the devices its claims were allocated, from the ResourceClaims.
async fn allocations(client: &Client, namespace: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let mut out: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for claim in claims.list(&ListParams::default()).await.unwrap() {
        let Some(owner) = claim
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.kind == "Pod")
            .map(|o| o.name.clone())
        else {
            continue;
        };
        let results = gpuslice_testcluster::allocated_devices(claim);
        for r in results {
            assert_eq!(r.driver, "gpuslice.io");
            out.entry(owner.clone())
                .or_default()
                .push((r.pool, r.device));
        }
    }
    out
}

/// Pods by phase-ish state: bound to a node, or Pending with the scheduler's message.
async fn placement(pods: &Api<Pod>, selector: &str) -> (Vec<(String, String)>, Vec<String>) {
    let mut bound = Vec::new();
    let mut waiting = Vec::new();
    for p in pods
        .list(&ListParams::default().labels(selector))
        .await
        .unwrap()
    {
        let name = p.metadata.name.clone().unwrap_or_default();
        match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            Some(node) => bound.push((name, node)),
            None => {
                let why = p
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .into_iter()
                    .find(|c| c.type_ == "PodScheduled")
                    .and_then(|c| c.message)
                    .unwrap_or_default();
                waiting.push(format!("{name}: {why}"));
            }
        }
    }
    (bound, waiting)
}

/// A control plane with two kwok nodes — `a100-a` in pool shared-a100 (software slices) and
/// `h200-a` in pool h200-mig (MIG) — one agent per node on an emulated GPU, the operator, and the
/// examples' pools and policies, all on a clock started at `clock`.
struct Cluster {
    cluster: ControlPlane,
    client: Client,
    /// `<dir>/<node>/` holds each agent's state, kubelet plugin sockets and CDI specs.
    dir: tempfile::TempDir,
    /// The agents of a100-a and h200-a, then the operator.
    processes: Vec<KillOnDrop>,
}

/// The agent of node `name` (its node file, state, kubelet and CDI folders under `dir/<name>`),
/// as the chart's agent identity with a token bound to its pod on that node.
async fn spawn_agent(
    cluster: &ControlPlane,
    dir: &Path,
    name: &str,
    clock: &str,
    agent_args: &[&str],
) -> KillOnDrop {
    KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_gpuslice"))
            .args(["agent", "--kube", "--apply", "--interval", "2s"])
            .args(agent_args)
            .arg("--emulate")
            .arg(dir.join(format!("{name}.yaml")))
            .arg("--state")
            .arg(dir.join(name).join("state"))
            // Pools' dataset caches, for /var/lib/gpuslice/cache.
            .arg("--cache-root")
            .arg(std::path::Path::new(&dir.join(name).join("state")).join("caches"))
            .arg("--kubelet-dir")
            .arg(dir.join(name).join("kubelet"))
            .arg("--cdi-dir")
            .arg(dir.join(name).join("cdi"))
            .env("KUBECONFIG", cluster.agent_kubeconfig(name).await.unwrap())
            .env("GPUSLICE_CLOCK_START", clock)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    )
}

async fn start(clock: &str, agent_args: &[&str]) -> Option<Cluster> {
    start_with_driver(clock, agent_args, None).await
}

/// As [`start`], the emulated nodes reporting `driver` (`version`, `cuda`) instead of the
/// emulator's current one.
async fn start_with_driver(
    clock: &str,
    agent_args: &[&str],
    driver: Option<(&str, &str)>,
) -> Option<Cluster> {
    let cluster = ControlPlane::start(Components::all()).await.unwrap()?;
    let client = cluster.client_with_crds().await;
    if !cluster.install_chart_identities().await.unwrap() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut processes = Vec::new();
    for (name, pool, model) in [
        ("a100-a", "shared-a100", "NVIDIA A100-SXM4-80GB"),
        ("h200-a", "h200-mig", "NVIDIA H200"),
    ] {
        cluster
            .create_node(name, &[("gpuslice.io/pool", pool)], &[])
            .await
            .unwrap();
        let node_file = dir.path().join(format!("{name}.yaml"));
        let driver = driver
            .map(|(version, cuda)| format!("driver: {{version: {version:?}, cuda: {cuda:?}}}\n"))
            .unwrap_or_default();
        std::fs::write(
            &node_file,
            format!("name: {name}\n{driver}gpus:\n- {{index: 0, model: {model}}}\n"),
        )
        .unwrap();
        processes.push(spawn_agent(&cluster, dir.path(), name, clock, agent_args).await);
    }
    processes.push(gpuslice_testcluster::spawn_operator(
        env!("CARGO_BIN_EXE_gpuslice"),
        &cluster.operator_kubeconfig().await.unwrap(),
        Some(clock),
        &[],
    ));
    gpuslice_testcluster::apply_repo_files(
        &client,
        &[
            "examples/gitops/policies/checkpoint-standard.yaml",
            "examples/gitops/pools/shared-a100.yaml",
            "examples/gitops/pools/h200-mig.yaml",
            "examples/gitops/policies/notebook.yaml",
            "examples/gitops/policies/llm-inference.yaml",
        ],
    )
    .await;
    Some(Cluster {
        cluster,
        client,
        dir,
        processes,
    })
}

#[tokio::test]
async fn pods_naming_a_policy_get_their_own_fitting_slice() {
    // 11:00 in Berlin and 18:00 in Shanghai on a Wednesday: both pools in their day layouts for
    // two hours.
    let Some(running) = start("2026-12-02T10:00:00Z", &[]).await else {
        return;
    };
    let client = running.client.clone();
    // The agents publish the day layouts: four 20 GiB software slices; 1g, 1g, 2g and 3g
    // instances, smallest first.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let published = eventually("both nodes publish their slices", || {
        let slices = slices.clone();
        async move {
            let mut by_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for s in slices
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
            {
                assert_eq!(s.spec.driver, "gpuslice.io");
                let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
                assert_eq!(
                    (owner.kind.as_str(), owner.name.as_str()),
                    ("Node", s.spec.node_name.as_deref().unwrap())
                );
                by_node
                    .entry(s.spec.node_name.clone().unwrap_or_default())
                    .or_default()
                    .extend(s.spec.devices.iter().flatten().map(|d| d.name.clone()));
            }
            (by_node.get("a100-a").map(Vec::len) == Some(4)
                && by_node.get("h200-a").map(Vec::len) == Some(4))
            .then_some(by_node.clone())
            .ok_or_else(|| format!("{by_node:?}"))
        }
    })
    .await;
    assert_eq!(
        published["a100-a"],
        ["gpu0-s0", "gpu0-s1", "gpu0-s2", "gpu0-s3"]
    );
    assert!(published["h200-a"][0].contains("1g-18gb"), "{published:?}");
    assert!(published["h200-a"][3].contains("3g-71gb"), "{published:?}");

    let classes: Api<DeviceClass> = Api::all(client.clone());
    eventually("the operator writes a DeviceClass per policy", || {
        let classes = classes.clone();
        async move {
            let names: BTreeSet<String> = classes
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .filter_map(|c| c.metadata.name)
                .collect();
            (names.contains("notebook.gpuslice.io") && names.contains("llm-inference.gpuslice.io"))
                .then_some(())
                .ok_or_else(|| format!("{names:?}"))
        }
    })
    .await;

    // Five notebooks on four software slices: four placed on distinct slices of the A100
    // node, the fifth waits with the scheduler's reason.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for i in 0..5 {
        pods.create(
            &PostParams::default(),
            &pod(&format!("notebook-{i}"), "notebook"),
        )
        .await
        .unwrap();
    }
    let (bound, waiting) = settled(&pods, 4, 1, "four notebooks are placed, one waits").await;
    assert!(bound.iter().all(|(_, node)| node == "a100-a"), "{bound:?}");
    assert!(
        waiting[0].contains("cannot allocate all claims"),
        "the scheduler says what is missing: {waiting:?}"
    );
    let given = eventually("the placed notebooks' claims are allocated", || {
        let client = client.clone();
        async move {
            let a = allocations(&client, "default").await;
            (a.len() == 4)
                .then_some(a.clone())
                .ok_or_else(|| format!("{a:?}"))
        }
    })
    .await;
    let devices: BTreeSet<&(String, String)> = given.values().flatten().collect();
    assert_eq!(devices.len(), 4, "never one slice for two pods: {given:?}");
    assert!(
        devices
            .iter()
            .all(|(pool, d)| pool == "a100-a" && d.starts_with("gpu0-s"))
    );

    // Two placed notebooks go away: one freed slice goes to the notebook that waited, the other
    // to a pod that asks through a ResourceClaimTemplate naming the policy's DeviceClass.
    for (gone, _) in &bound[..2] {
        pods.delete(gone, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), "default");
    let template: ResourceClaimTemplate = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "notebook-slice"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "slice", "exactly": {"deviceClassName": "notebook.gpuslice.io"}}
        ]}}}
    }))
    .unwrap();
    templates
        .create(&PostParams::default(), &template)
        .await
        .unwrap();
    let mut by_template = pod("notebook-claim", "notebook");
    let spec = by_template.spec.as_mut().unwrap();
    spec.containers[0].resources = None;
    spec.resource_claims = Some(vec![
        serde_json::from_value(serde_json::json!(
            {"name": "gpu", "resourceClaimTemplateName": "notebook-slice"}
        ))
        .unwrap(),
    ]);
    spec.containers[0].resources =
        Some(serde_json::from_value(serde_json::json!({"claims": [{"name": "gpu"}]})).unwrap());
    pods.create(&PostParams::default(), &by_template)
        .await
        .unwrap();
    eventually(
        "the waiting notebook and the claim's pod get the freed slices",
        || {
            let (pods, client) = (pods.clone(), client.clone());
            async move {
                let (bound, waiting) = placement(&pods, "app=dra-test").await;
                let a = allocations(&client, "default").await;
                let devices: BTreeSet<&(String, String)> = a.values().flatten().collect();
                (bound.len() == 4
                    && waiting.is_empty()
                    && a.len() == 4
                    && devices.len() == 4
                    && a.contains_key("notebook-claim"))
                .then_some(())
                .ok_or_else(|| format!("bound {bound:?}, waiting {waiting:?}, allocated {a:?}"))
            }
        },
    )
    .await;

    // The inference Deployment (30 GiB): the 2g and 3g instances hold it, the 1g ones do not;
    // its third replica waits.
    let serving: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let deployment = gpuslice_testcluster::deployment(
        "llm",
        3,
        &[],
        serde_json::json!({
            "containers": [{"name": "server", "image": "example.com/llm:2",
                "resources": {"limits": {"gpuslice.io/llm-inference": "1"}}}],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }),
    );
    serving
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    eventually("two replicas on the 2g and 3g instances, one waits", || {
        let (pods, client) = (pods.clone(), client.clone());
        async move {
            let (bound, waiting) = placement(&pods, "app=llm").await;
            let a = allocations(&client, "default").await;
            let mine: Vec<&String> = bound
                .iter()
                .filter_map(|(name, _)| a.get(name))
                .flatten()
                .map(|(_, device)| device)
                .collect();
            (bound.len() == 2
                && waiting.len() == 1
                && mine.len() == 2
                && mine.iter().any(|d| d.contains("2g-35gb"))
                && mine.iter().any(|d| d.contains("3g-71gb")))
            .then_some(())
            .ok_or_else(|| format!("bound {bound:?}, waiting {waiting:?}, devices {mine:?}"))
        }
    })
    .await;

    // The pools and policies count what is allocated.
    let pools: Api<GpuPool> = Api::all(client.clone());
    let policies: Api<GpuSlicePolicy> = Api::all(client.clone());
    eventually("pool and policy status count the allocations", || {
        let (pools, policies) = (pools.clone(), policies.clone());
        async move {
            let mut got = Vec::new();
            for pool in ["shared-a100", "h200-mig"] {
                let p = pools.get(pool).await.map_err(|e| e.to_string())?;
                got.push(p.status.map(|s| (s.slices.total, s.slices.allocated)));
            }
            for policy in ["notebook", "llm-inference"] {
                let p = policies.get(policy).await.map_err(|e| e.to_string())?;
                got.push(p.status.map(|s| (0, s.allocated)));
            }
            (got == [Some((4, 4)), Some((4, 2)), Some((0, 4)), Some((0, 2))])
                .then_some(())
                .ok_or_else(|| format!("{got:?}"))
        }
    })
    .await;

    // Deleting a policy deletes its class.
    policies
        .delete("notebook", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the notebook class goes with its policy", || {
        let classes = classes.clone();
        async move {
            match classes.get_opt("notebook.gpuslice.io").await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn slices_a_window_change_will_recut_take_no_new_pods() {
    // 19:55 in Shanghai: at 20:00 shared-a100 goes from four slices to two, so its devices are
    // tainted (lookahead 10 minutes); h200-mig (12:55 in Berlin) keeps its layout.
    let Some(running) = start("2026-12-02T11:55:00Z", &["--recut-lookahead", "10m"]).await else {
        return;
    };
    let client = running.client.clone();
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    eventually(
        "the A100's devices carry the re-cut taint, the H200's do not",
        || {
            let slices = slices.clone();
            async move {
                let mut tainted: BTreeMap<String, (usize, usize)> = BTreeMap::new();
                for s in slices
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                {
                    let entry = tainted
                        .entry(s.spec.node_name.clone().unwrap_or_default())
                        .or_default();
                    for d in s.spec.devices.iter().flatten() {
                        entry.0 += 1;
                        let recut = d.taints.iter().flatten().any(|t| {
                            t.key == "gpuslice.io/recut"
                                && t.effect == "NoSchedule"
                                && t.value.as_deref() == Some("20261202T120000Z")
                        });
                        entry.1 += usize::from(recut);
                    }
                }
                (tainted.get("a100-a") == Some(&(4, 4)) && tainted.get("h200-a") == Some(&(4, 0)))
                    .then_some(())
                    .ok_or_else(|| format!("(devices, tainted) per node: {tainted:?}"))
            }
        },
    )
    .await;
    notebook_waits_inference_runs(&client, "late-notebook").await;
}

#[tokio::test]
async fn a_driver_too_old_for_the_shim_offers_only_mig_slices() {
    // Both nodes run driver 470 (CUDA 11.4); the shim needs CUDA 12.0. The A100's software
    // slices are not offered, the H200's MIG instances are; each GpuNode says why and what to
    // install, and each pool counts its node.
    let Some(running) =
        start_with_driver("2026-12-02T10:00:00Z", &[], Some(("470.82.01", "11.4"))).await
    else {
        return;
    };
    let client = running.client.clone();
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    eventually("each GpuNode says the driver is too old", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let mut said = Vec::new();
            for name in ["a100-a", "h200-a"] {
                let node = gpu_nodes.get(name).await.map_err(|e| e.to_string())?;
                let c = node
                    .status
                    .iter()
                    .flat_map(|s| &s.conditions)
                    .find(|c| c.type_ == "DriverSupported")
                    .ok_or(format!("{name}: no DriverSupported condition yet"))?;
                said.push((c.status.clone(), c.reason.clone(), c.message.clone()));
            }
            said.iter()
                .all(|(status, reason, message)| {
                    status == "False"
                        && reason == "DriverTooOld"
                        && message.contains("driver 470.82.01 (CUDA 11.4)")
                        && message.contains("install NVIDIA driver 525.60.13 or newer")
                })
                .then_some(())
                .ok_or(format!("{said:?}"))
        }
    })
    .await;
    eventually("only the H200's MIG instances are published", || {
        let slices = slices.clone();
        async move {
            let mut devices: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for s in slices
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
            {
                let node = s.spec.node_name.clone().unwrap_or_default();
                devices
                    .entry(node)
                    .or_default()
                    .extend(s.spec.devices.iter().flatten().map(|d| d.name.clone()));
            }
            let h200 = devices.get("h200-a").map_or(0, Vec::len);
            (!devices.contains_key("a100-a") && h200 == 4)
                .then_some(())
                .ok_or(format!("{devices:?}"))
        }
    })
    .await;
    let pools: Api<GpuPool> = Api::all(client.clone());
    eventually("each pool counts its node as outdated", || {
        let pools = pools.clone();
        async move {
            let mut counts = Vec::new();
            for name in ["shared-a100", "h200-mig"] {
                let pool = pools.get(name).await.map_err(|e| e.to_string())?;
                let status = pool.status.unwrap_or_default();
                let degraded = status
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Degraded")
                    .map(|c| c.reason.clone());
                counts.push((name, status.driver_outdated, degraded));
            }
            counts
                .iter()
                .all(|(_, n, reason)| *n == 1 && reason.as_deref() == Some("DriverOutdated"))
                .then_some(())
                .ok_or(format!("{counts:?}"))
        }
    })
    .await;
    // A notebook (software slice) waits; an inference pod gets a MIG instance.
    notebook_waits_inference_runs(&client, "notebook").await;
}

/// A notebook pod (`name`) and an inference pod: the inference pod is placed on the H200, the
/// notebook waits (no A100 slice is offered to it).
async fn notebook_waits_inference_runs(client: &Client, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod(name, "notebook"))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("inference", "llm-inference"))
        .await
        .unwrap();
    let (bound, waiting) = settled(&pods, 1, 1, "the notebook waits, the inference pod runs").await;
    assert_eq!(bound, [("inference".to_string(), "h200-a".to_string())]);
    assert!(waiting[0].starts_with(&format!("{name}: ")), "{waiting:?}");
}

/// A `gpuslice run` on node `node` of `running` by `policy`, whose workload prints its slice
/// and pid, leaves on SIGUSR1 (the pools' CheckpointPolicy signal) and ends by itself after two
/// minutes at most (killing `gpuslice run` would leave it). Returns it with its slice and pid.
fn hold_slice(running: &Cluster, node: &str, policy: &str) -> (KillOnDrop, String, u32) {
    let mut run = Command::new(env!("CARGO_BIN_EXE_gpuslice"))
        .arg("run")
        .arg("--state")
        .arg(running.dir.path().join(node).join("state"))
        .args(["--policy", policy, "--", "sh", "-c"])
        .arg("echo \"$GPUSLICE_SLICE $$\"; trap 'exit 0' USR1; for i in $(seq 600); do sleep 0.2; done")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(run.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let (slice, pid) = line.trim().split_once(' ').unwrap();
    (KillOnDrop(run), slice.to_string(), pid.parse().unwrap())
}

/// Each published device of `node` with the value of its XID taint (`None`: untainted).
async fn xid_taints(
    client: &Client,
    node: &str,
) -> Result<BTreeMap<String, Option<String>>, String> {
    taints_of(client, node, "gpuslice.io/xid").await
}

/// Each published device of `node` with the value of its NoSchedule taint `key`.
async fn taints_of(
    client: &Client,
    node: &str,
    key: &str,
) -> Result<BTreeMap<String, Option<String>>, String> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut out = BTreeMap::new();
    for s in slices
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
    {
        for d in s.spec.devices.iter().flatten() {
            let xid = d
                .taints
                .iter()
                .flatten()
                .find(|t| t.key == key && t.effect == "NoSchedule")
                .and_then(|t| t.value.clone());
            out.insert(d.name.clone(), xid);
        }
    }
    Ok(out)
}

/// The notes of the Events with `reason` the agents recorded.
async fn event_notes(client: &Client, reason: &str) -> Vec<String> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
    events
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter_map(|e| e.note)
        .collect()
}

#[tokio::test]
async fn xid_errors_quarantine_the_faulting_slice_or_drain_the_gpu_until_it_is_reset() {
    // Both example pools isolate faults. The kernel log is a file the test writes as the kernel
    // would; the XIDs are injected into the emulated GPUs, whose NVML events the agents watch.
    let logs = tempfile::tempdir().unwrap();
    let kmsg = logs.path().join("kmsg");
    std::fs::write(&kmsg, "").unwrap();
    let kernel = |code: u64, pid: u32| gpuslice_testcluster::write_kernel_xid(&kmsg, code, pid);
    let Some(running) = start(
        "2026-12-02T10:00:00Z",
        &["--kernel-log", kmsg.to_str().unwrap()],
    )
    .await
    else {
        return;
    };
    let client = running.client.clone();
    let machine = |node: &str| {
        gpuslice_emulator::Store::open(
            &gpuslice_contract::StateDir::new(running.dir.path().join(node).join("state"))
                .emulated_machine(node),
        )
        .unwrap()
    };
    let inject = |node: &str, code: u64| {
        machine(node)
            .mutate(|m| m.inject_xid(0, code))
            .unwrap()
            .unwrap()
    };
    eventually("the A100's four slices are published", || async {
        let taints = xid_taints(&client, "a100-a").await?;
        (taints.len() == 4)
            .then_some(())
            .ok_or(format!("{taints:?}"))
    })
    .await;
    let (_a, slice_a, pid_a) = hold_slice(&running, "a100-a", "notebook");
    let (_b, slice_b, pid_b) = hold_slice(&running, "a100-a", "notebook");
    assert_ne!(slice_a, slice_b);
    // The slices `gpuslice run` holds are tainted in DRA: no pod is placed on them meanwhile.
    eventually("the slices the runs hold are tainted", || async {
        let held = taints_of(&client, "a100-a", "gpuslice.io/held-locally").await?;
        let tainted: Vec<&String> = held
            .iter()
            .filter_map(|(d, v)| v.as_ref().map(|_| d))
            .collect();
        (tainted.len() == 2 && tainted.contains(&&slice_a) && tainted.contains(&&slice_b))
            .then_some(())
            .ok_or(format!("{held:?}"))
    })
    .await;

    // XID 31 (a page fault) that the kernel says pid A caused: A's slice only.
    kernel(31, pid_a);
    inject("a100-a", 31);
    eventually("only A's slice is quarantined", || async {
        let taints = xid_taints(&client, "a100-a").await?;
        let tainted: Vec<(&String, &String)> = taints
            .iter()
            .filter_map(|(d, x)| Some((d, x.as_ref()?)))
            .collect();
        (tainted == [(&slice_a, &"31".to_string())])
            .then_some(())
            .ok_or(format!("{taints:?}"))
    })
    .await;
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    let quarantined = |name: &'static str| {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let node = gpu_nodes.get(name).await.map_err(|e| e.to_string())?;
            node.status
                .iter()
                .flat_map(|s| &s.conditions)
                .find(|c| c.type_ == "Quarantined")
                .map(|c| (c.status.clone(), c.message.clone()))
                .ok_or_else(|| "no Quarantined condition".to_string())
        }
    };
    let node = gpu_nodes.get("a100-a").await.unwrap();
    let io = node
        .status
        .iter()
        .flat_map(|s| &s.conditions)
        .find(|c| c.type_ == "IoLimited")
        .unwrap();
    // The example pool limits I/O; whether this machine can is its own affair, but it is said.
    assert!(
        io.message.contains("pool shared-a100: 500Mi/s"),
        "{}",
        io.message
    );
    let (status, message) = quarantined("a100-a").await.unwrap();
    assert_eq!(status, "True");
    assert!(
        message.contains(&format!(
            "slice {slice_a} quarantined after XID 31 (GPU memory page fault) from pid {pid_a}"
        )),
        "{message}"
    );
    // XID 43 with no kernel record while two slices are held: no slice can be named.
    inject("a100-a", 43);
    eventually("an XID no process can be named for is reported", || async {
        let notes = event_notes(&client, "XidUnattributed").await;
        notes
            .iter()
            .any(|n| n.contains("XID 43") && n.contains("2 slices of GPU 0 are held"))
            .then_some(())
            .ok_or(format!("{notes:?}"))
    })
    .await;
    // XID 45 (cleanup after an earlier error) is only counted; A ends: its slice comes back.
    inject("a100-a", 45);
    let killed = Command::new("kill")
        .args(["-KILL", &pid_a.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    eventually("A's slice is back once A released it", || async {
        let taints = xid_taints(&client, "a100-a").await?;
        let lifted = event_notes(&client, "QuarantineLifted").await;
        (taints.len() == 4
            && taints.values().all(Option::is_none)
            && lifted.iter().any(|n| n.contains(&slice_a)))
        .then_some(())
        .ok_or(format!("{taints:?} {lifted:?}"))
    })
    .await;

    // XID 79 (the GPU fell off the bus): every slice tainted, B drained by its policy.
    inject("a100-a", 79);
    eventually("the whole GPU is out and B is gone", || async {
        let taints = xid_taints(&client, "a100-a").await?;
        let b_alive = std::path::Path::new(&format!("/proc/{pid_b}")).exists();
        (taints.len() == 4 && taints.values().all(|x| x.as_deref() == Some("79")) && !b_alive)
            .then_some(())
            .ok_or(format!("{taints:?}, B alive: {b_alive}"))
    })
    .await;
    let (status, message) = quarantined("a100-a").await.unwrap();
    assert_eq!(status, "True");
    assert!(
        message.contains("GPU 0 out of service after XID 79 (GPU has fallen off the bus)")
            && message.contains("kubectl annotate gpunode a100-a gpuslice.io/gpu-reset=0"),
        "{message}"
    );
    // Someone reset the GPU and says so.
    gpu_nodes
        .patch(
            "a100-a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {"gpuslice.io/gpu-reset": "0"}}
            })),
        )
        .await
        .unwrap();
    eventually("the GPU is back and the annotation gone", || async {
        let taints = xid_taints(&client, "a100-a").await?;
        let (status, _) = quarantined("a100-a").await?;
        let node = gpu_nodes.get("a100-a").await.map_err(|e| e.to_string())?;
        let annotated = node
            .metadata
            .annotations
            .is_some_and(|a| a.contains_key("gpuslice.io/gpu-reset"));
        (taints.len() == 4
            && taints.values().all(Option::is_none)
            && status == "False"
            && !annotated)
            .then_some(())
            .ok_or(format!("{taints:?} {status} annotated: {annotated}"))
    })
    .await;

    // On MIG, NVML names the GPU instance: XID 94 (a contained ECC error) quarantines that
    // instance only.
    let (_c, slice_c, _) = hold_slice(&running, "h200-a", "llm-inference");
    let start: u32 = slice_c
        .strip_prefix("gpu0-mig")
        .and_then(|rest| rest.split('-').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{slice_c} is not a MIG slice of GPU 0"));
    machine("h200-a")
        .mutate(|m| {
            let instance = m.gpus[0]
                .instances
                .iter()
                .find(|i| i.placement.start == start)
                .map(|i| i.id);
            m.inject_xid_in(0, 94, instance)
        })
        .unwrap()
        .unwrap();
    let device_c = slice_c.replace('.', "-");
    eventually("only C's MIG instance is quarantined", || async {
        let taints = xid_taints(&client, "h200-a").await?;
        let tainted: Vec<(&String, &String)> = taints
            .iter()
            .filter_map(|(d, x)| Some((d, x.as_ref()?)))
            .collect();
        (taints.len() == 4 && tainted == [(&device_c, &"94".to_string())])
            .then_some(())
            .ok_or(format!("{taints:?}"))
    })
    .await;
}

/// What a container runtime does with a CDI device, to a local process: its environment, and its
/// mounts in a private mount namespace (over a fresh `/run`, and a copy of `/etc` so that
/// `/etc/ld.so.preload` exists only there). The emulated CUDA driver stands in for the one the
/// NVIDIA runtime would bring (`lib`, `machine`). `None` where mount namespaces are not allowed.
fn run_in_container(
    device: &serde_json::Value,
    lib: &Path,
    machine: &Path,
    scratch: &Path,
    command: &[&str],
) -> Option<std::process::Output> {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let etc = scratch.join("etc");
    let copied = Command::new("cp")
        .arg("-r")
        .arg("/etc")
        .arg(&etc)
        .status()
        .ok()?;
    if !copied.success() {
        return None;
    }
    let mut script = format!(
        "set -e; mount -t tmpfs none /run; mount --bind {etc} /etc; ",
        etc = quote(etc.to_str().unwrap())
    );
    for m in device["containerEdits"]["mounts"].as_array().unwrap() {
        let (host, target) = (
            m["hostPath"].as_str().unwrap(),
            m["containerPath"].as_str().unwrap(),
        );
        let make = if Path::new(host).is_dir() {
            format!("mkdir -p {}", quote(target))
        } else {
            format!(
                "mkdir -p \"$(dirname {t})\"; [ -e {t} ] || touch {t}",
                t = quote(target)
            )
        };
        let read_only = m["options"].as_array().unwrap().iter().any(|o| o == "ro");
        script += &format!("{make}; mount --bind {} {}; ", quote(host), quote(target));
        if read_only {
            script += &format!("mount -o remount,bind,ro {}; ", quote(target));
        }
    }
    script += "exec env";
    for e in device["containerEdits"]["env"].as_array().unwrap() {
        script += &format!(" {}", quote(e.as_str().unwrap()));
    }
    script += &format!(
        " LD_LIBRARY_PATH={} GPUSLICE_EMULATOR_STATE={}",
        quote(lib.to_str().unwrap()),
        quote(machine.to_str().unwrap())
    );
    for arg in command {
        script += &format!(" {}", quote(arg));
    }
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env_remove("LD_PRELOAD")
        .output()
        .ok()?;
    if String::from_utf8_lossy(&out.stderr).contains("unshare failed") {
        return None;
    }
    Some(out)
}

/// A gRPC channel to a Unix socket, as the kubelet opens one to a plugin (retried while the
/// plugin is starting).
async fn unix_channel(path: std::path::PathBuf) -> tonic::transport::Channel {
    eventually("the plugin accepts connections", || {
        let path = path.clone();
        async move {
            tonic::transport::Endpoint::try_from("http://[::]:0")
                .unwrap()
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                }))
                .await
                .map_err(|e| e.to_string())
        }
    })
    .await
}

fn claim(c: &ResourceClaim) -> proto::Claim {
    proto::Claim {
        namespace: c.metadata.namespace.clone().unwrap_or_default(),
        uid: c.metadata.uid.clone().unwrap_or_default(),
        name: c.metadata.name.clone().unwrap_or_default(),
    }
}

/// A tenant writes its own ResourceClaims, and a claim may carry opaque config for a driver:
/// this one names the notebook class but adds config for gpuslice.io naming the
/// llm-inference policy and an 80 GiB cap. The plugin reads only what the class gave: the
/// container's slice config holds the notebook's 9 GiB, and the agent counts the claim as a
/// notebook (its compute limit, its CheckpointPolicy).
#[tokio::test]
async fn a_claims_own_config_cannot_name_another_policy_or_raise_its_cap() {
    let Some(running) = start("2026-12-02T10:00:00Z", &[]).await else {
        return;
    };
    let client = running.client.clone();
    let mut plugin = registered_plugin(&running, "a100-a").await;
    let forged: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "forged", "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "notebook.gpuslice.io"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpuslice.io", "parameters": {
                "apiVersion": "gpuslice.io/v1alpha1", "kind": "ClassParameters",
                "policy": "llm-inference", "pool": "shared-a100", "memory": "80Gi",
                "memoryLimitBytes": 85899345920u64,
                "compute": {"limit": 100, "guarantee": 100}
            }}}]
        }}
    }))
    .unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    claims
        .create(&PostParams::default(), &forged)
        .await
        .unwrap();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "forger", "labels": {"app": "dra-test"}},
        "spec": {
            "containers": [{"name": "main", "image": "example.com/worker:1",
                "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "forged"}],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }
    }))
    .unwrap();
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let (uid, answer) = prepare_when_allocated(&mut plugin, &claims, "forged").await;
    let prepared = &answer.claims[&uid];
    assert_eq!(prepared.error, "", "{answer:?}");
    let slice = &prepared.devices[0].device_name;
    let state = gpuslice_contract::StateDir::new(running.dir.path().join("a100-a").join("state"));
    let config = gpuslice_node::kubelet::claim_config(&state, &uid, slice).expect("claim config");
    assert_eq!(
        config.memory_bytes,
        9u64 << 30,
        "the notebook's cap, not the claim's"
    );
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    eventually("the agent reports the claim as a notebook", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let node = gpu_nodes.get("a100-a").await.map_err(|e| e.to_string())?;
            let claims = node.status.map(|s| s.claims).unwrap_or_default();
            let policy = claims
                .iter()
                .find(|c| c.resource_claim.as_deref() == Some("default/forged"))
                .and_then(|c| c.policy.clone());
            (policy.as_deref() == Some("notebook"))
                .then_some(())
                .ok_or(format!("{claims:?}"))
        }
    })
    .await;

    // A claim of two notebook slices: the shim caps a container to one slice config, so the
    // second would go uncounted in its GPU's ledger. The plugin refuses to prepare it.
    let pair: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "two-quarters", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "notebook.gpuslice.io", "allocationMode": "ExactCount", "count": 2}}]}}
    }))
    .unwrap();
    claims.create(&PostParams::default(), &pair).await.unwrap();
    let mut pod = pod;
    pod.metadata.name = Some("two-quarters".into());
    pod.spec.as_mut().unwrap().resource_claims = Some(vec![
        serde_json::from_value(
            serde_json::json!({"name": "gpu", "resourceClaimName": "two-quarters"}),
        )
        .unwrap(),
    ]);
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let (uid, answer) = prepare_when_allocated(&mut plugin, &claims, "two-quarters").await;
    let refused = &answer.claims[&uid];
    assert!(
        refused.error.contains("2 software slices")
            && refused.error.contains("a container is capped to one"),
        "{answer:?}"
    );
    assert!(refused.devices.is_empty(), "{answer:?}");
}

/// Waits until ResourceClaim `default/name` is allocated, then asks the plugin to prepare it, as
/// the kubelet would: its uid and the plugin's answer.
async fn prepare_when_allocated(
    plugin: &mut DraPluginClient<tonic::transport::Channel>,
    claims: &Api<ResourceClaim>,
    name: &str,
) -> (String, proto::NodePrepareResourcesResponse) {
    let allocated = eventually(&format!("claim {name} is allocated"), || {
        let claims = claims.clone();
        async move {
            let c = claims.get(name).await.map_err(|e| e.to_string())?;
            let done = c
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .is_some();
            done.then_some(c).ok_or_else(|| "not allocated".to_string())
        }
    })
    .await;
    let answer = plugin
        .node_prepare_resources(proto::NodePrepareResourcesRequest {
            claims: vec![claim(&allocated)],
        })
        .await
        .unwrap()
        .into_inner();
    (allocated.metadata.uid.clone().unwrap(), answer)
}

/// The kubelet plugin of `node`, registered as the kubelet's plugin watcher does it.
async fn registered_plugin(
    running: &Cluster,
    node: &str,
) -> DraPluginClient<tonic::transport::Channel> {
    let registry = running
        .dir
        .path()
        .join(node)
        .join("kubelet/plugins_registry/gpuslice.io-reg.sock");
    eventually("the plugin's registration socket appears", || {
        let registry = registry.clone();
        async move { registry.exists().then_some(()).ok_or_else(String::new) }
    })
    .await;
    let mut registration = RegistrationClient::new(unix_channel(registry).await);
    let info = registration
        .get_info(proto::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            info.r#type.as_str(),
            info.name.as_str(),
            info.supported_versions.as_slice()
        ),
        (
            "DRAPlugin",
            "gpuslice.io",
            ["v1.DRAPlugin".to_string()].as_slice()
        )
    );
    registration
        .notify_registration_status(proto::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    DraPluginClient::new(unix_channel(info.endpoint.into()).await)
}

#[tokio::test]
async fn the_kubelet_plugin_prepares_allocated_slices() {
    let Some(mut running) = start("2026-12-02T10:00:00Z", &[]).await else {
        return;
    };
    let client = running.client.clone();
    let base = running.dir.path().to_path_buf();
    let node_dir = |node: &str| base.join(node);
    let mut plugin = registered_plugin(&running, "a100-a").await;

    // Two notebooks placed by the scheduler on the A100 node's software slices.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for i in 0..2 {
        pods.create(
            &PostParams::default(),
            &pod(&format!("notebook-{i}"), "notebook"),
        )
        .await
        .unwrap();
    }
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let allocated: Vec<ResourceClaim> = eventually("both notebooks' claims are allocated", || {
        let claims = claims.clone();
        async move {
            let all: Vec<ResourceClaim> = claims
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .filter(|c| {
                    c.status
                        .as_ref()
                        .and_then(|s| s.allocation.as_ref())
                        .is_some()
                })
                .collect();
            (all.len() == 2)
                .then_some(all.clone())
                .ok_or_else(|| format!("{} allocated", all.len()))
        }
    })
    .await;

    let missing = proto::Claim {
        namespace: "default".into(),
        uid: "0000".into(),
        name: "missing".into(),
    };
    let request = proto::NodePrepareResourcesRequest {
        claims: allocated
            .iter()
            .map(claim)
            .chain([missing.clone()])
            .collect(),
    };
    let answer = plugin
        .node_prepare_resources(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(
        answer.claims["0000"]
            .error
            .contains("ResourceClaim default/missing"),
        "{answer:?}"
    );
    let cdi = node_dir("a100-a").join("cdi");
    let state = node_dir("a100-a").join("state");
    let mut given = BTreeSet::new();
    for c in &allocated {
        let uid = c.metadata.uid.clone().unwrap();
        let prepared = &answer.claims[&uid];
        assert_eq!(prepared.error, "", "{answer:?}");
        let [device] = &prepared.devices[..] else {
            panic!("{prepared:?}")
        };
        assert_eq!(device.pool_name, "a100-a");
        assert_eq!(
            device.cdi_device_ids,
            [format!("gpuslice.io/slice={uid}-{}", device.device_name)]
        );
        given.insert(device.device_name.clone());

        // The CDI spec gives the container the slice: its GPU, the node contract's slice
        // directory and config, the agent's socket, and the shim through /etc/ld.so.preload.
        let spec: serde_json::Value = serde_json::from_slice(
            &std::fs::read(cdi.join(format!("gpuslice.io-{uid}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(spec["kind"], "gpuslice.io/slice");
        let edits = &spec["devices"][0]["containerEdits"];
        assert_eq!(
            spec["devices"][0]["name"],
            format!("{uid}-{}", device.device_name)
        );
        let slice = &device.device_name;
        let config: serde_json::Value = serde_json::from_slice(
            &std::fs::read(state.join("slices").join(slice).join("config")).unwrap(),
        )
        .unwrap();
        let env: Vec<&str> = edits["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e.as_str())
            .collect();
        let claim_env: Vec<&str> = spec["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e.as_str())
            .collect();
        assert!(
            claim_env.contains(
                &format!(
                    "CUDA_VISIBLE_DEVICES={}",
                    config["deviceUuid"].as_str().unwrap()
                )
                .as_str()
            ),
            "{claim_env:?}"
        );
        // The pool's CheckpointPolicy `standard` (every 5m, SIGUSR1): the notebook is told where
        // its marker goes, how often to checkpoint, and by which signal it is asked to.
        for want in [
            format!(
                "GPUSLICE_CHECKPOINT_DONE=/run/gpuslice/slices/{}/checkpoint-done",
                device.device_name
            ),
            "GPUSLICE_CHECKPOINT_INTERVAL=300".to_string(),
            "GPUSLICE_CHECKPOINT_SIGNAL=SIGUSR1".to_string(),
        ] {
            assert!(env.contains(&want.as_str()), "{want} not in {env:?}");
        }
        assert!(
            env.contains(
                &format!("GPUSLICE_SLICE_CONFIG=/run/gpuslice/slices/{slice}/config").as_str()
            ),
            "{env:?}"
        );
        let mounts = edits["mounts"].as_array().unwrap();
        let mount = |to: &str| {
            mounts
                .iter()
                .find(|m| m["containerPath"] == to)
                .unwrap_or_else(|| panic!("no mount at {to}: {mounts:?}"))
        };
        // The socket's directory, so that an agent started again is reached.
        assert_eq!(
            mount("/run/gpuslice/socket")["hostPath"],
            state.join("socket").to_str().unwrap()
        );
        let preload = mount("/etc/ld.so.preload");
        assert!(
            preload["options"]
                .as_array()
                .unwrap()
                .contains(&"ro".into())
        );
        assert_eq!(
            std::fs::read_to_string(preload["hostPath"].as_str().unwrap()).unwrap(),
            "/run/gpuslice/lib/libgpuslice.so\n"
        );
        // The container's slice config is the claim's: the policy's memory (8Gi) plus the
        // pool's headroom (1Gi), not the whole 20 GiB slice.
        let claim_config: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                mount(&format!("/run/gpuslice/slices/{slice}/config"))["hostPath"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(claim_config["memoryBytes"], 9u64 << 30);
        assert_eq!(claim_config["id"], config["id"]);
        let shim = mount("/run/gpuslice/lib/libgpuslice.so");
        assert!(Path::new(shim["hostPath"].as_str().unwrap()).exists());
    }
    assert_eq!(given.len(), 2, "two claims, two slices: {given:?}");

    // What the container sees, through the CDI spec alone (no LD_PRELOAD, no GPUSLICE_* set by
    // us): a GPU capped at the policy's 9 GiB; allocations past it fail.
    let uid = allocated[0].metadata.uid.clone().unwrap();
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(cdi.join(format!("gpuslice.io-{uid}.json"))).unwrap(),
    )
    .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let (program, lib) = gpuslice_testcluster::build_probe(
        Path::new(env!("CARGO_BIN_EXE_gpuslice")),
        scratch.path(),
    );
    let machine = gpuslice_contract::StateDir::new(&state).emulated_machine("a100-a");
    let program = program.to_str().unwrap();
    match run_in_container(
        &spec["devices"][0],
        &lib,
        &machine,
        scratch.path(),
        &[program, "link", "cap"],
    ) {
        None => eprintln!("no mount namespaces here: the container check is skipped"),
        Some(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            let value = |key: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("{key}=")))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or_else(|| {
                        panic!(
                            "no {key} in {text}\n{}",
                            String::from_utf8_lossy(&out.stderr)
                        )
                    })
            };
            assert_eq!(value("info_total"), 9 << 30, "{text}");
            // 1 GiB allocations until the cap: eight, as the CUDA context takes its share.
            assert_eq!(value("chunks"), 8, "{text}");
            assert_ne!(value("alloc_over"), 0, "{text}");
        }
    }

    // Asked again (the kubelet retries, or restarted), the plugin answers the same.
    let again = plugin
        .node_prepare_resources(proto::NodePrepareResourcesRequest {
            claims: allocated.iter().map(claim).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    for c in &allocated {
        let uid = c.metadata.uid.as_ref().unwrap();
        assert_eq!(again.claims[uid], answer.claims[uid]);
    }

    // The agent killed between prepare and unprepare: restarted, it still holds the slices and
    // answers the kubelet the same.
    let _ = running.processes[0].0.kill();
    let _ = running.processes[0].0.wait();
    // What the old agent reported goes, so that what is seen next is the new one's.
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    gpu_nodes
        .patch_status(
            "a100-a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"status": {"claims": null}})),
        )
        .await
        .unwrap();
    running.processes[0] = spawn_agent(
        &running.cluster,
        running.dir.path(),
        "a100-a",
        "2026-12-02T10:00:00Z",
        &[],
    )
    .await;
    eventually("the restarted agent reports both prepared claims", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let node = gpu_nodes.get("a100-a").await.map_err(|e| e.to_string())?;
            let held = node
                .status
                .iter()
                .flat_map(|s| &s.claims)
                .filter(|c| c.resource_claim.is_some() && c.policy.as_deref() == Some("notebook"))
                .count();
            (held == 2)
                .then_some(())
                .ok_or_else(|| format!("{held} held"))
        }
    })
    .await;
    let mut plugin = DraPluginClient::new(
        unix_channel(node_dir("a100-a").join("kubelet/plugins/gpuslice.io/dra.sock")).await,
    );
    let after_restart = plugin
        .node_prepare_resources(proto::NodePrepareResourcesRequest {
            claims: allocated.iter().map(claim).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    for c in &allocated {
        let uid = c.metadata.uid.as_ref().unwrap();
        assert_eq!(after_restart.claims[uid], answer.claims[uid]);
    }

    // The H200 node's plugin refuses a claim allocated on the A100 node.
    let other = node_dir("h200-a").join("kubelet/plugins/gpuslice.io/dra.sock");
    let mut other = DraPluginClient::new(unix_channel(other).await);
    let refused = other
        .node_prepare_resources(proto::NodePrepareResourcesRequest {
            claims: vec![claim(&allocated[0])],
        })
        .await
        .unwrap()
        .into_inner();
    let uid = allocated[0].metadata.uid.clone().unwrap();
    assert!(
        refused.claims[&uid].error.contains("not on node h200-a"),
        "{refused:?}"
    );

    // Unprepared, twice: its CDI spec is gone, and the second time is no error.
    for _ in 0..2 {
        let done = plugin
            .node_unprepare_resources(proto::NodeUnprepareResourcesRequest {
                claims: vec![claim(&allocated[0])],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(done.claims[&uid].error, "");
        assert!(!cdi.join(format!("gpuslice.io-{uid}.json")).exists());
    }
}

/// The memory capacities of a node's published devices, and the pool generation they are in.
async fn published_memory(client: &Client, node: &str) -> Result<(Vec<String>, i64), String> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|e| e.to_string())?;
    let generation = list
        .items
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let memory = list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| Some(d.capacity.as_ref()?.get("memory")?.value.0.clone()))
        .collect();
    Ok((memory, generation))
}

#[tokio::test]
async fn at_a_window_boundary_the_agent_switches_to_the_staged_layout_before_the_spec_is_rewritten()
{
    // 19:59:30 in Shanghai: at 20:00 shared-a100 goes from four 20 GiB slices to two of 40 GiB.
    let Some(running) = start("2026-12-02T11:59:30Z", &["--recut-lookahead", "1s"]).await else {
        return;
    };
    let client = running.client.clone();
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    // Ahead of the boundary the operator has written what 20:00 brings next to the day layout.
    let staged = eventually("the night layout is staged in the A100's spec", || {
        let gpu_nodes = gpu_nodes.clone();
        let client = client.clone();
        async move {
            let node = gpu_nodes.get("a100-a").await.map_err(|e| e.to_string())?;
            let (memory, _) = published_memory(&client, "a100-a").await?;
            let gpu = node.spec.gpus.first().ok_or("no layout yet")?;
            let next = gpu.next.as_ref().ok_or("nothing staged")?;
            let day = gpu
                .assigned
                .layout
                .software
                .as_ref()
                .map(|s| s.memory.0.clone());
            let night = next
                .assigned
                .layout
                .software
                .as_ref()
                .map(|s| s.memory.0.clone());
            let ready = memory == ["20Gi"; 4]
                && day.as_deref() == Some("20Gi")
                && night.as_deref() == Some("40Gi")
                && next.assigned.window.as_deref() == Some("night")
                && gpuslice_api::chrono_of(&next.at)
                    == Some("2026-12-02T12:00:00Z".parse().unwrap());
            let seen = format!("published {memory:?}, day {day:?}, staged {next:?}");
            ready.then_some(node.metadata.generation).ok_or(seen)
        }
    })
    .await;
    let generation = staged;
    // At the boundary the agent re-cuts and republishes on its own clock: the spec it switched
    // from is still the one the operator wrote before (it catches up 20 s later).
    let (_, published_at) = eventually("the A100 is re-cut and republished", || {
        let client = client.clone();
        async move {
            let (memory, pool_generation) = published_memory(&client, "a100-a").await?;
            (memory == ["40Gi"; 2])
                .then_some((memory.clone(), pool_generation))
                .ok_or_else(|| format!("{memory:?}"))
        }
    })
    .await;
    let node = gpu_nodes.get("a100-a").await.unwrap();
    assert_eq!(
        node.metadata.generation, generation,
        "the switch needed no spec write"
    );
    // Then the operator writes the night layout as the spec, with the morning staged next, and
    // the agent reports it applied; the devices are not published again.
    eventually("the spec catches up and is reported applied", || {
        let (gpu_nodes, pools, client) = (
            gpu_nodes.clone(),
            Api::<GpuPool>::all(client.clone()),
            client.clone(),
        );
        async move {
            let node = gpu_nodes.get("a100-a").await.map_err(|e| e.to_string())?;
            let gpu = node.spec.gpus.first().ok_or("no layout")?;
            let memory = gpu.assigned.layout.software.as_ref().map(|s| s.memory.0.clone());
            let morning = gpu
                .next
                .as_ref()
                .and_then(|n| gpuslice_api::chrono_of(&n.at));
            let applied = node.status.as_ref().and_then(|s| s.applied_generation);
            let pool = pools.get("shared-a100").await.map_err(|e| e.to_string())?;
            let ready = pool
                .status
                .iter()
                .flat_map(|s| &s.conditions)
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let (_, pool_generation) = published_memory(&client, "a100-a").await?;
            (memory.as_deref() == Some("40Gi")
                && morning == Some("2026-12-03T00:00:00Z".parse().unwrap())
                && node.metadata.generation > generation
                && applied == node.metadata.generation
                && ready
                && pool_generation == published_at)
                .then_some(())
                .ok_or_else(|| {
                    format!(
                        "spec {memory:?} (generation {:?}, applied {applied:?}), next {morning:?}, pool ready {ready}, devices generation {pool_generation}",
                        node.metadata.generation
                    )
                })
        }
    })
    .await;
}

#[tokio::test]
async fn a_prepared_claim_holds_back_a_window_change_until_it_is_unprepared() {
    // 19:59:20 in Shanghai: at 20:00 shared-a100 goes from four 20 GiB slices to two of 40 GiB.
    // (No re-cut taint ahead of it here, so that a pod lands on a slice about to change.)
    let Some(running) = start("2026-12-02T11:59:20Z", &["--recut-lookahead", "1s"]).await else {
        return;
    };
    let client = running.client.clone();
    let a100 = running.dir.path().join("a100-a");
    let socket = a100.join("kubelet/plugins/gpuslice.io/dra.sock");
    eventually("the plugin's socket appears", || {
        let socket = socket.clone();
        async move { socket.exists().then_some(()).ok_or_else(String::new) }
    })
    .await;
    let mut plugin = DraPluginClient::new(unix_channel(socket).await);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("notebook-0", "notebook"))
        .await
        .unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let allocated = eventually("the notebook's claim is allocated", || {
        let claims = claims.clone();
        async move {
            claims
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .find(|c| {
                    c.status
                        .as_ref()
                        .and_then(|s| s.allocation.as_ref())
                        .is_some()
                })
                .ok_or_else(|| "not yet".to_string())
        }
    })
    .await;
    let prepared = plugin
        .node_prepare_resources(proto::NodePrepareResourcesRequest {
            claims: vec![claim(&allocated)],
        })
        .await
        .unwrap()
        .into_inner();
    let uid = allocated.metadata.uid.clone().unwrap();
    assert_eq!(prepared.claims[&uid].error, "");
    let slice = prepared.claims[&uid].devices[0].device_name.clone();

    // At 20:00 the node must re-cut the GPU, but the pod's slice is in use: the agent waits and
    // says why, and the pool says it is blocked.
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    let pools: Api<GpuPool> = Api::all(client.clone());
    eventually("the window change waits for the prepared claim", || {
        let (gpu_nodes, pools, slice) = (gpu_nodes.clone(), pools.clone(), slice.clone());
        async move {
            let node = gpu_nodes.get("a100-a").await.map_err(|e| e.to_string())?;
            let blocked = node
                .status
                .iter()
                .flat_map(|s| &s.conditions)
                .find(|c| c.type_ == "Blocked")
                .map(|c| (c.status.clone(), c.message.clone()));
            let pool = pools.get("shared-a100").await.map_err(|e| e.to_string())?;
            let progressing = pool
                .status
                .iter()
                .flat_map(|s| &s.conditions)
                .find(|c| c.type_ == "Progressing")
                .map(|c| c.reason.clone());
            // The node's status says who holds the slice.
            let holders: Vec<(String, Vec<String>)> = node
                .status
                .iter()
                .flat_map(|s| &s.claims)
                .map(|c| (c.slice.clone(), c.pods.clone()))
                .collect();
            (blocked.as_ref().is_some_and(|(s, m)| {
                s == "True" && m.contains(&format!("a pod's ResourceClaim on {slice}"))
            }) && progressing.as_deref() == Some("Blocked")
                && holders == [(slice.clone(), vec!["default/notebook-0".to_string()])])
            .then_some(())
            .ok_or_else(|| format!("{blocked:?} {progressing:?} {holders:?}"))
        }
    })
    .await;

    // Meanwhile no new pod lands on the GPU: its devices carry the re-cut taint.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    eventually("the waiting GPU's devices are tainted", || {
        let slices = slices.clone();
        async move {
            let taints: Vec<Option<String>> = slices
                .list(&ListParams::default().fields("spec.nodeName=a100-a"))
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .map(|d| {
                    d.taints
                        .iter()
                        .flatten()
                        .find(|t| t.key == "gpuslice.io/recut")
                        .and_then(|t| t.value.clone())
                })
                .collect();
            (taints.len() == 4 && taints.iter().all(|t| t.as_deref() == Some("pending")))
                .then_some(())
                .ok_or_else(|| format!("{taints:?}"))
        }
    })
    .await;

    // The kubelet unprepares the claim (the pod ended): the node takes the night layout and
    // publishes its two 40 GiB slices.
    plugin
        .node_unprepare_resources(proto::NodeUnprepareResourcesRequest {
            claims: vec![claim(&allocated)],
        })
        .await
        .unwrap();
    eventually("the A100 is re-cut and republished", || {
        let slices = slices.clone();
        async move {
            let memory: Vec<String> = slices
                .list(&ListParams::default().fields("spec.nodeName=a100-a"))
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter_map(|d| Some(d.capacity.as_ref()?.get("memory")?.value.0.clone()))
                .collect();
            (memory == ["40Gi", "40Gi"])
                .then_some(())
                .ok_or_else(|| format!("{memory:?}"))
        }
    })
    .await;
}

/// The scheduler may allocate a slice that a `gpuslice run` on the node took before the agent's
/// `held-locally` taint was published: the slice is not prepared for the pod too (one holder per
/// slice); the kubelet's next try prepares it once the command has given it back.
#[tokio::test]
async fn a_slice_gpuslice_run_holds_is_not_prepared_for_a_pod_as_well() {
    let Some(running) = start("2026-12-02T10:00:00Z", &[]).await else {
        return;
    };
    let client = running.client.clone();
    let mut plugin = registered_plugin(&running, "a100-a").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("notebook-0", "notebook"))
        .await
        .unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let (allocated, device) = eventually("the notebook's claim is allocated", || {
        let claims = claims.clone();
        async move {
            let all = claims
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            all.items
                .into_iter()
                .find_map(|c| {
                    let device = c
                        .status
                        .as_ref()?
                        .allocation
                        .as_ref()?
                        .devices
                        .as_ref()?
                        .results
                        .as_ref()?
                        .first()?
                        .device
                        .clone();
                    Some((c, device))
                })
                .ok_or_else(|| "not allocated".to_string())
        }
    })
    .await;
    // `gpuslice run`s on the node until one holds the allocated slice (the agent does not know
    // the allocation: nothing has been prepared yet).
    let mut holders = Vec::new();
    let holder = loop {
        let held: Vec<&String> = holders
            .iter()
            .map(|h: &(KillOnDrop, String)| &h.1)
            .collect();
        assert!(holders.len() < 16, "no run got {device}: {held:?}");
        let (run, slice, _) = hold_slice(&running, "a100-a", "notebook");
        let held = gpuslice_api::dra::device_name(&slice) == device;
        holders.push((run, slice));
        if held {
            break holders.len() - 1;
        }
    };
    let request = proto::NodePrepareResourcesRequest {
        claims: vec![claim(&allocated)],
    };
    let uid = allocated.metadata.uid.clone().unwrap();
    let answer = plugin
        .node_prepare_resources(request.clone())
        .await
        .unwrap()
        .into_inner();
    let refused = &answer.claims[&uid];
    assert!(
        refused.devices.is_empty()
            && refused.error.contains(&format!(
                "slice {} is held by `gpuslice run`",
                holders[holder].1
            ))
            && refused
                .error
                .contains("the pod starts once that command ends"),
        "{answer:?}"
    );
    // The command ends (its connection closes): the kubelet's next try gets the slice.
    holders.remove(holder);
    let prepared = eventually("the claim is prepared once the slice is given back", || {
        let mut plugin = plugin.clone();
        let request = request.clone();
        let uid = uid.clone();
        async move {
            let answer = plugin
                .node_prepare_resources(request)
                .await
                .map_err(|e| e.to_string())?
                .into_inner();
            let c = &answer.claims[&uid];
            (c.error.is_empty())
                .then(|| c.devices.clone())
                .ok_or_else(|| c.error.clone())
        }
    })
    .await;
    assert_eq!(prepared[0].device_name, device);
    // And the slice is the pod's now: another `gpuslice run` gets another one.
    let (_run, slice, _) = hold_slice(&running, "a100-a", "notebook");
    assert_ne!(gpuslice_api::dra::device_name(&slice), device);
}

/// The agents publish each GPU's NVLink domain (`nvlinkDomain`, from NVML's peer-to-peer
/// status): every GPU of an 8-GPU H100 SXM board shares one, the two cards of an A100 PCIe box
/// have none. A claim for two whole GPUs that must share an NVLink domain (a `matchAttribute`
/// constraint, what a policy's `topology: nvlink` asks) is allocated by kube-scheduler on the
/// board and never on the PCIe pair, though both have two free GPUs.
#[tokio::test]
async fn a_two_gpu_claim_that_needs_nvlink_gets_an_nvlink_pair_never_a_pcie_one() {
    const CLOCK: &str = "2026-12-02T10:00:00Z";
    let Some(cluster) = ControlPlane::start(Components::all()).await.unwrap() else {
        return;
    };
    let client = cluster.client_with_crds().await;
    if !cluster.install_chart_identities().await.unwrap() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut processes = Vec::new();
    for (name, model, gpus) in [
        ("hgx", "NVIDIA H100 80GB HBM3", 8),
        ("pcie", "NVIDIA A100 80GB PCIe", 2),
    ] {
        cluster
            .create_node(name, &[("gpuslice.io/pool", "whole")], &[])
            .await
            .unwrap();
        let lines: String = (0..gpus)
            .map(|i| format!("- {{index: {i}, model: {model}}}\n"))
            .collect();
        std::fs::write(
            dir.path().join(format!("{name}.yaml")),
            format!("name: {name}\ngpus:\n{lines}"),
        )
        .unwrap();
        processes.push(spawn_agent(&cluster, dir.path(), name, CLOCK, &[]).await);
    }
    processes.push(gpuslice_testcluster::spawn_operator(
        env!("CARGO_BIN_EXE_gpuslice"),
        &cluster.operator_kubeconfig().await.unwrap(),
        Some(CLOCK),
        &[],
    ));
    gpuslice_testcluster::apply_all(
        &client,
        &gpuslice_testcluster::documents(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: whole}\nspec:\n  nodeSelector: {matchLabels: {gpuslice.io/pool: whole}}\n  layout: {exclusive: {}}\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: trainer}\nspec: {pool: whole, memory: 70Gi}\n",
        ),
    )
    .await;
    gpuslice_testcluster::wait_for_device_classes(&client, 1).await;

    // What each node publishes of each GPU: its NVLink domain, if any.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let domains = eventually("both nodes publish their GPUs", || {
        let slices = slices.clone();
        async move {
            let mut domains: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
            for s in slices
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
            {
                for d in s.spec.devices.iter().flatten() {
                    let domain = d
                        .attributes
                        .as_ref()
                        .and_then(|a| a.get(gpuslice_api::dra::attribute::NVLINK_DOMAIN))
                        .and_then(|a| a.string.clone());
                    domains
                        .entry(s.spec.node_name.clone().unwrap_or_default())
                        .or_default()
                        .push(domain);
                }
            }
            (domains.get("hgx").map(Vec::len) == Some(8)
                && domains.get("pcie").map(Vec::len) == Some(2))
            .then_some(domains.clone())
            .ok_or_else(|| format!("{domains:?}"))
        }
    })
    .await;
    let board: BTreeSet<&Option<String>> = domains["hgx"].iter().collect();
    assert_eq!(board.len(), 1, "one domain on the board: {domains:?}");
    assert!(
        board
            .first()
            .unwrap()
            .as_ref()
            .is_some_and(|d| d.starts_with("GPU-")),
        "{domains:?}"
    );
    assert_eq!(domains["pcie"], [None, None]);

    // A pod per node, each asking for two of the policy's devices on one NVLink domain.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    for node in ["pcie", "hgx"] {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": format!("pair-{node}")},
            "spec": {"devices": {
                "requests": [{"name": "gpus", "exactly": {
                    "deviceClassName": "trainer.gpuslice.io", "allocationMode": "ExactCount", "count": 2}}],
                "constraints": [{"requests": ["gpus"],
                    "matchAttribute": format!("gpuslice.io/{}", gpuslice_api::dra::attribute::NVLINK_DOMAIN)}]
            }}
        }))
        .unwrap();
        claims.create(&PostParams::default(), &claim).await.unwrap();
        let mut p = pod(&format!("pair-{node}"), "trainer");
        let spec = p.spec.as_mut().unwrap();
        spec.node_selector =
            Some([("kubernetes.io/hostname".to_string(), node.to_string())].into());
        spec.resource_claims = Some(vec![
            serde_json::from_value(
                serde_json::json!({"name": "gpus", "resourceClaimName": format!("pair-{node}")}),
            )
            .unwrap(),
        ]);
        spec.containers[0].resources = Some(
            serde_json::from_value(serde_json::json!({"claims": [{"name": "gpus"}]})).unwrap(),
        );
        pods.create(&PostParams::default(), &p).await.unwrap();
    }
    let (bound, waiting) = settled(
        &pods,
        1,
        1,
        "the board's pair is placed, the PCIe one waits",
    )
    .await;
    assert_eq!(bound, [("pair-hgx".to_string(), "hgx".to_string())]);
    assert!(
        waiting[0].starts_with("pair-pcie: ") && waiting[0].contains("cannot allocate all claims"),
        "{waiting:?}"
    );
    let allocated = claims.get("pair-hgx").await.unwrap();
    let devices: Vec<String> = gpuslice_testcluster::allocated_devices(allocated)
        .into_iter()
        .map(|r| r.device)
        .collect();
    assert_eq!(devices.len(), 2, "{devices:?}");
    drop(processes);
}
