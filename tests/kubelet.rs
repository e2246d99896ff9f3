//! The kubelet side of workloads on slices, with a real kubelet: the control plane (API server,
//! scheduler, controller-manager, etcd), the operator and the agent as the chart's identities, one
//! agent on an emulated A100, and the kubelet of its node on containerd with runc: every pod runs
//! in a real container of a local image (busybox, the probe, the emulated driver's libraries,
//! `gpuslice`), in its own pid and mount namespaces, as user 1000 on a read-only root filesystem,
//! with the CDI spec the agent wrote applied by containerd.
//!
//! What a user of the cluster sees: a pod asking for a policy's slice runs with the slice given
//! through CDI, its CUDA capped at the policy's memory though nothing in the pod names the shim;
//! the slice is released when the pod ends or is deleted; the kubelet restarted does not prepare
//! a claim again.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpuslice_testcluster::{
    Components, ControlPlane, KillOnDrop, Kubelet, Runtime, event_note, eventually,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt as _};

const NODE: &str = "gpu-a";
const CLOCK: &str = "2026-12-02T10:00:00Z";

/// The control plane, the kubelet of node `gpu-a` (on containerd) on an emulated A100 in pool
/// shared-a100, its agent and the operator, all on a clock started at `clock`; the examples' pool
/// and notebook policy; and the probe image (the shim's probe program built against the emulated
/// CUDA driver).
struct Setup {
    agent: KillOnDrop,
    /// The agent's extra arguments, its node file and state directory (to start it again).
    agent_args: Vec<String>,
    node_file: std::path::PathBuf,
    state: std::path::PathBuf,
    operator: KillOnDrop,
    /// The chart's identities the agent and the operator run as.
    agent_kubeconfig: std::path::PathBuf,
    operator_kubeconfig: std::path::PathBuf,
    clock: String,
    kubelet: Kubelet,
    cluster: ControlPlane,
    client: Client,
    agent_log: std::path::PathBuf,
    machine: std::path::PathBuf,
    dir: tempfile::TempDir,
    /// Where the agent serves /metrics.
    metrics_port: u16,
    /// The folder holding the emulated driver's state, shared with containers by a host path
    /// (world-writable, as the driver's device nodes are).
    driver: std::path::PathBuf,
    /// What the test writes for its pods to read (stop files), at one path for both.
    control: std::path::PathBuf,
}

/// In the probe image: the probe, and the emulated driver's libraries (what the NVIDIA container
/// runtime would bring from the host).
const IMAGE_PROBE: &str = "/usr/local/bin/probe";
const IMAGE_DRIVER_LIBS: &str = "/usr/local/lib/gpuslice-driver";
const IMAGE_GPUSLICE: &str = "/usr/local/bin/gpuslice";
const PROBE_IMAGE: &str = "gpuslice.test/probe:1";
const IMAGE_MPS_TOOL: &str = "/usr/local/bin/nvidia-cuda-mps-control";

/// The emulated `nvidia-cuda-mps-control`, beside the binary under test.
fn mps_tool() -> Option<std::path::PathBuf> {
    Some(
        Path::new(env!("CARGO_BIN_EXE_gpuslice"))
            .parent()?
            .join("nvidia-cuda-mps-control"),
    )
}

impl Setup {
    /// One emulated A100 on the node.
    async fn start(clock: &str, agent_args: &[&str]) -> Option<Setup> {
        Setup::start_with_gpus(clock, agent_args, 1).await
    }

    /// The kubelet on containerd, `gpus` emulated A100s: pods run in real containers of the
    /// probe image, as user 1000.
    async fn start_with_gpus(clock: &str, agent_args: &[&str], gpus: u32) -> Option<Setup> {
        let dir = tempfile::tempdir().unwrap();
        let (probe, lib) = gpuslice_testcluster::build_probe(
            Path::new(env!("CARGO_BIN_EXE_gpuslice")),
            dir.path(),
        );
        let image = dir.path().join("probe.tar");
        // ldd finds the probe's libraries (the emulated driver's among them) for the image.
        gpuslice_testcluster::containerd::build_image(
            &image,
            PROBE_IMAGE,
            None,
            &[
                format!("{}:{IMAGE_PROBE}", probe.display()),
                format!("{}:{IMAGE_DRIVER_LIBS}", lib.display()),
                format!("{}:{IMAGE_GPUSLICE}", env!("CARGO_BIN_EXE_gpuslice")),
            ]
            .into_iter()
            // A tenant's own copy of NVIDIA's MPS tool (the emulated one, built with the
            // workspace), to command the node's daemon with.
            .chain(
                mps_tool()
                    .filter(|t| t.exists())
                    .map(|t| format!("{}:{IMAGE_MPS_TOOL}", t.display())),
            )
            .collect::<Vec<_>>(),
            &[("LD_LIBRARY_PATH", lib.as_path())],
        );
        let runtime = Runtime {
            images: vec![image],
            driver: Default::default(),
        };
        let cluster = ControlPlane::start(Components::all()).await.unwrap()?;
        let kubelet = cluster
            .start_kubelet(NODE, &[("gpuslice.io/pool", "shared-a100")], runtime)
            .await
            .unwrap()?;
        let client = cluster.client_with_crds().await;
        if !cluster.install_chart_identities().await.unwrap() {
            return None;
        }
        let agent_kubeconfig = cluster.agent_kubeconfig(NODE).await.unwrap();
        let operator_kubeconfig = cluster.operator_kubeconfig().await.unwrap();
        let node_file = dir.path().join("node.yaml");
        let gpu_lines: String = (0..gpus)
            .map(|i| format!("- {{index: {i}, model: NVIDIA A100-SXM4-80GB}}\n"))
            .collect();
        std::fs::write(&node_file, format!("name: {NODE}\ngpus:\n{gpu_lines}")).unwrap();
        let state = dir.path().join("state");
        let agent_log = dir.path().join("agent.log");
        let metrics_port = gpuslice_testcluster::free_port().unwrap();
        let mut agent_args: Vec<String> = agent_args.iter().map(|a| a.to_string()).collect();
        let driver = dir.path().join("driver");
        std::fs::create_dir_all(&driver).unwrap();
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&driver, std::fs::Permissions::from_mode(0o777)).unwrap();
        }
        let machine = driver.join("machine.json");
        agent_args.push("--emulator-state".into());
        agent_args.push(machine.display().to_string());
        let agent = spawn_agent(
            &agent_kubeconfig,
            &kubelet,
            clock,
            &agent_args,
            &node_file,
            &state,
            metrics_port,
            &agent_log,
        );
        let operator = spawn_operator(&operator_kubeconfig, clock);
        gpuslice_testcluster::apply_repo_files(&client, &gpuslice_testcluster::NOTEBOOK_EXAMPLES)
            .await;
        let control = dir.path().join("control");
        std::fs::create_dir_all(&control).unwrap();
        Some(Setup {
            agent,
            agent_args,
            node_file,
            state,
            operator,
            agent_kubeconfig,
            operator_kubeconfig,
            clock: clock.to_string(),
            kubelet,
            cluster,
            client,
            agent_log,
            machine,
            metrics_port,
            driver,
            control,
            dir,
        })
    }

    fn agent_log(&self) -> String {
        std::fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// Kills the agent and starts another with the same arguments (its log goes on).
    fn restart_agent(&mut self) {
        self.stop_agent();
        self.agent = spawn_agent(
            &self.agent_kubeconfig,
            &self.kubelet,
            &self.clock,
            &self.agent_args,
            &self.node_file,
            &self.state,
            self.metrics_port,
            &self.agent_log,
        );
    }

    fn stop_agent(&mut self) {
        let _ = self.agent.0.kill();
        let _ = self.agent.0.wait();
    }

    /// Kills the operator and starts another (on a clock started where the first one's was).
    fn restart_operator(&mut self) {
        let _ = self.operator.0.kill();
        let _ = self.operator.0.wait();
        self.operator = spawn_operator(&self.operator_kubeconfig, &self.clock);
    }
}

/// The agent of node `gpu-a` on the emulated machine of `node_file`, serving the kubelet's
/// plugin, as the chart's agent identity; its log is appended to `log`.
#[allow(clippy::too_many_arguments)]
fn spawn_agent(
    kubeconfig: &Path,
    kubelet: &Kubelet,
    clock: &str,
    args: &[String],
    node_file: &Path,
    state: &Path,
    metrics_port: u16,
    log: &Path,
) -> KillOnDrop {
    KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_gpuslice"))
            .args(["agent", "--kube", "--apply", "--interval", "2s"])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(args)
            .arg("--emulate")
            .arg(node_file)
            .arg("--state")
            .arg(state)
            // Pools' dataset caches, for /var/lib/gpuslice/cache.
            .arg("--cache-root")
            .arg(std::path::Path::new(&state).join("caches"))
            .arg("--kubelet-dir")
            .arg(kubelet.root_dir())
            .arg("--cdi-dir")
            .arg(kubelet.cdi_dir())
            .env("KUBECONFIG", kubeconfig)
            .env("GPUSLICE_CLOCK_START", clock)
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            )
            .spawn()
            .unwrap(),
    )
}

/// The operator, as the chart's operator identity (its lease in the chart's namespace).
fn spawn_operator(kubeconfig: &Path, clock: &str) -> KillOnDrop {
    gpuslice_testcluster::spawn_operator(
        env!("CARGO_BIN_EXE_gpuslice"),
        kubeconfig,
        Some(clock),
        &[],
    )
}

/// A failed test shows the kubelet's, the runtime's and the agent's logs.
impl Drop for Setup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let agent = self.agent_log();
            let tail: Vec<&str> = agent.lines().rev().take(60).collect();
            eprintln!(
                "{}----- agent -----\n{}",
                self.kubelet.logs(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

/// Applies the objects of `yaml`, then waits until the operator has written `classes`
/// DeviceClasses (one per policy).
async fn apply_policies(setup: &Setup, yaml: &str, classes: usize) {
    let file = setup.dir.path().join("policies.yaml");
    std::fs::write(&file, yaml).unwrap();
    gpuslice_testcluster::apply_repo_files(&setup.client, &[file.to_str().unwrap()]).await;
    gpuslice_testcluster::wait_for_device_classes(&setup.client, classes).await;
}

impl Setup {
    /// A pod asking for one `notebook` slice by the policy's extended resource, running
    /// `command` with the emulated CUDA driver (what the NVIDIA container runtime would bring)
    /// on its path.
    fn pod(&self, name: &str, command: &[&str]) -> Pod {
        let mut spec = self.pod_spec(command);
        spec["restartPolicy"] = "Never".into();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "kubelet-test"}},
            "spec": spec,
        }))
        .unwrap()
    }

    /// In a real container of the probe image: host network (no CNI here), user 1000, a
    /// read-only root filesystem; the emulated driver's folder and the control folder
    /// (read-only) by host path, at the paths the host has.
    fn pod_spec(&self, command: &[&str]) -> serde_json::Value {
        let driver = &self.driver;
        let mut spec = gpuslice_testcluster::containerd::tenant_pod_spec(PROBE_IMAGE, command);
        let main = &mut spec["containers"][0];
        main["env"] = serde_json::json!([
            {"name": "LD_LIBRARY_PATH", "value": IMAGE_DRIVER_LIBS},
            {"name": "GPUSLICE_EMULATOR_STATE", "value": self.machine},
        ]);
        main["volumeMounts"] = serde_json::json!([
            {"name": "driver", "mountPath": driver},
            {"name": "control", "mountPath": self.control, "readOnly": true},
        ]);
        main["resources"] = serde_json::json!({"limits": {"gpuslice.io/notebook": "1"}});
        spec["volumes"] = serde_json::json!([
            {"name": "driver", "hostPath": {"path": driver, "type": "Directory"}},
            {"name": "control", "hostPath": {"path": self.control, "type": "Directory"}},
        ]);
        spec
    }

    /// The probe program, as a pod's command names it.
    fn probe(&self) -> &'static str {
        IMAGE_PROBE
    }

    /// `gpuslice`, as a pod's command names it.
    fn gpuslice(&self) -> &'static str {
        IMAGE_GPUSLICE
    }
}

/// Creates pod `name` running `script` on a notebook slice, waits for `phase`, and returns its
/// container as the runtime recorded it.
async fn run_pod(
    setup: &Setup,
    pods: &Api<Pod>,
    name: &str,
    script: &str,
    phase: &str,
) -> gpuslice_testcluster::Container {
    pods.create(
        &PostParams::default(),
        &setup.pod(name, &["/bin/sh", "-c", script]),
    )
    .await
    .unwrap();
    wait_for_phases(pods, &[name], [phase]).await;
    setup
        .kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == name)
        .unwrap()
}

/// The notes of the Events with `reason` about pod `pod` of namespace `default`.
async fn pod_event_notes(client: &Client, reason: &str, pod: &str) -> Result<Vec<String>, String> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    Ok(events
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
        })
        .filter_map(|e| e.note)
        .collect())
}

/// The container's output once it holds `marker`.
async fn output_with(
    setup: &Setup,
    container: &gpuslice_testcluster::Container,
    marker: &str,
) -> String {
    eventually(&format!("the container printed {marker}"), || {
        let output = setup.kubelet.output(container);
        async move {
            output
                .contains(marker)
                .then_some(output.clone())
                .ok_or(output)
        }
    })
    .await
}

/// The watchdog told pod `pod` why it sent SIGTERM (an Event `reason` whose note holds `why`),
/// and counted it in the agent's `series` with `action="signalled"`.
async fn told_why(setup: &Setup, pod: &str, reason: &str, why: &str, series: &str) {
    eventually("the pod is told why", || {
        let client = setup.client.clone();
        async move {
            let notes = pod_event_notes(&client, reason, pod).await?;
            notes
                .iter()
                .any(|n| n.contains(why) && n.contains("SIGTERM"))
                .then_some(())
                .ok_or(format!("{notes:?}"))
        }
    })
    .await;
    let (_, metrics) = gpuslice_testcluster::local_get(setup.metrics_port, "/metrics").unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with(series) && l.contains("action=\"signalled\"")),
        "{metrics}"
    );
}

/// The CDI device id the agent gives for a pod's claim: `gpuslice.io/slice=<claim uid>-<device>`.
async fn cdi_id(client: &Client, pod: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let claim_name = pods
        .get(pod)
        .await
        .unwrap()
        .status
        .and_then(|s| s.extended_resource_claim_status)
        .map(|s| s.resource_claim_name)
        .unwrap_or_else(|| panic!("{pod} has no claim for its extended resource"));
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim = claims.get(&claim_name).await.unwrap();
    let uid = claim.metadata.uid.clone().unwrap();
    let results = gpuslice_testcluster::allocated_devices(claim);
    let [result] = &results[..] else {
        panic!("{claim_name}: {results:?}")
    };
    format!("gpuslice.io/slice={uid}-{}", result.device)
}

async fn phase(pods: &Api<Pod>, name: &str) -> String {
    pods.get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|p| p.status?.phase)
        .unwrap_or_else(|| "gone".into())
}

/// Each pod's phase and conditions' messages, for a failure's message.
async fn pod_states(pods: &Api<Pod>) -> String {
    let mut out = String::new();
    for p in pods.list(&ListParams::default()).await.unwrap() {
        let status = p.status.unwrap_or_default();
        out += &format!(
            "\n{}: {:?} {:?} {:?}",
            p.metadata.name.unwrap_or_default(),
            status.phase,
            status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| c.message)
                .collect::<Vec<_>>(),
            status
                .container_statuses
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.state)
                .collect::<Vec<_>>()
        );
    }
    out
}

fn value(output: &str, key: &str) -> u64 {
    output
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in the container's output:\n{output}"))
}

#[tokio::test]
async fn a_real_kubelet_runs_pods_on_their_capped_slices() {
    // In real containers (containerd) of the probe image: their own pid and mount namespaces,
    // user 1000, a read-only root filesystem.
    let Some(mut setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let client = setup.client.clone();
    let probe = setup.probe();
    let machine = setup.machine.clone();

    // Three notebooks that check their GPU, then wait until told to end. Two try to switch the
    // cap off through the environment, as a hostile tenant would: one unsets the variable that
    // names the slice config, one points it at a config of its own granting 1 TiB. Neither
    // escapes: the shim reads the config the CDI spec pins read-only.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let names = ["notebook-0", "notebook-1", "notebook-2"];
    let scratch = setup.control.clone();
    let forged = scratch.join("forged-config");
    std::fs::write(
        &forged,
        r#"{"id":"gpu0-s0","kind":"software","gpu":0,"deviceUuid":"x","memoryBytes":1099511627776,"computePercent":100}"#,
    )
    .unwrap();
    let escapes = [
        String::new(),
        "env -u GPUSLICE_SLICE_CONFIG ".to_string(),
        format!("env GPUSLICE_SLICE_CONFIG={} ", forged.display()),
    ];
    let stop = |name: &str| scratch.join(format!("stop-{name}"));
    for (name, escape) in names.iter().zip(&escapes) {
        let script = format!(
            "echo pid=$$$$ uid=$(id -u) preload=$(cat /etc/ld.so.preload); \
             {escape}{probe} link cap && until [ -e {} ]; do sleep 0.2; done",
            stop(name).display()
        );
        pods.create(
            &PostParams::default(),
            &setup.pod(name, &["/bin/sh", "-c", &script]),
        )
        .await
        .unwrap();
    }
    wait_for_phases(&pods, &names, ["Running"; 3]).await;

    // The kubelet passed each pod exactly the CDI device the agent prepared for its claim, which
    // containerd applied (it refuses a container whose device no valid spec names); each pod
    // has its own slice.
    let containers = setup.kubelet.containers();
    assert_eq!(containers.len(), 3, "{containers:#?}");
    let mut devices = BTreeSet::new();
    for c in &containers {
        assert_eq!(c.cdi_devices, [cdi_id(&client, &c.pod).await], "{c:#?}");
        devices.insert(c.cdi_devices[0].clone());
        // Nothing preloads the shim by environment: /etc/ld.so.preload from the CDI spec does.
        assert!(
            !c.env.iter().any(|e| e.starts_with("LD_PRELOAD=")),
            "{c:#?}"
        );
        // What the program saw: the policy's 8 GiB plus the pool's 1 GiB headroom, not the
        // slice's 20 GiB; 1 GiB allocations until the cap (eight, the context takes its
        // share); past it, allocation fails.
        let output = eventually("the container printed its GPU", || {
            let output = setup.kubelet.output(c);
            async move {
                output
                    .contains("alloc_over=")
                    .then_some(output.clone())
                    .ok_or(output)
            }
        })
        .await;
        // Its own pid namespace (the shell is pid 1), the pod's user, and the shim preloaded by
        // the file the CDI spec put over the image's.
        assert!(output.contains("pid=1 uid=1000 "), "{output}");
        assert!(
            output.contains("preload=/run/gpuslice/lib/libgpuslice.so"),
            "{output}"
        );
        assert_eq!(value(&output, "info_total"), 9 << 30, "{output}");
        assert_eq!(value(&output, "chunks"), 8, "{output}");
        assert_ne!(value(&output, "alloc_over"), 0, "{output}");
    }
    assert_eq!(devices.len(), 3, "one slice per pod: {containers:#?}");
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    wait_for_holders(&gpu_nodes, &setup.kubelet, &names).await;

    // The agent's metrics show each pod's slice as its container used it: the eight 1 GiB
    // chunks it held at most, the allocations refused at its 9 GiB cap, the policy's class.
    let port = setup.metrics_port;
    for name in names {
        eventually(
            &format!("the agent's metrics show {name}'s slice"),
            || async move {
                let (_, text) =
                    gpuslice_testcluster::local_get(port, "/metrics").map_err(|e| e.to_string())?;
                let holder = format!("pod=\"{name}\"");
                let line = |metric: &str| {
                    text.lines()
                        .find(|l| l.starts_with(&format!("{metric}{{")) && l.contains(&holder))
                        .map(str::to_string)
                };
                let holder_line = line("gpuslice_agent_slice_holder").ok_or("no holder series")?;
                let slice = holder_line
                    .split("slice=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .ok_or("no slice label")?
                    .to_string();
                let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
                let peak = line("gpuslice_agent_slice_memory_peak_bytes").and_then(|l| value(&l));
                let refusals = text
                    .lines()
                    .find(|l| {
                        l.starts_with("gpuslice_agent_slice_memory_refusals_total{")
                            && l.contains(&format!("slice=\"{slice}\""))
                    })
                    .and_then(value);
                let gib = f64::from(1u32 << 30);
                (holder_line.contains("class=\"interactive\"")
                    && peak.is_some_and(|p| p >= 8.0 * gib && p <= 9.0 * gib)
                    && refusals.is_some_and(|r| r >= 1.0))
                .then_some(())
                .ok_or(format!(
                    "{holder_line}: peak {peak:?}, refusals {refusals:?}"
                ))
            },
        )
        .await;
    }

    // A pod that ends gives its slice back; so does a pod deleted.
    std::fs::write(stop("notebook-0"), "").unwrap();
    wait_for_phases(&pods, &names, ["Succeeded", "Running", "Running"]).await;
    wait_for_holders(&gpu_nodes, &setup.kubelet, &["notebook-1", "notebook-2"]).await;
    pods.delete("notebook-1", &DeleteParams::default())
        .await
        .unwrap();
    wait_for_holders(&gpu_nodes, &setup.kubelet, &["notebook-2"]).await;

    // The kubelet restarted: the running pod's claim is not prepared again, its container not
    // created again.
    let claim_uid = containers
        .iter()
        .find(|c| c.pod == "notebook-2")
        .map(|c| c.cdi_devices[0].trim_start_matches("gpuslice.io/slice="))
        .and_then(|id| id.get(..36))
        .unwrap()
        .to_string();
    let agent_log = setup.agent_log.clone();
    let asked = || {
        std::fs::read_to_string(&agent_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("NodePrepareResources:") && l.contains(&claim_uid))
            .count()
    };
    assert_eq!(asked(), 1);
    setup.kubelet.restart(&setup.cluster).await.unwrap();
    // Two of the kubelet's sync periods (5 s), in which a kubelet that lost track would prepare.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(asked(), 1, "the restarted kubelet prepared the claim again");
    assert_eq!(phase(&pods, "notebook-2").await, "Running");
    let notebook_2 = |c: &gpuslice_testcluster::Container| c.pod == "notebook-2";
    assert_eq!(
        setup
            .kubelet
            .containers()
            .iter()
            .filter(|c| notebook_2(c))
            .count(),
        1,
        "the restarted kubelet created notebook-2's container again"
    );

    // The GPU reports an XID the workload caused (31, a page fault) and no kernel record names
    // the process: notebook-2's is the only slice held on the GPU, so it is quarantined and the
    // pod is told why; it keeps running.
    gpuslice_emulator::Store::open(&machine)
        .unwrap()
        .mutate(|m| m.inject_xid(0, 31))
        .unwrap()
        .unwrap();
    eventually("notebook-2 gets an Event naming the XID", || {
        let client = client.clone();
        async move {
            let notes = pod_event_notes(&client, "GpuFault", "notebook-2").await?;
            notes
                .iter()
                .any(|n| n.contains("XID 31 (GPU memory page fault)") && n.contains("keep running"))
                .then_some(())
                .ok_or(format!("{notes:?}"))
        }
    })
    .await;
    assert_eq!(phase(&pods, "notebook-2").await, "Running");

    std::fs::write(stop("notebook-2"), "").unwrap();
    wait_for_phases(&pods, &names, ["Succeeded", "gone", "Succeeded"]).await;
    wait_for_holders(&gpu_nodes, &setup.kubelet, &[]).await;
}

async fn wait_for_phases<const N: usize>(pods: &Api<Pod>, names: &[&str], want: [&str; N]) {
    eventually(&format!("the pods are {want:?}"), || async move {
        let mut phases = Vec::new();
        for name in names {
            phases.push(phase(pods, name).await);
        }
        if phases == want {
            return Ok(());
        }
        Err(format!("{phases:?}{}", pod_states(pods).await))
    })
    .await;
}

/// Waits until exactly `holders` hold slices: the node's status lists their claims, one CDI spec
/// each is left, and every other container's process has ended.
async fn wait_for_holders(
    gpu_nodes: &Api<gpuslice_api::GpuNode>,
    kubelet: &Kubelet,
    holders: &[&str],
) {
    let want: BTreeSet<String> = holders.iter().map(|p| format!("default/{p}")).collect();
    eventually(&format!("slices held by {want:?}"), || {
        let want = want.clone();
        let cdi = kubelet.cdi_dir();
        let containers = kubelet.containers();
        async move {
            let node = gpu_nodes.get(NODE).await.map_err(|e| e.to_string())?;
            let held: BTreeSet<String> = node
                .status
                .iter()
                .flat_map(|s| &s.claims)
                .flat_map(|c| c.pods.clone())
                .collect();
            let specs = std::fs::read_dir(&cdi).map_err(|e| e.to_string())?.count();
            let running: BTreeSet<String> = containers
                .iter()
                .filter(|c| c.started && c.exit_code.is_none())
                .map(|c| format!("{}/{}", c.namespace, c.pod))
                .collect();
            (held == want && specs == want.len() && running == want)
                .then_some(())
                .ok_or_else(|| format!("held by {held:?}, {specs} CDI specs, running {running:?}"))
        }
    })
    .await;
}

/// The agent's devices: name, memory capacity, re-cut taint value.
/// Each published device: (name, memory, the value of its taint `key`).
async fn devices(client: &Client, key: &str) -> Vec<(String, String, Option<String>)> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut out = Vec::new();
    for s in slices.list(&ListParams::default()).await.unwrap() {
        for d in s.spec.devices.into_iter().flatten() {
            let memory = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|c| c.value.0.clone())
                .unwrap_or_default();
            let taint = d
                .taints
                .iter()
                .flatten()
                .find(|t| t.key == key)
                .and_then(|t| t.value.clone());
            out.push((d.name, memory, taint));
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn a_window_change_checkpoints_evicts_and_reschedules_a_pod_onto_the_new_layout() {
    // 19:59:10 in Shanghai: at 20:00 shared-a100 goes from four 20 GiB slices to two of 40 GiB.
    // Its devices are tainted 20 s ahead; its checkpoint policy (standard) sends SIGUSR1 and
    // requires a checkpoint before the pod may go.
    // In a real container (containerd), as user 1000: the agent signals the pod's process by its
    // cgroup, and the workload, not root, writes the checkpoint marker into its slice's folder.
    let Some(setup) = Setup::start("2026-12-02T11:59:10Z", &["--recut-lookahead", "20s"]).await
    else {
        return;
    };
    let client = setup.client.clone();
    let script = format!(
        "{} link cap; trap 'echo checkpointing; touch \"$(dirname \"$GPUSLICE_SLICE_CONFIG\")/checkpoint-done\"' USR1; while :; do sleep 0.2; done",
        setup.probe()
    );
    let deployment = gpuslice_testcluster::deployment(
        "trainer",
        1,
        &[],
        setup.pod_spec(&["/bin/sh", "-c", &script]),
    );
    Api::<Deployment>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let running = |pods: Api<Pod>| async move {
        let mut names = Vec::new();
        for p in pods
            .list(&ListParams::default().labels("app=trainer"))
            .await
            .map_err(|e| e.to_string())?
        {
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if phase == "Running" && p.metadata.deletion_timestamp.is_none() {
                names.push(p.metadata.name.unwrap_or_default());
            }
        }
        Ok::<_, String>(names)
    };
    let first = eventually("the trainer runs", || {
        let pods = pods.clone();
        async move {
            let names = running(pods.clone()).await?;
            names.first().cloned().ok_or(pod_states(&pods).await)
        }
    })
    .await;

    // Ahead of the boundary, its slice (like every slice of the GPU) is tainted: no new pod
    // lands there; the trainer keeps running.
    eventually("the slices are tainted ahead of 20:00", || {
        let client = client.clone();
        async move {
            let all = devices(&client, "gpuslice.io/recut").await;
            (all.len() == 4
                && all
                    .iter()
                    .all(|(_, _, t)| t.as_deref() == Some("20261202T120000Z")))
            .then_some(())
            .ok_or_else(|| format!("{all:?}"))
        }
    })
    .await;
    assert_eq!(
        running(pods.clone()).await.unwrap(),
        std::slice::from_ref(&first)
    );

    // At 20:00: the trainer is told to checkpoint, checkpoints, is evicted; the GPU is re-cut
    // into two 40 GiB slices; the Deployment's new pod runs on one of them.
    let second = eventually("a new trainer runs on the new layout", || {
        let (pods, client, first) = (pods.clone(), client.clone(), first.clone());
        async move {
            let names = running(pods.clone()).await?;
            let all = devices(&client, "gpuslice.io/recut").await;
            let new_layout =
                all.len() == 2 && all.iter().all(|(_, m, t)| m == "40Gi" && t.is_none());
            match names.as_slice() {
                [one] if *one != first && new_layout => Ok(one.clone()),
                _ => Err(format!(
                    "running {names:?}, devices {all:?}{}",
                    pod_states(&pods).await
                )),
            }
        }
    })
    .await;
    // The evicted pod's container is gone with it (a real runtime removes it): the agent's
    // request to evict it says the workload, user 1000, wrote its checkpoint marker first.
    let log = setup.agent_log();
    let signalled = log.find("SignalPods").expect("the agent signalled the pod");
    let evicted = log
        .find(&format!("asking the operator to evict pod default/{first}"))
        .expect("the agent asked for the pod's eviction");
    assert!(signalled < evicted, "signal, then eviction");
    let eviction = log[evicted..].lines().next().unwrap_or_default();
    assert!(eviction.contains("checkpoint taken"), "{eviction}");
    let new = eventually("the new trainer printed its GPU", || {
        let output = setup
            .kubelet
            .containers()
            .iter()
            .find(|c| c.pod == second)
            .map(|c| setup.kubelet.output(c))
            .unwrap_or_default();
        async move {
            output
                .contains("alloc_over=")
                .then_some(output.clone())
                .ok_or(output)
        }
    })
    .await;
    // Still the policy's cap, on the bigger slice.
    assert_eq!(value(&new, "info_total"), 9 << 30, "{new}");
}

/// Two policies of pool shared-a100 whose pods may not be preempted: `pinned` (priority low)
/// and `urgent` (high), for the preemption tests.
const PINNED_AND_URGENT: &str = "---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: pinned}
spec: {pool: shared-a100, memory: 8Gi, priority: low, preemptible: false}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: urgent}
spec: {pool: shared-a100, memory: 8Gi, priority: high, preemptible: false}
";

/// A pod of `policy` (by label and its extended resource) running `script`; `gated`: waiting
/// in the operator's queue, as the chart's admission policy would have created it.
fn policy_pod(setup: &Setup, name: &str, policy: &str, script: &str, gated: bool) -> Pod {
    policy_pod_of(setup, name, policy, 1, script, gated)
}

/// [`policy_pod`] asking for `slices` of the policy.
fn policy_pod_of(
    setup: &Setup,
    name: &str,
    policy: &str,
    slices: u32,
    script: &str,
    gated: bool,
) -> Pod {
    let mut spec = setup.pod_spec(&["/bin/sh", "-c", script]);
    spec["restartPolicy"] = "Never".into();
    spec["containers"][0]["resources"] =
        serde_json::json!({"limits": {format!("gpuslice.io/{policy}"): slices.to_string()}});
    if gated {
        spec["schedulingGates"] = serde_json::json!([{"name": "gpuslice.io/queue"}]);
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "preemption-test", "gpuslice.io/policy": policy}},
        "spec": spec,
    }))
    .unwrap()
}

/// The ResourceClaim (`default/<name>`) of a pod's extended resource.
async fn claim_of(pods: &Api<Pod>, pod: &str) -> String {
    let name = pods
        .get(pod)
        .await
        .unwrap()
        .status
        .and_then(|s| s.extended_resource_claim_status)
        .map(|s| s.resource_claim_name)
        .unwrap_or_else(|| panic!("{pod} has no claim"));
    format!("default/{name}")
}

/// What the node's agent says of each claim: (last checkpoint written, what it is doing to it).
async fn claim_reports(
    gpu_nodes: &Api<gpuslice_api::GpuNode>,
) -> std::collections::BTreeMap<String, (bool, Option<String>)> {
    let node = gpu_nodes.get(NODE).await.unwrap();
    node.status
        .iter()
        .flat_map(|s| &s.claims)
        .filter_map(|c| {
            Some((
                c.resource_claim.clone()?,
                (c.last_checkpoint.is_some(), c.draining.clone()),
            ))
        })
        .collect()
}

async fn queued(pods: &Api<Pod>, name: &str) -> Option<(bool, String, String)> {
    let p = pods.get(name).await.ok()?;
    let gated = p
        .spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| !g.is_empty());
    let c = p
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == "gpuslice.io/Queued")?;
    Some((
        gated,
        c.reason.unwrap_or_default(),
        c.message.unwrap_or_default(),
    ))
}

#[tokio::test]
async fn a_high_priority_pod_preempts_the_pod_that_loses_least_after_its_checkpoint_once() {
    // Day layout of shared-a100: four 20 GiB slices, preemption on.
    let Some(mut setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let client = setup.client.clone();
    let policies = "
apiVersion: gpuslice.io/v1alpha1
kind: CheckpointPolicy
metadata: {name: quick}
spec: {signal: SIGUSR1, gracePeriod: 3s}
---
apiVersion: gpuslice.io/v1alpha1
kind: CheckpointPolicy
metadata: {name: patient}
spec: {signal: SIGUSR1, gracePeriod: 60s}
---
apiVersion: gpuslice.io/v1alpha1
kind: CheckpointPolicy
metadata: {name: must-checkpoint}
spec: {signal: SIGUSR1, gracePeriod: 2s, required: true}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: batch}
spec: {pool: shared-a100, memory: 8Gi, priority: low, checkpointPolicy: quick}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: training}
spec: {pool: shared-a100, memory: 8Gi, priority: low, checkpointPolicy: patient}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: careful}
spec: {pool: shared-a100, memory: 8Gi, priority: low, checkpointPolicy: must-checkpoint}
";
    apply_policies(&setup, &format!("{policies}{PINNED_AND_URGENT}"), 6).await;
    let marker = "touch \"$(dirname \"$GPUSLICE_SLICE_CONFIG\")/checkpoint-done\"";
    let idle = "while :; do sleep 0.2; done";
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    // Four slices, four low-priority pods, oldest first: one that must checkpoint and never
    // does, one that ignores the signal, one that may not be preempted (checkpointed at once),
    // and one that checkpoints 3 s after it starts, and again when told (8 s later; its grace
    // period is 60 s).
    let running = [
        ("stubborn", "careful", format!("trap '' USR1; {idle}")),
        ("ignorer", "batch", format!("trap '' USR1; {idle}")),
        ("pinned", "pinned", format!("{marker}; {idle}")),
        (
            "trainer",
            "training",
            format!("trap 'sleep 8; echo checkpointing; {marker}' USR1; sleep 3; {marker}; {idle}"),
        ),
    ];
    for (name, policy, script) in &running {
        pods.create(
            &PostParams::default(),
            &policy_pod(&setup, name, policy, script, false),
        )
        .await
        .unwrap();
        eventually(&format!("{name} runs"), || {
            let pods = pods.clone();
            async move {
                let p = phase(&pods, name).await;
                (p == "Running").then_some(()).ok_or(p)
            }
        })
        .await;
    }
    let mut claims = std::collections::BTreeMap::new();
    for (name, _, _) in &running {
        claims.insert(*name, claim_of(&pods, name).await);
    }
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    eventually("the agent reports the two checkpoints", || {
        let (gpu_nodes, claims) = (gpu_nodes.clone(), claims.clone());
        async move {
            let reports = claim_reports(&gpu_nodes).await;
            let with: Vec<&str> = claims
                .iter()
                .filter(|(_, c)| reports.get(*c).is_some_and(|r| r.0))
                .map(|(n, _)| *n)
                .collect();
            (with == ["pinned", "trainer"])
                .then_some(())
                .ok_or_else(|| format!("{reports:?}"))
        }
    })
    .await;

    // A high-priority pod arrives: no slice is free. The queue takes back the trainer's (the
    // least work lost among the preemptible), and the pod says so while the trainer
    // checkpoints.
    pods.create(
        &PostParams::default(),
        &policy_pod(&setup, "urgent-0", "urgent", idle, true),
    )
    .await
    .unwrap();
    let trainer_claim = claims["trainer"].clone();
    // Its container goes with it once it is evicted (a real runtime removes it).
    let trainer_uid = pods
        .get("trainer")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap_or_default();
    let told = eventually("urgent-0 waits for the trainer's slice", || {
        let pods = pods.clone();
        async move {
            match queued(&pods, "urgent-0").await {
                Some((true, reason, message)) if reason == "Preempting" => Ok(message),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    assert!(told.contains(&trainer_claim), "{told}");
    // The operator restarts while the trainer checkpoints (8 s): the new one keeps the same
    // preemption and the pod's place; nobody is signalled or evicted twice.
    setup.restart_operator();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let node = gpu_nodes.get(NODE).await.unwrap();
    assert_eq!(
        node.spec
            .preemptions
            .iter()
            .map(|p| (p.resource_claim.as_str(), p.for_pod.as_str()))
            .collect::<Vec<_>>(),
        [(trainer_claim.as_str(), "default/urgent-0")]
    );
    let still = queued(&pods, "urgent-0").await.unwrap();
    assert!(
        still.0 && still.1 == "Preempting" && still.2.starts_with("1st of 1 waiting"),
        "{still:?}"
    );
    // Then urgent-0 runs on the trainer's slice; the trainer was evicted only after its
    // checkpoint, and is told so.
    eventually("urgent-0 runs, the trainer is gone", || {
        let pods = pods.clone();
        async move {
            let (u, t) = (
                phase(&pods, "urgent-0").await,
                phase(&pods, "trainer").await,
            );
            (u == "Running" && t == "gone")
                .then_some(())
                .ok_or(format!("urgent-0 {u}, trainer {t}"))
        }
    })
    .await;
    let log = setup.agent_log();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("SignalPods") && l.contains(&trainer_uid))
            .count(),
        1,
        "signalled once: {log}"
    );
    assert_eq!(
        log.matches("asking the operator to evict pod default/trainer:")
            .count(),
        1,
        "asked to evict once: {log}"
    );
    let note = eventually("the trainer's Preempted event", || {
        let client = client.clone();
        async move {
            event_note(&client, "Preempted", "trainer")
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "no event".to_string())
        }
    })
    .await;
    assert!(
        note.contains("for pod default/urgent-0") && note.ends_with("checkpoint taken"),
        "{note}"
    );

    // Two more: the pod that ignores the signal goes after its grace period; the one whose
    // checkpoint is required and never comes is waited for, not evicted; the pinned one is
    // never asked.
    for name in ["urgent-1", "urgent-2"] {
        pods.create(
            &PostParams::default(),
            &policy_pod(&setup, name, "urgent", idle, true),
        )
        .await
        .unwrap();
    }
    let stubborn_claim = claims["stubborn"].clone();
    eventually(
        "the stubborn pod's checkpoint is required and waited for",
        || {
            let gpu_nodes = gpu_nodes.clone();
            let stubborn_claim = stubborn_claim.clone();
            async move {
                let reports = claim_reports(&gpu_nodes).await;
                reports
                    .get(&stubborn_claim)
                    .and_then(|r| r.1.clone())
                    .filter(|d| d.contains("requires a checkpoint"))
                    .map(|_| ())
                    .ok_or_else(|| format!("{reports:?}"))
            }
        },
    )
    .await;
    eventually("one urgent pod runs on the ignorer's slice", || {
        let pods = pods.clone();
        async move {
            let phases = [
                phase(&pods, "ignorer").await,
                phase(&pods, "urgent-1").await,
                phase(&pods, "urgent-2").await,
            ];
            let one_runs = phases[1..].iter().filter(|p| *p == "Running").count() == 1;
            (phases[0] == "gone" && one_runs)
                .then_some(())
                .ok_or(format!("{phases:?}"))
        }
    })
    .await;
    for name in ["stubborn", "pinned", "urgent-0"] {
        assert_eq!(phase(&pods, name).await, "Running", "{name}");
        let p = pods.get(name).await.unwrap();
        assert!(
            p.metadata.deletion_timestamp.is_none(),
            "{name} is being deleted"
        );
    }
    let ignorer_note = event_note(&client, "Preempted", "ignorer")
        .await
        .unwrap()
        .unwrap_or_default();
    assert!(
        ignorer_note.ends_with("no checkpoint within the grace period of 3s"),
        "{ignorer_note}"
    );
    let log = setup.agent_log();
    assert!(
        !log.contains("to evict pod default/stubborn")
            && !log.contains("to evict pod default/pinned"),
        "{log}"
    );
}

/// A one-pod Deployment `name` of policy `policy`, created as the chart's admission policies
/// would leave its pods: labelled, asking for the policy's extended resource, gated.
fn queued_deployment(setup: &Setup, name: &str, policy: &str, script: &str) -> Deployment {
    let mut spec = setup.pod_spec(&["/bin/sh", "-c", script]);
    spec["containers"][0]["resources"] =
        serde_json::json!({"limits": {format!("gpuslice.io/{policy}"): "1"}});
    spec["schedulingGates"] = serde_json::json!([{"name": "gpuslice.io/queue"}]);
    gpuslice_testcluster::deployment(name, 1, &[("gpuslice.io/policy", policy)], spec)
}

/// The running pod of Deployment `app` (not being deleted), if one runs.
async fn running_pod(pods: &Api<Pod>, app: &str) -> Option<String> {
    pods.list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .ok()?
        .into_iter()
        .find(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        })
        .and_then(|p| p.metadata.name)
}

/// The GPU index of the slice the agent reports for each claim (`default/<name>`).
async fn gpu_of_claims(
    gpu_nodes: &Api<gpuslice_api::GpuNode>,
) -> std::collections::BTreeMap<String, u32> {
    let node = gpu_nodes.get(NODE).await.unwrap();
    node.status
        .iter()
        .flat_map(|s| &s.claims)
        .filter_map(|c| {
            let gpu = c
                .slice
                .strip_prefix("gpu")?
                .split('-')
                .next()?
                .parse()
                .ok()?;
            Some((c.resource_claim.clone()?, gpu))
        })
        .collect()
}

#[tokio::test]
async fn compaction_asked_for_moves_a_checkpointed_pod_off_its_gpu_and_keeps_that_gpu_free() {
    // Two A100s in shared-a100 (four 20 GiB slices each by day); the pool compacts at 03:00
    // UTC, and now by hand.
    let Some(setup) = Setup::start_with_gpus(CLOCK, &[], 2).await else {
        return;
    };
    let client = setup.client.clone();
    let policies = "
apiVersion: gpuslice.io/v1alpha1
kind: CheckpointPolicy
metadata: {name: quick}
spec: {signal: SIGUSR1, gracePeriod: 30s}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: batch}
spec: {pool: shared-a100, memory: 8Gi, priority: low, checkpointPolicy: quick}
";
    // The examples' notebook policy and batch.
    apply_policies(&setup, policies, 2).await;
    // Six jobs, each a one-pod Deployment that checkpoints when told.
    let script = "trap 'echo checkpointing; touch \"$(dirname \"$GPUSLICE_SLICE_CONFIG\")/checkpoint-done\"' USR1; while :; do sleep 0.2; done";
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut jobs = std::collections::BTreeMap::new();
    for i in 0..6 {
        let app = format!("job-{i}");
        deployments
            .create(
                &PostParams::default(),
                &queued_deployment(&setup, &app, "batch", script),
            )
            .await
            .unwrap();
        let pod = eventually(&format!("{app} runs"), || {
            let (pods, app) = (pods.clone(), app.clone());
            async move {
                match running_pod(&pods, &app).await {
                    Some(p) => Ok(p),
                    None => Err(pod_states(&pods).await),
                }
            }
        })
        .await;
        jobs.insert(app, pod);
    }
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    let mut claims = std::collections::BTreeMap::new();
    for (app, pod) in &jobs {
        claims.insert(app.clone(), claim_of(&pods, pod).await);
    }
    let on_gpu = eventually("the agent reports the six claims", || {
        let (gpu_nodes, claims) = (gpu_nodes.clone(), claims.clone());
        async move {
            let by_claim = gpu_of_claims(&gpu_nodes).await;
            let on: std::collections::BTreeMap<String, u32> = claims
                .iter()
                .filter_map(|(app, c)| Some((app.clone(), *by_claim.get(c)?)))
                .collect();
            (on.len() == 6)
                .then_some(on)
                .ok_or_else(|| format!("{by_claim:?}"))
        }
    })
    .await;
    // Leave one job on one GPU and two on the other: three of eight slices in use, and all five
    // free ones stranded beside them (fragmentation 100 % over the pool's 30 %).
    let apps_on = |gpu: u32| -> Vec<String> {
        on_gpu
            .iter()
            .filter(|(_, g)| **g == gpu)
            .map(|(a, _)| a.clone())
            .collect()
    };
    let (sparse, full) = if apps_on(0).len() <= apps_on(1).len() {
        (0, 1)
    } else {
        (1, 0)
    };
    let lone = apps_on(sparse)[0].clone();
    let pair: Vec<String> = apps_on(full).into_iter().take(2).collect();
    for app in on_gpu.keys() {
        if *app != lone && !pair.contains(app) {
            deployments
                .delete(app, &DeleteParams::foreground())
                .await
                .unwrap();
        }
    }
    eventually("three jobs hold slices", || {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let n = gpu_of_claims(&gpu_nodes).await.len();
            (n == 3).then_some(()).ok_or_else(|| format!("{n} claims"))
        }
    })
    .await;

    // `gpuslice compact` asks for a round now.
    let out = Command::new(env!("CARGO_BIN_EXE_gpuslice"))
        .args(["compact", "shared-a100"])
        .env("KUBECONFIG", setup.cluster.kubeconfig_path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let refused = Command::new(env!("CARGO_BIN_EXE_gpuslice"))
        .args(["compact", "no-such-pool"])
        .env("KUBECONFIG", setup.cluster.kubeconfig_path())
        .output()
        .unwrap();
    assert!(
        !refused.status.success()
            && String::from_utf8_lossy(&refused.stderr)
                .contains("GpuPool no-such-pool does not exist"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // The round: the lone job moves off its GPU into the other; it took up the annotation.
    let pools: Api<gpuslice_api::GpuPool> = Api::all(client.clone());
    let round = eventually("the pool records the round", || {
        let pools = pools.clone();
        async move {
            let pool = pools.get("shared-a100").await.map_err(|e| e.to_string())?;
            let asked = pool.annotations().get("gpuslice.io/compact-now").cloned();
            match pool.status.and_then(|s| s.compaction) {
                Some(round) if asked.is_some() && round.request == asked => Ok(round),
                other => Err(format!("annotated {asked:?}, {other:?}")),
            }
        }
    })
    .await;
    let sparse_ref = format!("{NODE}/gpu{sparse}");
    assert_eq!(round.trigger, "manual");
    assert_eq!(round.freeing, std::slice::from_ref(&sparse_ref));
    assert_eq!(
        round
            .moves
            .iter()
            .map(|m| (m.resource_claim.as_str(), m.from.as_str(), m.to.as_str()))
            .collect::<Vec<_>>(),
        [(
            claims[&lone].as_str(),
            sparse_ref.as_str(),
            format!("{NODE}/gpu{full}").as_str()
        )]
    );
    // While it moves, nothing new may land on the GPU being emptied.
    let prefix = format!("gpu{sparse}-");
    eventually("the GPU being emptied is tainted", || {
        let (client, prefix) = (client.clone(), prefix.clone());
        async move {
            let all = devices(&client, "gpuslice.io/compacting").await;
            let mine: Vec<_> = all.iter().filter(|d| d.0.starts_with(&prefix)).collect();
            (mine.len() == 4 && mine.iter().all(|d| d.2.is_some()))
                .then_some(())
                .ok_or_else(|| format!("{all:?}"))
        }
    })
    .await;
    // The lone job checkpoints, is evicted, and its Deployment's new pod runs on the other GPU;
    // the pair there was never asked.
    let moved = eventually("the lone job runs again, on the other GPU", || {
        let (pods, gpu_nodes, lone) = (pods.clone(), gpu_nodes.clone(), lone.clone());
        let old = jobs[&lone].clone();
        async move {
            let Some(pod) = running_pod(&pods, &lone).await.filter(|p| *p != old) else {
                return Err(pod_states(&pods).await);
            };
            let Some(claim) = pods
                .get(&pod)
                .await
                .ok()
                .and_then(|p| p.status?.extended_resource_claim_status)
                .map(|c| format!("default/{}", c.resource_claim_name))
            else {
                return Err(format!("{pod} has no claim yet"));
            };
            match gpu_of_claims(&gpu_nodes).await.get(&claim) {
                Some(gpu) if *gpu == full => Ok(pod),
                other => Err(format!("{pod} on {other:?}")),
            }
        }
    })
    .await;
    let old = setup
        .kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == jobs[&lone])
        .unwrap();
    assert!(setup.kubelet.output(&old).contains("checkpointing"));
    for app in &pair {
        assert_eq!(running_pod(&pods, app).await.as_ref(), Some(&jobs[app]));
    }
    let note = eventually("the moved pod's Compacted event", || {
        let (client, old) = (client.clone(), jobs[&lone].clone());
        async move {
            event_note(&client, "Compacted", &old)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "no event".to_string())
        }
    })
    .await;
    assert!(
        note.contains(&format!("emptying {sparse_ref}")) && note.ends_with("checkpoint taken"),
        "{note}"
    );
    // Once the moved pod runs and nothing else is being admitted, the round ends and the GPU,
    // now empty, is open again.
    eventually("the round ends and the GPU is open", || {
        let (client, pools, gpu_nodes) = (client.clone(), pools.clone(), gpu_nodes.clone());
        async move {
            let round = pools
                .get("shared-a100")
                .await
                .map_err(|e| e.to_string())?
                .status
                .and_then(|s| s.compaction);
            let spec = gpu_nodes.get(NODE).await.map_err(|e| e.to_string())?.spec;
            let tainted = devices(&client, "gpuslice.io/compacting")
                .await
                .into_iter()
                .filter(|d| d.2.is_some())
                .count();
            (round.as_ref().is_some_and(|r| r.finished_at.is_some())
                && spec.compacting.is_empty()
                && spec.preemptions.is_empty()
                && tainted == 0)
                .then_some(())
                .ok_or_else(|| format!("{round:?} {spec:?} {tainted} tainted"))
        }
    })
    .await;
    let held = gpu_of_claims(&gpu_nodes).await;
    assert!(
        held.values().all(|g| *g == full) && held.len() == 3,
        "all three jobs on GPU {full}: {held:?} ({moved})"
    );
}

#[tokio::test]
async fn a_pods_kernels_get_no_more_than_its_policys_compute_limit() {
    // One notebook (compute limit 25 %) alone on the GPU, launching 2 ms kernels back to back
    // for 4 s, in a real container (containerd) as user 1000: the shim the CDI spec preloads
    // asks the agent's arbiter for each turn (the agent knows the pod by its cgroup), so the
    // pod gets a quarter of the GPU's time, not all of it.
    let Some(setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let worker = format!(
        "{} bench compute-worker --kernel-us 2000 --seconds 4",
        setup.gpuslice()
    );
    let container = run_pod(&setup, &pods, "kernels", &worker, "Succeeded").await;
    let output = setup.kubelet.output(&container);
    let report: serde_json::Value = output
        .lines()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no report in the container's output:\n{output}"));
    let number = |key: &str| report[key].as_u64().unwrap_or_else(|| panic!("{report}"));
    let busy_ns = number("kernels") * 2_000_000;
    let share = busy_ns as f64 / (number("endNs") - number("startNs")) as f64;
    assert!(
        (0.20..=0.30).contains(&share),
        "the pod's kernels had {:.1} % of the GPU's time (limit 25 %): {report}",
        100.0 * share
    );
}

/// CheckpointPolicy `interval` (here 10 s): a pod is told it, where its marker goes and the
/// signal (the CDI spec's environment), and the agent reads its marker. A pod that writes the
/// marker every 3 s at the path it was told is on time; one that never does gets a
/// `CheckpointOverdue` Event once 15 s have passed, and only one.
#[tokio::test]
async fn a_pod_is_told_its_checkpoint_interval_and_one_that_misses_it_gets_an_event() {
    let Some(setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    apply_policies(
        &setup,
        "apiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {name: standard}\nspec: {interval: 10s, signal: SIGUSR1, gracePeriod: 2m}\n",
        1,
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let punctual = run_pod(
        &setup,
        &pods,
        "punctual",
        "echo \"every $GPUSLICE_CHECKPOINT_INTERVAL s on $GPUSLICE_CHECKPOINT_SIGNAL\"; while :; do touch \"$GPUSLICE_CHECKPOINT_DONE\"; sleep 3; done",
        "Running",
    )
    .await;
    run_pod(
        &setup,
        &pods,
        "forgetful",
        "while :; do sleep 1; done",
        "Running",
    )
    .await;
    let notes = eventually("the forgetful pod told it is overdue", || async {
        let notes = pod_event_notes(&setup.client, "CheckpointOverdue", "forgetful").await?;
        (!notes.is_empty())
            .then_some(notes)
            .ok_or(pod_states(&pods).await)
    })
    .await;
    assert!(
        notes[0].contains("since it took the slice")
            && notes[0].contains("CheckpointPolicy standard asks for one every 10s"),
        "{notes:?}"
    );
    assert!(
        setup
            .kubelet
            .output(&punctual)
            .contains("every 10 s on SIGUSR1"),
        "{}",
        setup.kubelet.output(&punctual)
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        pod_event_notes(&setup.client, "CheckpointOverdue", "forgetful")
            .await
            .unwrap()
            .len(),
        1,
        "told once"
    );
    assert_eq!(
        pod_event_notes(&setup.client, "CheckpointOverdue", "punctual").await,
        Ok(Vec::new())
    );
    let claim = claim_of(&pods, "punctual").await;
    let reports = claim_reports(&Api::all(setup.client.clone())).await;
    assert_eq!(reports.get(&claim).map(|r| r.0), Some(true), "{reports:?}");
}

/// What a drain would lose is the GPU work since a pod's last checkpoint, so the agent says
/// which pods' slices have stopped computing: a pod that ran kernels for 2 s and then only
/// sleeps shows `idleSince` in its GpuNode claim once a minute has passed, and keeps the same
/// time while it stays idle; a pod still launching kernels never shows it.
#[tokio::test]
async fn a_pod_that_stopped_computing_is_reported_idle_and_one_computing_is_not() {
    let Some(setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let kernels = |seconds: u32| {
        format!(
            "{} bench compute-worker --kernel-us 2000 --seconds {seconds}",
            setup.gpuslice()
        )
    };
    run_pod(
        &setup,
        &pods,
        "quiet",
        &format!("{} && sleep 600", kernels(2)),
        "Running",
    )
    .await;
    let started = std::time::Instant::now();
    run_pod(&setup, &pods, "computing", &kernels(600), "Running").await;
    let (quiet, computing) = (
        claim_of(&pods, "quiet").await,
        claim_of(&pods, "computing").await,
    );
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(setup.client.clone());
    let idle_since = |claim: String| {
        let gpu_nodes = gpu_nodes.clone();
        async move {
            let node = gpu_nodes.get(NODE).await.map_err(|e| e.to_string())?;
            let claims = node.status.map(|s| s.claims).unwrap_or_default();
            let reported = claims
                .iter()
                .find(|c| c.resource_claim.as_deref() == Some(claim.as_str()))
                .ok_or(format!("{claim} is not in {claims:?}"))?;
            Ok::<_, String>(reported.idle_since.clone())
        }
    };
    let since = eventually("the quiet pod is reported idle", || {
        let idle = idle_since(quiet.clone());
        async move { idle.await?.ok_or("not idle yet".to_string()) }
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(55),
        "reported idle {:?} after its kernels, before a minute had passed",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        idle_since(quiet).await.unwrap(),
        Some(since),
        "the time moved"
    );
    assert_eq!(idle_since(computing).await.unwrap(), None);
}

/// The shim is a fast path; the agent's memory watchdog is the guarantee. A tenant that
/// erases its slice's memory ledger (the file is the workload's to map, so the shim's count
/// starts from zero again and again) gets past the shim's cap, but not past the driver's own
/// figures: the agent sees the pod's processes hold more than the claim's 9 GiB, stops the
/// biggest with SIGTERM, and tells the pod why in an Event.
#[tokio::test]
async fn a_tenant_that_erases_its_ledger_is_stopped_by_the_agents_watchdog() {
    // In a real container (containerd), as user 1000: the agent finds the process by the pid
    // the driver reports and its pod by its cgroup.
    let Some(setup) = Setup::start(CLOCK, &["--memory-watchdog-interval", "200ms"]).await else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let stop = setup.control.join("stop-eraser");
    // 1 GiB every 200 ms up to 16 GiB, while the rows of the ledger (after its 64-byte header)
    // are zeroed every 50 ms.
    // First, a slice past DRA through the agent's socket (mounted into the container): refused.
    let script = format!(
        "{gpuslice} run --state /run/gpuslice --no-wait -- true; echo run-exit=$?; \
         ledger=\"$(dirname \"$GPUSLICE_SLICE_CONFIG\")/memory\"; \
         {probe} link creep 1024 16384 & p=$!; \
         while kill -0 $p 2>/dev/null; do \
           dd if=/dev/zero of=\"$ledger\" bs=64 seek=1 count=512 conv=notrunc 2>/dev/null; \
           sleep 0.05; \
         done; \
         wait $p; echo creep-ended=$?; \
         until [ -e {stop} ]; do sleep 0.2; done",
        gpuslice = setup.gpuslice(),
        probe = setup.probe(),
        stop = stop.display(),
    );
    let container = run_pod(&setup, &pods, "eraser", &script, "Running").await;
    let output = output_with(&setup, &container, "creep-ended=").await;
    assert!(output.contains("creep-ended=143"), "{output}");
    assert!(
        output.contains("pods get slices through their ResourceClaims")
            && output.contains("run-exit=")
            && !output.contains("run-exit=0"),
        "{output}"
    );
    // It did get past the shim before the agent stopped it: the erasing worked (the shim alone
    // stops it at 8 GiB, its context taking 300 MiB of the 9).
    let most = output
        .lines()
        .filter_map(|l| l.strip_prefix("held="))
        .filter_map(|v| v.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(most >= 9 << 30, "{output}");
    told_why(
        &setup,
        "eraser",
        "GpuMemoryOverCap",
        "more than its cap of 9216 MiB",
        "gpuslice_agent_slice_memory_overruns_total{",
    )
    .await;
    std::fs::write(&stop, "").unwrap();
    wait_for_phases(&pods, &["eraser"], ["Succeeded"]).await;
}

/// A pod that gets the node's GPU past every slice (no claim; the GPU given to it by the
/// container runtime, as the NVIDIA runtime does for an image or `envFrom` that sets
/// `NVIDIA_VISIBLE_DEVICES=all`, which admission cannot see) is found by the agent through
/// NVML, outside every slice of a pool's GPU: its process is stopped with SIGTERM, and the pod
/// evicted (by the operator, which the agent asks: a restarted container would take the GPU
/// again) and told why in an Event; the agent's metric counts it.
#[tokio::test]
async fn a_pod_given_a_gpu_past_its_slice_is_stopped_by_the_agent() {
    let Some(setup) = Setup::start(CLOCK, &["--memory-watchdog-interval", "200ms"]).await else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let configs: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(setup.client.clone(), "default");
    configs
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": "all-gpus"},
                "data": {"NVIDIA_VISIBLE_DEVICES": "all"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let script = format!(
        "{probe} link hold 1024; echo hold-ended=$?; sleep 600",
        probe = setup.probe(),
    );
    let mut pod = setup.pod("stray", &["/bin/sh", "-c", &script]);
    let spec = pod.spec.as_mut().unwrap();
    spec.containers[0].resources = None;
    spec.containers[0].env_from = Some(vec![
        serde_json::from_value(serde_json::json!({"configMapRef": {"name": "all-gpus"}})).unwrap(),
    ]);
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for_phases(&pods, &["stray"], ["Running"]).await;
    let container = setup
        .kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == "stray")
        .unwrap();
    let output = output_with(&setup, &container, "hold-ended=").await;
    assert!(output.contains(&format!("held={}", 1u64 << 30)), "{output}");
    assert!(output.contains("hold-ended=143"), "{output}");
    told_why(
        &setup,
        "stray",
        "GpuProcessWithoutSlice",
        "holds no slice of it",
        "gpuslice_agent_stray_gpu_processes_total{",
    )
    .await;
    eventually("the pod is evicted", || {
        let pods = pods.clone();
        async move {
            match pods.get_opt("stray").await.map_err(|e| e.to_string())? {
                Some(p) if p.metadata.deletion_timestamp.is_none() => {
                    Err(format!("{:?}", p.status.and_then(|s| s.phase)))
                }
                _ => Ok(()),
            }
        }
    })
    .await;
}

/// A pod's workload whose first kernel launch comes while the agent is away (a restart of the
/// DaemonSet's pod, say) does not run ungoverned: its launches wait, and go on under the agent
/// started again.
#[tokio::test]
async fn a_pods_first_launches_wait_for_an_agent_that_is_restarting() {
    // In a real container (containerd), as user 1000: the socket's folder is mounted, so the
    // agent's new socket reaches it.
    let Some(mut setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let go = setup.control.join("go");
    let script = format!(
        "until [ -e {go} ]; do sleep 0.1; done; exec {probe} link spin",
        go = go.display(),
        probe = setup.probe(),
    );
    let container = run_pod(&setup, &pods, "late", &script, "Running").await;
    setup.stop_agent();
    std::fs::write(&go, "").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let output = setup.kubelet.output(&container);
    assert!(
        output.contains("kernel launches wait for it") && !output.contains("launched="),
        "{output}"
    );
    setup.restart_agent();
    eventually("launches go on under the agent started again", || {
        let output = setup.kubelet.output(&container);
        async move {
            (output.contains("launched=") && output.contains("governed again"))
                .then_some(())
                .ok_or(output)
        }
    })
    .await;
    pods.delete("late", &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn an_elastic_pool_re_cuts_a_busy_gpu_only_after_its_pod_checkpointed() {
    // shared-a100 as an elastic pool that may drain checkpointable work: its one GPU in
    // quarters holds a notebook (checkpoint policy `standard`: SIGUSR1, required). A pod that
    // needs a half waits; the operator stages the GPU to halves, the agent has the notebook
    // checkpoint and evicted, and only then re-cuts it; both pods then run on the halves.
    let Some(setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let client = setup.client.clone();
    elastic_a100(&setup, "{slices: 4, memory: 20Gi, compute: 25}", true).await;
    queue_notebook(&setup, "notebook-e").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let first = eventually("the notebook runs on a quarter", || {
        let pods = pods.clone();
        async move {
            running_pod(&pods, "notebook-e")
                .await
                .ok_or(pod_states(&pods).await)
        }
    })
    .await;
    pods.create(
        &PostParams::default(),
        &policy_pod(&setup, "big-e", "big", "while :; do sleep 0.2; done", true),
    )
    .await
    .unwrap();
    // The big pod runs once the GPU is in halves; the notebook's Deployment brings it back on
    // the other half.
    eventually("the big pod and a new notebook run on the halves", || {
        let (pods, client, first) = (pods.clone(), client.clone(), first.clone());
        async move {
            let notebook = running_pod(&pods, "notebook-e").await;
            let big = phase(&pods, "big-e").await;
            let all = devices(&client, "gpuslice.io/recut").await;
            let halves = all.len() == 2 && all.iter().all(|(_, m, _)| m == "40Gi");
            (halves && big == "Running" && notebook.as_ref().is_some_and(|n| *n != first))
                .then_some(())
                .ok_or(format!(
                    "big {big}, notebook {notebook:?}, devices {all:?}{}",
                    pod_states(&pods).await
                ))
        }
    })
    .await;
    // The notebook was told to checkpoint, wrote its marker, and only then was evicted.
    let log = setup.agent_log();
    let signalled = log
        .find("SignalPods")
        .expect("the agent signalled the notebook");
    let evicted = log
        .find(&format!("asking the operator to evict pod default/{first}"))
        .expect("the agent asked for the notebook's eviction");
    assert!(signalled < evicted, "signal, then eviction");
    let eviction = log[evicted..].lines().next().unwrap_or_default();
    assert!(eviction.contains("checkpoint taken"), "{eviction}");
    let pool = Api::<gpuslice_api::GpuPool>::all(client.clone())
        .get("shared-a100")
        .await
        .unwrap();
    let recut = pool
        .status
        .and_then(|s| s.elastic)
        .and_then(|e| e.last_recut)
        .expect("the re-cut recorded");
    assert!(
        recut.reason.contains("quarters → halves (drained)") && recut.reason.contains("big"),
        "{}",
        recut.reason
    );
}

/// `shared-a100` with Git's layout `software` (quarters or halves), its CheckpointPolicy
/// `standard` (SIGUSR1, required), `elastic` or not: quarters or halves by demand, draining
/// checkpointable work; and a policy `big` that only a half holds.
async fn elastic_a100(setup: &Setup, software: &str, elastic: bool) {
    let elastic = if elastic {
        "  elastic:
    shapes:
    - {name: quarters, layout: {software: {slices: 4, memory: 20Gi, compute: 25}}}
    - {name: halves, layout: {software: {slices: 2, memory: 40Gi, compute: 50}}}
    drain: Checkpointable
    forecastHorizon: 0s
"
    } else {
        ""
    };
    let yaml = format!(
        "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {{name: shared-a100}}
spec:
  nodeSelector: {{matchLabels: {{gpuslice.io/pool: shared-a100}}}}
  gpuSelector: {{models: [NVIDIA A100-SXM4-80GB]}}
  layout: {{software: {software}}}
  memoryHeadroom: 1Gi
  checkpointPolicy: standard
  requireNonRoot: true
{elastic}---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {{name: big}}
spec: {{pool: shared-a100, memory: 30Gi, priority: high}}
"
    );
    apply_policies(setup, &yaml, 2).await;
}

/// A one-pod Deployment `name` of notebooks through the queue, whose workload writes its
/// checkpoint marker when told (SIGUSR1).
async fn queue_notebook(setup: &Setup, name: &str) {
    let script = format!(
        "{} link cap; trap 'echo checkpointing; touch \"$(dirname \"$GPUSLICE_SLICE_CONFIG\")/checkpoint-done\"' USR1; while :; do sleep 0.2; done",
        setup.probe()
    );
    Api::<Deployment>::namespaced(setup.client.clone(), "default")
        .create(
            &PostParams::default(),
            &queued_deployment(setup, name, "notebook", &script),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn notebooks_waiting_on_a_gpu_in_halves_get_it_cut_in_quarters_after_checkpoints() {
    // The same pool with Git's layout in halves: two notebooks run on the halves and two more
    // wait. Quarters serve all four (worth one more pod at the notebooks' low priority), so the
    // GPU is drained (each notebook checkpoints, then is evicted) and cut in quarters, and the
    // four run.
    let Some(setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let client = setup.client.clone();
    // Git's halves first, as a plain layout; then the same pool made elastic: the GPU starts
    // in halves, a shape of the set it was never re-cut to.
    let halves = "{slices: 2, memory: 40Gi, compute: 50}";
    elastic_a100(&setup, halves, false).await;
    eventually("the GPU is in halves", || {
        let client = client.clone();
        async move {
            let all = devices(&client, "gpuslice.io/recut").await;
            (all.len() == 2 && all.iter().all(|(_, m, _)| m == "40Gi"))
                .then_some(())
                .ok_or(format!("{all:?}"))
        }
    })
    .await;
    elastic_a100(&setup, halves, true).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let names = ["nb-1", "nb-2", "nb-3", "nb-4"];
    for name in &names[..2] {
        queue_notebook(&setup, name).await;
    }
    eventually("two notebooks run on the halves", || {
        let pods = pods.clone();
        async move {
            let mut running = Vec::new();
            for name in &names[..2] {
                running.extend(running_pod(&pods, name).await);
            }
            (running.len() == 2)
                .then_some(())
                .ok_or(pod_states(&pods).await)
        }
    })
    .await;
    for name in &names[2..] {
        queue_notebook(&setup, name).await;
    }
    eventually("four notebooks run on quarters", || {
        let (pods, client) = (pods.clone(), client.clone());
        async move {
            let mut running = Vec::new();
            for name in names {
                running.extend(running_pod(&pods, name).await);
            }
            let all = devices(&client, "gpuslice.io/recut").await;
            let quarters = all.len() == 4 && all.iter().all(|(_, m, _)| m == "20Gi");
            let elastic = Api::<gpuslice_api::GpuPool>::all(client.clone())
                .get("shared-a100")
                .await
                .ok()
                .and_then(|p| p.status?.elastic);
            (quarters && running.len() == 4)
                .then_some(())
                .ok_or(format!(
                    "running {running:?}, devices {all:?}, pool {elastic:?}{}",
                    pod_states(&pods).await
                ))
        }
    })
    .await;
    let log = setup.agent_log();
    let evictions: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("asking the operator to evict pod default/nb-"))
        .collect();
    assert_eq!(evictions.len(), 2, "{evictions:?}");
    assert!(
        evictions.iter().all(|l| l.contains("checkpoint taken")),
        "{evictions:?}"
    );
    let recut = Api::<gpuslice_api::GpuPool>::all(client.clone())
        .get("shared-a100")
        .await
        .unwrap()
        .status
        .and_then(|s| s.elastic)
        .and_then(|e| e.last_recut)
        .expect("the re-cut recorded");
    assert!(
        recut.reason.contains("halves → quarters (drained)") && recut.reason.contains("notebook"),
        "{}",
        recut.reason
    );
}

/// A CheckpointPolicy's `storage`: the chart's admission mounts the claim into the pods of a
/// policy that names it and tells them where. A pod whose claim does not exist waits in the
/// queue, told why (condition and Event), until it does. Preempted after its checkpoint, the
/// pod's replacement (its Deployment's next pod) finds the checkpoint its predecessor wrote and
/// resumes from it.
#[tokio::test]
async fn a_preempted_pods_replacement_resumes_from_the_checkpoint_in_its_storage() {
    // Day layout of shared-a100: four 20 GiB slices, preemption on.
    let Some(mut setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    let client = setup.client.clone();
    // The chart's admission policy that mounts checkpoint storage, and the operator writing the
    // parameters it reads, as the chart runs it.
    let helm = gpuslice_testcluster::built_tool("GPUSLICE_HELM", "helm", "")
        .expect("helm, as install_chart_identities found it");
    let storage_admission: Vec<serde_json::Value> =
        gpuslice_testcluster::render_chart(&helm, gpuslice_testcluster::CHART_NAMESPACE, &[])
            .into_iter()
            .filter(|d| {
                d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("-checkpoint-storage."))
            })
            .collect();
    assert_eq!(storage_admission.len(), 2, "the policy and its binding");
    gpuslice_testcluster::apply_all(&client, &storage_admission).await;
    let _ = setup.operator.0.kill();
    let _ = setup.operator.0.wait();
    setup.operator = gpuslice_testcluster::spawn_operator(
        env!("CARGO_BIN_EXE_gpuslice"),
        &setup.operator_kubeconfig,
        Some(&setup.clock),
        &[&format!(
            "--admission-params={}/{}-policies",
            gpuslice_testcluster::CHART_NAMESPACE,
            gpuslice_testcluster::CHART_RELEASE
        )],
    );
    let policies = "
apiVersion: gpuslice.io/v1alpha1
kind: CheckpointPolicy
metadata: {name: kept}
spec:
  signal: SIGUSR1
  gracePeriod: 60s
  storage: {persistentVolumeClaim: checkpoints, mountPath: /ckpt}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: trainer}
spec: {pool: shared-a100, memory: 8Gi, priority: low, checkpointPolicy: kept}
";
    apply_policies(&setup, &format!("{policies}{PINNED_AND_URGENT}"), 4).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    // The API server loads the admission policy, and the operator writes its parameters, a
    // moment later: a trainer pod sent as a dry run shows when both are in force.
    let probe = policy_pod(&setup, "probe", "trainer", "true", true);
    eventually("admission mounts the trainer's checkpoint storage", || {
        let (pods, probe) = (pods.clone(), probe.clone());
        async move {
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            let stored = pods.create(&dry, &probe).await.map_err(|e| e.to_string())?;
            let volumes = stored.spec.and_then(|s| s.volumes).unwrap_or_default();
            volumes
                .iter()
                .any(|v| v.name == "gpuslice-checkpoints")
                .then_some(())
                .ok_or(format!("{volumes:?}"))
        }
    })
    .await;

    // The trainer counts steps, resumes from the step in its storage, and on the checkpoint
    // signal writes its step there and says it has checkpointed.
    let trainer = "step=0; \
        if [ -f \"$GPUSLICE_CHECKPOINT_DIR/step\" ]; then step=$(cat \"$GPUSLICE_CHECKPOINT_DIR/step\"); echo \"resumed at step $step from $GPUSLICE_CHECKPOINT_DIR\"; fi; \
        trap 'echo $step > \"$GPUSLICE_CHECKPOINT_DIR/step\"; touch \"$GPUSLICE_CHECKPOINT_DONE\"' USR1; \
        while :; do step=$((step+1)); sleep 0.2; done";
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");
    deployments
        .create(
            &PostParams::default(),
            &queued_deployment(&setup, "trainer", "trainer", trainer),
        )
        .await
        .unwrap();
    // Its claim does not exist yet: it waits, and says what to create.
    let first = eventually("the trainer waits for its storage", || {
        let pods = pods.clone();
        async move {
            let names = app_pods(&pods, "trainer").await;
            let name = names.first().ok_or("no pod yet")?.clone();
            match queued(&pods, &name).await {
                Some((true, reason, message)) if reason == "CheckpointStorageMissing" => {
                    Ok((name, message))
                }
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let (first, message) = first;
    assert!(
        message.contains("PersistentVolumeClaim default/checkpoints")
            && message.contains("CheckpointPolicy kept")
            && message.contains("create it in namespace default"),
        "{message}"
    );
    let notes = pod_event_notes(&client, "CheckpointStorageMissing", &first)
        .await
        .unwrap();
    assert_eq!(notes, [message]);
    // Its CheckpointPolicy says so too.
    let kept_ready = |want: &'static str| {
        let checkpoints: Api<gpuslice_api::CheckpointPolicy> = Api::all(client.clone());
        async move {
            let c = checkpoints.get("kept").await.map_err(|e| e.to_string())?;
            let ready = c
                .status
                .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"))
                .ok_or("no Ready condition")?;
            (ready.reason == want)
                .then_some(ready.message.clone())
                .ok_or(format!("{}: {}", ready.reason, ready.message))
        }
    };
    let missing = eventually(
        "CheckpointPolicy kept says where its claim is missing",
        || kept_ready("StorageClaimMissing"),
    )
    .await;
    assert!(
        missing.contains("\"checkpoints\" does not exist in namespace(s) default, where 1 pod(s)"),
        "{missing}"
    );

    // The claim, bound to a folder of this host (world-writable: the pods run as user 1000).
    let storage = setup.dir.path().join("checkpoints");
    std::fs::create_dir_all(&storage).unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&storage, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let volume = format!(
        "
apiVersion: v1
kind: PersistentVolume
metadata: {{name: checkpoints-pv}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: manual
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {}, type: Directory}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: checkpoints, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: manual
  volumeName: checkpoints-pv
  resources: {{requests: {{storage: 1Gi}}}}
",
        storage.display()
    );
    gpuslice_testcluster::apply_all(&client, &gpuslice_testcluster::documents(&volume)).await;
    wait_for_phases(&pods, &[first.as_str()], ["Running"]).await;
    eventually("CheckpointPolicy kept is in use", || kept_ready("InUse")).await;
    let started = setup
        .kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == first)
        .unwrap();
    assert!(
        !setup.kubelet.output(&started).contains("resumed"),
        "nothing to resume from yet"
    );

    // The three other slices go to pods that may not be preempted; a high-priority pod then
    // takes the trainer's slice, after its checkpoint.
    for i in 0..3 {
        let name = format!("pinned-{i}");
        pods.create(
            &PostParams::default(),
            &policy_pod(
                &setup,
                &name,
                "pinned",
                "while :; do sleep 0.2; done",
                false,
            ),
        )
        .await
        .unwrap();
        wait_for_phases(&pods, &[name.as_str()], ["Running"]).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    pods.create(
        &PostParams::default(),
        &policy_pod(
            &setup,
            "urgent",
            "urgent",
            "while :; do sleep 0.2; done",
            true,
        ),
    )
    .await
    .unwrap();
    wait_for_phases(&pods, &["urgent", first.as_str()], ["Running", "gone"]).await;
    let step: u64 = std::fs::read_to_string(storage.join("step"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        step > 0,
        "the trainer had counted steps before its checkpoint"
    );

    // Its replacement waits while the urgent pod holds the slice, then resumes where it left off.
    pods.delete("urgent", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let second = eventually("the trainer's replacement runs", || {
        let (pods, first) = (pods.clone(), first.clone());
        async move {
            running_pod(&pods, "trainer")
                .await
                .filter(|p| *p != first)
                .ok_or(pod_states(&pods).await)
        }
    })
    .await;
    let resumed = setup
        .kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == second)
        .unwrap();
    output_with(
        &setup,
        &resumed,
        &format!("resumed at step {step} from /ckpt"),
    )
    .await;
}

/// The names of Deployment `app`'s pods.
async fn app_pods(pods: &Api<Pod>, app: &str) -> Vec<String> {
    pods.list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .map(|l| l.items.into_iter().map(|p| p.name_any()).collect())
        .unwrap_or_default()
}

/// The node's pool as two whole GPUs (replacing the example's software layout), preempting.
const WHOLE_A100S: &str = "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: shared-a100}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: shared-a100}}
  layout: {exclusive: {}}
  scheduling: {policy: PriorityFair, preemption: true}
";

/// `count > 1` in a real container (issue #37): on a node of two whole A100s, a pod of a policy
/// with `count: 2` asks for both; the queue admits it once both are free, the kubelet plugin
/// prepares its one claim of two devices, and the container sees both GPUs (the CDI spec's
/// claim-wide `CUDA_VISIBLE_DEVICES`, not the one device's a runtime would apply last).
#[tokio::test]
async fn a_pod_of_two_whole_gpus_sees_both_in_its_container() {
    let Some(setup) = Setup::start_with_gpus(CLOCK, &[], 2).await else {
        return;
    };
    let duo = "---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: duo}
spec: {pool: shared-a100, memory: 70Gi, count: 2}
";
    apply_policies(&setup, &format!("{WHOLE_A100S}{duo}"), 2).await;
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let pod = policy_pod_of(
        &setup,
        "duo-0",
        "duo",
        2,
        "echo \"cuda=$CUDA_VISIBLE_DEVICES\"; echo \"nvidia=$NVIDIA_VISIBLE_DEVICES\"",
        true,
    );
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for_phases(&pods, &["duo-0"], ["Succeeded"]).await;
    let container = setup
        .kubelet
        .containers()
        .into_iter()
        .find(|c| c.pod == "duo-0")
        .unwrap();
    let output = setup.kubelet.output(&container);
    let uuid = |slice: &str| -> String {
        let config: serde_json::Value = serde_json::from_slice(
            &std::fs::read(setup.state.join("slices").join(slice).join("config")).unwrap(),
        )
        .unwrap();
        config["deviceUuid"].as_str().unwrap().to_string()
    };
    let both: std::collections::BTreeSet<String> = [uuid("gpu0"), uuid("gpu1")].into();
    for variable in ["cuda", "nvidia"] {
        let seen: std::collections::BTreeSet<String> = output
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{variable}=")))
            .unwrap_or_else(|| panic!("no {variable}= line in:\n{output}"))
            .split(',')
            .map(str::to_string)
            .collect();
        assert_eq!(seen, both, "{variable}: {output}");
    }
}

/// Preemption for a pod of several slices (issue #37): on a node of two whole A100s, each held
/// by a low-priority pod, a high-priority pod of `count: 2` takes both back (taking one alone
/// would seat it nowhere), each victim asked to checkpoint and evicted once it has, and runs on
/// both GPUs.
#[tokio::test]
async fn a_two_gpu_pod_takes_back_both_gpus_it_needs_after_their_checkpoints() {
    let Some(setup) = Setup::start_with_gpus(CLOCK, &[], 2).await else {
        return;
    };
    let policies = "---
apiVersion: gpuslice.io/v1alpha1
kind: CheckpointPolicy
metadata: {name: quick}
spec: {signal: SIGUSR1, gracePeriod: 30s}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: solo}
spec: {pool: shared-a100, memory: 70Gi, priority: low, checkpointPolicy: quick}
---
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: duo}
spec: {pool: shared-a100, memory: 70Gi, count: 2, priority: high, preemptible: false}
";
    // The examples' notebook, solo and duo.
    apply_policies(&setup, &format!("{WHOLE_A100S}{policies}"), 3).await;
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    let checkpoints = "trap 'echo checkpointing; touch \"$GPUSLICE_CHECKPOINT_DONE\"' USR1; while :; do sleep 0.2; done";
    for name in ["solo-0", "solo-1"] {
        pods.create(
            &PostParams::default(),
            &policy_pod(&setup, name, "solo", checkpoints, false),
        )
        .await
        .unwrap();
    }
    wait_for_phases(&pods, &["solo-0", "solo-1"], ["Running", "Running"]).await;
    let duo = policy_pod_of(
        &setup,
        "duo-0",
        "duo",
        2,
        "while :; do sleep 0.2; done",
        true,
    );
    pods.create(&PostParams::default(), &duo).await.unwrap();
    eventually("duo-0 runs on both GPUs, the solos are gone", || {
        let pods = pods.clone();
        async move {
            let states = [
                phase(&pods, "duo-0").await,
                phase(&pods, "solo-0").await,
                phase(&pods, "solo-1").await,
            ];
            (states == ["Running", "gone", "gone"])
                .then_some(())
                .ok_or_else(|| format!("{states:?}"))
        }
    })
    .await;
    for name in ["solo-0", "solo-1"] {
        let note = event_note(&setup.client, "Preempted", name)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no Preempted event for {name}"));
        assert!(
            note.contains("for pod default/duo-0") && note.ends_with("checkpoint taken"),
            "{name}: {note}"
        );
    }
}

const MPS_A100: &str = "
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: shared-a100}
spec:
  nodeSelector: {matchLabels: {gpuslice.io/pool: shared-a100}}
  layout: {mps: {slices: 2, memory: 40Gi, compute: 50}}
  memoryHeadroom: 1Gi
  requireNonRoot: true
";

/// MPS slices in real containers (issue #37): on a pool whose layout is `mps` (half the SMs per
/// slice), the agent runs the GPU's MPS control daemon, and the CDI spec gives each pod the
/// daemon's pipe directory (at CUDA's default, read-only), its share of the SMs (its policy's
/// limit, 25 %, being lower than the slice's) and its pinned memory limit. Two pods, as user
/// 1000, launch 2 ms kernels back to back for 3 s: every kernel the GPU ran meanwhile ran on a
/// quarter of the SMs (MPS clients side by side; a client outside MPS would show the whole GPU).
#[tokio::test]
async fn pods_on_an_mps_pool_run_side_by_side_through_the_nodes_mps_daemon() {
    mps_pods_run_side_by_side(MPS_A100, "gpu0").await;
}

/// The same inside a MIG instance (`mig.mps`): the A100's one 7g instance in two MPS slices,
/// shared through the instance's own daemon; the pods see the MIG device, and their kernels run
/// side by side on the instance, each on a quarter of its SMs (the policy's limit).
#[tokio::test]
async fn pods_on_mps_slices_of_a_mig_instance_run_side_by_side_through_its_daemon() {
    let pool = MPS_A100.replace(
        "layout: {mps: {slices: 2, memory: 40Gi, compute: 50}}",
        "layout: {mig: {profiles: {7g.80gb: 1}, mps: {slices: 2}}}",
    );
    mps_pods_run_side_by_side(&pool, "gpu0-mig0-7g.80gb").await;
}

/// Two pods on the MPS slices of `device` (the daemon's name: `gpu0` or a MIG instance's slice
/// id) of the pool `pool`: see the tests above.
async fn mps_pods_run_side_by_side(pool: &str, device: &str) {
    let Some(setup) = Setup::start(CLOCK, &[]).await else {
        return;
    };
    apply_policies(&setup, pool, 1).await;
    let control = gpuslice_contract::StateDir::new(&setup.state)
        .mps_pipe(device)
        .join("control");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !control.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no MPS daemon:\n{}",
            setup.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The agent's metrics say the daemon runs (after the pass that started it).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, metrics) = gpuslice_testcluster::local_get(setup.metrics_port, "/metrics").unwrap();
        if metrics
            .lines()
            .any(|l| l.starts_with("gpuslice_agent_mps_daemon_up{") && l.ends_with(" 1"))
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no mps_daemon_up 1 in:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        mps_tool().is_some_and(|t| t.exists()),
        "the emulated nvidia-cuda-mps-control is not built: cargo build --workspace"
    );
    let pid_file = gpuslice_contract::StateDir::new(&setup.state)
        .mps_pipe(device)
        .join("nvidia-cuda-mps-control.pid");
    // The device's timeline: the GPU's, or its instance's.
    let machine = gpuslice_emulator::Store::open(&setup.machine)
        .unwrap()
        .snapshot()
        .unwrap();
    let (key, visible) = match machine.gpus[0].instances.first() {
        Some(instance) => (
            gpuslice_emulator::device_key(0, Some(instance.id)),
            instance.uuid.clone(),
        ),
        None => (
            gpuslice_emulator::device_key(0, None),
            machine.gpus[0].uuid.clone(),
        ),
    };
    let daemon = std::fs::read_to_string(&pid_file).unwrap();
    let pods: Api<Pod> = Api::namespaced(setup.client.clone(), "default");
    // Both start their kernels at the same moment, a while after they are created.
    let start = gpuslice_emulator::timeline::now_ns() + 10_000_000_000;
    // What a tenant tries first: plant a file where the daemon's socket is, and tell the
    // daemon to quit (or to give every client all the SMs).
    let script = format!(
        "echo \"mps=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,$CUDA_MPS_PIPE_DIRECTORY,$CUDA_VISIBLE_DEVICES\"; \
         ls \"$CUDA_MPS_PIPE_DIRECTORY\"; \
         touch \"$CUDA_MPS_PIPE_DIRECTORY/planted\" 2>/dev/null && echo planted=yes || echo planted=no; \
         echo set_default_active_thread_percentage 100 | {IMAGE_MPS_TOOL}; echo \"set-status=$?\"; \
         echo quit | {IMAGE_MPS_TOOL}; echo \"quit-status=$?\"; \
         exec {} bench compute-worker --kernel-us 2000 --seconds 3 --start-at {start}",
        setup.gpuslice()
    );
    let names = ["infer-a", "infer-b"];
    for name in names {
        pods.create(
            &PostParams::default(),
            &setup.pod(name, &["/bin/sh", "-c", &script]),
        )
        .await
        .unwrap();
    }
    wait_for_phases(&pods, &names, ["Succeeded", "Succeeded"]).await;
    let mut spans = Vec::new();
    let mut outputs = String::new();
    for name in names {
        let container = setup
            .kubelet
            .containers()
            .into_iter()
            .find(|c| c.pod == name)
            .unwrap();
        let output = setup.kubelet.output(&container);
        outputs.push_str(&output);
        let told = output
            .lines()
            .find_map(|l| l.strip_prefix("mps="))
            .unwrap_or_else(|| panic!("no mps= line in:\n{output}"));
        let told: Vec<&str> = told.split(',').collect();
        assert_eq!(told[0], "25", "the policy's limit: {output}");
        assert!(
            told[1].starts_with("0=") && told[1].ends_with('M'),
            "{output}"
        );
        assert_eq!(told[2], gpuslice_contract::paths::MPS_PIPE_IN_CONTAINER);
        assert_eq!(told[3], visible, "the device shared through MPS: {output}");
        for line in ["control", "planted=no", "set-status=1", "quit-status=1"] {
            assert!(
                output.lines().any(|l| l == line),
                "no {line:?} in:\n{output}"
            );
        }
        let report: serde_json::Value = output
            .lines()
            .find(|l| l.starts_with('{'))
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no report in:\n{output}"));
        spans.push((
            report["startNs"].as_u64().unwrap(),
            report["endNs"].as_u64().unwrap(),
        ));
    }
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap(),
        daemon,
        "the node's daemon still runs, the same one"
    );
    let (from, to) = (
        spans.iter().map(|s| s.0).max().unwrap(),
        spans.iter().map(|s| s.1).min().unwrap(),
    );
    assert!(to > from + 1_000_000_000, "the two ran together: {spans:?}");
    let timeline = gpuslice_emulator::timeline::Timeline::open(
        &gpuslice_emulator::timeline::timeline_path(&setup.machine, key),
    )
    .unwrap();
    let together: Vec<_> = timeline
        .intervals()
        .into_iter()
        .filter(|k| k.start < to && k.end > from)
        .collect();
    assert!(
        together.iter().all(|k| k.share == 25),
        "every kernel on a quarter of the SMs: {:?}\n{outputs}",
        together.iter().find(|k| k.share != 25)
    );
    // Side by side, each client runs an 8 ms kernel at a time: twice the count of one.
    let seconds = (to - from) as f64 / 1e9;
    assert!(
        together.len() as f64 > 1.6 * seconds / 0.008,
        "{} kernels in {seconds:.1} s",
        together.len()
    );
}
