//! The admission queue, against a real control plane (API server with the chart's admission
//! policies, kube-scheduler, controller-manager, etcd, a kwok node), the operator, and the
//! node's agent on an emulated A100 (four 20 GiB slices): pods that name a policy by label wait
//! at the scheduling gate `gpuslice.io/queue`; the operator lets through as many as there are
//! free slices, in the pool's order (priority first), each onto the node its placement engine
//! picks, and tells the others their place and why they wait.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpuslice_testcluster::{Components, ControlPlane, KillOnDrop, eventually};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const CLOCK: &str = "2026-12-02T10:00:00Z";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn helm() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("GPUSLICE_HELM") {
        return Some(PathBuf::from(path));
    }
    let out = Command::new("bash")
        .arg(root().join("tests/helm/build.sh"))
        .arg("--find")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

async fn apply(client: &Client, docs: &[serde_json::Value]) {
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .unwrap();
    for doc in docs {
        gpuslice_testcluster::apply_document(client, &discovery, doc, false)
            .await
            .unwrap_or_else(|| panic!("no such kind: {doc}"))
            .unwrap_or_else(|e| panic!("{}: {e}", doc["metadata"]["name"]));
    }
}

fn documents(text: &str) -> Vec<serde_json::Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &serde_json::Value| !v.is_null())
        .collect()
}

fn pod(name: &str, namespace: &str, policy: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"gpuslice.io/policy": policy, "app": "queue-test"}},
        "spec": {
            "containers": [{"name": "main", "image": "example.com/worker:1",
                            "resources": {"requests": {"cpu": "1"}}}],
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }
    }))
    .unwrap()
}

/// A pod that names no policy, on node a100-a, asking for one CPU.
fn plain_pod(name: &str, priority_class: Option<&str>) -> Pod {
    let mut pod = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "plain"}},
        "spec": {
            "containers": [{"name": "main", "image": "example.com/web:1",
                            "resources": {"requests": {"cpu": "1"}}}],
            "nodeSelector": {"kubernetes.io/hostname": "a100-a"},
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]
        }
    });
    if let Some(class) = priority_class {
        pod["spec"]["priorityClassName"] = class.into();
    }
    serde_json::from_value(pod).unwrap()
}

/// Each test pod: its node (when bound), whether it is still gated, and its queue condition.
async fn states(client: &Client) -> Vec<(String, Option<String>, bool, Option<(String, String)>)> {
    let mut out = Vec::new();
    for namespace in ["default", "nlp"] {
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        for p in pods
            .list(&ListParams::default().labels("app=queue-test"))
            .await
            .unwrap()
        {
            let spec = p.spec.clone().unwrap_or_default();
            let gated = spec
                .scheduling_gates
                .iter()
                .flatten()
                .any(|g| g.name == "gpuslice.io/queue");
            let queued = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "gpuslice.io/Queued"))
                .map(|c| {
                    (
                        c.reason.clone().unwrap_or_default(),
                        c.message.clone().unwrap_or_default(),
                    )
                });
            out.push((
                p.metadata.name.unwrap_or_default(),
                spec.node_name,
                gated,
                queued,
            ));
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn pods_wait_at_the_gate_and_go_in_priority_order_as_slices_free_up() {
    let Some(helm) = helm() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "no helm: run tests/helm/build.sh"
        );
        eprintln!("SKIPPED: no helm binary (bash tests/helm/build.sh builds one)");
        return;
    };
    let Some(cluster) = ControlPlane::start(Components::all()).await.unwrap() else {
        return;
    };
    let client = cluster.client().await.unwrap();
    gpuslice_testcluster::install_crds(&client, &root().join("crds"))
        .await
        .unwrap();
    // The chart's mutating admission policies: label → the policy's extended resource, and
    // label → the queue's gate.
    let rendered = Command::new(&helm)
        .args(["template", "gs", "--namespace", "gpuslice-system"])
        .arg(root().join("charts/gpuslice"))
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let mutating: Vec<serde_json::Value> = documents(&String::from_utf8(rendered.stdout).unwrap())
        .into_iter()
        .filter(|d| {
            d["kind"]
                .as_str()
                .is_some_and(|k| k.starts_with("MutatingAdmissionPolicy") || k == "PriorityClass")
        })
        .collect();
    assert_eq!(
        mutating.len(),
        7,
        "three policies, their bindings and the queued pods' PriorityClass"
    );
    apply(&client, &mutating).await;

    cluster
        .create_node(
            "a100-a",
            &[("gpuslice.io/pool", "shared-a100")],
            &[("cpu", "5")],
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("a100-a.yaml");
    std::fs::write(
        &node_file,
        "name: a100-a\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB}\n",
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_gpuslice");
    let _agent = KillOnDrop(
        Command::new(bin)
            .args([
                "agent",
                "--kube",
                "--apply",
                "--interval",
                "2s",
                "--emulate",
            ])
            .arg(&node_file)
            .arg("--state")
            .arg(dir.path().join("state"))
            .arg("--kubelet-dir")
            .arg(dir.path().join("kubelet"))
            .arg("--cdi-dir")
            .arg(dir.path().join("cdi"))
            .env("KUBECONFIG", cluster.kubeconfig_path())
            .env("GPUSLICE_CLOCK_START", CLOCK)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let _operator = KillOnDrop(
        Command::new(bin)
            .arg("operator")
            .env("KUBECONFIG", cluster.kubeconfig_path())
            .env("GPUSLICE_CLOCK_START", CLOCK)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let nlp = serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "nlp", "labels": {"team": "nlp"}}});
    let mut docs = vec![nlp];
    for file in [
        "examples/gitops/policies/checkpoint-standard.yaml",
        "examples/gitops/pools/shared-a100.yaml",
        "examples/gitops/policies/notebook.yaml",
        "examples/gitops/policies/bert-finetune.yaml",
    ] {
        docs.extend(documents(
            &std::fs::read_to_string(root().join(file)).unwrap(),
        ));
    }
    apply(&client, &docs).await;
    eventually("the policies' DeviceClasses exist", || {
        let classes: Api<k8s_openapi::api::resource::v1::DeviceClass> = Api::all(client.clone());
        async move {
            let n = classes
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            (n == 2).then_some(()).ok_or_else(|| format!("{n} classes"))
        }
    })
    .await;

    // A pod that is not ours (priority 0) takes the node's fifth CPU.
    let default: Api<Pod> = Api::namespaced(client.clone(), "default");
    default
        .create(&PostParams::default(), &plain_pod("bystander", None))
        .await
        .unwrap();
    eventually("the bystander is bound", || {
        let default = default.clone();
        async move {
            let p = default.get("bystander").await.map_err(|e| e.to_string())?;
            p.spec
                .and_then(|s| s.node_name)
                .map(|_| ())
                .ok_or_else(|| "not bound".to_string())
        }
    })
    .await;

    // Six notebooks (priority low) for four slices. The API server loads new admission policies
    // a moment after they are created: a pod stored without the gate is sent again.
    for i in 0..6 {
        let name = format!("notebook-{i}");
        eventually("a labelled pod is stored gated", || {
            let (default, name) = (default.clone(), name.clone());
            async move {
                let stored = default
                    .create(&PostParams::default(), &pod(&name, "default", "notebook"))
                    .await
                    .map_err(|e| e.to_string())?;
                let gated = stored
                    .spec
                    .and_then(|s| s.scheduling_gates)
                    .is_some_and(|g| g.iter().any(|g| g.name == "gpuslice.io/queue"));
                if gated {
                    return Ok(());
                }
                default
                    .delete(&name, &DeleteParams::default().grace_period(0))
                    .await
                    .map_err(|e| e.to_string())?;
                Err("stored without the gate".to_string())
            }
        })
        .await;
        // Arrival order is creation time, in seconds.
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    }
    // Four go through, onto the node, bound by kube-scheduler; the last two wait, told their
    // place.
    let settled = eventually("four notebooks run, two wait in order", || {
        let client = client.clone();
        async move {
            let s = states(&client).await;
            let bound: Vec<&String> = s
                .iter()
                .filter(|p| p.1.as_deref() == Some("a100-a"))
                .map(|p| &p.0)
                .collect();
            let waiting: Vec<(&String, &Option<(String, String)>)> =
                s.iter().filter(|p| p.2).map(|p| (&p.0, &p.3)).collect();
            let told = waiting
                .iter()
                .all(|(_, q)| q.as_ref().is_some_and(|(r, _)| r == "NoSliceFits"));
            (bound.len() == 4 && waiting.len() == 2 && told)
                .then(|| s.clone())
                .ok_or_else(|| format!("{s:?}"))
        }
    })
    .await;
    let waiting: Vec<(String, String)> = settled
        .iter()
        .filter(|p| p.2)
        .map(|p| (p.0.clone(), p.3.clone().unwrap().1))
        .collect();
    assert_eq!(
        waiting,
        [
            (
                "notebook-4".to_string(),
                "1st of 2 waiting in the queue of pool shared-a100: no free slice of pool shared-a100 fits policy notebook".to_string()
            ),
            (
                "notebook-5".to_string(),
                "2nd of 2 waiting in the queue of pool shared-a100: no free slice of pool shared-a100 fits policy notebook".to_string()
            ),
        ]
    );
    // The policy counts them: `kubectl get gpuslicepolicies` shows 4 allocated, 2 waiting.
    let policies: Api<gpuslice_api::GpuSlicePolicy> = Api::all(client.clone());
    eventually(
        "the notebook policy counts 4 allocated and 2 waiting",
        || {
            let policies = policies.clone();
            async move {
                let status = policies
                    .get("notebook")
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .unwrap_or_default();
                (status.allocated == 4 && status.waiting == 2)
                    .then_some(())
                    .ok_or_else(|| format!("{status:?}"))
            }
        },
    )
    .await;
    // An admitted pod was sent to its node by the queue, not left to the scheduler's choice.
    let admitted = default.get("notebook-0").await.unwrap();
    let terms = admitted
        .spec
        .unwrap()
        .affinity
        .unwrap()
        .node_affinity
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .unwrap()
        .node_selector_terms;
    assert_eq!(
        terms[0].match_fields.as_ref().unwrap()[0].values.as_deref(),
        Some(&["a100-a".to_string()][..])
    );

    // A fine-tuning job of normal priority arrives last and goes to the head of the line.
    let nlp: Api<Pod> = Api::namespaced(client.clone(), "nlp");
    nlp.create(
        &PostParams::default(),
        &pod("bert-0", "nlp", "bert-finetune"),
    )
    .await
    .unwrap();
    eventually("the fine-tuning job is first in line", || {
        let client = client.clone();
        async move {
            let s = states(&client).await;
            let bert = s.iter().find(|p| p.0 == "bert-0").and_then(|p| p.3.clone());
            bert.as_ref()
                .is_some_and(|(_, m)| m.starts_with("1st of 3 waiting"))
                .then_some(())
                .ok_or_else(|| format!("{s:?}"))
        }
    })
    .await;
    // It may preempt a notebook (the pool allows it): the queue asks the node's agent for the
    // slice of the one that loses the least work (none checkpointed: the newest). With no
    // kubelet here nothing ends it, so the job says it waits for that.
    let claim_of = |name: &'static str| {
        let default = default.clone();
        async move {
            let claim = default
                .get(name)
                .await
                .unwrap()
                .status
                .and_then(|s| s.extended_resource_claim_status)
                .map(|s| s.resource_claim_name)
                .unwrap();
            format!("default/{claim}")
        }
    };
    let newest = claim_of("notebook-3").await;
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    let preemptions = || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            gpu_nodes
                .get("a100-a")
                .await
                .map(|n| n.spec.preemptions)
                .map_err(|e| e.to_string())
        }
    };
    let taken = eventually("the queue takes back the newest notebook's slice", || {
        let client = client.clone();
        async move {
            let s = states(&client).await;
            let bert = s.iter().find(|p| p.0 == "bert-0").and_then(|p| p.3.clone());
            let p = preemptions().await?;
            (bert.as_ref().is_some_and(|(r, _)| r == "Preempting") && p.len() == 1)
                .then(|| p[0].clone())
                .ok_or_else(|| format!("{s:?} {p:?}"))
        }
    })
    .await;
    assert_eq!(
        (taken.resource_claim.as_str(), taken.for_pod.as_str()),
        (newest.as_str(), "nlp/bert-0")
    );
    // A slice frees up: it goes to the fine-tuning job, not to the notebooks that came first.
    default
        .delete("notebook-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    eventually("the fine-tuning job runs; the notebooks still wait", || {
        let client = client.clone();
        async move {
            let s = states(&client).await;
            let bert = s
                .iter()
                .find(|p| p.0 == "bert-0")
                .map(|p| (p.1.clone(), p.2));
            let still: Vec<&String> = s.iter().filter(|p| p.2).map(|p| &p.0).collect();
            (bert == Some((Some("a100-a".to_string()), false))
                && still == ["notebook-4", "notebook-5"])
            .then_some(())
            .ok_or_else(|| format!("{s:?}"))
        }
    })
    .await;

    // The job has its slice: the preemption is withdrawn.
    eventually("no preemption is left", || async move {
        let p = preemptions().await?;
        p.is_empty().then_some(()).ok_or_else(|| format!("{p:?}"))
    })
    .await;

    // kube-scheduler's own preemption takes none of the queue's pods: they carry the chart's
    // PriorityClass (the highest a non-system class may have) and preempt nobody themselves.
    let bert = nlp.get("bert-0").await.unwrap().spec.unwrap();
    assert_eq!(
        (
            bert.priority_class_name.as_deref(),
            bert.priority,
            bert.preemption_policy.as_deref()
        ),
        (Some("gs-queued"), Some(1_000_000_000), Some("Never"))
    );
    let classes: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(client.clone());
    let mut urgent: k8s_openapi::api::scheduling::v1::PriorityClass =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": "urgent-web"}, "value": 1_000_000
        }))
        .unwrap();
    urgent.preemption_policy = Some("PreemptLowerPriority".into());
    classes
        .create(&PostParams::default(), &urgent)
        .await
        .unwrap();
    // The node's five CPUs are taken (four by the queue's pods, one by the bystander). An urgent
    // pod preempts the bystander, the only pod of lower priority: preemption works here.
    default
        .create(
            &PostParams::default(),
            &plain_pod("urgent-0", Some("urgent-web")),
        )
        .await
        .unwrap();
    eventually("the urgent pod preempts the bystander", || {
        let default = default.clone();
        async move {
            let urgent = default.get("urgent-0").await.map_err(|e| e.to_string())?;
            let bystander = default
                .get_opt("bystander")
                .await
                .map_err(|e| e.to_string())?;
            let urgent_placed = urgent.spec.and_then(|s| s.node_name).is_some()
                || urgent.status.and_then(|s| s.nominated_node_name).is_some();
            (urgent_placed && bystander.is_none_or(|b| b.metadata.deletion_timestamp.is_some()))
                .then_some(())
                .ok_or_else(|| "bystander still there".to_string())
        }
    })
    .await;
    // A second urgent pod finds no victim: kube-scheduler says so, and the queue's pods stay.
    default
        .create(
            &PostParams::default(),
            &plain_pod("urgent-1", Some("urgent-web")),
        )
        .await
        .unwrap();
    let why = eventually("the second urgent pod is unschedulable", || {
        let default = default.clone();
        async move {
            let p = default.get("urgent-1").await.map_err(|e| e.to_string())?;
            p.status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| c.type_ == "PodScheduled" && c.reason.as_deref() == Some("Unschedulable"))
                .and_then(|c| c.message)
                .ok_or_else(|| "not tried yet".to_string())
        }
    })
    .await;
    assert!(why.contains("Insufficient cpu"), "{why}");
    let s = states(&client).await;
    let bound: Vec<&String> = s
        .iter()
        .filter(|p| p.1.as_deref() == Some("a100-a"))
        .map(|p| &p.0)
        .collect();
    assert_eq!(
        bound,
        ["bert-0", "notebook-1", "notebook-2", "notebook-3"],
        "{s:?}"
    );
    for name in ["notebook-1", "notebook-2", "notebook-3"] {
        let p = default.get(name).await.unwrap();
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{name} is being deleted"
        );
    }
}
