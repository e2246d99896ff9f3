//! `libgpuslice.so`, loaded with `LD_PRELOAD` into a workload's processes: it enforces the
//! slice's memory cap exactly, across all the processes of the slice, and shows the slice (not the
//! whole GPU) to CUDA's `cuMemGetInfo` and to NVML users such as `nvidia-smi`. It intercepts the
//! driver however a program reaches it: linked to `libcuda.so.1`, through `dlopen` + `dlsym`, or
//! through `cuGetProcAddress` (what CUDA ≥ 11.3 runtimes use).
//!
//! - [`hooks`]: the one table of hooked symbols, from which exports, `dlsym` and
//!   `cuGetProcAddress` are answered;
//! - [`real`]: the driver's real functions, resolved once;
//! - [`limits`]: the slice config the agent wrote, checked so a workload cannot raise its cap;
//! - [`memory`], [`nvml`], [`launch`]: what each hook does;
//! - [`compute`]: the slice's compute share, granted by the node agent around kernel launches.
//!
//! Without `GPUSLICE_SLICE_CONFIG` the shim passes every call through untouched.

// The exports take the C caller's pointers, as the functions they stand in for do.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod compute;
pub mod hooks;
pub mod launch;
pub mod limits;
pub mod memory;
pub mod nvml;
pub mod real;
