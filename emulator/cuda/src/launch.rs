//! Modules, their functions (kernels of the length their name says), and kernel launches.

use std::ffi::{CStr, c_char, c_uint, c_void};

use crate::driver::{guard, put, with};
use crate::{CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUresult, Handle, LaunchConfig};

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    guard(|| {
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = with(|d| {
            d.current_device()?;
            let id = d.id();
            d.modules.insert(id);
            Ok(id)
        })?;
        put(module, id as Handle)
    })
}

/// Any function name resolves; `sleep_<N>us` runs for N microseconds, anything else instantly.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleGetFunction(
    function: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    guard(|| {
        if name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null NUL-terminated string, as the API requires.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let run = name
            .strip_prefix("sleep_")
            .and_then(|n| n.strip_suffix("us"))
            .and_then(|n| n.parse().ok())
            .map_or(0, |us: u64| us * 1_000);
        let id = with(|d| {
            if !d.modules.contains(&(module as u64)) {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            let id = d.id();
            d.functions.insert(id, run);
            Ok(id)
        })?;
        put(function, id as Handle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    guard(|| {
        with(|d| {
            d.modules
                .remove(&(module as u64))
                .then_some(())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchKernel(
    function: Handle,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    stream: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    guard(|| with(|d| d.launch(function, stream)))
}

fn launch(function: Handle, stream: Handle) -> CUresult {
    guard(|| with(|d| d.launch(function, stream)))
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchKernel_ptsz(
    function: Handle,
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
) -> CUresult {
    let _ = (gx, gy, gz, bx, by, bz, shared, params, extra);
    launch(function, stream)
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchCooperativeKernel(
    function: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> CUresult {
    let _ = (gx, gy, gz, bx, by, bz, shared, params);
    launch(function, stream)
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the driver's signature
pub extern "C" fn cuLaunchCooperativeKernel_ptsz(
    function: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> CUresult {
    let _ = (gx, gy, gz, bx, by, bz, shared, params);
    launch(function, stream)
}

fn launch_ex(config: *const LaunchConfig, function: Handle) -> CUresult {
    guard(|| {
        if config.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null, pointing at the caller's CUlaunchConfig as the API requires.
        let stream = unsafe { (*config).stream };
        with(|d| d.launch(function, stream))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    function: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    launch_ex(config, function)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const LaunchConfig,
    function: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    launch_ex(config, function)
}
