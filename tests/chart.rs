//! The Helm chart, with a real Helm (built by tests/helm/build.sh) and a real API server: it
//! lints, renders, every rendered object is accepted, and the operator and an agent then run as
//! the chart's own ServiceAccounts — which proves the roles it grants are enough — until a pool
//! is Ready on an emulated node.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuslice_api::GpuPool;
use gpuslice_testcluster::repo_root as root;
use gpuslice_testcluster::{Components, ControlPlane, eventually};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, Patch, PatchParams, PostParams};

const NAMESPACE: &str = "gpuslice-system";

struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test]
async fn the_chart_installs_and_its_roles_are_enough() {
    let Some(helm) = gpuslice_testcluster::built_tool("GPUSLICE_HELM", "helm", "") else {
        return;
    };
    let chart = root().join("charts/gpuslice");
    let lint = Command::new(&helm)
        .arg("lint")
        .arg(&chart)
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    let docs = gpuslice_testcluster::render_chart(&helm, NAMESPACE, &[]);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for kind in [
        "Deployment",
        "DaemonSet",
        "ClusterRole",
        "ServiceAccount",
        "PodDisruptionBudget",
        "Service",
    ] {
        assert!(
            kinds.contains(&kind),
            "the chart renders a {kind}: {kinds:?}"
        );
    }
    let text = serde_json::to_string(&docs).unwrap();
    assert!(!text.contains("\"*\""), "no wildcards in the roles");
    assert!(
        !kinds.contains(&"ServiceMonitor"),
        "ServiceMonitors are opt-in: {kinds:?}"
    );
    service_monitors_select_the_pods(&helm);

    let Some(cluster) = ControlPlane::start(Components::default()).await.unwrap() else {
        return;
    };
    let admin = cluster.client().await.unwrap();
    gpuslice_testcluster::install_crds(&admin, &chart.join("crds"))
        .await
        .unwrap();
    let discovery = kube::discovery::Discovery::new(admin.clone())
        .run()
        .await
        .unwrap();
    for doc in &docs {
        gpuslice_testcluster::apply_document(&admin, &discovery, doc, false)
            .await
            .unwrap_or_else(|| panic!("unknown kind: {doc}"))
            .unwrap_or_else(|e| panic!("{}: {e}", doc["metadata"]["name"]));
    }

    // The operator and an agent, each as its ServiceAccount from the chart.
    let kubeconfig = |name: &str| {
        cluster
            .dir()
            .join(format!("sa-{NAMESPACE}-{name}.kubeconfig"))
    };
    cluster
        .service_account_client(NAMESPACE, "gs-operator")
        .await
        .unwrap();
    cluster
        .create_node("gpu-0", &[("gpuslice.io/pool", "h200-mig")], &[])
        .await
        .unwrap();
    // The agent's token is bound to its pod on gpu-0, as the DaemonSet's is.
    let agent = cluster
        .pod_service_account_client(NAMESPACE, "gs-agent", "gpu-0")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("node.yaml");
    std::fs::write(
        &node_file,
        "name: gpu-0\ngpus:\n- {index: 0, model: NVIDIA H200}\n",
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_gpuslice");
    let _children = Reaper(vec![
        Command::new(bin)
            .args(["operator", "--lease-namespace", NAMESPACE])
            .arg(format!("--admission-params={NAMESPACE}/gs-policies"))
            .env("KUBECONFIG", kubeconfig("gs-operator"))
            .env("GPUSLICE_CLOCK_START", "2026-12-02T09:00:00Z")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
        Command::new(bin)
            .args(["agent", "--kube", "--interval", "2s", "--emulate"])
            .arg(&node_file)
            .arg("--state")
            .arg(dir.path())
            // Pools' dataset caches, for /var/lib/gpuslice/cache.
            .arg("--cache-root")
            .arg(std::path::Path::new(&dir.path()).join("caches"))
            .env("KUBECONFIG", kubeconfig("gs-agent-on-gpu-0"))
            .env("GPUSLICE_CLOCK_START", "2026-12-02T09:00:00Z")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    ]);
    for file in [
        "examples/gitops/policies/checkpoint-standard.yaml",
        "examples/gitops/pools/h200-mig.yaml",
        "examples/gitops/policies/llm-inference.yaml",
        "examples/gitops/policies/notebook.yaml",
    ] {
        let doc: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(root().join(file)).unwrap()).unwrap();
        gpuslice_testcluster::apply_document(&admin, &discovery, &doc, false)
            .await
            .unwrap()
            .unwrap();
    }
    let pools: Api<GpuPool> = Api::all(admin.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pool = pools.get("h200-mig").await.unwrap();
        let ready = pool.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| (c.status.clone(), c.message.clone()))
        });
        if ready.as_ref().is_some_and(|(s, _)| s == "True") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not Ready under the chart's roles: {ready:?}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Under the same roles the agent publishes the node's slices for DRA and the operator
    // writes the policy's DeviceClass.
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let classes: Api<DeviceClass> = Api::all(admin.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let published = slices.list(&Default::default()).await.unwrap().items.len();
        let class = classes.get_opt("llm-inference.gpuslice.io").await.unwrap();
        if published == 1 && class.is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{published} ResourceSlices, class {class:?}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    admission_takes_policies_by_name(&admin).await;
    admission_keeps_root_off_a_non_root_pool(&admin).await;
    admission_mounts_checkpoint_storage(&admin).await;
    admission_gives_a_pod_its_count(&admin).await;

    // The kubelet plugin inside the agent reads the claims it prepares; the agent may neither
    // evict pods (it asks the operator, which evicts only the asking node's) nor delete them.
    let may = |account: &str, verb: &str, resource: &str| {
        let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
        let admin = admin.clone();
        let review: SubjectAccessReview = serde_json::from_value(serde_json::json!({
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": format!("system:serviceaccount:{NAMESPACE}:{account}"),
                "groups": ["system:serviceaccounts"],
                "resourceAttributes": {"verb": verb, "group": if resource == "pods" { "" } else { "resource.k8s.io" },
                    "resource": resource, "subresource": subresource, "namespace": "default"}
            }
        }))
        .unwrap();
        async move {
            Api::<SubjectAccessReview>::all(admin)
                .create(&Default::default(), &review)
                .await
                .unwrap()
                .status
                .is_some_and(|s| s.allowed)
        }
    };
    assert!(may("gs-agent", "get", "resourceclaims").await);
    assert!(!may("gs-agent", "create", "pods/eviction").await);
    assert!(!may("gs-agent", "delete", "pods").await);
    assert!(may("gs-operator", "create", "pods/eviction").await);

    // Its own node's ResourceSlices only: not another node's, and none with a token not bound
    // to a pod on a node.
    let other_node: ResourceSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "gpu-1-gpuslice.io-0"},
        "spec": {"driver": "gpuslice.io", "nodeName": "gpu-1",
                 "pool": {"name": "gpu-1", "generation": 1, "resourceSliceCount": 1}, "devices": []}
    }))
    .unwrap();
    let refused = eventually("the ResourceSlice policy is in force", || {
        let (agent, slice) = (agent.clone(), other_node.clone());
        async move {
            match Api::<ResourceSlice>::all(agent)
                .create(&PostParams::default(), &slice)
                .await
            {
                Err(kube::Error::Api(e))
                    if e.code == 403 && e.message.contains("ValidatingAdmissionPolicy") =>
                {
                    Ok(e.message)
                }
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    assert!(
        refused.contains("the gpuslice agent on node gpu-0 may not write ResourceSlice gpu-1-gpuslice.io-0 of node gpu-1"),
        "{refused}"
    );
    let unbound = cluster
        .service_account_client(NAMESPACE, "gs-agent")
        .await
        .unwrap();
    let mut own = other_node.clone();
    own.metadata.name = Some("gpu-0-gpuslice.io-9".into());
    own.spec.node_name = Some("gpu-0".into());
    let refused = Api::<ResourceSlice>::all(unbound.clone())
        .create(&PostParams::default(), &own)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("only with a token bound to its pod on a node"),
        "{refused}"
    );

    admission_covers_every_route(&admin, &agent, &unbound, &docs).await;
    assert!(may("gs-agent", "update", "resourceslices").await);

    // Nothing else: the agent could not, say, change a pool.
    let as_agent: Api<GpuPool> = Api::all(agent);
    let denied = as_agent
        .patch("h200-mig", &PatchParams::apply("intruder"), &Patch::Apply(serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": "h200-mig"}, "spec": {}})))
        .await;
    assert!(
        matches!(denied, Err(kube::Error::Api(ref e)) if e.code == 403),
        "{denied:?}"
    );
}

/// With `metrics.serviceMonitor.enabled`, each component gets a ServiceMonitor whose selector
/// picks its metrics Service, and that Service selects the component's pods on their `metrics` port.
fn service_monitors_select_the_pods(helm: &Path) {
    let docs = gpuslice_testcluster::render_chart(
        helm,
        NAMESPACE,
        &[
            "metrics.serviceMonitor.enabled=true",
            "metrics.serviceMonitor.labels.release=prometheus",
        ],
    );
    let of_kind = |kind: &str| -> Vec<&serde_json::Value> {
        docs.iter().filter(|d| d["kind"] == kind).collect()
    };
    let monitors = of_kind("ServiceMonitor");
    assert_eq!(monitors.len(), 2, "one per component");
    let matches = |selector: &serde_json::Value, labels: &serde_json::Value| {
        selector
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k] == v)
    };
    for (workload, component) in [("Deployment", "operator"), ("DaemonSet", "agent")] {
        let monitor = monitors
            .iter()
            .find(|m| m["metadata"]["labels"]["app.kubernetes.io/component"] == component)
            .unwrap_or_else(|| panic!("a ServiceMonitor for the {component}"));
        assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
        assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
        let service = of_kind("Service")
            .into_iter()
            .find(|s| {
                matches(
                    &monitor["spec"]["selector"]["matchLabels"],
                    &s["metadata"]["labels"],
                )
            })
            .unwrap_or_else(|| panic!("the {component} ServiceMonitor selects a Service"));
        assert_eq!(service["spec"]["ports"][0]["name"], "metrics");
        let pods = of_kind(workload)[0]["spec"]["template"]["metadata"]["labels"].clone();
        assert!(
            matches(&service["spec"]["selector"], &pods),
            "the {component} Service selects its pods"
        );
        let ports = &of_kind(workload)[0]["spec"]["template"]["spec"]["containers"][0]["ports"];
        assert!(
            ports
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "metrics"),
            "the {component} pods have a metrics port"
        );
    }
}

/// A pod in `namespace` with `labels` and, on its one container, `limits`.
fn pod(name: &str, namespace: &str, labels: serde_json::Value, limits: serde_json::Value) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "example.com/app:1",
            "resources": {"limits": limits}}]}
    }))
    .unwrap()
}

/// The chart's admission policies, in the API server: the label becomes the policy's extended
/// resource; a policy that does not exist, or that the namespace may not use, is refused with what
/// to change; pods that name no policy are stored as sent.
async fn admission_takes_policies_by_name(admin: &kube::Client) {
    use kube::api::PostParams;
    let create = |p: Pod| {
        let admin = admin.clone();
        async move {
            let ns = p.metadata.namespace.clone().unwrap();
            Api::<Pod>::namespaced(admin, &ns)
                .create(&PostParams::default(), &p)
                .await
        }
    };
    let refusal = |r: Result<Pod, kube::Error>| match r {
        Err(kube::Error::Api(e)) => e.message,
        other => panic!("expected a refusal: {other:?}"),
    };
    gpuslice_testcluster::ensure_namespace(admin, "web")
        .await
        .unwrap();
    let serving = serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "serving", "labels": {"team": "serving"}}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
        .patch(
            "serving",
            &PatchParams::apply("test"),
            &Patch::Apply(&serving),
        )
        .await
        .unwrap();
    // No controller-manager here: the namespaces' default ServiceAccounts by hand.
    for ns in ["web", "serving"] {
        let sa = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "default", "namespace": ns}});
        Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), ns)
            .patch("default", &PatchParams::apply("test"), &Patch::Apply(&sa))
            .await
            .unwrap();
    }
    let label = |policy: &str| serde_json::json!({"gpuslice.io/policy": policy});

    // `llm-inference` admits namespaces labelled team=serving: once the operator has resolved
    // that, a labelled pod there is stored asking for one slice of the policy. (The API server
    // loads new admission policies a moment after they are created, each on its own: a pod
    // stored before the mutating one is in force is deleted and sent again.)
    // (The policy's host CPU and memory come from the operator's parameters, a moment later.)
    let asks = |p: &Pod| {
        p.spec.as_ref().is_some_and(|s| {
            let resources = s.containers[0].resources.as_ref();
            resources
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.contains_key("gpuslice.io/llm-inference"))
                && resources
                    .and_then(|r| r.requests.as_ref())
                    .is_some_and(|r| r.contains_key("cpu"))
        })
    };
    // The validating policy in force first: an unknown policy is refused.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match create(pod("probe", "web", label("nope"), serde_json::json!({}))).await {
            Err(_) => break,
            Ok(_) => {
                Api::<Pod>::namespaced(admin.clone(), "web")
                    .delete("probe", &kube::api::DeleteParams::default().grace_period(0))
                    .await
                    .unwrap();
                assert!(
                    Instant::now() < deadline,
                    "the validating policy never took effect"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let stored = loop {
        match create(pod(
            "llm-0",
            "serving",
            label("llm-inference"),
            serde_json::json!({}),
        ))
        .await
        {
            Ok(p) if asks(&p) => break p,
            Ok(_) => {
                Api::<Pod>::namespaced(admin.clone(), "serving")
                    .delete("llm-0", &kube::api::DeleteParams::default().grace_period(0))
                    .await
                    .unwrap();
                assert!(Instant::now() < deadline, "the label never became a limit");
            }
            Err(e) => assert!(Instant::now() < deadline, "never admitted: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let resources = stored.spec.unwrap().containers[0]
        .resources
        .clone()
        .unwrap();
    for asked in [
        resources.limits.clone().unwrap(),
        resources.requests.clone().unwrap(),
    ] {
        assert_eq!(
            asked.get("gpuslice.io/llm-inference").map(|q| q.0.as_str()),
            Some("1")
        );
    }
    // The policy's `host` became the container's requests.
    let requests = resources.requests.clone().unwrap();
    assert_eq!(requests.get("cpu").map(|q| q.0.as_str()), Some("4"));
    assert_eq!(requests.get("memory").map(|q| q.0.as_str()), Some("32Gi"));
    // A policy without `host` adds no CPU or memory.
    let notebook = create(pod("nb-0", "web", label("notebook"), serde_json::json!({})))
        .await
        .unwrap();
    let requests = notebook.spec.unwrap().containers[0]
        .resources
        .clone()
        .and_then(|r| r.requests)
        .unwrap_or_default();
    assert!(
        requests.contains_key("gpuslice.io/notebook")
            && !requests.contains_key("cpu")
            && !requests.contains_key("memory"),
        "{requests:?}"
    );

    // (pod, namespace, labels, limits, what the refusal says)
    let refusals = [
        (
            "llm-1",
            "web",
            label("llm-inference"),
            serde_json::json!({}),
            &[
                r#"namespace "web" may not use GpuSlicePolicy "llm-inference""#,
                "namespaceSelector",
            ][..],
        ),
        (
            "nope-0",
            "serving",
            label("nope"),
            serde_json::json!({}),
            &[r#"GpuSlicePolicy "nope" (label gpuslice.io/policy) does not exist"#],
        ),
        (
            "nope-1",
            "serving",
            serde_json::json!({}),
            serde_json::json!({"gpuslice.io/nope": "1"}),
            &["gpuslice.io/nope: no such GpuSlicePolicy"],
        ),
        (
            "llm-2",
            "web",
            serde_json::json!({}),
            serde_json::json!({"gpuslice.io/llm-inference": "1"}),
            &[r#"namespace "web" may not use gpuslice.io/llm-inference"#],
        ),
    ];
    for (name, ns, labels, limits, says) in refusals {
        let message = refusal(create(pod(name, ns, labels, limits)).await);
        assert!(says.iter().all(|s| message.contains(s)), "{message}");
    }

    // A pod that names no policy is stored exactly as sent.
    let plain = pod(
        "plain",
        "web",
        serde_json::json!({"app": "web"}),
        serde_json::json!({"cpu": "1"}),
    );
    let stored = create(plain.clone()).await.unwrap();
    // (The API server itself defaults requests to the limits.)
    let got = stored.spec.as_ref().unwrap().containers[0]
        .resources
        .clone()
        .unwrap();
    let sent = plain.spec.as_ref().unwrap().containers[0]
        .resources
        .clone()
        .unwrap();
    assert_eq!(got.limits, sent.limits);
    assert_eq!(got.requests, sent.limits);
    assert_eq!(stored.metadata.labels, plain.metadata.labels);
}

/// A pool with `requireNonRoot`: a pod naming one of its policies runs no container as root,
/// ephemeral ones added later included; a pod of another pool's policy is not asked.
async fn admission_keeps_root_off_a_non_root_pool(admin: &kube::Client) {
    gpuslice_testcluster::apply_all(
        admin,
        &gpuslice_testcluster::documents(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: tenants}\nspec:\n  nodeSelector: {matchLabels: {pool: tenants}}\n  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}\n  requireNonRoot: true\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: sandbox}\nspec: {pool: tenants, memory: 8Gi}\n",
        ),
    )
    .await;
    let sandbox = |name: &str, pod_security: serde_json::Value, init: Option<serde_json::Value>| {
        let mut p = pod(
            name,
            "web",
            serde_json::json!({"gpuslice.io/policy": "sandbox"}),
            serde_json::json!({}),
        );
        let spec = p.spec.as_mut().unwrap();
        spec.security_context = serde_json::from_value(pod_security).unwrap();
        if let Some(init) = init {
            spec.init_containers = Some(vec![serde_json::from_value(init).unwrap()]);
        }
        p
    };
    let pods = Api::<Pod>::namespaced(admin.clone(), "web");
    // The operator writes which policies are the pool's into the admission parameters.
    assert_forbidden(
        eventually("the non-root rule is in force for policy sandbox", || {
            let pods = pods.clone();
            let root = sandbox("root-0", serde_json::json!(null), None);
            async move {
                policy_refusal(pods.create(&dry_post(), &root).await).and_then(|(code, m)| {
                    m.contains("requires non-root")
                        .then_some((code, m.clone()))
                        .ok_or(m)
                })
            }
        })
        .await,
        &[
            "requires non-root workloads (GpuPool spec.requireNonRoot)",
            "set securityContext.runAsNonRoot: true in the pod, or in spec.containers[main]",
        ],
    );
    // An init container that says it may run as root, whatever the pod says.
    let setup = serde_json::json!({"name": "setup", "image": "example.com/app:1",
        "securityContext": {"runAsNonRoot": false}});
    let (code, message) = policy_refusal(
        pods.create(
            &dry_post(),
            &sandbox(
                "root-1",
                serde_json::json!({"runAsNonRoot": true}),
                Some(setup),
            ),
        )
        .await,
    )
    .unwrap();
    assert_eq!(code, 403);
    assert!(
        message.contains("spec.initContainers[setup]")
            && !message.contains("spec.containers[main]"),
        "{message}"
    );
    // Non-root from the pod's securityContext: stored.
    pods.create(
        &PostParams::default(),
        &sandbox(
            "user-0",
            serde_json::json!({"runAsNonRoot": true, "runAsUser": 1000}),
            None,
        ),
    )
    .await
    .unwrap();
    // A debugging container added as root later is refused; one that inherits non-root is not.
    let debug = |security: serde_json::Value| {
        Patch::Strategic(serde_json::json!({"spec": {"ephemeralContainers": [
            {"name": "debug", "image": "example.com/debug:1", "securityContext": security}]}}))
    };
    let dry = PatchParams::default().dry_run();
    let (code, message) = policy_refusal(
        pods.patch_ephemeral_containers(
            "user-0",
            &dry,
            &debug(serde_json::json!({"runAsNonRoot": false})),
        )
        .await,
    )
    .unwrap();
    assert_eq!(code, 403);
    assert!(
        message.contains("spec.ephemeralContainers[debug]"),
        "{message}"
    );
    pods.patch_ephemeral_containers("user-0", &dry, &debug(serde_json::json!({})))
        .await
        .unwrap();
}

/// A policy whose CheckpointPolicy has `storage`: every pod naming it (by label or by resource)
/// gets the claim as volume `gpuslice-checkpoints`, mounted at the storage's path in each
/// container and told as GPUSLICE_CHECKPOINT_DIR; a tenant cannot swap the volume, move the path
/// or keep its own mount there. A policy whose CheckpointPolicy has none gets nothing.
async fn admission_mounts_checkpoint_storage(admin: &kube::Client) {
    gpuslice_testcluster::apply_all(
        admin,
        &gpuslice_testcluster::documents(
            "apiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {name: kept}\nspec:\n  gracePeriod: 1m\n  storage: {persistentVolumeClaim: ckpt, mountPath: /ckpt}\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: trainer}\nspec: {pool: h200-mig, memory: 8Gi, checkpointPolicy: kept}\n",
        ),
    )
    .await;
    let pods = Api::<Pod>::namespaced(admin.clone(), "web");
    let trainer = |name: &str, extra: serde_json::Value| -> Pod {
        let mut p = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "web", "labels": {"gpuslice.io/policy": "trainer"}},
            "spec": {"containers": [
                {"name": "main", "image": "example.com/app:1"},
                {"name": "sidecar", "image": "example.com/log:1"}]}
        });
        json_merge(&mut p, extra);
        serde_json::from_value(p).unwrap()
    };
    // The pod's volumes, and each container's mounts and variables, less the API server's own
    // (the service account token).
    let storage_of = |p: &Pod| -> (Vec<String>, Vec<Vec<String>>) {
        let spec = p.spec.as_ref().unwrap();
        let token = |name: &str| name.starts_with("kube-api-access-");
        let volumes = spec
            .volumes
            .iter()
            .flatten()
            .filter(|v| !token(&v.name))
            .map(|v| {
                let source = match (&v.persistent_volume_claim, &v.empty_dir) {
                    (Some(c), _) => format!("claim {}", c.claim_name),
                    (_, Some(_)) => "emptyDir".to_string(),
                    _ => "other".to_string(),
                };
                format!("{}: {source}", v.name)
            })
            .collect();
        let containers =
            spec.containers
                .iter()
                .map(|c| {
                    let mounts = c.volume_mounts.iter().flatten().filter(|m| !token(&m.name));
                    let env = c.env.iter().flatten();
                    mounts
                        .map(|m| format!("{} at {}", m.name, m.mount_path))
                        .chain(env.map(|e| {
                            format!("{}={}", e.name, e.value.as_deref().unwrap_or_default())
                        }))
                        .collect()
                })
                .collect();
        (volumes, containers)
    };
    let ours = vec![
        "gpuslice-checkpoints at /ckpt".to_string(),
        format!("{}=/ckpt", gpuslice_contract::env::CHECKPOINT_DIR),
    ];
    // The operator writes the claim and the path into the admission parameters.
    let stored = eventually(
        "the checkpoint storage is mounted for policy trainer",
        || {
            let pods = pods.clone();
            let p = trainer("trainer-0", serde_json::json!({}));
            async move {
                let stored = pods
                    .create(&dry_post(), &p)
                    .await
                    .map_err(|e| e.to_string())?;
                let got = storage_of(&stored);
                (!got.0.is_empty())
                    .then_some(got)
                    .ok_or("not mounted".to_string())
            }
        },
    )
    .await;
    assert_eq!(
        stored,
        (
            vec!["gpuslice-checkpoints: claim ckpt".to_string()],
            vec![ours.clone(), ours.clone()]
        )
    );
    // By the policy's resource instead of the label: the same.
    let by_resource = pod(
        "trainer-1",
        "web",
        serde_json::json!({}),
        serde_json::json!({"gpuslice.io/trainer": "1"}),
    );
    let stored = pods.create(&dry_post(), &by_resource).await.unwrap();
    assert_eq!(
        storage_of(&stored),
        (
            vec!["gpuslice-checkpoints: claim ckpt".to_string()],
            vec![ours.clone()]
        )
    );
    // A tenant's own variable and its own mount at the path give way to the policy's.
    let moved = trainer(
        "trainer-2",
        serde_json::json!({"spec": {
            "containers": [{"name": "main", "image": "example.com/app:1",
                "env": [{"name": "GPUSLICE_CHECKPOINT_DIR", "value": "/etc"}],
                "volumeMounts": [{"name": "scratch", "mountPath": "/ckpt"}]}],
            "volumes": [{"name": "scratch", "emptyDir": {}}]}}),
    );
    let stored = pods.create(&dry_post(), &moved).await.unwrap();
    let (volumes, containers) = storage_of(&stored);
    assert!(
        volumes.contains(&"gpuslice-checkpoints: claim ckpt".to_string()),
        "{volumes:?}"
    );
    assert_eq!(containers[0], ours, "{containers:?}");
    // A volume of that name of its own (another source) is refused.
    let swapped = trainer(
        "trainer-3",
        serde_json::json!({"spec": {"volumes": [{"name": "gpuslice-checkpoints", "emptyDir": {}}]}}),
    );
    match pods.create(&dry_post(), &swapped).await {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("gpuslice-checkpoints") && e.message.contains("volume type"),
            "{}",
            e.message
        ),
        other => panic!("a swapped checkpoint volume was stored: {other:?}"),
    }
    // `notebook` names no CheckpointPolicy with storage: nothing is added.
    let notebook = pods
        .create(
            &dry_post(),
            &pod(
                "nb-1",
                "web",
                serde_json::json!({"gpuslice.io/policy": "notebook"}),
                serde_json::json!({}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(storage_of(&notebook), (vec![], vec![vec![]]));
}

/// A policy's `count` (issue #37): a labelled pod asks for that many slices; a policy with a
/// `topology` gives it a claim from its ResourceClaimTemplate instead (the extended resource's
/// claim cannot carry the NVLink constraint); a pod that asks by resource for more than the
/// count, in any container, is refused with the field, and asking for the count is admitted.
async fn admission_gives_a_pod_its_count(admin: &kube::Client) {
    let policies = "
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: mig-trio}
spec: {pool: h200-mig, memory: 10Gi, count: 3}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: nv-pair}
spec: {pool: h200-mig, memory: 10Gi, count: 2, topology: nvlink}
";
    gpuslice_testcluster::apply_all(admin, &gpuslice_testcluster::documents(policies)).await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "web");
    let label = |policy: &str| serde_json::json!({"gpuslice.io/policy": policy});
    // Once the operator has written the counts and the API server has read them.
    let stored = eventually("a labelled pod asks for the policy's count", || {
        let pods = pods.clone();
        async move {
            let p = pods
                .create(
                    &dry_post(),
                    &pod("trio-0", "web", label("mig-trio"), serde_json::json!({})),
                )
                .await
                .map_err(|e| e.to_string())?;
            let asked = p.spec.as_ref().and_then(|s| {
                let r = s.containers[0].resources.as_ref()?;
                Some((
                    r.limits.as_ref()?.get("gpuslice.io/mig-trio")?.0.clone(),
                    r.requests.as_ref()?.get("gpuslice.io/mig-trio")?.0.clone(),
                ))
            });
            (asked == Some(("3".into(), "3".into())))
                .then_some(())
                .ok_or(format!("{asked:?}"))
        }
    });
    stored.await;
    let paired = eventually(
        "a topology policy's pod gets a claim from its template",
        || {
            let pods = pods.clone();
            async move {
                let p = pods
                    .create(
                        &dry_post(),
                        &pod("pair-0", "web", label("nv-pair"), serde_json::json!({})),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                let spec = p.spec.clone().unwrap_or_default();
                let claims = spec.resource_claims.clone().unwrap_or_default();
                (claims.len() == 1)
                    .then_some(spec)
                    .ok_or(format!("{claims:?}"))
            }
        },
    )
    .await;
    let claim = &paired.resource_claims.as_ref().unwrap()[0];
    assert_eq!(
        (
            claim.name.as_str(),
            claim.resource_claim_template_name.as_deref()
        ),
        ("gpuslice", Some("nv-pair.gpuslice.io"))
    );
    let resources = paired.containers[0].resources.clone().unwrap_or_default();
    assert_eq!(
        resources
            .claims
            .unwrap_or_default()
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        ["gpuslice"]
    );
    assert!(
        resources
            .limits
            .unwrap_or_default()
            .keys()
            .all(|k| !k.starts_with("gpuslice.io/")),
        "no extended resource beside the claim"
    );

    // Hostile: more than the count by resource, in a container or an init container.
    let over = |name: &str, limits: serde_json::Value, init: bool| {
        let mut p = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "web"},
            "spec": {"containers": [{"name": "main", "image": "example.com/app:1"}]}
        });
        let container = serde_json::json!({"name": "setup", "image": "example.com/app:1",
            "resources": {"limits": limits}});
        if init {
            p["spec"]["initContainers"] = serde_json::json!([container]);
        } else {
            p["spec"]["containers"][0]["resources"] = container["resources"].clone();
        }
        serde_json::from_value::<Pod>(p).unwrap()
    };
    for (p, says) in [
        (
            over(
                "over-0",
                serde_json::json!({"gpuslice.io/mig-trio": "4"}),
                false,
            ),
            "gpuslice.io/mig-trio: 4 (spec.containers[main].resources.limits)",
        ),
        (
            over(
                "over-1",
                serde_json::json!({"gpuslice.io/notebook": "2"}),
                true,
            ),
            "gpuslice.io/notebook: 2 (spec.initContainers[setup].resources.limits)",
        ),
    ] {
        let refusal = policy_refusal(pods.create(&dry_post(), &p).await).unwrap();
        assert_forbidden(
            refusal,
            &[
                says,
                "more slices than the GpuSlicePolicy gives a pod (its spec.count)",
            ],
        );
    }
    pods.create(
        &dry_post(),
        &over(
            "at-count",
            serde_json::json!({"gpuslice.io/mig-trio": "3"}),
            false,
        ),
    )
    .await
    .unwrap();
    // Hostile: a topology policy asked for by resource would lose its NVLink constraint.
    let refusal = policy_refusal(
        pods.create(
            &dry_post(),
            &over(
                "by-resource",
                serde_json::json!({"gpuslice.io/nv-pair": "2"}),
                false,
            ),
        )
        .await,
    )
    .unwrap();
    assert_forbidden(
        refusal,
        &[
            "gpuslice.io/nv-pair (spec.containers[main].resources.limits): the GpuSlicePolicy has a topology",
            "name it by the label gpuslice.io/policy instead",
        ],
    );
}

/// Merges `extra` into `base` (objects key by key; anything else replaces).
fn json_merge(base: &mut serde_json::Value, extra: serde_json::Value) {
    match (base, extra) {
        (serde_json::Value::Object(b), serde_json::Value::Object(e)) => {
            for (k, v) in e {
                json_merge(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, e) => *b = e,
    }
}

/// Asserts that `refusal` is a 403 whose message contains every one of `expected`.
fn assert_forbidden((code, message): (u16, String), expected: &[&str]) {
    assert_eq!(code, 403, "{message}");
    assert!(expected.iter().all(|e| message.contains(e)), "{message}");
}

/// The message of a refusal by one of the chart's admission policies, with its HTTP code; an
/// error when the request went through (or failed otherwise), so that [`eventually`] can wait
/// for a policy the API server has not loaded yet.
fn policy_refusal<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> Result<(u16, String), String> {
    match r {
        Err(kube::Error::Api(e)) if e.message.contains("ValidatingAdmissionPolicy") => {
            Ok((e.code, e.message))
        }
        other => Err(format!("not refused by a policy: {other:?}")),
    }
}

/// Requests are sent as dry runs: admission runs in full, nothing is stored.
fn dry_post() -> PostParams {
    PostParams {
        dry_run: true,
        ..Default::default()
    }
}

fn dry_patch(manager: &str) -> PatchParams {
    PatchParams::apply(manager).dry_run()
}

/// Every other route to a GPU goes through admission too (issue #35): init containers and
/// sidecars, ResourceClaims and ResourceClaimTemplates (`exactly` and `firstAvailable`), the
/// visible-devices variables in any container, and the agent's writes to other nodes' GpuNodes and
/// ResourceSlices. Each attack is refused with a message naming the field; the same object
/// without the attack is admitted.
async fn admission_covers_every_route(
    admin: &kube::Client,
    agent: &kube::Client,
    unbound: &kube::Client,
    chart: &[serde_json::Value],
) {
    use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
    let image = "example.com/app:1";
    let pod_of = |spec: serde_json::Value| -> Pod { serde_json::from_value(spec).unwrap() };
    let try_pod = |p: Pod| {
        let admin = admin.clone();
        async move {
            let ns = p.metadata.namespace.clone().unwrap();
            Api::<Pod>::namespaced(admin, &ns)
                .create(&dry_post(), &p)
                .await
        }
    };
    // A refusal by a policy, waiting for the API server to load it.
    async fn refused<T, F, Fut>(what: &str, attempt: F) -> (u16, String)
    where
        T: std::fmt::Debug,
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, kube::Error>>,
    {
        eventually(what, || {
            let fut = attempt();
            async move { policy_refusal(fut.await) }
        })
        .await
    }

    // 1. Init containers and sidecars are containers too.
    let with_init = |name: &str, ns: &str, init: serde_json::Value| {
        pod_of(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"initContainers": [init], "containers": [{"name": "main", "image": image}]}
        }))
    };
    assert_forbidden(
        refused("an init container asking for a forbidden policy", || {
            try_pod(with_init(
                "init-0",
                "web",
                serde_json::json!({"name": "setup", "image": image,
                "resources": {"limits": {"gpuslice.io/llm-inference": "1"}}}),
            ))
        })
        .await,
        &[
            r#"namespace "web" may not use gpuslice.io/llm-inference (spec.initContainers[setup].resources.limits)"#,
            "namespaceSelector",
        ],
    );
    assert_forbidden(
        refused("a sidecar asking for an unknown policy", || {
            try_pod(with_init(
                "sidecar-0",
                "serving",
                serde_json::json!({"name": "proxy", "image": image, "restartPolicy": "Always",
                "resources": {"limits": {"gpuslice.io/nope": "1"}}}),
            ))
        })
        .await,
        &["spec.initContainers[proxy].resources.limits gpuslice.io/nope: no such GpuSlicePolicy"],
    );
    // Where the namespace may use it, the pod is admitted, labelled with the policy it asks for
    // (and marked as asking by resource), and waits in the queue like a labelled pod: gated, at
    // the queued pods' priority.
    let admitted = eventually("a pod asking by resource is gated", || {
        let attempt = try_pod(with_init(
            "init-1",
            "serving",
            serde_json::json!({"name": "setup", "image": image,
                "resources": {"limits": {"gpuslice.io/llm-inference": "1"}}}),
        ));
        async move {
            let pod = attempt.await.map_err(|e| e.to_string())?;
            let spec = pod.spec.clone().unwrap_or_default();
            spec.scheduling_gates
                .iter()
                .flatten()
                .any(|g| g.name == "gpuslice.io/queue")
                .then_some(pod)
                .ok_or_else(|| format!("{spec:?}"))
        }
    })
    .await;
    let labels = admitted.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        (
            labels.get("gpuslice.io/uses-policy").map(String::as_str),
            labels.get("gpuslice.io/policy").map(String::as_str)
        ),
        (Some("true"), Some("llm-inference")),
        "{labels:?}"
    );
    assert_eq!(
        admitted.spec.unwrap().priority_class_name.as_deref(),
        Some("gs-queued")
    );
    // Resources that name two policies (or a label and another policy's resource) are refused:
    // one pod, one policy, one place in the queue.
    assert_forbidden(
        refused("a pod naming two policies", || {
            let mut two = with_init(
                "two-0",
                "serving",
                serde_json::json!({"name": "setup", "image": image,
                "resources": {"limits": {"gpuslice.io/llm-inference": "1"}}}),
            );
            two.spec.as_mut().unwrap().containers[0].resources = serde_json::from_value(
                serde_json::json!({"limits": {"gpuslice.io/notebook": "1"}}),
            )
            .unwrap();
            try_pod(two)
        })
        .await,
        &[
            "names several (spec.containers[main].resources.limits gpuslice.io/notebook, spec.initContainers[setup].resources.limits gpuslice.io/llm-inference)",
        ],
    );
    assert_forbidden(
        refused("a label and another policy's resource", || {
            let mut mixed = with_init(
                "two-1",
                "serving",
                serde_json::json!({"name": "setup", "image": image,
                "resources": {"limits": {"gpuslice.io/llm-inference": "1"}}}),
            );
            mixed.metadata.labels =
                Some([("gpuslice.io/policy".to_string(), "notebook".to_string())].into());
            try_pod(mixed)
        })
        .await,
        &[
            "names several (label gpuslice.io/policy: notebook, ",
            "spec.initContainers[setup].resources.limits gpuslice.io/llm-inference)",
        ],
    );

    // 2. ResourceClaims and ResourceClaimTemplates naming a policy's DeviceClass.
    let request = |class: &str, first_available: bool| {
        if first_available {
            serde_json::json!({"name": "gpu", "firstAvailable": [
                {"name": "other", "deviceClassName": "gpu.example.com"},
                {"name": "slice", "deviceClassName": class}]})
        } else {
            serde_json::json!({"name": "gpu", "exactly": {"deviceClassName": class}})
        }
    };
    let try_claim = |ns: &str, class: &str, first_available: bool| {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "claim-0", "namespace": ns},
            "spec": {"devices": {"requests": [request(class, first_available)]}}
        }))
        .unwrap();
        let api = Api::<ResourceClaim>::namespaced(admin.clone(), ns);
        async move { api.create(&dry_post(), &claim).await }
    };
    let try_template = |ns: &str, class: &str, first_available: bool| {
        let template: ResourceClaimTemplate = serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "template-0", "namespace": ns},
            "spec": {"spec": {"devices": {"requests": [request(class, first_available)]}}}
        }))
        .unwrap();
        let api = Api::<ResourceClaimTemplate>::namespaced(admin.clone(), ns);
        async move { api.create(&dry_post(), &template).await }
    };
    // (a template?, namespace, class, in firstAvailable?, what the refusal says)
    let refusals = [
        (
            true,
            "web",
            "llm-inference.gpuslice.io",
            false,
            r#"namespace "web" may not use GpuSlicePolicy "llm-inference" (spec.spec.devices.requests[gpu].exactly.deviceClassName llm-inference.gpuslice.io)"#,
        ),
        (
            true,
            "serving",
            "nope.gpuslice.io",
            true,
            r#"spec.spec.devices.requests[gpu].firstAvailable[slice].deviceClassName nope.gpuslice.io (GpuSlicePolicy "nope"): no such GpuSlicePolicy"#,
        ),
        (
            false,
            "web",
            "llm-inference.gpuslice.io",
            true,
            r#"namespace "web" may not use GpuSlicePolicy "llm-inference" (spec.devices.requests[gpu].firstAvailable[slice].deviceClassName llm-inference.gpuslice.io)"#,
        ),
        (
            false,
            "serving",
            "nope.gpuslice.io",
            false,
            r#"spec.devices.requests[gpu].exactly.deviceClassName nope.gpuslice.io (GpuSlicePolicy "nope"): no such GpuSlicePolicy"#,
        ),
    ];
    for (template, ns, class, first_available, says) in refusals {
        let kind = if template {
            "ResourceClaimTemplate"
        } else {
            "ResourceClaim"
        };
        let attempt = || async move {
            if template {
                try_template(ns, class, first_available).await.map(|_| ())
            } else {
                try_claim(ns, class, first_available).await.map(|_| ())
            }
        };
        assert_forbidden(
            refused(&format!("a {kind} of {class} in {ns}"), attempt).await,
            &[says],
        );
    }
    // Policies the namespace may use, and other drivers' classes, are admitted.
    try_template("serving", "llm-inference.gpuslice.io", false)
        .await
        .unwrap();
    try_claim("serving", "llm-inference.gpuslice.io", true)
        .await
        .unwrap();
    // Ours carry the label the claim binding selects by (admission's, not the tenant's); other
    // drivers' claims are left as sent.
    let uses_policy = |claim: &ResourceClaim| {
        claim
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("gpuslice.io/uses-policy").cloned())
    };
    let ours = try_claim("web", "notebook.gpuslice.io", false)
        .await
        .unwrap();
    assert_eq!(uses_policy(&ours).as_deref(), Some("true"));
    let theirs = try_claim("web", "gpu.example.com", false).await.unwrap();
    assert_eq!(uses_policy(&theirs), None);

    // 3. The visible-devices variables: never in a pod that names a policy, and
    // NVIDIA_VISIBLE_DEVICES in no other pod either (admission.denyVisibleDevicesEnv).
    let with_env = |name: &str, ns: &str, labels: serde_json::Value, env: serde_json::Value| {
        pod_of(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"containers": [{"name": "main", "image": image, "env": env}]}
        }))
    };
    let all_gpus = serde_json::json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let llm = serde_json::json!({"gpuslice.io/policy": "llm-inference"});
    assert_forbidden(
        refused("a pod of a policy setting NVIDIA_VISIBLE_DEVICES", || {
            try_pod(with_env("env-0", "serving", llm.clone(), all_gpus.clone()))
        })
        .await,
        &[
            r#"the pod uses GpuSlicePolicy "llm-inference" (label gpuslice.io/policy)"#,
            "remove spec.containers[main].env NVIDIA_VISIBLE_DEVICES",
        ],
    );
    try_pod(with_env(
        "env-0",
        "serving",
        llm.clone(),
        serde_json::json!([{"name": "TZ", "value": "UTC"}]),
    ))
    .await
    .unwrap();
    // By resource, in an init container, from a valueFrom.
    let mut by_resource = with_init(
        "env-1",
        "web",
        serde_json::json!({"name": "setup", "image": image, "env": [{"name": "CUDA_VISIBLE_DEVICES",
            "valueFrom": {"configMapKeyRef": {"name": "gpus", "key": "visible"}}}]}),
    );
    by_resource.spec.as_mut().unwrap().containers[0].resources =
        serde_json::from_value(serde_json::json!({"limits": {"gpuslice.io/notebook": "1"}}))
            .unwrap();
    assert_forbidden(
        policy_refusal(try_pod(by_resource).await).unwrap(),
        &[
            "the pod asks for gpuslice.io/notebook",
            "remove spec.initContainers[setup].env CUDA_VISIBLE_DEVICES",
        ],
    );
    // A pod that names no policy may not set NVIDIA_VISIBLE_DEVICES either; CUDA_VISIBLE_DEVICES
    // is its own business.
    assert_forbidden(
        policy_refusal(
            try_pod(with_env(
                "env-2",
                "web",
                serde_json::json!({"app": "web"}),
                serde_json::json!([{"name": "NVIDIA_VISIBLE_DEVICES",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
            ))
            .await,
        )
        .unwrap(),
        &[
            "spec.containers[main].env NVIDIA_VISIBLE_DEVICES: with the NVIDIA container runtime",
            "admission.denyVisibleDevicesEnv",
        ],
    );
    try_pod(with_env(
        "env-2",
        "web",
        serde_json::json!({"app": "web"}),
        serde_json::json!([{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]),
    ))
    .await
    .unwrap();
    // Ephemeral containers, added to stored pods.
    let debug = |env: serde_json::Value| {
        Patch::Strategic(serde_json::json!({"spec": {"ephemeralContainers": [
            {"name": "debug", "image": image, "env": env}]}}))
    };
    let dry = PatchParams::default().dry_run();
    let serving = Api::<Pod>::namespaced(admin.clone(), "serving");
    let web = Api::<Pod>::namespaced(admin.clone(), "web");
    assert_forbidden(
        policy_refusal(
            serving
                .patch_ephemeral_containers(
                    "llm-0",
                    &dry,
                    &debug(serde_json::json!([{"name": "CUDA_VISIBLE_DEVICES", "value": "1"}])),
                )
                .await,
        )
        .unwrap(),
        &["remove spec.ephemeralContainers[debug].env CUDA_VISIBLE_DEVICES"],
    );
    assert_forbidden(
        policy_refusal(
            web.patch_ephemeral_containers("plain", &dry, &debug(all_gpus.clone()))
                .await,
        )
        .unwrap(),
        &["spec.ephemeralContainers[debug].env NVIDIA_VISIBLE_DEVICES"],
    );
    serving
        .patch_ephemeral_containers("llm-0", &dry, &debug(serde_json::json!([])))
        .await
        .unwrap();
    // The chart's own pods are admitted: the agent sets NVIDIA_VISIBLE_DEVICES=all (it manages
    // every GPU of its node).
    for (kind, name) in [("DaemonSet", "gs-agent"), ("Deployment", "gs-operator")] {
        let workload = chart
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap();
        let template = &workload["spec"]["template"];
        let own = pod_of(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{name}-own"), "namespace": NAMESPACE,
                "labels": template["metadata"]["labels"]},
            "spec": template["spec"]
        }));
        try_pod(own)
            .await
            .unwrap_or_else(|e| panic!("the chart's {kind} {name} is refused: {e}"));
    }

    // 4. The agent writes only its own node's GpuNode (gpu-0): not gpu-1's, status or spec, and
    // not its own spec.
    let gpu_nodes = Api::<gpuslice_api::GpuNode>::all(admin.clone());
    let gpu_1 = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": "gpu-1"}, "spec": {}});
    gpu_nodes
        .patch("gpu-1", &PatchParams::apply("test"), &Patch::Apply(&gpu_1))
        .await
        .unwrap();
    let as_agent = Api::<gpuslice_api::GpuNode>::all(agent.clone());
    let no_op = Patch::Merge(serde_json::json!({"status": {}}));
    let merge = PatchParams::default().dry_run();
    assert_forbidden(
        refused("the agent of gpu-0 writing gpu-1's status", || {
            as_agent.patch_status("gpu-1", &merge, &no_op)
        })
        .await,
        &["the gpuslice agent on node gpu-0 may not write GpuNode gpu-1"],
    );
    // Nor create another node's, as it creates its own (server-side apply, an empty spec).
    let gpu_2 = serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": "gpu-2"}, "spec": {}});
    assert_forbidden(
        policy_refusal(
            as_agent
                .patch("gpu-2", &dry_patch("gpuslice-agent"), &Patch::Apply(&gpu_2))
                .await,
        )
        .unwrap(),
        &["may not write GpuNode gpu-2"],
    );
    as_agent
        .patch_status("gpu-0", &merge, &no_op)
        .await
        .unwrap();
    as_agent
        .patch(
            "gpu-0",
            &merge,
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {"example.com/seen": "yes"}}}),
            ),
        )
        .await
        .unwrap();
    assert_forbidden(
        policy_refusal(
            as_agent
                .patch(
                    "gpu-0",
                    &merge,
                    &Patch::Merge(serde_json::json!({"spec": {"sourceRevision": "mine"}})),
                )
                .await,
        )
        .unwrap(),
        &["may not write the spec of GpuNode gpu-0"],
    );
    assert_forbidden(
        policy_refusal(
            Api::<gpuslice_api::GpuNode>::all(unbound.clone())
                .patch_status("gpu-0", &merge, &no_op)
                .await,
        )
        .unwrap(),
        &["GpuNodes only with a token bound to its pod on a node"],
    );

    // 5. ResourceSlices: its own node's, of driver gpuslice.io, in its node's pool only.
    let slice = |name: &str, driver: &str, node: &str, pool: &str| -> ResourceSlice {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1}, "devices": []}
        }))
        .unwrap()
    };
    let agent_slices = Api::<ResourceSlice>::all(agent.clone());
    // Another driver's slice; a slice of our driver for another pool.
    for (refused, says) in [
        (
            slice("gpu-0-other-0", "gpu.example.com", "gpu-0", "gpu-0"),
            "of driver gpu.example.com",
        ),
        (
            slice("gpu-0-gpuslice.io-8", "gpuslice.io", "gpu-0", "gpu-1"),
            "pool gpu-1",
        ),
    ] {
        let created = agent_slices.create(&dry_post(), &refused).await;
        assert_forbidden(policy_refusal(created).unwrap(), &[says]);
    }
    // It updates its own (RBAC's update verb), as its Publisher does.
    eventually("the agent updates its own ResourceSlice", || {
        let (admin, agent_slices) = (admin.clone(), agent_slices.clone());
        async move {
            let own = Api::<ResourceSlice>::all(admin)
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .find(|s| s.spec.node_name.as_deref() == Some("gpu-0"))
                .ok_or("no ResourceSlice of gpu-0")?;
            agent_slices
                .replace(own.metadata.name.as_deref().unwrap(), &dry_post(), &own)
                .await
                .map_err(|e| e.to_string())
        }
    })
    .await;

    // 6. Without the parameters (the ConfigMap deleted), pods that name a policy are refused,
    // as it cannot be checked; pods that name none are not even looked at.
    Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(admin.clone(), NAMESPACE)
        .delete("gs-policies", &Default::default())
        .await
        .unwrap();
    let (_, message) = refused("a labelled pod without parameters", || {
        try_pod(pod(
            "params-0",
            "serving",
            serde_json::json!({"gpuslice.io/policy": "llm-inference"}),
            serde_json::json!({}),
        ))
    })
    .await;
    assert!(message.contains("no params found"), "{message}");
    let (_, message) = policy_refusal(
        try_pod(pod(
            "params-1",
            "serving",
            serde_json::json!({}),
            serde_json::json!({"gpuslice.io/llm-inference": "1"}),
        ))
        .await,
    )
    .unwrap();
    assert!(message.contains("no params found"), "{message}");
    try_pod(pod(
        "params-2",
        "web",
        serde_json::json!({"app": "web"}),
        serde_json::json!({"cpu": "1"}),
    ))
    .await
    .unwrap();
    // The same for claims: one naming a policy's class is refused, another driver's is not.
    let claim = |name: &str, class: &str| -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "serving"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}}
        }))
        .unwrap()
    };
    let claims = Api::<ResourceClaim>::namespaced(admin.clone(), "serving");
    let (_, message) = policy_refusal(
        claims
            .create(&dry_post(), &claim("params-3", "llm-inference.gpuslice.io"))
            .await,
    )
    .unwrap();
    assert!(message.contains("no params found"), "{message}");
    claims
        .create(&dry_post(), &claim("params-4", "gpu.example.com"))
        .await
        .unwrap();
}
