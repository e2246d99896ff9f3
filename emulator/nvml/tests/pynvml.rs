//! A monitoring tool written against nvidia-ml-py (`tests/monitor.py`, in the style of
//! nvidia-smi and gpustat) runs unchanged on the emulator: pynvml loads `libnvidia-ml.so.1` from
//! the library path, as on a real node, and every device answers with the values the emulated
//! GPUs' timelines and ledgers give. Inside a slice (the shim preloaded) it sees the slice's cap.
//!
//! The Python comes from `GPUSLICE_TEST_PYTHON` (`.ci/run` points it at a venv with
//! nvidia-ml-py), else `python3`. Without Python or pynvml the tests print why and skip, except
//! under `CI`, where they fail.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuslice_emulator::shm::{Ledger, Process};
use gpuslice_emulator::timeline::{Timeline, now_ns, timeline_path};
use gpuslice_emulator::{Machine, Store, cuda_ledger_path, device_key};
use serde_json::Value;

const GIB: u64 = 1 << 30;
const MS: u64 = 1_000_000;

/// The Python with pynvml, or `None` (after saying why) when this machine has none.
fn python() -> Option<String> {
    let python = std::env::var("GPUSLICE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let why = match Command::new(&python).args(["-c", "import pynvml"]).output() {
        Ok(out) if out.status.success() => return Some(python),
        Ok(out) => format!(
            "{python} cannot import pynvml (pip install nvidia-ml-py): {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ),
        Err(e) => format!("{python} cannot run: {e}"),
    };
    assert!(
        std::env::var_os("CI").is_none(),
        "{why}; CI must run this test (.ci/run installs nvidia-ml-py and sets GPUSLICE_TEST_PYTHON)"
    );
    println!("SKIPPED: {why}");
    None
}

fn deps() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// An emulated node: two H200s (the second in MIG mode with one 3g instance) and an A100 with a
/// seeded process; a lib directory holding the emulator as `libnvidia-ml.so.1` (a copy, as a
/// driver install has) and the shim.
struct Node {
    dir: tempfile::TempDir,
    state: PathBuf,
}

impl Node {
    fn new() -> Node {
        Node::of(
            "name: n
gpus:
- {index: 0, model: NVIDIA H200, uuid: GPU-aaaa}
- {index: 1, model: NVIDIA A100-SXM4-80GB, processes: [{pid: 4242, memory: 10Gi}]}
- index: 2
  model: NVIDIA H200
  mig: {enabled: true, instances: [{profile: 3g.71gb, placement: {start: 4, size: 4}, uuid: MIG-bbbb}]}
",
        )
    }

    /// The node `inventory` (YAML) describes.
    fn of(inventory: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        for (name, built) in [
            ("libnvidia-ml.so.1", "libnvidia_ml.so"),
            ("libgpuslice.so", "libgpuslice.so"),
        ] {
            std::fs::copy(deps().join(built), lib.join(name)).unwrap();
        }
        let node: gpuslice_api::NodeInventory = serde_yaml::from_str(inventory).unwrap();
        let state = dir.path().join("machine.json");
        Store::create(&state, &Machine::from_inventory(&node).unwrap()).unwrap();
        Node { dir, state }
    }

    /// Runs the tool; its header and one JSON value per device.
    fn monitor(&self, python: &str, env: &[(&str, &Path)]) -> (Value, Vec<Value>) {
        let mut lines = self.run(python, "monitor.py", env).into_iter();
        let header = lines.next().expect("a header line");
        (header, lines.collect())
    }

    /// Runs `tests/<script>` with pynvml on this node; one JSON value per line it prints.
    fn run(&self, python: &str, script: &str, env: &[(&str, &Path)]) -> Vec<Value> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests")
            .join(script);
        let out = Command::new(python)
            .arg(script)
            .env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env("GPUSLICE_EMULATOR_STATE", &self.state)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }
}

/// `nvidia-smi topo -m` in pynvml (`tests/topology.py`) on an 8-GPU H100 SXM board and on a
/// two-card A100 PCIe box: pairs share a PCIe switch, halves a CPU socket; every SXM GPU reaches
/// every other over NVLink with all 18 links up, the PCIe cards have no NVLink at all.
#[test]
fn a_pynvml_topology_tool_sees_an_nvlink_board_and_a_pcie_only_box() {
    let Some(python) = python() else { return };
    let gpus = |model: &str, n: u32| -> String {
        (0..n)
            .map(|i| format!("- {{index: {i}, model: {model}}}\n"))
            .collect()
    };
    let board = Node::of(&format!(
        "name: hgx\ngpus:\n{}",
        gpus("NVIDIA H100 80GB HBM3", 8)
    ));
    let topo = &board.run(&python, "topology.py", &[])[0];
    assert_eq!(
        topo["matrix"][0],
        serde_json::json!(["X", "PXB", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"])
    );
    assert_eq!(
        topo["matrix"][5],
        serde_json::json!(["SYS", "SYS", "SYS", "SYS", "PXB", "X", "NODE", "NODE"])
    );
    for (a, row) in topo["nvlink"].as_array().unwrap().iter().enumerate() {
        for (b, peer) in row.as_array().unwrap().iter().enumerate() {
            assert_eq!(peer, &Value::Bool(a != b), "GPU {a} to GPU {b}: {topo}");
        }
    }
    assert_eq!(
        topo["links"],
        serde_json::json!([18, 18, 18, 18, 18, 18, 18, 18])
    );

    let pcie = Node::of(&format!(
        "name: box\ngpus:\n{}",
        gpus("NVIDIA A100 80GB PCIe", 2)
    ));
    let topo = &pcie.run(&python, "topology.py", &[])[0];
    assert_eq!(
        topo["matrix"],
        serde_json::json!([["X", "PXB"], ["PXB", "X"]])
    );
    assert_eq!(
        topo["nvlink"],
        serde_json::json!([[false, false], [false, false]])
    );
    assert_eq!(topo["links"], serde_json::json!([null, null]));
}

#[test]
fn a_pynvml_monitoring_tool_runs_unchanged_on_the_emulator() {
    let Some(python) = python() else { return };
    let node = Node::new();
    // This process holds 3 GiB on GPU 0 and 1 GiB in the MIG instance, as CUDA allocations do,
    // and keeps GPU 0 busy from two seconds ago for the next five seconds.
    let ledger = Ledger::open(&cuda_ledger_path(&node.state)).unwrap();
    let me = Process::current();
    let row = ledger.row_for(me, device_key(0, None)).unwrap();
    assert!(ledger.try_charge(row, 3 * GIB, 100 * GIB));
    let mig_row = ledger.row_for(me, device_key(2, Some(1))).unwrap();
    assert!(ledger.try_charge(mig_row, GIB, 60 * GIB));
    // On GPU 0 it is an MPS client, as the CUDA emulator marks one.
    ledger
        .row_for(me, gpuslice_emulator::mps_context_key(device_key(0, None)))
        .unwrap();
    let timeline = Timeline::open(&timeline_path(&node.state, device_key(0, None))).unwrap();
    timeline.run(me.pid, now_ns() - 2_000 * MS, 7_000 * MS);

    let (header, gpus) = node.monitor(&python, &[]);
    assert_eq!(header["nvml"], "12.575.57.08");
    assert_eq!(header["cuda"], 12080);
    assert!(header["driver"].as_str().unwrap().starts_with("575."));
    assert_eq!(gpus.len(), 3);
    for (i, gpu) in gpus.iter().enumerate() {
        assert_eq!(gpu["found_by"], serde_json::json!([i, i]), "{gpu}");
        assert_eq!(gpu["minor"], i);
        assert_eq!(gpu["fan"], Value::Null, "passively cooled boards: N/A");
        assert_eq!(gpu["persistence"], 1);
        assert_eq!(gpu["pstate"], 0);
        assert_eq!(gpu["ecc"], serde_json::json!([1, 1]));
        assert_eq!(gpu["ecc_uncorrected"], 0);
        assert_eq!(gpu["encoder"], 0);
        assert_eq!(gpu["serial"].as_str().unwrap().len(), 13);
    }
    let bus_ids: std::collections::HashSet<_> =
        gpus.iter().map(|g| g["bus_id"].to_string()).collect();
    assert_eq!(bus_ids.len(), 3);

    let h200 = &gpus[0];
    assert_eq!(h200["name"], "NVIDIA H200");
    assert_eq!(h200["uuid"], "GPU-aaaa");
    assert_eq!(h200["compute_capability"], serde_json::json!([9, 0]));
    assert_eq!(h200["memory"]["total"], 143_771u64 << 20);
    assert_eq!(h200["memory"]["used"], 3 * GIB);
    assert_eq!(h200["processes"][0]["pid"], me.pid, "{}", h200["processes"]);
    assert_eq!(h200["processes"][0]["memory"], 3 * GIB);
    assert!(h200["processes"][0]["name"].is_string());
    assert_eq!(
        h200["processes"].as_array().unwrap().len(),
        1,
        "an MPS client's context is one compute process: {}",
        h200["processes"]
    );
    assert_eq!(
        h200["mps_processes"],
        serde_json::json!([me.pid]),
        "and among the MPS processes"
    );
    // Busy for the whole last second: full load, at the board's limits.
    assert_eq!(
        h200["utilization"],
        serde_json::json!({"gpu": 100, "memory": 100})
    );
    // Per process (`nvidia-smi pmon`): this process had all of the last second.
    assert_eq!(
        h200["process_utilization"],
        serde_json::json!([{"pid": me.pid, "sm": 100, "memory": 100, "stamped": true}])
    );
    assert_eq!(h200["temperature"], 70);
    assert_eq!(h200["power"], 700_000);
    assert_eq!(h200["power_limit"], 700_000);
    assert_eq!(
        h200["clocks"],
        serde_json::json!({"graphics": 1980, "sm": 1980, "memory": 3201, "max_sm": 1980})
    );

    let a100 = &gpus[1];
    assert_eq!(a100["name"], "NVIDIA A100-SXM4-80GB");
    assert_eq!(a100["memory"]["used"], 10 * GIB);
    assert_eq!(a100["processes"][0]["pid"], 4242);
    assert_eq!(
        a100["processes"][0]["name"],
        Value::Null,
        "a seeded process runs nowhere"
    );
    assert_eq!(
        a100["utilization"],
        serde_json::json!({"gpu": 0, "memory": 0})
    );
    assert_eq!(a100["mps_processes"], serde_json::json!([]));
    assert_eq!(
        a100["process_utilization"],
        serde_json::json!([]),
        "no kernels ran there: NOT_FOUND"
    );
    assert_eq!(a100["temperature"], 30);
    assert_eq!(a100["power"], 60_000);
    assert_eq!(a100["power_limit"], 400_000);
    assert_eq!(a100["clocks"]["graphics"], 210);
    assert_eq!(a100["mig_mode"], serde_json::json!([0, 0]));

    // MIG mode: no utilisation for the GPU or its MIG device; the MIG device has its memory.
    let migged = &gpus[2];
    assert_eq!(migged["utilization"], Value::Null);
    assert_eq!(migged["process_utilization"], Value::Null);
    assert_eq!(migged["mig_mode"], serde_json::json!([1, 1]));
    let mig = &migged["mig_devices"][0];
    assert_eq!(mig["name"], "NVIDIA H200 MIG 3g.71gb");
    assert_eq!(mig["uuid"], "MIG-bbbb");
    assert_eq!(mig["memory"]["total"], 69 * GIB + GIB / 2);
    assert_eq!(mig["memory"]["used"], GIB);
    assert_eq!(mig["utilization"], Value::Null);
    assert_eq!(mig["processes"][0]["pid"], me.pid);
    assert_eq!(
        mig["mps_processes"],
        serde_json::json!([]),
        "not an MPS client there"
    );
}

#[test]
fn inside_a_slice_the_tool_sees_the_slice_memory() {
    let Some(python) = python() else { return };
    let node = Node::new();
    // The slice as the agent leaves it: a read-only config and the slice's ledger.
    let slice = node.dir.path().join("state/slices/gpu0-s0");
    std::fs::create_dir_all(&slice).unwrap();
    let config = slice.join("config");
    let cap = 8 * GIB;
    let slice_config = gpuslice_contract::SliceConfig {
        id: "gpu0-s0".into(),
        kind: gpuslice_contract::SliceKind::Software,
        gpu: 0,
        device_minor: None,
        device_uuid: "GPU-aaaa".into(),
        memory_bytes: cap,
        compute_percent: 50,
    };
    std::fs::write(&config, serde_json::to_vec(&slice_config).unwrap()).unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o444)).unwrap();
    Ledger::open(&slice.join("memory")).unwrap();
    // The shim trusts a config only if the workload's user could not have written it; a test
    // run by an ordinary user owns the file it wrote, which only root may.
    if std::fs::metadata(&config).unwrap().uid() != 0 {
        println!("SKIPPED: the shim accepts a slice config its own user wrote only as root");
        return;
    }

    let (_, gpus) = node.monitor(
        &python,
        &[
            ("LD_PRELOAD", &node.dir.path().join("lib/libgpuslice.so")),
            ("GPUSLICE_SLICE_CONFIG", &config),
        ],
    );
    assert_eq!(gpus[0]["memory"]["total"], cap, "{}", gpus[0]);
    assert_eq!(gpus[0]["memory"]["used"], 0);
    assert_eq!(gpus[0]["memory"]["free"], cap);
}
