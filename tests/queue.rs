//! The admission queue, against a real control plane (API server with the chart's admission
//! policies, kube-scheduler, controller-manager, etcd, a kwok node), the operator, and the
//! node's agent on an emulated A100 (four 20 GiB slices): pods that name a policy by label wait
//! at the scheduling gate `gpuslice.io/queue`; the operator lets through as many as there are
//! free slices, in the pool's order (priority first), each onto the node its placement engine
//! picks, and tells the others their place and why they wait.

use std::process::Stdio;

use gpuslice_testcluster::repo_root as root;
use gpuslice_testcluster::{Components, ControlPlane, KillOnDrop, eventually};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const CLOCK: &str = "2026-12-02T10:00:00Z";

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

/// The control plane with the chart's mutating admission policies (and the queued pods'
/// PriorityClass), one kwok node with `cpu` CPUs and emulated A100s (`gpus`) labelled for
/// `pool`, its agent, and the operator, on a clock started at `clock`.
struct Harness {
    agent: KillOnDrop,
    /// The agents of nodes added after the first.
    _more_agents: Vec<KillOnDrop>,
    operator: KillOnDrop,
    operator_args: Vec<String>,
    clock: String,
    client: Client,
    cluster: ControlPlane,
    _dir: tempfile::TempDir,
}

/// The operator, as the chart's operator identity.
async fn spawn_operator(cluster: &ControlPlane, clock: &str, args: &[String]) -> KillOnDrop {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    gpuslice_testcluster::spawn_operator(
        env!("CARGO_BIN_EXE_gpuslice"),
        &cluster.operator_kubeconfig().await.unwrap(),
        Some(clock),
        &args,
    )
}

/// A kwok node labelled for `pool` with `cpu` CPUs, and its agent on emulated `gpus` (models),
/// as the chart's agent identity; its state under `dir/node`.
async fn spawn_node_agent(
    cluster: &ControlPlane,
    dir: &std::path::Path,
    node: &str,
    pool: &str,
    cpu: &str,
    gpus: &[&str],
    clock: &str,
) -> KillOnDrop {
    cluster
        .create_node(node, &[("gpuslice.io/pool", pool)], &[("cpu", cpu)])
        .await
        .unwrap();
    let agent_kubeconfig = cluster.agent_kubeconfig(node).await.unwrap();
    let dir = dir.join(node);
    std::fs::create_dir_all(&dir).unwrap();
    let node_file = dir.join("node.yaml");
    let gpu_lines: String = gpus
        .iter()
        .enumerate()
        .map(|(i, model)| format!("- {{index: {i}, model: {model}}}\n"))
        .collect();
    std::fs::write(&node_file, format!("name: {node}\ngpus:\n{gpu_lines}")).unwrap();
    KillOnDrop(
        gpuslice_testcluster::agent_command(
            env!("CARGO_BIN_EXE_gpuslice"),
            "2s",
            &node_file,
            &dir.join("state"),
            &dir.join("kubelet"),
            &dir.join("cdi"),
        )
        .env("KUBECONFIG", &agent_kubeconfig)
        .env("GPUSLICE_CLOCK_START", clock)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap(),
    )
}

impl Harness {
    async fn start(clock: &str, node: &str, pool: &str, cpu: &str, gpus: u32) -> Option<Harness> {
        Self::start_with(clock, node, pool, cpu, gpus, &[]).await
    }

    /// [`start`](Self::start), with more arguments for the operator.
    async fn start_with(
        clock: &str,
        node: &str,
        pool: &str,
        cpu: &str,
        gpus: u32,
        operator_args: &[&str],
    ) -> Option<Harness> {
        let operator_args: Vec<String> = operator_args.iter().map(|a| a.to_string()).collect();
        let helm = gpuslice_testcluster::built_tool("GPUSLICE_HELM", "helm", "")?;
        let cluster = ControlPlane::start(Components::all()).await.unwrap()?;
        let client = cluster.client_with_crds().await;
        // The chart's mutating admission policies: label → the policy's extended resource,
        // label → the queue's gate, the queued pods' priority, claims naming our classes → a label.
        let mutating: Vec<serde_json::Value> =
            gpuslice_testcluster::render_chart(&helm, "gpuslice-system", &[])
                .into_iter()
                .filter(|d| {
                    d["kind"].as_str().is_some_and(|k| {
                        k.starts_with("MutatingAdmissionPolicy") || k == "PriorityClass"
                    })
                })
                .collect();
        assert_eq!(
            mutating.len(),
            15,
            "seven policies, their bindings and the queued pods' PriorityClass"
        );
        gpuslice_testcluster::apply_all(&client, &mutating).await;
        cluster.install_chart_identities().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let gpus = vec!["NVIDIA A100-SXM4-80GB"; gpus as usize];
        let agent = spawn_node_agent(&cluster, dir.path(), node, pool, cpu, &gpus, clock).await;
        let operator = spawn_operator(&cluster, clock, &operator_args).await;
        Some(Harness {
            agent,
            _more_agents: Vec::new(),
            operator,
            operator_args,
            clock: clock.to_string(),
            client,
            cluster,
            _dir: dir,
        })
    }

    /// Another node of `pool` with these GPUs, and its agent.
    async fn add_node(&mut self, node: &str, pool: &str, gpus: &[&str]) {
        let agent = spawn_node_agent(
            &self.cluster,
            self._dir.path(),
            node,
            pool,
            "64",
            gpus,
            &self.clock,
        )
        .await;
        self._more_agents.push(agent);
    }

    /// Stops the operator and starts a new one.
    async fn restart_operator(&mut self) {
        self.operator = spawn_operator(&self.cluster, &self.clock, &self.operator_args).await;
    }

    /// Applies `docs`, then waits until the operator has written `classes` DeviceClasses.
    async fn apply_and_wait(&self, docs: &[serde_json::Value], classes: usize) {
        gpuslice_testcluster::apply_all(&self.client, docs).await;
        gpuslice_testcluster::wait_for_device_classes(&self.client, classes).await;
    }

    /// The example pool shared-a100 with its policies notebook and bert-finetune (and the
    /// namespace nlp that may use the latter).
    async fn apply_notebook_and_finetune(&self) {
        let nlp = serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "nlp", "labels": {"team": "nlp"}}});
        let mut docs = vec![nlp];
        for file in [
            "examples/gitops/policies/checkpoint-standard.yaml",
            "examples/gitops/pools/shared-a100.yaml",
            "examples/gitops/policies/notebook.yaml",
            "examples/gitops/policies/bert-finetune.yaml",
        ] {
            docs.extend(gpuslice_testcluster::documents(
                &std::fs::read_to_string(root().join(file)).unwrap(),
            ));
        }
        self.apply_and_wait(&docs, 2).await;
    }

    /// Creates a labelled pod, stored gated (see `gpuslice_testcluster::create_gated`).
    async fn create_gated(&self, pod: &Pod) {
        gpuslice_testcluster::create_gated(&self.client, pod).await;
    }
}

#[tokio::test]
async fn pods_wait_at_the_gate_and_go_in_priority_order_as_slices_free_up() {
    let Some(harness) = Harness::start(CLOCK, "a100-a", "shared-a100", "5", 1).await else {
        return;
    };
    let client = harness.client.clone();
    harness.apply_notebook_and_finetune().await;

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
        harness
            .create_gated(&pod(&format!("notebook-{i}"), "default", "notebook"))
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

    // The job that comes next may preempt a notebook (the pool allows it): the queue asks the
    // node's agent for the slice of the one that loses the least work (none checkpointed: the
    // newest). (The scheduler writes a pod's claim into its status as it binds it.)
    let claim_of = |name: &'static str| {
        let default = default.clone();
        async move {
            eventually(&format!("{name} shows its claim"), || {
                let default = default.clone();
                async move {
                    let pod = default.get(name).await.map_err(|e| e.to_string())?;
                    pod.status
                        .and_then(|s| s.extended_resource_claim_status)
                        .map(|s| format!("default/{}", s.resource_claim_name))
                        .ok_or_else(|| format!("{name} has no claim in its status yet"))
                }
            })
            .await
        }
    };
    // Read before the job arrives: its preemption may take the notebook away at once.
    let newest = claim_of("notebook-3").await;

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
    // No kubelet here: the notebook's claim was never prepared, so nothing runs on its slice and
    // nothing could checkpoint. The agent asks for it to be evicted at once, the operator evicts
    // it, and the job gets its slice, ahead of the notebooks that came first.
    eventually(
        "notebook-3 is evicted; the fine-tuning job runs; two notebooks still wait",
        || {
            let (client, default) = (client.clone(), default.clone());
            async move {
                let s = states(&client).await;
                let bert = s
                    .iter()
                    .find(|p| p.0 == "bert-0")
                    .map(|p| (p.1.clone(), p.2));
                let still: Vec<&String> = s.iter().filter(|p| p.2).map(|p| &p.0).collect();
                let victim = default
                    .get_opt("notebook-3")
                    .await
                    .map_err(|e| e.to_string())?;
                (bert == Some((Some("a100-a".to_string()), false))
                    && still == ["notebook-4", "notebook-5"]
                    && victim.is_none_or(|v| v.metadata.deletion_timestamp.is_some()))
                .then_some(())
                .ok_or_else(|| format!("{s:?}"))
            }
        },
    )
    .await;
    let note = eventually("notebook-3's Preempted event", || {
        let client = client.clone();
        async move {
            gpuslice_testcluster::event_note(&client, "Preempted", "notebook-3")
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "no event yet".to_string())
        }
    })
    .await;
    assert!(note.contains("never prepared"), "{note}");

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
    // pod preempts the bystander, the only pod of lower priority: preemption works here. (The
    // API server's Priority admission finds a new PriorityClass a moment after it is created.)
    eventually("the urgent pod is admitted", || {
        let default = default.clone();
        async move {
            default
                .create(
                    &PostParams::default(),
                    &plain_pod("urgent-0", Some("urgent-web")),
                )
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await;
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
        ["bert-0", "notebook-0", "notebook-1", "notebook-2"],
        "{s:?}"
    );
    for name in ["notebook-0", "notebook-1", "notebook-2"] {
        let p = default.get(name).await.unwrap();
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{name} is being deleted"
        );
    }
}

/// Bound pods (not being deleted) in `namespaces`: (namespace, name).
async fn bound(client: &Client, namespaces: &[&str]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for namespace in namespaces {
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        for p in pods.list(&ListParams::default()).await.unwrap() {
            let on_node = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
            if on_node && p.metadata.deletion_timestamp.is_none() {
                out.push((namespace.to_string(), p.metadata.name.unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn namespaces_share_a_pool_by_their_weights() {
    let Some(h) = Harness::start(CLOCK, "a100-f", "teams", "64", 2).await else {
        return;
    };
    let client = h.client.clone();
    let docs = gpuslice_testcluster::documents(
        "
apiVersion: v1
kind: Namespace
metadata: {name: alpha}
---
apiVersion: v1
kind: Namespace
metadata: {name: beta}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: teams}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: teams}}
  layout: {software: {slices: 3, memory: 26Gi, compute: 33}}
  scheduling: {policy: Fair, weights: {alpha: 2, beta: 1}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: team-job}
spec: {pool: teams, memory: 8Gi}
",
    );
    h.apply_and_wait(&docs, 1).await;
    // Both teams submit more than the six slices hold.
    for i in 0..16 {
        for namespace in ["alpha", "beta"] {
            h.create_gated(&pod(&format!("{namespace}-{i:02}"), namespace, "team-job"))
                .await;
        }
    }
    // Jobs end one at a time, alternately of each team; each freed slice goes to the team
    // furthest below its weighted share. What each holds is sampled whenever all six run, from
    // the third round on: the first six go in as they arrive (often three of each, while no one
    // waits yet), and two freed slices are what it takes to correct that.
    let mut held = (0u32, 0u32);
    for round in 0..12 {
        let running = eventually("six jobs hold the six slices", || {
            let client = client.clone();
            async move {
                let b = bound(&client, &["alpha", "beta"]).await;
                (b.len() == 6)
                    .then(|| b.clone())
                    .ok_or_else(|| format!("{b:?}"))
            }
        })
        .await;
        let alpha = running.iter().filter(|(ns, _)| ns == "alpha").count() as u32;
        if round >= 2 {
            held.0 += alpha;
            held.1 += 6 - alpha;
        }
        let ending = if round % 2 == 0 { "alpha" } else { "beta" };
        let (namespace, name) = running
            .iter()
            .find(|(ns, _)| ns == ending)
            .unwrap_or(&running[0])
            .clone();
        Api::<Pod>::namespaced(client.clone(), &namespace)
            .delete(&name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    // A waiting pod is told where its namespace stands.
    let waiting_pod = Api::<Pod>::namespaced(client.clone(), "beta")
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
        .and_then(|p| p.metadata.name)
        .expect("beta has pods still waiting");
    let (_, told) = queued(&client, "beta", &waiting_pod).await.unwrap();
    assert!(
        told.contains("by fair share, namespace beta holds") && told.contains("at weight 1"),
        "{told}"
    );
    // Slice-time used, alpha to beta: 2:1 within 10 %.
    let ratio = f64::from(held.0) / f64::from(held.1.max(1));
    assert!((1.8..=2.2).contains(&ratio), "alpha:beta = {held:?}");

    // The pool's status records each namespace's use; a restarted operator carries on from it
    // (one counting from zero would record a few slice-seconds in its first write).
    let before = eventually("the pool records alpha's use", || {
        let client = client.clone();
        async move {
            let (_, alpha) = recorded_use(&client, "alpha").await?;
            (alpha >= 100)
                .then_some(alpha)
                .ok_or_else(|| format!("alpha {alpha}"))
        }
    })
    .await;
    let mut h = h;
    h.restart_operator().await;
    let restarted = k8s_openapi::jiff::Timestamp::now();
    let after = eventually("the restarted operator records alpha's use", || {
        let client = client.clone();
        async move {
            let (at, alpha) = recorded_use(&client, "alpha").await?;
            (at > restarted)
                .then_some(alpha)
                .ok_or_else(|| format!("recorded at {at}"))
        }
    })
    .await;
    assert!(
        after >= before,
        "alpha's use was {before} slice-seconds before the restart, {after} after"
    );
}

/// The reason and message of a pod's `gpuslice.io/Queued` condition, once it has one.
async fn queued(client: &Client, namespace: &str, name: &str) -> Result<(String, String), String> {
    let p = Api::<Pod>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .map_err(|e| e.to_string())?;
    p.status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "gpuslice.io/Queued")
        .map(|c| (c.reason.unwrap_or_default(), c.message.unwrap_or_default()))
        .ok_or_else(|| format!("{namespace}/{name} not told yet"))
}

/// When the pool `teams` last recorded its namespaces' use, and `namespace`'s slice-seconds.
async fn recorded_use(
    client: &Client,
    namespace: &str,
) -> Result<(k8s_openapi::jiff::Timestamp, i64), String> {
    let pool = Api::<gpuslice_api::GpuPool>::all(client.clone())
        .get("teams")
        .await
        .map_err(|e| e.to_string())?;
    let recorded = pool
        .status
        .and_then(|s| s.fair_share)
        .ok_or("no status.fairShare")?;
    let used = recorded
        .namespaces
        .iter()
        .find(|n| n.namespace == namespace)
        .map(|n| n.slice_seconds)
        .ok_or_else(|| format!("{namespace} not recorded"))?;
    Ok((recorded.at.0, used))
}

#[tokio::test]
async fn priorities_change_with_the_window_in_force() {
    // 18:00:20 in Shanghai: the window "evening" (18:00–18:01) raises lab jobs to high; it
    // keeps the pool's layout, so nothing is re-cut when it closes.
    let Some(h) = Harness::start("2026-12-02T10:00:20Z", "a100-w", "lab", "64", 1).await else {
        return;
    };
    let client = h.client.clone();
    let docs = gpuslice_testcluster::documents(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: lab}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: lab}}
  layout: {software: {slices: 2, memory: 40Gi, compute: 50}}
  windows:
  - name: evening
    timeZone: Asia/Shanghai
    start: '18:00'
    end: '18:01'
    layout: {software: {slices: 2, memory: 40Gi, compute: 50}}
    priorities: {lab-job: high}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: prod-job}
spec: {pool: lab, memory: 8Gi, priority: normal}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: lab-job}
spec: {pool: lab, memory: 8Gi, priority: low}
",
    );
    h.apply_and_wait(&docs, 2).await;
    for name in ["filler-0", "filler-1", "prod-x"] {
        h.create_gated(&pod(name, "default", "prod-job")).await;
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    }
    h.create_gated(&pod("lab-y", "default", "lab-job")).await;
    let place = |name: &'static str| {
        let client = client.clone();
        async move { Ok::<String, String>(queued(&client, "default", name).await?.1) }
    };
    // In the window the lab job, though it came last, is first in line.
    eventually("the lab job is first while the window is open", || async {
        let (lab, prod) = (place("lab-y").await?, place("prod-x").await?);
        (lab.starts_with("1st of 2") && prod.starts_with("2nd of 2"))
            .then_some(())
            .ok_or(format!("lab-y: {lab}; prod-x: {prod}"))
    })
    .await;
    // At 18:01 the window closes: the lab job is low again, behind the production job.
    eventually("the production job is first after the window", || async {
        let (lab, prod) = (place("lab-y").await?, place("prod-x").await?);
        (lab.starts_with("2nd of 2") && prod.starts_with("1st of 2"))
            .then_some(())
            .ok_or(format!("lab-y: {lab}; prod-x: {prod}"))
    })
    .await;
    let bound = bound(&client, &["default"]).await;
    assert_eq!(
        bound,
        [
            ("default".to_string(), "filler-0".to_string()),
            ("default".to_string(), "filler-1".to_string())
        ]
    );
}

#[tokio::test]
async fn a_pod_is_not_put_on_a_slice_a_window_change_recuts_before_it_ends() {
    // 10:00 UTC; at 10:30 the window "batch" re-cuts the GPU (2 × 40 GiB → 4 × 20 GiB).
    let Some(h) = Harness::start(CLOCK, "a100-r", "recut", "64", 1).await else {
        return;
    };
    let client = h.client.clone();
    let docs = gpuslice_testcluster::documents(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: recut}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: recut}}
  layout: {software: {slices: 2, memory: 40Gi, compute: 50}}
  windows:
  - {name: batch, timeZone: UTC, start: '10:30', end: '11:30', layout: {software: {slices: 4, memory: 20Gi, compute: 25}}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: job}
spec: {pool: recut, memory: 8Gi}
",
    );
    h.apply_and_wait(&docs, 1).await;
    let with_run_time = |name: &str, run_time: &str| {
        let mut p = pod(name, "default", "job");
        p.metadata.annotations = Some(
            [(
                "gpuslice.io/expected-run-time".to_string(),
                run_time.to_string(),
            )]
            .into(),
        );
        p
    };
    h.create_gated(&with_run_time("long", "2h")).await;
    h.create_gated(&with_run_time("typo", "soon")).await;
    let told = |name: &'static str| {
        let client = client.clone();
        async move { queued(&client, "default", name).await }
    };
    // Both slices are free, but the long job would still run at 10:30.
    eventually("the long job waits for the window change", || async {
        let (reason, message) = told("long").await?;
        (reason == "WindowChangeAhead" && message.contains("expected run time"))
            .then_some(())
            .ok_or(format!("{reason}: {message}"))
    })
    .await;
    eventually(
        "a run time that is not a duration is refused by name",
        || async {
            let (reason, message) = told("typo").await?;
            (reason == "InvalidExpectedRunTime"
                && message.contains("\"soon\" is not a positive duration"))
            .then_some(())
            .ok_or(format!("{reason}: {message}"))
        },
    )
    .await;
    // The short job and the one that declares nothing take the two slices. They come after the
    // checks above: once they hold both slices, the long job waits for a free slice (NoSliceFits).
    h.create_gated(&with_run_time("short", "20m")).await;
    h.create_gated(&pod("plain", "default", "job")).await;
    eventually("the short and the plain job are bound", || {
        let client = client.clone();
        async move {
            let b = bound(&client, &["default"]).await;
            let names: Vec<&str> = b.iter().map(|(_, n)| n.as_str()).collect();
            (names == ["plain", "short"])
                .then_some(())
                .ok_or(format!("{names:?}"))
        }
    })
    .await;
}

#[tokio::test]
async fn a_pod_goes_only_to_a_node_with_its_cpu_free_and_says_so_when_none_has_it() {
    // Two nodes of one pool, a GPU each in four slices; a100-c has 4 CPUs, a100-d 64. Equal on
    // GPUs, a100-c would be picked first (by name): it has no room for an 8-CPU pod, which
    // kube-scheduler would then never bind there.
    let Some(mut h) = Harness::start(CLOCK, "a100-c", "roomy", "4", 1).await else {
        return;
    };
    h.add_node("a100-d", "roomy", &["NVIDIA A100-SXM4-80GB"])
        .await;
    let client = h.client.clone();
    let docs = gpuslice_testcluster::documents(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: roomy}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: roomy}}
  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: job}
spec: {pool: roomy, memory: 8Gi}
",
    );
    h.apply_and_wait(&docs, 1).await;
    let asking = |name: &str, cpu: &str| {
        let mut p = pod(name, "default", "job");
        let spec = p.spec.as_mut().unwrap();
        spec.containers[0].resources =
            Some(serde_json::from_value(serde_json::json!({"requests": {"cpu": cpu}})).unwrap());
        p
    };
    h.create_gated(&asking("wide", "8")).await;
    h.create_gated(&asking("huge", "100")).await;
    eventually("the 8-CPU pod is bound on the node with room", || {
        let client = client.clone();
        async move {
            let pods: Api<Pod> = Api::namespaced(client, "default");
            let node = pods
                .get("wide")
                .await
                .map_err(|e| e.to_string())?
                .spec
                .and_then(|s| s.node_name);
            (node.as_deref() == Some("a100-d"))
                .then_some(())
                .ok_or(format!("on {node:?}"))
        }
    })
    .await;
    eventually("the 100-CPU pod waits and says why", || async {
        let (reason, message) = queued(&client, "default", "huge").await?;
        (reason == "NoRoom"
            && message.contains("no node that has them has the 100000m CPU")
            && message.contains("lower the pod's requests"))
        .then_some(())
        .ok_or(format!("{reason}: {message}"))
    })
    .await;
}

/// The Warning Events on pool `pool` with `reason`: their messages.
async fn pool_events(client: &Client, pool: &str, reason: &str) -> Vec<String> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
    events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pool)
                && e.reason.as_deref() == Some(reason)
        })
        .filter_map(|e| e.note)
        .collect()
}

#[tokio::test]
async fn a_preemption_its_agent_never_reads_is_reported_then_given_up() {
    let Some(mut h) = Harness::start_with(
        CLOCK,
        "a100-d",
        "shared-a100",
        "64",
        1,
        &["--agent-timeout", "3s"],
    )
    .await
    else {
        return;
    };
    let client = h.client.clone();
    h.apply_notebook_and_finetune().await;
    for i in 0..4 {
        h.create_gated(&pod(&format!("notebook-{i}"), "default", "notebook"))
            .await;
    }
    eventually("four notebooks run", || {
        let client = client.clone();
        async move {
            let s = states(&client).await;
            (s.iter().filter(|p| p.1.is_some()).count() == 4)
                .then_some(())
                .ok_or_else(|| format!("{s:?}"))
        }
    })
    .await;

    // The node's agent dies; a fine-tune of higher priority arrives and a notebook's slice is
    // asked back from an agent that never reads it.
    h.agent.0.kill().unwrap();
    h.create_gated(&pod("bert-0", "nlp", "bert-finetune")).await;
    let told = |reason: &'static str, part: &'static str| {
        let client = client.clone();
        async move {
            let s = states(&client).await;
            let bert = s.iter().find(|p| p.0 == "bert-0").and_then(|p| p.3.clone());
            bert.as_ref()
                .is_some_and(|(r, m)| r == reason && m.contains(part))
                .then_some(())
                .ok_or_else(|| format!("{bert:?}"))
        }
    };
    // Past the timeout the waiting pod and the pool say so; the preemption is still asked.
    eventually("the waiting pod says the agent has not read it", || {
        told(
            "Preempting",
            "asked the agent of node a100-d, which has not read it for over 3s (is it running?); given up after 15s",
        )
    })
    .await;
    let overdue = eventually("a PreemptionOverdue Event on the pool", || {
        let client = client.clone();
        async move {
            let notes = pool_events(&client, "shared-a100", "PreemptionOverdue").await;
            notes.first().cloned().ok_or_else(|| "none".to_string())
        }
    })
    .await;
    assert!(
        overdue.starts_with("the agent of node a100-d has not read, for 3s, the preemption of ResourceClaim default/")
            && overdue.ends_with("for pod nlp/bert-0: is gpuslice's agent running there? Still asked; given up after 15s"),
        "{overdue}"
    );
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    assert_eq!(
        gpu_nodes
            .get("a100-d")
            .await
            .unwrap()
            .spec
            .preemptions
            .len(),
        1
    );
    // Five timeouts later it is given up: the preemption leaves the GpuNode, the pool says why,
    // and the pod waits for a slice to free up (no other victim on that node is chosen).
    eventually("the preemption given up", || {
        let client = client.clone();
        async move {
            let notes = pool_events(&client, "shared-a100", "PreemptionGivenUp").await;
            notes
                .iter()
                .any(|n| n.contains("its agent did not read the request within 15s; the pod waits for another slice, and no slice of node a100-d is taken back for 10 minutes"))
                .then_some(())
                .ok_or_else(|| format!("{notes:?}"))
        }
    })
    .await;
    eventually("the pod waits for a free slice", || {
        told(
            "NoSliceFits",
            "no free slice of pool shared-a100 fits policy bert-finetune",
        )
    })
    .await;
    assert!(
        gpu_nodes
            .get("a100-d")
            .await
            .unwrap()
            .spec
            .preemptions
            .is_empty()
    );
    assert_eq!(
        pool_events(&client, "shared-a100", "PreemptionOverdue")
            .await
            .len(),
        1,
        "reported once"
    );
}

/// The pool's elastic status, once it has one.
async fn elastic_status(
    client: &Client,
    pool: &str,
) -> Result<gpuslice_api::ElasticStatus, String> {
    Api::<gpuslice_api::GpuPool>::all(client.clone())
        .get(pool)
        .await
        .map_err(|e| e.to_string())?
        .status
        .and_then(|s| s.elastic)
        .ok_or_else(|| format!("GpuPool {pool} has no elastic status yet"))
}

#[tokio::test]
async fn an_elastic_pool_re_cuts_an_idle_gpu_for_a_waiting_pod_and_leaves_busy_ones_alone() {
    // Two A100s in quarters; the elastic set may also cut halves. A pod that needs a half waits
    // until the operator re-cuts the idle GPU; the GPU holding a quarter's pod keeps its shape.
    let Some(mut h) = Harness::start(CLOCK, "a100-e", "elastic", "64", 2).await else {
        return;
    };
    let client = h.client.clone();
    let docs = gpuslice_testcluster::documents(
        &std::fs::read_to_string(root().join("tests/fixtures/elastic-a100.yaml")).unwrap(),
    );
    h.apply_and_wait(&docs, 2).await;
    eventually("both GPUs are quarters", || async {
        let s = elastic_status(&client, "elastic").await?;
        (s.shapes.get("quarters") == Some(&2))
            .then_some(())
            .ok_or(format!("{s:?}"))
    })
    .await;
    h.create_gated(&pod("small-0", "default", "small")).await;
    eventually("the small pod is bound", || {
        let client = client.clone();
        async move {
            let b = bound(&client, &["default"]).await;
            (b.len() == 1).then_some(()).ok_or(format!("{b:?}"))
        }
    })
    .await;
    h.create_gated(&pod("big-0", "default", "big")).await;
    // The operator stages the idle GPU to halves; the agent switches it, the queue admits the pod.
    eventually("the big pod is bound on a half", || {
        let client = client.clone();
        async move {
            let b = bound(&client, &["default"]).await;
            (b.len() == 2).then_some(()).ok_or(format!(
                "{b:?}; {:?}",
                elastic_status(&client, "elastic").await
            ))
        }
    })
    .await;
    let status = eventually("one GPU in each shape", || async {
        let s = elastic_status(&client, "elastic").await?;
        (s.shapes.get("quarters") == Some(&1) && s.shapes.get("halves") == Some(&1))
            .then_some(s.clone())
            .ok_or(format!("{s:?}"))
    })
    .await;
    let recut = status.last_recut.expect("the re-cut recorded");
    assert!(
        recut.reason.contains("quarters → halves") && recut.reason.contains("big"),
        "{}",
        recut.reason
    );
    let events = pool_events(&client, "elastic", "ElasticRecut").await;
    assert!(events.iter().any(|e| e.contains("halves")), "{events:?}");
    // The small pod was never drained: the same pod still runs.
    let small = Api::<Pod>::namespaced(client.clone(), "default")
        .get("small-0")
        .await
        .unwrap();
    assert!(small.metadata.deletion_timestamp.is_none());
    // The GpuNode says which GPU has which shape, and since when.
    let node = Api::<gpuslice_api::GpuNode>::all(client.clone())
        .get("a100-e")
        .await
        .unwrap();
    let shapes: Vec<(String, bool)> = node
        .spec
        .in_force(gpuslice_api::chrono_of(&recut.at).unwrap() + chrono::TimeDelta::minutes(1))
        .gpus
        .iter()
        .map(|g| {
            let s = g.assigned.shape.as_ref().expect("a shape");
            (s.name.clone(), s.since.is_some())
        })
        .collect();
    let mut sorted = shapes.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            ("halves".to_string(), true),
            ("quarters".to_string(), false)
        ],
        "{shapes:?}"
    );

    // A new operator carries the forecast on from the pool's status: once the small pod is
    // gone, this hour's peak for it stays 1 (a fresh operator would have learned 0).
    let learned = status.forecast.expect("a forecast");
    assert_eq!(learned.peaks.get("small"), Some(&1.0), "{learned:?}");
    h.restart_operator().await;
    Api::<Pod>::namespaced(client.clone(), "default")
        .delete("small-0", &DeleteParams::default())
        .await
        .unwrap();
    let policies: Api<gpuslice_api::GpuSlicePolicy> = Api::all(client.clone());
    eventually("the new operator sees the small pod gone", || async {
        let s = policies
            .get("small")
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        (s.allocated == 0 && s.observed_generation.is_some())
            .then_some(())
            .ok_or(format!("{s:?}"))
    })
    .await;
    let forecast = elastic_status(&client, "elastic")
        .await
        .unwrap()
        .forecast
        .unwrap_or_default();
    assert_eq!(forecast.hour, learned.hour);
    assert_eq!(forecast.peaks.get("small"), Some(&1.0), "{forecast:?}");
}

#[tokio::test]
async fn an_elastic_pool_shapes_ahead_of_what_its_prometheus_expects_and_says_when_it_cannot_read_it()
 {
    let Some(prometheus) =
        gpuslice_testcluster::built_tool("GPUSLICE_PROMETHEUS_DIR", "prometheus", "")
    else {
        return;
    };
    let Some(h) = Harness::start(CLOCK, "a100-p", "forecast", "64", 2).await else {
        return;
    };
    let client = h.client.clone();
    // A real Prometheus with nothing to scrape: the query makes up the expectation.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(&config, "global: {scrape_interval: 15s}\n").unwrap();
    let port = gpuslice_testcluster::free_port().unwrap();
    let mut server = KillOnDrop(
        std::process::Command::new(prometheus.join("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let docs = gpuslice_testcluster::documents(&format!(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {{name: forecast}}
spec:
  nodeSelector: {{matchLabels: {{gpuslice.io/pool: forecast}}}}
  layout: {{software: {{slices: 4, memory: 20Gi, compute: 25}}}}
  elastic:
    shapes:
    - {{name: quarters, layout: {{software: {{slices: 4, memory: 20Gi, compute: 25}}}}}}
    - {{name: halves, layout: {{software: {{slices: 2, memory: 40Gi, compute: 50}}}}}}
    prometheus:
      url: http://127.0.0.1:{port}
      query: label_replace(vector(1), \"policy\", \"big\", \"\", \"\")
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {{name: big}}
spec: {{pool: forecast, memory: 30Gi}}
"
    ));
    h.apply_and_wait(&docs, 1).await;
    let signal = || {
        let client = client.clone();
        async move {
            let pool = Api::<gpuslice_api::GpuPool>::all(client)
                .get("forecast")
                .await
                .map_err(|e| e.to_string())?;
            pool.status
                .unwrap_or_default()
                .conditions
                .into_iter()
                .find(|c| c.type_ == "ElasticSignal")
                .ok_or_else(|| "no ElasticSignal condition yet".to_string())
        }
    };
    // No pod waits, yet one idle GPU is cut in halves for the pod Prometheus expects.
    eventually("Prometheus is read and a GPU is cut ahead", || async {
        let c = signal().await?;
        let s = elastic_status(&client, "forecast").await?;
        (c.status == "True"
            && c.message.contains("expects big 1")
            && s.shapes.get("halves") == Some(&1))
        .then_some(())
        .ok_or(format!("{c:?} {s:?}"))
    })
    .await;
    // Prometheus goes away: the pool says so, and keeps its shapes.
    server.0.kill().unwrap();
    let _ = server.0.wait();
    eventually("the pool says Prometheus cannot be read", || async {
        let c = signal().await?;
        (c.status == "False"
            && c.reason == "PrometheusUnavailable"
            && c.message
                .contains("the queue and the learned forecast stay in force"))
        .then_some(())
        .ok_or(format!("{c:?}"))
    })
    .await;
    let s = elastic_status(&client, "forecast").await.unwrap();
    assert_eq!(s.shapes.get("halves"), Some(&1), "{s:?}");
}

#[tokio::test]
async fn an_elastic_gpu_holds_its_shape_for_min_dwell_then_goes_back_and_the_pool_spec_never_changes()
 {
    // Two A100s; the set keeps both in quarters (minGpus 2) unless pods wait for a half. A pod
    // of `big` re-cuts one to halves; once it is gone, minDwell (1m) holds that GPU in halves,
    // and only then does the minimum take it back. No forecast: nothing else wants halves.
    let Some(h) = Harness::start(CLOCK, "a100-d", "dwell", "64", 2).await else {
        return;
    };
    let client = h.client.clone();
    let docs = gpuslice_testcluster::documents(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: dwell}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: dwell}}
  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}
  elastic:
    shapes:
    - {name: quarters, minGpus: 2, layout: {software: {slices: 4, memory: 20Gi, compute: 25}}}
    - {name: halves, layout: {software: {slices: 2, memory: 40Gi, compute: 50}}}
    minDwell: 1m
    maxInFlight: 50
    forecastHorizon: 0s
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: big-d}
spec: {pool: dwell, memory: 30Gi}
",
    );
    h.apply_and_wait(&docs, 1).await;
    let pools: Api<gpuslice_api::GpuPool> = Api::all(client.clone());
    let applied = pools.get("dwell").await.unwrap().metadata.generation;
    h.create_gated(&pod("big-d-0", "default", "big-d")).await;
    let recut = eventually("the big pod is bound on a half", || {
        let client = client.clone();
        async move {
            let s = elastic_status(&client, "dwell").await?;
            let b = bound(&client, &["default"]).await;
            (b.len() == 1 && s.shapes.get("halves") == Some(&1))
                .then(|| s.last_recut.clone())
                .flatten()
                .ok_or(format!("{b:?}; {s:?}"))
        }
    })
    .await;
    let recut_at = gpuslice_api::chrono_of(&recut.at).unwrap();
    Api::<Pod>::namespaced(client.clone(), "default")
        .delete("big-d-0", &DeleteParams::default())
        .await
        .unwrap();
    // Idle and below the minimum of quarters, the GPU still waits out minDwell.
    let held = eventually("the pool says minDwell holds the GPU", || async {
        let s = elastic_status(&client, "dwell").await?;
        s.waiting_for
            .iter()
            .any(|w| w.contains("minDwell"))
            .then_some(s.clone())
            .ok_or(format!("{s:?}"))
    })
    .await;
    assert_eq!(held.shapes.get("halves"), Some(&1), "{held:?}");
    let back = eventually("the GPU goes back to quarters", || async {
        let s = elastic_status(&client, "dwell").await?;
        (s.shapes.get("quarters") == Some(&2))
            .then(|| s.last_recut.clone())
            .flatten()
            .ok_or(format!("{s:?}"))
    })
    .await;
    let back_at = gpuslice_api::chrono_of(&back.at).unwrap();
    assert!(
        back_at - recut_at >= chrono::TimeDelta::minutes(1),
        "re-cut again after {} s: {back:?}",
        (back_at - recut_at).num_seconds()
    );
    assert!(
        back.reason
            .contains("halves → quarters (for the minGpus of quarters)"),
        "{}",
        back.reason
    );
    // Git stays the source of truth: the operator wrote the pool's status, never its spec,
    // so Argo CD has no drift to show.
    let pool = pools.get("dwell").await.unwrap();
    assert_eq!(pool.metadata.generation, applied);
    let spec_writers: Vec<String> = pool
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.subresource.is_none())
        .filter_map(|m| m.manager)
        .collect();
    assert_eq!(
        spec_writers,
        ["gpuslice-test"],
        "only the applier writes the spec"
    );
}

/// The devices allocated to the ResourceClaims pod `name` owns (its extended resource's, or
/// its claim made from a template): (node, device).
async fn claimed_devices(client: &Client, name: &str) -> Vec<(String, String)> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let mut out = Vec::new();
    for claim in claims.list(&ListParams::default()).await.unwrap() {
        let owned = claim
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Pod" && o.name == name);
        if !owned {
            continue;
        }
        let results = gpuslice_testcluster::allocated_devices(claim);
        out.extend(results.into_iter().map(|r| (r.pool, r.device)));
    }
    out.sort();
    out
}

/// Each published device's NVLink domain, by (node, device).
async fn nvlink_domains(client: &Client) -> std::collections::BTreeMap<(String, String), String> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut out = std::collections::BTreeMap::new();
    for s in slices.list(&ListParams::default()).await.unwrap() {
        for d in s.spec.devices.iter().flatten() {
            let domain = d
                .attributes
                .as_ref()
                .and_then(|a| a.get(gpuslice_api::dra::attribute::NVLINK_DOMAIN))
                .and_then(|a| a.string.clone());
            if let Some(domain) = domain {
                out.insert((s.spec.pool.name.clone(), d.name.clone()), domain);
            }
        }
    }
    out
}

/// `count > 1`: a pod gets all of its GPUs on one node or waits (never some of them), and a
/// `topology: nvlink` pod is never given a PCIe-only pair, through the chart's admission (the
/// policy's count as the extended resource's quantity; a claim from the policy's
/// ResourceClaimTemplate, which the queue writes, for the topology), the queue and
/// kube-scheduler.
#[tokio::test]
async fn a_pod_of_several_gpus_gets_them_all_on_one_node_and_an_nvlink_pair_never_a_pcie_one() {
    let params = format!(
        "--admission-params={}/{}-policies",
        gpuslice_testcluster::CHART_NAMESPACE,
        gpuslice_testcluster::CHART_RELEASE
    );
    let Some(mut h) = Harness::start_with(CLOCK, "hgx", "whole", "64", 8, &[params.as_str()]).await
    else {
        return;
    };
    h.add_node("pcie", "whole", &["NVIDIA A100 80GB PCIe"; 2])
        .await;
    let client = h.client.clone();
    h.apply_and_wait(
        &gpuslice_testcluster::documents(
            "apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: whole}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: whole}}
  layout: {exclusive: {}}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: quad}
spec: {pool: whole, memory: 70Gi, count: 4}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: pair}
spec: {pool: whole, memory: 70Gi, count: 2}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: nvpair}
spec: {pool: whole, memory: 70Gi, count: 2, topology: nvlink}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: nine}
spec: {pool: whole, memory: 70Gi, count: 9}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: nvthree}
spec: {pool: whole, memory: 70Gi, count: 3, topology: nvlink}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: nvnine}
spec: {pool: whole, memory: 70Gi, count: 9, topology: nvlink}
",
        ),
        6,
    )
    .await;
    // A count no node holds is bad input, said on the policy; three on one NVLink domain fit.
    let policies: Api<gpuslice_api::GpuSlicePolicy> = Api::all(client.clone());
    for (name, want) in [
        (
            "nine",
            "NoNodeHoldsCount: spec.count: no node of GpuPool \"whole\" has 9 slices that hold spec.memory 70Gi + memoryHeadroom (the most is 8, on hgx)",
        ),
        (
            "nvnine",
            "NoNvlinkDomainHoldsCount: spec.count: no NVLink domain of a node of GpuPool \"whole\" has 9 slices",
        ),
        ("nvthree", "SliceFits"),
        ("nvpair", "SliceFits"),
    ] {
        let policies = policies.clone();
        eventually(&format!("policy {name}: {want}"), || {
            let policies = policies.clone();
            async move {
                let p = policies.get(name).await.map_err(|e| e.to_string())?;
                let ready = p
                    .status
                    .iter()
                    .flat_map(|s| &s.conditions)
                    .find(|c| c.type_ == "Ready")
                    .map(|c| format!("{}: {}", c.reason, c.message))
                    .unwrap_or_default();
                ready.starts_with(want).then_some(()).ok_or(ready)
            }
        })
        .await;
    }
    let domains = eventually("both nodes publish their GPUs", || {
        let client = client.clone();
        async move {
            let d = nvlink_domains(&client).await;
            (d.keys().filter(|(node, _)| node == "hgx").count() == 8)
                .then_some(d.clone())
                .ok_or_else(|| format!("{d:?}"))
        }
    })
    .await;
    assert!(
        !domains.keys().any(|(node, _)| node == "pcie"),
        "PCIe GPUs have no NVLink domain: {domains:?}"
    );

    // The policy's count is the quantity admission asks for.
    let limit_is = |n: &'static str| {
        move |p: &Pod| {
            p.spec.as_ref().is_some_and(|s| {
                s.containers[0]
                    .resources
                    .as_ref()
                    .and_then(|r| r.limits.as_ref())
                    .and_then(|l| l.values().next())
                    .is_some_and(|q| q.0 == n)
            })
        }
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for name in ["quad-1", "quad-2"] {
        gpuslice_testcluster::create_gated_as(
            &client,
            &pod(name, "default", "quad"),
            limit_is("4"),
        )
        .await;
    }
    let on = |node: &'static str| {
        let client = client.clone();
        move |names: &'static [&'static str]| {
            let client = client.clone();
            async move {
                let s = states(&client).await;
                let there: Vec<&str> = s
                    .iter()
                    .filter(|p| p.1.as_deref() == Some(node))
                    .map(|p| p.0.as_str())
                    .collect();
                (there == names)
                    .then_some(())
                    .ok_or_else(|| format!("{s:?}"))
            }
        }
    };
    eventually("both 4-GPU pods go onto the 8-GPU board", || {
        on("hgx")(&["quad-1", "quad-2"])
    })
    .await;
    for name in ["quad-1", "quad-2"] {
        let devices = claimed_devices(&client, name).await;
        assert_eq!(devices.len(), 4, "{name}: {devices:?}");
        assert!(devices.iter().all(|(node, _)| node == "hgx"), "{devices:?}");
    }

    // The board is full; the PCIe box has two free GPUs. The NVLink pair waits, told why; a
    // plain pair takes the PCIe GPUs.
    let has_claim = |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .is_some_and(|c| {
                c.iter().any(|c| {
                    c.resource_claim_template_name.as_deref() == Some("nvpair.gpuslice.io")
                })
            })
    };
    gpuslice_testcluster::create_gated_as(
        &client,
        &pod("nvpair-1", "default", "nvpair"),
        has_claim,
    )
    .await;
    gpuslice_testcluster::create_gated_as(
        &client,
        &pod("pair-1", "default", "pair"),
        limit_is("2"),
    )
    .await;
    eventually("the plain pair goes onto the PCIe box", || {
        on("pcie")(&["pair-1"])
    })
    .await;
    let (reason, message) = eventually("the NVLink pair is told why it waits", || {
        let client = client.clone();
        async move { queued(&client, "default", "nvpair-1").await }
    })
    .await;
    assert_eq!(reason, "NoSliceFits", "{message}");
    assert!(
        message.contains(
            "no 2 free slices of pool whole that fit policy nvpair are on one NVLink domain"
        ),
        "{message}"
    );

    // A third 4-GPU pod waits behind it; one board pod ends: the NVLink pair takes two of the
    // four freed GPUs, on one domain, and the 4-GPU pod still waits with two free, told why.
    gpuslice_testcluster::create_gated_as(
        &client,
        &pod("quad-3", "default", "quad"),
        limit_is("4"),
    )
    .await;
    pods.delete("quad-1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    eventually("the NVLink pair goes onto the board", || {
        on("hgx")(&["nvpair-1", "quad-2"])
    })
    .await;
    let pair = eventually("the NVLink pair's claim is allocated", || {
        let client = client.clone();
        async move {
            let d = claimed_devices(&client, "nvpair-1").await;
            (d.len() == 2)
                .then_some(d.clone())
                .ok_or_else(|| format!("{d:?}"))
        }
    })
    .await;
    let pair_domains: std::collections::BTreeSet<&String> =
        pair.iter().map(|d| &domains[d]).collect();
    assert_eq!(pair_domains.len(), 1, "{pair:?} on {pair_domains:?}");
    let (reason, message) = eventually("the 4-GPU pod is told why it waits", || {
        let client = client.clone();
        async move {
            let (r, m) = queued(&client, "default", "quad-3").await?;
            m.contains("no 4 free slices of pool whole that fit policy quad are on one node")
                .then_some((r, m.clone()))
                .ok_or(m)
        }
    })
    .await;
    assert_eq!(reason, "NoSliceFits", "{message}");
    let s = states(&client).await;
    assert!(
        s.iter().any(|p| p.0 == "quad-3" && p.1.is_none() && p.2),
        "quad-3 is still gated, no GPU of it allocated: {s:?}"
    );
    assert!(claimed_devices(&client, "quad-3").await.is_empty());

    // The pair ends: four are free together, and the 4-GPU pod takes them.
    pods.delete("nvpair-1", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    eventually("the third 4-GPU pod goes onto the board", || {
        on("hgx")(&["quad-2", "quad-3"])
    })
    .await;
    let devices = claimed_devices(&client, "quad-3").await;
    assert_eq!(devices.len(), 4, "{devices:?}");
}
