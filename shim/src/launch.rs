//! Kernel launches of every kind — plain, cooperative, `cuLaunchKernelEx`, CUDA graphs — go
//! through the compute gate ([`crate::compute::gate`]), so none is a way around the slice's share.
//! Stream captures are followed so that launches recorded into a graph (which run nothing) pass.

use std::ffi::{c_int, c_uint, c_void};

use crate::compute::{capture_ended, capture_started, gate};
use gpuslice_contract::cuda::{
    Handle, LaunchConfig, LaunchCooperativeKernelFn, LaunchKernelExFn, LaunchKernelFn,
};

type Launch = LaunchKernelFn;

#[allow(clippy::too_many_arguments)] // the driver's signature
pub fn launch(
    real: Launch,
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    gate(stream, || unsafe {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
    })
}

type Cooperative = LaunchCooperativeKernelFn;

#[allow(clippy::too_many_arguments)] // the driver's signature
pub fn cooperative(
    real: Cooperative,
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    gate(stream, || unsafe {
        real(f, gx, gy, gz, bx, by, bz, shared, stream, params)
    })
}

/// `cuLaunchKernelEx`: a launch with its configuration in a struct, gated like the others.
pub fn launch_ex(
    real: LaunchKernelExFn,
    config: *const LaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int {
    let stream = if config.is_null() {
        std::ptr::null_mut()
    } else {
        // SAFETY: non-null, the caller's CUlaunchConfig (the driver reads it the same way).
        unsafe { (*config).stream }
    };
    // SAFETY: the program's call, forwarded unchanged.
    gate(stream, || unsafe { real(config, f, params, extra) })
}

pub fn graph(
    real: unsafe extern "C" fn(Handle, Handle) -> c_int,
    exec: Handle,
    stream: Handle,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    gate(stream, || unsafe { real(exec, stream) })
}

pub fn begin_capture(
    real: unsafe extern "C" fn(Handle, c_int) -> c_int,
    stream: Handle,
    mode: c_int,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(stream, mode) };
    if rc == 0 {
        capture_started(stream);
    }
    rc
}

pub fn end_capture(
    real: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    stream: Handle,
    graph: *mut Handle,
) -> c_int {
    // SAFETY: the program's call, forwarded unchanged.
    let rc = unsafe { real(stream, graph) };
    // A failed end (an invalidated capture) still ends it.
    capture_ended(stream);
    rc
}
