//! What the shim's tests and benchmark share: an emulated H200, the probe program built against
//! the emulated driver and NVML, and a slice as the agent would have set it up.
#![allow(dead_code)] // each user takes what it needs

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpuslice_emulator::shm::Ledger;
use gpuslice_emulator::{Machine, Store};

/// The three ways a program reaches the driver.
pub const MODES: [&str; 3] = ["link", "dlsym", "procaddr"];

pub fn deps() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A machine with one emulated H200, the probe program built against the emulated libraries,
/// and a slice of `cap` bytes whose config the agent would have written.
pub struct Setup {
    pub dir: tempfile::TempDir,
    pub probe: PathBuf,
    pub config: PathBuf,
}

impl Setup {
    pub fn new(cap: u64) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        // Copies, not links into `target/`: a test may run the probe as another user, who cannot
        // open files inside a checkout that lives in a private (0700) directory.
        for (name, built) in [
            ("libcuda.so", "libcuda.so"),
            ("libcuda.so.1", "libcuda.so"),
            ("libnvidia-ml.so", "libnvidia_ml.so"),
            ("libnvidia-ml.so.1", "libnvidia_ml.so"),
            ("libgpuslice.so", "libgpuslice.so"),
        ] {
            let copy = lib.join(name);
            std::fs::copy(deps().join(built), &copy).unwrap();
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o755)).unwrap();
        let probe = dir.path().join("probe");
        let built = Command::new("cc")
            .arg("-O1")
            .arg("-o")
            .arg(&probe)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/probe.c"))
            .arg(format!("-L{}", lib.display()))
            .args(["-lcuda", "-lnvidia-ml", "-ldl"])
            .output()
            .unwrap();
        assert!(
            built.status.success(),
            "{}",
            String::from_utf8_lossy(&built.stderr)
        );

        let node: gpuslice_api::NodeInventory =
            serde_yaml::from_str("name: n\ngpus:\n- {index: 0, model: NVIDIA H200}\n").unwrap();
        let machine = dir.path().join("machine.json");
        Store::create(&machine, &Machine::from_inventory(&node).unwrap()).unwrap();
        // The emulated device is open to every user, as /dev/nvidia* is.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        Ledger::open(&gpuslice_emulator::cuda_ledger_path(&machine)).unwrap();
        for file in [
            machine.with_extension("lock"),
            gpuslice_emulator::cuda_ledger_path(&machine),
        ] {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o666)).unwrap();
        }
        std::fs::set_permissions(&machine, std::fs::Permissions::from_mode(0o644)).unwrap();

        // What the agent writes: a read-only config and the slice's ledger, in the slice's directory.
        let slice = dir.path().join("state/slices/gpu0-s0");
        std::fs::create_dir_all(&slice).unwrap();
        let config = slice.join("config");
        let slice_config = gpuslice_contract::SliceConfig {
            id: "gpu0-s0".into(),
            kind: gpuslice_contract::SliceKind::Software,
            gpu: 0,
            device_minor: None,
            device_uuid: "GPU-x".into(),
            memory_bytes: cap,
            compute_percent: 50,
        };
        std::fs::write(&config, serde_json::to_vec(&slice_config).unwrap()).unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o444)).unwrap();
        Ledger::open(&slice.join("memory")).unwrap();
        std::fs::set_permissions(slice.join("memory"), std::fs::Permissions::from_mode(0o666))
            .unwrap();
        Setup { dir, probe, config }
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.probe);
        cmd.args(args)
            .env("LD_PRELOAD", self.dir.path().join("lib/libgpuslice.so"))
            .env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env(
                "GPUSLICE_EMULATOR_STATE",
                self.dir.path().join("machine.json"),
            )
            .env("GPUSLICE_SLICE_CONFIG", &self.config);
        cmd
    }

    pub fn ledger(&self) -> Ledger {
        Ledger::open(&self.config.with_file_name("memory")).unwrap()
    }
}

/// The probe's `key=value` lines.
pub fn values(out: &Output) -> std::collections::HashMap<String, i64> {
    numbers(out)
        .into_iter()
        .map(|(k, v)| (k, v as i64))
        .collect()
}

/// The probe's `key=value` lines, as numbers.
pub fn numbers(out: &Output) -> std::collections::HashMap<String, f64> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}
