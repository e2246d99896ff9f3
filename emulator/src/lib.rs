//! The emulated GPU device model that gpuslice's NVML and CUDA driver emulators share, so every
//! component runs its real code paths without a GPU. A machine is seeded from a
//! [`gpuslice_api::NodeInventory`] (the same type the agent reports and `gpuslice plan` reads) and
//! kept in a state file ([`store::Store`]) that every process on the machine shares. Tests that
//! need many emulated nodes in one process use [`model::Machine`] directly.

pub mod model;
pub mod store;

pub use model::{Fault, FaultAction, Gpu, GpuInstance, Machine, NvmlError};
pub use store::{Store, StoreError};
