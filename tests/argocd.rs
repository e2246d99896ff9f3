//! gpuslice in Argo CD: the health checks of our kinds (`argocd/health/gpuslice.io/<Kind>`),
//! rendered into `argocd-cm` by the chart, evaluated by Argo CD itself (built by
//! `tests/argocd/build.sh`) on a status fixture for every condition combination the operator and
//! the agent write; and a real Argo CD syncing the example GitOps folder (workloads included) in
//! its sync waves, through a change, a layout the operator refuses, a commit the API server
//! refuses and a revert.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuslice_api::GpuNode;
use gpuslice_testcluster::repo_root as root;
use gpuslice_testcluster::{Components, ControlPlane, KillOnDrop, built_tool, free_port};
use kube::api::{Api, ApiResource, DynamicObject};

const KINDS: [&str; 4] = ["GpuPool", "GpuSlicePolicy", "GpuNode", "CheckpointPolicy"];

/// `helm template` of the chart's argocd-health.yaml, its Argo CD health checks enabled.
fn render_health_checks(helm: &Path) -> std::process::Output {
    Command::new(helm)
        .args(["template", "gpuslice"])
        .arg(root().join("charts/gpuslice"))
        .args([
            "--set",
            "argocd.healthChecks.enabled=true",
            "--show-only",
            "templates/argocd-health.yaml",
        ])
        .output()
        .unwrap()
}

#[derive(serde::Deserialize)]
struct HealthTests {
    tests: Vec<HealthTest>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthTest {
    health_status: Health,
    input_path: String,
}

#[derive(serde::Deserialize, Debug, PartialEq)]
struct Health {
    status: String,
    message: String,
}

#[test]
fn argo_cd_shows_the_health_the_operator_reports_for_each_of_our_kinds() {
    let Some(argocd) = built_tool("GPUSLICE_ARGOCD_DIR", "argocd", "argocd") else {
        return;
    };
    let Some(helm) = built_tool("GPUSLICE_HELM", "helm", "") else {
        return;
    };
    // argocd-cm as a platform team gets it from the chart.
    let rendered = render_health_checks(&helm);
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let cm: serde_yaml::Value = serde_yaml::from_slice(&rendered.stdout).unwrap();
    let data = cm["data"].as_mapping().unwrap();
    assert_eq!(data.len(), KINDS.len(), "{data:?}");
    let dir = tempfile::tempdir().unwrap();
    let cm_path = dir.path().join("argocd-cm.yaml");
    std::fs::write(&cm_path, &rendered.stdout).unwrap();

    let mut failures = Vec::new();
    let mut checked = 0;
    for kind in KINDS {
        let here = root().join("argocd/health/gpuslice.io").join(kind);
        let lua = std::fs::read_to_string(here.join("health.lua")).unwrap();
        assert_eq!(
            data[format!("resource.customizations.health.gpuslice.io_{kind}").as_str()]
                .as_str()
                .map(str::trim_end),
            Some(lua.trim_end()),
            "the chart renders argocd/health/gpuslice.io/{kind}/health.lua as it is"
        );
        let tests: HealthTests =
            serde_yaml::from_str(&std::fs::read_to_string(here.join("health_test.yaml")).unwrap())
                .unwrap();
        let mut fixtures: Vec<String> = std::fs::read_dir(here.join("testdata"))
            .unwrap()
            .map(|e| format!("testdata/{}", e.unwrap().file_name().to_string_lossy()))
            .collect();
        fixtures.sort();
        let mut tested: Vec<String> = tests.tests.iter().map(|t| t.input_path.clone()).collect();
        tested.sort();
        assert_eq!(
            fixtures, tested,
            "{kind}: every fixture has its expected health"
        );
        for t in &tests.tests {
            let out = Command::new(&argocd)
                .args(["admin", "settings", "resource-overrides", "health"])
                .arg(here.join(&t.input_path))
                .arg("--argocd-cm-path")
                .arg(&cm_path)
                .env("HOME", dir.path())
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let field = |name: &str| {
                stdout
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            let got = Health {
                status: field("STATUS:"),
                message: field("MESSAGE:"),
            };
            checked += 1;
            if !out.status.success() || got != t.health_status {
                failures.push(format!(
                    "{kind} {}: expected {:?}, Argo CD says {got:?} (exit {}; {})",
                    t.input_path,
                    t.health_status,
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .last()
                        .unwrap_or_default()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 20, "only {checked} fixtures");
}

/// A process whose output goes to `<dir>/<name>.log` (shown when the test fails).
fn spawn_logged(dir: &Path, name: &str, command: &mut Command) -> KillOnDrop {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    KillOnDrop(
        command
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}")),
    )
}

fn tail_logs(dir: &Path) -> String {
    let mut out = String::new();
    for name in [
        "git-daemon",
        "redis",
        "repo-server",
        "application-controller",
        "operator",
        "agent-h200",
        "agent-a100",
        "agent-h100",
    ] {
        let text = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!("----- {name} -----\n"));
        for l in &lines[lines.len().saturating_sub(25)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on port {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Application's sync status, health status and health message of `kind/name` among its
/// resources, and the last operation's phase and message.
#[derive(Clone, Debug, Default)]
struct AppState {
    sync: String,
    health: String,
    revision: String,
    operation: String,
    operation_revision: String,
    operation_message: String,
    resources: Vec<(String, String, String, String)>,
}

async fn app_state(apps: &Api<DynamicObject>) -> Result<AppState, String> {
    let app = apps
        .get("gpuslice-config")
        .await
        .map_err(|e| e.to_string())?;
    let status = &app.data["status"];
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    Ok(AppState {
        sync: text(&status["sync"]["status"]),
        health: text(&status["health"]["status"]),
        revision: text(&status["sync"]["revision"]),
        operation: text(&status["operationState"]["phase"]),
        operation_revision: text(&status["operationState"]["syncResult"]["revision"]),
        operation_message: text(&status["operationState"]["message"]),
        resources: status["resources"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    text(&r["kind"]),
                    text(&r["name"]),
                    text(&r["health"]["status"]),
                    text(&r["health"]["message"]),
                )
            })
            .collect(),
    })
}

fn head_of(repo: &git2::Repository) -> String {
    repo.head()
        .unwrap()
        .peel_to_commit()
        .unwrap()
        .id()
        .to_string()
}

const CLOCK: &str = "2026-12-02T10:00:00Z";

#[tokio::test]
async fn argo_cd_syncs_the_example_repository_in_waves_and_shows_our_health() {
    let Some(argocd) = built_tool("GPUSLICE_ARGOCD_DIR", "argocd", "") else {
        return;
    };
    let Some(helm) = built_tool("GPUSLICE_HELM", "helm", "") else {
        return;
    };
    let Some(redis) = which("redis-server") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "no redis-server (Debian: apt-get install redis-server)"
        );
        eprintln!("SKIPPED: no redis-server");
        return;
    };
    let Some(cluster) = ControlPlane::start(Components::all()).await.unwrap() else {
        return;
    };
    let client = cluster.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    gpuslice_testcluster::install_crds(&client, &root().join("crds"))
        .await
        .unwrap();
    gpuslice_testcluster::install_crds(&client, &argocd.join("crds"))
        .await
        .unwrap();
    gpuslice_testcluster::ensure_namespace(&client, "argocd")
        .await
        .unwrap();

    // The repository a platform team keeps: a copy of examples/gitops, served by git daemon.
    let served = dir.path().join("git");
    let repo_dir = served.join("gpu-config");
    let repo = git2::Repository::init(&repo_dir).unwrap();
    repo.set_head("refs/heads/main").unwrap();
    gpuslice_testcluster::copy_dir(&root().join("examples/gitops"), &repo_dir.join("gitops"));
    gpuslice_testcluster::commit_all(&repo, "gpu pools");
    let git_port = free_port().unwrap();
    let _git = spawn_logged(
        &logs,
        "git-daemon",
        Command::new("git")
            .args([
                "daemon",
                "--reuseaddr",
                "--export-all",
                "--listen=127.0.0.1",
            ])
            .arg(format!("--port={git_port}"))
            .arg(format!("--base-path={}", served.display()))
            .arg(&served),
    );
    wait_port(git_port);

    // Argo CD: redis, the repo server and the application controller, against the test API
    // server (ARGOCD_FAKE_IN_CLUSTER: the in-cluster destination is the kubeconfig's).
    let redis_port = free_port().unwrap();
    let _redis = spawn_logged(
        &logs,
        "redis",
        Command::new(redis)
            .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .args(["--port", &redis_port.to_string()])
            .arg("--dir")
            .arg(dir.path()),
    );
    wait_port(redis_port);
    let rendered = render_health_checks(&helm);
    assert!(rendered.status.success());
    let mut argocd_cm: serde_json::Value = serde_yaml::from_slice(&rendered.stdout).unwrap();
    // Argo CD's own settings of a test install: our health checks merged in as a platform team
    // would (see the chart's values).
    argocd_cm["data"]["timeout.reconciliation"] = "5s".into();
    let setup: Vec<serde_json::Value> = vec![
        argocd_cm,
        serde_json::json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "argocd-secret", "namespace": "argocd",
                "labels": {"app.kubernetes.io/part-of": "argocd"}},
            "stringData": {"server.secretkey": "gpuslice-test"}}),
        serde_json::json!({"apiVersion": "argoproj.io/v1alpha1", "kind": "AppProject",
            "metadata": {"name": "default", "namespace": "argocd"},
            "spec": {"sourceRepos": ["*"],
                "destinations": [{"server": "*", "namespace": "*"}],
                "clusterResourceWhitelist": [{"group": "*", "kind": "*"}]}}),
    ];
    gpuslice_testcluster::apply_all(&client, &setup).await;
    let repo_port = free_port().unwrap();
    let argocd_env = |c: &mut Command| {
        c.env("KUBECONFIG", cluster.kubeconfig_path())
            .env("ARGOCD_FAKE_IN_CLUSTER", "true")
            .env("ARGOCD_GPG_ENABLED", "false")
            .env("HOME", dir.path())
            .env("TMPDIR", dir.path());
    };
    let mut repo_server = Command::new(argocd.join("argocd-repo-server"));
    argocd_env(&mut repo_server);
    let _repo_server = spawn_logged(
        &logs,
        "repo-server",
        repo_server
            .args(["--disable-tls", "--address", "127.0.0.1"])
            .args(["--port", &repo_port.to_string()])
            .args(["--metrics-port", &free_port().unwrap().to_string()])
            .args(["--redis", &format!("127.0.0.1:{redis_port}")])
            .args(["--revision-cache-expiration", "1s"]),
    );
    wait_port(repo_port);
    let mut controller = Command::new(argocd.join("argocd-application-controller"));
    argocd_env(&mut controller);
    let _controller = spawn_logged(
        &logs,
        "application-controller",
        controller
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig_path())
            .args(["--namespace", "argocd", "--repo-server-plaintext"])
            .args(["--repo-server", &format!("127.0.0.1:{repo_port}")])
            .args(["--redis", &format!("127.0.0.1:{redis_port}")])
            .args(["--metrics-port", &free_port().unwrap().to_string()])
            .args(["--app-resync", "5", "--app-resync-jitter", "0"])
            .args(["--self-heal-timeout-seconds", "1"])
            // Argo CD 3 keeps resource health out of the Application unless asked.
            .arg("--persist-resource-health"),
    );

    // gpuslice: the operator and one agent per kwok node with emulated GPUs.
    let bin = env!("CARGO_BIN_EXE_gpuslice");
    let mut gpuslice = Vec::new();
    let mut operator = Command::new(bin);
    gpuslice_testcluster::ensure_namespace(&client, "gpuslice-system")
        .await
        .unwrap();
    // The operator and the agents run as the chart's identities.
    cluster.install_chart_identities().await.unwrap();
    operator
        .args([
            "operator",
            "--admission-params",
            "gpuslice-system/gs-policies",
            "--lease-namespace",
            gpuslice_testcluster::CHART_NAMESPACE,
        ])
        .env("KUBECONFIG", cluster.operator_kubeconfig().await.unwrap())
        .env("GPUSLICE_CLOCK_START", CLOCK);
    gpuslice.push(spawn_logged(&logs, "operator", &mut operator));
    for (node, pool, model) in [
        ("h200", "h200-mig", "NVIDIA H200"),
        ("a100", "shared-a100", "NVIDIA A100-SXM4-80GB"),
        ("h100", "research-h100", "NVIDIA H100 80GB HBM3"),
    ] {
        cluster
            .create_node(node, &[("gpuslice.io/pool", pool)], &[])
            .await
            .unwrap();
        let node_file = dir.path().join(format!("{node}.yaml"));
        std::fs::write(
            &node_file,
            format!("name: {node}\ngpus:\n- {{index: 0, model: {model}}}\n"),
        )
        .unwrap();
        // The kubelet plugin publishes the node's slices as DRA devices.
        let mut agent = gpuslice_testcluster::agent_command(
            bin,
            "2s",
            &node_file,
            &dir.path().join(format!("state-{node}")),
            &dir.path().join(format!("kubelet-{node}")),
            &dir.path().join(format!("cdi-{node}")),
        );
        agent
            .env("KUBECONFIG", cluster.agent_kubeconfig(node).await.unwrap())
            .env("GPUSLICE_CLOCK_START", CLOCK);
        gpuslice.push(spawn_logged(&logs, &format!("agent-{node}"), &mut agent));
    }

    // The chart's admission policies: a pod labelled with a policy gets its extended resource
    // and the queue's gate, and one naming a policy it may not use is refused.
    let chart = Command::new(&helm)
        .args(["template", "gs", "--namespace", "gpuslice-system"])
        .arg(root().join("charts/gpuslice"))
        .output()
        .unwrap();
    assert!(chart.status.success());
    let admission: Vec<serde_json::Value> = serde_yaml::Deserializer::from_slice(&chart.stdout)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|d: &serde_json::Value| {
            let kind = d["kind"].as_str().unwrap_or_default();
            kind.contains("AdmissionPolicy") || kind == "PriorityClass"
        })
        .collect();
    gpuslice_testcluster::apply_all(&client, &admission).await;

    // The Application, automated, as examples/gitops/argocd/application.yaml declares it, with
    // the served repository.
    let mut application: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("examples/gitops/argocd/application.yaml")).unwrap(),
    )
    .unwrap();
    application["spec"]["source"]["repoURL"] =
        format!("git://127.0.0.1:{git_port}/gpu-config").into();
    application["spec"]["source"]["path"] = "gitops".into();
    let applications = ApiResource {
        group: "argoproj.io".into(),
        version: "v1alpha1".into(),
        api_version: "argoproj.io/v1alpha1".into(),
        kind: "Application".into(),
        plural: "applications".into(),
    };
    let apps: Api<DynamicObject> = Api::namespaced_with(client.clone(), "argocd", &applications);
    let started = Instant::now();
    gpuslice_testcluster::apply_all(&client, &[application]).await;
    let first = head_of(&repo);
    let state = app_until(&apps, &logs, 240, "the first sync turning Healthy", |s| {
        healthy_at(s, &first)
    })
    .await;
    let first_sync = started.elapsed();
    // Waves: the policies (wave 3) were applied once the pools (wave 2) were Healthy, that is,
    // once the agents had cut the GPUs; every object of the folder synced on the first try.
    assert_eq!(state.operation, "Succeeded", "{state:?}");
    let health_of = |s: &AppState, kind: &str, name: &str| {
        s.resources
            .iter()
            .find(|r| r.0 == kind && r.1 == name)
            .map(|r| (r.2.clone(), r.3.clone()))
            .unwrap_or_default()
    };
    // The workloads (wave 4) got their slices: the inference Deployment is available on the
    // H200's MIG instances, the fine-tuning Job ran on an A100 slice.
    for (kind, name) in [
        ("GpuPool", "h200-mig"),
        ("GpuPool", "shared-a100"),
        ("GpuSlicePolicy", "llm-inference"),
        ("GpuSlicePolicy", "bert-finetune"),
        ("GpuSlicePolicy", "notebook"),
        ("GpuPool", "research-h100"),
        ("GpuSlicePolicy", "research-notebook"),
        ("GpuSlicePolicy", "research-training"),
        ("CheckpointPolicy", "standard"),
        ("CheckpointPolicy", "durable"),
        ("Deployment", "llm-inference"),
        ("Job", "bert-finetune"),
    ] {
        assert_eq!(
            health_of(&state, kind, name).0,
            "Healthy",
            "{kind} {name}: {state:?}"
        );
    }
    for (namespace, node, count) in [("serving", "h200", 2), ("nlp", "a100", 1)] {
        let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), namespace)
            .list(&Default::default())
            .await
            .unwrap();
        let on: Vec<Option<String>> = pods
            .items
            .iter()
            .map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
            .collect();
        assert_eq!(on, vec![Some(node.to_string()); count], "{namespace}");
    }
    let gpu_nodes: Api<GpuNode> = Api::all(client.clone());
    let slices_on = |node: &'static str| {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let n = gpu_nodes.get(node).await.map_err(|e| e.to_string())?;
            let gpu = n
                .status
                .and_then(|s| s.inventory)
                .and_then(|i| i.gpus.into_iter().next())
                .ok_or("no inventory")?;
            let mut cut: Vec<String> = gpu
                .slices
                .iter()
                .map(|s| format!("{}@{}%", s.memory.0, s.compute))
                .chain(
                    gpu.mig
                        .iter()
                        .flat_map(|m| &m.instances)
                        .map(|i| i.profile.clone()),
                )
                .collect();
            cut.sort();
            Ok::<_, String>(cut)
        }
    };
    assert_eq!(
        slices_on("a100").await.unwrap(),
        ["20Gi@25%", "20Gi@25%", "20Gi@25%", "20Gi@25%"]
    );
    let h200_day = slices_on("h200").await.unwrap();
    assert_eq!(h200_day, ["1g.18gb", "1g.18gb", "2g.35gb", "3g.71gb"]);
    // The elastic pool of the README's worked example: its GPU in the halves it starts with.
    assert_eq!(slices_on("h100").await.unwrap(), ["39Gi@50%", "39Gi@50%"]);
    // Three research notebooks wait for two halves: the operator cuts the idle GPU in quarters.
    // It writes only the pool's status, so the Application stays Synced at the same revision.
    let notebooks: Vec<serde_json::Value> = (1..=3)
        .map(|i| {
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": format!("research-{i}"),
                    "namespace": "default",
                    "labels": {"gpuslice.io/policy": "research-notebook"},
                },
                "spec": {"containers": [{"name": "main", "image": "example.com/notebook:1"}]},
            })
        })
        .collect();
    gpuslice_testcluster::apply_all(&client, &notebooks).await;
    gpuslice_testcluster::eventually("the H100 cut in quarters", || async {
        let cut = slices_on("h100").await?;
        (cut.len() == 4).then_some(()).ok_or(format!("{cut:?}"))
    })
    .await;
    let state = app_until(
        &apps,
        &logs,
        120,
        "the app Synced and Healthy after the re-cut",
        |s| healthy_at(s, &first),
    )
    .await;
    assert_eq!(
        health_of(&state, "GpuPool", "research-h100").0,
        "Healthy",
        "{state:?}"
    );

    // A merged change: the A100 pool goes to two slices. Push → Argo CD syncs → the operator →
    // the agent re-cuts → the pool and the Application are Healthy again.
    let pool_file = repo_dir.join("gitops/pools/shared-a100.yaml");
    let original = std::fs::read_to_string(&pool_file).unwrap();
    let edit = |from: &str, to: &str| {
        let text = std::fs::read_to_string(&pool_file).unwrap();
        assert!(text.contains(from), "{from}");
        std::fs::write(&pool_file, text.replacen(from, to, 1)).unwrap();
    };
    edit(
        "software: {slices: 4, memory: 20Gi, compute: 25}",
        "software: {slices: 2, memory: 40Gi, compute: 50}",
    );
    let pushed = Instant::now();
    let change = gpuslice_testcluster::commit_all(&repo, "shared-a100: two slices by day");
    app_until(&apps, &logs, 180, "the change turning Healthy", |s| {
        healthy_at(s, &change)
    })
    .await;
    let push_to_healthy = pushed.elapsed();
    // Healthy means done: the agent has already re-cut the GPU.
    assert_eq!(slices_on("a100").await.unwrap(), ["40Gi@50%", "40Gi@50%"]);

    // A commit the operator marks Degraded (a layout no A100 can hold): the Application shows
    // Degraded with the operator's message, and the GPU keeps the layout it had.
    edit(
        "software: {slices: 2, memory: 40Gi, compute: 50}",
        "software: {slices: 2, memory: 60Gi, compute: 50}",
    );
    let pushed = Instant::now();
    let broken = gpuslice_testcluster::commit_all(&repo, "shared-a100: slices too big");
    let degraded = app_until(&apps, &logs, 180, "the bad layout showing Degraded", |s| {
        s.revision == broken && s.health == "Degraded"
    })
    .await;
    let broken_to_degraded = pushed.elapsed();
    let (health, message) = health_of(&degraded, "GpuPool", "shared-a100");
    assert_eq!(health, "Degraded", "{degraded:?}");
    assert!(
        message.contains("GPU 0") && message.contains("60Gi"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(slices_on("a100").await.unwrap(), ["40Gi@50%", "40Gi@50%"]);

    // A commit the API server refuses (two layouts at once): the sync fails naming the rule;
    // the live pool and the GPU stay as they were.
    edit(
        "software: {slices: 2, memory: 60Gi, compute: 50}",
        "software: {slices: 2, memory: 40Gi, compute: 50}\n    exclusive: {}",
    );
    let pushed = Instant::now();
    let refused = gpuslice_testcluster::commit_all(&repo, "shared-a100: two layouts");
    // The first failed attempt (Argo CD retries twice, see application.yaml).
    let failed = app_until(
        &apps,
        &logs,
        180,
        "the refused commit failing its sync",
        |s| {
            s.operation_revision == refused
                && s.operation_message
                    .contains("set exactly one of mig, software, mps or exclusive")
        },
    )
    .await;
    let refused_to_failed = pushed.elapsed();
    assert_eq!(failed.sync, "OutOfSync", "{failed:?}");
    assert_ne!(failed.operation, "Succeeded", "{failed:?}");
    assert_eq!(slices_on("a100").await.unwrap(), ["40Gi@50%", "40Gi@50%"]);

    // The revert heals it.
    std::fs::write(&pool_file, &original).unwrap();
    let pushed = Instant::now();
    let revert = gpuslice_testcluster::commit_all(&repo, "revert shared-a100");
    app_until(&apps, &logs, 180, "the revert turning Healthy", |s| {
        healthy_at(s, &revert)
    })
    .await;
    let revert_to_healthy = pushed.elapsed();
    assert_eq!(
        slices_on("a100").await.unwrap(),
        ["20Gi@25%", "20Gi@25%", "20Gi@25%", "20Gi@25%"]
    );
    assert_eq!(
        slices_on("h200").await.unwrap(),
        h200_day,
        "the other pool never moved"
    );
    eprintln!(
        "Argo CD timings: first sync → Healthy {:.1} s; push → Healthy {:.1} s; \
         bad layout → Degraded {:.1} s; refused commit → sync Failed {:.1} s; revert → Healthy {:.1} s",
        first_sync.as_secs_f64(),
        push_to_healthy.as_secs_f64(),
        broken_to_degraded.as_secs_f64(),
        refused_to_failed.as_secs_f64(),
        revert_to_healthy.as_secs_f64()
    );
}

/// Polls the Application every 250 ms until `done` holds for its state (returned), for up to
/// `seconds`; then panics with `what`, the last state and the components' logs.
async fn app_until(
    apps: &Api<DynamicObject>,
    logs: &Path,
    seconds: u64,
    what: &str,
    done: impl Fn(&AppState) -> bool,
) -> AppState {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        let state = app_state(apps).await;
        match state {
            Ok(s) if done(&s) => return s,
            last if Instant::now() > deadline => {
                panic!("{what} did not happen; last: {last:?}\n{}", tail_logs(logs))
            }
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Whether the Application is Synced to `revision` and Healthy.
fn healthy_at(s: &AppState, revision: &str) -> bool {
    s.sync == "Synced" && s.health == "Healthy" && s.revision == revision
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}
