//! NVIDIA's own clients judge our emulators, and our agent and NVIDIA's tools agree on MIG.
//!
//! - nvidia-ml-py reads every catalog model's MIG profiles the way NVIDIA's tools do
//!   (`tests/device/mig_profiles.py`, the same read-only script a real GPU runs) and gets the
//!   catalog's ids, names, sizes and placements; go-nvml agrees, and names each profile as
//!   mig-parted does;
//! - both drive MIG call by call (`tests/pynvml/mig_calls.py`, `gonvml conformance`): a row per
//!   call with NVIDIA's documented answer and the emulator's, printed as a table (`--nocapture`);
//! - for every MIG layout of mig-parted's standard configs on A30, A100 40/80GB, H100 and H200:
//!   what our agent applies, go-nvml exports as the layout declared; what go-nvml applies the
//!   mig-parted way, our agent reads back and finds nothing to change;
//! - cuda-bindings (`cuda.bindings.driver`) fetches every driver entry point through
//!   `cuGetProcAddress`, by name and the CUDA version of the variant it means, and calls it with
//!   that variant's arguments (`tests/cuda_bindings/driver_calls.py`). Against the CUDA emulator
//!   every call answers as the driver documents; under the shim, in a slice, the same calls see the
//!   slice's cap, an allocation past it fails, and the versioned variants (`cuCtxCreate_v3`,
//!   `_v4`) reach code that takes their arguments.
//!
//! The clients come from `GPUSLICE_TEST_PYTHON` (a Python with nvidia-ml-py and cuda-bindings) and
//! `GPUSLICE_GONVML` (`tests/gonvml/build.sh`); `.ci/run` provides both. Without them the tests
//! say why and skip, except under `CI`, where they fail.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuslice_emulator::{Machine, Store};
use gpuslice_planning::catalog;
use gpuslice_testcluster::repo_root as root;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

/// Fails under CI, else says why the test is skipped.
fn missing(why: String) -> Option<PathBuf> {
    assert!(
        std::env::var_os("CI").is_none(),
        "{why}; CI must run this test (.ci/run provides it)"
    );
    println!("SKIPPED: {why}");
    None
}

/// The Python that can import `module` (nvidia-ml-py's `pynvml`, cuda-bindings'
/// `cuda.bindings.driver`).
fn python(module: &str) -> Option<PathBuf> {
    let python = std::env::var("GPUSLICE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
    {
        Ok(out) if out.status.success() => Some(PathBuf::from(python)),
        _ => missing(format!(
            "{python} cannot import {module} (set GPUSLICE_TEST_PYTHON to a Python with \
             nvidia-ml-py and cuda-bindings)"
        )),
    }
}

/// The go-nvml client: `GPUSLICE_GONVML`, else one `tests/gonvml/build.sh` already built.
fn gonvml() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("GPUSLICE_GONVML") {
        return Some(PathBuf::from(path));
    }
    let found = Command::new("bash")
        .arg(root().join("tests/gonvml/build.sh"))
        .arg("--find")
        .output()
        .ok()
        .filter(|o| o.status.success());
    match found {
        Some(out) => Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())),
        None => {
            missing("no go-nvml client (run tests/gonvml/build.sh, or set GPUSLICE_GONVML)".into())
        }
    }
}

/// An emulated node in a temporary folder: its state file and a lib folder holding the emulators
/// as `libnvidia-ml.so.1` and `libcuda.so.1`, as a driver install has them, and the shim.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new(yaml: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        let built = Path::new(BIN).parent().unwrap();
        for (name, file) in [
            ("libnvidia-ml.so.1", "libnvidia_ml.so"),
            ("libcuda.so.1", "libcuda.so"),
            ("libgpuslice.so", "libgpuslice.so"),
        ] {
            let newest = gpuslice_runtime::built::newest_built(built, file)
                .unwrap_or_else(|| panic!("{file} is not built: cargo build --workspace"));
            std::fs::copy(&newest, lib.join(name))
                .unwrap_or_else(|e| panic!("{}: {e}", newest.display()));
        }
        std::fs::write(dir.path().join("node.yaml"), yaml).unwrap();
        let node: gpuslice_api::NodeInventory = serde_yaml::from_str(yaml).unwrap();
        // Where `gpuslice agent --emulate node.yaml --state <dir>/state` keeps the machine.
        let state = dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        Store::create(
            &state.join(format!("emulated-{}.json", node.name)),
            &Machine::from_inventory(&node).unwrap(),
        )
        .unwrap();
        Node { dir }
    }

    fn state_file(&self) -> PathBuf {
        self.dir.path().join("state/emulated-n.json")
    }

    fn library(&self) -> PathBuf {
        self.dir.path().join("lib/libnvidia-ml.so.1")
    }

    /// Runs a client against the emulated node; its stdout as JSON (and whether it succeeded).
    fn client(&self, program: &Path, args: &[&str]) -> (bool, Value) {
        self.client_with(program, args, &[])
    }

    fn client_with(&self, program: &Path, args: &[&str], env: &[(&str, &Path)]) -> (bool, Value) {
        let out = Command::new(program)
            .args(args)
            .env("GPUSLICE_EMULATOR_STATE", self.state_file())
            .env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env("GONVML_LIBRARY", self.library())
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "{} {args:?}: not JSON ({e}):\n{stdout}\n{}",
                program.display(),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out.status.success(), json)
    }

    /// One pass of our agent over the pools in `source` (`--apply` or only planning), as JSON.
    fn agent(&self, source: &Path, apply: bool) -> Value {
        let mut cmd = Command::new(BIN);
        cmd.args(["agent", "--once", "--output", "json", "--source"])
            .arg(source)
            .arg("--emulate")
            .arg(self.dir.path().join("node.yaml"))
            .arg("--state")
            .arg(self.dir.path().join("state"));
        if apply {
            cmd.arg("--apply");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "agent: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// Prints rows of {call, documented, got, ok} as a table; returns the calls that failed.
fn table(client: &str, rows: &Value) -> Vec<String> {
    println!(
        "\n{client}: {:<72} | {:<48} | emulator",
        "call", "NVIDIA documents"
    );
    let mut failed = Vec::new();
    for row in rows.as_array().expect("rows") {
        let text = |k: &str| row[k].as_str().unwrap_or_default().to_string();
        let ok = row["ok"] == true;
        println!(
            "{} {:<72} | {:<48} | {}",
            if ok { "PASS" } else { "FAIL" },
            text("call"),
            text("documented"),
            text("got")
        );
        if !ok {
            failed.push(text("call"));
        }
    }
    failed
}

/// Every MIG model of the catalog, one GPU each, MIG off; minor numbers that are not the indices.
fn every_model_node() -> String {
    let mut yaml = String::from("name: n\ngpus:\n");
    for (index, model) in catalog::models().iter().enumerate() {
        yaml += &format!(
            "- {{index: {index}, minor: {}, model: {}}}\n",
            index + 10,
            model.name
        );
    }
    yaml
}

#[test]
fn nvidia_clients_read_every_models_profiles_as_the_catalog_has_them() {
    let (Some(python), Some(gonvml)) = (python("pynvml"), gonvml()) else {
        return;
    };
    let node = Node::new(&every_model_node());
    let (ok, read) = node.client(
        &python,
        &[root()
            .join("tests/device/mig_profiles.py")
            .to_str()
            .unwrap()],
    );
    assert!(ok, "{read}");
    let (ok, go) = node.client(&gonvml, &["profiles"]);
    assert!(ok, "{go}");
    for (index, model) in catalog::models().iter().enumerate() {
        let py = &read["gpus"][index];
        let go = &go["gpus"][index];
        assert_eq!(py["name"], model.name);
        assert_eq!(py["minor"], index + 10, "{}: the minor number", model.name);
        assert_eq!(go["minorNumber"], index + 10, "{}", model.name);
        let geometry = model.mig.as_ref().unwrap();
        let mut want: Vec<Value> = geometry
            .profiles
            .iter()
            .map(|p| {
                serde_json::json!({
                    "index": p.nvml_index, "id": p.id, "name": p.name,
                    "slices": p.compute_slices, "instanceCount": p.max_count,
                    "memoryMiB": p.memory_mib, "sms": p.sms,
                    "placements": p.placements.iter().map(|s| [*s, p.memory_slices]).collect::<Vec<_>>(),
                })
            })
            .collect();
        want.sort_by_key(|p| p["index"].as_u64());
        assert_eq!(
            py["profiles"],
            Value::Array(want),
            "{}: nvidia-ml-py",
            model.name
        );
        // go-nvml: the same ids and placements, and mig-parted's name for each is the catalog's.
        let go_profiles = go["profiles"].as_array().unwrap();
        assert_eq!(go_profiles.len(), geometry.profiles.len(), "{}", model.name);
        for p in go_profiles {
            let id = p["id"].as_u64().unwrap() as u32;
            let mine = geometry.profile_by_id(id).unwrap();
            assert_eq!(p["index"], mine.nvml_index, "{} {}", model.name, mine.name);
            assert_eq!(
                p["migPartedName"], mine.name,
                "{}: mig-parted's name",
                model.name
            );
            assert_eq!(p["name"], format!("MIG {}", mine.name), "{}", model.name);
            assert_eq!(
                p["placements"].as_array().unwrap().len(),
                mine.placements.len(),
                "{} {}",
                model.name,
                mine.name
            );
        }
    }
}

#[test]
fn nvidia_clients_drive_mig_call_by_call_as_nvidia_documents() {
    let (Some(python), Some(gonvml)) = (python("pynvml"), gonvml()) else {
        return;
    };
    let mut failed = Vec::new();
    for model in ["NVIDIA H200", "NVIDIA A100-SXM4-40GB", "NVIDIA A30"] {
        let yaml = format!(
            "name: n\ngpus:\n- {{index: 0, model: {model}, mig: {{enabled: true, instances: []}}}}\n"
        );
        let node = Node::new(&yaml);
        let (_, rows) = node.client(
            &python,
            &[root().join("tests/pynvml/mig_calls.py").to_str().unwrap()],
        );
        failed.extend(table(&format!("nvidia-ml-py on {model}"), &rows));
        let (_, rows) = node.client(&gonvml, &["conformance"]);
        failed.extend(table(&format!("go-nvml on {model}"), &rows));
    }
    assert!(
        failed.is_empty(),
        "calls NVML answers otherwise: {failed:?}"
    );
}

/// mig-parted's standard configs (all-1g, all-2g, all-3g, all-balanced, all-7g and the like) in
/// each model's profile names, with one layout holding the media engines.
fn layouts() -> Vec<(&'static str, BTreeMap<String, u32>)> {
    let layout = |pairs: &[(&str, u32)]| -> BTreeMap<String, u32> {
        pairs.iter().map(|(p, n)| (p.to_string(), *n)).collect()
    };
    // Per 8-slice model: the names of 1g, 1g with double memory, 2g, 3g, 4g and 7g.
    let eight_slice: [(&'static str, [&str; 6]); 4] = [
        (
            "NVIDIA H200",
            [
                "1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb",
            ],
        ),
        (
            "NVIDIA H100 80GB HBM3",
            [
                "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
            ],
        ),
        (
            "NVIDIA A100-SXM4-80GB",
            [
                "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
            ],
        ),
        (
            "NVIDIA A100-SXM4-40GB",
            [
                "1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb",
            ],
        ),
    ];
    let mut all = Vec::new();
    for (model, [g1, g1d, g2, g3, g4, g7]) in eight_slice {
        let me = format!("{g1}+me");
        for l in [
            layout(&[(g1, 7)]),
            layout(&[(g1d, 4)]),
            layout(&[(g2, 3)]),
            layout(&[(g3, 2)]),
            layout(&[(g4, 1)]),
            layout(&[(g7, 1)]),
            layout(&[(g1, 2), (g2, 1), (g3, 1)]),
            layout(&[(me.as_str(), 1), (g1, 6)]),
        ] {
            all.push((model, l));
        }
    }
    for l in [
        layout(&[("1g.6gb", 4)]),
        layout(&[("2g.12gb", 2)]),
        layout(&[("4g.24gb", 1)]),
        layout(&[("1g.6gb", 2), ("2g.12gb", 1)]),
        layout(&[("2g.12gb+me", 1), ("2g.12gb", 1)]),
    ] {
        all.push(("NVIDIA A30", l));
    }
    all
}

/// A GitOps folder with one pool that asks `layout` of the node's GPUs.
fn pool_source(dir: &Path, layout: &BTreeMap<String, u32>) -> PathBuf {
    let source = dir.join("source");
    std::fs::create_dir_all(&source).unwrap();
    let profiles: Vec<String> = layout.iter().map(|(p, n)| format!("{p}: {n}")).collect();
    std::fs::write(
        source.join("pool.yaml"),
        format!(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata:\n  name: lab\nspec:\n  nodeSelector:\n    matchLabels: {{lab: \"yes\"}}\n  layout:\n    mig:\n      profiles: {{{}}}\n",
            profiles.join(", ")
        ),
    )
    .unwrap();
    source
}

/// What go-nvml exports of GPU 0: each MIG device's profile (mig-parted's name) and count.
fn exported(export: &Value) -> BTreeMap<String, u32> {
    let gpu = &export["gpus"][0];
    assert_eq!(gpu["migEnabled"], true, "{gpu}");
    for gi in gpu["gpuInstances"].as_array().unwrap() {
        let cis = gi["computeInstances"].as_array().unwrap();
        assert_eq!(cis.len(), 1, "one compute instance per GPU instance: {gi}");
        assert!(cis[0]["migDevice"].is_object(), "a MIG device: {gi}");
    }
    serde_json::from_value(gpu["migDevices"].clone()).unwrap()
}

#[test]
fn mig_parted_and_our_agent_agree_on_every_layout() {
    let Some(gonvml) = gonvml() else {
        return;
    };
    let mut rows = Vec::new();
    for (model, layout) in layouts() {
        let yaml = format!(
            "name: n\nlabels: {{lab: \"yes\"}}\ngpus:\n- {{index: 0, model: {model}, mig: {{enabled: true, instances: []}}}}\n"
        );
        let wanted = format!("{model} {layout:?}");
        // Our agent applies the layout; go-nvml exports what is there.
        let node = Node::new(&yaml);
        let source = pool_source(node.dir.path(), &layout);
        let pass = node.agent(&source, true);
        assert_eq!(
            pass["outcomes"][0]["converged"], true,
            "{wanted}: the agent applies it\n{pass:#}"
        );
        let (ok, export) = node.client(&gonvml, &["export"]);
        assert!(ok, "{export}");
        assert_eq!(
            exported(&export),
            layout,
            "{wanted}: go-nvml's export of what the agent applied"
        );

        // go-nvml applies it the way mig-parted does; our agent finds nothing to change.
        let node = Node::new(&yaml);
        let source = pool_source(node.dir.path(), &layout);
        let file = node.dir.path().join("layout.json");
        std::fs::write(
            &file,
            serde_json::json!({"gpus": {"0": layout}}).to_string(),
        )
        .unwrap();
        let (ok, applied) = node.client(&gonvml, &["apply", file.to_str().unwrap()]);
        assert!(ok, "{wanted}: go-nvml applies it\n{applied:#}");
        assert_eq!(exported(&applied["export"]), layout, "{wanted}");
        let pass = node.agent(&source, false);
        let ops = &pass["plan"]["nodes"][0]["gpus"][0]["ops"];
        assert_eq!(
            ops,
            &serde_json::json!([]),
            "{wanted}: our agent reads back what mig-parted applied\n{pass:#}"
        );
        rows.push(wanted);
    }
    println!("agree on {} layouts:", rows.len());
    for row in rows {
        println!("  {row}");
    }
}

/// Two emulated H200s for the CUDA calls.
const TWO_H200S: &str =
    "name: n\ngpus:\n- {index: 0, model: NVIDIA H200}\n- {index: 1, model: NVIDIA H200}\n";

fn driver_calls() -> PathBuf {
    root().join("tests/cuda_bindings/driver_calls.py")
}

#[test]
fn cuda_bindings_drive_the_emulated_driver_as_nvidia_documents() {
    let Some(python) = python("cuda.bindings.driver") else {
        return;
    };
    let node = Node::new(TWO_H200S);
    let (_, rows) = node.client(&python, &[driver_calls().to_str().unwrap()]);
    assert!(rows.as_array().unwrap().len() > 20, "{rows}");
    let failed = table("cuda-bindings on the CUDA emulator", &rows);
    assert!(failed.is_empty(), "calls answered otherwise: {failed:?}");
}

#[test]
fn under_the_shim_cuda_bindings_see_the_slice_and_every_variant_works() {
    let Some(python) = python("cuda.bindings.driver") else {
        return;
    };
    let node = Node::new(TWO_H200S);
    // The slice as the agent writes it: its read-only config and its memory ledger.
    let state = gpuslice_contract::StateDir::new(node.dir.path().join("agent"));
    let cap = 8 << 30;
    let slice = gpuslice_contract::SliceConfig {
        id: "gpu0-s0".into(),
        kind: gpuslice_contract::SliceKind::Software,
        gpu: 0,
        device_minor: None,
        device_uuid: "GPU-aaaa".into(),
        memory_bytes: cap,
        compute_percent: 100,
    };
    gpuslice_node::gpu::slices::sync_dirs(&state, std::slice::from_ref(&slice)).unwrap();
    let config = state.slice_config(&slice.id);
    if std::fs::metadata(&config).unwrap().uid() != 0 {
        println!("SKIPPED: the shim accepts a slice config its own user wrote only as root");
        return;
    }
    let (_, rows) = node.client_with(
        &python,
        &[driver_calls().to_str().unwrap(), &cap.to_string()],
        &[
            ("LD_PRELOAD", &node.dir.path().join("lib/libgpuslice.so")),
            ("GPUSLICE_SLICE_CONFIG", &config),
        ],
    );
    let failed = table("cuda-bindings under the shim, in an 8 GiB slice", &rows);
    assert!(failed.is_empty(), "calls answered otherwise: {failed:?}");
    assert!(
        rows.as_array()
            .unwrap()
            .iter()
            .any(|r| r["call"] == "cuMemAlloc past the slice's cap" && r["ok"] == true),
        "{rows}"
    );
}
