//! `--emulate`: the agent on an emulated machine (the emulated NVML, seeded from a
//! `NodeInventory`), for demos and tests without a GPU.

use std::path::{Path, PathBuf};

use gpuslice_api::NodeInventory;

/// Why the emulated machine cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum EmulateError {
    #[error(
        "the NVML emulator (libnvidia_ml.so) is not next to {0}: build the workspace with cargo build"
    )]
    NoLibrary(String),
    #[error("emulated node {node}: {message}")]
    Machine { node: String, message: String },
}

/// Where the emulated `libnvidia-ml` is: next to the running `gpuslice`, as cargo builds it.
pub fn emulator_library() -> Result<PathBuf, EmulateError> {
    let exe = std::env::current_exe().unwrap_or_default();
    gpuslice_runtime::built::newest_built(exe.parent().unwrap_or(Path::new(".")), "libnvidia_ml.so")
        .ok_or_else(|| EmulateError::NoLibrary(exe.display().to_string()))
}

/// The emulated `nvidia-cuda-mps-control`, next to the running `gpuslice` as
/// `cargo build --workspace` builds it; else the name alone, so that only a GPU with an `mps`
/// layout finds it missing (its outcome says so).
pub fn emulated_mps_control() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let tool = exe
        .parent()
        .unwrap_or(Path::new("."))
        .join(crate::gpu::mps::DEFAULT_CONTROL);
    if tool.is_file() {
        tool
    } else {
        PathBuf::from(crate::gpu::mps::DEFAULT_CONTROL)
    }
}

/// Seeds (or reuses) the emulated machine's state file (`path`) for an inventory, and points the
/// emulated NVML at it. The state persists between runs, as hardware would.
pub fn prepare_emulator(path: &Path, node: &NodeInventory) -> Result<PathBuf, EmulateError> {
    let failed = |message: String| EmulateError::Machine {
        node: node.name.clone(),
        message,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| failed(format!("{}: {e}", dir.display())))?;
    if gpuslice_emulator::Store::open(path).is_err() {
        let machine =
            gpuslice_emulator::Machine::from_inventory(node).map_err(|e| failed(e.to_string()))?;
        gpuslice_emulator::Store::create(path, &machine).map_err(|e| failed(e.to_string()))?;
    }
    // SAFETY: called from main before any other thread exists; the emulated NVML reads it at init.
    unsafe { std::env::set_var(gpuslice_contract::env::EMULATOR_STATE, path) };
    Ok(path.to_path_buf())
}
