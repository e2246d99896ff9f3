//! Tests against a real Kubernetes control plane (etcd, kube-apiserver, controller-manager,
//! scheduler, kwok) built from upstream Go modules by `tests/controlplane/build.sh`.
//!
//! Each test starts its own control plane (a few seconds) so it can restart or inspect it alone.
//! Without the binaries the tests are skipped loudly, unless `CI` is set.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuslice_testcluster::repo_root as root;
use gpuslice_testcluster::{Components, ControlPlane};
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::discovery::{ApiResource, Discovery};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::Value;

async fn start(components: Components) -> Option<ControlPlane> {
    ControlPlane::start(components)
        .await
        .expect("the control plane starts")
}

async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<String>>,
{
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < timeout {
        match check().await {
            None => return,
            Some(state) => last = state,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{what} did not happen within {timeout:?}; last seen: {last}");
}

/// Applies the CRDs in `crds/` and waits until each is Established.
async fn install_crds(client: &Client) {
    gpuslice_testcluster::install_crds(client, &root().join("crds"))
        .await
        .expect("the CRDs install");
}

fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(yaml_files(&path));
        } else if path.extension().is_some_and(|e| e == "yaml") {
            out.push(path);
        }
    }
    out.sort();
    out
}

async fn ensure_namespace(client: &Client, name: &str) {
    gpuslice_testcluster::ensure_namespace(client, name)
        .await
        .unwrap();
}

/// Server-side apply of one document with strict field validation, dry-run or for real.
async fn apply(
    client: &Client,
    discovery: &Discovery,
    doc: &Value,
    dry_run: bool,
) -> Option<Result<(), kube::Error>> {
    gpuslice_testcluster::apply_document(client, discovery, doc, dry_run).await
}

#[tokio::test]
async fn crds_are_established_and_every_example_is_accepted() {
    let Some(cp) = start(Components::default()).await else {
        return;
    };
    let client = cp.client().await.unwrap();
    install_crds(&client).await;
    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    let mut applied = 0;
    for file in yaml_files(&root().join("examples/gitops")) {
        for doc in yaml_documents(&file) {
            // Our objects are created for real; workloads with a server-side dry run.
            let ours = doc["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with("gpuslice.io/"));
            match apply(&client, &discovery, &doc, !ours).await {
                Some(result) => {
                    result.unwrap_or_else(|e| {
                        panic!(
                            "{}: {} rejected: {e}",
                            file.display(),
                            doc["metadata"]["name"]
                        )
                    });
                    applied += 1;
                }
                // The Argo CD Application: its CRD belongs to Argo CD, not to this cluster.
                None => assert_eq!(
                    doc["kind"],
                    "Application",
                    "{}: unknown kind",
                    file.display()
                ),
            }
        }
    }
    assert_eq!(
        applied, 14,
        "10 gpuslice objects, 2 namespaces and 2 workloads"
    );
    let pools: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::erase::<gpuslice_api::GpuPool>(&()),
    );
    let pool = pools.get("shared-a100").await.unwrap();
    // Defaults from the schema are applied by the server.
    assert_eq!(
        pool.data["spec"]["windows"][0]["days"]
            .as_array()
            .map(Vec::len),
        Some(7)
    );
}

/// `# expect:` and `# server:` lines of a corpus file.
fn corpus_expectations(text: &str) -> (Vec<String>, Option<String>) {
    let paths = text
        .lines()
        .filter_map(|l| l.strip_prefix("# expect:"))
        .map(|l| l.split('|').next().unwrap().trim().to_string())
        .collect();
    let server = text
        .lines()
        .find_map(|l| l.strip_prefix("# server:"))
        .map(|l| l.trim().to_string());
    (paths, server)
}

#[tokio::test]
async fn the_server_rejects_the_corpus_like_validate_does() {
    let Some(cp) = start(Components::default()).await else {
        return;
    };
    let client = cp.client().await.unwrap();
    install_crds(&client).await;
    let discovery = Discovery::new(client.clone()).run().await.unwrap();
    let corpus = yaml_files(&root().join("tests/corpus/invalid"));
    let mut rejected = 0;
    for file in &corpus {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(file).unwrap();
        let (paths, server) = corpus_expectations(&text);
        let server = server.unwrap_or_else(|| panic!("{name} has no `# server:` line"));
        if server.starts_with("not sent") {
            continue;
        }
        let doc = yaml_documents(file).into_iter().next().unwrap();
        let result = apply(&client, &discovery, &doc, true)
            .await
            .unwrap_or_else(|| panic!("{name}: kind not served"));
        match server.strip_prefix("rejects |") {
            Some(message) => {
                let err = match result {
                    Err(kube::Error::Api(e)) => e,
                    other => panic!("{name}: the server should reject it, got {other:?}"),
                };
                // Server-side apply reports a field missing from the schema as a 500 ("field not
                // declared in schema"); every other rejection is a 422 Invalid.
                let unknown_field =
                    err.code == 500 && err.message.contains("field not declared in schema");
                assert!(err.code == 422 || unknown_field, "{name}: {err:?}");
                assert!(
                    err.message.contains(message.trim()),
                    "{name}: server said {:?}, expected {:?}",
                    err.message,
                    message.trim()
                );
                // The field the user must change appears in the server's answer too.
                let field = paths[0]
                    .trim_start_matches("spec.")
                    .rsplit('.')
                    .next()
                    .unwrap()
                    .split('[')
                    .next()
                    .unwrap();
                assert!(
                    err.message.contains(field),
                    "{name}: server message {:?} does not name {field}",
                    err.message
                );
                rejected += 1;
                // And validate rejects it (the validate corpus test checks the exact path and reason).
                assert!(!paths.is_empty(), "{name}");
            }
            None => {
                assert!(
                    result.is_ok(),
                    "{name}: the server rejected what only validate should find: {result:?}"
                );
            }
        }
    }
    assert!(
        rejected >= 15,
        "{rejected} corpus files rejected by the server"
    );
}

#[tokio::test]
async fn pods_with_gpus_are_scheduled_onto_fake_nodes_that_have_them() {
    let Some(cp) = start(Components::all()).await else {
        return;
    };
    let client = cp.client().await.unwrap();
    cp.create_node(
        "gpu-node-1",
        &[("gpuslice.io/pool", "shared-a100")],
        &[("nvidia.com/gpu", "4")],
    )
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    eventually(
        "the kwok node is Ready without taints",
        Duration::from_secs(60),
        || {
            let nodes = nodes.clone();
            async move {
                let node = nodes.get("gpu-node-1").await.ok()?;
                let ready = node
                    .status
                    .as_ref()?
                    .conditions
                    .as_ref()?
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                let taints = node
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.clone())
                    .unwrap_or_default();
                if ready && taints.is_empty() {
                    None
                } else {
                    Some(format!("ready={ready} taints={taints:?}"))
                }
            }
        },
    )
    .await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    eventually(
        "the default ServiceAccount exists",
        Duration::from_secs(60),
        || {
            let accounts = accounts.clone();
            async move {
                accounts
                    .get_opt("default")
                    .await
                    .ok()
                    .flatten()
                    .map_or(Some("missing".into()), |_| None)
            }
        },
    )
    .await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod = |name: &str, gpus: &str| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "example/train:1",
                "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}
        }))
        .unwrap()
    };
    pods.create(&PostParams::default(), &pod("fits", "2"))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("too-big", "16"))
        .await
        .unwrap();
    eventually(
        "pod fits Running on gpu-node-1",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get("fits").await.ok()?;
                let phase = p
                    .status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_default();
                let node = p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default();
                if phase == "Running" && node == "gpu-node-1" {
                    None
                } else {
                    Some(format!("{phase} on {node:?}"))
                }
            }
        },
    )
    .await;
    eventually(
        "pod too-big Pending as unschedulable",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move {
                let p = pods.get("too-big").await.ok()?;
                let status = p.status.unwrap_or_default();
                let scheduled = status
                    .conditions
                    .unwrap_or_default()
                    .into_iter()
                    .find(|c| c.type_ == "PodScheduled");
                match scheduled {
                    Some(c)
                        if c.status == "False"
                            && c.reason.as_deref() == Some("Unschedulable")
                            && c.message
                                .as_deref()
                                .is_some_and(|m| m.contains("Insufficient nvidia.com/gpu")) =>
                    {
                        assert_eq!(status.phase.as_deref(), Some("Pending"));
                        None
                    }
                    other => Some(format!("{other:?}")),
                }
            }
        },
    )
    .await;
}

#[tokio::test]
async fn service_account_clients_have_only_the_rights_rbac_gives_them() {
    let Some(cp) = start(Components::default()).await else {
        return;
    };
    let admin = cp.client().await.unwrap();
    install_crds(&admin).await;
    ensure_namespace(&admin, "gpuslice-system").await;
    let sa = cp
        .service_account_client("gpuslice-system", "reader")
        .await
        .unwrap();
    let pools: Api<gpuslice_api::GpuPool> = Api::all(sa.clone());
    match pools.list(&Default::default()).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{e:?}"),
        other => panic!("a ServiceAccount without roles must be forbidden, got {other:?}"),
    }
    let rbac = serde_json::json!([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "pool-reader"},
         "rules": [{"apiGroups": ["gpuslice.io"], "resources": ["gpupools"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "pool-reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "pool-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "gpuslice-system"}]}
    ]);
    let discovery = Discovery::new(admin.clone()).run().await.unwrap();
    for doc in rbac.as_array().unwrap() {
        apply(&admin, &discovery, doc, false)
            .await
            .unwrap()
            .unwrap();
    }
    eventually("the role takes effect", Duration::from_secs(20), || {
        let pools = pools.clone();
        async move {
            pools
                .list(&Default::default())
                .await
                .err()
                .map(|e| e.to_string())
        }
    })
    .await;
    // Reading is allowed; writing is not.
    let pool: gpuslice_api::GpuPool = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("examples/gitops/pools/shared-a100.yaml")).unwrap(),
    )
    .unwrap();
    match pools.create(&PostParams::default(), &pool).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403),
        other => panic!("create must be forbidden, got {other:?}"),
    }
}

/// Waits until the watcher reports `want` (`name:slices`).
async fn expect(seen: &mut tokio::sync::mpsc::UnboundedReceiver<String>, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(Some(s)) = tokio::time::timeout(Duration::from_secs(1), seen.recv()).await
            && s == want
        {
            return;
        }
    }
    panic!("the watcher never saw {want}");
}

#[tokio::test]
async fn a_watch_sees_every_change_and_survives_an_apiserver_restart() {
    let Some(mut cp) = start(Components::default()).await else {
        return;
    };
    let admin = cp.client().await.unwrap();
    install_crds(&admin).await;
    let pools: Api<gpuslice_api::GpuPool> = Api::all(admin.clone());
    let template: gpuslice_api::GpuPool = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("examples/gitops/pools/shared-a100.yaml")).unwrap(),
    )
    .unwrap();
    let named = |name: &str| {
        let mut p = template.clone();
        p.metadata.name = Some(name.to_string());
        p
    };

    let (reader, writer) = reflector::store();
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let stream = reflector(
        writer,
        watcher(pools.clone(), watcher::Config::default()).default_backoff(),
    )
    .applied_objects();
    let task = tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let Ok(pool) = event {
                let slices = pool
                    .spec
                    .layout
                    .software
                    .as_ref()
                    .map(|s| s.slices)
                    .unwrap_or_default();
                let _ = seen_tx.send(format!("{}:{slices}", pool.name_any()));
            }
        }
    });
    pools
        .create(&PostParams::default(), &named("alpha"))
        .await
        .unwrap();
    expect(&mut seen_rx, "alpha:4").await;

    cp.restart_apiserver().await.unwrap();
    // Changes made after the restart reach the same watcher.
    let admin = cp.client().await.unwrap();
    let pools: Api<gpuslice_api::GpuPool> = Api::all(admin);
    let mut alpha = pools.get("alpha").await.unwrap();
    alpha.spec.layout = gpuslice_api::Layout::software(2, "40Gi", 50);
    pools
        .replace("alpha", &PostParams::default(), &alpha)
        .await
        .unwrap();
    expect(&mut seen_rx, "alpha:2").await;
    pools
        .create(&PostParams::default(), &named("beta"))
        .await
        .unwrap();
    expect(&mut seen_rx, "beta:4").await;
    pools
        .delete("alpha", &DeleteParams::default())
        .await
        .unwrap();
    let store = reader.clone();
    eventually("the store holds beta only", Duration::from_secs(30), || {
        let store = store.clone();
        async move {
            let mut names: Vec<String> = store.state().iter().map(|p| p.name_any()).collect();
            names.sort();
            if names == ["beta"] {
                None
            } else {
                Some(format!("{names:?}"))
            }
        }
    })
    .await;
    task.abort();
}
