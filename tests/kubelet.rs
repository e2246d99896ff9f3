//! The kubelet side of workloads on slices, with a real kubelet: the control plane (API server,
//! scheduler, controller-manager, etcd), the operator, one agent on an emulated A100, and the
//! kubelet of its node on our test runtime (the kubelet's fake CRI server, which also resolves
//! CDI devices with the CDI library, validates their specs against the CDI schema, and runs each
//! container's command as a local process with the CDI edits applied).
//!
//! What a user of the cluster sees: a pod asking for a policy's slice runs with the slice given
//! through CDI, its CUDA capped at the policy's memory though nothing in the pod names the shim;
//! the slice is released when the pod ends or is deleted; the kubelet restarted does not prepare
//! a claim again.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpuslice_testcluster::{Components, ControlPlane, KillOnDrop, Kubelet, eventually};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const NODE: &str = "gpu-a";
const CLOCK: &str = "2026-12-02T10:00:00Z";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Prints the kubelet's, the runtime's and the agent's logs when a test fails.
struct LogsOnPanic<'a> {
    kubelet: &'a Kubelet,
    agent_log: std::path::PathBuf,
}

impl Drop for LogsOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let agent = std::fs::read_to_string(&self.agent_log).unwrap_or_default();
            let tail: Vec<&str> = agent.lines().rev().take(60).collect();
            eprintln!(
                "{}----- agent -----\n{}",
                self.kubelet.logs(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

async fn apply_examples(client: &Client, files: &[&str]) {
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .unwrap();
    for file in files {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
            gpuslice_testcluster::apply_document(client, &discovery, &value, false)
                .await
                .unwrap_or_else(|| panic!("{file}: no such kind"))
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }
}

/// A pod asking for one `notebook` slice by the policy's extended resource, running `command`
/// with the emulated CUDA driver (what the NVIDIA container runtime would bring) on its path.
fn pod(name: &str, command: &[&str], lib: &Path, machine: &Path) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "kubelet-test"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "containers": [{
                "name": "main",
                "image": "example.com/notebook:1",
                "command": command,
                "env": [
                    {"name": "LD_LIBRARY_PATH", "value": lib},
                    {"name": "GPUSLICE_EMULATOR_STATE", "value": machine},
                ],
                "resources": {"limits": {"gpuslice.io/notebook": "1"}}
            }]
        }
    }))
    .unwrap()
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
    let results = claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
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
    let Some(cluster) = ControlPlane::start(Components::all()).await.unwrap() else {
        return;
    };
    let Some(mut kubelet) = cluster
        .start_kubelet(NODE, &[("gpuslice.io/pool", "shared-a100")])
        .await
        .unwrap()
    else {
        return;
    };
    let client = cluster.client().await.unwrap();
    gpuslice_testcluster::install_crds(&client, &root().join("crds"))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("node.yaml");
    std::fs::write(
        &node_file,
        format!("name: {NODE}\ngpus:\n- {{index: 0, model: NVIDIA A100-SXM4-80GB}}\n"),
    )
    .unwrap();
    let state = dir.path().join("state");
    let agent_log = dir.path().join("agent.log");
    let _agent = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_gpuslice"))
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
            .arg(&state)
            .arg("--kubelet-dir")
            .arg(kubelet.root_dir())
            .arg("--cdi-dir")
            .arg(kubelet.cdi_dir())
            .env("KUBECONFIG", cluster.kubeconfig_path())
            .env("GPUSLICE_CLOCK_START", CLOCK)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&agent_log).unwrap())
            .spawn()
            .unwrap(),
    );
    let _operator = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_gpuslice"))
            .arg("operator")
            .env("KUBECONFIG", cluster.kubeconfig_path())
            .env("GPUSLICE_CLOCK_START", CLOCK)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    apply_examples(
        &client,
        &[
            "examples/gitops/policies/checkpoint-standard.yaml",
            "examples/gitops/pools/shared-a100.yaml",
            "examples/gitops/policies/notebook.yaml",
        ],
    )
    .await;

    let (program, lib) =
        gpuslice_testcluster::build_probe(Path::new(env!("CARGO_BIN_EXE_gpuslice")), dir.path());
    let machine = gpuslice_contract::StateDir::new(&state).emulated_machine(NODE);
    let probe = program.to_str().unwrap();
    let logs = LogsOnPanic {
        kubelet: &kubelet,
        agent_log: agent_log.clone(),
    };

    // Three notebooks that check their GPU, then wait until told to end.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let names = ["notebook-0", "notebook-1", "notebook-2"];
    let stop = |name: &str| dir.path().join(format!("stop-{name}"));
    for name in names {
        let script = format!(
            "{probe} link cap && until [ -e {} ]; do sleep 0.2; done",
            stop(name).display()
        );
        pods.create(
            &PostParams::default(),
            &pod(name, &["/bin/sh", "-c", &script], &lib, &machine),
        )
        .await
        .unwrap();
    }
    wait_for_phases(&pods, &names, ["Running"; 3]).await;

    // The kubelet passed each pod exactly the CDI device the agent prepared for its claim; the
    // runtime found it in a spec that is valid CDI; each pod has its own slice.
    let containers = kubelet.containers();
    assert_eq!(containers.len(), 3, "{containers:#?}");
    let mut devices = BTreeSet::new();
    for c in &containers {
        assert_eq!(c.cdi_devices, [cdi_id(&client, &c.pod).await], "{c:#?}");
        assert_eq!(c.cdi_specs.len(), 1, "{c:#?}");
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
            let output = kubelet.output(c);
            async move {
                output
                    .contains("alloc_over=")
                    .then_some(output.clone())
                    .ok_or(output)
            }
        })
        .await;
        assert_eq!(value(&output, "info_total"), 9 << 30, "{output}");
        assert_eq!(value(&output, "chunks"), 8, "{output}");
        assert_ne!(value(&output, "alloc_over"), 0, "{output}");
    }
    assert_eq!(devices.len(), 3, "one slice per pod: {containers:#?}");
    let gpu_nodes: Api<gpuslice_api::GpuNode> = Api::all(client.clone());
    wait_for_holders(&gpu_nodes, &kubelet, &names).await;

    // A pod that ends gives its slice back; so does a pod deleted.
    std::fs::write(stop("notebook-0"), "").unwrap();
    wait_for_phases(&pods, &names, ["Succeeded", "Running", "Running"]).await;
    wait_for_holders(&gpu_nodes, &kubelet, &["notebook-1", "notebook-2"]).await;
    pods.delete("notebook-1", &DeleteParams::default())
        .await
        .unwrap();
    wait_for_holders(&gpu_nodes, &kubelet, &["notebook-2"]).await;

    // The kubelet restarted: the running pod's claim is not prepared again, its container not
    // created again.
    let claim_uid = containers
        .iter()
        .find(|c| c.pod == "notebook-2")
        .map(|c| c.cdi_devices[0].trim_start_matches("gpuslice.io/slice="))
        .and_then(|id| id.get(..36))
        .unwrap()
        .to_string();
    let asked = || {
        std::fs::read_to_string(&agent_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("NodePrepareResources:") && l.contains(&claim_uid))
            .count()
    };
    assert_eq!(asked(), 1);
    drop(logs);
    kubelet.restart(&cluster).await.unwrap();
    let logs = LogsOnPanic {
        kubelet: &kubelet,
        agent_log: agent_log.clone(),
    };
    // Two of the kubelet's sync periods (5 s), in which a kubelet that lost track would prepare.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(asked(), 1, "the restarted kubelet prepared the claim again");
    assert_eq!(phase(&pods, "notebook-2").await, "Running");
    assert_eq!(kubelet.containers().len(), 3);

    std::fs::write(stop("notebook-2"), "").unwrap();
    wait_for_phases(&pods, &names, ["Succeeded", "gone", "Succeeded"]).await;
    wait_for_holders(&gpu_nodes, &kubelet, &[]).await;
    drop(logs);
}

async fn wait_for_phases(pods: &Api<Pod>, names: &[&str], want: [&str; 3]) {
    eventually(&format!("the notebooks are {want:?}"), || async move {
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
