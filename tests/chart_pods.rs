//! The chart's own pods: `helm install` of the chart with an image built from what the
//! Dockerfile ships (`gpuslice` and the shim beside it, in an OCI tarball imported into
//! containerd; no registry), on a real kubelet with containerd and runc. The operator Deployment
//! and the agent DaemonSet run as real pods with the chart's ServiceAccounts, host paths and
//! privileges; the agent finds the emulated GPU through `libnvidia-ml.so.1` where the NVIDIA
//! container runtime would put the host's (RuntimeClass `nvidia`), publishes the node's
//! ResourceSlices, serves the kubelet plugin, and a pod that names a policy by label gets its
//! slice, capped.
//!
//! Only host-network pods run here (no CNI plugin, no kube-proxy), so the chart is installed with
//! `hostNetwork` and the API server's address (`apiServer.host/port`), as on a cluster whose
//! `kubernetes` Service does not serve host-network pods.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpuslice_testcluster::containerd::{Driver, build_image};
use gpuslice_testcluster::repo_root as root;
use gpuslice_testcluster::{Components, ControlPlane, Runtime, eventually};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams, PostParams};

const NODE: &str = "gpu-a";
const NAMESPACE: &str = "gpuslice-system";
const RELEASE: &str = "gs";
const IMAGE_REPOSITORY: &str = "gpuslice.test/gpuslice";
const IMAGE_TAG: &str = "chart";
const PROBE_IMAGE: &str = "gpuslice.test/probe:chart";
/// Where the NVIDIA container runtime puts the driver's libraries in a container (Debian/Ubuntu).
const DRIVER_LIBS: &str = "/usr/lib/x86_64-linux-gnu";

/// The images: the chart's (`gpuslice` and `libgpuslice.so` in /usr/local/bin, as the
/// Dockerfile puts them, with the libraries they link) and the workload's (the probe).
fn build_images(dir: &Path, probe: &Path, driver_libs: &Path) -> Vec<PathBuf> {
    let gpuslice = Path::new(env!("CARGO_BIN_EXE_gpuslice"));
    let built = gpuslice.parent().unwrap();
    let shim = gpuslice_runtime::built::newest_built(built, "libgpuslice.so")
        .expect("the shim is built: cargo build --workspace");
    let chart_image = dir.join("gpuslice.tar");
    build_image(
        &chart_image,
        &format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}"),
        Some("/usr/local/bin/gpuslice"),
        &[
            format!("{}:/usr/local/bin/gpuslice", gpuslice.display()),
            format!("{}:/usr/local/bin/libgpuslice.so", shim.display()),
        ],
        &[],
    );
    // ldd finds the emulated driver's libraries (and through them what they link) for the image;
    // the runtime class puts the driver's own over them where the program looks.
    let probe_image = dir.join("probe.tar");
    build_image(
        &probe_image,
        PROBE_IMAGE,
        None,
        &[format!("{}:/usr/local/bin/probe", probe.display())],
        &[("LD_LIBRARY_PATH", driver_libs)],
    );
    vec![chart_image, probe_image]
}

/// The emulated driver as the NVIDIA container runtime gives it: its libraries where the
/// loader finds them, and its device (the emulated machine's state, in a world-writable folder
/// as device nodes are) at the host's path.
fn driver(libs: &Path, machine_dir: &Path, machine: &Path) -> Driver {
    let mut mounts: Vec<(PathBuf, PathBuf, bool)> = [
        "libnvidia-ml.so.1",
        "libnvidia-ml.so",
        "libcuda.so.1",
        "libcuda.so",
    ]
    .iter()
    .map(|name| (libs.join(name), Path::new(DRIVER_LIBS).join(name), false))
    .collect();
    mounts.push((machine_dir.to_path_buf(), machine_dir.to_path_buf(), true));
    Driver {
        mounts,
        env: vec![(
            "GPUSLICE_EMULATOR_STATE".to_string(),
            machine.display().to_string(),
        )],
    }
}

fn helm_install(helm: &Path, cluster: &ControlPlane, values: &[(&str, String)]) {
    let sets: Vec<String> = values.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let out = Command::new(helm)
        .args([
            "install",
            RELEASE,
            "--namespace",
            NAMESPACE,
            "--create-namespace",
        ])
        .arg(root().join("charts/gpuslice"))
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig_path())
        .arg("--set")
        .arg(sets.join(","))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm install: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The phase of a pod, or what keeps it from one.
async fn phase(pods: &Api<Pod>, name: &str) -> String {
    match pods.get_opt(name).await {
        Ok(Some(p)) => p
            .status
            .and_then(|s| s.phase)
            .unwrap_or_else(|| "no phase".into()),
        Ok(None) => "absent".into(),
        Err(e) => e.to_string(),
    }
}

/// The pods of one of the chart's components, waited for until one runs with every container
/// ready.
async fn wait_ready(pods: &Api<Pod>, component: &str) -> Pod {
    let selector =
        format!("app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}");
    eventually(&format!("the chart's {component} pod is ready"), || {
        let pods = pods.clone();
        let selector = selector.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?;
            let ready = |p: &Pod| {
                p.status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .flatten()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                })
            };
            list.items
                .iter()
                .find(|p| ready(p))
                .cloned()
                .ok_or_else(|| {
                    let states: Vec<String> = list
                        .items
                        .iter()
                        .map(|p| format!("{:?}", p.status))
                        .collect();
                    format!("{states:?}")
                })
        }
    })
    .await
}

#[tokio::test]
async fn the_charts_own_pods_run_and_a_workload_gets_its_slice() {
    let Some(helm) = gpuslice_testcluster::built_tool("GPUSLICE_HELM", "helm", "") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (probe, libs) =
        gpuslice_testcluster::build_probe(Path::new(env!("CARGO_BIN_EXE_gpuslice")), dir.path());
    let images = build_images(dir.path(), &probe, &libs);

    // One emulated A100, its state where the driver's device would be.
    let machine_dir = dir.path().join("driver");
    std::fs::create_dir_all(&machine_dir).unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&machine_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let machine = machine_dir.join("machine.json");
    let inventory: gpuslice_api::NodeInventory = serde_yaml::from_str(&format!(
        "name: {NODE}\ngpus:\n- {{index: 0, model: NVIDIA A100-SXM4-80GB}}\n"
    ))
    .unwrap();
    gpuslice_emulator::Store::create(
        &machine,
        &gpuslice_emulator::Machine::from_inventory(&inventory).unwrap(),
    )
    .unwrap();

    let Some(cluster) = ControlPlane::start(Components::all()).await.unwrap() else {
        return;
    };
    let runtime = Runtime {
        images,
        driver: driver(&libs, &machine_dir, &machine),
    };
    let Some(kubelet) = cluster
        .start_kubelet(
            NODE,
            &[
                ("gpuslice.io/pool", "shared-a100"),
                ("nvidia.com/gpu.present", "true"),
            ],
            runtime,
        )
        .await
        .unwrap()
    else {
        return;
    };
    let client = cluster.client().await.unwrap();
    // What the GPU Operator installs where the NVIDIA runtime is not containerd's default.
    gpuslice_testcluster::apply_all(
        &client,
        &gpuslice_testcluster::documents(
            "apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata: {name: nvidia}\nhandler: nvidia\n",
        ),
    )
    .await;

    let (api_host, api_port) = cluster
        .server()
        .trim_start_matches("https://")
        .rsplit_once(':')
        .map(|(h, p)| (h.to_string(), p.to_string()))
        .unwrap();
    let state = dir.path().join("state");
    helm_install(
        &helm,
        &cluster,
        &[
            ("image.repository", IMAGE_REPOSITORY.to_string()),
            ("image.tag", IMAGE_TAG.to_string()),
            ("image.pullPolicy", "Never".to_string()),
            ("apiServer.host", api_host),
            ("apiServer.port", api_port),
            ("operator.hostNetwork", "true".to_string()),
            (
                "operator.metricsPort",
                gpuslice_testcluster::free_port().unwrap().to_string(),
            ),
            ("agent.hostNetwork", "true".to_string()),
            (
                "agent.metricsPort",
                gpuslice_testcluster::free_port().unwrap().to_string(),
            ),
            ("agent.runtimeClassName", "nvidia".to_string()),
            ("agent.interval", "2s".to_string()),
            ("agent.stateDir", state.display().to_string()),
            (
                "agent.cacheRoot",
                dir.path().join("caches").display().to_string(),
            ),
            (
                "agent.kubeletPlugin.kubeletDir",
                kubelet.root_dir().display().to_string(),
            ),
            (
                "agent.kubeletPlugin.cdiDir",
                kubelet.cdi_dir().display().to_string(),
            ),
        ],
    );

    // Both of the chart's pods run and pass their liveness and readiness as the chart declares.
    let system_pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let report = |what: &str| {
        format!(
            "{what}\n--- kubelet ---\n{}\n--- containers ---\n{:#?}",
            kubelet.logs(),
            kubelet
                .containers()
                .iter()
                .map(|c| (c.pod.clone(), kubelet.output(c)))
                .collect::<Vec<_>>()
        )
    };
    let operator = tokio::time::timeout(
        std::time::Duration::from_secs(150),
        wait_ready(&system_pods, "operator"),
    )
    .await
    .unwrap_or_else(|_| panic!("{}", report("operator not ready")));
    let agent = tokio::time::timeout(
        std::time::Duration::from_secs(150),
        wait_ready(&system_pods, "agent"),
    )
    .await
    .unwrap_or_else(|_| panic!("{}", report("agent not ready")));
    let containers = kubelet.containers();
    for pod in [&operator, &agent] {
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some(NODE));
        // In a container of the chart's image that containerd runs.
        let name = pod.metadata.name.as_deref().unwrap();
        assert!(
            containers
                .iter()
                .any(|c| c.pod == name && c.started && c.exit_code.is_none()),
            "{name}: {containers:#?}"
        );
        assert_eq!(
            spec.containers[0].image.as_deref(),
            Some(format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}").as_str())
        );
        assert!(
            spec.service_account_name
                .as_deref()
                .is_some_and(|sa| sa.starts_with(RELEASE)),
            "{spec:?}"
        );
    }

    // The agent in its pod read the emulated GPU through NVML and published the node's slices.
    gpuslice_testcluster::apply_repo_files(&client, &gpuslice_testcluster::NOTEBOOK_EXAMPLES).await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    eventually("the agent pod publishes its node's ResourceSlices", || {
        let slices = slices.clone();
        async move {
            let list = slices
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let devices: usize = list
                .items
                .iter()
                .filter(|s| {
                    s.spec.driver == "gpuslice.io" && s.spec.node_name.as_deref() == Some(NODE)
                })
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum();
            (devices > 0)
                .then_some(())
                .ok_or(format!("{} slices, none with devices", list.items.len()))
        }
    })
    .await;

    // A notebook named by label: admitted by the chart's admission policies, queued and
    // scheduled, prepared by the agent pod's kubelet plugin, run with the NVIDIA runtime class,
    // and capped by the shim at the policy's 8 GiB plus the pool's 1 GiB headroom.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut spec = gpuslice_testcluster::containerd::tenant_pod_spec(
        PROBE_IMAGE,
        &["/bin/sh", "-c", "/usr/local/bin/probe link cap"],
    );
    spec["runtimeClassName"] = "nvidia".into();
    spec["restartPolicy"] = "Never".into();
    let workload: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "notebook", "labels": {"gpuslice.io/policy": "notebook"}},
        "spec": spec,
    }))
    .unwrap();
    // Admitted once the operator has written the policy into the admission parameters, and
    // stored as the mutating policies leave it (asking for the policy's slice, at the queue's
    // gate) once the API server has loaded them: each policy loads on its own, a moment after it
    // is created, so a pod stored before they all are is deleted and sent again.
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    eventually("the notebook is admitted and mutated", || {
        let (pods, workload, dry) = (pods.clone(), workload.clone(), dry.clone());
        async move {
            let stored = pods
                .create(&dry, &workload)
                .await
                .map_err(|e| e.to_string())?;
            let spec = stored.spec.unwrap_or_default();
            let asks = spec.containers[0]
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.contains_key("gpuslice.io/notebook"));
            let gated = spec
                .scheduling_gates
                .is_some_and(|g| g.iter().any(|g| g.name == "gpuslice.io/queue"));
            (asks && gated)
                .then_some(())
                .ok_or_else(|| "stored without the slice or the gate".to_string())
        }
    })
    .await;
    pods.create(&PostParams::default(), &workload)
        .await
        .unwrap();
    let done = tokio::time::timeout(
        std::time::Duration::from_secs(150),
        eventually("the notebook ends", || {
            let pods = pods.clone();
            async move {
                let p = phase(&pods, "notebook").await;
                ["Succeeded", "Failed"]
                    .contains(&p.as_str())
                    .then_some(p.clone())
                    .ok_or(p)
            }
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("{}", report("the notebook did not end")));
    let container = kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == "notebook")
        .unwrap();
    let output = kubelet.output(&container);
    println!("the notebook in the chart's cluster:\n{output}");
    assert_eq!(done, "Succeeded", "{output}");
    assert_eq!(
        container.cdi_devices.len(),
        1,
        "one slice device: {container:#?}"
    );
    let value = |key: &str| -> u64 {
        output
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in the notebook's output:\n{output}"))
    };
    assert_eq!(value("info_total"), 9 << 30, "{output}");
    assert_eq!(value("chunks"), 8, "{output}");
    assert_ne!(value("alloc_over"), 0, "{output}");
}
