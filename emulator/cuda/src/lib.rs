//! An emulated `libcuda.so.1`: the CUDA driver API that gpuslice's shim hooks and that test
//! programs call, on the shared device model. Devices come from the machine in the state file
//! named by `GPUSLICE_EMULATOR_STATE` (whole GPUs, or MIG instances, as `CUDA_VISIBLE_DEVICES`
//! selects by index, `GPU-…` or `MIG-…` UUID). Device memory is held in a ledger every process
//! shares ([`gpuslice_emulator::cuda_ledger_path`]), so allocations in one process shrink what
//! the others can take, return `CUDA_ERROR_OUT_OF_MEMORY` when the device is full, and show up in
//! the emulated NVML's process list. A context costs [`CONTEXT_BYTES`] of device memory, as a real
//! one costs hundreds of MiB. Kernels take the time their name says (`sleep_250us`), on streams
//! that events can time.
//!
//! Programs reach it as they reach the real driver: linked (`-lcuda`), through `dlopen` +
//! `dlsym`, or through `cuGetProcAddress[_v2]`, which answers from one table of entry points.
//! Every export runs under `catch_unwind`: a panic becomes `CUDA_ERROR_UNKNOWN`.

// The exports carry the driver's names and take the C caller's pointers, as its functions do.
#![allow(non_snake_case, clippy::not_unsafe_ptr_arg_deref)]

mod context;
mod device;
mod driver;
mod error;
mod graph;
mod launch;
mod memory;
mod mps;
mod proc_address;
mod stream;
mod timeline;
mod visible;

pub use gpuslice_contract::cuda::{
    ArrayDescriptor, ArrayDescriptor3D, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN,
    CUDA_SUCCESS, CuDevice as CUdevice, CuDevicePtr as CUdeviceptr, CuResult as CUresult, Handle,
    LaunchConfig,
};

// The exports, also at the crate's root for Rust callers.
pub use context::*;
pub use device::*;
pub use driver::CONTEXT_BYTES;
pub use error::*;
pub use graph::*;
pub use launch::*;
pub use memory::*;
pub use proc_address::*;
pub use stream::*;
