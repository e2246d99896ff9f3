//! NVIDIA's cuda-bindings judge the CUDA emulator and the shim over it.
//!
//! cuda-bindings (`cuda.bindings.driver`) fetches every driver entry point through
//! `cuGetProcAddress`, by name and the CUDA version of the variant it means, and calls it with
//! that variant's arguments (`tests/cuda_bindings/driver_calls.py`: a row per call, NVIDIA's
//! documented answer beside what came back, printed with `--nocapture`). Against the emulator
//! alone every call answers as the driver documents; under the shim, in a slice, the same calls
//! see the slice's cap and an allocation past it fails — and the versioned variants
//! (`cuCtxCreate_v3`, `_v4`) reach code that takes their arguments.
//!
//! The Python comes from `GPUSLICE_TEST_PYTHON` (`.ci/run` installs cuda-bindings there); without
//! it the tests say why and skip, except under `CI`, where they fail.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use gpuslice_emulator::{Machine, Store};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");
const GIB: u64 = 1 << 30;

/// The Python with cuda-bindings, or `None` (after saying why) outside CI.
fn python() -> Option<String> {
    let python = std::env::var("GPUSLICE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&python)
        .args(["-c", "import cuda.bindings.driver"])
        .output()
    {
        Ok(out) if out.status.success() => Some(python),
        _ => {
            let why = format!(
                "{python} cannot import cuda.bindings (pip install cuda-bindings; .ci/run does)"
            );
            assert!(
                std::env::var_os("CI").is_none(),
                "{why}; CI must run this test"
            );
            println!("SKIPPED: {why}");
            None
        }
    }
}

/// Two emulated H200s, the CUDA emulator as `libcuda.so.1` and the shim beside it.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        let built = Path::new(BIN).parent().unwrap();
        for (name, file) in [
            ("libcuda.so.1", "libcuda.so"),
            ("libgpuslice.so", "libgpuslice.so"),
        ] {
            std::fs::copy(built.join(file), lib.join(name)).unwrap();
        }
        let node: gpuslice_api::NodeInventory = serde_yaml::from_str(
            "name: n\ngpus:\n- {index: 0, model: NVIDIA H200}\n- {index: 1, model: NVIDIA H200}\n",
        )
        .unwrap();
        Store::create(
            &dir.path().join("machine.json"),
            &Machine::from_inventory(&node).unwrap(),
        )
        .unwrap();
        Node { dir }
    }

    fn run(&self, python: &str, args: &[String], env: &[(&str, PathBuf)]) -> Vec<Value> {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_bindings/driver_calls.py");
        let out = Command::new(python)
            .arg(script)
            .args(args)
            .env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env(
                "GPUSLICE_EMULATOR_STATE",
                self.dir.path().join("machine.json"),
            )
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let rows: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}):\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        rows.as_array().unwrap().clone()
    }
}

/// Prints the rows; returns the calls that failed.
fn table(title: &str, rows: &[Value]) -> Vec<String> {
    println!(
        "\n{title}: {:<44} | {:<52} | got",
        "call", "NVIDIA documents"
    );
    let mut failed = Vec::new();
    for row in rows {
        let text = |k: &str| row[k].as_str().unwrap_or_default().to_string();
        let ok = row["ok"] == true;
        println!(
            "{} {:<44} | {:<52} | {}",
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

#[test]
fn cuda_bindings_drive_the_emulated_driver_as_nvidia_documents() {
    let Some(python) = python() else { return };
    let node = Node::new();
    let rows = node.run(&python, &[], &[]);
    assert!(rows.len() > 20, "{rows:?}");
    let failed = table("cuda-bindings on the CUDA emulator", &rows);
    assert!(failed.is_empty(), "calls answered otherwise: {failed:?}");
}

#[test]
fn under_the_shim_cuda_bindings_see_the_slice_and_every_variant_works() {
    let Some(python) = python() else { return };
    let node = Node::new();
    // The slice as the agent leaves it: a read-only config and the slice's ledger.
    let slice = node.dir.path().join("slices/gpu0-s0");
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
        compute_percent: 100,
    };
    std::fs::write(&config, serde_json::to_vec(&slice_config).unwrap()).unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o444)).unwrap();
    gpuslice_emulator::shm::Ledger::open(&slice.join("memory")).unwrap();
    if std::fs::metadata(&config).unwrap().uid() != 0 {
        println!("SKIPPED: the shim accepts a slice config its own user wrote only as root");
        return;
    }
    let rows = node.run(
        &python,
        &[cap.to_string()],
        &[
            ("LD_PRELOAD", node.dir.path().join("lib/libgpuslice.so")),
            ("GPUSLICE_SLICE_CONFIG", config),
        ],
    );
    let failed = table("cuda-bindings under the shim, in an 8 GiB slice", &rows);
    assert!(failed.is_empty(), "calls answered otherwise: {failed:?}");
    assert!(
        rows.iter()
            .any(|r| r["call"] == "cuMemAlloc past the slice's cap" && r["ok"] == true),
        "{rows:?}"
    );
}
