//! The operator binary against a real control plane (kube-apiserver, etcd, kwok nodes): pools
//! become per-node desired layouts in GpuNodes and pool status with conditions; a node that gains
//! the pool's label joins; an agent that applies turns the pool Ready; a pool naming a missing
//! CheckpointPolicy is Degraded while the others reconcile.

use std::path::Path;
use std::process::{Command, Stdio};

use gpuslice_api::{GpuNode, GpuPool, NodeInventory};
use gpuslice_testcluster::{Components, ControlPlane, KillOnDrop, eventually, free_port};

fn http_get(port: u16, path: &str) -> (String, String) {
    gpuslice_testcluster::local_get(port, path).unwrap()
}
use gpuslice_testcluster::repo_root as root;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};

const AGENT: &str = "gpuslice-test-agent";

/// What an agent on `node` would report: its GPUs.
async fn report_gpus(client: &Client, node: &str, gpus: &str) {
    let api: Api<GpuNode> = Api::all(client.clone());
    let inventory: NodeInventory =
        serde_yaml::from_str(&format!("name: {node}\ngpus:\n{gpus}")).unwrap();
    let params = PatchParams::apply(AGENT).force();
    // The object must exist (with its required, here empty, spec) before its status can be written.
    let object = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": node}, "spec": {}});
    api.patch(node, &params, &Patch::Apply(&object))
        .await
        .unwrap();
    let status = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": node}, "status": {"inventory": inventory}});
    api.patch_status(node, &params, &Patch::Apply(&status))
        .await
        .unwrap();
}

/// What an agent does once it has applied the spec. Like every apply, it states its whole status
/// (server-side apply drops the fields a manager stops sending).
async fn report_applied(client: &Client, node: &str) {
    let api: Api<GpuNode> = Api::all(client.clone());
    let current = api.get(node).await.unwrap();
    let inventory = current.status.and_then(|s| s.inventory);
    let status = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode", "metadata": {"name": node}, "status": {"inventory": inventory, "appliedGeneration": current.metadata.generation}});
    api.patch_status(
        node,
        &PatchParams::apply(AGENT).force(),
        &Patch::Apply(&status),
    )
    .await
    .unwrap();
}

async fn apply_yaml(client: &Client, text: &str) {
    for doc in text.split("\n---\n") {
        let value: serde_json::Value = serde_yaml::from_str(doc).unwrap();
        let name = value["metadata"]["name"].as_str().unwrap().to_string();
        let params = PatchParams::apply("gpuslice-test-gitops").force();
        match value["kind"].as_str().unwrap() {
            "GpuPool" => {
                let api: Api<GpuPool> = Api::all(client.clone());
                api.patch(&name, &params, &Patch::Apply(&value))
                    .await
                    .unwrap();
            }
            "CheckpointPolicy" => {
                let api: Api<gpuslice_api::CheckpointPolicy> = Api::all(client.clone());
                api.patch(&name, &params, &Patch::Apply(&value))
                    .await
                    .unwrap();
            }
            "GpuSlicePolicy" => {
                let api: Api<gpuslice_api::GpuSlicePolicy> = Api::all(client.clone());
                api.patch(&name, &params, &Patch::Apply(&value))
                    .await
                    .unwrap();
            }
            other => panic!("{other}"),
        }
    }
}

fn condition(pool: &GpuPool, kind: &str) -> Option<(String, String, String)> {
    pool.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// A control plane with our CRDs installed, and a client; `None` where none can run.
async fn cluster_with_crds() -> Option<(ControlPlane, Client)> {
    let cluster = ControlPlane::start(Components::default()).await.unwrap()?;
    let client = cluster.client_with_crds().await;
    // The operator and the agents run as the chart's identities.
    if !cluster.install_chart_identities().await.unwrap() {
        return None;
    }
    Some((cluster, client))
}

/// The operator's arguments that go with its chart identity: its lease in the chart's namespace.
const LEASE: [&str; 2] = ["--lease-namespace", gpuslice_testcluster::CHART_NAMESPACE];

/// `gpuslice operator` with `LEASE` and `extra` against the cluster (its log on stderr), on a
/// clock started at `clock` where given.
async fn start_operator(cluster: &ControlPlane, extra: &[&str], clock: Option<&str>) -> KillOnDrop {
    let mut operator = Command::new(env!("CARGO_BIN_EXE_gpuslice"));
    operator
        .arg("operator")
        .args(LEASE)
        .args(extra)
        .env("KUBECONFIG", cluster.operator_kubeconfig().await.unwrap());
    if let Some(clock) = clock {
        operator.env("GPUSLICE_CLOCK_START", clock);
    }
    KillOnDrop(
        operator
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    )
}

#[tokio::test]
async fn pools_become_node_layouts_and_status() {
    let Some((cluster, client)) = cluster_with_crds().await else {
        return;
    };
    for name in ["h200-a", "h200-b"] {
        cluster
            .create_node(name, &[("gpuslice.io/pool", "h200-mig")], &[])
            .await
            .unwrap();
        report_gpus(
            &client,
            name,
            "- {index: 0, model: NVIDIA H200}\n- {index: 1, model: NVIDIA H200}\n",
        )
        .await;
    }
    cluster.create_node("h200-c", &[], &[]).await.unwrap();
    report_gpus(&client, "h200-c", "- {index: 0, model: NVIDIA H200}\n").await;

    // Mid-morning in Berlin on a Wednesday: the pool's default layout is in force.
    let _operator = start_operator(&cluster, &[], Some("2026-12-02T09:00:00Z")).await;
    let pool_text =
        std::fs::read_to_string(root().join("examples/gitops/pools/h200-mig.yaml")).unwrap();
    apply_yaml(&client, &pool_text).await;
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    let pools: Api<GpuPool> = Api::all(client.clone());

    // Both labelled nodes get the layout for both GPUs; the unlabelled one nothing.
    for name in ["h200-a", "h200-b"] {
        let gpu_nodes = gpu_nodes.clone();
        eventually(&format!("{name} gets its layout"), || {
            let gpu_nodes = gpu_nodes.clone();
            async move {
                let n = gpu_nodes.get(name).await.map_err(|e| e.to_string())?;
                let gpus = &n.spec.gpus;
                (gpus.len() == 2
                    && gpus
                        .iter()
                        .all(|g| g.assigned.pool == "h200-mig" && g.assigned.layout.mig.is_some()))
                .then_some(())
                .ok_or_else(|| format!("{:?}", n.spec))
            }
        })
        .await;
    }
    assert!(gpu_nodes.get("h200-c").await.unwrap().spec.gpus.is_empty());

    // The checkpoint policy the pool names does not exist yet: Degraded, saying what to change.
    let pool = eventually("the pool reports its problem", || {
        let pools = pools.clone();
        async move {
            let p = pools.get("h200-mig").await.map_err(|e| e.to_string())?;
            match condition(&p, "Degraded") {
                Some((s, _, _)) if s == "True" => Ok(p),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let (_, reason, message) = condition(&pool, "Degraded").unwrap();
    assert_eq!(reason, "InvalidConfiguration");
    assert!(
        message.contains("CheckpointPolicy \"standard\" does not exist"),
        "{message}"
    );
    let status = pool.status.unwrap();
    assert_eq!((status.nodes, status.gpus, status.slices.total), (2, 4, 16));
    assert_eq!(status.observed_generation, pool.metadata.generation);
    assert!(status.next_transition.is_some());

    // The policy appears; the agents apply; the pool turns Ready.
    let checkpoint =
        std::fs::read_to_string(root().join("examples/gitops/policies/checkpoint-standard.yaml"))
            .unwrap();
    apply_yaml(&client, &checkpoint).await;
    for name in ["h200-a", "h200-b"] {
        report_applied(&client, name).await;
    }
    eventually("the pool is Ready", || {
        let pools = pools.clone();
        async move {
            let p = pools.get("h200-mig").await.map_err(|e| e.to_string())?;
            match condition(&p, "Ready") {
                Some((s, _, _)) if s == "True" => Ok(()),
                other => Err(format!("{other:?} / {:?}", condition(&p, "Progressing"))),
            }
        }
    })
    .await;

    // Policies say whether workloads can use them: one fits a slice, one names no pool.
    let policy =
        std::fs::read_to_string(root().join("examples/gitops/policies/llm-inference.yaml"))
            .unwrap();
    apply_yaml(&client, &policy).await;
    apply_yaml(
        &client,
        &policy
            .replace("name: llm-inference", "name: lost")
            .replace("pool: h200-mig", "pool: gone"),
    )
    .await;
    let policies: Api<gpuslice_api::GpuSlicePolicy> = Api::all(client.clone());
    for (name, want_ready, want_reason) in [
        ("llm-inference", "True", "SliceFits"),
        ("lost", "False", "PoolNotFound"),
    ] {
        let policies = policies.clone();
        eventually(&format!("GpuSlicePolicy {name} is {want_reason}"), || {
            let policies = policies.clone();
            async move {
                let p = policies.get(name).await.map_err(|e| e.to_string())?;
                let ready = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready").cloned());
                ready
                    .filter(|c| c.status == want_ready && c.reason == want_reason)
                    .map(|_| ())
                    .ok_or_else(|| format!("{:?}", p.status))
            }
        })
        .await;
    }

    // A pool whose layout the GPUs it selects cannot have: Degraded, and h200-mig stays Ready.
    apply_yaml(
        &client,
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: broken}\nspec:\n  nodeSelector: {matchLabels: {team: x}}\n  layout: {mig: {profiles: {3g.71gb: 3}}}\n",
    )
    .await;
    let nodes: Api<Node> = Api::all(client.clone());
    let team = serde_json::json!({"metadata": {"labels": {"team": "x"}}});
    nodes
        .patch("h200-c", &PatchParams::default(), &Patch::Merge(&team))
        .await
        .unwrap();
    eventually("the broken pool says what is wrong", || {
        let pools = pools.clone();
        async move {
            let p = pools.get("broken").await.map_err(|e| e.to_string())?;
            match condition(&p, "Degraded") {
                Some((s, _, m)) if s == "True" && m.contains("h200-c") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let still = pools.get("h200-mig").await.unwrap();
    assert_eq!(condition(&still, "Ready").unwrap().0, "True");
    let unlabel = serde_json::json!({"metadata": {"labels": {"team": null}}});
    nodes
        .patch("h200-c", &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
        .unwrap();

    // A label added to the third node: it joins, and the pool waits for its agent.
    let label = serde_json::json!({"metadata": {"labels": {"gpuslice.io/pool": "h200-mig"}}});
    nodes
        .patch("h200-c", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    eventually("the new node joins", || {
        let (pools, gpu_nodes) = (pools.clone(), gpu_nodes.clone());
        async move {
            let n = gpu_nodes.get("h200-c").await.map_err(|e| e.to_string())?;
            let p = pools.get("h200-mig").await.map_err(|e| e.to_string())?;
            let progressing = condition(&p, "Progressing");
            (n.spec.gpus.len() == 1
                && progressing.as_ref().is_some_and(|(s, r, m)| {
                    s == "True" && r == "Applying" && m.contains("h200-c")
                }))
            .then_some(())
            .ok_or_else(|| format!("{:?} {progressing:?}", n.spec))
        }
    })
    .await;

    // The label removed again: the node leaves the pool and its GpuNode assigns nothing.
    let leave = serde_json::json!({"metadata": {"labels": {"gpuslice.io/pool": null}}});
    nodes
        .patch("h200-c", &PatchParams::default(), &Patch::Merge(&leave))
        .await
        .unwrap();
    eventually("h200-c leaves the pool", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let n = gpu_nodes.get("h200-c").await.map_err(|e| e.to_string())?;
            n.spec
                .gpus
                .is_empty()
                .then_some(())
                .ok_or_else(|| format!("{:?}", n.spec))
        }
    })
    .await;
}

#[tokio::test]
async fn the_operator_and_agents_converge_emulated_nodes() {
    let (operator_port, agent_port) = (free_port().unwrap(), free_port().unwrap());
    let Some((cluster, client)) = cluster_with_crds().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut processes = Vec::new();
    for name in ["gpu-a", "gpu-b"] {
        cluster
            .create_node(name, &[("gpuslice.io/pool", "h200-mig")], &[])
            .await
            .unwrap();
        let node_file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &node_file,
            format!("name: {name}\ngpus:\n- {{index: 0, model: NVIDIA H200}}\n- {{index: 1, model: NVIDIA H200}}\n"),
        )
        .unwrap();
        // The workload below is put on an instance directly, holding no claim: the watchdog
        // only reports it, so that what is tested is how a re-cut drains it.
        let mut agent = Command::new(env!("CARGO_BIN_EXE_gpuslice"));
        agent
            .args(["agent", "--kube", "--interval", "2s"])
            .args(["--stray-processes", "report", "--emulate"])
            .arg(&node_file);
        if name == "gpu-a" {
            agent.args(["--metrics-addr", &format!("127.0.0.1:{agent_port}")]);
        }
        processes.push(KillOnDrop(
            agent
                .arg("--state")
                .arg(dir.path().join(name))
                // Pools' dataset caches, for /var/lib/gpuslice/cache.
                .arg("--cache-root")
                .arg(std::path::Path::new(&dir.path().join(name)).join("caches"))
                .env("KUBECONFIG", cluster.agent_kubeconfig(name).await.unwrap())
                // The operator's clock: the agents switch at the boundary on their own.
                .env("GPUSLICE_CLOCK_START", "2026-12-02T20:59:00Z")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        ));
    }
    // 21:59 in Berlin on a Wednesday: the night window opens in 60 s, time for the day layout to
    // be applied and the workload to start even on a loaded machine.
    processes.push(
        start_operator(
            &cluster,
            &["--metrics-addr", &format!("127.0.0.1:{operator_port}")],
            Some("2026-12-02T20:59:00Z"),
        )
        .await,
    );
    let pool_text =
        std::fs::read_to_string(root().join("examples/gitops/pools/h200-mig.yaml")).unwrap();
    let checkpoint =
        std::fs::read_to_string(root().join("examples/gitops/policies/checkpoint-standard.yaml"))
            .unwrap();
    apply_yaml(&client, &checkpoint).await;
    apply_yaml(&client, &pool_text).await;

    let pools: Api<GpuPool> = Api::all(client.clone());
    eventually(
        "the pool is Ready once the agents applied the day layout",
        || {
            let pools = pools.clone();
            async move {
                let p = pools.get("h200-mig").await.map_err(|e| e.to_string())?;
                match condition(&p, "Ready") {
                    Some((s, _, _)) if s == "True" => Ok(()),
                    other => Err(format!(
                        "{other:?} / {:?} / {:?}",
                        condition(&p, "Progressing"),
                        condition(&p, "Degraded")
                    )),
                }
            }
        },
    )
    .await;

    // As kubectl shows them (the control plane's own, v1.36.3): each node with its two GPUs and
    // Ready; and `kubectl explain` gives the API's own words.
    eventually("kubectl shows both nodes with two GPUs, Ready", || {
        let nodes = cluster.kubectl(&["get", "gpunodes"]);
        async move {
            let header: Vec<&str> = nodes
                .lines()
                .next()
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            let row = |name: &str| -> Vec<String> {
                nodes
                    .lines()
                    .find(|l| l.starts_with(name))
                    .map(|l| l.split_whitespace().map(str::to_string).collect())
                    .unwrap_or_default()
            };
            let shown = |name: &str| {
                let row = row(name);
                row.get(1).map(String::as_str) == Some("2")
                    && row.get(4).map(String::as_str) == Some("True")
            };
            (header.get(..5) == Some(&["NAME", "GPUS", "DESIRED", "APPLIED", "READY"][..])
                && shown("gpu-a")
                && shown("gpu-b"))
            .then_some(())
            .ok_or(nodes.clone())
        }
    })
    .await;
    let explained = cluster.kubectl(&["explain", "gpupools.spec.requireNonRoot"]);
    assert!(explained.contains("may not run as root"), "{explained}");

    // A workload on one of gpu-a's instances: at the boundary that GPU cannot be re-sliced, the
    // pool says why, and the agent drains it as the pool's CheckpointPolicy says (`standard`:
    // SIGUSR1, then it waits for the checkpoint-done marker, `required: true`). The workload
    // checkpoints once the test has seen the pool blocked; the agent then stops it and re-slices.
    let state_a = dir.path().join("gpu-a").join("emulated-gpu-a.json");
    let slices = dir.path().join("gpu-a").join("slices");
    let (gi, slice) = eventually("gpu-a's GPU 0 has the day layout's four instances", || {
        let m = gpuslice_emulator::Store::open(&state_a)
            .unwrap()
            .snapshot()
            .unwrap();
        let instances = m.gpu(0).unwrap().instances.clone();
        let published: Vec<String> = std::fs::read_dir(&slices)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        async move {
            let [first, _, _, _] = &instances[..] else {
                return Err(format!("{} instances", instances.len()));
            };
            // The agent publishes the instance's slice directory once it has read it back.
            let prefix = format!("gpu0-mig{}-", first.placement.start);
            let slice = published
                .into_iter()
                .find(|name| name.starts_with(&prefix))
                .ok_or_else(|| format!("no slice directory {prefix}*"))?;
            Ok((first.id, slice))
        }
    })
    .await;
    let marker = slices.join(&slice).join("checkpoint-done");
    let signalled = dir.path().join("signalled");
    let go = dir.path().join("go");
    let mut workload = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "trap 'touch {signalled}; while [ ! -e {go} ]; do sleep 0.1; done; touch {marker}' USR1; while :; do sleep 0.1; done",
            signalled = signalled.display(),
            go = go.display(),
            marker = marker.display()
        ))
        .spawn()
        .unwrap();
    gpuslice_emulator::Store::open(&state_a)
        .unwrap()
        .update(|m| m.attach_real_process(0, workload.id(), 1 << 30, Some(gi)))
        .unwrap()
        .unwrap();
    eventually("the pool reports the busy instance", || {
        let pools = pools.clone();
        async move {
            let p = pools.get("h200-mig").await.map_err(|e| e.to_string())?;
            match condition(&p, "Progressing") {
                Some((s, r, m))
                    if s == "True"
                        && r == "Blocked"
                        && m.contains("gpu-a")
                        && m.contains("sent SIGUSR1 (standard)") =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    std::fs::write(&go, "").unwrap();
    let stopped = eventually("the agent signals, waits for the checkpoint, stops", || {
        let status = workload.try_wait().unwrap();
        let signalled = signalled.exists();
        async move {
            match status {
                Some(status) if signalled => Ok(status),
                other => Err(format!("signalled={signalled}, exit={other:?}")),
            }
        }
    })
    .await;
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(stopped.signal(), Some(9), "stopped after its checkpoint");

    // At the boundary the operator re-slices every node for the night: one whole-GPU instance each.
    let instances = |name: &str| -> Vec<usize> {
        let path = dir.path().join(name).join(format!("emulated-{name}.json"));
        let machine = gpuslice_emulator::Store::open(&path)
            .unwrap()
            .snapshot()
            .unwrap();
        machine.gpus.iter().map(|g| g.instances.len()).collect()
    };
    eventually("the night layout is applied on every GPU", || {
        let pools = pools.clone();
        let (a, b) = (instances("gpu-a"), instances("gpu-b"));
        async move {
            let p = pools.get("h200-mig").await.map_err(|e| e.to_string())?;
            let window = p.status.as_ref().and_then(|s| s.active_window.clone());
            let ready = condition(&p, "Ready").is_some_and(|(s, _, _)| s == "True");
            (a == [1, 1] && b == [1, 1] && window.as_deref() == Some("night") && ready)
                .then_some(())
                .ok_or_else(|| format!("{a:?} {b:?} {window:?} ready={ready}"))
        }
    })
    .await;
    // The pool's story is in its Events: the block, then the window change.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    let reasons: Vec<String> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("h200-mig"))
        .filter_map(|e| e.reason)
        .collect();
    assert!(
        reasons.iter().any(|r| r == "WindowChanged") && reasons.iter().any(|r| r == "Blocked"),
        "{reasons:?}"
    );

    // Both binaries report what they did, and are healthy.
    let (status_line, operator_metrics) = http_get(operator_port, "/metrics");
    assert!(status_line.contains("200"), "{status_line}");
    assert!(
        operator_metrics.contains("gpuslice_pool_slices{pool=\"h200-mig\"} 4"),
        "{operator_metrics}"
    );
    assert!(operator_metrics.contains("gpuslice_operator_reconciles_total"));
    let (_, agent_metrics) = http_get(agent_port, "/metrics");
    let operations = agent_metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpuslice_agent_operations_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{agent_metrics}"));
    assert!(
        operations >= 10.0,
        "day and night layouts on two GPUs: {operations}"
    );
    assert!(http_get(agent_port, "/healthz").0.contains("200"));
    assert!(http_get(operator_port, "/healthz").0.contains("200"));
    // The in-cluster agent serves the node's socket for the shims' compute arbitration; the
    // night layout is one MIG instance per GPU, which has no compute share to arbitrate.
    {
        use std::io::{BufRead as _, BufReader, Write as _};
        let mut socket = std::os::unix::net::UnixStream::connect(
            gpuslice_contract::StateDir::new(dir.path().join("gpu-a")).socket(),
        )
        .unwrap();
        socket
            .write_all(&gpuslice_contract::socket::line(
                &gpuslice_contract::socket::Request::Compute {
                    slice: "gpu0-mig0-7g.141gb".into(),
                },
            ))
            .unwrap();
        let mut answer = String::new();
        BufReader::new(socket).read_line(&mut answer).unwrap();
        assert!(answer.contains("has no compute share"), "{answer}");
    }

    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    let node = gpu_nodes.get("gpu-a").await.unwrap();
    let status = node.status.unwrap();
    assert_eq!(status.applied_generation, node.metadata.generation);
    let inventory = status.inventory.unwrap();
    assert!(inventory.gpus.iter().all(|g| {
        g.mig
            .as_ref()
            .is_some_and(|m| m.instances.iter().all(|i| i.uuid.is_some()))
    }));
    drop(processes);
}

#[tokio::test]
async fn a_standby_operator_takes_over_when_the_leader_dies() {
    let Some((cluster, client)) = cluster_with_crds().await else {
        return;
    };
    for name in ["n1", "n2"] {
        cluster.create_node(name, &[], &[]).await.unwrap();
        report_gpus(&client, name, "- {index: 0, model: NVIDIA H200}\n").await;
    }
    let kubeconfig = cluster.operator_kubeconfig().await.unwrap();
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_gpuslice"))
            .args(["operator", "--lease-duration", "2s"])
            .args(LEASE)
            .env("KUBECONFIG", &kubeconfig)
            // A Wednesday morning in Berlin: the pool's default layout is in force, whatever
            // the time the test runs (at night the `whole` preset would be).
            .env("GPUSLICE_CLOCK_START", "2026-12-02T09:00:00Z")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut operators = vec![KillOnDrop(spawn()), KillOnDrop(spawn())];
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), gpuslice_testcluster::CHART_NAMESPACE);
    let holder = eventually("one operator holds the lease", || {
        let leases = leases.clone();
        async move {
            let lease = leases
                .get("gpuslice-operator")
                .await
                .map_err(|e| e.to_string())?;
            lease
                .spec
                .and_then(|s| s.holder_identity)
                .ok_or_else(|| "no holder".to_string())
        }
    })
    .await;
    let leader = operators
        .iter()
        .position(|o| holder.ends_with(&format!("-{}", o.0.id())))
        .unwrap_or_else(|| panic!("{holder} is none of ours"));
    apply_yaml(
        &client,
        &std::fs::read_to_string(root().join("examples/gitops/pools/h200-mig.yaml"))
            .unwrap()
            .replace("  checkpointPolicy: standard\n", ""),
    )
    .await;
    let nodes: Api<Node> = Api::all(client.clone());
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    let join = |name: &'static str| {
        let nodes = nodes.clone();
        async move {
            let label =
                serde_json::json!({"metadata": {"labels": {"gpuslice.io/pool": "h200-mig"}}});
            nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(&label))
                .await
                .unwrap();
        }
    };
    let has_layout = |name: &'static str| {
        let gpu_nodes = gpu_nodes.clone();
        move || {
            let gpu_nodes = gpu_nodes.clone();
            async move {
                let n = gpu_nodes.get(name).await.map_err(|e| e.to_string())?;
                (!n.spec.gpus.is_empty())
                    .then_some(())
                    .ok_or_else(|| format!("{:?}", n.spec))
            }
        }
    };
    join("n1").await;
    eventually("the leader writes n1's layout", has_layout("n1")).await;

    // The leader dies; the standby takes the lease over and carries on.
    drop(operators.remove(leader));
    join("n2").await;
    eventually("the standby writes n2's layout", has_layout("n2")).await;
    let lease = leases.get("gpuslice-operator").await.unwrap().spec.unwrap();
    assert_ne!(lease.holder_identity.as_deref(), Some(holder.as_str()));
    assert!(lease.lease_transitions.unwrap_or(0) >= 1);

    // Every operator gone, a new one started: it takes over without rewriting what is right
    // (no new generation on the nodes) and carries on with what changed meanwhile.
    let generation = |n: GpuNode| n.metadata.generation;
    let before = generation(gpu_nodes.get("n1").await.unwrap());
    operators.clear();
    let pools: Api<GpuPool> = Api::all(client.clone());
    let edit = serde_json::json!({"spec": {"layout": {"mig": {"profiles": {"3g.71gb": 2, "2g.35gb": null, "1g.18gb": null}}}}});
    pools
        .patch("h200-mig", &PatchParams::default(), &Patch::Merge(&edit))
        .await
        .unwrap();
    let _restarted = KillOnDrop(spawn());
    eventually("the restarted operator applies the edit", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let n = gpu_nodes.get("n2").await.map_err(|e| e.to_string())?;
            let profiles = n
                .spec
                .gpus
                .first()
                .and_then(|g| g.assigned.layout.mig.as_ref())
                .map(|m| m.profiles.clone());
            (profiles
                .as_ref()
                .is_some_and(|p| p.get("3g.71gb") == Some(&2) && p.len() == 1))
            .then_some(())
            .ok_or_else(|| format!("{profiles:?}"))
        }
    })
    .await;
    let after = generation(gpu_nodes.get("n1").await.unwrap());
    assert_eq!(
        after,
        before.map(|g| g + 1),
        "exactly one new generation: the edit"
    );
}

/// Cluster mode holds claims like standalone mode: a software slice claimed through the
/// in-cluster agent's socket (with a policy the agent reads from the API) gets that policy's
/// compute limit and guarantee from the arbiter, and is busy, so the window change on its GPU
/// waits, with the pool saying which slice, until the claim ends.
#[tokio::test]
async fn a_claimed_software_slice_holds_back_a_window_change_in_the_cluster() {
    let Some((cluster, client)) = cluster_with_crds().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    cluster
        .create_node("gpu-s", &[("gpuslice.io/pool", "shared-a100")], &[])
        .await
        .unwrap();
    let node_file = dir.path().join("gpu-s.yaml");
    std::fs::write(
        &node_file,
        "name: gpu-s\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB}\n",
    )
    .unwrap();
    let state = dir.path().join("gpu-s");
    let metrics_port = free_port().unwrap();
    // 19:59 in Shanghai for both: the pool's night window (2 slices instead of 4) opens in 60 s.
    let spawn = |args: &[&str], kubeconfig: &Path| {
        KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_gpuslice"))
                .args(args)
                .env("KUBECONFIG", kubeconfig)
                .env("GPUSLICE_CLOCK_START", "2026-12-02T11:59:00Z")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        )
    };
    let _agent = spawn(
        &[
            "agent",
            "--kube",
            "--interval",
            "1s",
            "--emulate",
            node_file.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
            // Pools' dataset caches, for /var/lib/gpuslice/cache.
            "--cache-root",
            state.join("caches").to_str().unwrap(),
            "--metrics-addr",
            &format!("127.0.0.1:{metrics_port}"),
        ],
        &cluster.agent_kubeconfig("gpu-s").await.unwrap(),
    );
    let _operator = spawn(
        &["operator", LEASE[0], LEASE[1]],
        &cluster.operator_kubeconfig().await.unwrap(),
    );
    // No CheckpointPolicy: nothing is signalled, the change waits for the claim to end.
    let pool = std::fs::read_to_string(root().join("examples/gitops/pools/shared-a100.yaml"))
        .unwrap()
        .replace("  checkpointPolicy: standard\n", "");
    apply_yaml(&client, &pool).await;
    apply_yaml(
        &client,
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: small}\nspec:\n  pool: shared-a100\n  memory: 8Gi\n  compute: {limit: 20, guarantee: 10}\n",
    )
    .await;
    let pools: Api<GpuPool> = Api::all(client.clone());
    let ready = |window: Option<&'static str>| {
        let pools = pools.clone();
        async move {
            let p = pools.get("shared-a100").await.map_err(|e| e.to_string())?;
            let active = p.status.as_ref().and_then(|s| s.active_window.clone());
            match condition(&p, "Ready") {
                Some((s, _, _)) if s == "True" && active.as_deref() == window => Ok(()),
                other => Err(format!(
                    "{other:?} {active:?} {:?}",
                    condition(&p, "Progressing")
                )),
            }
        }
    };
    eventually("the day layout (4 slices) is applied", || {
        ready(Some("default"))
    })
    .await;
    let table = || std::fs::read_to_string(state.join("gpu-0.slices.json")).unwrap_or_default();
    eventually("the agent wrote the 4-slice table", || {
        let slices = table().matches("\"id\"").count();
        async move {
            (slices == 4)
                .then_some(())
                .ok_or(format!("{slices} slices"))
        }
    })
    .await;

    // A claim through the agent's socket, by a policy the agent read from the API.
    let mut claim = Command::new(env!("CARGO_BIN_EXE_gpuslice"))
        .args([
            "run",
            "--state",
            state.to_str().unwrap(),
            "--policy",
            "small",
        ])
        .args(["--", "sh", "-c", "echo \"$GPUSLICE_SLICE\"; exec sleep 600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let slice = {
        use std::io::BufRead as _;
        let mut line = String::new();
        std::io::BufReader::new(claim.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        line.trim().to_string()
    };
    assert!(slice.starts_with("gpu0-s"), "{slice:?}");
    let claim = KillOnDrop(claim);
    let share = |metrics: &str, name: &str, slice: &str| {
        let key = format!("gpuslice_agent_slice_compute_{name}_percent{{slice=\"{slice}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .map(|v| v.trim().to_string())
    };
    eventually("the arbiter takes the policy's limit and guarantee", || {
        let (_, metrics) = http_get(metrics_port, "/metrics");
        let got = (
            share(&metrics, "limit", &slice),
            share(&metrics, "guarantee", &slice),
        );
        let unclaimed = if slice == "gpu0-s1" {
            "gpu0-s0"
        } else {
            "gpu0-s1"
        };
        let other = share(&metrics, "limit", unclaimed);
        async move {
            match (&got, &other) {
                ((Some(limit), Some(guarantee)), Some(other))
                    if limit == "20" && guarantee == "10" && other == "25" =>
                {
                    Ok(())
                }
                _ => Err(format!("{got:?}, unclaimed {other:?}")),
            }
        }
    })
    .await;
    eventually("the window change waits, naming the claimed slice", || {
        let pools = pools.clone();
        let slice = slice.clone();
        async move {
            let p = pools.get("shared-a100").await.map_err(|e| e.to_string())?;
            match condition(&p, "Progressing") {
                Some((s, r, m)) if s == "True" && r == "Blocked" && m.contains(&slice) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    assert_eq!(table().matches("\"id\"").count(), 4, "nothing was re-cut");

    // The claim ends: the night layout follows.
    drop(claim);
    eventually("the night layout (2 slices) is applied", || {
        ready(Some("night"))
    })
    .await;
    assert_eq!(table().matches("\"id\"").count(), 2);
}

/// Evictions: an agent evicts no pod itself (the chart's role has no `pods/eviction`); it asks
/// in its GpuNode's status and the operator evicts the pod, but only one that runs on the asking
/// agent's node. A compromised agent on node A that asks for node B's pod gets nothing.
#[tokio::test]
async fn an_agent_has_only_its_own_nodes_pods_evicted() {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
    let Some((cluster, client)) = cluster_with_crds().await else {
        return;
    };
    for node in ["gpu-a", "gpu-b"] {
        cluster.create_node(node, &[], &[]).await.unwrap();
    }
    // No controller-manager here: the namespace's default ServiceAccount by hand.
    let account: k8s_openapi::api::core::v1::ServiceAccount = serde_json::from_value(
        serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}),
    )
    .unwrap();
    Api::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut uids = std::collections::BTreeMap::new();
    for (name, node) in [("trainer-a", "gpu-a"), ("trainer-b", "gpu-b")] {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "example.com/train:1"}]},
        }))
        .unwrap();
        let created = pods.create(&PostParams::default(), &pod).await.unwrap();
        uids.insert(name, created.metadata.uid.unwrap());
    }
    let agent_a = cluster
        .pod_service_account_client(
            gpuslice_testcluster::CHART_NAMESPACE,
            &format!("{}-agent", gpuslice_testcluster::CHART_RELEASE),
            "gpu-a",
        )
        .await
        .unwrap();

    // The agent's own identity may evict nothing, not even its own node's pod.
    let as_agent: Api<Pod> = Api::namespaced(agent_a.clone(), "default");
    for name in ["trainer-a", "trainer-b"] {
        match as_agent.evict(name, &EvictParams::default()).await {
            Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{name}: {e:?}"),
            other => panic!("the agent evicted {name}: {other:?}"),
        }
    }

    let _operator = start_operator(&cluster, &[], None).await;
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    eventually("the agent's GpuNode exists", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            if gpu_nodes
                .get_opt("gpu-a")
                .await
                .map_err(|e| e.to_string())?
                .is_none()
            {
                let node: GpuNode = serde_json::from_value(serde_json::json!({
                    "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
                    "metadata": {"name": "gpu-a"}, "spec": {},
                }))
                .unwrap();
                gpu_nodes
                    .create(&PostParams::default(), &node)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        }
    })
    .await;
    // The agent of gpu-a asks for both pods, as a compromised one would.
    let ask = |pod: &str| {
        serde_json::json!({"pod": format!("default/{pod}"), "uid": uids[pod], "cause": "preemption",
            "checkpoint": "taken", "message": "preempted for a pod of higher priority"})
    };
    Api::<GpuNode>::all(agent_a.clone())
        .patch_status(
            "gpu-a",
            &PatchParams::apply("gpuslice-agent"),
            &Patch::Apply(serde_json::json!({
                "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
                "metadata": {"name": "gpu-a"},
                "status": {"evictions": [ask("trainer-a"), ask("trainer-b")]},
            })),
        )
        .await
        .unwrap();
    let going = |pod: Option<Pod>| pod.is_none_or(|p| p.metadata.deletion_timestamp.is_some());
    eventually("the operator evicts gpu-a's pod", || {
        let pods = pods.clone();
        async move {
            let pod = pods.get_opt("trainer-a").await.map_err(|e| e.to_string())?;
            going(pod)
                .then_some(())
                .ok_or("trainer-a still runs".to_string())
        }
    })
    .await;
    // Several of the operator's rounds (every 0.5 s, again after 5 s) later, gpu-b's pod runs on.
    tokio::time::sleep(std::time::Duration::from_secs(7)).await;
    let other = pods.get_opt("trainer-b").await.unwrap();
    assert!(
        !going(other),
        "trainer-b on gpu-b was evicted for gpu-a's agent"
    );
}
