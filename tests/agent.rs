//! `gpuslice agent --once` as a user runs it, against emulated nodes: a dry run changes nothing,
//! `--apply` converges and a second pass finds nothing to do, a window change keeps what can stay,
//! a GPU in use blocks, and an invalid source changes nothing.

use std::path::Path;
use std::process::{Command, Output};

use gpuslice_testcluster::repo_root as root;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

fn agent(state: &Path, node: &str, at: &str, apply: bool, source: &Path) -> (Output, Value) {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "agent", "--once", "--output", "json", "--at", at, "--source",
    ])
    .arg(source)
    .arg("--emulate")
    .arg(root().join("examples/nodes").join(node))
    .arg("--state")
    .arg(state)
    // Pools' dataset caches, for /var/lib/gpuslice/cache.
    .arg("--cache-root")
    .arg(state.join("caches"));
    if apply {
        cmd.arg("--apply");
    }
    let out = cmd.output().unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out, json)
}

fn outcome(pass: &Value, gpu: u64) -> &Value {
    pass["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["index"] == gpu)
        .unwrap()
}

fn emulated(state: &Path, node: &str) -> Value {
    serde_json::from_slice(&std::fs::read(state.join(format!("emulated-{node}.json"))).unwrap())
        .unwrap()
}

#[test]
fn the_agent_converges_an_emulated_h200_node_across_a_window_change() {
    let state = tempfile::tempdir().unwrap();
    let source = root().join("examples/gitops");
    let day = "2026-12-02T10:00:00Z";

    let (out, dry) = agent(state.path(), "h200-node.yaml", day, false, &source);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(outcome(&dry, 0)["ops"][0]["op"], "enableMig");
    assert_eq!(
        emulated(state.path(), "h200-node-1")["gpus"][0]["mig_enabled"],
        false,
        "a dry run changes nothing"
    );

    let (out, applied) = agent(state.path(), "h200-node.yaml", day, true, &source);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(outcome(&applied, 0)["converged"], true);
    assert_eq!(
        emulated(state.path(), "h200-node-1")["gpus"][0]["instances"]
            .as_array()
            .unwrap()
            .len(),
        4
    );

    let (_, again) = agent(state.path(), "h200-node.yaml", day, true, &source);
    assert_eq!(
        outcome(&again, 0)["ops"],
        Value::Array(vec![]),
        "nothing left to do"
    );

    // 22:00 UTC is 23:00 in Berlin on a Wednesday: the night window wants whole GPUs.
    let (out, night) = agent(
        state.path(),
        "h200-node.yaml",
        "2026-12-02T22:00:00Z",
        true,
        &source,
    );
    assert!(out.status.success());
    assert_eq!(outcome(&night, 1)["converged"], true);
    let gpus = emulated(state.path(), "h200-node-1");
    let instances = gpus["gpus"][1]["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 1);
    assert_eq!(instances[0]["placement"]["size"], 8);

    // One slice directory per instance now there; the day's are gone. The config names the MIG
    // device the emulated NVML reports, and no workload can rewrite it.
    let mut slices: Vec<String> = std::fs::read_dir(state.path().join("slices"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    slices.sort();
    assert_eq!(slices, ["gpu0-mig0-7g.141gb", "gpu1-mig0-7g.141gb"]);
    let config = state.path().join("slices/gpu1-mig0-7g.141gb/config");
    let text: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    assert_eq!(text["kind"], "mig");
    assert_eq!(text["deviceUuid"], instances[0]["uuid"]);
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&config).unwrap().permissions().mode();
    assert_eq!(mode & 0o222, 0, "read-only: {mode:o}");
}

#[test]
fn a_gpu_in_use_blocks_and_an_invalid_source_changes_nothing() {
    let state = tempfile::tempdir().unwrap();
    let (out, pass) = agent(
        state.path(),
        "a100-node.yaml",
        "2026-12-02T10:00:00+08:00",
        true,
        &root().join("examples/gitops"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(outcome(&pass, 0)["converged"], true);
    let busy = outcome(&pass, 3);
    assert_eq!(busy["blockedBy"][0]["kind"], "gpu");
    assert_eq!(busy["converged"], false);
    assert_eq!(
        std::fs::read_to_string(state.path().join("gpu-0.slices.json"))
            .unwrap()
            .matches("\"id\"")
            .count(),
        4
    );
    assert!(!state.path().join("gpu-3.slices.json").exists());
    let config: Value =
        serde_json::from_slice(&std::fs::read(state.path().join("slices/gpu0-s3/config")).unwrap())
            .unwrap();
    assert_eq!(config["kind"], "software");
    assert_eq!(config["memoryBytes"], 20u64 << 30);
    assert_eq!(config["computePercent"], 25);
    assert!(config["deviceUuid"].as_str().unwrap().starts_with("GPU-"));

    let broken = tempfile::tempdir().unwrap();
    std::fs::copy(
        root().join("tests/corpus/invalid/pool-unknown-time-zone.yaml"),
        broken.path().join("pool.yaml"),
    )
    .unwrap();
    let (out, _) = agent(
        state.path(),
        "a100-node.yaml",
        "2026-12-02T10:00:00+08:00",
        true,
        broken.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not an IANA time zone") && err.contains("nothing changed"),
        "{err}"
    );
}

/// A one-GPU H200 node in the h200-mig pool, written where the test can point the agent.
fn one_gpu_node(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("node.yaml");
    std::fs::write(
        &path,
        "name: crash-node\nlabels: {gpuslice.io/pool: h200-mig}\ngpus:\n- {index: 0, model: NVIDIA H200}\n",
    )
    .unwrap();
    path
}

fn run_agent(state: &Path, node: &Path, at: &str) -> Output {
    Command::new(BIN)
        .args([
            "agent", "--once", "--apply", "--output", "json", "--at", at, "--source",
        ])
        .arg(root().join("examples/gitops"))
        .arg("--emulate")
        .arg(node)
        .arg("--state")
        .arg(state)
        // Pools' dataset caches, for /var/lib/gpuslice/cache.
        .arg("--cache-root")
        .arg(std::path::Path::new(&state).join("caches"))
        .output()
        .unwrap()
}

fn machine(state: &Path) -> gpuslice_emulator::Machine {
    gpuslice_emulator::Store::open(&state.join("emulated-crash-node.json"))
        .unwrap()
        .snapshot()
        .unwrap()
}

/// What a GPU holds: (profile id, placement start, size) per instance, sorted, after checking
/// that each instance has exactly one compute instance (none orphaned, none doubled).
fn layout(m: &gpuslice_emulator::Machine) -> Vec<(u32, u32, u32)> {
    let gpu = m.gpu(0).unwrap();
    for i in &gpu.instances {
        assert_eq!(
            i.compute_instances.len(),
            1,
            "instance at {:?} has {} compute instances",
            i.placement,
            i.compute_instances.len()
        );
    }
    let mut out: Vec<_> = gpu
        .instances
        .iter()
        .map(|i| (i.profile_id, i.placement.start, i.placement.size))
        .collect();
    out.sort_unstable();
    out
}

const DAY: &str = "2026-12-02T10:00:00Z";
const NIGHT: &str = "2026-12-02T22:00:00Z";

#[test]
fn a_crash_or_an_nvml_error_at_any_step_converges_on_the_next_run() {
    use gpuslice_emulator::{Fault, FaultAction, NvmlError, Store};

    // A clean run of both transitions: how many mutating calls each takes, and where it ends.
    let clean = tempfile::tempdir().unwrap();
    let node = one_gpu_node(clean.path());
    assert!(run_agent(clean.path(), &node, DAY).status.success());
    let day = machine(clean.path());
    assert!(run_agent(clean.path(), &node, NIGHT).status.success());
    let night = machine(clean.path());
    let transitions = [
        (None, DAY, day.mutations, layout(&day)),
        (
            Some(DAY),
            NIGHT,
            night.mutations - day.mutations,
            layout(&night),
        ),
    ];
    assert!(day.mutations >= 5 && night.mutations > day.mutations);

    for (before, at, steps, want) in transitions {
        for step in 1..=steps {
            for action in [
                FaultAction::KillBefore,
                FaultAction::KillAfter,
                FaultAction::Fail(NvmlError::Unknown),
            ] {
                let what = format!("{at}: {action:?} at step {step} of {steps}");
                let dir = tempfile::tempdir().unwrap();
                let node = one_gpu_node(dir.path());
                if let Some(earlier) = before {
                    assert!(run_agent(dir.path(), &node, earlier).status.success());
                } else {
                    // Seed the emulated node, as the agent would, to arm the fault before it runs.
                    let inventory: gpuslice_api::NodeInventory =
                        serde_yaml::from_str(&std::fs::read_to_string(&node).unwrap()).unwrap();
                    Store::create(
                        &dir.path().join("emulated-crash-node.json"),
                        &gpuslice_emulator::Machine::from_inventory(&inventory).unwrap(),
                    )
                    .unwrap();
                }
                let store = Store::open(&dir.path().join("emulated-crash-node.json")).unwrap();
                store
                    .update(|m| {
                        m.faults.push(Fault {
                            at: m.mutations + step,
                            action: action.clone(),
                        })
                    })
                    .unwrap();

                let failed = run_agent(dir.path(), &node, at);
                assert!(!failed.status.success(), "{what}: the run must fail");
                if let FaultAction::Fail(_) = action {
                    let pass: Value = serde_json::from_slice(&failed.stdout).unwrap();
                    let error = outcome(&pass, 0)["error"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    assert!(
                        error.contains("nvml") && error.contains("internal driver error"),
                        "{what}: {error}"
                    );
                }

                let again = run_agent(dir.path(), &node, at);
                assert!(
                    again.status.success(),
                    "{what}: {}",
                    String::from_utf8_lossy(&again.stdout)
                );
                let pass: Value = serde_json::from_slice(&again.stdout).unwrap();
                assert_eq!(outcome(&pass, 0)["converged"], true, "{what}");
                assert_eq!(layout(&machine(dir.path())), want, "{what}");
            }
        }
    }
}
