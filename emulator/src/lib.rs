//! The emulated GPU device model that gpuslice's NVML and CUDA driver emulators share, so every
//! component runs its real code paths without a GPU. A machine is seeded from a
//! [`gpuslice_api::NodeInventory`] (the same type the agent reports and `gpuslice plan` reads) and
//! kept in a state file ([`store::Store`]) that every process on the machine shares. Tests that
//! need many emulated nodes in one process use [`model::Machine`] directly.

pub mod model;
pub mod mps;
pub mod store;
pub mod timeline;

pub use model::{Fault, FaultAction, Gpu, GpuInstance, Machine, NvmlError, Xid};
pub use store::{Store, StoreError};

use std::path::{Path, PathBuf};

/// Where the CUDA driver emulator keeps device memory held by processes: a
/// [`gpuslice_shm::Ledger`] next to the state file, one row per (process, device), so every
/// process sees one device and the NVML emulator lists what CUDA allocations took.
pub fn cuda_ledger_path(state: &Path) -> PathBuf {
    state.with_extension("cuda-memory")
}

/// The ledger key of a CUDA device: a whole GPU, or one GPU instance of it.
pub fn device_key(gpu: u32, gpu_instance: Option<u32>) -> u32 {
    (gpu << 16) | gpu_instance.unwrap_or(0xFFFF)
}

/// The GPU and GPU instance a ledger key names.
pub fn device_of_key(key: u32) -> (u32, Option<u32>) {
    let key = key & !MPS_CONTEXT;
    let gi = key & 0xFFFF;
    (key >> 16, (gi != 0xFFFF).then_some(gi))
}

/// Set on the key of a ledger row that holds no memory and says its process has an MPS context
/// on that device (it is an MPS client there): a key of its own, so no device's sum counts it.
const MPS_CONTEXT: u32 = 1 << 31;

/// The key of the row that marks an MPS client of device `key`.
pub fn mps_context_key(key: u32) -> u32 {
    key | MPS_CONTEXT
}

/// Whether a ledger row's key marks an MPS client rather than holding memory.
pub fn is_mps_context(key: u32) -> bool {
    key & MPS_CONTEXT != 0
}
/// An emulated driver library (`libnvidia_ml.so`, `libcuda.so`) cargo built next to the running
/// test or benchmark binary (in its `deps/` folder or the one above). Panics when it is not there:
/// only tests and benchmarks ask, and they cannot run without it.
pub fn built_library(file: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the running binary's path");
    let deps = exe.parent().unwrap_or(Path::new("."));
    [Some(deps.join(file)), deps.parent().map(|up| up.join(file))]
        .into_iter()
        .flatten()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{file} is not built next to {}", deps.display()))
}

pub use gpuslice_shm as shm;
