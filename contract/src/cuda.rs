//! The CUDA driver ABI as the shim, the CUDA emulator and the compute benchmark's worker use it:
//! the handle and result types, the error codes they return, and the structures passed by
//! pointer. Facts from `cuda.h`; declared here once so the three cannot drift apart.

use std::ffi::{c_int, c_uint, c_void};

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUdeviceptr`.
pub type CuDevicePtr = u64;
/// An opaque driver handle (`CUcontext`, `CUstream`, `CUfunction`, `CUevent`, `CUgraphExec`…).
pub type Handle = *mut c_void;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CuResult = 400;
pub const CUDA_ERROR_NOT_FOUND: CuResult = 500;
pub const CUDA_ERROR_NOT_PERMITTED: CuResult = 800;
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

/// `CUlaunchConfig`, as `cuLaunchKernelEx` takes it.
#[repr(C)]
pub struct LaunchConfig {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: Handle,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: c_uint,
    pub channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (the 2D descriptor is its first fields without depth and flags).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ArrayDescriptor3D {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_uint,
    pub channels: c_uint,
    pub flags: c_uint,
}

/// `cuLaunchKernel`: function, grid x/y/z, block x/y/z, shared memory, stream, parameters, extra.
pub type LaunchKernelFn = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;

/// `cuLaunchCooperativeKernel`: as `cuLaunchKernel` without `extra`.
pub type LaunchCooperativeKernelFn = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
) -> CuResult;

/// `cuLaunchKernelEx`: config, function, parameters, extra.
pub type LaunchKernelExFn = unsafe extern "C" fn(
    *const LaunchConfig,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;
